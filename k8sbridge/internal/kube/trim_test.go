package kube

import (
	"context"
	stdjson "encoding/json"
	"fmt"
	"reflect"
	goruntime "runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer/json"
	"k8s.io/apimachinery/pkg/runtime/serializer/protobuf"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/cache"
	"sigs.k8s.io/randfill"

	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
)

const (
	trimDriver = "bench.csibroker.io"
	trimClass  = "bench-retain"
	trimNS     = "prebound"
)

var trimManagedFields = []metav1.ManagedFieldsEntry{{
	Manager: "benchk8s", Operation: metav1.ManagedFieldsOperationUpdate, APIVersion: "v1", FieldsType: "FieldsV1",
	FieldsV1: metav1.NewFieldsV1(`{"f:spec":{"f:accessModes":{},"f:resources":{"f:requests":{".":{},"f:storage":{}}},"f:storageClassName":{},"f:volumeName":{}}}`),
}, {
	Manager: "kube-controller-manager", Operation: metav1.ManagedFieldsOperationUpdate, APIVersion: "v1", FieldsType: "FieldsV1", Subresource: "status",
	FieldsV1: metav1.NewFieldsV1(`{"f:status":{"f:accessModes":{},"f:capacity":{".":{},"f:storage":{}},"f:phase":{}}}`),
}}

// trimPair is pair i of test/benchk8s's memory scenario (createPrebound) as
// the API server returns it once kube-controller-manager has bound it: UIDs,
// resource versions, protection finalizers, defaulted volume modes, the full
// claimRef, bind-completed, Bound status, managedFields.
func trimPair(i int, created time.Time) (*corev1.PersistentVolume, *corev1.PersistentVolumeClaim) {
	name := fmt.Sprintf("pre-%06d", i)
	pvUID := types.UID(fmt.Sprintf("6b1f2c3d-%04x-4e5f-8a9b-%012x", i%0x10000, 2*i))
	claimUID := types.UID(fmt.Sprintf("6b1f2c3d-%04x-4e5f-8a9b-%012x", i%0x10000, 2*i+1))
	fs := corev1.PersistentVolumeFilesystem
	sc := trimClass
	ts := metav1.NewTime(created.Truncate(time.Second).Local())
	bound := metav1.NewTime(created.Add(time.Duration(i%3) * time.Second).Truncate(time.Second).Local())
	pv := &corev1.PersistentVolume{
		TypeMeta: metav1.TypeMeta{Kind: "PersistentVolume", APIVersion: "v1"},
		ObjectMeta: metav1.ObjectMeta{Name: name, UID: pvUID, ResourceVersion: fmt.Sprint(100000 + 3*i), CreationTimestamp: ts,
			Annotations:   map[string]string{AnnProvisionedBy: trimDriver},
			Finalizers:    []string{"kubernetes.io/pv-protection"},
			ManagedFields: trimManagedFields},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			StorageClassName:              trimClass,
			VolumeMode:                    &fs,
			ClaimRef: &corev1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: trimNS, Name: name,
				UID: claimUID, ResourceVersion: fmt.Sprint(100000 + 3*i + 1)},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: trimDriver, VolumeHandle: name, FSType: "ext4",
				VolumeAttributes: map[string]string{"storage.kubernetes.io/csiProvisionerIdentity": "bench"},
			}},
		},
		Status: corev1.PersistentVolumeStatus{Phase: corev1.VolumeBound, LastPhaseTransitionTime: &bound},
	}
	pvc := &corev1.PersistentVolumeClaim{
		TypeMeta: metav1.TypeMeta{Kind: "PersistentVolumeClaim", APIVersion: "v1"},
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: trimNS, UID: claimUID, ResourceVersion: fmt.Sprint(100000 + 3*i + 2), CreationTimestamp: ts,
			Annotations:   map[string]string{"pv.kubernetes.io/bind-completed": "yes"},
			Finalizers:    []string{"kubernetes.io/pvc-protection"},
			ManagedFields: trimManagedFields},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
			VolumeName:       name,
			StorageClassName: &sc,
			VolumeMode:       &fs,
		},
		Status: corev1.PersistentVolumeClaimStatus{
			Phase:       corev1.ClaimBound,
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Capacity:    corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
		},
	}
	return pv, pvc
}

