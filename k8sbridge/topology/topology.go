package topology

import (
	"cmp"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
)

// Topology decisions for CreateVolume, with the behaviour of
// external-provisioner's topology table (README "Topology support"):
//
//	delayed | strict | allowedTopologies | immediate-topology | requisite / preferred
//	yes     | yes    | -                 | -                  | selected node's segment / the same
//	yes     | no     | no                | -                  | aggregated cluster topology / rotated, selected node's segment first
//	yes     | no     | yes               | -                  | allowedTopologies flattened / rotated, selected node's segment first
//	no      | -      | yes               | -                  | allowedTopologies flattened / rotated by the claim name's hash
//	no      | -      | no                | yes                | aggregated cluster topology / rotated by the claim name's hash
//	no      | -      | no                | no                 | nil (no requirement sent)
//
// Everything here is pure: the caller turns Node and CSINode objects from its
// listers into Node values.

// Errors AccessibilityRequirements wraps, so a caller can tell them apart
// (with a selected node, each of them is a reason to let the scheduler pick
// another node).
var (
	// ErrNoTopologyKeys: the selected node's CSINode lists no topology keys
	// for the driver (driver not registered there, or registered without
	// topology).
	ErrNoTopologyKeys = errors.New("no topology keys for the driver on the selected node")
	// ErrNodeMissingTopologyLabel: the selected node lacks a label for one of
	// the topology keys its CSINode lists.
	ErrNodeMissingTopologyLabel = errors.New("selected node lacks a topology label")
	// ErrNodeNotInTopology: the selected node's segment is outside
	// allowedTopologies (strict topology) or outside the requisite terms.
	ErrNodeNotInTopology = errors.New("selected node's topology is not allowed")
	// ErrNoAvailableTopology: no node runs the driver with topology keys, or
	// no such node carries the key labels.
	ErrNoAvailableTopology = errors.New("no available topology")
)

// Node is one node as topology decisions see it.
type Node struct {
	Name   string
	Labels map[string]string
	// DriverKeys are the topology keys the node's CSINode lists for the driver;
	// nil when the driver is not registered on the node.
	DriverKeys []string
}

// NewNode builds a driver's view of a node from its Node and CSINode
// objects. csiNode may be nil (not created yet); so may node (deleted), and
// then the name is taken from csiNode. A driver the CSINode lists gets a
// non-nil DriverKeys even when it registered no topology keys, so it still
// counts as running on the node.
func NewNode(node *corev1.Node, csiNode *storagev1.CSINode, driver string) Node {
	var n Node
	if node != nil {
		n.Name, n.Labels = node.Name, node.Labels
	} else if csiNode != nil {
		n.Name = csiNode.Name
	}
	if csiNode != nil {
		for _, d := range csiNode.Spec.Drivers {
			if d.Name == driver {
				n.DriverKeys = append([]string{}, d.TopologyKeys...)
				break
			}
		}
	}
	return n
}

// NodesOf is the cluster as topology decisions see it for driver: one Node
// per Node object, in name order, with the keys its CSINode (the one of
// the same name) lists for the driver. Two rules, the same wherever the
// broker reads topology:
//
//   - A CSINode whose Node object is missing is no node: its keys decide
//     nothing. Such a CSINode is a kubelet registration whose node has been
//     deleted (the garbage collector removes it after its owner), or one
//     made before its Node: no pod can be scheduled there, and keys from it
//     could steer a volume to a topology no live node has. external-
//     provisioner may pick its keys; the broker refuses the claim instead
//     (ErrNoAvailableTopology), and the claim's retry succeeds once a node
//     that exists registers the driver.
//   - Of two entries for the driver in one CSINode (the API server refuses
//     them; a cache may still hold such an object), the first counts, as
//     in NewNode and external-provisioner's getTopologyKeys.
func NodesOf(nodes []*corev1.Node, csiNodes []*storagev1.CSINode, driver string) []Node {
	byName := make(map[string]*storagev1.CSINode, len(csiNodes))
	for _, cn := range csiNodes {
		byName[cn.Name] = cn
	}
	out := make([]Node, 0, len(nodes))
	for _, n := range nodes {
		out = append(out, NewNode(n, byName[n.Name], driver))
	}
	slices.SortFunc(out, func(a, b Node) int { return cmp.Compare(a.Name, b.Name) })
	return out
}

