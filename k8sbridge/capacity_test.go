package k8sbridge

import (
	"context"
	"fmt"
	"runtime"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/capacity"
	"github.com/csibroker/csibroker/k8sbridge/csiparams"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
)

const gib = int64(1) << 30

// fastCapacityPolls makes the capacity controller of bridges started by this
// test poll every 500ms and notice (un)registered drivers within 200ms.
func fastCapacityPolls(t *testing.T) {
	t.Helper()
	poll, reg, grace := capacity.PollInterval, capacity.RegistryInterval, capacity.UnregisteredGrace
	capacity.PollInterval, capacity.RegistryInterval, capacity.UnregisteredGrace = 500*time.Millisecond, 200*time.Millisecond, 4*time.Second
	t.Cleanup(func() {
		capacity.PollInterval, capacity.RegistryInterval, capacity.UnregisteredGrace = poll, reg, grace
	})
}

// longCapacityGrace makes the grace period of bridges started by this test
// after the call 15s: long enough that a loaded machine watching the
// objects through it does not see it end early. Call it after
// fastCapacityPolls and before starting a bridge.
func longCapacityGrace(t *testing.T) {
	t.Helper()
	prev := capacity.UnregisteredGrace
	capacity.UnregisteredGrace = 15 * time.Second
	t.Cleanup(func() { capacity.UnregisteredGrace = prev })
}

// waitLogLine waits until a line of r's log holds every one of parts.
func waitLogLine(t *testing.T, r *bridgeRun, parts ...string) {
	t.Helper()
	err := testenv.WaitFor(context.Background(), 30*time.Second, fmt.Sprintf("a log line with %q", parts), func(context.Context) (bool, string, error) {
		for _, line := range strings.Split(r.logs.String(), "\n") {
			found := true
			for _, p := range parts {
				found = found && strings.Contains(line, p)
			}
			if found {
				return true, "", nil
			}
		}
		return false, "", nil
	})
	if err != nil {
		t.Fatalf("%v\n%s", err, tail(r.logs.String(), 30))
	}
}

// mountCaps is a generic mount capability, for volumes the tests make
// behind the broker's back.
func mountCaps() []*csi.VolumeCapability {
	return []*csi.VolumeCapability{{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}}
}

// capacityObjects lists the broker's capacity objects of driver in ns, keyed
// by "class segment-labels".
func capacityObjects(ctx context.Context, c kubernetes.Interface, ns, driver string) (map[string]storagev1.CSIStorageCapacity, error) {
	list, err := c.StorageV1().CSIStorageCapacities(ns).List(ctx, metav1.ListOptions{LabelSelector: capacity.LabelDriver + "=" + driver})
	if err != nil {
		return nil, err
	}
	out := map[string]storagev1.CSIStorageCapacity{}
	for _, o := range list.Items {
		k := o.StorageClassName + " " + capacity.SegmentOf(&o)
		if _, dup := out[k]; dup {
			k += " (duplicate " + o.Name + ")"
		}
		out[k] = o
	}
	return out, nil
}

func describeCapacities(objs map[string]storagev1.CSIStorageCapacity) string {
	var lines []string
	for k, o := range objs {
		maxSize := "-"
		if o.MaximumVolumeSize != nil {
			maxSize = o.MaximumVolumeSize.String()
		}
		lines = append(lines, fmt.Sprintf("%s: %s capacity %s max %s", k, o.Name, o.Capacity.String(), maxSize))
	}
	sort.Strings(lines)
	return "[" + strings.Join(lines, "; ") + "]"
}

