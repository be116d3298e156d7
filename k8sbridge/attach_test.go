package k8sbridge

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/attach"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
)

func makeCSIDriver(t *testing.T, c kubernetes.Interface, name string, attach bool) {
	t.Helper()
	d := &storagev1.CSIDriver{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: storagev1.CSIDriverSpec{AttachRequired: &attach}}
	if _, err := c.StorageV1().CSIDrivers().Create(context.Background(), d, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.StorageV1().CSIDrivers().Delete(context.Background(), name, metav1.DeleteOptions{}) })
}

// addAttachNode adds a node of the test's own (zone z1) for pods to be
// attached to, deleted when the test ends.
func addAttachNode(t *testing.T, env *testenv.Env, ns string) string {
	t.Helper()
	node := kubetest.ClusterName(ns, "node")
	if _, err := env.AddNodes(context.Background(), testenv.NodeSpec{Name: node, Zone: "z1"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { env.Client().CoreV1().Nodes().Delete(context.Background(), node, metav1.DeleteOptions{}) })
	return node
}

// createVA creates a VolumeAttachment of PV pvName to node for driver drv,
// as the attach/detach controller does, deleted when the test ends.
func createVA(t *testing.T, c kubernetes.Interface, ns, drv, node, pvName string) *storagev1.VolumeAttachment {
	t.Helper()
	va := &storagev1.VolumeAttachment{ObjectMeta: metav1.ObjectMeta{Name: kubetest.ClusterName(ns, "va")},
		Spec: storagev1.VolumeAttachmentSpec{Attacher: drv, NodeName: node, Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &pvName}}}
	if _, err := c.StorageV1().VolumeAttachments().Create(context.Background(), va, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.StorageV1().VolumeAttachments().Delete(context.Background(), va.Name, metav1.DeleteOptions{})
	})
	return va
}

