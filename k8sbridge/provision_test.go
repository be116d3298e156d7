package k8sbridge

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/csiparams"
	"github.com/csibroker/csibroker/k8sbridge/intent"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
)

// TestProvisionTwoDriversImmediateAndWFFC: one broker provisions Immediate
// and WaitForFirstConsumer claims for two drivers at once; the PVs carry what
// external-provisioner would write; deleting the claims deletes the volumes
// (reclaim Delete) or keeps them (Retain).
func TestProvisionTwoDriversImmediateAndWFFC(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	nodeName := kubetest.ClusterName(ns, "node")
	if _, err := env.AddNodes(ctx, testenv.NodeSpec{Name: nodeName, Zone: "z1"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.CoreV1().Nodes().Delete(context.Background(), nodeName, metav1.DeleteOptions{}) })

	drvA, drvB := kubetest.ClusterName(ns, "a.csi.test"), kubetest.ClusterName(ns, "b.csi.test")
	drivers := &testDrivers{}
	a := drivers.addDriver(t, sampledriver.Config{Name: drvA, NodeID: nodeName})
	b := drivers.addDriver(t, sampledriver.Config{Name: drvB, NodeID: nodeName})
	for _, d := range []string{drvA, drvB} {
		if err := env.AddCSINode(ctx, nodeName, d, nodeName, nil); err != nil {
			t.Fatal(err)
		}
	}
	classA := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "a"), drvA, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, map[string]string{"label": "blue"})
	classB := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "b"), drvB, storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimRetain, nil)
	r := startBridge(t, env, ns, drivers, bridgeOpts{})

	claimA := kubetest.MakeClaim(t, c, ns, "claim-a", classA.Name, "1Gi")
	claimB := kubetest.MakeClaim(t, c, ns, "claim-b", classB.Name, "2Gi")
	kubetest.MakePod(t, c, ns, "pod-b", "claim-b")

	boundA := kubetest.WaitBound(t, c, ns, "claim-a", 60*time.Second)
	boundB := kubetest.WaitBound(t, c, ns, "claim-b", 60*time.Second)
	if boundB.Annotations[kube.AnnSelectedNode] != nodeName {
		t.Fatalf("claim-b selected node = %q", boundB.Annotations[kube.AnnSelectedNode])
	}

	pvA, err := c.CoreV1().PersistentVolumes().Get(ctx, boundA.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if want := "pvc-" + string(claimA.UID); pvA.Name != want {
		t.Errorf("PV name %s, want %s", pvA.Name, want)
	}
	src := pvA.Spec.CSI
	switch {
	case src == nil || src.Driver != drvA || src.VolumeHandle == "":
		t.Errorf("PV CSI source %+v", src)
	case pvA.Annotations[kube.AnnProvisionedBy] != drvA:
		t.Errorf("provisioned-by = %q", pvA.Annotations[kube.AnnProvisionedBy])
	case pvA.Spec.PersistentVolumeReclaimPolicy != corev1.PersistentVolumeReclaimDelete || !kube.HasFinalizer(pvA, kube.FinalizerVolume):
		t.Errorf("reclaim %s finalizers %v", pvA.Spec.PersistentVolumeReclaimPolicy, pvA.Finalizers)
	case pvA.Spec.ClaimRef == nil || pvA.Spec.ClaimRef.UID != claimA.UID:
		t.Errorf("claimRef %+v", pvA.Spec.ClaimRef)
	case pvA.Spec.StorageClassName != classA.Name:
		t.Errorf("storage class %q", pvA.Spec.StorageClassName)
	}
	if q := pvA.Spec.Capacity[corev1.ResourceStorage]; q.Value() != 1<<30 {
		t.Errorf("capacity %s", q.String())
	}
	pvB, err := c.CoreV1().PersistentVolumes().Get(ctx, boundB.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	switch q := pvB.Spec.Capacity[corev1.ResourceStorage]; {
	case pvB.Name != "pvc-"+string(claimB.UID):
		t.Errorf("claim-b PV name %s", pvB.Name)
	case pvB.Spec.CSI == nil || pvB.Spec.CSI.Driver != drvB || pvB.Spec.CSI.VolumeHandle == "":
		t.Errorf("claim-b PV CSI source %+v", pvB.Spec.CSI)
	case pvB.Spec.PersistentVolumeReclaimPolicy != corev1.PersistentVolumeReclaimRetain:
		t.Errorf("claim-b PV reclaim %s", pvB.Spec.PersistentVolumeReclaimPolicy)
	case pvB.Spec.ClaimRef == nil || pvB.Spec.ClaimRef.UID != claimB.UID || pvB.Spec.StorageClassName != classB.Name:
		t.Errorf("claim-b PV claimRef %+v, class %q", pvB.Spec.ClaimRef, pvB.Spec.StorageClassName)
	case q.Value() != 2<<30:
		t.Errorf("claim-b PV capacity %s", q.String())
	}
	vols := a.Volumes()
	if len(vols) != 1 || vols[0].ID != src.VolumeHandle || vols[0].Parameters["label"] != "blue" {
		t.Fatalf("driver A volumes %+v", vols)
	}
	if len(b.Volumes()) != 1 {
		t.Fatalf("driver B volumes %+v", b.Volumes())
	}
	kubetest.WaitEvent(t, c, ns, "claim-a", "ProvisioningSucceeded", "Successfully provisioned volume "+pvA.Name)
	// The Event names the trace of the claim's provisioning.
	ev := kubetest.WaitEvent(t, c, ns, "claim-a", "Provisioning", "(trace ")
	id := ev.Message[strings.LastIndex(ev.Message, "(trace ")+len("(trace "):]
	id = strings.TrimSuffix(id, ")")
	var traced []string
	for _, sp := range r.spans.Ended() {
		if sp.Name() == "provision "+ns+"/claim-a" {
			traced = append(traced, sp.SpanContext().TraceID().String())
		}
	}
	if !slices.Contains(traced, id) {
		t.Fatalf("the Provisioning Event names trace %q; the claim's provisioning spans are in traces %v", id, traced)
	}

	// Reclaim Delete: claim deleted → volume deleted → PV gone.
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "claim-a", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitPVGone(t, c, pvA.Name, 60*time.Second)
	if n := len(a.Volumes()); n != 0 {
		t.Fatalf("driver A still has %d volumes", n)
	}

	// Reclaim Retain: the PV and the volume stay.
	if err := c.CoreV1().Pods(ns).Delete(ctx, "pod-b", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "claim-b", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitPV(t, c, boundB.Spec.VolumeName, "Released", 60*time.Second, func(pv *corev1.PersistentVolume) (bool, string) {
		if pv == nil {
			return false, "gone"
		}
		return pv.Status.Phase == corev1.VolumeReleased, string(pv.Status.Phase)
	})
	// A sentinel: a claim of driver B with reclaim Delete, made and
	// deleted after claim-b's PV was Released. Its deletion is enqueued
	// after that PV's update was seen, so once its PV is gone a wrong
	// deletion of the Retain volume would have been asked of the driver.
	classDel := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "b-delete"), drvB, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	sentinel := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "sentinel", classDel.Name, "1Gi").Name, 60*time.Second)
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "sentinel", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitPVGone(t, c, sentinel.Spec.VolumeName, 60*time.Second)
	if n, calls := len(b.Volumes()), b.CallCount("DeleteVolume"); n != 1 || calls != 1 {
		t.Fatalf("Retain: driver B has %d volumes after %d DeleteVolume calls, want 1 after 1 (the sentinel's)", n, calls)
	}
}