// wireCodec encodes objects as the API server sends them and decodes them
// as client-go does: fresh strings, maps and slices per object, type meta
// cleared.
type wireCodec struct {
	name  string
	codec runtime.Serializer
}

func wireCodecs() []wireCodec {
	return []wireCodec{
		{"json", json.NewSerializerWithOptions(json.DefaultMetaFactory, scheme.Scheme, scheme.Scheme, json.SerializerOptions{})},
		{"protobuf", protobuf.NewSerializer(scheme.Scheme, scheme.Scheme)},
	}
}

func (w wireCodec) encode(tb testing.TB, obj runtime.Object) []byte {
	tb.Helper()
	b, err := runtime.Encode(w.codec, obj)
	if err != nil {
		tb.Fatalf("%s encode: %v", w.name, err)
	}
	return b
}

func (w wireCodec) decode(tb testing.TB, data []byte, into runtime.Object) runtime.Object {
	tb.Helper()
	obj, _, err := w.codec.Decode(data, nil, into)
	if err != nil {
		tb.Fatalf("%s decode: %v", w.name, err)
	}
	obj.GetObjectKind().SetGroupVersionKind(schema.GroupVersionKind{})
	return obj
}

// pointers lists the address of every string, map, slice and pointer in v,
// depth first: equal lists mean nothing in v was replaced.
func pointers(v any) []uintptr {
	var out []uintptr
	var walk func(reflect.Value)
	walk = func(v reflect.Value) {
		switch v.Kind() {
		case reflect.String:
			s := v.String()
			out = append(out, uintptr(unsafe.Pointer(unsafe.StringData(s))))
		case reflect.Pointer, reflect.Interface:
			if v.Kind() == reflect.Pointer {
				out = append(out, v.Pointer())
			}
			if !v.IsNil() {
				walk(v.Elem())
			}
		case reflect.Map:
			out = append(out, v.Pointer())
			keys := v.MapKeys()
			slices.SortFunc(keys, func(a, b reflect.Value) int { return strings.Compare(fmt.Sprint(a), fmt.Sprint(b)) })
			for _, k := range keys {
				walk(k)
				walk(v.MapIndex(k))
			}
		case reflect.Slice:
			out = append(out, v.Pointer(), uintptr(v.Len()), uintptr(v.Cap()))
			for i := range v.Len() {
				walk(v.Index(i))
			}
		case reflect.Array:
			for i := range v.Len() {
				walk(v.Index(i))
			}
		case reflect.Struct:
			for i := range v.NumField() {
				walk(v.Field(i))
			}
		}
	}
	walk(reflect.ValueOf(v))
	return out
}

// sameObject fails unless got and want are the same object for every
// reader (semantic equality, as the controllers compare) and on the wire
// (what an Update of a DeepCopy sends).
func sameObject(t *testing.T, want, got any) {
	t.Helper()
	if !apiequality.Semantic.DeepEqual(want, got) {
		t.Fatalf("object changed (-want +got):\n%s", cmp.Diff(want, got, cmp.Exporter(func(reflect.Type) bool { return true })))
	}
	wj, err := stdjson.Marshal(want)
	if err != nil {
		t.Fatal(err)
	}
	gj, err := stdjson.Marshal(got)
	if err != nil {
		t.Fatal(err)
	}
	if string(wj) != string(gj) {
		t.Fatalf("wire form changed:\nwant %s\ngot  %s", wj, gj)
	}
}