// waitVAGone waits until the VolumeAttachment name is deleted (its
// finalizers removed), saying what holds it if it is not.
func waitVAGone(t *testing.T, c kubernetes.Interface, name string, timeout time.Duration) {
	t.Helper()
	err := testenv.WaitFor(context.Background(), timeout, "the attachment gone", func(ctx context.Context) (bool, string, error) {
		cur, err := c.StorageV1().VolumeAttachments().Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, "", nil
		}
		if err != nil {
			return false, err.Error(), nil
		}
		return false, fmt.Sprintf("finalizers %v, detach error %v", cur.Finalizers, cur.Status.DetachError), nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// vaFor waits for the attach/detach controller's VolumeAttachment of pv.
func vaFor(t *testing.T, c kubernetes.Interface, pv string, cond func(*storagev1.VolumeAttachment) bool, what string) *storagev1.VolumeAttachment {
	t.Helper()
	var found *storagev1.VolumeAttachment
	err := testenv.WaitFor(context.Background(), 60*time.Second, what, func(ctx context.Context) (bool, string, error) {
		vas, err := c.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		for i := range vas.Items {
			va := &vas.Items[i]
			if va.Spec.Source.PersistentVolumeName != nil && *va.Spec.Source.PersistentVolumeName == pv {
				found = va
				return cond(va), fmt.Sprintf("attached=%v error=%v finalizers=%v", va.Status.Attached, va.Status.AttachError, va.Finalizers), nil
			}
		}
		return false, "no VolumeAttachment yet", nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return found
}

// TestAttachDetach: a pod with a claim on a fake node gets its volume
// attached through the broker (publish context in the VolumeAttachment);
// deleting the pod detaches it and removes the finalizers. A driver without
// PUBLISH_UNPUBLISH is attached without a CSI call; a failing publish shows
// in the attachment's status.
func TestAttachDetach(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	node := addAttachNode(t, env, ns)

	pub, triv, bad := kubetest.ClusterName(ns, "pub.csi.test"), kubetest.ClusterName(ns, "triv.csi.test"), kubetest.ClusterName(ns, "bad.csi.test")
	drivers := &testDrivers{}
	dPub := drivers.addDriver(t, sampledriver.Config{Name: pub, NodeID: node})
	dTriv := drivers.addDriver(t, sampledriver.Config{Name: triv, NodeID: node, DisablePublish: true})
	drivers.addDriver(t, sampledriver.Config{Name: bad, NodeID: node, Faults: sampledriver.Faults{Methods: map[string]sampledriver.Fault{
		"ControllerPublishVolume": {Rate: 1, Code: codes.FailedPrecondition}}}})
	for _, d := range []string{pub, triv, bad} {
		makeCSIDriver(t, c, d, true)
		if err := env.AddCSINode(ctx, node, d, node, nil); err != nil {
			t.Fatal(err)
		}
	}
	imm, del := storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete
	for _, d := range []string{pub, triv, bad} {
		kubetest.MakeClass(t, c, d+"-class", d, imm, del, nil)
	}
	startBridge(t, env, ns, drivers, bridgeOpts{})

	pvOf := map[string]string{}
	for _, d := range []struct{ claim, driver string }{{"pub", pub}, {"triv", triv}, {"bad", bad}} {
		kubetest.MakeClaim(t, c, ns, d.claim, d.driver+"-class", "1Gi")
		pvOf[d.claim] = kubetest.WaitBound(t, c, ns, d.claim, 60*time.Second).Spec.VolumeName
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "pod-" + d.claim, Namespace: ns}, Spec: corev1.PodSpec{NodeName: node,
			Containers: []corev1.Container{{Name: "c", Image: "busybox"}},
			Volumes:    []corev1.Volume{{Name: "v", VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: d.claim}}}}}}
		if _, err := c.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	va := vaFor(t, c, pvOf["pub"], func(va *storagev1.VolumeAttachment) bool { return va.Status.Attached }, "pub attached")
	if va.Status.AttachmentMetadata[sampledriver.PublishContextDevicePath] == "" {
		t.Fatalf("publish context %v", va.Status.AttachmentMetadata)
	}
	fin := kube.AttacherFinalizer(pub)
	pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvOf["pub"], metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(va.Finalizers, fin) || !kube.HasFinalizer(pv, fin) || va.Annotations[kube.AnnVANodeID] != node {
		t.Fatalf("finalizers VA %v PV %v, node ID %q", va.Finalizers, pv.Finalizers, va.Annotations[kube.AnnVANodeID])
	}
	if n := dPub.CallCount("ControllerPublishVolume"); n != 1 {
		t.Fatalf("the driver was asked to publish %d times, want once", n)
	}

	vaFor(t, c, pvOf["triv"], func(va *storagev1.VolumeAttachment) bool { return va.Status.Attached }, "trivial attach")
	if n := dTriv.CallCount("ControllerPublishVolume"); n != 0 {
		t.Fatalf("trivial driver got %d ControllerPublishVolume calls", n)
	}

	badVA := vaFor(t, c, pvOf["bad"], func(va *storagev1.VolumeAttachment) bool { return va.Status.AttachError != nil }, "attach error recorded")
	if e := badVA.Status.AttachError; !strings.Contains(e.Message, "FailedPrecondition") || e.ErrorCode == nil || *e.ErrorCode != int32(codes.FailedPrecondition) || badVA.Status.Attached {
		t.Fatalf("attach error %+v", e)
	}

	// Pod gone → the attach/detach controller deletes the attachment → the
	// broker unpublishes and drops its finalizers.
	if err := c.CoreV1().Pods(ns).Delete(ctx, "pod-pub", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	err = testenv.WaitFor(ctx, 60*time.Second, "attachment of pub gone", func(ctx context.Context) (bool, string, error) {
		_, err := c.StorageV1().VolumeAttachments().Get(ctx, va.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), fmt.Sprint(err), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if dPub.CallCount("ControllerUnpublishVolume") == 0 {
		t.Fatal("the driver was never asked to unpublish")
	}
	// The PV keeps the attacher finalizer until it is deleted; deleting the
	// claim (reclaim Delete) must then end with the PV gone.
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "pub", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	err = testenv.WaitFor(ctx, 60*time.Second, "PV of pub deleted", func(ctx context.Context) (bool, string, error) {
		pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvOf["pub"], metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, "", nil
		}
		if err != nil {
			return false, err.Error(), nil
		}
		return false, fmt.Sprintf("phase %s finalizers %v", pv.Status.Phase, pv.Finalizers), nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestDetachesWhatExternalAttacherAttached: external-attacher's finalizer
// name sanitizes the driver name ("a.b.csi" → external-attacher/a-b-csi);
// an attachment the sidecar made, carrying that name, is detached by the
// broker (unpublished, finalizers of the VolumeAttachment and the PV
// removed), so a cluster moves from the sidecar to the broker unchanged.
func TestDetachesWhatExternalAttacherAttached(t *testing.T) {
	for driver, want := range map[string]string{"ebs.csi.aws.com": "external-attacher/ebs-csi-aws-com", "a/b_c.": "external-attacher/a-b-c-X", "plain-name": "external-attacher/plain-name"} {
		if got := kube.AttacherFinalizer(driver); got != want {
			t.Errorf("kube.AttacherFinalizer(%q) = %q, want %q (external-attacher's)", driver, got, want)
		}
	}
	s := newAttachSetup(t, "moved.csi.test", sampledriver.Config{})
	ctx, c, ns, node, drv, d := s.ctx, s.c, s.ns, s.node, s.drv, s.d
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "moved"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimRetain, nil)
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second).Spec.VolumeName

	// What external-attacher left: its finalizer on the attachment and the
	// PV, named as it names it (computed here, not by the code under test).
	sidecarFin := "external-attacher/" + regexp.MustCompile(`[^a-zA-Z0-9-]`).ReplaceAllString(drv, "-")
	pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pv.Finalizers = append(pv.Finalizers, sidecarFin)
	if _, err := c.CoreV1().PersistentVolumes().Update(ctx, pv, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	va := createHeldVA(t, c, &storagev1.VolumeAttachment{ObjectMeta: metav1.ObjectMeta{Name: kubetest.ClusterName(ns, "va"), Finalizers: []string{sidecarFin}, Annotations: map[string]string{kube.AnnVANodeID: node}},
		Spec: storagev1.VolumeAttachmentSpec{Attacher: drv, NodeName: node, Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &pvName}}})
	vaFor(t, c, pvName, func(va *storagev1.VolumeAttachment) bool { return va.Status.Attached }, "attachment attached")
	if err := c.StorageV1().VolumeAttachments().Delete(ctx, va.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	err = testenv.WaitFor(ctx, 30*time.Second, "the sidecar's attachment detached and gone", func(ctx context.Context) (bool, string, error) {
		cur, err := c.StorageV1().VolumeAttachments().Get(ctx, va.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, "", nil
		}
		if err != nil {
			return false, err.Error(), nil
		}
		return false, fmt.Sprintf("finalizers %v", cur.Finalizers), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := d.CallCount("ControllerUnpublishVolume"); n == 0 {
		t.Fatal("the volume was never unpublished")
	}
}

// TestNoAttachOfAPVBeingDeleted: an attachment of a PV marked for deletion
// fails with an AttachError saying so, as external-attacher's does, and
// the volume is never published.
func TestNoAttachOfAPVBeingDeleted(t *testing.T) {
	s := newAttachSetup(t, "del.csi.test", sampledriver.Config{})
	ctx, c, ns, node, drv, d := s.ctx, s.c, s.ns, s.node, s.drv, s.d
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "del"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimRetain, nil)
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second).Spec.VolumeName
	const hold = "test.csibroker.io/hold"
	pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pv.Finalizers = append(pv.Finalizers, hold)
	if _, err := c.CoreV1().PersistentVolumes().Update(ctx, pv, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cur, err := c.CoreV1().PersistentVolumes().Get(context.Background(), pvName, metav1.GetOptions{}); err == nil {
			cur.Finalizers = kube.RemoveString(cur.Finalizers, hold)
			c.CoreV1().PersistentVolumes().Update(context.Background(), cur, metav1.UpdateOptions{})
		}
	})
	if err := c.CoreV1().PersistentVolumes().Delete(ctx, pvName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	createVA(t, c, ns, drv, node, pvName)
	got := vaFor(t, c, pvName, func(va *storagev1.VolumeAttachment) bool { return va.Status.AttachError != nil }, "attach error recorded")
	if !strings.Contains(got.Status.AttachError.Message, "marked for deletion") || got.Status.Attached {
		t.Fatalf("attach of a PV being deleted: %+v", got.Status)
	}
	if n := d.CallCount("ControllerPublishVolume"); n != 0 {
		t.Fatalf("%d ControllerPublishVolume calls for a volume being deleted", n)
	}
}

// TestAttacherFinalizerOfAPVLeftTerminating: a PV being deleted still holds
// the attacher finalizer though no attachment uses it any more (its last
// one went while no broker was running). The broker that starts drops the
// finalizer, and the PV goes.
func TestAttacherFinalizerOfAPVLeftTerminating(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ctx, c, ns := context.Background(), env.Client(), env.NewNamespace(t)
	drivers := &testDrivers{}
	drv := kubetest.ClusterName(ns, "left.csi.test")
	drivers.addDriver(t, sampledriver.Config{Name: drv})
	makeCSIDriver(t, c, drv, true)
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: kubetest.ClusterName(ns, "pv"), Finalizers: []string{kube.AttacherFinalizer(drv)}},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			PersistentVolumeSource:        corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: drv, VolumeHandle: "left-1"}},
		},
	}
	if _, err := c.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := c.CoreV1().PersistentVolumes().Delete(ctx, pv.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	startBridge(t, env, ns, drivers, bridgeOpts{})
	kubetest.WaitPVGone(t, c, pv.Name, 30*time.Second)
}

// TestReadOnlyPublishOnlyWhenTheDriverMayBeAsked: a read-only PV of a
// driver without PUBLISH_READONLY is published with readonly unset (the CSI
// spec forbids asking), as external-attacher does; the driver, which
// refuses such a request, attaches it.
func TestReadOnlyPublishOnlyWhenTheDriverMayBeAsked(t *testing.T) {
	s := newAttachSetup(t, "ro.csi.test", sampledriver.Config{NoPublishReadonly: true})
	ctx, c, ns, node, drv, drivers, d := s.ctx, s.c, s.ns, s.node, s.drv, s.drivers, s.d
	// A pre-provisioned read-only PV of one of the driver's volumes.
	conn, err := drivers.ControllerConn(drv)
	if err != nil {
		t.Fatal(err)
	}
	vol, err := csi.NewControllerClient(conn).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "ro", VolumeCapabilities: []*csi.VolumeCapability{{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY}}}})
	if err != nil {
		t.Fatal(err)
	}
	pvName := kubetest.ClusterName(ns, "ro-pv")
	pv := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: pvName}, Spec: corev1.PersistentVolumeSpec{
		Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
		AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadOnlyMany},
		PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
		PersistentVolumeSource:        corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: drv, VolumeHandle: vol.GetVolume().GetVolumeId(), ReadOnly: true}}}}
	if _, err := c.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.CoreV1().PersistentVolumes().Delete(context.Background(), pvName, metav1.DeleteOptions{}) })
	createVA(t, c, ns, drv, node, pvName)
	got := vaFor(t, c, pvName, func(va *storagev1.VolumeAttachment) bool { return va.Status.Attached || va.Status.AttachError != nil }, "attached or failed")
	if !got.Status.Attached {
		t.Fatalf("read-only PV of a driver without PUBLISH_READONLY: %+v", got.Status.AttachError)
	}
	if n := d.CallCount("ControllerPublishVolume"); n == 0 {
		t.Fatal("never published")
	}
}