// Input is everything AccessibilityRequirements decides from.
type Input struct {
	Driver            string
	ClaimName         string                        // for StatefulSet-style spreading (name-<index>)
	AllowedTopologies []corev1.TopologySelectorTerm // from the StorageClass
	SelectedNode      *Node                         // nil: Immediate binding
	Nodes             []Node                        // every node, for aggregating cluster topology
	StrictTopology    bool
	ImmediateTopology bool
	// Pick chooses which node's keys to aggregate by when no node is selected
	// (external-provisioner picks a random CSINode); nil = first in name order. Tests pass a deterministic one.
	Pick func(n int) int
}

// AccessibilityRequirements returns the CreateVolume topology requirement, or
// nil when none should be sent, or an error saying what is wrong (no topology
// keys on the selected node's CSINode, selected node missing a key label,
// selected node outside allowedTopologies with strict topology, no node runs
// the driver, ...).
//
// Requisite is sorted and free of duplicates. Preferred is Requisite rotated:
// with a selected node, to start at the first term the node's segment
// satisfies; without one, by the hash of the claim's StatefulSet name plus its
// ordinal, so the replicas of a StatefulSet spread over the segments.
//
// Aggregated cluster topology is the set of segments of the nodes that run the
// driver and carry a label for every topology key; the keys are the selected
// node's (delayed binding) or those of one node running the driver, chosen
// with Pick (immediate binding). Upstream aggregates over every node that
// carries the labels, whether the driver runs there or not; a volume placed
// in a segment where no node runs the driver could not be used, so nodes
// whose CSINode does not list the driver are left out here.
func AccessibilityRequirements(in Input) (*csi.TopologyRequirement, error) {
	var (
		selected     Term
		selectedKeys []string
		selectedName string
		requisite    []Term
		nodeSelected = in.SelectedNode != nil
		allowed      = flattenAllowedTopologies(in.AllowedTopologies)
	)

	// 1. The selected node's segment.
	if nodeSelected {
		selectedName = in.SelectedNode.Name
		selectedKeys = in.SelectedNode.DriverKeys
		if len(selectedKeys) == 0 {
			return nil, fmt.Errorf("node %q: CSINode lists no topology keys for driver %q (driver not registered on the node yet?): %w",
				selectedName, in.Driver, ErrNoTopologyKeys)
		}
		var missing []string
		selected, missing = TermFromLabels(in.SelectedNode.Labels, selectedKeys)
		if len(missing) > 0 {
			return nil, fmt.Errorf("node %q has no label for topology key(s) %s that its CSINode lists for driver %q: %w",
				selectedName, strings.Join(missing, ", "), in.Driver, ErrNodeMissingTopologyLabel)
		}
		if in.StrictTopology {
			if len(in.AllowedTopologies) > 0 && !slices.ContainsFunc(allowed, func(t Term) bool { return t.SubsetOf(selected) }) {
				return nil, fmt.Errorf("node %q has topology %s, which is not in the StorageClass's allowedTopologies %s (strict topology): %w",
					selectedName, selected, topoTermsString(allowed), ErrNodeNotInTopology)
			}
			requisite = []Term{selected}
		}
	}

	// 2. Requisite.
	if len(requisite) == 0 {
		switch {
		case len(in.AllowedTopologies) > 0:
			requisite = slices.Clone(allowed)
		case !nodeSelected && !in.ImmediateTopology:
			// Neither the class nor the claim limits where the volume goes,
			// and the driver is not to be told where nodes are.
			return nil, nil
		default:
			var err error
			requisite, err = aggregateTopology(in, selectedKeys)
			if err != nil {
				return nil, err
			}
		}
	}
	if len(requisite) == 0 {
		// allowedTopologies had only empty terms: behave as without topology.
		return nil, nil
	}
	slices.SortFunc(requisite, Term.Compare)
	requisite = slices.CompactFunc(requisite, func(a, b Term) bool { return a.Compare(b) == 0 })

	// 3. Preferred: requisite rotated.
	first := 0
	switch {
	case !nodeSelected:
		hash, index := ClaimNameHashAndIndex(in.ClaimName)
		first = int((hash + index) % uint32(len(requisite)))
	case in.StrictTopology:
		// requisite is the selected node's segment alone.
	default:
		first = slices.IndexFunc(requisite, func(t Term) bool { return t.SubsetOf(selected) })
		if first < 0 {
			return nil, fmt.Errorf("node %q has topology %s, which is in none of the requisite terms %s: %w",
				selectedName, selected, topoTermsString(requisite), ErrNodeNotInTopology)
		}
	}
	rotated := make([]Term, 0, len(requisite))
	rotated = append(rotated, requisite[first:]...)
	rotated = append(rotated, requisite[:first]...)
	return &csi.TopologyRequirement{
		Requisite: topoTermsToCSI(requisite),
		Preferred: topoTermsToCSI(rotated),
	}, nil
}

