package k8sbridge

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
	"github.com/csibroker/csibroker/k8sbridge/resize"
)

// makeResizeClass makes an Immediate, Delete StorageClass that allows
// expansion, with a controller-expand secret when secretName is set.
func makeResizeClass(t *testing.T, c kubernetes.Interface, name, driver, secretNS, secretName string) string {
	t.Helper()
	var params map[string]string
	if secretName != "" {
		params = map[string]string{"csi.storage.k8s.io/controller-expand-secret-name": secretName, "csi.storage.k8s.io/controller-expand-secret-namespace": secretNS}
	}
	mode, reclaim, allow := storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, true
	sc := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Provisioner: driver, VolumeBindingMode: &mode, ReclaimPolicy: &reclaim,
		AllowVolumeExpansion: &allow, Parameters: params}
	if _, err := c.StorageV1().StorageClasses().Create(context.Background(), sc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.StorageV1().StorageClasses().Delete(context.Background(), name, metav1.DeleteOptions{}) })
	return name
}

// TestResizeWaitsForDetachAfterAnInUseRefusal: a driver that expands
// offline only answers FailedPrecondition while the volume is attached; the
// claim is told so and the driver is not asked again until the
// VolumeAttachment is gone, then the expansion goes through (external-
// resizer's --handle-volume-inuse-error).
func TestResizeWaitsForDetachAfterAnInUseRefusal(t *testing.T) {
	s := newAttachSetup(t, "off.csi.test", sampledriver.Config{Faults: sampledriver.Faults{Methods: map[string]sampledriver.Fault{
		"ControllerExpandVolume": {First: 1, Code: codes.FailedPrecondition}}}})
	ctx, c, ns, node, drv, d := s.ctx, s.c, s.ns, s.node, s.drv, s.d
	class := makeResizeClass(t, c, kubetest.ClusterName(ns, "off"), drv, "", "")
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class, "1Gi").Name, 60*time.Second).Spec.VolumeName
	va := createVA(t, c, ns, drv, node, pvName)
	vaFor(t, c, pvName, func(va *storagev1.VolumeAttachment) bool { return va.Status.Attached }, "attached")

	raiseRequest(t, c, ns, "data", "2Gi")
	kubetest.WaitEvent(t, c, ns, "data", "VolumeResizeFailed", "once the volume is detached")
	inUse := map[string]string{"driver": drv, "result": "in_use"}
	err := testenv.WaitFor(ctx, 30*time.Second, "the refusal counted", func(context.Context) (bool, string, error) {
		return s.r.metricValue(t, "csibroker_resize_operations_total", inUse) == 1, "", nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// Asked for more while still attached, the claim is handled again
	// and the driver is still not asked (nor by a retry with backoff,
	// which would come before it: 100 ms here).
	items := map[string]string{"controller": "resize"}
	handled := s.r.metricValue(t, "csibroker_work_items_total", items)
	raiseRequest(t, c, ns, "data", "3Gi")
	err = testenv.WaitFor(ctx, 30*time.Second, "the larger request handled", func(context.Context) (bool, string, error) {
		now := s.r.metricValue(t, "csibroker_work_items_total", items)
		return now > handled, fmt.Sprintf("%v work items handled", now-handled), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := d.CallCount("ControllerExpandVolume"); n != 1 {
		t.Fatalf("%d ControllerExpandVolume calls while the volume stayed attached, want only the refused one", n)
	}
	if got := s.r.metricValue(t, "csibroker_resize_operations_total", inUse); got != 1 {
		t.Errorf("resize results: in_use %v, want 1", got)
	}
	if err := c.StorageV1().VolumeAttachments().Delete(ctx, va.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitClaim(t, c, ns, "data", "expanded after the detach", func(p *corev1.PersistentVolumeClaim) bool {
		q := p.Status.Capacity[corev1.ResourceStorage]
		st := p.Status.AllocatedResourceStatuses[corev1.ResourceStorage]
		return q.Cmp(resource.MustParse("3Gi")) >= 0 || st == corev1.PersistentVolumeClaimNodeResizePending
	})
	if n := d.CallCount("ControllerExpandVolume"); n != 2 {
		t.Fatalf("%d ControllerExpandVolume calls, want 2 (refused while attached, then done)", n)
	}
}

// raiseRequest sets a claim's storage request, as a user does.
func raiseRequest(t *testing.T, c kubernetes.Interface, ns, name, size string) {
	t.Helper()
	patch := []byte(`{"spec":{"resources":{"requests":{"storage":"` + size + `"}}}}`)
	if _, err := c.CoreV1().PersistentVolumeClaims(ns).Patch(context.Background(), name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatalf("set request of claim %s to %s: %v", name, size, err)
	}
}

func waitClaim(t *testing.T, c kubernetes.Interface, ns, name, what string, cond func(*corev1.PersistentVolumeClaim) bool) *corev1.PersistentVolumeClaim {
	t.Helper()
	var pvc *corev1.PersistentVolumeClaim
	err := testenv.WaitFor(context.Background(), 60*time.Second, "claim "+name+": "+what, func(ctx context.Context) (bool, string, error) {
		var err error
		pvc, err = c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		return cond(pvc), fmt.Sprintf("status %+v", pvc.Status), nil
	})
	if err != nil {
		t.Fatalf("%v\nevents: %s", err, kubetest.EventsOf(c, ns, name))
	}
	return pvc
}

func waitCalls(t *testing.T, d *sampledriver.Driver, n int64) {
	t.Helper()
	err := testenv.WaitFor(context.Background(), 60*time.Second, fmt.Sprintf("%d ControllerExpandVolume calls", n), func(ctx context.Context) (bool, string, error) {
		got := d.CallCount("ControllerExpandVolume")
		return got >= n, fmt.Sprintf("%d calls", got), nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// checkResizedVolume checks the PV's capacity and the driver's volume size.
func checkResizedVolume(t *testing.T, c kubernetes.Interface, pvName string, d *sampledriver.Driver, want int64) {
	t.Helper()
	pv, err := c.CoreV1().PersistentVolumes().Get(context.Background(), pvName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if q := pv.Spec.Capacity[corev1.ResourceStorage]; q.Value() != want {
		t.Errorf("PV %s capacity %s, want %d bytes", pvName, q.String(), want)
	}
	for _, v := range d.Volumes() {
		if v.ID == pv.Spec.CSI.VolumeHandle {
			if v.CapacityBytes != want {
				t.Errorf("driver volume %s has %d bytes, want %d", v.ID, v.CapacityBytes, want)
			}
			return
		}
	}
	t.Errorf("driver has no volume %s", pv.Spec.CSI.VolumeHandle)
}

func volumeHandle(t *testing.T, c kubernetes.Interface, pvName string) string {
	t.Helper()
	pv, err := c.CoreV1().PersistentVolumes().Get(context.Background(), pvName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pv.Spec.CSI.VolumeHandle
}

// TestResizeKeepsToPerDriverWorkers: expansions of one driver run at most
// PerDriverWorkers at a time, so a slow driver cannot take every worker;
// the others wait their turn and are all done.
func TestResizeKeepsToPerDriverWorkers(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "slowexpand.csi.test")
	drivers := newCountingDrivers()
	drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := makeResizeClass(t, c, kubetest.ClusterName(ns, "slow"), drv, "", "")
	r := startBridge(t, env, ns, drivers, bridgeOpts{configureCfg: func(cfg *Config) { cfg.PerDriverWorkers = 1 }})
	names := []string{"a", "b", "c"}
	for _, name := range names {
		kubetest.MakeClaim(t, c, ns, name, class, "1Gi")
	}
	for _, name := range names {
		kubetest.WaitBound(t, c, ns, name, 60*time.Second)
	}
	// The first expansion is held at the driver until the other two wait
	// for its slot: they contend for it.
	letGo := drivers.hold("ControllerExpandVolume")
	defer letGo()
	for _, name := range names {
		raiseRequest(t, c, ns, name, "2Gi")
	}
	rs := extraOf[*resize.Controller](t, r.b)
	err := testenv.WaitFor(context.Background(), 30*time.Second, "two expansions waiting for the driver's slot", func(context.Context) (bool, string, error) {
		n := rs.QueueLen()
		return n == 2, fmt.Sprintf("%d claims waiting", n), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	letGo()
	for _, name := range names {
		waitClaim(t, c, ns, name, "expanded on the controller", func(pvc *corev1.PersistentVolumeClaim) bool {
			return pvc.Status.AllocatedResourceStatuses[corev1.ResourceStorage] == corev1.PersistentVolumeClaimNodeResizePending
		})
	}
	if most := drivers.most("ControllerExpandVolume"); most != 1 {
		t.Errorf("%d ControllerExpandVolume calls of one driver at once, want at most PerDriverWorkers = 1", most)
	}
}

// TestResizeFailureReportedOncePerRequest: an expansion the driver refuses
// with FailedPrecondition (an offline-only driver while a pod uses the
// volume) is retried with backoff and logged on every attempt, but its
// VolumeResizeFailed Event is recorded once per requested size, although
// the driver's message differs on every call (the sample driver counts
// them in it): a raised request is reported again, and so is the first
// failure of a new term of leadership.
func TestResizeFailureReportedOncePerRequest(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "offline.csi.test")
	spy := &resizeSpy{testDrivers: &testDrivers{}}
	spy.addDriver(t, sampledriver.Config{Name: drv, Faults: sampledriver.Faults{Methods: map[string]sampledriver.Fault{
		"ControllerExpandVolume": {Rate: 1, Code: codes.FailedPrecondition}}}})
	r := startBridge(t, env, ns, spy, bridgeOpts{leader: true})
	kubetest.MakeClaim(t, c, ns, "busy", makeResizeClass(t, c, kubetest.ClusterName(ns, "offline"), drv, "", ""), "1Gi")
	claim := kubetest.WaitBound(t, c, ns, "busy", 60*time.Second)
	vol := volumeHandle(t, c, claim.Spec.VolumeName)

	// refused counts the driver's FailedPrecondition answers for size.
	refused := func(size int64) int {
		n := 0
		for _, s := range spy.requests(vol) {
			if s.code == codes.FailedPrecondition && (size == 0 || s.requiredBytes == size) {
				n++
			}
		}
		return n
	}
	waitRefused := func(size int64, n int) {
		t.Helper()
		err := testenv.WaitFor(ctx, 60*time.Second, fmt.Sprintf("%d refused expansions to %d bytes", n, size), func(context.Context) (bool, string, error) {
			return refused(size) >= n, fmt.Sprint(spy.requests(vol)), nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	// settle waits until the resizer has started another attempt, so every
	// attempt before it has recorded what it records, then until the
	// bridge's Events recorded so far are written (they are written in
	// order); it returns how many calls the driver had answered before.
	flushes := 0
	settle := func() int {
		t.Helper()
		n := len(spy.requests(vol))
		err := testenv.WaitFor(ctx, 60*time.Second, "another expansion attempt", func(context.Context) (bool, string, error) {
			return len(spy.requests(vol)) > n, fmt.Sprintf("%d calls", len(spy.requests(vol))), nil
		})
		if err != nil {
			t.Fatal(err)
		}
		flushes++
		marker := fmt.Sprintf("flush %d", flushes)
		// A Warning: the claim's Normal Events (provisioning, Resizing)
		// must not use up the recorder's per-object budget for markers.
		r.b.Event(ctx, kube.ClaimRef(claim), corev1.EventTypeWarning, "TestFlush", "%s", marker)
		kubetest.WaitEvent(t, c, ns, "busy", "TestFlush", marker)
		return n
	}
	// events counts the Events with reason recorded on the claim (an Event
	// the recorder repeated counts as often as it was recorded).
	events := func(reason string) int {
		t.Helper()
		evs, err := c.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=busy"})
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, e := range evs.Items {
			if e.Reason != reason || e.InvolvedObject.UID != claim.UID {
				continue
			}
			if reason == "VolumeResizeFailed" && (!strings.Contains(e.Message, "FailedPrecondition") || !strings.Contains(e.Message, "injected fault in ControllerExpandVolume")) {
				t.Errorf("event %q does not carry the driver's code and message", e.Message)
			}
			n += int(max(e.Count, 1))
		}
		return n
	}
	// warnings counts the VolumeResizeFailed Events; announced the Resizing
	// ones: one per request too, not one per attempt.
	warnings := func() int { return events("VolumeResizeFailed") }
	announced := func() int { return events("Resizing") }
	// logged counts the bridge's log lines of refused expansions of the claim.
	logged := func() int {
		n := 0
		for _, l := range strings.Split(r.logs.String(), "\n") {
			if strings.Contains(l, `msg="ControllerExpandVolume failed"`) && strings.Contains(l, "claim="+ns+"/busy ") {
				n++
			}
		}
		return n
	}

	// Several refusals of one request: one Event, a log line each.
	raiseRequest(t, c, ns, "busy", "2Gi")
	waitRefused(2<<30, 3)
	answered := settle()
	if n := warnings(); n != 1 {
		t.Errorf("%d VolumeResizeFailed Events after %d refusals of the same request, want 1:%s", n, refused(2<<30), kubetest.EventsOf(c, ns, "busy"))
	}
	if n := announced(); n != 1 {
		t.Errorf("%d Resizing Events after %d attempts at the same request, want 1:%s", n, refused(2<<30), kubetest.EventsOf(c, ns, "busy"))
	}
	if n := logged(); n < answered {
		t.Errorf("%d log lines of refused expansions after %d refusals, want one per refusal", n, answered)
	}

	// A new request is reported again, once.
	raiseRequest(t, c, ns, "busy", "3Gi")
	waitRefused(3<<30, 3)
	settle()
	if n := warnings(); n != 2 {
		t.Errorf("%d VolumeResizeFailed Events after %d refusals of 2Gi and %d of 3Gi, want 2 (one per request):%s", n, refused(2<<30), refused(3<<30), kubetest.EventsOf(c, ns, "busy"))
	}
	if n := announced(); n != 2 {
		t.Errorf("%d Resizing Events after attempts at 2Gi and 3Gi, want 2 (one per request):%s", n, kubetest.EventsOf(c, ns, "busy"))
	}

	// Another holder takes the Lease for a moment: the first refusal of
	// the broker's next term is reported again, and only the first.
	takeLease(t, c, ns, "intruder", 3)
	for _, want := range []bool{false, true} {
		if err := testenv.WaitFor(ctx, 30*time.Second, fmt.Sprintf("the broker leading: %v", want), func(context.Context) (bool, string, error) {
			ok, _ := r.b.Leader()
			return ok == want, "", nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	before := refused(0)
	err := testenv.WaitFor(ctx, 30*time.Second, "a VolumeResizeFailed Event in the new term", func(context.Context) (bool, string, error) {
		return warnings() >= 3, kubetest.EventsOf(c, ns, "busy"), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	waitRefused(0, before+3)
	settle()
	if n := warnings(); n != 3 {
		t.Errorf("%d VolumeResizeFailed Events after %d refusals in the new term, want 3 (one more):%s", n, refused(0)-before, kubetest.EventsOf(c, ns, "busy"))
	}
}

// TestResizeClaimWaitingForTheKubeletAsksNoDriver: a claim whose expansion
// waits for the kubelet (NodeResizePending) has nothing for the driver, so
// a new term does not ask its driver anything for it: with the driver
// unreachable, only a claim that does need the driver is told so.
func TestResizeClaimWaitingForTheKubeletAsksNoDriver(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "gone.csi.test")
	live := &testDrivers{}
	live.addDriver(t, sampledriver.Config{Name: drv})
	class := makeResizeClass(t, c, kubetest.ClusterName(ns, "gone"), drv, "", "")
	first := startBridge(t, env, ns, live, bridgeOpts{})
	kubetest.MakeClaim(t, c, ns, "waiting", class, "1Gi")
	kubetest.MakeClaim(t, c, ns, "other", class, "1Gi")
	kubetest.WaitBound(t, c, ns, "other", 60*time.Second)
	kubetest.WaitBound(t, c, ns, "waiting", 60*time.Second)
	raiseRequest(t, c, ns, "waiting", "2Gi")
	waitClaim(t, c, ns, "waiting", "NodeResizePending", func(pvc *corev1.PersistentVolumeClaim) bool {
		return pvc.Status.AllocatedResourceStatuses[corev1.ResourceStorage] == corev1.PersistentVolumeClaimNodeResizePending
	})
	first.stop()

	// The driver is gone; "other" now needs it.
	raiseRequest(t, c, ns, "other", "2Gi")
	dead := &testDrivers{}
	dead.addDeadDriver(t, drv)
	second := startBridge(t, env, ns, dead, bridgeOpts{})
	kubetest.WaitEvent(t, c, ns, "other", "VolumeResizeFailed", "not reachable")
	// Handled, and found to have nothing for the driver.
	handled := "nothing for the driver now"
	err := testenv.WaitFor(context.Background(), 30*time.Second, "the waiting claim handled", func(context.Context) (bool, string, error) {
		for _, line := range strings.Split(second.logs.String(), "\n") {
			if strings.Contains(line, handled) && strings.Contains(line, "claim="+ns+"/waiting") {
				return true, "", nil
			}
		}
		return false, "no log line of it", nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if evs := kubetest.EventsOf(c, ns, "waiting"); strings.Contains(evs, "VolumeResizeFailed") {
		t.Fatalf("a claim waiting for the kubelet was reported as failed:%s", evs)
	}
}

// TestResizeExpandsAMigratedInTreeVolume: kube-controller-manager names, in
// volume.kubernetes.io/storage-resizer, the CSI driver that CSI migration
// moves an in-tree claim's volume to; the broker expands the volume through
// its CSI translation, as external-resizer does. The driver's own volume
// grows (asked with the translated handle and filesystem), and so does the
// PV, which keeps its in-tree source.
func TestResizeExpandsAMigratedInTreeVolume(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ctx, c, ns := context.Background(), env.Client(), env.NewNamespace(t)
	// The driver CSI migration moves in-tree Cinder volumes to (a name the
	// translation fixes, shared with TestAttachesAMigratedInTreeVolume).
	const drv = "cinder.csi.openstack.org"
	spy := &resizeSpy{testDrivers: &testDrivers{}}
	d := spy.addDriver(t, sampledriver.Config{Name: drv})
	volID := createDriverVolume(t, spy.testDrivers, drv, kubetest.ClusterName(ns, "in-tree"))
	class := makeResizeClass(t, c, kubetest.ClusterName(ns, "cinder"), "kubernetes.io/cinder", "", "")
	pv := createStaticPV(t, c, kubetest.ClusterName(ns, "pv"), corev1.PersistentVolumeSource{Cinder: &corev1.CinderPersistentVolumeSource{VolumeID: volID, FSType: "ext4"}},
		func(pv *corev1.PersistentVolume) {
			pv.Spec.StorageClassName, pv.Spec.ClaimRef = class, &corev1.ObjectReference{Namespace: ns, Name: "data"}
		})
	kubetest.MakeClaimWith(t, c, ns, "data", class, func(p *corev1.PersistentVolumeClaim) { p.Spec.VolumeName = pv.Name })
	kubetest.WaitBound(t, c, ns, "data", 60*time.Second)
	startBridge(t, env, ns, spy, bridgeOpts{})

	raiseRequest(t, c, ns, "data", "2Gi")
	claim := waitClaim(t, c, ns, "data", "NodeResizePending", func(pvc *corev1.PersistentVolumeClaim) bool {
		return pvc.Status.AllocatedResourceStatuses[corev1.ResourceStorage] == corev1.PersistentVolumeClaimNodeResizePending
	})
	if got := claim.Annotations[kube.AnnStorageResizer]; got != drv {
		t.Errorf("claim annotation %s = %q, want kube-controller-manager's %q", kube.AnnStorageResizer, got, drv)
	}
	seen := spy.requests(volID)
	if len(seen) == 0 {
		t.Fatalf("no ControllerExpandVolume call for volume %s", volID)
	}
	for _, s := range seen {
		if s.requiredBytes != 2<<30 || !s.mount || s.code != codes.OK {
			t.Errorf("ControllerExpandVolume request %v: want 2Gi and a mount capability", s)
		}
	}
	got, err := c.CoreV1().PersistentVolumes().Get(ctx, pv.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if q := got.Spec.Capacity[corev1.ResourceStorage]; q.Cmp(resource.MustParse("2Gi")) != 0 || got.Spec.Cinder == nil || got.Spec.CSI != nil {
		t.Errorf("PV after the expansion: capacity %s, source %+v; want 2Gi and the in-tree source kept", q.String(), got.Spec.PersistentVolumeSource)
	}
	for _, v := range d.Volumes() {
		if v.ID == volID && v.CapacityBytes != 2<<30 {
			t.Errorf("driver volume %s has %d bytes, want %d", v.ID, v.CapacityBytes, int64(2<<30))
		}
	}
	kubetest.WaitEvent(t, c, ns, "data", "FileSystemResizeRequired", "Require file system resize of volume on node")
}
