// Package kubetest holds what the tests of k8sbridge's packages share: the
// real control plane (skipped under -short), CRDs, Events.
//
// Only tests import it.
package kubetest

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/policy"
)

// ControlPlane is the package's shared control plane (testenv.Shared). A
// test that needs one is not fast: under -short it is skipped, so that
// go test -short runs the fast tier alone.
func ControlPlane(t testing.TB) *testenv.Env {
	t.Helper()
	if testing.Short() {
		t.Skip("needs the real control plane (skipped with -short)")
	}
	return testenv.Shared(t)
}

// CRDs is where CustomResourceDefinitions are created and read.
var CRDs = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// CreateCRD creates crd (if it is not there yet) and waits until gvr is
// served.
func CreateCRD(t *testing.T, env *testenv.Env, crd *unstructured.Unstructured, gvr schema.GroupVersionResource) {
	t.Helper()
	const wait = 30 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	dyn := dynamic.NewForConfigOrDie(env.RESTConfig())
	if _, err := dyn.Resource(CRDs).Create(ctx, crd, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("create CRD %s: %v", crd.GetName(), err)
	}
	err := testenv.WaitFor(ctx, wait, "CRD "+crd.GetName()+" established and served", func(ctx context.Context) (bool, string, error) {
		got, err := dyn.Resource(CRDs).Get(ctx, crd.GetName(), metav1.GetOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		conds, _, _ := unstructured.NestedSlice(got.Object, "status", "conditions")
		established := false
		for _, c := range conds {
			if m, ok := c.(map[string]any); ok && m["type"] == "Established" && m["status"] == "True" {
				established = true
			}
		}
		if !established {
			return false, fmt.Sprintf("conditions %v", conds), nil
		}
		if _, err := dyn.Resource(gvr).List(ctx, metav1.ListOptions{Limit: 1}); err != nil {
			return false, "established; list: " + err.Error(), nil
		}
		return true, "", nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// ClusterName is s made unique to the test's namespace ns (for
// cluster-scoped objects and driver names).
func ClusterName(ns, s string) string { return ns + "-" + s }

// EventsOf lists the Events on object name in ns, one a line.
func EventsOf(c kubernetes.Interface, ns, name string) string {
	evs, err := c.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + name})
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, e := range evs.Items {
		fmt.Fprintf(&b, "\n  %s %s: %s", e.Type, e.Reason, e.Message)
	}
	return b.String()
}

// WaitEvent waits for an Event with reason on object name whose message
// contains want.
func WaitEvent(t *testing.T, c kubernetes.Interface, ns, name, reason, want string) corev1.Event {
	t.Helper()
	var found corev1.Event
	err := testenv.WaitFor(context.Background(), 30*time.Second, fmt.Sprintf("event %s on %s containing %q", reason, name, want), func(ctx context.Context) (bool, string, error) {
		evs, err := c.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + name})
		if err != nil {
			return false, err.Error(), nil
		}
		for _, e := range evs.Items {
			if e.Reason == reason && strings.Contains(e.Message, want) {
				found = e
				return true, "", nil
			}
		}
		return false, EventsOf(c, ns, name), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return found
}

func MakeClass(t *testing.T, c kubernetes.Interface, name, driver string, mode storagev1.VolumeBindingMode, reclaim corev1.PersistentVolumeReclaimPolicy, params map[string]string) *storagev1.StorageClass {
	t.Helper()
	sc := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Provisioner: driver, VolumeBindingMode: &mode, ReclaimPolicy: &reclaim, Parameters: params}
	sc, err := c.StorageV1().StorageClasses().Create(context.Background(), sc, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.StorageV1().StorageClasses().Delete(context.Background(), name, metav1.DeleteOptions{}) })
	return sc
}

func MakeClaim(t *testing.T, c kubernetes.Interface, ns, name, class, size string) *corev1.PersistentVolumeClaim {
	t.Helper()
	return MakeClaimWith(t, c, ns, name, class, func(p *corev1.PersistentVolumeClaim) {
		p.Spec.Resources.Requests[corev1.ResourceStorage] = resource.MustParse(size)
	})
}

