package k8sbridge

import (
	"context"
	"fmt"
	"log/slog"
	"net"
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

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/capacity"
	"github.com/csibroker/csibroker/k8sbridge/csiparams"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
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

// TestCapacityNodeLocalNodeWithoutProxy: a node that runs a node-local
// driver (its CSINode lists it) but has no proxy registered gets no
// object and no failing refreshes; a node whose proxy goes away keeps its
// object as it was, and the object follows the driver again once the
// proxy is back.
func TestCapacityNodeLocalNodeWithoutProxy(t *testing.T) {
	fastCapacityPolls(t)
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "local.csi.test")
	nodeA, nodeB := kubetest.ClusterName(ns, "node-a"), kubetest.ClusterName(ns, "no-proxy")
	addHostnameNodes(t, env, drv, nodeA, nodeB)
	dA, chainA := nodeProxy(t, drv, nodeA, 4*gib)
	br, err := broker.New(broker.Options{TrustDomain: chaintest.TrustDomain, TLS: chainA.BrokerSource})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(br.Close)
	withA := broker.DriverConfig{Name: drv, NodeLocal: true, Timeout: 30 * time.Second, Nodes: []broker.ProxyConfig{{Node: nodeA, Address: chainA.ProxyAddr}}}
	if err := br.SetDriver(withA); err != nil {
		t.Fatal(err)
	}
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "local"), drv, storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete, nil)
	run := startBridge(t, env, ns, br, bridgeOpts{})
	keyA := segmentKey(class.Name, corev1.LabelHostname, nodeA)
	before := waitCapacities(t, c, ns, drv, map[string]int64{keyA: 4 * gib})
	// Node A's object polled a few times more: node B's would have been
	// asked for by now.
	unchanged := func() float64 {
		return run.metricValue(t, "csibroker_capacity_refreshes_total", map[string]string{"driver": drv, "result": "unchanged"})
	}
	polled := unchanged()
	if err := testenv.WaitFor(ctx, 30*time.Second, "node A's capacity polled again", func(context.Context) (bool, string, error) {
		n := unchanged()
		return n >= polled+3, fmt.Sprintf("%v unchanged refreshes", n), nil
	}); err != nil {
		t.Fatal(err)
	}
	if objs, err := capacityObjects(ctx, c, ns, drv); err != nil || len(objs) != 1 {
		t.Fatalf("objects %s (%v), want node A's only: node B has no proxy", describeCapacities(objs), err)
	}
	failed := func() float64 {
		return run.metricValue(t, "csibroker_capacity_refreshes_total", map[string]string{"driver": drv, "result": "failed"})
	}
	if f := failed(); f != 0 {
		t.Errorf("%v failed refreshes: the node without a proxy was asked", f)
	}

	// Node A's proxy goes away (a restart; the driver keeps a proxy on a
	// node of no segment here): its object stays as it was.
	keptPolls := func() float64 {
		return run.metricValue(t, "csibroker_capacity_refreshes_total", map[string]string{"driver": drv, "result": "kept"})
	}
	keptBefore := keptPolls()
	if err := br.SetDriver(broker.DriverConfig{Name: drv, NodeLocal: true, Timeout: 30 * time.Second,
		Nodes: []broker.ProxyConfig{{Node: kubetest.ClusterName(ns, "elsewhere"), Address: chainA.ProxyAddr}}}); err != nil {
		t.Fatal(err)
	}
	// Polled a few times while the proxy is gone.
	if err := testenv.WaitFor(ctx, 30*time.Second, "node A's object polled while its proxy is gone", func(context.Context) (bool, string, error) {
		n := keptPolls()
		return n >= keptBefore+3, fmt.Sprintf("%v polls keeping it", n), nil
	}); err != nil {
		t.Fatal(err)
	}
	kept, err := capacityObjects(ctx, c, ns, drv)
	if err != nil {
		t.Fatal(err)
	}
	if o, ok := kept[keyA]; !ok || o.UID != before[keyA].UID || o.Capacity.Value() != 4*gib {
		t.Fatalf("node A's proxy gone: %s, want %s kept as it was", describeCapacities(kept), before[keyA].Name)
	}
	if f := failed(); f != 0 {
		t.Errorf("%v failed refreshes while node A had no proxy", f)
	}

	// Back, with less room: the same object follows.
	if err := br.SetDriver(withA); err != nil {
		t.Fatal(err)
	}
	conn, err := br.NodeConn(drv, nodeA)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := csi.NewControllerClient(conn).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "used", CapacityRange: &csi.CapacityRange{RequiredBytes: gib},
		VolumeCapabilities: mountCaps()}); err != nil {
		t.Fatal(err)
	}
	after := waitCapacities(t, c, ns, drv, map[string]int64{keyA: 3 * gib})
	if after[keyA].UID != before[keyA].UID {
		t.Errorf("node A's object recreated instead of updated")
	}
	if len(dA.Volumes()) != 1 {
		t.Fatalf("node A volumes %d", len(dA.Volumes()))
	}
}

