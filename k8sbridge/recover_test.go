package k8sbridge

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/csiparams"
	"github.com/csibroker/csibroker/k8sbridge/intent"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
)

// recordIntent writes in into the namespace's intent record, as a broker
// that died after recording it would have left it.
func recordIntent(t *testing.T, c kubernetes.Interface, ns string, in intent.Intent) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := intent.NewStore(c, ns, "csibroker-intents", nil)
	go s.Run(ctx)
	addCtx, addCancel := context.WithTimeout(ctx, 30*time.Second)
	defer addCancel()
	if err := s.Add(addCtx, in); err != nil {
		t.Fatal(err)
	}
}

// createRequest is the CreateVolume the broker would send for volume name.
func createRequest(name string) *csi.CreateVolumeRequest {
	return &csi.CreateVolumeRequest{
		Name:               name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: 1 << 20},
		VolumeCapabilities: mountCaps(),
	}
}

// intentFor is the entry a broker records before creating volume name for claim.
func intentFor(t *testing.T, driver, name string, claim *corev1.PersistentVolumeClaim) intent.Intent {
	t.Helper()
	raw, err := proto.Marshal(createRequest(name))
	if err != nil {
		t.Fatal(err)
	}
	return intent.Intent{VolumeName: name, Driver: driver, ClaimNamespace: claim.Namespace, ClaimName: claim.Name, ClaimUID: string(claim.UID), Request: raw, Created: metav1.Now()}
}

// createDriverVolume makes volume name on the driver through its chain, as
// the broker would have, and returns its ID.
func createDriverVolume(t *testing.T, drivers *testDrivers, driver, name string) string {
	t.Helper()
	return createDriverVolumeWith(t, drivers, driver, createRequest(name))
}

// createDriverVolumeWith is createDriverVolume with the whole request.
func createDriverVolumeWith(t *testing.T, drivers *testDrivers, driver string, req *csi.CreateVolumeRequest) string {
	t.Helper()
	conn, err := drivers.ControllerConn(driver)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := csi.NewControllerClient(conn).CreateVolume(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	return resp.GetVolume().GetVolumeId()
}

// makeStaticClaim makes a claim no provisioner acts on (empty class),
// pre-bound to PV volumeName when it is not empty.
func makeStaticClaim(t *testing.T, c kubernetes.Interface, ns, name, volumeName string) *corev1.PersistentVolumeClaim {
	t.Helper()
	empty := ""
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			StorageClassName: &empty,
			VolumeName:       volumeName,
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Mi")}},
		},
	}
	pvc, err := c.CoreV1().PersistentVolumeClaims(ns).Create(context.Background(), pvc, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pvc
}

func hasVolume(d *sampledriver.Driver, name string) bool {
	for _, v := range d.Volumes() {
		if v.Name == name {
			return true
		}
	}
	return false
}