// TestSelectedNodeGoneReschedules: a WaitForFirstConsumer claim whose
// selected node no longer exists is handed back to the scheduler (its
// selected-node annotation removed, with an Event saying why), as
// external-provisioner does, instead of failing forever; no volume is made.
func TestSelectedNodeGoneReschedules(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "wffc.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "wffc"), drv, storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})
	kubetest.MakeClaim(t, c, ns, "orphaned", class.Name, "1Gi")
	gone := kubetest.ClusterName(ns, "gone-node")
	setSelectedNode(t, c, ns, "orphaned", gone)
	kubetest.WaitEvent(t, c, ns, "orphaned", "ProvisioningFailed", "selected node \""+gone+"\" no longer exists")
	waitSelectedNodeRemoved(t, c, ns, "orphaned")
	if n := len(d.Volumes()); n != 0 {
		t.Fatalf("%d volumes made for a node that does not exist", n)
	}
}

// TestPerMethodTimeoutLongerThanTheDefault: a driver whose CreateVolume
// takes 2 s, with --timeout 1 s and the driver's own CreateVolume timeout
// of 20 s: the controller's call is given the driver's timeout (it is not
// cut at 1 s and re-issued as "in progress"), and the claim is bound after
// one call.
func TestPerMethodTimeoutLongerThanTheDefault(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "slow.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv, Faults: sampledriver.Faults{Methods: map[string]sampledriver.Fault{"CreateVolume": {Latency: 2 * time.Second}}}},
		func(o *chaintest.Options) {
			o.Timeout, o.MethodTimeouts = time.Second, map[string]time.Duration{"CreateVolume": 20 * time.Second}
		})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "slow"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{timeout: time.Second})
	kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "slow", class.Name, "1Gi").Name, 60*time.Second)
	if n := d.CallCount("CreateVolume"); n != 1 {
		t.Fatalf("%d CreateVolume calls, want 1 (the call cut short and re-issued)", n)
	}
}