// addHostnameNodes adds nodes whose CSINode lists drv with the hostname
// as its topology key (a node-local driver), removed at the test's end.
// addNode adds a Node of spec, deleted when the test ends, and, for a
// driver, its CSINode listing keys.
func addNode(t *testing.T, env *testenv.Env, spec testenv.NodeSpec, drv string, keys []string) {
	t.Helper()
	ctx, c := context.Background(), env.Client()
	if _, err := env.AddNodes(ctx, spec); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.CoreV1().Nodes().Delete(context.Background(), spec.Name, metav1.DeleteOptions{}) })
	if drv == "" {
		return
	}
	if err := env.AddCSINode(ctx, spec.Name, drv, spec.Name, keys); err != nil {
		t.Fatal(err)
	}
}

func addHostnameNodes(t *testing.T, env *testenv.Env, drv string, nodes ...string) {
	t.Helper()
	for _, n := range nodes {
		addNode(t, env, testenv.NodeSpec{Name: n}, drv, []string{corev1.LabelHostname})
	}
}

// nodeProxy starts a sample driver for node behind its own real proxy whose
// certificate names the node (spiffe://.../driver/<driver>/node/<node>).
func nodeProxy(t *testing.T, driver, node string, capacity int64) (*sampledriver.Driver, *chaintest.Chain) {
	t.Helper()
	ep, d := sampledriver.StartTest(t, sampledriver.Config{Name: driver, NodeID: node, Topology: map[string]string{corev1.LabelHostname: node},
		CapacityBytes: capacity, Logger: slog.New(slog.DiscardHandler)})
	now := time.Now()
	mat, err := chaintest.SharedCA(t).IssueMaterial(mtls.Leaf{ID: mtls.NodeDriverID(chaintest.TrustDomain, driver, node), NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	// The chain's own broker expects a controller proxy and is not used:
	// the test's broker below dials this proxy as the node's.
	return d, chaintest.Start(t, chaintest.Options{Driver: driver, DriverEndpoint: ep, ProxyMaterial: mat, NoWait: true, LogLevel: slog.LevelError})
}

// TestCapacityNodeLocalWithoutTopology: a node-local driver that has no
// topology of its own (no VOLUME_ACCESSIBILITY_CONSTRAINTS, its CSINode
// lists no keys) still gets a capacity object per node, by hostname, and is
// asked on its node's proxy without a topology in the request, which the
// spec forbids it (the sample driver refuses one).
func TestCapacityNodeLocalWithoutTopology(t *testing.T) {
	fastCapacityPolls(t)
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "plain.csi.test")
	node := kubetest.ClusterName(ns, "node")
	addNode(t, env, testenv.NodeSpec{Name: node}, drv, nil)
	ep, d := sampledriver.StartTest(t, sampledriver.Config{Name: drv, NodeID: node, CapacityBytes: 4 * gib, Logger: slog.New(slog.DiscardHandler)})
	now := time.Now()
	mat, err := chaintest.SharedCA(t).IssueMaterial(mtls.Leaf{ID: mtls.NodeDriverID(chaintest.TrustDomain, drv, node), NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	chain := chaintest.Start(t, chaintest.Options{Driver: drv, DriverEndpoint: ep, ProxyMaterial: mat, NoWait: true, LogLevel: slog.LevelError})
	br, err := broker.New(broker.Options{TrustDomain: chaintest.TrustDomain, TLS: chain.BrokerSource})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(br.Close)
	if err := br.SetDriver(broker.DriverConfig{Name: drv, NodeLocal: true, Timeout: 30 * time.Second, Nodes: []broker.ProxyConfig{{Node: node, Address: chain.ProxyAddr}}}); err != nil {
		t.Fatal(err)
	}
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "plain"), drv, storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, br, bridgeOpts{})
	waitCapacities(t, c, ns, drv, map[string]int64{segmentKey(class.Name, corev1.LabelHostname, node): 4 * gib})
	if n := d.CallCount("GetCapacity"); n == 0 {
		t.Fatal("no GetCapacity call reached the node's driver")
	}
}

// TestCapacityNodeLocalTwoNodes: a node-local driver with an instance (and
// a node proxy) on each of two nodes, registered in a real broker with node
// proxies only: one object per node with what that node's instance reports,
// a change on one node follows; kube-scheduler uses the objects (a claim
// too big for one node's free space lands on the other, is provisioned by
// that node's instance and its object follows; a claim too big for both is
// not placed).
func TestCapacityNodeLocalTwoNodes(t *testing.T) {
	fastCapacityPolls(t)
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "local.csi.test")
	nodeA, nodeB := kubetest.ClusterName(ns, "node-a"), kubetest.ClusterName(ns, "node-b")
	addHostnameNodes(t, env, drv, nodeA, nodeB)
	dA, chainA := nodeProxy(t, drv, nodeA, 4*gib)
	dB, chainB := nodeProxy(t, drv, nodeB, 6*gib)
	br, err := broker.New(broker.Options{TrustDomain: chaintest.TrustDomain, TLS: chainA.BrokerSource})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(br.Close)
	if err := br.SetDriver(broker.DriverConfig{Name: drv, NodeLocal: true, Timeout: 30 * time.Second, Nodes: []broker.ProxyConfig{
		{Node: nodeA, Address: chainA.ProxyAddr}, {Node: nodeB, Address: chainB.ProxyAddr},
	}}); err != nil {
		t.Fatal(err)
	}
	// The scheduler checks capacity for this driver's claims.
	csiDriver := &storagev1.CSIDriver{ObjectMeta: metav1.ObjectMeta{Name: drv}, Spec: storagev1.CSIDriverSpec{AttachRequired: new(false), StorageCapacity: new(true)}}
	if _, err := c.StorageV1().CSIDrivers().Create(ctx, csiDriver, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.StorageV1().CSIDrivers().Delete(context.Background(), drv, metav1.DeleteOptions{}) })
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "local"), drv, storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, br, bridgeOpts{})

	keyA, keyB := segmentKey(class.Name, corev1.LabelHostname, nodeA), segmentKey(class.Name, corev1.LabelHostname, nodeB)
	objs := waitCapacities(t, c, ns, drv, map[string]int64{keyA: 4 * gib, keyB: 6 * gib})
	if dA.CallCount("GetCapacity") == 0 || dB.CallCount("GetCapacity") == 0 {
		t.Fatalf("GetCapacity calls: node A %d, node B %d", dA.CallCount("GetCapacity"), dB.CallCount("GetCapacity"))
	}

	// 1 GiB used on node A (a volume made through the broker's node
	// route): only node A's object follows.
	conn, err := br.NodeConn(drv, nodeA)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := csi.NewControllerClient(conn).CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name:               "on-a",
		CapacityRange:      &csi.CapacityRange{RequiredBytes: gib},
		VolumeCapabilities: mountCaps(),
	}); err != nil {
		t.Fatal(err)
	}
	after := waitCapacities(t, c, ns, drv, map[string]int64{keyA: 3 * gib, keyB: 6 * gib})
	for k, o := range after {
		if o.UID != objs[k].UID {
			t.Errorf("%s recreated instead of updated", k)
		}
	}
	if len(dA.Volumes()) != 1 || len(dB.Volumes()) != 0 {
		t.Fatalf("volumes: node A %d, node B %d", len(dA.Volumes()), len(dB.Volumes()))
	}

	// A 5 GiB claim fits only node B: the scheduler, reading the objects,
	// selects it.
	kubetest.MakeClaim(t, c, ns, "big", class.Name, "5Gi")
	kubetest.MakePod(t, c, ns, "pod", "big")
	err = testenv.WaitFor(ctx, 60*time.Second, "the scheduler to select node B for the 5Gi claim", func(ctx context.Context) (bool, string, error) {
		pvc, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "big", metav1.GetOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		sel := pvc.Annotations[kube.AnnSelectedNode]
		if sel != "" && sel != nodeB {
			return false, "", fmt.Errorf("selected node %s, which has 3Gi free", sel)
		}
		pod, err := c.CoreV1().Pods(ns).Get(ctx, "pod", metav1.GetOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		return sel == nodeB, fmt.Sprintf("selected %q, pod conditions %+v", sel, pod.Status.Conditions), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// It is provisioned by node B's instance, through node B's proxy, and
	// node B's object follows.
	kubetest.WaitBound(t, c, ns, "big", 60*time.Second)
	if len(dA.Volumes()) != 1 || len(dB.Volumes()) != 1 {
		t.Fatalf("volumes: node A %d, node B %d; want the claim's on node B", len(dA.Volumes()), len(dB.Volumes()))
	}
	waitCapacities(t, c, ns, drv, map[string]int64{keyA: 3 * gib, keyB: 1 * gib})

	// A claim larger than either node's free space is not placed at all,
	// and the scheduler says why: it read the objects.
	kubetest.MakeClaim(t, c, ns, "huge", class.Name, "4Gi")
	kubetest.MakePod(t, c, ns, "pod-huge", "huge")
	err = testenv.WaitFor(ctx, 60*time.Second, "the scheduler to refuse the 4Gi claim for lack of storage", func(ctx context.Context) (bool, string, error) {
		pod, err := c.CoreV1().Pods(ns).Get(ctx, "pod-huge", metav1.GetOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		if pod.Spec.NodeName != "" {
			return false, "", fmt.Errorf("pod placed on %s", pod.Spec.NodeName)
		}
		for _, cond := range pod.Status.Conditions {
			if cond.Type == corev1.PodScheduled && cond.Status == corev1.ConditionFalse && strings.Contains(cond.Message, "enough free storage") {
				return true, "", nil
			}
		}
		return false, fmt.Sprintf("pod conditions %+v", pod.Status.Conditions), nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// The broker is the bridge's drivers (lookups and timeouts included).
var _ Drivers = (*broker.Broker)(nil)

// TestCapacityForImmediateBinding: with --capacity-for-immediate-binding,
// an Immediate class of the driver gets its objects too.
func TestCapacityForImmediateBinding(t *testing.T) {
	fastCapacityPolls(t)
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "imm.csi.test")
	node := kubetest.ClusterName(ns, "node-z1")
	addNode(t, env, testenv.NodeSpec{Name: node, Zone: "z1"}, drv, []string{testenv.LabelZone})
	drivers := &testDrivers{}
	drivers.addDriver(t, sampledriver.Config{Name: drv, ControllerSegments: []map[string]string{{testenv.LabelZone: "z1"}}, CapacityBytes: 10 * gib})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "imm"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{configure: func(b *Bridge) { b.Cfg.CapacityForImmediateBinding = true }})
	waitCapacities(t, c, ns, drv, map[string]int64{segmentKey(class.Name, testenv.LabelZone, "z1"): 10 * gib})
}

// TestCapacityDriverWithoutTopology: a driver whose nodes list no topology
// keys, with storage capacity tracking on in its CSIDriver, gets one
// object per class whose nodeTopology selects every node, as
// external-provisioner makes it (with none, the scheduler finds no room
// for its WaitForFirstConsumer claims anywhere), and a claim's pod is
// scheduled and its volume provisioned.
func TestCapacityDriverWithoutTopology(t *testing.T) {
	fastCapacityPolls(t)
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "flat.csi.test")
	addNode(t, env, testenv.NodeSpec{Name: kubetest.ClusterName(ns, "node")}, drv, nil)
	drivers := &testDrivers{}
	drivers.addDriver(t, sampledriver.Config{Name: drv, CapacityBytes: 4 * gib})
	csiDriver := &storagev1.CSIDriver{ObjectMeta: metav1.ObjectMeta{Name: drv}, Spec: storagev1.CSIDriverSpec{AttachRequired: new(false), StorageCapacity: new(true)}}
	if _, err := c.StorageV1().CSIDrivers().Create(ctx, csiDriver, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.StorageV1().CSIDrivers().Delete(context.Background(), drv, metav1.DeleteOptions{}) })
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "flat"), drv, storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})

	objs := waitCapacities(t, c, ns, drv, map[string]int64{class.Name + " {}": 4 * gib})
	for k, o := range objs {
		if o.NodeTopology == nil || len(o.NodeTopology.MatchLabels) != 0 || len(o.NodeTopology.MatchExpressions) != 0 {
			t.Errorf("%s: node topology %+v, want the empty selector (every node)", k, o.NodeTopology)
		}
	}
	kubetest.MakeClaim(t, c, ns, "claim", class.Name, "1Gi")
	kubetest.MakePod(t, c, ns, "pod", "claim")
	kubetest.WaitBound(t, c, ns, "claim", 60*time.Second)
}