// fullVolume is a PV with every field the broker may meet set.
func fullVolume() *corev1.PersistentVolume {
	pv, _ := trimPair(7, time.Unix(1700000000, 0))
	pv.Labels = map[string]string{"app": "db", "tier": "a\x00b"}
	pv.Annotations[AnnDeletionSecretName] = "s"
	pv.Annotations[AnnDeletionSecretNS] = "ns"
	pv.Annotations[AnnVolumeNode] = "node-1"
	pv.OwnerReferences = []metav1.OwnerReference{{APIVersion: "v1", Kind: "ConfigMap", Name: "o", UID: "u"}}
	pv.Finalizers = append(pv.Finalizers, FinalizerVolume, "external-attacher/bench-csibroker-io") // external-attacher's for trimDriver
	pv.Spec.MountOptions = []string{"noatime", "discard"}
	vac := "gold"
	pv.Spec.VolumeAttributesClassName = &vac
	pv.Spec.NodeAffinity = &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
		MatchExpressions: []corev1.NodeSelectorRequirement{{Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpIn, Values: []string{"node-1"}}}}}}}
	pv.Spec.CSI.ReadOnly = true
	pv.Spec.CSI.ControllerPublishSecretRef = &corev1.SecretReference{Name: "pub", Namespace: "ns"}
	pv.Spec.CSI.NodeStageSecretRef = &corev1.SecretReference{Name: "stage", Namespace: "ns"}
	pv.Spec.CSI.NodePublishSecretRef = &corev1.SecretReference{Name: "pub", Namespace: "ns"}
	pv.Spec.CSI.ControllerExpandSecretRef = &corev1.SecretReference{Name: "expand", Namespace: "ns"}
	pv.Spec.CSI.NodeExpandSecretRef = &corev1.SecretReference{Name: "nexpand", Namespace: "ns"}
	pv.Status.Reason, pv.Status.Message = "Failed", "it failed"
	gone := metav1.Unix(1700000100, 0)
	pv.DeletionTimestamp = &gone
	return pv
}

// fullClaim is a claim with every field the broker may meet set.
func fullClaim() *corev1.PersistentVolumeClaim {
	_, pvc := trimPair(7, time.Unix(1700000000, 0))
	pvc.Labels = map[string]string{"app": "db"}
	pvc.Annotations[AnnStorageProvisioner] = trimDriver
	pvc.Annotations[AnnBetaStorageProvisioner] = trimDriver
	pvc.Annotations[AnnSelectedNode] = "node-1"
	pvc.Annotations[AnnStorageResizer] = trimDriver
	pvc.Spec.Selector = &metav1.LabelSelector{MatchLabels: map[string]string{"disk": "fast"}}
	pvc.Spec.Resources.Limits = corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("2Gi")}
	pvc.Spec.Resources.Requests[corev1.ResourceStorage] = resource.MustParse("1536Mi")
	pvc.Spec.DataSource = &corev1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: "src"}
	pvc.Spec.DataSourceRef = &corev1.TypedObjectReference{Kind: "PersistentVolumeClaim", Name: "src"}
	vac := "gold"
	pvc.Spec.VolumeAttributesClassName = &vac
	pvc.Status.AllocatedResources = corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1536Mi")}
	pvc.Status.AllocatedResourceStatuses = map[corev1.ResourceName]corev1.ClaimResourceStatus{
		corev1.ResourceStorage: corev1.PersistentVolumeClaimControllerResizeInProgress}
	pvc.Status.Conditions = []corev1.PersistentVolumeClaimCondition{
		{Type: corev1.PersistentVolumeClaimResizing, Status: corev1.ConditionTrue, LastTransitionTime: metav1.Unix(1700000000, 0), Message: "m"}}
	pvc.Status.CurrentVolumeAttributesClassName = &vac
	pvc.Status.ModifyVolumeStatus = &corev1.ModifyVolumeStatus{TargetVolumeAttributesClassName: "gold", Status: corev1.PersistentVolumeClaimModifyVolumeInProgress}
	return pvc
}

func withoutManagedFields[T interface {
	SetManagedFields([]metav1.ManagedFieldsEntry)
}](o T) T {
	o.SetManagedFields(nil)
	return o
}

