package k8sbridge

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/csiparams"
	"github.com/csibroker/csibroker/k8sbridge/intent"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
	"github.com/csibroker/csibroker/k8sbridge/provision"
)

// TestNodeLocalAttemptsOfAnEarlierLeader: the first attempt of a term sees
// the node-local entries an earlier leader recorded. A claim whose volume
// the earlier leader may have made on the small node is finished there,
// although the big node has more room (the earlier volume is not left
// behind); a claim whose earlier attempt went to a node that no longer
// exists is provisioned anew, with an Event saying what was left where,
// instead of failing for ever on the missing node.
func TestNodeLocalAttemptsOfAnEarlierLeader(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "local.csi.test")
	small, big, gone := kubetest.ClusterName(ns, "small"), kubetest.ClusterName(ns, "big"), kubetest.ClusterName(ns, "gone")
	drivers := &testDrivers{}
	inst := addLocalNodes(t, env, drivers, drv, map[string]int64{small: 10 << 30, big: 100 << 30}, sampledriver.Faults{})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "imm"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)

	// What the earlier leader left: for "earlier", an entry on the small
	// node whose CreateVolume did make the volume there; for "lost", an
	// entry on a node deleted since.
	earlier := kubetest.MakeClaim(t, c, ns, "earlier", class.Name, "1Gi")
	lost := kubetest.MakeClaim(t, c, ns, "lost", class.Name, "1Gi")
	earlierPV, lostPV := csiparams.VolumeName("pvc", earlier.UID, 0), csiparams.VolumeName("pvc", lost.UID, 0)
	conn, err := drivers.NodeConn(drv, small)
	if err != nil {
		t.Fatal(err)
	}
	req := createRequest(earlierPV)
	req.CapacityRange.RequiredBytes = 1 << 30
	if _, err := csi.NewControllerClient(conn).CreateVolume(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	in := intentFor(t, drv, earlierPV, earlier)
	in.Node = small
	recordIntent(t, c, ns, in)
	in = intentFor(t, drv, lostPV, lost)
	in.Node = gone
	recordIntent(t, c, ns, in)

	startBridge(t, env, ns, drivers, bridgeOpts{})
	for _, name := range []string{"earlier", "lost"} {
		kubetest.WaitBound(t, c, ns, name, 60*time.Second)
	}
	pv, err := c.CoreV1().PersistentVolumes().Get(context.Background(), earlierPV, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := pv.Annotations[kube.AnnVolumeNode]; got != small {
		t.Errorf("claim earlier provisioned on node %q, want %q where the earlier leader's attempt made its volume", got, small)
	}
	if n := len(inst[small].Volumes()); n != 1 {
		t.Errorf("small node has %d volumes, want 1 (the earlier attempt's, used)", n)
	}
	if n := len(inst[big].Volumes()); n != 1 {
		t.Errorf("big node has %d volumes, want 1 (claim lost's)", n)
	}
	kubetest.WaitEvent(t, c, ns, "lost", "ProvisioningOrphan", "on node "+gone+", which no longer exists")
}

// TestNodeLocalSecondVolumeOfAnExistingPV: a node-local PV that exists
// already, saved by an earlier attempt with its volume on another node,
// does not let the volume this broker made on its own node go unaccounted.
// A provisioning attempt whose PV create finds that PV deletes the second
// volume it made (the previous leader saved the PV while this attempt
// called the driver, unseen by the cache); recovery deletes the volume of
// an intent entry whose PV names another node.
func TestNodeLocalSecondVolumeOfAnExistingPV(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "local.csi.test")
	small, big := kubetest.ClusterName(ns, "small"), kubetest.ClusterName(ns, "big")
	drivers := &testDrivers{}
	inst := addLocalNodes(t, env, drivers, drv, map[string]int64{small: 10 << 30, big: 100 << 30}, sampledriver.Faults{})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "imm"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)

	// saveOnSmall makes volume name on the small node and saves its PV
	// for claim, as an earlier leader would have.
	saveOnSmall := func(ctx context.Context, name string, claim *corev1.PersistentVolumeClaim) error {
		conn, err := drivers.NodeConn(drv, small)
		if err != nil {
			return err
		}
		resp, err := csi.NewControllerClient(conn).CreateVolume(ctx, createRequest(name))
		if err != nil {
			return err
		}
		pv := &corev1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{kube.AnnVolumeNode: small}},
			Spec: corev1.PersistentVolumeSpec{
				Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
				AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				ClaimRef:                      &corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: claim.Namespace, Name: claim.Name, UID: claim.UID},
				StorageClassName:              class.Name,
				PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimDelete,
				PersistentVolumeSource:        corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: drv, VolumeHandle: resp.GetVolume().GetVolumeId()}},
			},
		}
		_, err = c.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{})
		return err
	}

	// Recovery: the earlier leader saved "recorded"'s PV on small, and an
	// attempt of its own on big left a volume and its entry there.
	recorded := kubetest.MakeClaim(t, c, ns, "recorded", class.Name, "1Gi")
	recordedPV := csiparams.VolumeName("pvc", recorded.UID, 0)
	if err := saveOnSmall(ctx, recordedPV, recorded); err != nil {
		t.Fatal(err)
	}
	conn, err := drivers.NodeConn(drv, big)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := csi.NewControllerClient(conn).CreateVolume(ctx, createRequest(recordedPV)); err != nil {
		t.Fatal(err)
	}
	in := intentFor(t, drv, recordedPV, recorded)
	in.Node = big
	recordIntent(t, c, ns, in)

	// Provisioning: "meanwhile" is placed on big (more room); while its
	// CreateVolume runs, the earlier leader's PV appears, on small.
	meanwhile := kubetest.MakeClaim(t, c, ns, "meanwhile", class.Name, "1Gi")
	meanwhilePV := csiparams.VolumeName("pvc", meanwhile.UID, 0)
	startBridge(t, env, ns, drivers, bridgeOpts{configure: func(b *Bridge) {
		var once sync.Once
		b.prov.AfterCreate = func(ctx context.Context, vol string) {
			if vol != meanwhilePV {
				return
			}
			once.Do(func() {
				if err := saveOnSmall(ctx, vol, meanwhile); err != nil {
					t.Errorf("save the earlier leader's PV: %v", err)
				}
			})
		}
	}})

	for _, name := range []string{"recorded", "meanwhile"} {
		if got := kubetest.WaitBound(t, c, ns, name, 60*time.Second); got.Spec.VolumeName != csiparams.VolumeName("pvc", got.UID, 0) {
			t.Fatalf("claim %s bound to %s", name, got.Spec.VolumeName)
		}
	}
	err = testenv.WaitFor(ctx, 60*time.Second, "only the PVs' volumes, on small", func(ctx context.Context) (bool, string, error) {
		onBig, onSmall := len(inst[big].Volumes()), len(inst[small].Volumes())
		seen := fmt.Sprintf("volumes on big %d, on small %d", onBig, onSmall)
		intents, err := intent.NewStore(c, ns, "csibroker-intents", nil).List(ctx)
		if err != nil {
			return false, seen + "; " + err.Error(), nil
		}
		return onBig == 0 && onSmall == 2 && len(intents) == 0, fmt.Sprintf("%s; intent entries %d", seen, len(intents)), nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestNodeLocalVolumeOfANodeThatComesBack: an earlier attempt may have
// made a claim's volume on a node that is deleted before the claim is
// provisioned; the claim is provisioned anew on another node, and the
// earlier attempt's entry is kept apart, so that when the node registers
// again under its name (its storage kept), recovery deletes the volume
// left there.
func TestNodeLocalVolumeOfANodeThatComesBack(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "local.csi.test")
	stay, flaky := kubetest.ClusterName(ns, "stay"), kubetest.ClusterName(ns, "flaky")
	drivers := &testDrivers{}
	inst := addLocalNodes(t, env, drivers, drv, map[string]int64{stay: 100 << 30, flaky: 10 << 30}, sampledriver.Faults{})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "imm"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)

	// The earlier leader's attempt on flaky made the volume; then the
	// node object went (its storage, and here its proxy, stay).
	claim := kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi")
	pvName := csiparams.VolumeName("pvc", claim.UID, 0)
	conn, err := drivers.NodeConn(drv, flaky)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := csi.NewControllerClient(conn).CreateVolume(ctx, createRequest(pvName)); err != nil {
		t.Fatal(err)
	}
	in := intentFor(t, drv, pvName, claim)
	in.Node = flaky
	recordIntent(t, c, ns, in)
	if err := c.CoreV1().Nodes().Delete(ctx, flaky, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}

	startBridge(t, env, ns, drivers, bridgeOpts{})
	bound := kubetest.WaitBound(t, c, ns, "data", 60*time.Second)
	kubetest.WaitEvent(t, c, ns, "data", "ProvisioningOrphan", "deleted if the node comes back")
	pv, err := c.CoreV1().PersistentVolumes().Get(ctx, bound.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := pv.Annotations[kube.AnnVolumeNode]; got != stay {
		t.Fatalf("provisioned anew on node %q, want %s", got, stay)
	}
	// Once the new attempt's entry is dropped (its PV exists), the record
	// holds the attempt on flaky only.
	err = testenv.WaitFor(ctx, 30*time.Second, "the record to hold only the attempt on "+flaky, func(ctx context.Context) (bool, string, error) {
		intents, err := intent.NewStore(c, ns, "csibroker-intents", nil).List(ctx)
		if err != nil {
			return false, err.Error(), nil
		}
		var seen []string
		for _, in := range intents {
			seen = append(seen, fmt.Sprintf("%s on %s (superseded %v)", in.VolumeName, in.Node, in.Superseded))
		}
		return len(intents) == 1 && intents[0].Superseded && intents[0].Node == flaky && intents[0].VolumeName == pvName, strings.Join(seen, ", "), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := len(inst[flaky].Volumes()); n != 1 {
		t.Fatalf("%d volumes on %s while it is gone, want the earlier attempt's", n, flaky)
	}

	// The node registers again.
	if _, err := env.AddNodes(ctx, testenv.NodeSpec{Name: flaky}); err != nil {
		t.Fatal(err)
	}
	err = testenv.WaitFor(ctx, 60*time.Second, "the volume left on "+flaky+" deleted and its entry gone", func(ctx context.Context) (bool, string, error) {
		left := len(inst[flaky].Volumes())
		intents, err := intent.NewStore(c, ns, "csibroker-intents", nil).List(ctx)
		if err != nil {
			return false, err.Error(), nil
		}
		return left == 0 && len(intents) == 0, fmt.Sprintf("%d volumes on %s, %d intent entries", left, flaky, len(intents)), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := len(inst[stay].Volumes()); n != 1 {
		t.Fatalf("%d volumes on %s, want the claim's", n, stay)
	}
}

// TestSupersededEntryGivenUp: the entry of an attempt on a node that is
// gone waits for the node to come back, and is given up, with a log line,
// once its attempt is older than supersededKeep.
func TestSupersededEntryGivenUp(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "local.csi.test")
	drivers := &testDrivers{}
	addLocalNodes(t, env, drivers, drv, map[string]int64{kubetest.ClusterName(ns, "here"): 10 << 30}, sampledriver.Faults{})
	claim := kubetest.MakeClaim(t, c, ns, "gone", "no-such-class", "1Gi")
	old := intentFor(t, drv, "pvc-old", claim)
	old.Node, old.Superseded, old.Created = kubetest.ClusterName(ns, "gone-long-ago"), true, metav1.NewTime(time.Now().Add(-provision.SupersededKeep-time.Hour))
	recent := intentFor(t, drv, "pvc-recent", claim)
	recent.Node, recent.Superseded = kubetest.ClusterName(ns, "gone-lately"), true
	recordIntent(t, c, ns, old)
	recordIntent(t, c, ns, recent)

	r := startBridge(t, env, ns, drivers, bridgeOpts{})
	err := testenv.WaitFor(ctx, 30*time.Second, "the old entry given up, the recent one kept", func(ctx context.Context) (bool, string, error) {
		intents, err := intent.NewStore(c, ns, "csibroker-intents", nil).List(ctx)
		if err != nil {
			return false, err.Error(), nil
		}
		var keys []string
		for _, in := range intents {
			keys = append(keys, in.Key())
		}
		return len(keys) == 1 && keys[0] == recent.Key(), strings.Join(keys, ", "), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if logs := r.logs.String(); !strings.Contains(logs, "its entry is given up") || !strings.Contains(logs, old.Node) {
		t.Fatalf("no log line says the old entry was given up:\n%s", tail(logs, 20))
	}
	if got := r.metricValue(t, "csibroker_recovered_volumes_total", map[string]string{"driver": drv, "result": "abandoned"}); got != 1 {
		t.Fatalf("abandoned entries counted %v, want 1", got)
	}
}

// TestNodeLocalMovedOffAFullNode: a WaitForFirstConsumer claim's attempt
// on node b answers "may still be in progress", and the scheduler then
// moves the claim to a. b has no room for the volume, so the re-issued
// CreateVolume on b answers ResourceExhausted, which says b holds no
// volume of that name: the claim is provisioned on a (it waited for b for
// ever).
func TestNodeLocalMovedOffAFullNode(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "full.csi.test")
	a, b := kubetest.ClusterName(ns, "a"), kubetest.ClusterName(ns, "b")
	drivers := &testDrivers{}
	// The first CreateVolume on each node answers Aborted before it is
	// handled.
	lost := sampledriver.Faults{Methods: map[string]sampledriver.Fault{"CreateVolume": {First: 1, Code: codes.Aborted}}}
	inst := addLocalNodes(t, env, drivers, drv, map[string]int64{a: 10 << 30, b: 1 << 30}, lost)
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "wffc"), drv, storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})

	kubetest.MakeClaim(t, c, ns, "moved", class.Name, "5Gi")
	setSelectedNode(t, c, ns, "moved", b)
	kubetest.WaitEvent(t, c, ns, "moved", "ProvisioningFailed", "may still be in progress")
	setSelectedNode(t, c, ns, "moved", a)
	kubetest.WaitBound(t, c, ns, "moved", 60*time.Second)
	if na, nb := len(inst[a].Volumes()), len(inst[b].Volumes()); na != 1 || nb != 0 {
		t.Fatalf("volumes on a %d, on b %d; want the one on a", na, nb)
	}
	noLeaks(t, env, ns, inst[a], drv)
}

// TestNodeLocalAffinityByHostnameLabel: a node-local volume's PV is pinned
// to its node by the node's kubernetes.io/hostname label, which need not be
// the node's name; and a topology reported by a driver that does not
// advertise VOLUME_ACCESSIBILITY_CONSTRAINTS is not made into an affinity
// (its keys are no node labels it promised), as external-provisioner.
func TestNodeLocalAffinityByHostnameLabel(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "host.csi.test")
	node := kubetest.ClusterName(ns, "n1")
	host := "host-" + ns
	addNode(t, env, testenv.NodeSpec{Name: node, Labels: map[string]string{corev1.LabelHostname: host}}, drv, nil)
	drivers := newCountingDrivers()
	drivers.addNodeDriver(t, sampledriver.Config{Name: drv, CapacityBytes: 10 << 30}, node)
	drivers.rewriteReply("CreateVolume", func(_ int, reply any) {
		reply.(*csi.CreateVolumeResponse).Volume.AccessibleTopology = []*csi.Topology{{Segments: map[string]string{"example.com/rack": "r1"}}}
	})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "imm"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second).Spec.VolumeName
	pv, err := c.CoreV1().PersistentVolumes().Get(context.Background(), pvName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	terms := pv.Spec.NodeAffinity.Required.NodeSelectorTerms
	if len(terms) != 1 || len(terms[0].MatchExpressions) != 1 {
		t.Fatalf("PV node affinity %+v, want one hostname term", terms)
	}
	if e := terms[0].MatchExpressions[0]; e.Key != corev1.LabelHostname || !slices.Equal(e.Values, []string{host}) {
		t.Errorf("PV node affinity %+v, want %s In [%s] (the node's label, not its name %s)", e, corev1.LabelHostname, host, node)
	}
}

// TestNodeLocalPlacementKeepsToAllowedTopologiesAndMovesOn: an Immediate
// claim of a node-local driver is placed only on a node in its class's
// allowedTopologies, even when another has more room; and a node that
// answers ResourceExhausted (its GetCapacity said there was room) is not
// asked again and again: the next attempt goes to another node.
func TestNodeLocalPlacementKeepsToAllowedTopologiesAndMovesOn(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "place.csi.test")
	big, small := kubetest.ClusterName(ns, "big"), kubetest.ClusterName(ns, "small")
	addNode(t, env, testenv.NodeSpec{Name: big, Zone: "za"}, drv, nil)
	addNode(t, env, testenv.NodeSpec{Name: small, Zone: "zb"}, drv, nil)
	drivers := &testDrivers{}
	full := sampledriver.Faults{Methods: map[string]sampledriver.Fault{"CreateVolume": {First: 1 << 30, Code: codes.ResourceExhausted}}}
	bigDrv := drivers.addNodeDriver(t, sampledriver.Config{Name: drv, CapacityBytes: 100 << 30, Faults: full}, big)
	smallDrv := drivers.addNodeDriver(t, sampledriver.Config{Name: drv, CapacityBytes: 10 << 30}, small)
	imm, del := storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete
	anywhere := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "any"), drv, imm, del, nil)
	zb := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: kubetest.ClusterName(ns, "zb")}, Provisioner: drv, VolumeBindingMode: &imm, ReclaimPolicy: &del,
		AllowedTopologies: []corev1.TopologySelectorTerm{{MatchLabelExpressions: []corev1.TopologySelectorLabelRequirement{{Key: testenv.LabelZone, Values: []string{"zb"}}}}}}
	if _, err := c.StorageV1().StorageClasses().Create(ctx, zb, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.StorageV1().StorageClasses().Delete(context.Background(), zb.Name, metav1.DeleteOptions{}) })
	startBridge(t, env, ns, drivers, bridgeOpts{})

	kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "in-zb", zb.Name, "1Gi").Name, 60*time.Second)
	if n := bigDrv.CallCount("CreateVolume"); n != 0 {
		t.Fatalf("the claim of a class allowing zone zb only was asked of %s (zone za) %d times", big, n)
	}
	kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "anywhere", anywhere.Name, "1Gi").Name, 60*time.Second)
	if n := bigDrv.CallCount("CreateVolume"); n != 1 {
		t.Errorf("%s, full, was asked %d times; want once, then another node", big, n)
	}
	if n := len(smallDrv.Volumes()); n != 2 {
		t.Errorf("%s holds %d volumes, want both claims'", small, n)
	}
}
