package topology

import (
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Topology fixtures: zones z1..z3, each with one node running the driver
// (keys: zone), a node in z4 without the driver, and a second node in z1.
const (
	tkZone = "zone"
	tkRack = "rack"
)

func topoNode(name string, keys []string, labels ...string) Node {
	n := Node{Name: name, DriverKeys: keys, Labels: map[string]string{}}
	for i := 0; i+1 < len(labels); i += 2 {
		n.Labels[labels[i]] = labels[i+1]
	}
	return n
}

var (
	zoneKeys  = []string{tkZone}
	tn1       = topoNode("n1", zoneKeys, tkZone, "z1", "kubernetes.io/hostname", "n1")
	tn1b      = topoNode("n1b", zoneKeys, tkZone, "z1")
	tn2       = topoNode("n2", zoneKeys, tkZone, "z2")
	tn3       = topoNode("n3", zoneKeys, tkZone, "z3")
	tn4       = topoNode("n4", nil, tkZone, "z4") // driver not registered
	topoNodes = []Node{tn3, tn1, tn4, tn2, tn1b}
)

func topoPtr(n Node) *Node { return &n }

// allowedZones is an allowedTopologies with one term: zone in values.
func allowedZones(values ...string) []corev1.TopologySelectorTerm {
	return []corev1.TopologySelectorTerm{{MatchLabelExpressions: []corev1.TopologySelectorLabelRequirement{
		{Key: tkZone, Values: values},
	}}}
}

// topoRender renders segments as "k=v,k=v k=v" (keys sorted, terms in order).
func topoRender(ts []*csi.Topology) string {
	parts := make([]string, 0, len(ts))
	for _, t := range ts {
		var kv []string
		for k, v := range t.GetSegments() {
			kv = append(kv, k+"="+v)
		}
		slices.Sort(kv)
		parts = append(parts, strings.Join(kv, ","))
	}
	return strings.Join(parts, " ")
}

func topoRenderReq(r *csi.TopologyRequirement) string {
	if r == nil {
		return "nil"
	}
	return "req=[" + topoRender(r.Requisite) + "] pref=[" + topoRender(r.Preferred) + "]"
}

// topoFNV1 is the 32-bit FNV-1 hash upstream spreads StatefulSet claims with.
func topoFNV1(s string) uint32 {
	h := fnv.New32()
	h.Write([]byte(s))
	return h.Sum32()
}

// rotated returns "req=[terms] pref=[terms rotated to start at first]".
func topoRotated(terms []string, first int) string {
	pref := append(slices.Clone(terms[first:]), terms[:first]...)
	return "req=[" + strings.Join(terms, " ") + "] pref=[" + strings.Join(pref, " ") + "]"
}

// topoSpreadIndex is where upstream's spreading puts a StatefulSet claim
// (<template>-<set>-<ordinal>) among n terms.
func topoSpreadIndex(set string, ordinal uint32, n int) int {
	return int((topoFNV1(set) + ordinal) % uint32(n))
}

func TestAccessibilityRequirements(t *testing.T) {
	zones3 := []string{"zone=z1", "zone=z2", "zone=z3"}
	webFirst := topoSpreadIndex("web", 1, 3)

	type tc struct {
		name    string
		in      Input
		want    string // topoRenderReq of the result
		wantErr error  // errors.Is target; want is ignored when set
	}
	var cases []tc

	// One case per row of the external-provisioner README topology table
	// (delayed binding | strict topology | allowed topologies | immediate
	// topology), run with every value of the row's "Irrelevant" columns.
	bools := []bool{false, true}
	for _, allowed := range bools {
		for _, immediate := range bools {
			var at []corev1.TopologySelectorTerm
			if allowed {
				at = allowedZones("z1", "z2")
			}
			// Requisite = Preferred = selected node topology.
			cases = append(cases, tc{
				name: fmt.Sprintf("row1 delayed, strict [allowed=%v immediate-topology=%v]", allowed, immediate),
				in: Input{Driver: "d", ClaimName: "data-web-1", SelectedNode: topoPtr(tn2), Nodes: topoNodes,
					AllowedTopologies: at, StrictTopology: true, ImmediateTopology: immediate},
				want: "req=[zone=z2] pref=[zone=z2]",
			})
		}
	}
	for _, immediate := range bools {
		// Requisite = aggregated cluster topology (n4 does not run the
		// driver); Preferred = Requisite with the selected node's first.
		cases = append(cases, tc{
			name: fmt.Sprintf("row2 delayed, not strict, no allowed [immediate-topology=%v]", immediate),
			in: Input{Driver: "d", ClaimName: "data-web-1", SelectedNode: topoPtr(tn2), Nodes: topoNodes,
				ImmediateTopology: immediate},
			want: topoRotated(zones3, 1),
		})
	}
	for _, immediate := range bools {
		// Requisite = allowed topologies; Preferred = Requisite with the
		// selected node's first.
		cases = append(cases, tc{
			name: fmt.Sprintf("row3 delayed, not strict, allowed [immediate-topology=%v]", immediate),
			in: Input{Driver: "d", ClaimName: "data-web-1", SelectedNode: topoPtr(tn3), Nodes: topoNodes,
				AllowedTopologies: allowedZones("z3", "z1", "z4"), ImmediateTopology: immediate},
			want: topoRotated([]string{"zone=z1", "zone=z3", "zone=z4"}, 1),
		})
	}
	for _, strict := range bools {
		for _, immediate := range bools {
			// Requisite = allowed topologies; Preferred = Requisite rotated
			// by the claim name's hash.
			cases = append(cases, tc{
				name: fmt.Sprintf("row4 immediate, allowed [strict=%v immediate-topology=%v]", strict, immediate),
				in: Input{Driver: "d", ClaimName: "data-web-1", Nodes: topoNodes,
					AllowedTopologies: allowedZones("z3", "z2", "z1"), StrictTopology: strict, ImmediateTopology: immediate},
				want: topoRotated(zones3, webFirst),
			})
		}
	}
	for _, strict := range bools {
		// Requisite = aggregated cluster topology; Preferred = Requisite
		// rotated by the claim name's hash.
		cases = append(cases, tc{
			name: fmt.Sprintf("row5 immediate, no allowed, immediate-topology [strict=%v]", strict),
			in: Input{Driver: "d", ClaimName: "data-web-1", Nodes: topoNodes,
				StrictTopology: strict, ImmediateTopology: true},
			want: topoRotated(zones3, webFirst),
		})
	}
	for _, strict := range bools {
		// Requisite and Preferred both nil.
		cases = append(cases, tc{
			name: fmt.Sprintf("row6 immediate, no allowed, no immediate-topology [strict=%v]", strict),
			in: Input{Driver: "d", ClaimName: "data-web-1", Nodes: topoNodes,
				StrictTopology: strict},
			want: "nil",
		})
	}

	cases = append(cases,
		// Errors.
		tc{
			name:    "error: selected node's CSINode lists no keys for the driver",
			in:      Input{Driver: "d", SelectedNode: topoPtr(tn4), Nodes: topoNodes},
			wantErr: ErrNoTopologyKeys,
		},
		tc{
			name:    "error: selected node's driver registered with empty keys",
			in:      Input{Driver: "d", SelectedNode: topoPtr(topoNode("n9", []string{}, tkZone, "z1")), Nodes: topoNodes},
			wantErr: ErrNoTopologyKeys,
		},
		tc{
			name: "error: selected node lacks a key label",
			in: Input{Driver: "d", SelectedNode: topoPtr(topoNode("n9", []string{tkZone, tkRack}, tkZone, "z1")),
				Nodes: topoNodes},
			wantErr: ErrNodeMissingTopologyLabel,
		},
		tc{
			name: "error: strict, selected node outside allowedTopologies",
			in: Input{Driver: "d", SelectedNode: topoPtr(tn3), Nodes: topoNodes,
				AllowedTopologies: allowedZones("z1", "z2"), StrictTopology: true},
			wantErr: ErrNodeNotInTopology,
		},
		tc{
			name: "error: strict, allowedTopologies uses a key the node's segment lacks",
			in: Input{Driver: "d", SelectedNode: topoPtr(tn1), Nodes: topoNodes, StrictTopology: true,
				AllowedTopologies: []corev1.TopologySelectorTerm{{MatchLabelExpressions: []corev1.TopologySelectorLabelRequirement{
					{Key: tkZone, Values: []string{"z1"}}, {Key: tkRack, Values: []string{"r1"}}}}}},
			wantErr: ErrNodeNotInTopology,
		},
		tc{
			name: "error: not strict, selected node outside allowedTopologies",
			in: Input{Driver: "d", SelectedNode: topoPtr(tn3), Nodes: topoNodes,
				AllowedTopologies: allowedZones("z1", "z2")},
			wantErr: ErrNodeNotInTopology,
		},
		tc{
			name:    "error: immediate topology, no node runs the driver",
			in:      Input{Driver: "d", Nodes: []Node{tn4}, ImmediateTopology: true},
			wantErr: ErrNoAvailableTopology,
		},
		tc{
			name:    "error: immediate topology, no nodes at all",
			in:      Input{Driver: "d", ImmediateTopology: true},
			wantErr: ErrNoAvailableTopology,
		},
		tc{
			name: "error: immediate topology, the picked keys are on no node's labels",
			in: Input{Driver: "d", ImmediateTopology: true,
				Nodes: []Node{topoNode("n1", []string{tkRack}, tkZone, "z1")}},
			wantErr: ErrNoAvailableTopology,
		},

		// Strict with a selected node inside allowedTopologies, given as a
		// term with more keys: the node's full segment is sent.
		tc{
			name: "strict: selected node within a coarser allowed term sends its own segment",
			in: Input{Driver: "d", Nodes: topoNodes, StrictTopology: true,
				SelectedNode:      topoPtr(topoNode("r", []string{tkZone, tkRack}, tkZone, "z1", tkRack, "r7")),
				AllowedTopologies: allowedZones("z1")},
			want: "req=[rack=r7,zone=z1] pref=[rack=r7,zone=z1]",
		},

		// Aggregation details.
		tc{
			name: "aggregated: nodes without the driver are left out, duplicates merged",
			in: Input{Driver: "d", SelectedNode: topoPtr(tn1), ImmediateTopology: false,
				Nodes: []Node{tn1, tn1b, tn4, topoNode("n5", zoneKeys, tkZone, "z1")}},
			want: "req=[zone=z1] pref=[zone=z1]",
		},
		tc{
			name: "aggregated: the selected node counts even when missing from Nodes",
			in:   Input{Driver: "d", SelectedNode: topoPtr(tn3), Nodes: []Node{tn1, tn2}},
			want: topoRotated(zones3, 2),
		},
		tc{
			name: "aggregated: keys are the selected node's, nodes lacking one of them are left out",
			in: Input{Driver: "d",
				SelectedNode: topoPtr(topoNode("a", []string{tkZone, tkRack}, tkZone, "z1", tkRack, "r2")),
				Nodes: []Node{
					topoNode("b", []string{tkZone, tkRack}, tkZone, "z1", tkRack, "r1"),
					topoNode("c", []string{tkZone}, tkZone, "z2"),
					topoNode("d", []string{tkZone}, tkZone, "z3", tkRack, "r1"),
				}},
			want: topoRotated([]string{"rack=r1,zone=z1", "rack=r1,zone=z3", "rack=r2,zone=z1"}, 2),
		},
		tc{
			name: "aggregated, immediate: Pick chooses whose keys (here zone+rack)",
			in: Input{Driver: "d", ClaimName: "solo", ImmediateTopology: true,
				Pick: func(n int) int { return n - 1 }, // the last in name order: "c"
				Nodes: []Node{
					topoNode("c", []string{tkZone, tkRack}, tkZone, "z1", tkRack, "r1"),
					topoNode("a", []string{tkZone}, tkZone, "z2", tkRack, "r2"),
					topoNode("b", nil, tkZone, "z3", tkRack, "r3"),
				}},
			want: "req=[rack=r1,zone=z1 rack=r2,zone=z2] pref=" +
				[]string{"[rack=r1,zone=z1 rack=r2,zone=z2]", "[rack=r2,zone=z2 rack=r1,zone=z1]"}[topoFNV1("solo")%2],
		},
		tc{
			name: "aggregated, immediate: nil Pick takes the first node in name order with keys",
			in: Input{Driver: "d", ClaimName: "solo", ImmediateTopology: true,
				Nodes: []Node{
					topoNode("c", []string{tkZone, tkRack}, tkZone, "z1", tkRack, "r1"),
					topoNode("b", []string{tkZone}, tkZone, "z2", tkRack, "r2"),
					topoNode("a", nil, tkZone, "z3"),
				}},
			want: "req=[zone=z1 zone=z2] pref=" +
				[]string{"[zone=z1 zone=z2]", "[zone=z2 zone=z1]"}[topoFNV1("solo")%2],
		},
		tc{
			name: "aggregated, immediate: an out-of-range Pick wraps around",
			in: Input{Driver: "d", ClaimName: "solo", ImmediateTopology: true, Pick: func(int) int { return -1 },
				Nodes: []Node{
					topoNode("a", []string{tkZone}, tkZone, "z1", tkRack, "r1"),
					topoNode("b", []string{tkRack}, tkZone, "z2", tkRack, "r2"),
				}},
			want: "req=[rack=r1 rack=r2] pref=" +
				[]string{"[rack=r1 rack=r2]", "[rack=r2 rack=r1]"}[topoFNV1("solo")%2],
		},

		// Deduplication and flattening of allowedTopologies.
		tc{
			name: "allowed: duplicate values and terms are sent once",
			in: Input{Driver: "d", SelectedNode: topoPtr(tn2), Nodes: topoNodes,
				AllowedTopologies: append(allowedZones("z2", "z1", "z2"), allowedZones("z1")...)},
			want: "req=[zone=z1 zone=z2] pref=[zone=z2 zone=z1]",
		},
		tc{
			name: "allowed: multi-value expressions are flattened into their cartesian product, terms ORed",
			in: Input{Driver: "d", ClaimName: "x", SelectedNode: topoPtr(topoNode("n", []string{tkZone, tkRack}, tkZone, "z2", tkRack, "b")),
				AllowedTopologies: []corev1.TopologySelectorTerm{
					{MatchLabelExpressions: []corev1.TopologySelectorLabelRequirement{
						{Key: tkZone, Values: []string{"z1", "z2"}},
						{Key: tkRack, Values: []string{"a", "b"}},
					}},
					{MatchLabelExpressions: []corev1.TopologySelectorLabelRequirement{{Key: tkZone, Values: []string{"z3"}}}},
				}},
			want: topoRotated([]string{"zone=z3", "rack=a,zone=z1", "rack=a,zone=z2", "rack=b,zone=z1", "rack=b,zone=z2"}, 4),
		},
		tc{
			name: "allowed: only empty terms behaves as no topology",
			in: Input{Driver: "d", SelectedNode: topoPtr(tn2), Nodes: topoNodes,
				AllowedTopologies: []corev1.TopologySelectorTerm{{}}},
			want: "nil",
		},
	)

	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := AccessibilityRequirements(c.in)
			if c.wantErr != nil {
				if !errors.Is(err, c.wantErr) {
					t.Fatalf("error = %v, want %v", err, c.wantErr)
				}
				if got != nil {
					t.Errorf("requirement %s alongside error", topoRenderReq(got))
				}
				t.Logf("error: %v", err)
				return
			}
			if err != nil {
				t.Fatalf("unexpected error: %v", err)
			}
			if s := topoRenderReq(got); s != c.want {
				t.Errorf("got  %s\nwant %s", s, c.want)
			}
			if got != nil {
				topoCheckRotation(t, got)
			}
		})
	}
}

