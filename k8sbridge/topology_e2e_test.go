package k8sbridge

import (
	"context"
	"fmt"
	"sort"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
)

func zonesOf(ts []*csi.Topology) []string {
	var out []string
	for _, t := range ts {
		out = append(out, t.GetSegments()[testenv.LabelZone])
	}
	return out
}

// zoneNodes adds a node in each zone (region r1), named node-<zone> in
// ns, with drv's CSINode keyed by the zone label, and returns the nodes by
// zone and the zones as segments.
func zoneNodes(t *testing.T, env *testenv.Env, ns, drv string, zones ...string) (map[string]string, []map[string]string) {
	t.Helper()
	nodes := map[string]string{}
	var segs []map[string]string
	for _, z := range zones {
		node := kubetest.ClusterName(ns, "node-"+z)
		nodes[z] = node
		addNode(t, env, testenv.NodeSpec{Name: node, Zone: z, Region: "r1"}, drv, []string{testenv.LabelZone})
		segs = append(segs, map[string]string{testenv.LabelZone: z})
	}
	return nodes, segs
}

// TestTopologyThreeZones checks the CreateVolume requests the driver saw for
// Immediate, WaitForFirstConsumer and allowedTopologies claims in a
// three-zone cluster, and the PVs' node affinity.
func TestTopologyThreeZones(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "zonal.csi.test")
	zones := []string{"z1", "z2", "z3"}
	_, segs := zoneNodes(t, env, ns, drv, zones...)
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv, ControllerSegments: segs})
	imm, wffc, del := storagev1.VolumeBindingImmediate, storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete
	immClass := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "imm"), drv, imm, del, nil)
	wffcClass := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "wffc"), drv, wffc, del, nil)
	allowed := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "allowed"), drv, imm, del, nil)
	allowed.AllowedTopologies = []corev1.TopologySelectorTerm{{MatchLabelExpressions: []corev1.TopologySelectorLabelRequirement{{Key: testenv.LabelZone, Values: []string{"z2"}}}}}
	// allowedTopologies is immutable: recreate the class with it.
	if err := c.StorageV1().StorageClasses().Delete(ctx, allowed.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	allowed.ResourceVersion = ""
	if _, err := c.StorageV1().StorageClasses().Create(ctx, allowed, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	startBridge(t, env, ns, drivers, bridgeOpts{})

	kubetest.MakeClaim(t, c, ns, "imm", immClass.Name, "1Gi")
	kubetest.MakeClaim(t, c, ns, "wffc", wffcClass.Name, "1Gi")
	kubetest.MakePod(t, c, ns, "pod", "wffc")
	kubetest.MakeClaim(t, c, ns, "allowed", allowed.Name, "1Gi")
	claims := map[string]*corev1.PersistentVolumeClaim{}
	for _, n := range []string{"imm", "wffc", "allowed"} {
		claims[n] = kubetest.WaitBound(t, c, ns, n, 60*time.Second)
	}
	reqs := map[string]*csi.CreateVolumeRequest{}
	for _, r := range d.CreateVolumeRequests() {
		reqs[r.GetName()] = r
	}
	check := func(claim string, wantRequisite []string, wantFirst string) {
		t.Helper()
		pvName := claims[claim].Spec.VolumeName
		r := reqs[pvName]
		if r == nil {
			t.Fatalf("%s: the driver saw no CreateVolume for %s", claim, pvName)
		}
		req := zonesOf(r.GetAccessibilityRequirements().GetRequisite())
		sort.Strings(req)
		pref := zonesOf(r.GetAccessibilityRequirements().GetPreferred())
		t.Logf("%s: requisite %v preferred %v", claim, req, pref)
		if fmt.Sprint(req) != fmt.Sprint(wantRequisite) {
			t.Errorf("%s: requisite %v, want %v", claim, req, wantRequisite)
		}
		if len(pref) == 0 || (wantFirst != "" && pref[0] != wantFirst) {
			t.Errorf("%s: preferred %v, want %s first", claim, pref, wantFirst)
		}
		pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		terms := pv.Spec.NodeAffinity.Required.NodeSelectorTerms
		if len(terms) != 1 || terms[0].MatchExpressions[0].Key != testenv.LabelZone || terms[0].MatchExpressions[0].Values[0] != pref[0] {
			t.Errorf("%s: PV node affinity %+v, want zone %s", claim, terms, pref[0])
		}
	}
	check("imm", zones, "")
	node := claims["wffc"].Annotations[kube.AnnSelectedNode]
	n, err := c.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	check("wffc", zones, n.Labels[testenv.LabelZone])
	check("allowed", []string{"z2"}, "z2")
}

// TestRetryAfterALostAnswerAsksTheSameTopology: a CreateVolume whose answer
// was lost (DeadlineExceeded: the volume may exist) is asked again with the
// same accessibility requirement, even after its selected node was deleted
// in between, instead of the claim being rescheduled and asked with another
// topology (which a driver would refuse, AlreadyExists, or answer with a
// second volume): the claim binds to the first attempt's volume, its
// selected node kept.
func TestRetryAfterALostAnswerAsksTheSameTopology(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "lost.csi.test")
	nodes, segs := zoneNodes(t, env, ns, drv, "z1", "z2")
	drivers := newCountingDrivers()
	d := drivers.addDriver(t, sampledriver.Config{Name: drv, ControllerSegments: segs})
	var run atomic.Pointer[bridgeRun] // set once the bridge runs
	drivers.script("CreateVolume", func(n int, call func() error) error {
		if n > 1 {
			return call()
		}
		// The volume is made, its answer lost, and the selected node
		// goes before the retry, as the broker's cache sees it too.
		if err := call(); err != nil {
			return err
		}
		if err := c.CoreV1().Nodes().Delete(context.Background(), nodes["z1"], metav1.DeleteOptions{}); err != nil {
			return fmt.Errorf("delete node (test): %w", err)
		}
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			if _, err := run.Load().b.Nodes.Get(nodes["z1"]); apierrors.IsNotFound(err) {
				break
			}
		}
		return status.Error(codes.DeadlineExceeded, "answer lost (test)")
	})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "wffc"), drv, storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete, nil)
	run.Store(startBridge(t, env, ns, drivers, bridgeOpts{}))
	kubetest.MakeClaimWith(t, c, ns, "data", class.Name, func(p *corev1.PersistentVolumeClaim) {
		p.Annotations = map[string]string{kube.AnnSelectedNode: nodes["z1"]}
	})
	bound := kubetest.WaitBound(t, c, ns, "data", 60*time.Second)
	if got := bound.Annotations[kube.AnnSelectedNode]; got != nodes["z1"] {
		t.Errorf("selected node %q after the retry, want %q kept (not rescheduled)", got, nodes["z1"])
	}
	reqs := d.CreateVolumeRequests()
	if len(reqs) < 2 {
		t.Fatalf("%d CreateVolume calls reached the driver, want the lost one and its retry", len(reqs))
	}
	first := reqs[0].GetAccessibilityRequirements()
	for i, r := range reqs[1:] {
		if !proto.Equal(r.GetAccessibilityRequirements(), first) {
			t.Errorf("CreateVolume %d asked requisite %v preferred %v, want the first's %v / %v", i+2,
				zonesOf(r.GetAccessibilityRequirements().GetRequisite()), zonesOf(r.GetAccessibilityRequirements().GetPreferred()),
				zonesOf(first.GetRequisite()), zonesOf(first.GetPreferred()))
		}
	}
	if n := len(d.Volumes()); n != 1 {
		t.Errorf("%d volumes on the driver, want the first attempt's only", n)
	}
}

