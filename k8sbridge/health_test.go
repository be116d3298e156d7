package k8sbridge

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/health"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
)

// healthInterval is --monitor-interval in these tests.
const healthInterval = time.Second

// driverClient dials a sample driver's own socket: what happens there
// happens behind the broker's back.
func driverClient(t *testing.T, d *sampledriver.Driver) csi.ControllerClient {
	t.Helper()
	conn, err := grpc.NewClient(d.Config().Endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return csi.NewControllerClient(conn)
}

// healthEvents are the Events with reason on claim name.
func healthEvents(t *testing.T, c kubernetes.Interface, ns, name, reason string) []corev1.Event {
	t.Helper()
	evs, err := c.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + name + ",reason=" + reason})
	if err != nil {
		t.Fatal(err)
	}
	return evs.Items
}

// waitSweeps waits until driver's sweeps with result number at least n.
func (r *bridgeRun) waitSweeps(t *testing.T, driver, result string, n float64) float64 {
	t.Helper()
	var got float64
	err := testenv.WaitFor(context.Background(), 30*time.Second, fmt.Sprintf("%v %s sweeps of %s", n, result, driver), func(context.Context) (bool, string, error) {
		got = r.metricValue(t, "csibroker_volume_health_sweeps_total", map[string]string{"driver": driver, "result": result})
		return got >= n, fmt.Sprint(got), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// TestVolumeHealthEndToEnd: drivers of each kind of volume health API
// behind the real chain, a bridge sweeping every second. A volume marked
// abnormal in the driver gets a Warning on its claim within two
// intervals, once however many sweeps see it; its recovery a Normal
// Event; a volume deleted at the driver behind the broker's back a
// VolumeNotFound Warning. A driver with ControllerGetVolume only is swept
// by it; a driver without volume health is never asked.
func TestVolumeHealthEndToEnd(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	type kind struct {
		name   string
		health sampledriver.HealthConfig
		// asked must be called and never must not.
		asked, never []string
	}
	kinds := []kind{
		{name: "health", asked: []string{"ControllerListVolumeHealth", "ListVolumes", "ControllerGetVolumeHealth"}, never: []string{"ControllerGetVolume"}},
		{name: "condition", health: sampledriver.HealthConfig{NoVolumeHealth: true}, asked: []string{"ListVolumes", "ControllerGetVolume"},
			never: []string{"ControllerListVolumeHealth", "ControllerGetVolumeHealth"}},
		{name: "getonly", health: sampledriver.HealthConfig{NoVolumeHealth: true, NoListVolumes: true}, asked: []string{"ControllerGetVolume"},
			never: []string{"ListVolumes", "ControllerListVolumeHealth", "ControllerGetVolumeHealth"}},
	}
	td := &testDrivers{}
	sds := map[string]*sampledriver.Driver{}
	name := func(k string) string { return kubetest.ClusterName(ns, k+".health.csi.test") }
	for _, k := range kinds {
		sds[k.name] = td.addDriver(t, sampledriver.Config{Name: name(k.name), Health: k.health})
	}
	noHealth := td.addDriver(t, sampledriver.Config{Name: name("none"), Health: sampledriver.HealthConfig{NoVolumeHealth: true, NoVolumeCondition: true}})
	r := startBridge(t, env, ns, td, bridgeOpts{configureCfg: func(cfg *Config) { cfg.MonitorInterval = healthInterval }})

	handle := map[string]string{} // claim → volume handle
	for _, k := range append(kinds, kind{name: "none"}) {
		class := kubetest.MakeClass(t, c, name(k.name), name(k.name), storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
		for _, cl := range []string{"ok", "sick", "lost"} {
			kubetest.MakeClaim(t, c, ns, k.name+"-"+cl, class.Name, "1Gi")
		}
	}
	for _, k := range append(kinds, kind{name: "none"}) {
		for _, cl := range []string{"ok", "sick", "lost"} {
			claim := k.name + "-" + cl
			pvName := kubetest.WaitBound(t, c, ns, claim, 60*time.Second).Spec.VolumeName
			pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			handle[claim] = pv.Spec.CSI.VolumeHandle
		}
	}
	// The PVs are Bound in the bridge's cache once a sweep has seen
	// them; from then on a change is what is measured.
	for _, k := range kinds {
		r.waitSweeps(t, name(k.name), "success", 2)
	}

	for _, k := range kinds {
		t.Run(k.name, func(t *testing.T) {
			d, drv := sds[k.name], name(k.name)
			sick, lost, ok := k.name+"-sick", k.name+"-lost", k.name+"-ok"
			msg := "replica lost on " + k.name
			start := time.Now()
			if err := d.SetVolumeCondition(handle[sick], true, msg); err != nil {
				t.Fatal(err)
			}
			kubetest.WaitEvent(t, c, ns, sick, health.ReasonAbnormal, msg)
			took := time.Since(start)
			t.Logf("%s: abnormal condition to Warning Event on the claim in %v (interval %v)", k.name, took.Round(time.Millisecond), healthInterval)
			if took > 2*healthInterval+500*time.Millisecond {
				t.Errorf("the Warning took %v, more than two intervals (%v)", took, 2*healthInterval)
			}
			// Three more sweeps see the same condition: no new Event.
			s := r.waitSweeps(t, drv, "success", 0)
			r.waitSweeps(t, drv, "success", s+3)
			if evs := healthEvents(t, c, ns, sick, health.ReasonAbnormal); len(evs) != 1 || evs[0].Count != 1 || evs[0].Type != corev1.EventTypeWarning {
				t.Errorf("want one Warning recorded once, got %s", kubetest.EventsOf(c, ns, sick))
			}
			if g := r.metricValue(t, "csibroker_volumes_abnormal", map[string]string{"driver": drv}); g != 1 {
				t.Errorf("csibroker_volumes_abnormal{driver=%s} = %v, want 1", drv, g)
			}

			if err := d.SetVolumeCondition(handle[sick], false, ""); err != nil {
				t.Fatal(err)
			}
			kubetest.WaitEvent(t, c, ns, sick, health.ReasonNormal, "normal again")

			if _, err := driverClient(t, d).DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: handle[lost]}); err != nil {
				t.Fatal(err)
			}
			kubetest.WaitEvent(t, c, ns, lost, health.ReasonNotFound, handle[lost])
			if g := r.metricValue(t, "csibroker_volumes_not_found", map[string]string{"driver": drv}); g != 1 {
				t.Errorf("csibroker_volumes_not_found{driver=%s} = %v, want 1", drv, g)
			}

			for _, reason := range []string{health.ReasonAbnormal, health.ReasonNormal, health.ReasonNotFound} {
				if evs := healthEvents(t, c, ns, ok, reason); len(evs) != 0 {
					t.Errorf("the healthy claim got %s: %s", reason, kubetest.EventsOf(c, ns, ok))
				}
			}
			calls := d.Calls()
			for _, m := range k.asked {
				if calls[m] == 0 {
					t.Errorf("%s never called (calls %v)", m, calls)
				}
			}
			for _, m := range k.never {
				if calls[m] != 0 {
					t.Errorf("%s called %d times (calls %v)", m, calls[m], calls)
				}
			}
		})
	}

	t.Run("none", func(t *testing.T) {
		s := r.waitSweeps(t, name("none"), "skipped", 1)
		r.waitSweeps(t, name("none"), "skipped", s+3)
		calls := noHealth.Calls()
		for _, m := range []string{"ListVolumes", "ControllerGetVolume", "ControllerGetVolumeHealth", "ControllerListVolumeHealth"} {
			if calls[m] != 0 {
				t.Errorf("a driver without volume health got %d %s calls", calls[m], m)
			}
		}
	})
}

// TestVolumeHealthThousandVolumes: 1,000 bound, healthy volumes of a
// driver with VOLUME_CONDITION and LIST_VOLUMES cost one paged ListVolumes
// sweep per interval (two pages of 500), not a call per volume, and no
// Event.
func TestVolumeHealthThousandVolumes(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	const n = 1000
	drv := kubetest.ClusterName(ns, "many.health.csi.test")
	td := &testDrivers{}
	d := td.addDriver(t, sampledriver.Config{Name: drv, Health: sampledriver.HealthConfig{NoVolumeHealth: true}})
	dc := driverClient(t, d)

	// The volumes, their PVs and claims, made directly (pre-bound pairs:
	// kube-controller-manager binds them).
	label := map[string]string{"csibroker-test-ns": ns}
	t.Cleanup(func() {
		c.CoreV1().PersistentVolumes().DeleteCollection(context.Background(), metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: "csibroker-test-ns=" + ns})
	})
	empty := ""
	work := make(chan int)
	errs := make(chan error, n)
	var wg sync.WaitGroup
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				errs <- makeBoundPair(ctx, c, dc, ns, drv, i, label, &empty)
			}
		}()
	}
	start := time.Now()
	for i := range n {
		work <- i
	}
	close(work)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	err := testenv.WaitFor(ctx, 3*time.Minute, fmt.Sprintf("%d PVs Bound", n), func(ctx context.Context) (bool, string, error) {
		pvs, err := c.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{LabelSelector: "csibroker-test-ns=" + ns})
		if err != nil {
			return false, err.Error(), nil
		}
		bound := 0
		for _, pv := range pvs.Items {
			if pv.Status.Phase == corev1.VolumeBound {
				bound++
			}
		}
		return bound == n, fmt.Sprintf("%d of %d bound", bound, len(pvs.Items)), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d volumes, PVs and claims made and bound in %v", n, time.Since(start).Round(time.Millisecond))

	r := startBridge(t, env, ns, td, bridgeOpts{configureCfg: func(cfg *Config) { cfg.MonitorInterval = healthInterval }})
	// The first sweep after the caches hold all of them.
	s0 := r.waitSweeps(t, drv, "success", 1)
	l0, g0, t0 := d.CallCount("ListVolumes"), d.CallCount("ControllerGetVolume"), time.Now()
	const sweeps = 5
	s1 := r.waitSweeps(t, drv, "success", s0+sweeps)
	l1, g1, t1 := d.CallCount("ListVolumes"), d.CallCount("ControllerGetVolume"), time.Now()
	swept := s1 - s0
	lists := float64(l1 - l0)
	t.Logf("%v sweeps of %d volumes in %v: %v ListVolumes calls, %d ControllerGetVolume calls", swept, n, t1.Sub(t0).Round(time.Millisecond), lists, g1-g0)
	// The driver's counts, read after the sweep counter, may hold pages of
	// the sweep in flight at either end: one sweep's worth either way.
	if lists < 2*(swept-1) || lists > 2*(swept+1) {
		t.Errorf("%v ListVolumes calls for %v sweeps: want two pages per sweep", lists, swept)
	}
	if g1 != g0 || d.CallCount("ControllerGetVolumeHealth") != 0 || d.CallCount("ControllerListVolumeHealth") != 0 {
		t.Errorf("per-volume calls made: %v", d.Calls())
	}
	if maxSweeps := t1.Sub(t0).Seconds()/healthInterval.Seconds() + 1; swept > maxSweeps {
		t.Errorf("%v sweeps in %v: more than one per interval", swept, t1.Sub(t0))
	}
	for _, reason := range []string{health.ReasonAbnormal, health.ReasonNormal, health.ReasonNotFound} {
		evs, err := c.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "reason=" + reason})
		if err != nil {
			t.Fatal(err)
		}
		if len(evs.Items) != 0 {
			t.Errorf("%d %s Events for healthy volumes, first: %s", len(evs.Items), reason, evs.Items[0].Message)
		}
	}
}