// aggregateTopology returns the segments of the nodes that run the driver,
// keyed by the selected node's keys or, without a selected node, by the keys
// of a node picked among those that list some.
func aggregateTopology(in Input, keys []string) ([]Term, error) {
	nodes := slices.Clone(in.Nodes)
	if in.SelectedNode != nil && !slices.ContainsFunc(nodes, func(n Node) bool { return n.Name == in.SelectedNode.Name }) {
		nodes = append(nodes, *in.SelectedNode)
	}
	slices.SortStableFunc(nodes, func(a, b Node) int { return cmp.Compare(a.Name, b.Name) })

	if in.SelectedNode == nil {
		var candidates []Node
		for _, n := range nodes {
			if len(n.DriverKeys) > 0 {
				candidates = append(candidates, n)
			}
		}
		if len(candidates) == 0 {
			return nil, fmt.Errorf("no CSINode lists topology keys for driver %q (is the driver running on any node?): %w",
				in.Driver, ErrNoAvailableTopology)
		}
		i := 0
		if in.Pick != nil {
			i = in.Pick(len(candidates))
			i = ((i % len(candidates)) + len(candidates)) % len(candidates)
		}
		keys = candidates[i].DriverKeys
	}

	var terms []Term
	for _, n := range nodes {
		if n.DriverKeys == nil {
			continue // the driver does not run there
		}
		if t, missing := TermFromLabels(n.Labels, keys); len(missing) == 0 {
			terms = append(terms, t)
		}
	}
	if len(terms) == 0 {
		return nil, fmt.Errorf("no node running driver %q has labels for all of the topology keys %s: %w",
			in.Driver, strings.Join(keys, ", "), ErrNoAvailableTopology)
	}
	return terms, nil
}

// NodeAffinity turns a created volume's accessible topology into PV node affinity: one NodeSelectorTerm per segment, each segment's keys as In requirements; nil for no segments.
//
// Empty segments are skipped (an empty term would match no node); the
// requirements of a term are sorted by key.
func NodeAffinity(segments []*csi.Topology) *corev1.VolumeNodeAffinity {
	var terms []corev1.NodeSelectorTerm
	for _, seg := range segments {
		if len(seg.GetSegments()) == 0 {
			continue
		}
		keys := make([]string, 0, len(seg.GetSegments()))
		for k := range seg.GetSegments() {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		exprs := make([]corev1.NodeSelectorRequirement, 0, len(keys))
		for _, k := range keys {
			exprs = append(exprs, corev1.NodeSelectorRequirement{
				Key:      k,
				Operator: corev1.NodeSelectorOpIn,
				Values:   []string{seg.GetSegments()[k]},
			})
		}
		terms = append(terms, corev1.NodeSelectorTerm{MatchExpressions: exprs})
	}
	if len(terms) == 0 {
		return nil
	}
	return &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{NodeSelectorTerms: terms}}
}

// Segment is one key=value pair of a topology term.
type Segment struct{ Key, Value string }

// Term is an AND of segments, kept sorted by key then value.
type Term []Segment

func (t Term) Sort() {
	slices.SortFunc(t, func(a, b Segment) int {
		return cmp.Or(strings.Compare(a.Key, b.Key), strings.Compare(a.Value, b.Value))
	})
}

// Compare orders terms by length, then segment by segment.
func (t Term) Compare(o Term) int {
	if c := cmp.Compare(len(t), len(o)); c != 0 {
		return c
	}
	for i := range t {
		if c := cmp.Or(strings.Compare(t[i].Key, o[i].Key), strings.Compare(t[i].Value, o[i].Value)); c != 0 {
			return c
		}
	}
	return 0
}

// SubsetOf reports whether every segment of t is in o (both sorted): a node
// whose segment is o satisfies t.
func (t Term) SubsetOf(o Term) bool {
	j := 0
	for _, s := range t {
		for j < len(o) && o[j].Key < s.Key {
			j++
		}
		if j == len(o) || o[j] != s {
			return false
		}
		j++
	}
	return true
}