// TestPerDriverWorkersServeClaimsInOrder: with one slot per driver, claims
// that arrive while the slot is taken (its CreateVolume held) wait in line
// and are provisioned in the order they arrived, each as soon as the one
// before is done (no claim can overtake another by polling at the right
// moment), and the claims waiting count in the queue's depth.
func TestPerDriverWorkersServeClaimsInOrder(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "inline.csi.test")
	drivers := newCountingDrivers()
	drivers.addDriver(t, sampledriver.Config{Name: drv})
	letGo := drivers.hold("CreateVolume")
	defer letGo()
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "inline"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	r := startBridge(t, env, ns, drivers, bridgeOpts{configureCfg: func(cfg *Config) { cfg.PerDriverWorkers = 1 }})
	var want []string
	for i := range 5 {
		claim := kubetest.MakeClaim(t, c, ns, fmt.Sprintf("c%d", i), class.Name, "1Gi")
		want = append(want, csiparams.VolumeName(r.b.Cfg.VolumeNamePrefix, claim.UID, r.b.Cfg.VolumeNameUUIDLength))
		// Each claim in line before the next is made: the first in the
		// driver, then one more waiting each time.
		err := testenv.WaitFor(context.Background(), 30*time.Second, fmt.Sprintf("claim c%d handled", i), func(context.Context) (bool, string, error) {
			called, waiting := len(drivers.names("CreateVolume")), r.b.prov.QueueLen()
			return called == 1 && waiting == i, fmt.Sprintf("%d CreateVolume calls, %d claims waiting", called, waiting), nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	letGo()
	for i := range 5 {
		kubetest.WaitBound(t, c, ns, fmt.Sprintf("c%d", i), 60*time.Second)
	}
	if got := drivers.names("CreateVolume"); !slices.Equal(got, want) {
		t.Errorf("CreateVolume calls for %v, want them in the claims' order %v", got, want)
	}
	if most := drivers.most("CreateVolume"); most != 1 {
		t.Errorf("%d CreateVolume calls at once, want at most PerDriverWorkers = 1", most)
	}
	if n := r.b.prov.QueueLen(); n != 0 {
		t.Errorf("%d keys still waiting after every claim was bound", n)
	}
}

// TestIntentRecordFullIsReported: a claim whose intent cannot be recorded
// (the record is full) gets an Event saying so, and no driver is called.
func TestIntentRecordFullIsReported(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "full.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "full"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{configure: func(b *Bridge) { b.Intents().LimitEntries(0) }})
	kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi")
	kubetest.WaitEvent(t, c, ns, "data", "ProvisioningFailed", "record the intent to create volume")
	kubetest.WaitEvent(t, c, ns, "data", "ProvisioningFailed", intent.ErrFull.Error())
	if n := d.CallCount("CreateVolume"); n != 0 {
		t.Errorf("%d CreateVolume calls without a recorded intent, want 0", n)
	}
}

// TestRefusalAfterAnAttemptInProgressKeepsTheIntent: the driver makes the
// volume on the first CreateVolume but the answer is lost (the broker sees
// DeadlineExceeded: in progress), then refuses the retry with a final
// code. The intent entry must stay, since the first attempt made the
// volume; when the claim is deleted, recovery deletes that volume.
// (Removing the entry on the final refusal left the volume on the driver
// with nothing accounting for it.)
func TestRefusalAfterAnAttemptInProgressKeepsTheIntent(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "lost.csi.test")
	drivers := newCountingDrivers()
	drivers.script("CreateVolume", func(n int, call func() error) error {
		switch n {
		case 1:
			if err := call(); err != nil {
				return err
			}
			return status.Error(codes.DeadlineExceeded, "answer lost (test)")
		case 2:
			return status.Error(codes.InvalidArgument, "refused (test)")
		}
		return call() // recovery's re-issue learns the volume's ID
	})
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "lost"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	r := startBridge(t, env, ns, drivers, bridgeOpts{})
	claim := kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi")
	pvName := csiparams.VolumeName(r.b.Cfg.VolumeNamePrefix, claim.UID, r.b.Cfg.VolumeNameUUIDLength)
	kubetest.WaitEvent(t, c, ns, "data", "ProvisioningFailed", "refused (test)")
	if n := len(d.Volumes()); n != 1 {
		t.Fatalf("%d volumes on the driver after the lost answer, want 1", n)
	}
	if !r.b.Intents().Has(pvName) {
		t.Fatalf("intent entry of %s removed after the final refusal, while the first attempt's volume exists", pvName)
	}
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "data", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	err := testenv.WaitFor(ctx, 60*time.Second, "the first attempt's volume deleted and its entry gone", func(context.Context) (bool, string, error) {
		return len(d.Volumes()) == 0 && !r.b.Intents().Has(pvName), fmt.Sprintf("%d volumes, entry %v", len(d.Volumes()), r.b.Intents().Has(pvName)), nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestUndersizedVolumeIsDeletedAndRetried: a driver answering with a
// volume smaller than the claim asked for (which the PV controller would
// never bind) gets it deleted, the claim a ProvisioningFailed Event saying
// so, and a retry that provisions it, as external-provisioner does.
func TestUndersizedVolumeIsDeletedAndRetried(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "small.csi.test")
	drivers := newCountingDrivers()
	drivers.rewriteReply("CreateVolume", func(n int, reply any) {
		if n == 1 {
			v := reply.(*csi.CreateVolumeResponse).GetVolume()
			v.CapacityBytes /= 2
		}
	})
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "small"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})
	kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi")
	kubetest.WaitEvent(t, c, ns, "data", "ProvisioningFailed", "less than requested capacity 1073741824; the volume was deleted")
	bound := kubetest.WaitBound(t, c, ns, "data", 60*time.Second)
	if vols := d.Volumes(); len(vols) != 1 || d.CallCount("DeleteVolume") != 1 {
		t.Fatalf("driver volumes %d, DeleteVolume calls %d; want the small one deleted and one left for %s", len(vols), d.CallCount("DeleteVolume"), bound.Spec.VolumeName)
	}
}

// TestClaimsTheProvisionerLeavesOrRefuses: as external-provisioner, a claim
// with a selector is refused with an Event; a claim whose data source is a
// populator's is left to the populator (a Normal Event, no volume); a
// claim naming its class by the beta annotation is provisioned; a class
// with controller-modify secret parameters is accepted, its PV recording
// the secret.
func TestClaimsTheProvisionerLeavesOrRefuses(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "which.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "which"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete,
		map[string]string{"csi.storage.k8s.io/controller-modify-secret-name": "mod-${pvc.name}", "csi.storage.k8s.io/controller-modify-secret-namespace": "${pvc.namespace}"})
	startBridge(t, env, ns, drivers, bridgeOpts{})

	selected := kubetest.MakeClaimWith(t, c, ns, "selected", class.Name, func(p *corev1.PersistentVolumeClaim) {
		p.Spec.Selector = &metav1.LabelSelector{MatchLabels: map[string]string{"tier": "gold"}}
	})
	populated := kubetest.MakeClaimWith(t, c, ns, "populated", class.Name, func(p *corev1.PersistentVolumeClaim) {
		group := "populators.example.com"
		p.Spec.DataSourceRef = &corev1.TypedObjectReference{APIGroup: &group, Kind: "Blob", Name: "b"}
	})
	beta := kubetest.MakeClaimWith(t, c, ns, "beta", "", func(p *corev1.PersistentVolumeClaim) {
		p.Spec.StorageClassName = nil
		p.Annotations = map[string]string{kube.AnnBetaStorageClass: class.Name}
	})
	kubetest.WaitEvent(t, c, ns, selected.Name, "ProvisioningFailed", "claim Selector is not supported")
	kubetest.WaitEvent(t, c, ns, populated.Name, "Provisioning", "Assuming an external populator will provision the volume")
	pvName := kubetest.WaitBound(t, c, ns, beta.Name, 60*time.Second).Spec.VolumeName
	pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if n, s := pv.Annotations[kube.AnnModifySecretName], pv.Annotations[kube.AnnModifySecretNS]; n != "mod-beta" || s != ns {
		t.Fatalf("PV modify-secret annotations %q/%q, want %s/mod-beta", s, n, ns)
	}
	// Only the beta claim's volume: the others were left or refused.
	if n := len(d.Volumes()); n != 1 {
		t.Fatalf("driver has %d volumes, want the beta claim's only", n)
	}
	for _, name := range []string{selected.Name, populated.Name} {
		if cur, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{}); err != nil || cur.Spec.VolumeName != "" {
			t.Fatalf("claim %s: %v, volume %q; want it unprovisioned", name, err, cur.Spec.VolumeName)
		}
	}
}

