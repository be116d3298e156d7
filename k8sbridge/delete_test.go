package k8sbridge

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
	"github.com/csibroker/csibroker/k8sbridge/provision"
	"github.com/csibroker/csibroker/policy"
)

// TestDeletionBlockedByAttachment: a Released PV whose volume is still
// attached is not deleted (an Event says why); once detached it is.
func TestDeletionBlockedByAttachment(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "att.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "att"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})
	claim := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second)
	pvName := claim.Spec.VolumeName

	vaName := kubetest.ClusterName(ns, "va")
	va := &storagev1.VolumeAttachment{ObjectMeta: metav1.ObjectMeta{Name: vaName},
		Spec: storagev1.VolumeAttachmentSpec{Attacher: drv, NodeName: "some-node", Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &pvName}}}
	if _, err := c.StorageV1().VolumeAttachments().Create(ctx, va, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.StorageV1().VolumeAttachments().Delete(context.Background(), vaName, metav1.DeleteOptions{}) })
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "data", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitEvent(t, c, "default", pvName, "VolumeFailedDelete", "still attached to node some-node")
	if len(d.Volumes()) != 1 || d.CallCount("DeleteVolume") != 0 {
		t.Fatalf("volume deleted while attached: %+v", d.Calls())
	}
	if err := c.StorageV1().VolumeAttachments().Delete(ctx, vaName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitPVGone(t, c, pvName, 60*time.Second)
	if n := len(d.Volumes()); n != 0 {
		t.Fatalf("%d volumes left", n)
	}
}

// TestCloneFromClaim: a claim whose dataSource is a bound claim of the same
// driver gets a volume cloned from the source volume, when it asks for as
// much as the source claim did, though the source volume is larger (its
// driver rounded the size up).
func TestCloneFromClaim(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "clone.csi.test")
	drivers := newCountingDrivers()
	drivers.rewriteReply("CreateVolume", func(n int, reply any) {
		if n == 1 { // the source: rounded up to twice its request
			reply.(*csi.CreateVolumeResponse).GetVolume().CapacityBytes *= 2
		}
	})
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "clone"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})
	src := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "src", class.Name, "1Gi").Name, 60*time.Second)
	srcPV, err := c.CoreV1().PersistentVolumes().Get(context.Background(), src.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	clone := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "copy", Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}, StorageClassName: &class.Name,
			Resources:  corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: src.Spec.Resources.Requests[corev1.ResourceStorage]}},
			DataSource: &corev1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: "src"},
		},
	}
	if _, err := c.CoreV1().PersistentVolumeClaims(ns).Create(context.Background(), clone, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	bound := kubetest.WaitBound(t, c, ns, "copy", 60*time.Second)
	for _, r := range d.CreateVolumeRequests() {
		if r.GetName() == bound.Spec.VolumeName {
			if got := r.GetVolumeContentSource().GetVolume().GetVolumeId(); got != srcPV.Spec.CSI.VolumeHandle {
				t.Fatalf("clone source %q, want %q", got, srcPV.Spec.CSI.VolumeHandle)
			}
			return
		}
	}
	t.Fatal("the driver saw no CreateVolume for the clone")
}

