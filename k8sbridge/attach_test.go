package k8sbridge

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
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
	"github.com/csibroker/csibroker/policy"
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

// TestAttachAndDeleteKeepToPerDriverWorkers: attachments and deletions of
// one driver run at most PerDriverWorkers at a time, as provisioning and
// expansion do, so a slow driver cannot take every worker of the attacher
// or the deleter; the others wait their turn and are all done.
func TestAttachAndDeleteKeepToPerDriverWorkers(t *testing.T) {
	drivers := newCountingDrivers()
	s := newAttachSetupWith(t, "sa.csi.test", sampledriver.Config{}, drivers.testDrivers, drivers, bridgeOpts{configureCfg: func(cfg *Config) { cfg.PerDriverWorkers = 1 }})
	ctx, c, ns, node, drv := s.ctx, s.c, s.ns, s.node, s.drv
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "slow"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)

	// Three claims used by pods on the node (attached), three left alone
	// (deleted).
	used, spare := []string{"a", "b", "c"}, []string{"x", "y", "z"}
	pvOf := map[string]string{}
	for _, name := range append(slices.Clone(used), spare...) {
		kubetest.MakeClaim(t, c, ns, name, class.Name, "1Gi")
	}
	for _, name := range append(slices.Clone(used), spare...) {
		pvOf[name] = kubetest.WaitBound(t, c, ns, name, 60*time.Second).Spec.VolumeName
	}
	// The first publish and the first deletion are held at the driver
	// until the other two of each wait for the driver's slot: they
	// contend for it.
	letPublish, letDelete := drivers.hold("ControllerPublishVolume"), drivers.hold("DeleteVolume")
	defer letPublish()
	defer letDelete()
	for _, name := range used {
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "pod-" + name, Namespace: ns}, Spec: corev1.PodSpec{NodeName: node,
			Containers: []corev1.Container{{Name: "c", Image: "busybox"}},
			Volumes:    []corev1.Volume{{Name: "v", VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: name}}}}}}
		if _, err := c.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// Detached while the bridge still runs (clean-ups run last first), so
	// that no VolumeAttachment is left with the broker's finalizer.
	t.Cleanup(func() {
		for _, name := range used {
			c.CoreV1().Pods(ns).Delete(context.Background(), "pod-"+name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
		}
		err := testenv.WaitFor(context.Background(), 60*time.Second, "the test's VolumeAttachments gone", func(ctx context.Context) (bool, string, error) {
			vas, err := c.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, err.Error(), nil
			}
			for _, va := range vas.Items {
				if va.Spec.Attacher == drv {
					return false, va.Name + " still there", nil
				}
			}
			return true, "", nil
		})
		if err != nil {
			t.Error(err)
		}
	})
	for _, name := range spare {
		if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	at := extraOf[*attach.Controller](t, s.r.b)
	err := testenv.WaitFor(ctx, 60*time.Second, "two attachments and two deletions waiting for the driver's slot", func(context.Context) (bool, string, error) {
		na, nd := at.QueueLen(), s.r.b.del.QueueLen()
		return na == 2 && nd == 2, fmt.Sprintf("%d attachments and %d deletions waiting", na, nd), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	letPublish()
	letDelete()
	for _, name := range used {
		vaFor(t, c, pvOf[name], func(va *storagev1.VolumeAttachment) bool { return va.Status.Attached }, name+" attached")
	}
	for _, name := range spare {
		kubetest.WaitPVGone(t, c, pvOf[name], 60*time.Second)
	}
	if most := drivers.most("ControllerPublishVolume"); most != 1 {
		t.Errorf("%d ControllerPublishVolume calls of one driver at once, want at most PerDriverWorkers = 1", most)
	}
	if most := drivers.most("DeleteVolume"); most != 1 {
		t.Errorf("%d DeleteVolume calls of one driver at once, want at most PerDriverWorkers = 1", most)
	}
}

// TestAttachRefusalsAreReported: what stops an attach before the driver is
// asked is said in the attachment's status and an Event. An admission
// policy that refuses the attacher's finalizer (a webhook or policy engine
// of the cluster) is reported as such, not retried in silence; an
// attachment whose attacher is not the driver of its volume is refused
// without asking either driver.
func TestAttachRefusalsAreReported(t *testing.T) {
	s := newAttachSetup(t, "refused.csi.test", sampledriver.Config{})
	ctx, c, ns, node, drv, d := s.ctx, s.c, s.ns, s.node, s.drv, s.d
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "refused"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second).Spec.VolumeName

	// A volume of another driver, attached by this one's name.
	other := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: kubetest.ClusterName(ns, "other-pv")}, Spec: corev1.PersistentVolumeSpec{
		Capacity:               corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
		AccessModes:            []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
		PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: kubetest.ClusterName(ns, "other.csi.test"), VolumeHandle: "other-volume"}}}}
	if _, err := c.CoreV1().PersistentVolumes().Create(ctx, other, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.CoreV1().PersistentVolumes().Delete(context.Background(), other.Name, metav1.DeleteOptions{})
	})
	mixed := &storagev1.VolumeAttachment{ObjectMeta: metav1.ObjectMeta{Name: kubetest.ClusterName(ns, "mixed")},
		Spec: storagev1.VolumeAttachmentSpec{Attacher: drv, NodeName: node, Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &other.Name}}}
	if _, err := c.StorageV1().VolumeAttachments().Create(ctx, mixed, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.StorageV1().VolumeAttachments().Delete(context.Background(), mixed.Name, metav1.DeleteOptions{})
	})
	// (Until the broker's cache has the new PV, its attempts fail on that,
	// and are retried.)
	got := vaFor(t, c, other.Name, func(va *storagev1.VolumeAttachment) bool {
		return va.Status.AttachError != nil && strings.Contains(va.Status.AttachError.Message, "not of the attachment's attacher")
	}, "attach error of the mixed attachment")
	if msg := got.Status.AttachError.Message; !strings.Contains(msg, "not of the attachment's attacher") || got.Status.Attached || slices.Contains(got.Finalizers, kube.AttacherFinalizer(drv)) {
		t.Fatalf("attachment of another driver's volume: %+v, finalizers %v", got.Status, got.Finalizers)
	}
	kubetest.WaitEvent(t, c, "default", mixed.Name, "AttachFailed", "not of the attachment's attacher")

	// The cluster refuses the attacher's finalizer on this driver's
	// attachments.
	fail := admissionregistrationv1.Fail
	policy := &admissionregistrationv1.ValidatingAdmissionPolicy{ObjectMeta: metav1.ObjectMeta{Name: kubetest.ClusterName(ns, "no-attacher-finalizer")},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicySpec{
			FailurePolicy: &fail,
			MatchConstraints: &admissionregistrationv1.MatchResources{ResourceRules: []admissionregistrationv1.NamedRuleWithOperations{{
				RuleWithOperations: admissionregistrationv1.RuleWithOperations{
					Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create, admissionregistrationv1.Update},
					Rule:       admissionregistrationv1.Rule{APIGroups: []string{"storage.k8s.io"}, APIVersions: []string{"v1"}, Resources: []string{"volumeattachments"}}}}}},
			MatchConditions: []admissionregistrationv1.MatchCondition{{Name: "this-driver", Expression: fmt.Sprintf("object.spec.attacher == %q", drv)}},
			Validations: []admissionregistrationv1.Validation{{
				Expression: "!has(object.metadata.finalizers) || object.metadata.finalizers.all(f, !f.startsWith('external-attacher/'))",
				Message:    "attacher finalizers are refused by the test's policy"}},
		}}
	if _, err := c.AdmissionregistrationV1().ValidatingAdmissionPolicies().Create(ctx, policy, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.AdmissionregistrationV1().ValidatingAdmissionPolicies().Delete(context.Background(), policy.Name, metav1.DeleteOptions{})
	})
	binding := &admissionregistrationv1.ValidatingAdmissionPolicyBinding{ObjectMeta: metav1.ObjectMeta{Name: policy.Name},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicyBindingSpec{PolicyName: policy.Name, ValidationActions: []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny}}}
	if _, err := c.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Delete(context.Background(), binding.Name, metav1.DeleteOptions{})
	})
	// The policy is in force once a dry run of such an attachment is refused.
	probe := &storagev1.VolumeAttachment{ObjectMeta: metav1.ObjectMeta{Name: kubetest.ClusterName(ns, "probe"), Finalizers: []string{kube.AttacherFinalizer(drv)}},
		Spec: storagev1.VolumeAttachmentSpec{Attacher: drv, NodeName: node, Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &pvName}}}
	err := testenv.WaitFor(ctx, 30*time.Second, "the admission policy to refuse the finalizer", func(ctx context.Context) (bool, string, error) {
		_, err := c.StorageV1().VolumeAttachments().Create(ctx, probe, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err != nil && strings.Contains(err.Error(), "refused by the test's policy"), fmt.Sprint(err), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	createVA(t, c, ns, drv, node, pvName)
	got = vaFor(t, c, pvName, func(va *storagev1.VolumeAttachment) bool { return va.Status.AttachError != nil }, "attach error of the refused write")
	if msg := got.Status.AttachError.Message; !strings.Contains(msg, "add finalizer") || !strings.Contains(msg, "refused by the test's policy") || got.Status.Attached {
		t.Fatalf("attachment whose finalizer is refused: %+v", got.Status)
	}
	kubetest.WaitEvent(t, c, "default", got.Name, "AttachFailed", "refused by the test's policy")
	if n := d.CallCount("ControllerPublishVolume"); n != 0 {
		t.Fatalf("%d ControllerPublishVolume calls, want none", n)
	}
}

// TestDetachUndoesAPublishWhateverTheCapabilities: an attachment that
// carries the attacher's finalizer was published (or a publish was tried),
// so its detach asks the driver to unpublish even when the driver's
// capabilities no longer list a publish step (here: a driver version
// without it), and takes Unimplemented as nothing to undo.
func TestDetachUndoesAPublishWhateverTheCapabilities(t *testing.T) {
	s := newAttachSetup(t, "nopub.csi.test", sampledriver.Config{DisablePublish: true})
	ctx, c, ns, node, drv, d := s.ctx, s.c, s.ns, s.node, s.drv, s.d
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "nopub"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second).Spec.VolumeName
	// What an attach with a publish step left.
	va := &storagev1.VolumeAttachment{ObjectMeta: metav1.ObjectMeta{Name: kubetest.ClusterName(ns, "va"), Finalizers: []string{kube.AttacherFinalizer(drv)}, Annotations: map[string]string{kube.AnnVANodeID: node}},
		Spec: storagev1.VolumeAttachmentSpec{Attacher: drv, NodeName: node, Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &pvName}}}
	if _, err := c.StorageV1().VolumeAttachments().Create(ctx, va, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	vaFor(t, c, pvName, func(va *storagev1.VolumeAttachment) bool { return va.Status.Attached }, "attached")
	if err := c.StorageV1().VolumeAttachments().Delete(ctx, va.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitVAGone(t, c, va.Name, 30*time.Second)
	if n := d.CallCount("ControllerUnpublishVolume"); n != 1 {
		t.Fatalf("%d ControllerUnpublishVolume calls, want 1", n)
	}
}

// TestDetachRetriesNotFound: a driver answering ControllerUnpublishVolume
// with NotFound has not said the volume is unpublished (CSI: that answer
// is OK); the attachment keeps its finalizer, shows the error, and goes
// once the driver answers OK.
func TestDetachRetriesNotFound(t *testing.T) {
	s := newAttachSetup(t, "nf.csi.test", sampledriver.Config{Faults: sampledriver.Faults{Methods: map[string]sampledriver.Fault{
		"ControllerUnpublishVolume": {First: 2, Code: codes.NotFound}}}})
	ctx, c, ns, node, drv, d := s.ctx, s.c, s.ns, s.node, s.drv, s.d
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "nf"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second).Spec.VolumeName
	va := createVA(t, c, ns, drv, node, pvName)
	vaFor(t, c, pvName, func(va *storagev1.VolumeAttachment) bool { return va.Status.Attached }, "attached")
	if err := c.StorageV1().VolumeAttachments().Delete(ctx, va.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	got := vaFor(t, c, pvName, func(va *storagev1.VolumeAttachment) bool { return va.Status.DetachError != nil }, "detach error recorded")
	if !slices.Contains(got.Finalizers, kube.AttacherFinalizer(drv)) || !strings.Contains(got.Status.DetachError.Message, "NotFound") {
		t.Fatalf("after a NotFound unpublish: finalizers %v, detach error %+v; want the finalizer kept and the error shown", got.Finalizers, got.Status.DetachError)
	}
	waitVAGone(t, c, va.Name, 60*time.Second)
	if n := d.CallCount("ControllerUnpublishVolume"); n != 3 {
		t.Fatalf("%d ControllerUnpublishVolume calls, want 3 (two NotFound, then OK)", n)
	}
}

// TestVolumeErrorMessageFitsTheAPIServer: the API server refuses a
// VolumeAttachment status whose error message is over 1024 bytes; a long
// driver error is cut (on a UTF-8 boundary) to a message it accepts.
func TestVolumeErrorMessageFitsTheAPIServer(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	pv := "pv"
	va := createVA(t, c, ns, "limits.csi.test", kubetest.ClusterName(ns, "node"), pv)
	write := func(msg string) error {
		cur, err := c.StorageV1().VolumeAttachments().Get(ctx, va.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		cur.Status.AttachError = &storagev1.VolumeError{Time: metav1.Now(), Message: msg}
		_, err = c.StorageV1().VolumeAttachments().UpdateStatus(ctx, cur, metav1.UpdateOptions{})
		return err
	}
	if err := write(strings.Repeat("x", attach.MaxVolumeErrorMessage+1)); err == nil {
		t.Fatalf("the API server took a %d-byte message: the limit is not %d", attach.MaxVolumeErrorMessage+1, attach.MaxVolumeErrorMessage)
	}
	long := "driver says: " + strings.Repeat("é", 2000)
	cut := attach.VolumeErrorMessage(long)
	if len(cut) > attach.MaxVolumeErrorMessage || !utf8.ValidString(cut) || !strings.HasPrefix(cut, "driver says: é") || !strings.Contains(cut, "cut;") {
		t.Fatalf("cut message (%d bytes, valid UTF-8 %v): %q", len(cut), utf8.ValidString(cut), cut)
	}
	if err := write(cut); err != nil {
		t.Fatalf("the cut message was refused: %v", err)
	}
	if short := "ControllerPublishVolume failed"; attach.VolumeErrorMessage(short) != short {
		t.Fatalf("a short message was changed: %q", attach.VolumeErrorMessage(short))
	}
}

// TestAttachesAMigratedInTreeVolume: with CSI migration the attach/detach
// controller makes VolumeAttachments for in-tree PVs naming the CSI
// driver the plugin moved to, and the PV keeps its in-tree source. The
// broker translates it as external-attacher does: the driver publishes its
// own volume ID, detach unpublishes it, and the PV's attacher finalizer
// goes when the PV is deleted.
func TestAttachesAMigratedInTreeVolume(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ctx, c, ns := context.Background(), env.Client(), env.NewNamespace(t)
	node := addAttachNode(t, env, ns)
	// The driver CSI migration moves in-tree Cinder volumes to (a name the
	// translation fixes, shared with TestResizeExpandsAMigratedInTreeVolume;
	// the two run one after the other, each with its own bridge).
	const drv = "cinder.csi.openstack.org"
	drivers, d := publishingDriver(t, env, drv, node)
	volID := createDriverVolume(t, drivers, drv, kubetest.ClusterName(ns, "in-tree"))
	pv := createStaticPV(t, c, kubetest.ClusterName(ns, "pv"), corev1.PersistentVolumeSource{Cinder: &corev1.CinderPersistentVolumeSource{VolumeID: volID, FSType: "ext4"}}, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})

	va := createVA(t, c, ns, drv, node, pv.Name)
	vaFor(t, c, pv.Name, func(va *storagev1.VolumeAttachment) bool { return va.Status.Attached || va.Status.AttachError != nil }, "migrated volume attached")
	got, err := c.StorageV1().VolumeAttachments().Get(ctx, va.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !got.Status.Attached {
		t.Fatalf("the migrated volume was not attached: %+v", got.Status)
	}
	published := func() []string {
		for _, v := range d.Volumes() {
			if v.ID == volID {
				return v.PublishedNodes
			}
		}
		t.Fatalf("volume %s gone from the driver", volID)
		return nil
	}
	if nodes := published(); !slices.Equal(nodes, []string{node}) {
		t.Fatalf("the driver has volume %s published to %v, want [%s]", volID, nodes, node)
	}
	cur, err := c.CoreV1().PersistentVolumes().Get(ctx, pv.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(cur.Finalizers, kube.AttacherFinalizer(drv)) {
		t.Fatalf("the in-tree PV lacks the attacher finalizer: %v", cur.Finalizers)
	}
	if err := c.StorageV1().VolumeAttachments().Delete(ctx, va.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitVAGone(t, c, va.Name, 30*time.Second)
	if nodes := published(); len(nodes) != 0 {
		t.Fatalf("after detach the driver still has volume %s published to %v", volID, nodes)
	}
	if err := c.CoreV1().PersistentVolumes().Delete(ctx, pv.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitPVGone(t, c, pv.Name, 30*time.Second)
}

// TestDetachMarksAnAttachmentKeptByAnotherFinalizer: when another
// controller's finalizer keeps a VolumeAttachment after the broker's goes,
// its status says detached (attached false, no publish context, no old
// detach error), as external-attacher leaves it.
func TestDetachMarksAnAttachmentKeptByAnotherFinalizer(t *testing.T) {
	s := newAttachSetup(t, "kept.csi.test", sampledriver.Config{})
	ctx, c, ns, node, drv, d := s.ctx, s.c, s.ns, s.node, s.drv, s.d
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "kept"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimRetain, nil)
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second).Spec.VolumeName
	const hold = "test.csibroker.io/hold"
	va := createHeldVA(t, c, &storagev1.VolumeAttachment{ObjectMeta: metav1.ObjectMeta{Name: kubetest.ClusterName(ns, "va"), Finalizers: []string{hold}},
		Spec: storagev1.VolumeAttachmentSpec{Attacher: drv, NodeName: node, Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &pvName}}})
	vaFor(t, c, pvName, func(va *storagev1.VolumeAttachment) bool { return va.Status.Attached }, "attachment attached")
	if err := c.StorageV1().VolumeAttachments().Delete(ctx, va.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	got := vaFor(t, c, pvName, func(va *storagev1.VolumeAttachment) bool { return !kube.HasAttacherFinalizer(va.Finalizers, drv) }, "the broker's finalizer removed")
	if got.Status.Attached || got.Status.AttachmentMetadata != nil || got.Status.DetachError != nil || !slices.Equal(got.Finalizers, []string{hold}) {
		t.Fatalf("attachment kept by another finalizer after detach: status %+v, finalizers %v; want detached, [%s]", got.Status, got.Finalizers, hold)
	}
	if n := d.CallCount("ControllerUnpublishVolume"); n == 0 {
		t.Fatal("the volume was never unpublished")
	}
}

// TestDetachAfterNamespaceIsGone: a grant admits publish secrets for
// claims of namespaces labelled team=a. A static PV (which records no
// namespace labels) is attached; its claim's namespace is deleted before
// the detach. The attachment recorded the labels its publish was decided
// with, so the unpublish is decided with them and the detach completes.
func TestDetachAfterNamespaceIsGone(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ctx, c, storageNS := context.Background(), env.Client(), env.NewNamespace(t)
	tenant := makeTenant(t, c, storageNS)
	node := addAttachNode(t, env, storageNS)
	drv := kubetest.ClusterName(storageNS, "gone.csi.test")
	drivers, d := publishingDriver(t, env, drv, node)
	volID := createDriverVolume(t, drivers, drv, kubetest.ClusterName(storageNS, "static"))
	pv := createStaticPV(t, c, kubetest.ClusterName(storageNS, "pv"), corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: drv, VolumeHandle: volID,
		ControllerPublishSecretRef: &corev1.SecretReference{Namespace: storageNS, Name: "creds"}}}, func(pv *corev1.PersistentVolume) {
		pv.Spec.ClaimRef = &corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: tenant, Name: "data"}
	})
	rs, errs := policy.Compile([]policy.Grant{{Namespace: storageNS, Name: "team-a", Spec: policy.GrantSpec{Drivers: []string{drv}, SecretNames: []string{"creds"},
		Operations: []policy.Operation{policy.OpControllerPublishVolume, policy.OpControllerUnpublishVolume},
		Requesters: policy.Requesters{NamespaceSelector: &policy.LabelSelector{MatchLabels: map[string]string{"team": "a"}}}}}})
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	startBridge(t, env, storageNS, drivers, bridgeOpts{policy: &policy.Authorizer{Rules: policy.NewStore(rs)}})

	va := createVA(t, c, storageNS, drv, node, pv.Name)
	got := vaFor(t, c, pv.Name, func(va *storagev1.VolumeAttachment) bool { return va.Status.Attached || va.Status.AttachError != nil }, "attachment attached")
	var noted map[string]string
	if err := json.Unmarshal([]byte(got.Annotations[kube.AnnNamespaceLabels]), &noted); !got.Status.Attached || err != nil || noted["team"] != "a" {
		t.Fatalf("attachment: status %+v, annotations %v; want attached, with the namespace labels recorded", got.Status, got.Annotations)
	}
	deleteNamespace(t, c, tenant)
	if err := c.StorageV1().VolumeAttachments().Delete(ctx, va.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitVAGone(t, c, va.Name, 30*time.Second)
	if n := d.CallCount("ControllerUnpublishVolume"); n == 0 {
		t.Fatal("the volume was never unpublished")
	}
}

// publishingDriver starts sample driver drv (with a controller publish
// step) for node, as registered there (CSIDriver, CSINode).
func publishingDriver(t *testing.T, env *testenv.Env, drv, node string) (*testDrivers, *sampledriver.Driver) {
	t.Helper()
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv, NodeID: node})
	makeCSIDriver(t, env.Client(), drv, true)
	if err := env.AddCSINode(context.Background(), node, drv, node, nil); err != nil {
		t.Fatal(err)
	}
	return drivers, d
}

