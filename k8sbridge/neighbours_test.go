package k8sbridge

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/csiparams"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
)

// Two drivers behind one broker, driver A in trouble, driver B not: B's
// claims must not wait for A's (issue 35, "Neighbours").

// neighbourWorkers is the bridge's --worker-threads in these tests (and so
// each driver's --per-driver-workers, whose default it is).
const neighbourWorkers = 8

// neighbours is a running bridge with drivers A (its CreateVolume answers
// passed through troubleA) and B, both behind one broker (B's proxy is
// registered with A's broker too, so they share its process and client
// chain), and a class of each.
type neighbours struct {
	env            *testenv.Env
	ns             string
	run            *bridgeRun
	classA, classB string
	a, b           string
	drivers        *testDrivers
	dB             *sampledriver.Driver
}

func startNeighbours(t *testing.T, troubleA grpc.ServerOption, o bridgeOpts, both ...func(*sampledriver.Config)) *neighbours {
	t.Helper()
	n := newNeighbours(t, troubleA, both...)
	n.start(t, o)
	return n
}

// newNeighbours is startNeighbours without the bridge (start starts it).
func newNeighbours(t *testing.T, troubleA grpc.ServerOption, both ...func(*sampledriver.Config)) *neighbours {
	t.Helper()
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	n := &neighbours{env: env, ns: ns, a: kubetest.ClusterName(ns, "a.csi.test"), b: kubetest.ClusterName(ns, "b.csi.test")}
	drivers := &testDrivers{}
	var optsA []grpc.ServerOption
	if troubleA != nil {
		optsA = append(optsA, troubleA)
	}
	cfgA, cfgB := sampledriver.Config{Name: n.a, ServerOptions: optsA}, sampledriver.Config{Name: n.b}
	for _, f := range both {
		f(&cfgA)
		f(&cfgB)
	}
	drivers.addDriver(t, cfgA)
	n.dB = drivers.addDriver(t, cfgB)
	shareBroker(t, drivers, n.a, n.b)
	n.drivers = drivers
	imm, del := storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete
	n.classA = kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "a"), n.a, imm, del, nil).Name
	n.classB = kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "b"), n.b, imm, del, nil).Name
	return n
}

// start starts the bridge over the neighbours' drivers.
func (n *neighbours) start(t *testing.T, o bridgeOpts) {
	t.Helper()
	inner := o.configureCfg
	o.configureCfg = func(cfg *Config) {
		cfg.WorkerThreads = neighbourWorkers
		if inner != nil {
			inner(cfg)
		}
	}
	n.run = startBridge(t, n.env, n.ns, n.drivers, o)
}