// attachSetup is one node and one attach-required sample driver registered
// on it, with a running bridge: what the attach tests below start from.
type attachSetup struct {
	ctx      context.Context
	c        kubernetes.Interface
	ns, node string
	drv      string
	drivers  *testDrivers
	d        *sampledriver.Driver
	r        *bridgeRun
}

// newAttachSetup starts it; the driver is named after name and runs cfg
// (its name and node ID set here).
func newAttachSetup(t *testing.T, name string, cfg sampledriver.Config) *attachSetup {
	t.Helper()
	return newAttachSetupWith(t, name, cfg, &testDrivers{}, nil, bridgeOpts{})
}

// newAttachSetupWith is newAttachSetup with the bridge's options, and its
// drivers: td (the test drivers the setup adds its driver to), seen by the
// bridge through wrap if wrap is not nil.
func newAttachSetupWith(t *testing.T, name string, cfg sampledriver.Config, td *testDrivers, wrap Drivers, o bridgeOpts) *attachSetup {
	t.Helper()
	env := kubetest.ControlPlane(t)
	s := &attachSetup{ctx: context.Background(), c: env.Client(), ns: env.NewNamespace(t), drivers: td}
	s.node = addAttachNode(t, env, s.ns)
	s.drv = kubetest.ClusterName(s.ns, name)
	cfg.Name, cfg.NodeID = s.drv, s.node
	s.d = s.drivers.addDriver(t, cfg)
	makeCSIDriver(t, s.c, s.drv, true)
	if err := env.AddCSINode(s.ctx, s.node, s.drv, s.node, nil); err != nil {
		t.Fatal(err)
	}
	if wrap == nil {
		wrap = td
	}
	s.r = startBridge(t, env, s.ns, wrap, o)
	return s
}