// TestCloneSourceKeptUntilItsCloneIsMade: the source of a clone gets
// external-provisioner's cloning-protection finalizer before the driver is
// asked to copy it; deleted while the copy is in progress, it stays (with
// its volume) until the clone is bound, and then goes.
func TestCloneSourceKeptUntilItsCloneIsMade(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "cp.csi.test")
	drivers := newCountingDrivers()
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "cp"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	r := startBridge(t, env, ns, drivers, bridgeOpts{})
	src := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "src", class.Name, "1Gi").Name, 60*time.Second)

	letGo := drivers.hold("CreateVolume")
	defer letGo()
	kubetest.MakeClaimWith(t, c, ns, "copy", class.Name, func(p *corev1.PersistentVolumeClaim) {
		p.Spec.DataSource = &corev1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: src.Name}
	})
	err := testenv.WaitFor(ctx, 60*time.Second, "the clone's CreateVolume held", func(context.Context) (bool, string, error) {
		n := len(drivers.names("CreateVolume"))
		return n == 2, fmt.Sprintf("%d CreateVolume calls", n), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	cur, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, src.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(cur.Finalizers, provision.CloneFinalizer) {
		t.Fatalf("source claim finalizers %v while it is being copied: want %s", cur.Finalizers, provision.CloneFinalizer)
	}

	// Deleted mid-copy: kept, and the broker says why in its log.
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, src.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	err = testenv.WaitFor(ctx, 60*time.Second, "the deleted source kept for its pending clone", func(context.Context) (bool, string, error) {
		return strings.Contains(r.logs.String(), "deleted claim kept while claims cloning it are pending"), "no such log line", nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if cur, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, src.Name, metav1.GetOptions{}); err != nil || cur.DeletionTimestamp == nil {
		t.Fatalf("source claim while its clone is pending: %v, err %v; want it there, being deleted", cur, err)
	}
	if d.CallCount("DeleteVolume") != 0 {
		t.Fatal("a volume was deleted while the clone was being made")
	}

	// The copy done: the clone binds, the source goes, then its volume.
	letGo()
	kubetest.WaitBound(t, c, ns, "copy", 60*time.Second)
	err = testenv.WaitFor(ctx, 60*time.Second, "source claim gone", func(ctx context.Context) (bool, string, error) {
		_, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, src.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), fmt.Sprint(err), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	kubetest.WaitPVGone(t, c, src.Spec.VolumeName, 60*time.Second)
}

// TestDeleteAfterNamespaceIsGone: a grant admits claims of namespaces
// labelled team=a; when such a namespace is deleted with its claims, the
// volumes are still deleted: the decision uses the labels the namespace had
// when the volume was made.
func TestDeleteAfterNamespaceIsGone(t *testing.T) {
	env := kubetest.ControlPlane(t)
	storageNS := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	tenant := makeTenant(t, c, storageNS)
	drv := kubetest.ClusterName(storageNS, "ns.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	rs, errs := policy.Compile([]policy.Grant{{Namespace: storageNS, Name: "team-a", Spec: policy.GrantSpec{Drivers: []string{drv}, SecretNames: []string{"creds"},
		Operations: []policy.Operation{policy.OpCreateVolume, policy.OpDeleteVolume},
		Requesters: policy.Requesters{NamespaceSelector: &policy.LabelSelector{MatchLabels: map[string]string{"team": "a"}}}}}})
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(storageNS, "ns"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, map[string]string{
		"csi.storage.k8s.io/provisioner-secret-name": "creds", "csi.storage.k8s.io/provisioner-secret-namespace": storageNS})
	authz := &policy.Authorizer{Rules: policy.NewStore(rs)}
	first := startBridge(t, env, storageNS, drivers, bridgeOpts{policy: authz})
	bound := kubetest.WaitBound(t, c, tenant, kubetest.MakeClaim(t, c, tenant, "data", class.Name, "1Gi").Name, 60*time.Second)
	// A PV that does not record its claim's namespace labels (made by
	// another provisioner, say).
	unrecorded := kubetest.WaitBound(t, c, tenant, kubetest.MakeClaim(t, c, tenant, "unrecorded", class.Name, "1Gi").Name, 60*time.Second).Spec.VolumeName
	if _, err := c.CoreV1().PersistentVolumes().Patch(ctx, unrecorded, types.MergePatchType,
		[]byte(`{"metadata":{"annotations":{"`+kube.AnnNamespaceLabels+`":null}}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}

	// The namespace disappears while no broker runs, so that the next one
	// meets the Released volume with no namespace left to read labels from.
	first.stop()
	deleteNamespace(t, c, tenant)
	startBridge(t, env, storageNS, drivers, bridgeOpts{policy: authz, identity: "broker-1"})
	err := testenv.WaitFor(ctx, 60*time.Second, "volume of the deleted namespace deleted", func(ctx context.Context) (bool, string, error) {
		_, err := c.CoreV1().PersistentVolumes().Get(ctx, bound.Spec.VolumeName, metav1.GetOptions{})
		return apierrors.IsNotFound(err) && len(d.Volumes()) == 1, kubetest.EventsOf(c, "default", bound.Spec.VolumeName), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// The PV without recorded labels is not decided for with labels nobody
	// knows; its Event says how to give them, and giving them unblocks it.
	kubetest.WaitEvent(t, c, "default", unrecorded, "VolumeFailedDelete", kube.AnnNamespaceLabels+" annotation")
	if _, err := c.CoreV1().PersistentVolumes().Patch(ctx, unrecorded, types.MergePatchType,
		[]byte(`{"metadata":{"annotations":{"`+kube.AnnNamespaceLabels+`":"{\"team\":\"a\"}"}}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitPVGone(t, c, unrecorded, 60*time.Second)
	if n := len(d.Volumes()); n != 0 {
		t.Fatalf("%d volumes left", n)
	}
}

// TestRetainedPVLosesTheDeletionFinalizer: an admin switches a provisioned
// PV to Retain to keep its data, deletes its claim and then the PV: the PV
// goes (the broker drops the finalizer that waits for a volume deletion
// that will now never come, as external-provisioner does) and the volume
// stays.
func TestRetainedPVLosesTheDeletionFinalizer(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "keep.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "keep"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})
	claim := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second)
	pvName := claim.Spec.VolumeName
	pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !kube.HasFinalizer(pv, kube.FinalizerVolume) {
		t.Fatalf("provisioned PV without %s: %v", kube.FinalizerVolume, pv.Finalizers)
	}
	patch := []byte(`{"spec":{"persistentVolumeReclaimPolicy":"Retain"}}`)
	if _, err := c.CoreV1().PersistentVolumes().Patch(ctx, pvName, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "data", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := c.CoreV1().PersistentVolumes().Delete(ctx, pvName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitPVGone(t, c, pvName, 30*time.Second)
	if n := len(d.Volumes()); n != 1 || d.CallCount("DeleteVolume") != 0 {
		t.Fatalf("retained volume: %d volumes, %d DeleteVolume calls; want it kept", n, d.CallCount("DeleteVolume"))
	}
}

// TestBoundPVWithoutFinalizerGetsIt: a bound PV of a registered driver
// that lacks the deletion finalizer (as an older external-provisioner made
// it) gets it, as external-provisioner adds it; so deleting the PV object
// first and its claim after still deletes the volume instead of leaking it.
func TestBoundPVWithoutFinalizerGetsIt(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "fin.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "fin"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})
	claim := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second)
	pvName := claim.Spec.VolumeName
	kubetest.WaitPV(t, c, pvName, "Bound", 30*time.Second, func(pv *corev1.PersistentVolume) (bool, string) {
		if pv == nil {
			return false, "gone"
		}
		return pv.Status.Phase == corev1.VolumeBound, string(pv.Status.Phase)
	})
	// As an older provisioner left it: the other finalizers stay.
	err := testenv.WaitFor(ctx, 30*time.Second, "finalizer removed", func(ctx context.Context) (bool, string, error) {
		pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		pv.Finalizers = kube.RemoveString(pv.Finalizers, kube.FinalizerVolume)
		if _, err := c.CoreV1().PersistentVolumes().Update(ctx, pv, metav1.UpdateOptions{}); err != nil {
			return false, err.Error(), nil
		}
		return true, "", nil
	})
	if err != nil {
		t.Fatal(err)
	}
	kubetest.WaitPV(t, c, pvName, "finalizer added back", 30*time.Second, func(pv *corev1.PersistentVolume) (bool, string) {
		return pv != nil && kube.HasFinalizer(pv, kube.FinalizerVolume), "no finalizer " + kube.FinalizerVolume
	})
	// The PV object first, then its claim: the volume is still deleted.
	if err := c.CoreV1().PersistentVolumes().Delete(ctx, pvName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "data", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitPVGone(t, c, pvName, 60*time.Second)
	if n := len(d.Volumes()); n != 0 || d.CallCount("DeleteVolume") != 1 {
		t.Fatalf("%d volumes left, %d DeleteVolume calls; want the volume deleted once", n, d.CallCount("DeleteVolume"))
	}
}

// TestDeleteFallsBackToTheClassSecret: a PV that records no deletion
// secret (made by an external-provisioner older than those annotations) is
// deleted with its StorageClass's provisioner secret, as
// external-provisioner does, through the policy.
func TestDeleteFallsBackToTheClassSecret(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "old.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	if _, err := c.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "creds", Namespace: ns}, StringData: map[string]string{"k": "v"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	rs, errs := policy.Compile([]policy.Grant{{Namespace: ns, Name: "g", Spec: policy.GrantSpec{
		Drivers: []string{drv}, SecretNames: []string{"creds"}, Operations: []policy.Operation{policy.OpCreateVolume, policy.OpDeleteVolume},
		Requesters: policy.Requesters{Namespaces: []string{ns}}}},
		// A PV's own labels are its requests' (here: a PV labelled frozen
		// keeps its volume).
		{Namespace: ns, Name: "frozen", Spec: policy.GrantSpec{Action: policy.ActionDeny,
			Drivers: []string{drv}, SecretNames: []string{"creds"}, Operations: []policy.Operation{policy.OpDeleteVolume},
			Requesters: policy.Requesters{Namespaces: []string{ns}}, Condition: `"frozen" in request.requester.labels && request.requester.labels["frozen"] == "true"`}},
	})
	if len(errs) != 0 {
		t.Fatal(errs)
	}
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "old"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete,
		map[string]string{"csi.storage.k8s.io/provisioner-secret-name": "creds", "csi.storage.k8s.io/provisioner-secret-namespace": "${pvc.namespace}"})
	r := startBridge(t, env, ns, drivers, bridgeOpts{policy: &policy.Authorizer{Rules: policy.NewStore(rs)}})
	claim := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second)
	pvName := claim.Spec.VolumeName
	// As an old provisioner left it: no deletion-secret annotations.
	patch := fmt.Sprintf(`{"metadata":{"labels":{"frozen":"true"},"annotations":{%q:null,%q:null}}}`, kube.AnnDeletionSecretName, kube.AnnDeletionSecretNS)
	if _, err := c.CoreV1().PersistentVolumes().Patch(ctx, pvName, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "data", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitEvent(t, c, "default", pvName, "VolumeFailedDelete", "deny grant "+ns+"/frozen")
	if _, err := c.CoreV1().PersistentVolumes().Patch(ctx, pvName, types.MergePatchType, []byte(`{"metadata":{"labels":{"frozen":null}}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitPVGone(t, c, pvName, 60*time.Second)
	if n := len(d.Volumes()); n != 0 {
		t.Fatalf("%d volumes left", n)
	}
	if got := r.metricValue(t, "csibroker_secret_policy_decisions_total", map[string]string{"operation": "DeleteVolume", "decision": "allow"}); got < 1 {
		t.Fatalf("DeleteVolume secret decisions allowed: %v, want the class's secret decided and used", got)
	}
}