// shareBroker registers driver to's proxy with driver from's broker and
// routes to's calls through it: one broker process, one client chain, a
// connection per driver's proxy, as a broker serving many drivers has.
func shareBroker(t *testing.T, d *testDrivers, from, to string) {
	t.Helper()
	d.mu.Lock()
	defer d.mu.Unlock()
	host, own := d.chains[from], d.chains[to]
	err := host.Broker.SetDriver(broker.DriverConfig{Name: to, Controller: &broker.ProxyConfig{Address: own.ProxyAddr}, Timeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	d.chains[to] = host
}

// timeToBound makes a claim of class and waits until it is Bound.
func (n *neighbours) timeToBound(t *testing.T, name, class string) time.Duration {
	t.Helper()
	start := time.Now()
	kubetest.MakeClaim(t, n.env.Client(), n.ns, name, class, "1Gi")
	kubetest.WaitBound(t, n.env.Client(), n.ns, name, 2*time.Minute)
	return time.Since(start)
}

// baselineB is the longest of two of B's claims bound while A is idle.
func (n *neighbours) baselineB(t *testing.T) time.Duration {
	t.Helper()
	return max(n.timeToBound(t, "b-alone-1", n.classB), n.timeToBound(t, "b-alone-2", n.classB))
}

// claimsOfA makes count claims of A's class.
func (n *neighbours) claimsOfA(t *testing.T, count int) {
	t.Helper()
	for i := range count {
		kubetest.MakeClaim(t, n.env.Client(), n.ns, fmt.Sprintf("a-%03d", i), n.classA, "1Gi")
	}
}

// neighbourBound is how long B's claim may take while A is in trouble:
// generous for a loaded machine, yet well below the 30s a call of A's
// takes to time out, which is what B would wait if A held its workers.
func neighbourBound(alone time.Duration) time.Duration { return 4*alone + 5*time.Second }

// waitCount waits until v reaches at least want.
func waitCount(t *testing.T, v *atomic.Int64, want int64, what string, timeout time.Duration) {
	t.Helper()
	err := testenv.WaitFor(context.Background(), timeout, what, func(context.Context) (bool, string, error) {
		got := v.Load()
		return got >= want, fmt.Sprintf("%d of %d", got, want), nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// hangMethod is a driver's server option that holds every call of method
// (counted in hung) until release is closed or the caller gives up,
// counting in answered each call that ended.
func hangMethod(method string, hung, answered *atomic.Int64, release <-chan struct{}) grpc.ServerOption {
	return grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		if !strings.HasSuffix(info.FullMethod, "/"+method) {
			return h(ctx, req)
		}
		hung.Add(1)
		defer answered.Add(1)
		select {
		case <-release:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		return h(ctx, req)
	})
}

// TestHungDriverHoldsOnlyItsOwn: driver A hangs every CreateVolume (the
// calls reach the driver and are never answered) with 100 claims
// pending; A's calls in flight are its per-driver slots, no more, and
// driver B's claim binds within a bound derived from B alone, while every
// one of A's calls is still hung.
func TestHungDriverHoldsOnlyItsOwn(t *testing.T) {
	var hung, answered atomic.Int64
	release := make(chan struct{})
	n := startNeighbours(t, hangMethod("CreateVolume", &hung, &answered, release), bridgeOpts{})
	t.Cleanup(func() { close(release) })
	alone := n.baselineB(t)

	const pendingA = 100
	n.claimsOfA(t, pendingA)
	waitCount(t, &hung, neighbourWorkers, "A's CreateVolume calls to hang, one per slot", time.Minute)
	took := n.timeToBound(t, "b-beside-hung-a", n.classB)
	if a := answered.Load(); a != 0 {
		t.Fatalf("%d of A's hung calls ended before B's claim was bound (after %v): B waited for them", a, took)
	}
	if h := hung.Load(); h != neighbourWorkers {
		t.Errorf("A has %d calls hung, want its %d per-driver slots, no more", h, neighbourWorkers)
	}
	if limit := neighbourBound(alone); took > limit {
		t.Fatalf("B's claim took %v beside hung A (alone: %v), want at most %v", took, alone, limit)
	}
	t.Logf("B alone: %v; beside A hung with %d claims pending (%d calls in flight): %v", alone, pendingA, hung.Load(), took)
	if early, err := n.run.exitedEarly(); early {
		t.Fatalf("the bridge stopped: %v", err)
	}
}

// garbageCreate answers A's CreateVolume calls, after the driver made the
// volume, with garbage of four kinds in turn: a message of another type
// (which does not decode as a CreateVolumeResponse), no volume ID, a
// negative capacity, a topology that is no label.
func garbageCreate(garbage *atomic.Int64) grpc.ServerOption {
	return grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		resp, err := h(ctx, req)
		cv, ok := resp.(*csi.CreateVolumeResponse)
		if !ok || err != nil {
			return resp, err
		}
		v := *cv.GetVolume()
		switch garbage.Add(1) % 4 {
		case 0:
			return &csi.GetCapacityResponse{AvailableCapacity: 42}, nil
		case 1:
			v.VolumeId = ""
		case 2:
			v.CapacityBytes = -1
		case 3:
			v.AccessibleTopology = []*csi.Topology{{Segments: map[string]string{"not a label": "x"}}}
		}
		return &csi.CreateVolumeResponse{Volume: &v}, nil
	})
}

// TestGarbageDriverHoldsOnlyItsOwn: driver A answers every CreateVolume
// with garbage, 100 claims of it failing and retried; driver B's claim
// binds within a bound derived from B alone, A's claims fail with Events
// naming what is wrong, and the bridge runs on.
func TestGarbageDriverHoldsOnlyItsOwn(t *testing.T) {
	var garbage atomic.Int64
	n := startNeighbours(t, garbageCreate(&garbage), bridgeOpts{})
	alone := n.baselineB(t)

	const pendingA = 100
	n.claimsOfA(t, pendingA)
	waitCount(t, &garbage, pendingA, "garbage answers for every one of A's claims", 2*time.Minute)
	took := n.timeToBound(t, "b-beside-garbage-a", n.classB)
	if limit := neighbourBound(alone); took > limit {
		t.Fatalf("B's claim took %v beside A answering garbage (alone: %v), want at most %v", took, alone, limit)
	}
	t.Logf("B alone: %v; beside A answering garbage to %d claims (%d answers so far): %v", alone, pendingA, garbage.Load(), took)
	c := n.env.Client()
	kubetest.WaitEvent(t, c, n.ns, "a-000", "ProvisioningFailed", "CreateVolume")
	pvc, err := c.CoreV1().PersistentVolumeClaims(n.ns).Get(context.Background(), "a-000", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if pvc.Status.Phase == corev1.ClaimBound {
		t.Fatal("a claim of A is Bound on a garbage answer")
	}
	if early, err := n.run.exitedEarly(); early {
		t.Fatalf("the bridge stopped: %v", err)
	}
}

// TestPanicInOneDriverFailsOnlyItsItems: the test hook makes every work
// item of driver A panic in the provision controller (holding A's slot).
// Each of A's claims gets a WorkItemPanicked Event (neither the panic's
// value nor its stack in it; both in the log), the panics are counted,
// and each item is retried; B's claims are provisioned meanwhile, and the
// bridge never stops. Once the hook stops panicking, A's claims are
// provisioned too: the panics gave back every slot they held.
func TestPanicInOneDriverFailsOnlyItsItems(t *testing.T) {
	const marker = "injected-test-panic-value"
	var panicking atomic.Bool
	panicking.Store(true)
	var mu sync.Mutex
	hits := map[string]int{}
	var driverA atomic.Value // set once the namespace names it
	driverA.Store("")
	hook := func(controller, driver, key string) {
		if controller != "provision" || driver != driverA.Load().(string) || !panicking.Load() {
			return
		}
		mu.Lock()
		hits[key]++
		mu.Unlock()
		panic(marker)
	}
	n := startNeighbours(t, nil, bridgeOpts{configureCfg: func(cfg *Config) { cfg.PanicHook = hook }})
	driverA.Store(n.a)
	c := n.env.Client()
	const claimsA = neighbourWorkers + 4 // more than A's slots: a slot a panic kept would stop A for good
	n.claimsOfA(t, claimsA)
	for i := range 3 {
		n.timeToBound(t, fmt.Sprintf("b-%d", i), n.classB)
	}
	for i := range claimsA {
		ev := kubetest.WaitEvent(t, c, n.ns, fmt.Sprintf("a-%03d", i), kube.ReasonWorkItemPanicked, "provision controller")
		if strings.Contains(ev.Message, marker) || strings.Contains(ev.Message, "goroutine") {
			t.Fatalf("the Event quotes the panic: %q", ev.Message)
		}
	}
	err := testenv.WaitFor(context.Background(), time.Minute, "an item of A retried after its panic", func(context.Context) (bool, string, error) {
		mu.Lock()
		defer mu.Unlock()
		most := 0
		for _, h := range hits {
			most = max(most, h)
		}
		return most >= 2, fmt.Sprint(hits), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if p := n.run.metricValue(t, "csibroker_work_item_panics_total", map[string]string{"controller": "provision"}); p < claimsA {
		t.Errorf("%v panics counted, want at least %d", p, claimsA)
	}
	if logs := n.run.logs.String(); !strings.Contains(logs, "work item panicked") || !strings.Contains(logs, marker) || !strings.Contains(logs, "goroutine") {
		t.Error("the log has no line of the panic with its value and stack")
	}
	if early, err := n.run.exitedEarly(); early {
		t.Fatalf("the bridge stopped: %v", err)
	}
	panicking.Store(false)
	for i := range claimsA {
		kubetest.WaitBound(t, c, n.ns, fmt.Sprintf("a-%03d", i), 2*time.Minute)
	}
}

// TestHungCapacityHoldsOnlyItsOwn: driver A hangs every GetCapacity, with
// twice as many of its classes as the capacity controller has workers;
// driver B's new class gets its CSIStorageCapacity within a bound derived
// from B alone, while every one of A's calls is still hung.
func TestHungCapacityHoldsOnlyItsOwn(t *testing.T) {
	fastCapacityPolls(t)
	var hung, answered atomic.Int64
	release := make(chan struct{})
	seg := []map[string]string{{testenv.LabelZone: "z1"}}
	n := startNeighbours(t, hangMethod("GetCapacity", &hung, &answered, release), bridgeOpts{}, func(c *sampledriver.Config) {
		c.ControllerSegments, c.CapacityBytes = seg, 10*gib
	})
	t.Cleanup(func() { close(release) })
	c := n.env.Client()
	node := kubetest.ClusterName(n.ns, "node-z1")
	addNode(t, n.env, testenv.NodeSpec{Name: node, Zone: "z1"}, n.a, []string{testenv.LabelZone})
	if err := n.env.AddCSINode(context.Background(), node, n.b, node, []string{testenv.LabelZone}); err != nil {
		t.Fatal(err)
	}
	wffc, del := storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete
	want := map[string]int64{}
	classOfB := func(name string) time.Duration {
		start := time.Now()
		class := kubetest.MakeClass(t, c, kubetest.ClusterName(n.ns, name), n.b, wffc, del, nil)
		want[segmentKey(class.Name, testenv.LabelZone, "z1")] = 10 * gib
		waitCapacities(t, c, n.ns, n.b, want)
		return time.Since(start)
	}
	alone := classOfB("b-alone")

	const capacityWorkers = 4 // the capacity controller's
	for i := range 2 * capacityWorkers {
		kubetest.MakeClass(t, c, kubetest.ClusterName(n.ns, fmt.Sprintf("a-%d", i)), n.a, wffc, del, nil)
	}
	waitCount(t, &hung, capacityWorkers, "A's GetCapacity calls to hang on every worker", time.Minute)
	took := classOfB("b-beside-hung-a")
	if a := answered.Load(); a != 0 {
		t.Fatalf("%d of A's hung calls ended before B's object was written (after %v): B waited for them", a, took)
	}
	if limit := neighbourBound(alone); took > limit {
		t.Fatalf("B's capacity object took %v beside hung A (alone: %v), want at most %v", took, alone, limit)
	}
	t.Logf("B's object alone: %v; beside A's %d hung GetCapacity calls: %v", alone, hung.Load(), took)
}

// TestHungDriverHoldsUpOnlyItsOwnRecovery: the intent record holds four
// orphans of driver A, whose every CreateVolume (the recovery's reissue)
// hangs, recorded before one orphan of driver B. B's orphan is deleted
// while every one of A's calls is still hung: recovery does not clean up
// one driver's volumes behind another's.
func TestHungDriverHoldsUpOnlyItsOwnRecovery(t *testing.T) {
	var hung, answered atomic.Int64
	release := make(chan struct{})
	n := newNeighbours(t, hangMethod("CreateVolume", &hung, &answered, release))
	t.Cleanup(func() { close(release) })
	c := n.env.Client()
	for i := range 4 {
		claim := goneClaim(t, c, n.ns, fmt.Sprintf("a-gone-%d", i))
		recordIntent(t, c, n.ns, intentFor(t, n.a, csiparams.VolumeName("pvc", claim.UID, 0), claim))
	}
	claimB := goneClaim(t, c, n.ns, "b-gone")
	volB := csiparams.VolumeName("pvc", claimB.UID, 0)
	createDriverVolume(t, n.drivers, n.b, volB)
	recordIntent(t, c, n.ns, intentFor(t, n.b, volB, claimB))
	n.start(t, bridgeOpts{configureCfg: func(cfg *Config) { cfg.RecoveryInterval = 400 * time.Millisecond }})

	waitCount(t, &hung, 1, "recovery's CreateVolume of A to hang", time.Minute)
	err := testenv.WaitFor(context.Background(), time.Minute, "B's orphan deleted", func(context.Context) (bool, string, error) {
		return !hasVolume(n.dB, volB), fmt.Sprintf("%d of A's calls hung, %d ended", hung.Load(), answered.Load()), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if a := answered.Load(); a != 0 {
		t.Fatalf("%d of A's hung calls ended before B's orphan was deleted: B's clean-up waited for them", a)
	}
}

// TestPanicInOneDriversCapacityFailsOnlyItsOwn: the test hook makes every
// capacity refresh of driver A panic. A's class gets a WorkItemPanicked
// Event and no object; B's class gets its object; the bridge runs on.
func TestPanicInOneDriversCapacityFailsOnlyItsOwn(t *testing.T) {
	fastCapacityPolls(t)
	var driverA atomic.Value
	driverA.Store("")
	hook := func(controller, driver, _ string) {
		if controller == "capacity" && driver == driverA.Load().(string) {
			panic("injected-capacity-panic")
		}
	}
	seg := []map[string]string{{testenv.LabelZone: "z1"}}
	n := newNeighbours(t, nil, func(c *sampledriver.Config) { c.ControllerSegments, c.CapacityBytes = seg, 10*gib })
	driverA.Store(n.a)
	c := n.env.Client()
	node := kubetest.ClusterName(n.ns, "node-z1")
	addNode(t, n.env, testenv.NodeSpec{Name: node, Zone: "z1"}, n.a, []string{testenv.LabelZone})
	if err := n.env.AddCSINode(context.Background(), node, n.b, node, []string{testenv.LabelZone}); err != nil {
		t.Fatal(err)
	}
	wffc, del := storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete
	classA := kubetest.MakeClass(t, c, kubetest.ClusterName(n.ns, "cap-a"), n.a, wffc, del, nil)
	classB := kubetest.MakeClass(t, c, kubetest.ClusterName(n.ns, "cap-b"), n.b, wffc, del, nil)
	n.start(t, bridgeOpts{configureCfg: func(cfg *Config) { cfg.PanicHook = hook }})

	ev := kubetest.WaitEvent(t, c, "default", classA.Name, kube.ReasonWorkItemPanicked, "capacity controller")
	if strings.Contains(ev.Message, "injected") || strings.Contains(ev.Message, "goroutine") {
		t.Fatalf("the Event quotes the panic: %q", ev.Message)
	}
	waitCapacities(t, c, n.ns, n.b, map[string]int64{segmentKey(classB.Name, testenv.LabelZone, "z1"): 10 * gib})
	if objs, err := capacityObjects(context.Background(), c, n.ns, n.a); err != nil || len(objs) != 0 {
		t.Fatalf("A's objects %s (%v): want none, every refresh of A panicked", describeCapacities(objs), err)
	}
	if p := n.run.metricValue(t, "csibroker_work_item_panics_total", map[string]string{"controller": "capacity"}); p < 1 {
		t.Errorf("%v capacity panics counted", p)
	}
	if early, err := n.run.exitedEarly(); early {
		t.Fatalf("the bridge stopped: %v", err)
	}
}