// TestVANeverPublishedCanGo: a VolumeAttachment whose publish cannot be
// made (its controller-publish secret is missing) takes no finalizer, so
// deleting it is not blocked on a detach that would fail the same way.
func TestVANeverPublishedCanGo(t *testing.T) {
	s := newAttachSetup(t, "nosecret.csi.test", sampledriver.Config{})
	ctx, c, ns, node, drv, d := s.ctx, s.c, s.ns, s.node, s.drv, s.d
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "nosecret"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, map[string]string{
		"csi.storage.k8s.io/controller-publish-secret-name": "missing", "csi.storage.k8s.io/controller-publish-secret-namespace": ns})
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second).Spec.VolumeName
	va := createVA(t, c, ns, drv, node, pvName)
	got := vaFor(t, c, pvName, func(va *storagev1.VolumeAttachment) bool { return va.Status.AttachError != nil }, "attach error recorded")
	if !strings.Contains(got.Status.AttachError.Message, "missing") || slices.Contains(got.Finalizers, kube.AttacherFinalizer(drv)) {
		t.Fatalf("attach without its secret: status %+v, finalizers %v; want the error and no finalizer", got.Status, got.Finalizers)
	}
	if err := c.StorageV1().VolumeAttachments().Delete(ctx, va.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	err := testenv.WaitFor(ctx, 20*time.Second, "the VolumeAttachment gone", func(ctx context.Context) (bool, string, error) {
		cur, err := c.StorageV1().VolumeAttachments().Get(ctx, va.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, "", nil
		}
		if err != nil {
			return false, err.Error(), nil
		}
		return false, fmt.Sprintf("finalizers %v, detach error %+v", cur.Finalizers, cur.Status.DetachError), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := d.CallCount("ControllerPublishVolume") + d.CallCount("ControllerUnpublishVolume"); n != 0 {
		t.Fatalf("%d publish/unpublish calls for a VA that could not be published", n)
	}
}

// TestAttachReconcilePublishesAgain: when the driver no longer reports an
// attached volume as published (ListVolumes), the reconcile publishes it
// again, as external-attacher does, and the VolumeAttachment stays
// attached throughout (false would make the attach-detach controller count
// the volume as detached from a node that may be using it).
func TestAttachReconcilePublishesAgain(t *testing.T) {
	prev := attach.ReconcileInterval
	attach.ReconcileInterval = 300 * time.Millisecond
	t.Cleanup(func() { attach.ReconcileInterval = prev })
	s := newAttachSetup(t, "relist.csi.test", sampledriver.Config{})
	ctx, c, ns, node, drv, d := s.ctx, s.c, s.ns, s.node, s.drv, s.d
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "relist"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second).Spec.VolumeName
	va := createVA(t, c, ns, drv, node, pvName)
	attached := vaFor(t, c, pvName, func(va *storagev1.VolumeAttachment) bool { return va.Status.Attached }, "attached")
	// Every version of the attachment from now on, to see whether any
	// says detached, however briefly.
	w, err := c.StorageV1().VolumeAttachments().Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + va.Name, ResourceVersion: attached.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	var (
		watchMu      sync.Mutex
		detachedSeen bool
		watchedRV    = attached.ResourceVersion // the last version the watch delivered
		watchProblem string
	)
	go func() {
		for ev := range w.ResultChan() {
			watchMu.Lock()
			if cur, ok := ev.Object.(*storagev1.VolumeAttachment); ok {
				watchedRV = cur.ResourceVersion
				if !cur.Status.Attached && cur.DeletionTimestamp == nil {
					detachedSeen = true
				}
			} else {
				watchProblem = fmt.Sprintf("watch event %s: %v", ev.Type, ev.Object)
			}
			watchMu.Unlock()
		}
		watchMu.Lock()
		if watchProblem == "" {
			watchProblem = "the watch ended"
		}
		watchMu.Unlock()
	}()

	// Behind the broker's back the driver forgets the publication.
	pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	conn, err := s.drivers.ControllerConn(drv)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := csi.NewControllerClient(conn).ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: pv.Spec.CSI.VolumeHandle, NodeId: node}); err != nil {
		t.Fatal(err)
	}
	err = testenv.WaitFor(ctx, 30*time.Second, "the volume published again", func(ctx context.Context) (bool, string, error) {
		for _, v := range d.Volumes() {
			if v.ID == pv.Spec.CSI.VolumeHandle && slices.Contains(v.PublishedNodes, node) {
				return true, "", nil
			}
		}
		return false, fmt.Sprintf("%d ControllerPublishVolume calls", d.CallCount("ControllerPublishVolume")), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// Every version of the attachment up to now: the watch has delivered
	// them once it has delivered the current one (a watch delivers an
	// object's versions in order).
	now, err := c.StorageV1().VolumeAttachments().Get(ctx, va.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	err = testenv.WaitFor(ctx, 30*time.Second, "the watch to deliver version "+now.ResourceVersion, func(context.Context) (bool, string, error) {
		watchMu.Lock()
		defer watchMu.Unlock()
		if watchedRV == now.ResourceVersion {
			return true, "", nil
		}
		if watchProblem != "" {
			return false, "", errors.New(watchProblem)
		}
		return false, "last delivered " + watchedRV, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	watchMu.Lock()
	defer watchMu.Unlock()
	if detachedSeen {
		t.Fatal("the VolumeAttachment was marked detached on the way")
	}
}
