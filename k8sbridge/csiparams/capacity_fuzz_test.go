package csiparams

import (
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// FuzzCheckCapacity feeds driver GetCapacity answers (any bytes a driver
// may send) to the check: nothing may panic, and an answer it accepts has
// no negative size and no minimum above its maximum.
func FuzzCheckCapacity(f *testing.F) {
	for _, r := range []*csi.GetCapacityResponse{
		{AvailableCapacity: 1 << 30, MaximumVolumeSize: wrapperspb.Int64(1 << 20), MinimumVolumeSize: wrapperspb.Int64(1)},
		{AvailableCapacity: -1},
		{MaximumVolumeSize: wrapperspb.Int64(1), MinimumVolumeSize: wrapperspb.Int64(2)},
		{},
	} {
		b, _ := proto.Marshal(r)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var resp csi.GetCapacityResponse
		if proto.Unmarshal(data, &resp) != nil || CheckCapacity(&resp) != nil {
			return
		}
		maxSize, minSize := resp.GetMaximumVolumeSize(), resp.GetMinimumVolumeSize()
		if resp.GetAvailableCapacity() < 0 || maxSize.GetValue() < 0 || minSize.GetValue() < 0 ||
			(maxSize != nil && minSize != nil && minSize.GetValue() > maxSize.GetValue()) {
			t.Fatalf("accepted %v", &resp)
		}
	})
}