// makeBoundPair makes volume i at the driver, a PV of it pre-bound to
// claim vol-i, and that claim.
func makeBoundPair(ctx context.Context, c kubernetes.Interface, dc csi.ControllerClient, ns, drv string, i int, label map[string]string, class *string) error {
	name := fmt.Sprintf("vol-%04d", i)
	vol, err := dc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: ns + "-" + name, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}}})
	if err != nil {
		return fmt.Errorf("CreateVolume %s: %w", name, err)
	}
	size := resource.MustParse("1Mi")
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: kubetest.ClusterName(ns, name), Labels: label},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: size},
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			StorageClassName:              *class,
			ClaimRef:                      &corev1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: ns, Name: name},
			PersistentVolumeSource:        corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: drv, VolumeHandle: vol.GetVolume().GetVolumeId()}},
		},
	}
	if _, err := c.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create PV %s: %w", pv.Name, err)
	}
	claim := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			StorageClassName: class,
			VolumeName:       pv.Name,
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: size}},
		},
	}
	if _, err := c.CoreV1().PersistentVolumeClaims(ns).Create(ctx, claim, metav1.CreateOptions{}); err != nil && !strings.Contains(err.Error(), "already exists") {
		return fmt.Errorf("create claim %s: %w", name, err)
	}
	return nil
}