func (t Term) String() string {
	parts := make([]string, len(t))
	for i, s := range t {
		parts[i] = s.Key + "=" + s.Value
	}
	return "{" + strings.Join(parts, ",") + "}"
}

func topoTermsString(ts []Term) string {
	parts := make([]string, len(ts))
	for i, t := range ts {
		parts[i] = t.String()
	}
	return "[" + strings.Join(parts, " ") + "]"
}

// TermFromLabels returns the term of keys' values in labels, or the keys
// that have no label.
func TermFromLabels(labels map[string]string, keys []string) (Term, []string) {
	t := make(Term, 0, len(keys))
	var missing []string
	for _, k := range keys {
		v, ok := labels[k]
		if !ok {
			missing = append(missing, k)
			continue
		}
		t = append(t, Segment{k, v})
	}
	if len(missing) > 0 {
		return nil, missing
	}
	t.Sort()
	return t, nil
}

// flattenAllowedTopologies turns allowedTopologies (an OR of terms, each an
// AND of expressions, each an OR of values) into an OR of plain terms: each
// term's expressions are expanded into the cartesian product of their values.
//
// For example {zone in [z1,z2], rack in [a,b]} becomes
// {zone=z1,rack=a} {zone=z2,rack=a} {zone=z1,rack=b} {zone=z2,rack=b}.
func flattenAllowedTopologies(allowed []corev1.TopologySelectorTerm) []Term {
	var out []Term
	for _, sel := range allowed {
		if len(sel.MatchLabelExpressions) == 0 {
			continue
		}
		product := []Term{nil}
		for _, expr := range sel.MatchLabelExpressions {
			next := make([]Term, 0, len(product)*len(expr.Values))
			for _, v := range expr.Values {
				for _, t := range product {
					next = append(next, append(slices.Clone(t), Segment{expr.Key, v}))
				}
			}
			product = next
		}
		out = append(out, product...)
	}
	for _, t := range out {
		t.Sort()
	}
	return out
}

// InAllowed reports whether a node with labels is in one of a
// StorageClass's allowedTopologies terms (every expression of the term
// holds: the node's label has one of its values).
func InAllowed(terms []corev1.TopologySelectorTerm, labels map[string]string) bool {
	for _, term := range terms {
		if len(term.MatchLabelExpressions) == 0 {
			continue
		}
		in := true
		for _, e := range term.MatchLabelExpressions {
			if v, ok := labels[e.Key]; !ok || !slices.Contains(e.Values, v) {
				in = false
				break
			}
		}
		if in {
			return true
		}
	}
	return false
}

func topoTermsToCSI(ts []Term) []*csi.Topology {
	out := make([]*csi.Topology, 0, len(ts))
	for _, t := range ts {
		if len(t) == 0 {
			continue
		}
		segs := make(map[string]string, len(t))
		for _, s := range t {
			segs[s.Key] = s.Value
		}
		out = append(out, &csi.Topology{Segments: segs})
	}
	return out
}

// ClaimNameHashAndIndex is the StatefulSet spreading heuristic of
// external-provisioner (and of the in-tree volume plugins): a claim named
// <template>-<set>-<ordinal> hashes only <set> (the part after the last dash
// before the ordinal) and is offset by its ordinal, so the replicas of a set
// take successive segments while the claims of one replica stay together.
// Other names are hashed whole with no offset. The hash is 32-bit FNV-1.
// (Upstream hashes a random number for an empty name; claims always have
// names, and this stays deterministic.)
func ClaimNameHashAndIndex(name string) (hash, index uint32) {
	hashed := name
	if dash := strings.LastIndexByte(name, '-'); dash >= 0 {
		if ordinal, err := strconv.ParseUint(name[dash+1:], 10, 32); err == nil {
			index = uint32(ordinal)
			hashed = name[:dash]
			if d := strings.LastIndexByte(hashed, '-'); d >= 0 {
				hashed = hashed[d+1:]
			}
		}
	}
	h := fnv.New32()
	h.Write([]byte(hashed))
	return h.Sum32(), index
}

// Labels is the term as a label map (key → value).
func (t Term) Labels() map[string]string {
	m := make(map[string]string, len(t))
	for _, s := range t {
		m[s.Key] = s.Value
	}
	return m
}