func TestStripBulk(t *testing.T) {
	trimmed := func(s *sharer, o any) any {
		out, err := s.transform(o)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n", Labels: map[string]string{"zone": "a"},
		Annotations: map[string]string{AnnNodeIDs: `{"d":"n"}`}, ManagedFields: trimManagedFields}}
	cases := []struct {
		name string
		// in makes the object; the sharer has seen the objects of seen first.
		in   func(s *sharer) any
		seen func() []any
		want func() any
		// untouched: nothing in the object may be replaced, not even by an
		// equal shared value.
		untouched bool
	}{{
		name: "volume: every field kept, managedFields dropped",
		in:   func(*sharer) any { return fullVolume() },
		want: func() any { return withoutManagedFields(fullVolume()) },
	}, {
		name: "claim: every field kept, managedFields dropped",
		in:   func(*sharer) any { return fullClaim() },
		want: func() any { return withoutManagedFields(fullClaim()) },
	}, {
		name: "volume equal to one seen before: every field kept",
		in:   func(*sharer) any { return fullVolume() },
		seen: func() []any { return []any{fullVolume(), fullClaim()} },
		want: func() any { return withoutManagedFields(fullVolume()) },
	}, {
		name: "claim equal to one seen before: every field kept",
		in:   func(*sharer) any { return fullClaim() },
		seen: func() []any { return []any{fullVolume(), fullClaim()} },
		want: func() any { return withoutManagedFields(fullClaim()) },
	}, {
		name: "volume without optional fields: nil stays nil, empty stays empty",
		in: func(*sharer) any {
			return &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "bare", Labels: map[string]string{}},
				Spec: corev1.PersistentVolumeSpec{AccessModes: []corev1.PersistentVolumeAccessMode{}}}
		},
		want: func() any {
			return &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "bare", Labels: map[string]string{}},
				Spec: corev1.PersistentVolumeSpec{AccessModes: []corev1.PersistentVolumeAccessMode{}}}
		},
	}, {
		name:      "volume already trimmed: unchanged, nothing written",
		in:        func(s *sharer) any { return trimmed(s, fullVolume()) },
		want:      func() any { return withoutManagedFields(fullVolume()) },
		untouched: true,
	}, {
		name:      "claim already trimmed: unchanged, nothing written",
		in:        func(s *sharer) any { return trimmed(s, fullClaim()) },
		want:      func() any { return withoutManagedFields(fullClaim()) },
		untouched: true,
	}, {
		name:      "node: only managedFields dropped",
		in:        func(*sharer) any { return withoutManagedFields(node.DeepCopy()) },
		want:      func() any { return withoutManagedFields(node.DeepCopy()) },
		untouched: true,
	}, {
		name: "node with managedFields: they are dropped",
		in:   func(*sharer) any { return node.DeepCopy() },
		want: func() any { return withoutManagedFields(node.DeepCopy()) },
	}, {
		name: "volume attachment: untouched",
		in: func(*sharer) any {
			return &storagev1.VolumeAttachment{ObjectMeta: metav1.ObjectMeta{Name: "va", Annotations: map[string]string{AnnVANodeID: "n"}}}
		},
		want: func() any {
			return &storagev1.VolumeAttachment{ObjectMeta: metav1.ObjectMeta{Name: "va", Annotations: map[string]string{AnnVANodeID: "n"}}}
		},
		untouched: true,
	}, {
		name: "tombstone: passed as it is (its object was transformed when cached)",
		in: func(*sharer) any {
			return cache.DeletedFinalStateUnknown{Key: "prebound/pre-000007", Obj: fullClaim()}
		},
		want:      func() any { return cache.DeletedFinalStateUnknown{Key: "prebound/pre-000007", Obj: fullClaim()} },
		untouched: true,
	}, {
		name:      "not an object: passed as it is",
		in:        func(*sharer) any { return "x" },
		want:      func() any { return "x" },
		untouched: true,
	}}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := newSharer()
			if tc.seen != nil {
				for _, o := range tc.seen() {
					trimmed(s, o)
				}
			}
			in := tc.in(s)
			before := pointers(in)
			got := trimmed(s, in)
			if reflect.ValueOf(got).Kind() == reflect.Pointer && reflect.ValueOf(got).Pointer() != reflect.ValueOf(in).Pointer() {
				t.Fatal("transform returned another object; it works in place")
			}
			sameObject(t, tc.want(), got)
			if tc.untouched && !slices.Equal(before, pointers(got)) {
				t.Fatal("transform replaced values of an object it must leave as it is")
			}
		})
	}
}

