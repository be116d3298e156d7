package provision

import (
	"fmt"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
)

// TestRecordedTopology: a requirement of a few segments is recorded as
// sent; one of many (a segment per node) is recorded as its first
// preferred segment, so an entry does not grow with the cluster.
func TestRecordedTopology(t *testing.T) {
	seg := func(i int) *csi.Topology {
		return &csi.Topology{Segments: map[string]string{corev1.LabelHostname: fmt.Sprintf("node-%d", i)}}
	}
	few := &csi.TopologyRequirement{Requisite: []*csi.Topology{seg(1), seg(2)}, Preferred: []*csi.Topology{seg(2), seg(1)}}
	if got := recordedTopology(few); !proto.Equal(got, few) {
		t.Errorf("few segments recorded as %v, want them as sent", got)
	}
	var many csi.TopologyRequirement
	for i := range 1000 {
		many.Requisite = append(many.Requisite, seg(i))
		many.Preferred = append(many.Preferred, seg((i+7)%1000))
	}
	want := &csi.TopologyRequirement{Preferred: []*csi.Topology{seg(7)}}
	if got := recordedTopology(&many); !proto.Equal(got, want) {
		t.Errorf("1000 segments recorded as %v, want %v", got, want)
	}
	if got := recordedTopology(&csi.TopologyRequirement{Requisite: many.Requisite}); got != nil {
		t.Errorf("1000 requisite segments and no preferred one recorded as %v, want none", got)
	}
	if got := recordedTopology(nil); got != nil {
		t.Errorf("no requirement recorded as %v", got)
	}
}
