package csiparams

import (
	"errors"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
)

func TestCheckCreatedVolume(t *testing.T) {
	topo := func(k, v string) []*csi.Topology { return []*csi.Topology{{Segments: map[string]string{k: v}}} }
	for _, c := range []struct {
		name string
		vol  *csi.Volume
		want string // "" for accepted
	}{
		{"whole answer", &csi.Volume{VolumeId: "v1", CapacityBytes: 1 << 30, AccessibleTopology: topo("topology.kubernetes.io/zone", "z1")}, ""},
		{"no capacity, no topology", &csi.Volume{VolumeId: "v1"}, ""},
		{"no volume", nil, "no volume ID"},
		{"empty ID", &csi.Volume{CapacityBytes: 1}, "no volume ID"},
		{"negative capacity", &csi.Volume{VolumeId: "v1", CapacityBytes: -1}, "negative capacity"},
		{"bad topology key", &csi.Volume{VolumeId: "v1", AccessibleTopology: topo("not a key", "z1")}, `key "not a key" is not a label key`},
		{"bad topology value", &csi.Volume{VolumeId: "v1", AccessibleTopology: topo("zone", "a b")}, `zone="a b" is not a label value`},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := CheckCreatedVolume(c.vol)
			if c.want == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err %v, want one saying %q", err, c.want)
			}
			if (c.vol.GetVolumeId() == "") != errors.Is(err, ErrNoVolumeID) {
				t.Fatalf("err %v: ErrNoVolumeID is for an answer without an ID only", err)
			}
		})
	}
}

// FuzzCheckCreatedVolume feeds driver CreateVolume answers (any bytes a
// driver may send) to the check: nothing may panic, and an answer it
// accepts has an ID and valid topology labels.
func FuzzCheckCreatedVolume(f *testing.F) {
	for _, r := range []*csi.CreateVolumeResponse{
		{Volume: &csi.Volume{VolumeId: "v1", CapacityBytes: 1 << 30, AccessibleTopology: []*csi.Topology{{Segments: map[string]string{"zone": "z1"}}}}},
		{Volume: &csi.Volume{}},
		{},
	} {
		b, _ := proto.Marshal(r)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var resp csi.CreateVolumeResponse
		if proto.Unmarshal(data, &resp) != nil {
			return
		}
		if err := CheckCreatedVolume(resp.GetVolume()); err != nil {
			return
		}
		if resp.GetVolume().GetVolumeId() == "" || resp.GetVolume().GetCapacityBytes() < 0 {
			t.Fatalf("accepted %v", resp.GetVolume())
		}
	})
}
