package capacity

import (
	"maps"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"

	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/csiparams"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/secrets"
	"github.com/csibroker/csibroker/k8sbridge/topology"
)

func TestCapacitySegments(t *testing.T) {
	const zone, rack, host = testenv.LabelZone, "example.com/rack", corev1.LabelHostname
	node := func(name string, keys []string, labels ...string) topology.Node {
		l := map[string]string{}
		for i := 0; i+1 < len(labels); i += 2 {
			l[labels[i]] = labels[i+1]
		}
		return topology.Node{Name: name, Labels: l, DriverKeys: keys}
	}
	type seg struct{ term, request, node string }
	for _, tc := range []struct {
		name      string
		nodeLocal bool
		nodes     []topology.Node
		want      []seg
	}{
		{
			name: "central driver: one segment per distinct zone, sorted",
			nodes: []topology.Node{
				node("n3", []string{zone}, zone, "z2", host, "n3"),
				node("n1", []string{zone}, zone, "z1", host, "n1"),
				node("n2", []string{zone}, zone, "z1", host, "n2"),
			},
			want: []seg{{term: "{" + zone + "=z1}", request: "{" + zone + "=z1}"}, {term: "{" + zone + "=z2}", request: "{" + zone + "=z2}"}},
		},
		{
			name: "central driver: several keys make one segment",
			nodes: []topology.Node{
				node("n1", []string{zone, rack}, zone, "z1", rack, "r1"),
				node("n2", []string{rack, zone}, zone, "z1", rack, "r2"),
			},
			want: []seg{
				{term: "{" + rack + "=r1," + zone + "=z1}", request: "{" + rack + "=r1," + zone + "=z1}"},
				{term: "{" + rack + "=r2," + zone + "=z1}", request: "{" + rack + "=r2," + zone + "=z1}"},
			},
		},
		{
			name: "nodes not running the driver or missing a key label give nothing",
			nodes: []topology.Node{
				node("n1", nil, zone, "z9"),
				node("n2", []string{zone}, rack, "r1"),
				node("n3", []string{zone}, zone, "z1"),
			},
			want: []seg{{term: "{" + zone + "=z1}", request: "{" + zone + "=z1}"}},
		},
		{
			name: "central driver without topology keys: the empty segment, every node",
			nodes: []topology.Node{
				node("n1", []string{}, zone, "z1"),
				node("n2", []string{}, zone, "z2"),
			},
			want: []seg{{term: "{}", request: "{}"}},
		},
		{
			name:      "node-local driver: one segment per node, asked in its own keys",
			nodeLocal: true,
			nodes: []topology.Node{
				node("n2", []string{rack}, host, "n2", rack, "r1"),
				node("n1", []string{host}, host, "n1"),
			},
			want: []seg{
				{term: "{" + host + "=n1}", request: "{" + host + "=n1}", node: "n1"},
				{term: "{" + host + "=n2}", request: "{" + rack + "=r1}", node: "n2"},
			},
		},
		{
			name:      "node-local driver without topology keys still gets per-node segments",
			nodeLocal: true,
			nodes: []topology.Node{
				node("n1", []string{}, host, "n1"),
				node("n2", nil, host, "n2"),
				node("n3", []string{}, zone, "z1"), // no hostname label
			},
			want: []seg{{term: "{" + host + "=n1}", request: "{" + host + "=n1}", node: "n1"}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got []seg
			for _, s := range capacitySegments(tc.nodes, tc.nodeLocal) {
				got = append(got, seg{term: s.term.String(), request: s.request.String(), node: s.node})
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("segments\n got %v\nwant %v", got, tc.want)
			}
		})
	}
}

// TestCapacityRequest: the class's parameters without the provisioner's
// keys, the segment, and no volume capability (as external-provisioner:
// the field is optional, and a made-up one could have a block-only driver
// answer 0).
func TestCapacityRequest(t *testing.T) {
	class := &storagev1.StorageClass{
		Parameters: map[string]string{
			"label":               "blue",
			csiparams.ParamFSType: "xfs",
			secrets.ParameterPrefix + "provisioner-secret-name": "s",
		},
		MountOptions: []string{"noatime"},
	}
	req := CapacityRequest(class, map[string]string{testenv.LabelZone: "z1"})
	if !maps.Equal(req.GetParameters(), map[string]string{"label": "blue"}) {
		t.Errorf("parameters %v: want the class's without csi.storage.k8s.io/ keys", req.GetParameters())
	}
	if caps := req.GetVolumeCapabilities(); caps != nil {
		t.Errorf("capabilities %v, want none", caps)
	}
	if got := req.GetAccessibleTopology().GetSegments(); !maps.Equal(got, map[string]string{testenv.LabelZone: "z1"}) {
		t.Errorf("accessible topology %v", got)
	}
	if r := CapacityRequest(&storagev1.StorageClass{}, nil); r.GetAccessibleTopology() != nil || r.GetParameters() == nil {
		t.Errorf("no segment: %v", r)
	}
	// The deprecated unprefixed key is the driver's parameter, passed on.
	if legacy := CapacityRequest(&storagev1.StorageClass{Parameters: map[string]string{"fsType": "ext4"}}, nil); legacy.GetParameters()["fsType"] != "ext4" {
		t.Errorf("deprecated fsType key: parameters %v", legacy.GetParameters())
	}
}

// TestCapacitySegmentHolds: which objects a volume change refreshes.
func TestCapacitySegmentHolds(t *testing.T) {
	const zone, rack = testenv.LabelZone, "example.com/rack"
	z1 := capacitySegment{term: topology.Term{{Key: zone, Value: "z1"}}}
	z1r1 := capacitySegment{term: topology.Term{{Key: rack, Value: "r1"}, {Key: zone, Value: "z1"}}}
	n1 := capacitySegment{term: topology.Term{{Key: corev1.LabelHostname, Value: "n1"}}, node: "n1"}
	for _, c := range []struct {
		name      string
		seg       capacitySegment
		nodeLocal bool
		v         kube.VolumeChange
		want      bool
	}{
		{"topology not known", z1, false, kube.VolumeChange{}, true},
		{"in the zone", z1, false, kube.VolumeChange{Topo: []map[string]string{{zone: "z1", rack: "r9"}}}, true},
		{"another zone", z1, false, kube.VolumeChange{Topo: []map[string]string{{zone: "z2"}}}, false},
		{"one of its segments", z1, false, kube.VolumeChange{Topo: []map[string]string{{zone: "z2"}, {zone: "z1"}}}, true},
		{"another rack", z1r1, false, kube.VolumeChange{Topo: []map[string]string{{zone: "z1", rack: "r2"}}}, false},
		{"a key the volume does not say", z1r1, false, kube.VolumeChange{Topo: []map[string]string{{zone: "z1"}}}, true},
		{"the empty segment", capacitySegment{term: topology.Term{}}, false, kube.VolumeChange{Topo: []map[string]string{{zone: "z1"}}}, true},
		{"node-local, its node", n1, true, kube.VolumeChange{Node: "n1"}, true},
		{"node-local, another node", n1, true, kube.VolumeChange{Node: "n2"}, false},
		{"node-local, node not known", n1, true, kube.VolumeChange{}, true},
	} {
		if got := c.seg.holds(c.nodeLocal, c.v); got != c.want {
			t.Errorf("%s: holds %v, want %v", c.name, got, c.want)
		}
	}
}
