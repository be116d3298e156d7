package k8sbridge

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/capacity"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
)

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