// TestStripBulkServerObjects: a pair made as test/benchk8s makes them and
// bound by the real kube-controller-manager is what trimPair (the
// benchmark's fixture) says, field for field, and the transform keeps every
// field of it but managedFields.
func TestStripBulkServerObjects(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "trim"), trimDriver, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimRetain, nil)
	pvName, name := kubetest.ClusterName(ns, "pre-000007"), "pre-000007"
	// As createPrebound in test/benchk8s/objects.go.
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: pvName, Annotations: map[string]string{AnnProvisionedBy: trimDriver}},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			StorageClassName:              class.Name,
			ClaimRef:                      &corev1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: ns, Name: name},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: trimDriver, VolumeHandle: pvName, FSType: "ext4",
				VolumeAttributes: map[string]string{"storage.kubernetes.io/csiProvisionerIdentity": "bench"},
			}},
		},
	}
	if _, err := c.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.CoreV1().PersistentVolumes().Delete(context.Background(), pvName, metav1.DeleteOptions{}) })
	sc := class.Name
	claim := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			StorageClassName: &sc,
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
			VolumeName:       pvName,
		},
	}
	if _, err := c.CoreV1().PersistentVolumeClaims(ns).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	gotClaim := kubetest.WaitBound(t, c, ns, name, 60*time.Second)
	gotPV, err := c.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(gotPV.ManagedFields) == 0 || len(gotClaim.ManagedFields) == 0 {
		t.Fatal("the server sent no managedFields")
	}

	// The fixture with what is the objects' own (names, UIDs, versions, times).
	wantPV, wantClaim := trimPair(7, time.Now())
	wantPV.TypeMeta, wantClaim.TypeMeta = metav1.TypeMeta{}, metav1.TypeMeta{}
	wantPV.Name, wantPV.UID, wantPV.ResourceVersion, wantPV.CreationTimestamp = gotPV.Name, gotPV.UID, gotPV.ResourceVersion, gotPV.CreationTimestamp
	wantPV.Spec.StorageClassName, wantPV.Spec.CSI.VolumeHandle = class.Name, pvName
	wantPV.Status.LastPhaseTransitionTime = gotPV.Status.LastPhaseTransitionTime
	if r := gotPV.Spec.ClaimRef; r != nil {
		wantPV.Spec.ClaimRef.Namespace, wantPV.Spec.ClaimRef.UID, wantPV.Spec.ClaimRef.ResourceVersion = r.Namespace, r.UID, r.ResourceVersion
	}
	wantClaim.Namespace, wantClaim.UID, wantClaim.ResourceVersion, wantClaim.CreationTimestamp = ns, gotClaim.UID, gotClaim.ResourceVersion, gotClaim.CreationTimestamp
	wantClaim.Spec.VolumeName, wantClaim.Spec.StorageClassName = pvName, &sc
	sameObject(t, withoutManagedFields(wantPV), withoutManagedFields(gotPV.DeepCopy()))
	sameObject(t, withoutManagedFields(wantClaim), withoutManagedFields(gotClaim.DeepCopy()))

	s := newSharer()
	for _, obj := range []interface {
		runtime.Object
		SetManagedFields([]metav1.ManagedFieldsEntry)
	}{gotPV, gotClaim} {
		got, err := s.transform(obj.DeepCopyObject())
		if err != nil {
			t.Fatal(err)
		}
		obj.SetManagedFields(nil)
		sameObject(t, obj, got)
	}
}

