package k8sbridge

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
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