// topoCheckRotation checks that preferred holds the same terms as requisite, in
// rotated order, and shares no object with it.
func topoCheckRotation(t *testing.T, r *csi.TopologyRequirement) {
	t.Helper()
	n := len(r.Requisite)
	if len(r.Preferred) != n || n == 0 {
		t.Fatalf("requisite has %d terms, preferred %d", n, len(r.Preferred))
	}
	req := strings.Fields(topoRender(r.Requisite))
	pref := strings.Fields(topoRender(r.Preferred))
	first := slices.Index(req, pref[0])
	for i := range pref {
		if pref[i] != req[(first+i)%n] {
			t.Fatalf("preferred %v is not a rotation of requisite %v", pref, req)
		}
		if slices.Contains(r.Requisite, r.Preferred[i]) {
			t.Fatalf("preferred term %d is the same object as a requisite term", i)
		}
	}
}

func TestAccessibilityRequirementsSpreadsStatefulSet(t *testing.T) {
	in := Input{Driver: "d", Nodes: topoNodes, ImmediateTopology: true}
	first := func(claim string) string {
		t.Helper()
		in.ClaimName = claim
		r, err := AccessibilityRequirements(in)
		if err != nil {
			t.Fatal(err)
		}
		return topoRender(r.Preferred[:1])
	}

	// Three replicas over three zones: each starts in another zone, and the
	// pattern repeats with the fourth.
	seen := map[string]string{}
	for i := range 3 {
		claim := fmt.Sprintf("data-web-%d", i)
		z := first(claim)
		if other, dup := seen[z]; dup {
			t.Errorf("%s and %s both prefer %s", other, claim, z)
		}
		seen[z] = claim
	}
	if a, b := first("data-web-0"), first("data-web-3"); a != b {
		t.Errorf("data-web-3 prefers %s, want data-web-0's %s (ordinal modulo zones)", b, a)
	}
	// Claims of one replica from different templates stay together: only the
	// set name is hashed.
	for i := range 5 {
		if a, b := first(fmt.Sprintf("data-web-%d", i)), first(fmt.Sprintf("logs-web-%d", i)); a != b {
			t.Errorf("replica %d: data prefers %s, logs %s", i, a, b)
		}
	}
	// Deterministic for a given name, and in the zone the hash says.
	for i := range 6 {
		want := []string{"zone=z1", "zone=z2", "zone=z3"}[topoSpreadIndex("web", uint32(i), 3)]
		if got := first(fmt.Sprintf("data-web-%d", i)); got != want {
			t.Errorf("data-web-%d prefers %s, want %s", i, got, want)
		}
	}
	// Names without an ordinal are hashed whole.
	if got, want := first("scratch"), []string{"zone=z1", "zone=z2", "zone=z3"}[topoFNV1("scratch")%3]; got != want {
		t.Errorf("scratch prefers %s, want %s", got, want)
	}
}