// MakeClaimWith creates a 1Gi claim of class, changed by mut first.
func MakeClaimWith(t *testing.T, c kubernetes.Interface, ns, name, class string, mut func(*corev1.PersistentVolumeClaim)) *corev1.PersistentVolumeClaim {
	t.Helper()
	size := "1Gi"
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{"app": "test"}},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			StorageClassName: &class,
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(size)}},
		},
	}
	mut(pvc)
	pvc, err := c.CoreV1().PersistentVolumeClaims(ns).Create(context.Background(), pvc, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pvc
}

func MakePod(t *testing.T, c kubernetes.Interface, ns, name, claim string) {
	t.Helper()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.PodSpec{
			Containers: []corev1.Container{{Name: "c", Image: "busybox", Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("10m")}},
				VolumeMounts: []corev1.VolumeMount{{Name: "v", MountPath: "/data"}}}},
			Volumes: []corev1.Volume{{Name: "v", VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}},
		},
	}
	if _, err := c.CoreV1().Pods(ns).Create(context.Background(), pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func WaitBound(t *testing.T, c kubernetes.Interface, ns, name string, timeout time.Duration) *corev1.PersistentVolumeClaim {
	t.Helper()
	var pvc *corev1.PersistentVolumeClaim
	err := testenv.WaitFor(context.Background(), timeout, "claim "+ns+"/"+name+" Bound", func(ctx context.Context) (bool, string, error) {
		var err error
		pvc, err = c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		return pvc.Status.Phase == corev1.ClaimBound, string(pvc.Status.Phase) + " " + fmt.Sprint(pvc.Annotations), nil
	})
	if err != nil {
		t.Fatalf("%v\nevents: %s", err, EventsOf(c, ns, name))
	}
	return pvc
}

// WaitPV waits until cond holds for PV name, asked of the API server; cond
// gets nil once the PV is gone and returns what to report while waiting.
func WaitPV(t *testing.T, c kubernetes.Interface, name, what string, timeout time.Duration, cond func(*corev1.PersistentVolume) (bool, string)) {
	t.Helper()
	err := testenv.WaitFor(context.Background(), timeout, "PV "+name+": "+what, func(ctx context.Context) (bool, string, error) {
		pv, err := c.CoreV1().PersistentVolumes().Get(ctx, name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			pv = nil
		case err != nil:
			return false, err.Error(), nil
		}
		ok, seen := cond(pv)
		return ok, seen, nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// WaitPVGone waits until PV name no longer exists.
func WaitPVGone(t *testing.T, c kubernetes.Interface, name string, timeout time.Duration) {
	t.Helper()
	WaitPV(t, c, name, "gone", timeout, func(pv *corev1.PersistentVolume) (bool, string) {
		if pv == nil {
			return true, ""
		}
		return false, fmt.Sprintf("finalizers %v, phase %s", pv.Finalizers, pv.Status.Phase)
	})
}

// CreatePasswordSecrets creates Secrets names in namespace ns, each with
// key "password" set to password (a test's canary).
func CreatePasswordSecrets(t *testing.T, c kubernetes.Interface, ns, password string, names ...string) {
	t.Helper()
	for _, name := range names {
		if _, err := c.CoreV1().Secrets(ns).Create(context.Background(), &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
			StringData: map[string]string{"password": password}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

// GrantsAuthorizer is a policy of grants alone, in enforce mode; an
// invalid grant fails the test.
func GrantsAuthorizer(t *testing.T, grants ...policy.Grant) *policy.Authorizer {
	t.Helper()
	rs, errs := policy.Compile(grants)
	if len(errs) != 0 {
		t.Fatal(errs)
	}
	return &policy.Authorizer{Rules: policy.NewStore(rs)}
}

// ClaimCondition is c's condition of type typ, nil if it has none.
func ClaimCondition(c *corev1.PersistentVolumeClaim, typ corev1.PersistentVolumeClaimConditionType) *corev1.PersistentVolumeClaimCondition {
	for i := range c.Status.Conditions {
		if c.Status.Conditions[i].Type == typ {
			return &c.Status.Conditions[i]
		}
	}
	return nil
}

// HasClaimCondition reports whether c has a true condition of type typ.
func HasClaimCondition(c *corev1.PersistentVolumeClaim, typ corev1.PersistentVolumeClaimConditionType) bool {
	cond := ClaimCondition(c, typ)
	return cond != nil && cond.Status == corev1.ConditionTrue
}