// TestCapacityFollowsVolumes: a volume made or deleted through the broker
// refreshes the objects of its segment at once, as external-provisioner
// does, not at the next poll (set beyond the test's waits here): a claim's
// volume takes 1 GiB off its zone's object, and its deletion gives it back.
func TestCapacityFollowsVolumes(t *testing.T) {
	poll, reg := capacity.PollInterval, capacity.RegistryInterval
	capacity.PollInterval, capacity.RegistryInterval = 10*time.Minute, 200*time.Millisecond
	t.Cleanup(func() { capacity.PollInterval, capacity.RegistryInterval = poll, reg })
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "follow.csi.test")
	addNode(t, env, testenv.NodeSpec{Name: kubetest.ClusterName(ns, "node"), Zone: "z1"}, drv, []string{testenv.LabelZone})
	drivers := &testDrivers{}
	drivers.addDriver(t, sampledriver.Config{Name: drv, ControllerSegments: []map[string]string{{testenv.LabelZone: "z1"}}, CapacityBytes: 4 * gib})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "follow"), drv, storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})
	key := segmentKey(class.Name, testenv.LabelZone, "z1")
	waitCapacities(t, c, ns, drv, map[string]int64{key: 4 * gib})

	kubetest.MakeClaim(t, c, ns, "claim", class.Name, "1Gi")
	kubetest.MakePod(t, c, ns, "pod", "claim")
	pvName := kubetest.WaitBound(t, c, ns, "claim", 60*time.Second).Spec.VolumeName
	waitCapacities(t, c, ns, drv, map[string]int64{key: 3 * gib})

	if err := c.CoreV1().Pods(ns).Delete(ctx, "pod", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "claim", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitPVGone(t, c, pvName, 60*time.Second)
	waitCapacities(t, c, ns, drv, map[string]int64{key: 4 * gib})
}