func TestClaimNameHashAndIndex(t *testing.T) {
	cases := []struct {
		name      string
		hashed    string
		wantIndex uint32
	}{
		{"data-web-2", "web", 2},
		{"web-7", "web", 7},
		{"data-my-web-3", "web", 3},
		{"plain", "plain", 0},
		{"trailing-", "trailing-", 0},
		{"not-a-number-x1", "not-a-number-x1", 0},
		{"neg--1", "", 1},
		{"", "", 0},
	}
	for _, c := range cases {
		h, i := ClaimNameHashAndIndex(c.name)
		if h != topoFNV1(c.hashed) || i != c.wantIndex {
			t.Errorf("%q: hash %d index %d, want hash of %q (%d) index %d", c.name, h, i, c.hashed, topoFNV1(c.hashed), c.wantIndex)
		}
	}
}

func TestFlattenAllowedTopologies(t *testing.T) {
	expr := func(key string, values ...string) corev1.TopologySelectorLabelRequirement {
		return corev1.TopologySelectorLabelRequirement{Key: key, Values: values}
	}
	cases := []struct {
		name    string
		allowed []corev1.TopologySelectorTerm
		want    string
	}{
		{"none", nil, "[]"},
		{"empty term", []corev1.TopologySelectorTerm{{}}, "[]"},
		{"one value", []corev1.TopologySelectorTerm{{MatchLabelExpressions: []corev1.TopologySelectorLabelRequirement{expr("z", "1")}}},
			"[{z=1}]"},
		{"OR of values", []corev1.TopologySelectorTerm{{MatchLabelExpressions: []corev1.TopologySelectorLabelRequirement{expr("z", "1", "2")}}},
			"[{z=1} {z=2}]"},
		{"AND of ORs is the product", []corev1.TopologySelectorTerm{{MatchLabelExpressions: []corev1.TopologySelectorLabelRequirement{
			expr("z", "1", "2"), expr("r", "a", "b"), expr("d", "x")}}},
			"[{d=x,r=a,z=1} {d=x,r=a,z=2} {d=x,r=b,z=1} {d=x,r=b,z=2}]"},
		{"an expression with no values leaves the term empty", []corev1.TopologySelectorTerm{{MatchLabelExpressions: []corev1.TopologySelectorLabelRequirement{
			expr("z", "1"), expr("r"), expr("d", "x")}}},
			"[]"},
		{"terms are ORed", []corev1.TopologySelectorTerm{
			{MatchLabelExpressions: []corev1.TopologySelectorLabelRequirement{expr("z", "1")}},
			{MatchLabelExpressions: []corev1.TopologySelectorLabelRequirement{expr("r", "a", "b")}}},
			"[{z=1} {r=a} {r=b}]"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := topoTermsString(flattenAllowedTopologies(c.allowed)); got != c.want {
				t.Errorf("got %s, want %s", got, c.want)
			}
		})
	}
}