// TestStripBulkShares: decoded pairs end up sharing their equal values, with
// no spare capacity in shared slices; DeepCopy gives a writable object that
// does not write into the others.
func TestStripBulkShares(t *testing.T) {
	for _, w := range wireCodecs() {
		t.Run(w.name, func(t *testing.T) {
			s := newSharer()
			created := time.Unix(1700000000, 0)
			var pvs []*corev1.PersistentVolume
			var pvcs []*corev1.PersistentVolumeClaim
			for i := range 3 {
				pv, pvc := trimPair(i, created)
				o, _ := s.transform(w.decode(t, w.encode(t, pv), &corev1.PersistentVolume{}))
				pvs = append(pvs, o.(*corev1.PersistentVolume))
				o, _ = s.transform(w.decode(t, w.encode(t, pvc), &corev1.PersistentVolumeClaim{}))
				pvcs = append(pvcs, o.(*corev1.PersistentVolumeClaim))
			}
			a, b := pvs[0], pvs[1]
			same := func(what string, x, y any) {
				t.Helper()
				if reflect.ValueOf(x).Pointer() != reflect.ValueOf(y).Pointer() {
					t.Errorf("%s not shared", what)
				}
			}
			same("PV annotations", a.Annotations, b.Annotations)
			same("PV capacity", a.Spec.Capacity, b.Spec.Capacity)
			same("PV access modes", a.Spec.AccessModes, pvcs[0].Spec.AccessModes)
			same("PV finalizers", a.Finalizers, b.Finalizers)
			same("PV volume mode", a.Spec.VolumeMode, pvcs[2].Spec.VolumeMode)
			same("volume attributes", a.Spec.CSI.VolumeAttributes, b.Spec.CSI.VolumeAttributes)
			same("claim requests and capacity", pvcs[0].Spec.Resources.Requests, pvcs[1].Status.Capacity)
			same("claim annotations", pvcs[0].Annotations, pvcs[2].Annotations)
			same("claim class", pvcs[0].Spec.StorageClassName, pvcs[1].Spec.StorageClassName)
			if unsafe.StringData(a.Spec.CSI.Driver) != unsafe.StringData(b.Spec.CSI.Driver) ||
				unsafe.StringData(a.Spec.ClaimRef.Namespace) != unsafe.StringData(pvcs[1].Namespace) {
				t.Error("equal strings not shared")
			}
			if unsafe.StringData(a.Name) == unsafe.StringData(pvcs[0].Name) {
				t.Error("names are the object's own and should not go through the tables")
			}
			if cap(a.Finalizers) != len(a.Finalizers) || cap(a.Spec.AccessModes) != len(a.Spec.AccessModes) {
				t.Error("shared slices have spare capacity: an append would write into other objects")
			}

			cp := a.DeepCopy()
			cp.Annotations["x"] = "y"
			cp.Finalizers = append(cp.Finalizers, "f")
			cp.Spec.Capacity[corev1.ResourceStorage] = resource.MustParse("5Gi")
			*cp.Spec.VolumeMode = corev1.PersistentVolumeBlock
			want, _ := trimPair(1, created)
			want.TypeMeta = metav1.TypeMeta{}
			sameObject(t, withoutManagedFields(want), b)
		})
	}
}

// TestStripBulkNeverMixesValues: many objects whose values are drawn from
// a few keys and values, some differing only by where a NUL or a key ends,
// go through one sharer; at the end every object is still equal to its
// original (nothing shared across different contents, nothing written into
// an object transformed earlier).
func TestStripBulkNeverMixesValues(t *testing.T) {
	words := []string{"", "a", "b", "ab", "a\x00b", "\x00", "a\x00", "ReadWriteOnce", "1", "\x01b"}
	word := func(c randfill.Continue) string { return words[c.Intn(len(words))] }
	f := randfill.New().NilChance(0.3).NumElements(0, 3).Funcs(
		func(s *string, c randfill.Continue) { *s = word(c) },
		func(m *corev1.PersistentVolumeAccessMode, c randfill.Continue) {
			*m = corev1.PersistentVolumeAccessMode(word(c))
		},
		func(m *corev1.ResourceName, c randfill.Continue) { *m = corev1.ResourceName(word(c)) },
		func(q *resource.Quantity, c randfill.Continue) {
			*q = []resource.Quantity{resource.MustParse("1Gi"), resource.MustParse("1024Mi"), resource.MustParse("1073741824"),
				resource.MustParse("1G"), resource.MustParse("0"), resource.MustParse("1.5"), resource.MustParse("100m")}[c.Intn(7)]
		},
		func(tm *metav1.Time, c randfill.Continue) {
			*tm = metav1.Unix(1700000000+c.Int63n(3), 0)
			if c.Intn(4) == 0 {
				*tm = metav1.NewTime(tm.UTC())
			}
		},
		func(f *metav1.FieldsV1, c randfill.Continue) { f.SetRawBytes([]byte(`{}`)) },
	)
	s := newSharer()
	type pair struct{ orig, got any }
	var all []pair
	for range 2000 {
		pv, pvc := &corev1.PersistentVolume{}, &corev1.PersistentVolumeClaim{}
		f.Fill(pv)
		f.Fill(pvc)
		for _, o := range []interface {
			runtime.Object
			SetManagedFields([]metav1.ManagedFieldsEntry)
		}{pv, pvc} {
			in := o.DeepCopyObject()
			got, err := s.transform(in)
			if err != nil {
				t.Fatal(err)
			}
			o.SetManagedFields(nil)
			all = append(all, pair{o, got})
		}
	}
	for _, p := range all {
		sameObject(t, p.orig, p.got)
	}
}