// createHeldVA creates va (its finalizers as given), and at cleanup drops
// whatever finalizers it still has so that it goes.
func createHeldVA(t *testing.T, c kubernetes.Interface, va *storagev1.VolumeAttachment) *storagev1.VolumeAttachment {
	t.Helper()
	made, err := c.StorageV1().VolumeAttachments().Create(context.Background(), va, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cur, err := c.StorageV1().VolumeAttachments().Get(context.Background(), made.Name, metav1.GetOptions{}); err == nil {
			cur.Finalizers = nil
			c.StorageV1().VolumeAttachments().Update(context.Background(), cur, metav1.UpdateOptions{})
		}
	})
	return made
}

// deleteNamespace deletes namespace ns and waits until it is gone.
func deleteNamespace(t *testing.T, c kubernetes.Interface, ns string) {
	t.Helper()
	ctx := context.Background()
	if err := c.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	err := testenv.WaitFor(ctx, 60*time.Second, "namespace "+ns+" gone", func(ctx context.Context) (bool, string, error) {
		_, err := c.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
		return apierrors.IsNotFound(err), fmt.Sprint(err), nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestAttachKeepsPublishContextKeysSpeltLikePatchDirectives: a driver's
// publish context is the VolumeAttachment's attachmentMetadata, keys and
// all. Keys a strategic merge patch reads as directives ("$patch":
// "delete" dropped the whole map) reach the API server as data.
func TestAttachKeepsPublishContextKeysSpeltLikePatchDirectives(t *testing.T) {
	env := kubetest.ControlPlane(t)
	c, ns := env.Client(), env.NewNamespace(t)
	node := addAttachNode(t, env, ns)
	drv := kubetest.ClusterName(ns, "dollar.csi.test")
	drivers, _ := publishingDriver(t, env, drv, node)
	extra := map[string]string{"$patch": "delete", "$retainKeys": "devicePath", "$setElementOrder/x": "y"}
	volID := createDriverVolume(t, drivers, drv, kubetest.ClusterName(ns, "vol"))
	pv := createStaticPV(t, c, kubetest.ClusterName(ns, "pv"), corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: drv, VolumeHandle: volID}}, nil)
	startBridge(t, env, ns, &hookedDrivers{testDrivers: drivers, hook: func(_ string, _, reply any, err error) error {
		if resp, ok := reply.(*csi.ControllerPublishVolumeResponse); ok && err == nil {
			if resp.PublishContext == nil {
				resp.PublishContext = map[string]string{}
			}
			maps.Copy(resp.PublishContext, extra)
		}
		return err
	}}, bridgeOpts{})

	createVA(t, c, ns, drv, node, pv.Name)
	got := vaFor(t, c, pv.Name, func(va *storagev1.VolumeAttachment) bool { return va.Status.Attached || va.Status.AttachError != nil }, "attached")
	if !got.Status.Attached {
		t.Fatalf("not attached: %+v", got.Status)
	}
	for k, v := range extra {
		if got.Status.AttachmentMetadata[k] != v {
			t.Errorf("attachmentMetadata %v: want %s=%s from the driver's publish context", got.Status.AttachmentMetadata, k, v)
		}
	}
	if got.Status.AttachmentMetadata[sampledriver.PublishContextDevicePath] == "" {
		t.Errorf("attachmentMetadata %v lacks the driver's own %s", got.Status.AttachmentMetadata, sampledriver.PublishContextDevicePath)
	}
}

// hookedDrivers passes every answer of its drivers' controller
// connections through hook (which may change the reply, and says what
// error the caller gets) before the caller sees it.
type hookedDrivers struct {
	*testDrivers
	hook func(method string, args, reply any, err error) error
}

func (d *hookedDrivers) ControllerConn(drv string) (grpc.ClientConnInterface, error) {
	c, err := d.testDrivers.ControllerConn(drv)
	if err != nil {
		return nil, err
	}
	return &hookedConn{ClientConnInterface: c, hook: d.hook}, nil
}

type hookedConn struct {
	grpc.ClientConnInterface
	hook func(method string, args, reply any, err error) error
}

func (c *hookedConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	return c.hook(method, args, reply, c.ClientConnInterface.Invoke(ctx, method, args, reply, opts...))
}

// createStaticPV creates a 1Gi ReadWriteOnce PV of src reclaimed by Retain,
// changed by mut (if set) first, and deletes it at cleanup.
func createStaticPV(t *testing.T, c kubernetes.Interface, name string, src corev1.PersistentVolumeSource, mut func(*corev1.PersistentVolume)) *corev1.PersistentVolume {
	t.Helper()
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			PersistentVolumeSource:        src,
		},
	}
	if mut != nil {
		mut(pv)
	}
	pv, err := c.CoreV1().PersistentVolumes().Create(context.Background(), pv, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.CoreV1().PersistentVolumes().Delete(context.Background(), name, metav1.DeleteOptions{}) })
	return pv
}