func TestTopoTermSubsetOf(t *testing.T) {
	term := func(kv ...string) Term {
		var t Term
		for i := 0; i+1 < len(kv); i += 2 {
			t = append(t, Segment{kv[i], kv[i+1]})
		}
		t.Sort()
		return t
	}
	cases := []struct {
		a, b Term
		want bool
	}{
		{term(), term("z", "1"), true},
		{term("z", "1"), term("z", "1"), true},
		{term("z", "1"), term("r", "a", "z", "1"), true},
		{term("r", "a", "z", "1"), term("z", "1"), false},
		{term("z", "2"), term("r", "a", "z", "1"), false},
		{term("r", "a", "z", "1"), term("d", "x", "r", "a", "z", "1"), true},
		{term("q", "1"), term("r", "a", "z", "1"), false},
	}
	for _, c := range cases {
		if got := c.a.SubsetOf(c.b); got != c.want {
			t.Errorf("%s subsetOf %s = %v, want %v", c.a, c.b, got, c.want)
		}
	}
}

func TestNodeAffinity(t *testing.T) {
	render := func(a *corev1.VolumeNodeAffinity) string {
		if a == nil {
			return "nil"
		}
		var terms []string
		for _, term := range a.Required.NodeSelectorTerms {
			var exprs []string
			for _, e := range term.MatchExpressions {
				exprs = append(exprs, fmt.Sprintf("%s %s %v", e.Key, e.Operator, e.Values))
			}
			terms = append(terms, "("+strings.Join(exprs, " && ")+")")
		}
		return strings.Join(terms, " || ")
	}
	cases := []struct {
		name     string
		segments []*csi.Topology
		want     string
	}{
		{"nil", nil, "nil"},
		{"only empty segments", []*csi.Topology{{}, nil, {Segments: map[string]string{}}}, "nil"},
		{"one segment", []*csi.Topology{{Segments: map[string]string{"zone": "z1"}}}, "(zone In [z1])"},
		{"one term per segment, keys as In requirements sorted by key",
			[]*csi.Topology{
				{Segments: map[string]string{"zone": "z1", "rack": "r1"}},
				{},
				{Segments: map[string]string{"zone": "z2"}},
			},
			"(rack In [r1] && zone In [z1]) || (zone In [z2])"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := render(NodeAffinity(c.segments)); got != c.want {
				t.Errorf("got %s, want %s", got, c.want)
			}
		})
	}
}