// TestStripBulkConcurrent: informers transform from their own goroutines.
func TestStripBulkConcurrent(t *testing.T) {
	s := newSharer()
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 200 {
				pv, pvc := trimPair(g*1000+i, time.Unix(1700000000, 0))
				s.transform(pv)
				s.transform(pvc)
				if pv.Annotations[AnnProvisionedBy] != trimDriver || pvc.Status.Capacity.Storage().String() != "1Gi" {
					t.Error("wrong shared value")
					return
				}
			}
		})
	}
	wg.Wait()
}

// BenchmarkCachePerPair measures what the broker's PV and claim caches hold
// per pair: 10,000 pairs shaped as test/benchk8s's memory scenario makes
// them (trimPair) are decoded from their wire form, transformed, and kept
// in indexers like the shared informers' (namespace index). Metrics: Go
// heap in use and live heap (runtime.ReadMemStats after runtime.GC) per
// pair, and the transform's time per object. "managedfields" is the
// transform before sharing (managedFields dropped only), "shared" is
// StripBulk. Run: go test -run='^$' -bench=CachePerPair ./k8sbridge/internal/kube/
func BenchmarkCachePerPair(b *testing.B) {
	const pairs = 10000
	created := time.Now()
	for _, w := range wireCodecs() {
		pvs, pvcs := make([][]byte, pairs), make([][]byte, pairs)
		for i := range pairs {
			pv, pvc := trimPair(i, created)
			pvs[i], pvcs[i] = w.encode(b, pv), w.encode(b, pvc)
		}
		modes := []struct {
			name      string
			transform func() cache.TransformFunc
		}{
			{"managedfields", func() cache.TransformFunc {
				return func(o any) (any, error) { dropManagedFields(o); return o, nil }
			}},
			{"shared", func() cache.TransformFunc { return newSharer().transform }},
		}
		for _, m := range modes {
			b.Run(w.name+"/"+m.name, func(b *testing.B) {
				var inuse, live, took float64
				for range b.N {
					r := cachePairs(b, w, pvs, pvcs, m.transform())
					inuse += r.inuse
					live += r.live
					took += float64(r.transform.Nanoseconds())
				}
				n := float64(b.N)
				b.ReportMetric(inuse/n/pairs/1024, "heap-inuse-KiB/pair")
				b.ReportMetric(live/n/pairs/1024, "heap-live-KiB/pair")
				b.ReportMetric(took/n/(2*pairs), "transform-ns/object")
			})
		}
	}
}

type cacheMeasure struct {
	inuse, live float64
	transform   time.Duration
}

func cachePairs(b *testing.B, w wireCodec, pvs, pvcs [][]byte, transform cache.TransformFunc) cacheMeasure {
	var before, after goruntime.MemStats
	goruntime.GC()
	goruntime.ReadMemStats(&before)
	indexers := cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc}
	volumes := cache.NewIndexer(cache.DeletionHandlingMetaNamespaceKeyFunc, indexers)
	claims := cache.NewIndexer(cache.DeletionHandlingMetaNamespaceKeyFunc, indexers)
	var took time.Duration
	add := func(store cache.Indexer, data []byte, into runtime.Object) {
		obj := w.decode(b, data, into)
		start := time.Now()
		out, err := transform(obj)
		took += time.Since(start)
		if err != nil {
			b.Fatal(err)
		}
		if err := store.Add(out); err != nil {
			b.Fatal(err)
		}
	}
	for i := range pvs {
		add(volumes, pvs[i], &corev1.PersistentVolume{})
		add(claims, pvcs[i], &corev1.PersistentVolumeClaim{})
	}
	goruntime.GC()
	goruntime.ReadMemStats(&after)
	if len(volumes.ListKeys()) != len(pvs) || len(claims.ListKeys()) != len(pvcs) {
		b.Fatal("objects missing from the caches")
	}
	goruntime.KeepAlive(volumes)
	goruntime.KeepAlive(claims)
	return cacheMeasure{
		inuse:     float64(after.HeapInuse) - float64(before.HeapInuse),
		live:      float64(after.HeapAlloc) - float64(before.HeapAlloc),
		transform: took,
	}
}