// waitCapacities waits until the driver's objects are exactly want ("class
// segment" → bytes of capacity and of maximum volume size) and returns them.
func waitCapacities(t *testing.T, c kubernetes.Interface, ns, driver string, want map[string]int64) map[string]storagev1.CSIStorageCapacity {
	t.Helper()
	var got map[string]storagev1.CSIStorageCapacity
	err := testenv.WaitFor(context.Background(), 60*time.Second, fmt.Sprintf("capacity objects of %s to be %v", driver, want), func(ctx context.Context) (bool, string, error) {
		var err error
		if got, err = capacityObjects(ctx, c, ns, driver); err != nil {
			return false, err.Error(), nil
		}
		if len(got) != len(want) {
			return false, describeCapacities(got), nil
		}
		for k, bytes := range want {
			o, ok := got[k]
			if !ok || o.Capacity == nil || o.Capacity.Value() != bytes || o.MaximumVolumeSize == nil || o.MaximumVolumeSize.Value() != bytes {
				return false, describeCapacities(got), nil
			}
		}
		return true, "", nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

func segmentKey(class, key, value string) string { return class + " {" + key + "=" + value + "}" }

// TestCapacityZonalDriverTwoClasses: a driver serving two zones and two of
// its classes give one CSIStorageCapacity per class and zone with what
// GetCapacity reports, owned by the intent ConfigMap; a volume provisioned
// through the broker shows after a poll; a refresh that finds nothing
// changed writes nothing; a deleted class loses its objects; the garbage
// collector removes objects whose owner is deleted, and the broker makes
// them again under the new owner.
func TestCapacityZonalDriverTwoClasses(t *testing.T) {
	fastCapacityPolls(t)
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "zonal.csi.test")
	var segs []map[string]string
	for _, z := range []string{"z1", "z2"} {
		node := kubetest.ClusterName(ns, "node-"+z)
		addNode(t, env, testenv.NodeSpec{Name: node, Zone: z}, drv, []string{testenv.LabelZone})
		segs = append(segs, map[string]string{testenv.LabelZone: z})
	}
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv, ControllerSegments: segs, CapacityBytes: 10 * gib})
	wffc, del := storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete
	classA := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "a"), drv, wffc, del, nil)
	classB := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "b"), drv, wffc, del, map[string]string{"label": "blue", csiparams.ParamFSType: "ext4"})
	// An Immediate class of the driver gets no objects (the scheduler
	// reads capacity for WaitForFirstConsumer claims only): the exact sets
	// waited for below, the later ones many polls on, hold none of it.
	kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "immediate"), drv, storagev1.VolumeBindingImmediate, del, nil)
	run := startBridge(t, env, ns, drivers, bridgeOpts{})

	all := func(bytes int64) map[string]int64 {
		return map[string]int64{
			segmentKey(classA.Name, testenv.LabelZone, "z1"): bytes, segmentKey(classA.Name, testenv.LabelZone, "z2"): bytes,
			segmentKey(classB.Name, testenv.LabelZone, "z1"): bytes, segmentKey(classB.Name, testenv.LabelZone, "z2"): bytes,
		}
	}
	objs := waitCapacities(t, c, ns, drv, all(10*gib))
	cm, err := c.CoreV1().ConfigMaps(ns).Get(ctx, "csibroker-intents", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for k, o := range objs {
		switch {
		case len(o.OwnerReferences) != 1 || o.OwnerReferences[0].Kind != "ConfigMap" || o.OwnerReferences[0].UID != cm.UID:
			t.Errorf("%s: owners %+v, want the intent ConfigMap %s", k, o.OwnerReferences, cm.UID)
		case o.Labels[capacity.LabelManagedBy] != capacity.ManagedBy || !strings.HasPrefix(o.Name, capacity.GenerateName):
			t.Errorf("%s: name %s labels %v", k, o.Name, o.Labels)
		case o.NodeTopology == nil || len(o.NodeTopology.MatchLabels) != 1 || len(o.NodeTopology.MatchExpressions) != 0:
			t.Errorf("%s: node topology %+v", k, o.NodeTopology)
		}
	}
	// The driver saw the class parameters without csi.storage.k8s.io/ keys
	// (the sample driver would answer 0 for a capability it cannot serve).
	if n := d.CallCount("GetCapacity"); n < 4 {
		t.Fatalf("GetCapacity called %d times", n)
	}

	// A volume provisioned through the broker: free space drops in both
	// zones (one pool serves both).
	kubetest.MakeClaim(t, c, ns, "claim", classA.Name, "1Gi")
	kubetest.MakePod(t, c, ns, "pod", "claim")
	kubetest.WaitBound(t, c, ns, "claim", 60*time.Second)
	objs = waitCapacities(t, c, ns, drv, all(9*gib))

	// Nothing changes: refreshes write nothing. Two full polls (every key
	// refreshed twice, found unchanged) make no create, update or delete.
	writes := func() float64 { return run.metricValue(t, "csibroker_capacity_api_writes_total", nil) }
	unchanged := func() float64 {
		return run.metricValue(t, "csibroker_capacity_refreshes_total", map[string]string{"driver": drv, "result": "unchanged"})
	}
	// The objects are read back before the controller counts its last
	// update: wait until the four creates and four updates are counted.
	err = testenv.WaitFor(ctx, 10*time.Second, "the updates counted", func(context.Context) (bool, string, error) {
		w := writes()
		return w >= 8, fmt.Sprintf("%v writes counted", w), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	w0, u0 := writes(), unchanged()
	err = testenv.WaitFor(ctx, 60*time.Second, "two polls without change", func(context.Context) (bool, string, error) {
		u := unchanged()
		return u >= u0+8, fmt.Sprintf("%v unchanged refreshes", u-u0), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if w := writes(); w != w0 {
		t.Fatalf("%v API writes during refreshes that found nothing changed", w-w0)
	}
	t.Logf("API writes so far: %v (4 creates, 4 updates after the volume)", w0)

	// A deleted class loses its objects; the other class keeps its own
	// (same objects, not recreated).
	if err := c.StorageV1().StorageClasses().Delete(ctx, classB.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	left := waitCapacities(t, c, ns, drv, map[string]int64{
		segmentKey(classA.Name, testenv.LabelZone, "z1"): 9 * gib, segmentKey(classA.Name, testenv.LabelZone, "z2"): 9 * gib,
	})
	for k, o := range left {
		if o.UID != objs[k].UID {
			t.Errorf("%s was recreated (%s → %s)", k, objs[k].Name, o.Name)
		}
	}

	// The owner goes: the garbage collector (kube-controller-manager)
	// removes the objects; the broker recreates the ConfigMap and the
	// objects under it.
	if err := c.CoreV1().ConfigMaps(ns).Delete(ctx, cm.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	err = testenv.WaitFor(ctx, 60*time.Second, "objects collected with their owner and made again under the new one", func(ctx context.Context) (bool, string, error) {
		got, err := capacityObjects(ctx, c, ns, drv)
		if err != nil {
			return false, err.Error(), nil
		}
		cm2, err := c.CoreV1().ConfigMaps(ns).Get(ctx, cm.Name, metav1.GetOptions{})
		if err != nil {
			return false, "intent ConfigMap: " + err.Error(), nil
		}
		if cm2.UID == cm.UID || len(got) != 2 {
			return false, describeCapacities(got), nil
		}
		for k, o := range got {
			if o.UID == left[k].UID || len(o.OwnerReferences) != 1 || o.OwnerReferences[0].UID != cm2.UID || o.Capacity.Value() != 9*gib {
				return false, fmt.Sprintf("%s: %s owners %+v", k, o.Name, o.OwnerReferences), nil
			}
		}
		return true, "", nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// switchDrivers makes a registered driver unreachable (its connections go
// to a port nobody serves) or unregistered, on demand.
type switchDrivers struct {
	*testDrivers
	down, gone atomic.Bool
	dead       *grpc.ClientConn
	// reconcilesWhileGone counts the capacity controller's passes over the
	// registry (desiredItems: at every poll, registry change and object
	// event) that found the driver unregistered.
	reconcilesWhileGone atomic.Int64
}

func (s *switchDrivers) ControllerConn(d string) (grpc.ClientConnInterface, error) {
	if s.down.Load() {
		return s.dead, nil
	}
	return s.testDrivers.ControllerConn(d)
}

func (s *switchDrivers) DriverNames() []string {
	if s.gone.Load() {
		if calledFrom("capacity.(*Controller).desiredItems") {
			s.reconcilesWhileGone.Add(1)
		}
		return nil
	}
	return s.testDrivers.DriverNames()
}

func (s *switchDrivers) HasDriver(d string) bool {
	if s.gone.Load() {
		return false
	}
	return s.testDrivers.HasDriver(d)
}

// calledFrom reports whether a function whose name ends in fn is on the
// caller's stack.
func calledFrom(fn string) bool {
	pcs := make([]uintptr, 32)
	frames := runtime.CallersFrames(pcs[:runtime.Callers(2, pcs)])
	for {
		f, more := frames.Next()
		if strings.HasSuffix(f.Function, fn) {
			return true
		}
		if !more {
			return false
		}
	}
}

// waitReconcilesWhileGone waits until the capacity controller has decided n
// times in all, with the driver unregistered, which objects it wants: the
// polls (every 500ms here) that could have dropped the driver's objects
// have run.
func (s *switchDrivers) waitReconcilesWhileGone(t *testing.T, n int64) {
	t.Helper()
	err := testenv.WaitFor(context.Background(), 30*time.Second, fmt.Sprintf("%d capacity reconciles while the driver is unregistered", n), func(context.Context) (bool, string, error) {
		got := s.reconcilesWhileGone.Load()
		return got >= n, fmt.Sprintf("%d", got), nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// zoneCapacity is one zonal driver (8 GiB, zone z1) on one node with a
// WaitForFirstConsumer class, registered through a switchDrivers.
type zoneCapacity struct {
	env      *testenv.Env
	ns       string
	c        kubernetes.Interface
	drv, key string
	drivers  *switchDrivers
	d        *sampledriver.Driver
	class    *storagev1.StorageClass
}

func setUpZoneCapacity(t *testing.T) zoneCapacity {
	t.Helper()
	fastCapacityPolls(t)
	z := zoneCapacity{env: kubetest.ControlPlane(t)}
	z.ns = z.env.NewNamespace(t)
	z.c = z.env.Client()
	z.drv = kubetest.ClusterName(z.ns, "zonal.csi.test")
	node := kubetest.ClusterName(z.ns, "node")
	addNode(t, z.env, testenv.NodeSpec{Name: node, Zone: "z1"}, z.drv, []string{testenv.LabelZone})
	// A closed port: calls fail with Unavailable.
	dead, err := grpc.NewClient("passthrough:///127.0.0.1:1", grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dead.Close() })
	z.drivers = &switchDrivers{testDrivers: &testDrivers{}, dead: dead}
	z.d = z.drivers.addDriver(t, sampledriver.Config{Name: z.drv, ControllerSegments: []map[string]string{{testenv.LabelZone: "z1"}}, CapacityBytes: 8 * gib})
	z.class = kubetest.MakeClass(t, z.c, kubetest.ClusterName(z.ns, "c"), z.drv, storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete, nil)
	z.key = segmentKey(z.class.Name, testenv.LabelZone, "z1")
	return z
}

// useCapacity makes a volume of size bytes on the driver behind the broker's
// back, so its capacity falls.
func (z zoneCapacity) useCapacity(t *testing.T, name string, size int64) {
	t.Helper()
	conn, err := z.drivers.testDrivers.ControllerConn(z.drv)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := csi.NewControllerClient(conn).CreateVolume(context.Background(), &csi.CreateVolumeRequest{
		Name:               name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: mountCaps(),
	}); err != nil {
		t.Fatal(err)
	}
}

// TestCapacityDriverDownKeepsObjectsUnregisteredRemoves: while GetCapacity
// fails the objects keep their last value (retried with backoff, never
// deleted); once the driver answers again they follow it; when the driver is
// unregistered its objects stay for the grace period (a proxy restart
// unregisters a discovered driver for a moment), then are deleted.
func TestCapacityDriverDownKeepsObjectsUnregisteredRemoves(t *testing.T) {
	z := setUpZoneCapacity(t)
	longCapacityGrace(t)
	ns, c, ctx, drv, drivers, d, key := z.ns, z.c, context.Background(), z.drv, z.drivers, z.d, z.key
	run := startBridge(t, z.env, ns, drivers, bridgeOpts{})
	before := waitCapacities(t, c, ns, drv, map[string]int64{key: 8 * gib})

	drivers.down.Store(true)
	failed := func() float64 {
		return run.metricValue(t, "csibroker_capacity_refreshes_total", map[string]string{"driver": drv, "result": "failed"})
	}
	err := testenv.WaitFor(ctx, 60*time.Second, "three failed refreshes", func(context.Context) (bool, string, error) {
		f := failed()
		return f >= 3, fmt.Sprintf("%v failed", f), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	during, err := capacityObjects(ctx, c, ns, drv)
	if err != nil {
		t.Fatal(err)
	}
	if o, ok := during[key]; !ok || o.UID != before[key].UID || o.Capacity.Value() != 8*gib {
		t.Fatalf("while the driver is down: %s, want %s kept with its last value", describeCapacities(during), before[key].Name)
	}
	if !strings.Contains(run.logs.String(), "retrying with backoff") {
		t.Errorf("no warning logged for the failed refreshes")
	}

	// The driver is back and has less room: the same object follows.
	z.useCapacity(t, "made-elsewhere", 3*gib)
	drivers.down.Store(false)
	after := waitCapacities(t, c, ns, drv, map[string]int64{key: 5 * gib})
	if after[key].UID != before[key].UID {
		t.Errorf("object recreated instead of updated")
	}
	if len(d.Volumes()) != 1 {
		t.Fatalf("driver volumes %+v", d.Volumes())
	}

	// Unregistered: its objects stay for the grace period (15 s here), then
	// go. The controller says it keeps them; several polls later they are
	// still there, as they were.
	gone := time.Now() // no later than the controller notices
	drivers.gone.Store(true)
	waitLogLine(t, run, "driver unregistered; its capacity objects keep their last value", "driver="+drv)
	drivers.waitReconcilesWhileGone(t, 5)
	kept, err := capacityObjects(ctx, c, ns, drv)
	if err != nil {
		t.Fatal(err)
	}
	if o, ok := kept[key]; !ok || o.UID != after[key].UID || o.Capacity.Value() != 5*gib {
		t.Fatalf("%v after the driver was unregistered (grace %v): %s, want %s kept through the grace period", time.Since(gone).Round(time.Millisecond), capacity.UnregisteredGrace, describeCapacities(kept), after[key].Name)
	}
	t.Logf("kept through %d capacity reconciles, %v after the driver was unregistered", drivers.reconcilesWhileGone.Load(), time.Since(gone).Round(time.Millisecond))
	waitCapacities(t, c, ns, drv, map[string]int64{})
	if d := time.Since(gone); d < capacity.UnregisteredGrace {
		t.Fatalf("objects deleted %v after the driver was unregistered, before the %v grace period", d, capacity.UnregisteredGrace)
	}
}

// TestCapacityNewLeaderKeepsObjectsOfDriversNotRegisteredYet: a broker that
// starts leading before its discovery has registered a driver (a failover,
// a restart) keeps that driver's objects as they are instead of deleting
// them, and updates the same objects once the driver registers.
func TestCapacityNewLeaderKeepsObjectsOfDriversNotRegisteredYet(t *testing.T) {
	z := setUpZoneCapacity(t)
	longCapacityGrace(t)
	first := startBridge(t, z.env, z.ns, z.drivers, bridgeOpts{identity: "broker-0"})
	before := waitCapacities(t, z.c, z.ns, z.drv, map[string]int64{z.key: 8 * gib})
	first.stop()

	z.drivers.gone.Store(true) // the next broker's discovery has not found it yet
	started := time.Now()
	next := startBridge(t, z.env, z.ns, z.drivers, bridgeOpts{identity: "broker-1"})
	// Its term has started (it says it keeps the objects), then several
	// polls (a deletion, without the grace, takes well under 1 s), all
	// within the 15 s grace.
	waitLogLine(t, next, "capacity objects of a driver not registered yet are kept", "driver="+z.drv)
	z.drivers.waitReconcilesWhileGone(t, 5)
	kept, err := capacityObjects(context.Background(), z.c, z.ns, z.drv)
	if err != nil {
		t.Fatal(err)
	}
	if o, ok := kept[z.key]; !ok || o.UID != before[z.key].UID || o.Capacity.Value() != 8*gib {
		t.Fatalf("new leader, driver not registered yet, %v after it started (grace %v): %s, want %s kept as it was", time.Since(started).Round(time.Millisecond), capacity.UnregisteredGrace, describeCapacities(kept), before[z.key].Name)
	}
	t.Logf("kept through %d capacity reconciles, %v after the new leader started", z.drivers.reconcilesWhileGone.Load(), time.Since(started).Round(time.Millisecond))

	z.useCapacity(t, "made-elsewhere", 3*gib)
	z.drivers.gone.Store(false)
	after := waitCapacities(t, z.c, z.ns, z.drv, map[string]int64{z.key: 5 * gib})
	if after[z.key].UID != before[z.key].UID {
		t.Errorf("object %s recreated as %s instead of updated", before[z.key].Name, after[z.key].Name)
	}
	if n := next.metricValue(t, "csibroker_capacity_api_writes_total", map[string]string{"operation": "delete"}); n != 0 {
		t.Errorf("%v capacity objects deleted by the new leader, want 0", n)
	}
}