func TestNewTopologyNode(t *testing.T) {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1", Labels: map[string]string{tkZone: "z1"}}}
	csiNode := &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: "n1"}, Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{
		{Name: "other", TopologyKeys: []string{tkRack}},
		{Name: "d", TopologyKeys: []string{tkZone}},
		{Name: "flat"}, // registered without topology keys
	}}}
	cases := []struct {
		name     string
		node     *corev1.Node
		csiNode  *storagev1.CSINode
		driver   string
		wantName string
		wantKeys []string // nil: not registered
		wantNil  bool
	}{
		{"registered with keys", node, csiNode, "d", "n1", []string{tkZone}, false},
		{"registered without keys is not nil", node, csiNode, "flat", "n1", []string{}, false},
		{"not registered", node, csiNode, "absent", "n1", nil, true},
		{"no CSINode", node, nil, "d", "n1", nil, true},
		{"no Node", nil, csiNode, "d", "n1", []string{tkZone}, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			n := NewNode(c.node, c.csiNode, c.driver)
			if n.Name != c.wantName || (n.DriverKeys == nil) != c.wantNil || !slices.Equal(n.DriverKeys, c.wantKeys) {
				t.Errorf("got %+v, want name %q keys %v (nil %v)", n, c.wantName, c.wantKeys, c.wantNil)
			}
			if c.node != nil && n.Labels[tkZone] != "z1" {
				t.Errorf("labels %v", n.Labels)
			}
		})
	}
}