// TestDefaultFSType: with a default filesystem (--default-fstype), a mount
// volume whose class names none gets it, in CreateVolume and on the PV; a
// class's own fstype wins.
func TestDefaultFSType(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "fs.csi.test")
	drivers := &testDrivers{}
	drivers.addDriver(t, sampledriver.Config{Name: drv})
	plain := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "plain"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	xfs := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "xfs"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete,
		map[string]string{csiparams.ParamFSType: "xfs"})
	startBridge(t, env, ns, drivers, bridgeOpts{configure: func(b *Bridge) { b.Cfg.DefaultFSType = "ext4" }})
	for _, tc := range []struct{ claim, class, want string }{{"plain", plain.Name, "ext4"}, {"xfs", xfs.Name, "xfs"}} {
		pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, tc.claim, tc.class, "1Gi").Name, 60*time.Second).Spec.VolumeName
		pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if got := pv.Spec.CSI.FSType; got != tc.want {
			t.Errorf("claim %s: PV fsType %q, want %q", tc.claim, got, tc.want)
		}
	}
}

// TestControllerPublishReadOnly: with --controller-publish-readonly the PV
// of a claim whose only access mode is ReadOnlyMany is read-only (so the
// attacher asks for a read-only publish); any other claim's is not, and
// without the flag none is.
func TestControllerPublishReadOnly(t *testing.T) {
	env := kubetest.ControlPlane(t)
	c := env.Client()
	ctx := context.Background()
	rox, rwo := corev1.ReadOnlyMany, corev1.ReadWriteOnce
	for _, on := range []bool{true, false} {
		ns := env.NewNamespace(t)
		drv := kubetest.ClusterName(ns, "ro.csi.test")
		drivers := &testDrivers{}
		drivers.addDriver(t, sampledriver.Config{Name: drv})
		class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "ro"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
		startBridge(t, env, ns, drivers, bridgeOpts{configure: func(b *Bridge) { b.Cfg.ControllerPublishReadOnly = on }})
		for _, tc := range []struct {
			claim string
			modes []corev1.PersistentVolumeAccessMode
			want  bool
		}{{"rox", []corev1.PersistentVolumeAccessMode{rox}, on}, {"rwo", []corev1.PersistentVolumeAccessMode{rwo}, false}, {"both", []corev1.PersistentVolumeAccessMode{rwo, rox}, false}} {
			claim := kubetest.MakeClaimWith(t, c, ns, tc.claim, class.Name, func(p *corev1.PersistentVolumeClaim) { p.Spec.AccessModes = tc.modes })
			pv, err := c.CoreV1().PersistentVolumes().Get(ctx, kubetest.WaitBound(t, c, ns, claim.Name, 60*time.Second).Spec.VolumeName, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if pv.Spec.CSI.ReadOnly != tc.want {
				t.Errorf("flag %v, claim %s (%v): PV readOnly %v, want %v", on, tc.claim, tc.modes, pv.Spec.CSI.ReadOnly, tc.want)
			}
		}
	}
}

// TestVolumeAttributesClass: a claim naming a VolumeAttributesClass of its
// driver gets a volume made with the class's parameters as mutable
// parameters and a PV naming the class, which the PV controller binds; a
// class of another driver is refused with an Event.
func TestVolumeAttributesClass(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "vac.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "vac"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	mkVAC := func(name, driver string) string {
		vac := &storagev1.VolumeAttributesClass{ObjectMeta: metav1.ObjectMeta{Name: kubetest.ClusterName(ns, name)}, DriverName: driver,
			Parameters: map[string]string{sampledriver.MutableIOPS: "3000"}}
		if _, err := c.StorageV1().VolumeAttributesClasses().Create(ctx, vac, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			c.StorageV1().VolumeAttributesClasses().Delete(context.Background(), vac.Name, metav1.DeleteOptions{})
		})
		return vac.Name
	}
	fast, other := mkVAC("fast", drv), mkVAC("other", "other.csi.test")
	startBridge(t, env, ns, drivers, bridgeOpts{})
	withVAC := func(vac string) func(*corev1.PersistentVolumeClaim) {
		return func(p *corev1.PersistentVolumeClaim) { p.Spec.VolumeAttributesClassName = &vac }
	}
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaimWith(t, c, ns, "fast", class.Name, withVAC(fast)).Name, 60*time.Second).Spec.VolumeName
	pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := pv.Spec.VolumeAttributesClassName; got == nil || *got != fast {
		t.Fatalf("PV volumeAttributesClassName %v, want %s", got, fast)
	}
	found := false
	for _, r := range d.CreateVolumeRequests() {
		if r.GetName() == pvName {
			found = true
			if got := r.GetMutableParameters(); len(got) != 1 || got[sampledriver.MutableIOPS] != "3000" {
				t.Fatalf("CreateVolume mutable parameters %v, want the class's", got)
			}
		}
	}
	if !found {
		t.Fatal("the driver saw no CreateVolume for the claim")
	}
	kubetest.MakeClaimWith(t, c, ns, "other", class.Name, withVAC(other))
	kubetest.WaitEvent(t, c, ns, "other", "ProvisioningFailed", "is for driver other.csi.test")
}