// TestRescheduleLeavesAClaimMadeAgain: the patch that hands a claim back
// to the scheduler names the claim's UID, so a claim deleted and made
// again under the name while an attempt ran keeps its selected node; the
// API server's refusal of the mismatched UID is taken as that, not as a
// failure.
func TestRescheduleLeavesAClaimMadeAgain(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	r := startBridge(t, env, ns, &testDrivers{}, bridgeOpts{})
	claim := kubetest.MakeClaimWith(t, c, ns, "data", "none", func(p *corev1.PersistentVolumeClaim) {
		p.Annotations = map[string]string{kube.AnnSelectedNode: "n1"}
	})
	old := claim.DeepCopy()
	old.UID = "00000000-0000-0000-0000-000000000001" // the claim an attempt began with
	if err := r.b.prov.Reschedule(context.Background(), old); err != nil {
		t.Fatalf("reschedule of a claim made again: %v, want nothing done and no error", err)
	}
	cur, err := c.CoreV1().PersistentVolumeClaims(ns).Get(context.Background(), "data", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if cur.Annotations[kube.AnnSelectedNode] != "n1" {
		t.Fatalf("the claim made again lost its selected node: %v", cur.Annotations)
	}
	if err := r.b.prov.Reschedule(context.Background(), cur); err != nil {
		t.Fatal(err)
	}
	cur, err = c.CoreV1().PersistentVolumeClaims(ns).Get(context.Background(), "data", metav1.GetOptions{})
	if err != nil || cur.Annotations[kube.AnnSelectedNode] != "" {
		t.Fatalf("the claim itself: %v, annotations %v; want its selected node removed", err, cur.Annotations)
	}
}