// A claim waiting for its first consumer, scheduled to a node in zone b of a
// three-zone cluster: any zone is allowed, zone b is preferred.
func ExampleAccessibilityRequirements() {
	node := func(name, zone string) Node {
		return Node{Name: name, Labels: map[string]string{"topology.kubernetes.io/zone": zone},
			DriverKeys: []string{"topology.kubernetes.io/zone"}}
	}
	nodes := []Node{node("n1", "a"), node("n2", "b"), node("n3", "c")}
	req, err := AccessibilityRequirements(Input{
		Driver:       "hostpath.example.com",
		ClaimName:    "data-db-0",
		SelectedNode: &nodes[1],
		Nodes:        nodes,
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("requisite:", topoRender(req.Requisite))
	fmt.Println("preferred:", topoRender(req.Preferred))
	// Output:
	// requisite: topology.kubernetes.io/zone=a topology.kubernetes.io/zone=b topology.kubernetes.io/zone=c
	// preferred: topology.kubernetes.io/zone=b topology.kubernetes.io/zone=c topology.kubernetes.io/zone=a
}

// TestInAllowedTopologies: a node is in a class's allowedTopologies when
// every expression of one term holds for its labels.
func TestInAllowedTopologies(t *testing.T) {
	terms := []corev1.TopologySelectorTerm{
		{MatchLabelExpressions: []corev1.TopologySelectorLabelRequirement{{Key: "zone", Values: []string{"z1", "z2"}}, {Key: "rack", Values: []string{"a"}}}},
		{MatchLabelExpressions: []corev1.TopologySelectorLabelRequirement{{Key: "zone", Values: []string{"z3"}}}},
		{}, // an empty term allows nothing
	}
	for _, tc := range []struct {
		labels map[string]string
		want   bool
	}{
		{map[string]string{"zone": "z2", "rack": "a"}, true},
		{map[string]string{"zone": "z2", "rack": "b"}, false},
		{map[string]string{"zone": "z2"}, false},
		{map[string]string{"zone": "z3", "rack": "x"}, true},
		{map[string]string{}, false},
	} {
		if got := InAllowed(terms, tc.labels); got != tc.want {
			t.Errorf("labels %v: %v, want %v", tc.labels, got, tc.want)
		}
	}
}

// TestNodesOf: the two rules every topology decision shares. A CSINode
// whose Node is missing is no node (its keys decide nothing, so a driver
// registered only there has no topology, and a claim that needs one is
// refused until a node that exists registers it); of two entries for the
// driver in one CSINode, the first counts.
func TestNodesOf(t *testing.T) {
	node := func(name, zone string) *corev1.Node {
		return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{tkZone: zone}}}
	}
	csiNode := func(name string, drivers ...storagev1.CSINodeDriver) *storagev1.CSINode {
		return &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: storagev1.CSINodeSpec{Drivers: drivers}}
	}
	zoned := storagev1.CSINodeDriver{Name: "d", TopologyKeys: []string{tkZone}}
	racked := storagev1.CSINodeDriver{Name: "d", TopologyKeys: []string{tkRack}}
	tests := []struct {
		name     string
		nodes    []*corev1.Node
		csiNodes []*storagev1.CSINode
		want     []Node
		// wantErr: AccessibilityRequirements of an Immediate claim with
		// immediate topology over these nodes fails with it (nil: it
		// succeeds).
		wantErr error
	}{
		{
			name:     "a CSINode without its Node is no node",
			nodes:    []*corev1.Node{node("n1", "z1")},
			csiNodes: []*storagev1.CSINode{csiNode("gone", zoned), csiNode("n1")},
			want:     []Node{{Name: "n1", Labels: map[string]string{tkZone: "z1"}}},
			wantErr:  ErrNoAvailableTopology,
		},
		{
			name:     "a Node without a CSINode runs no driver",
			nodes:    []*corev1.Node{node("n2", "z2"), node("n1", "z1")},
			csiNodes: []*storagev1.CSINode{csiNode("n1", zoned)},
			want: []Node{
				{Name: "n1", Labels: map[string]string{tkZone: "z1"}, DriverKeys: []string{tkZone}},
				{Name: "n2", Labels: map[string]string{tkZone: "z2"}},
			},
		},
		{
			name:     "the first of two entries for the driver counts",
			nodes:    []*corev1.Node{node("n1", "z1")},
			csiNodes: []*storagev1.CSINode{csiNode("n1", zoned, racked)},
			want:     []Node{{Name: "n1", Labels: map[string]string{tkZone: "z1"}, DriverKeys: []string{tkZone}}},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := NodesOf(tc.nodes, tc.csiNodes, "d")
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Fatalf("nodes %+v, want %+v", got, tc.want)
			}
			_, err := AccessibilityRequirements(Input{Driver: "d", ClaimName: "c", Nodes: got, ImmediateTopology: true})
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("AccessibilityRequirements: %v, want %v", err, tc.wantErr)
			}
		})
	}
}