// TestEmptyVolumeAttributesClassName: a claim naming the empty class (no
// class) gets a PV without one, which the API server accepts and the PV
// controller binds.
func TestEmptyVolumeAttributesClassName(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "novac.csi.test")
	drivers := &testDrivers{}
	drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "novac"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})
	empty := ""
	kubetest.WaitBound(t, c, ns, kubetest.MakeClaimWith(t, c, ns, "data", class.Name, func(p *corev1.PersistentVolumeClaim) { p.Spec.VolumeAttributesClassName = &empty }).Name, 60*time.Second)
}

// TestSelectedNodeWithoutCSINodeReschedules: a claim of a topology-aware
// driver whose selected node has no CSINode (no driver registered there) is
// handed back to the scheduler with an Event, as external-provisioner does;
// no volume is made.
func TestSelectedNodeWithoutCSINodeReschedules(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "topo.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv, Topology: map[string]string{testenv.LabelZone: "z1"}})
	node := kubetest.ClusterName(ns, "bare")
	addNode(t, env, testenv.NodeSpec{Name: node}, "", nil) // no CSINode
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "topo"), drv, storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})
	kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi")
	setSelectedNode(t, c, ns, "data", node)
	kubetest.WaitEvent(t, c, ns, "data", "ProvisioningFailed", "selected node \""+node+"\" has no CSINode object")
	waitSelectedNodeRemoved(t, c, ns, "data")
	if n := len(d.Volumes()); n != 0 {
		t.Fatalf("%d volumes made for a node without the driver", n)
	}
}