// TestRecoverBoundClaimWithoutItsPV: intent entries whose claim still
// exists and is bound, while no PV of the entry's name exists, are settled.
//   - "prebound" was bound by an admin to a static PV: the volume the broker
//     made under the claim's own name is an orphan and is deleted.
//   - "retained" is bound to the entry's own PV, which is gone (its reclaim
//     policy kept the volume, then an admin deleted the PV): the entry is
//     dropped and the volume left alone.
func TestRecoverBoundClaimWithoutItsPV(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "bound.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})

	// a. A static PV of a pre-existing volume, and a claim pre-bound to it.
	staticName := kubetest.ClusterName(ns, "static")
	staticID := createDriverVolume(t, drivers, drv, staticName)
	static := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: staticName},
		Spec: corev1.PersistentVolumeSpec{
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Mi")},
			PersistentVolumeSource:        corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: drv, VolumeHandle: staticID}},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
		},
	}
	if _, err := c.CoreV1().PersistentVolumes().Create(ctx, static, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.CoreV1().PersistentVolumes().Delete(context.Background(), staticName, metav1.DeleteOptions{})
	})
	prebound := makeStaticClaim(t, c, ns, "prebound", staticName)
	kubetest.WaitBound(t, c, ns, "prebound", 60*time.Second)
	orphan := csiparams.VolumeName("pvc", prebound.UID, 0)
	createDriverVolume(t, drivers, drv, orphan)
	recordIntent(t, c, ns, intentFor(t, drv, orphan, prebound))

	// b. A claim bound to its own PV (as the PV controller binds it),
	// the PV since deleted; its volume stays on the driver.
	retained := makeStaticClaim(t, c, ns, "retained", "")
	kept := csiparams.VolumeName("pvc", retained.UID, 0)
	retained.Spec.VolumeName = kept
	if _, err := c.CoreV1().PersistentVolumeClaims(ns).Update(ctx, retained, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	createDriverVolume(t, drivers, drv, kept)
	recordIntent(t, c, ns, intentFor(t, drv, kept, retained))

	creates := d.CallCount("CreateVolume")
	r := startBridge(t, env, ns, drivers, bridgeOpts{})
	store := intent.NewStore(c, ns, "csibroker-intents", nil)
	err := testenv.WaitFor(ctx, 60*time.Second, "the intent record to empty", func(ctx context.Context) (bool, string, error) {
		intents, err := store.List(ctx)
		if err != nil {
			return false, err.Error(), nil
		}
		return len(intents) == 0, fmt.Sprintf("%d entries %v", len(intents), intents), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if hasVolume(d, orphan) {
		t.Errorf("volume %s of the claim pre-bound to %s was not deleted", orphan, staticName)
	}
	if !hasVolume(d, kept) {
		t.Errorf("volume %s, whose PV's lifecycle decided its fate, was deleted by recovery", kept)
	}
	if !hasVolume(d, staticName) {
		t.Errorf("the static volume %s was deleted", staticName)
	}
	// One CreateVolume (to learn the orphan's ID) and one DeleteVolume,
	// both for the orphan; none for the retained volume.
	if n := d.CallCount("CreateVolume") - creates; n != 1 {
		t.Errorf("recovery made %d CreateVolume calls, want 1", n)
	}
	if n := d.CallCount("DeleteVolume"); n != 1 {
		t.Errorf("recovery made %d DeleteVolume calls, want 1", n)
	}
	if v := r.metricValue(t, "csibroker_recovered_volumes_total", map[string]string{"driver": drv, "result": "deleted"}); v != 1 {
		t.Errorf("recovered_volumes_total{result=deleted} = %v, want 1", v)
	}
	logs := r.logs.String()
	if !strings.Contains(logs, "recovery: deleted an orphaned volume") || !strings.Contains(logs, "claim is bound to PersistentVolume "+staticName) {
		t.Errorf("no log line for the deleted orphan:\n%s", tail(logs, 40))
	}
	found := false
	for _, line := range strings.Split(logs, "\n") {
		if strings.Contains(line, "level=INFO") && strings.Contains(line, "volume="+kept) && strings.Contains(line, "no longer exists") {
			found = true
		}
	}
	if !found {
		t.Errorf("no Info log line for the dropped entry of %s:\n%s", kept, tail(logs, 40))
	}
	// The pre-bound claim still holds its static PV.
	if pvc, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "prebound", metav1.GetOptions{}); err != nil || pvc.Spec.VolumeName != staticName {
		t.Errorf("claim prebound: %v, bound to %q", err, pvc.Spec.VolumeName)
	}
}

// TestRecoverBacksOffFailingCalls: the claim of an entry is gone and the
// driver refuses, four times with a final code, the re-issued CreateVolume
// (which tells recovery the volume's ID) or the DeleteVolume after it.
// Recovery keeps trying, each time after a longer wait (1, 2, 4, 8 recovery
// intervals), not once per pass, reports the entry as stuck at the third
// failure, and deletes the volume once the call succeeds.
func TestRecoverBacksOffFailingCalls(t *testing.T) {
	for _, method := range []string{"CreateVolume", "DeleteVolume"} {
		t.Run(method, func(t *testing.T) { testRecoverBacksOff(t, method) })
	}
}

// goneClaim makes claim ns/name and deletes it, and returns it as made
// once the API server no longer has it.
func goneClaim(t *testing.T, c kubernetes.Interface, ns, name string) *corev1.PersistentVolumeClaim {
	t.Helper()
	ctx := context.Background()
	claim := makeStaticClaim(t, c, ns, name, "")
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	err := testenv.WaitFor(ctx, 30*time.Second, "claim "+name+" deleted", func(ctx context.Context) (bool, string, error) {
		_, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), fmt.Sprint(err), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return claim
}

func testRecoverBacksOff(t *testing.T, method string) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "refuse.csi.test")
	const failures = 4
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv, Faults: sampledriver.Faults{Methods: map[string]sampledriver.Fault{
		method: {First: failures, Code: codes.FailedPrecondition}}}})

	claim := goneClaim(t, c, ns, "gone")
	vol := csiparams.VolumeName("pvc", claim.UID, 0)
	recordIntent(t, c, ns, intentFor(t, drv, vol, claim))

	const interval = 400 * time.Millisecond
	r := startBridge(t, env, ns, drivers, bridgeOpts{configureCfg: func(cfg *Config) { cfg.RecoveryInterval = interval }})

	err := testenv.WaitFor(ctx, 60*time.Second, fmt.Sprintf("%d %s calls", failures+1, method), func(context.Context) (bool, string, error) {
		n := d.CallCount(method)
		return n >= failures+1, fmt.Sprintf("%d calls", n), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	noLeaks(t, env, ns, d, drv)
	// When each call of method reached the driver, as the driver saw it.
	calls := d.CallTimes(method)
	if len(calls) != failures+1 {
		t.Fatalf("driver recorded %d %s calls, want %d", len(calls), method, failures+1)
	}

	// Once per pass, the five calls would come one interval apart; with
	// the backoff the k-th wait is 2^(k-1) intervals, up to half an
	// interval early.
	elapsed := calls[len(calls)-1].Sub(calls[0])
	t.Logf("%s calls %v apart over %v (%.1f recovery intervals)", method, gaps(calls), elapsed.Round(time.Millisecond), float64(elapsed)/float64(interval))
	for k, g := range gaps(calls) {
		want := time.Duration(1<<k)*interval - interval/2
		if g < want {
			t.Errorf("wait %d before retrying %s was %v, want at least %v (calls %v apart)", k+1, method, g.Round(time.Millisecond), want, gaps(calls))
		}
	}
	if passes := float64(elapsed) / float64(interval); passes < 2*float64(len(calls)) {
		t.Errorf("%d %s calls over %.1f recovery passes: not backing off", len(calls), method, passes)
	}
	// Settled: no further calls over three more passes.
	from := r.b.prov.RecoveryPasses()
	err = testenv.WaitFor(context.Background(), 30*time.Second, "three more recovery passes", func(context.Context) (bool, string, error) {
		n := r.b.prov.RecoveryPasses()
		return n >= from+3, fmt.Sprintf("%d passes", n-from), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := d.CallCount(method); n != failures+1 {
		t.Errorf("%d %s calls after the entry was settled, want %d", n, method, failures+1)
	}
	if v := r.metricValue(t, "csibroker_recovered_volumes_total", map[string]string{"driver": drv, "result": "stuck"}); v != 1 {
		t.Errorf("recovered_volumes_total{result=stuck} = %v, want 1 (at the third failure)", v)
	}
	if v := r.metricValue(t, "csibroker_recovered_volumes_total", map[string]string{"driver": drv, "result": "deleted"}); v != 1 {
		t.Errorf("recovered_volumes_total{result=deleted} = %v, want 1", v)
	}
}

// TestRecoverBacksOffAnUnreachableDriver: an orphan entry whose driver is
// not registered (its proxy gone, say) is retried with the same backoff as
// a failed call, not on every pass (each attempt costs API reads of its
// claim and PV), and is reported as stuck at the third failure.
func TestRecoverBacksOffAnUnreachableDriver(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "absent.csi.test")
	claim := goneClaim(t, c, ns, "gone")
	recordIntent(t, c, ns, intentFor(t, drv, csiparams.VolumeName("pvc", claim.UID, 0), claim))

	const interval = 200 * time.Millisecond
	r := startBridge(t, env, ns, &testDrivers{}, bridgeOpts{configureCfg: func(cfg *Config) { cfg.RecoveryInterval = interval }})
	const passes = 16
	err := testenv.WaitFor(ctx, 60*time.Second, fmt.Sprintf("%d recovery passes", passes), func(context.Context) (bool, string, error) {
		n := r.b.prov.RecoveryPasses()
		return n >= passes, fmt.Sprintf("%d passes", n), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// Waits of 1, 2, 4 and 8 intervals (half an interval early at most):
	// attempts in passes 0, 1, 3, 7 and 15, five in sixteen passes.
	attempts := strings.Count(r.logs.String(), "unknown driver")
	if attempts < 3 || attempts > 6 {
		t.Errorf("%d attempts in %d recovery passes, want 3 to 6 (backing off)", attempts, passes)
	}
	if v := r.metricValue(t, "csibroker_recovered_volumes_total", map[string]string{"driver": drv, "result": "stuck"}); v != 1 {
		t.Errorf("recovered_volumes_total{result=stuck} = %v, want 1 (at the third failure)", v)
	}
}

func gaps(ts []time.Time) []time.Duration {
	var out []time.Duration
	for i := 1; i < len(ts); i++ {
		out = append(out, ts[i].Sub(ts[i-1]).Round(time.Millisecond))
	}
	return out
}