// TestNodeLocalDriverWithItsFirstNodeDown: a node-local driver without a
// controller proxy is asked for its capabilities through a node proxy;
// when that node's proxy does not answer, another node's does, so the
// node that is up still gets its capacity object and its claims
// provisioned (the first node down stopped both for every node).
func TestNodeLocalDriverWithItsFirstNodeDown(t *testing.T) {
	fastCapacityPolls(t)
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "local.csi.test")
	nodeA, nodeB := kubetest.ClusterName(ns, "node-a"), kubetest.ClusterName(ns, "node-b")
	addHostnameNodes(t, env, drv, nodeA, nodeB)
	dB, chainB := nodeProxy(t, drv, nodeB, 6*gib)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	down := lis.Addr().String() // nothing listens there once closed
	lis.Close()
	br, err := broker.New(broker.Options{TrustDomain: chaintest.TrustDomain, TLS: chainB.BrokerSource})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(br.Close)
	if err := br.SetDriver(broker.DriverConfig{Name: drv, NodeLocal: true, Timeout: 30 * time.Second, Nodes: []broker.ProxyConfig{
		{Node: nodeA, Address: down}, {Node: nodeB, Address: chainB.ProxyAddr},
	}}); err != nil {
		t.Fatal(err)
	}
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "local"), drv, storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, br, bridgeOpts{})
	waitCapacities(t, c, ns, drv, map[string]int64{segmentKey(class.Name, corev1.LabelHostname, nodeB): 6 * gib})

	kubetest.MakeClaim(t, c, ns, "claim", class.Name, "1Gi")
	setSelectedNode(t, c, ns, "claim", nodeB)
	kubetest.WaitBound(t, c, ns, "claim", 60*time.Second)
	if n := len(dB.Volumes()); n != 1 {
		t.Fatalf("node B has %d volumes, want the claim's", n)
	}
}

// TestCapacityKeptObjectOfADeletedClassGoes: an object kept because its
// driver is not registered for a moment still goes when its StorageClass
// is deleted (it stayed until the driver came back or the grace period
// ended).
func TestCapacityKeptObjectOfADeletedClassGoes(t *testing.T) {
	z := setUpZoneCapacity(t)
	longCapacityGrace(t)
	run := startBridge(t, z.env, z.ns, z.drivers, bridgeOpts{})
	waitCapacities(t, z.c, z.ns, z.drv, map[string]int64{z.key: 8 * gib})
	gone := time.Now()
	z.drivers.gone.Store(true)
	waitLogLine(t, run, "driver unregistered; its capacity objects keep their last value", "driver="+z.drv)
	if err := z.c.StorageV1().StorageClasses().Delete(context.Background(), z.class.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitCapacities(t, z.c, z.ns, z.drv, map[string]int64{})
	if d := time.Since(gone); d >= capacity.UnregisteredGrace {
		t.Fatalf("the object went %v after its driver was unregistered, at the end of the %v grace period, not with its class", d, capacity.UnregisteredGrace)
	}
}
