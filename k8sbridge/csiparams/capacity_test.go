package csiparams

import (
	"math"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

func TestCheckCapacity(t *testing.T) {
	i64 := wrapperspb.Int64
	for _, c := range []struct {
		name string
		resp *csi.GetCapacityResponse
		want string // "" for accepted
	}{
		{"no answer", nil, ""},
		{"capacity only", &csi.GetCapacityResponse{AvailableCapacity: 1 << 40}, ""},
		{"zero everything", &csi.GetCapacityResponse{MaximumVolumeSize: i64(0), MinimumVolumeSize: i64(0)}, ""},
		{"all three", &csi.GetCapacityResponse{AvailableCapacity: 10 << 30, MaximumVolumeSize: i64(1 << 30), MinimumVolumeSize: i64(1 << 20)}, ""},
		{"thin pool: maximum above available", &csi.GetCapacityResponse{AvailableCapacity: 1, MaximumVolumeSize: i64(1 << 40)}, ""},
		{"the largest int64", &csi.GetCapacityResponse{AvailableCapacity: math.MaxInt64, MaximumVolumeSize: i64(math.MaxInt64)}, ""},
		{"minimum without maximum", &csi.GetCapacityResponse{MinimumVolumeSize: i64(math.MaxInt64)}, ""},
		{"negative capacity", &csi.GetCapacityResponse{AvailableCapacity: -1}, "negative available_capacity (-1 bytes)"},
		{"smallest int64 capacity", &csi.GetCapacityResponse{AvailableCapacity: math.MinInt64}, "negative available_capacity"},
		{"negative maximum", &csi.GetCapacityResponse{AvailableCapacity: 5, MaximumVolumeSize: i64(-5)}, "negative maximum_volume_size (-5 bytes)"},
		{"negative minimum", &csi.GetCapacityResponse{MinimumVolumeSize: i64(-1)}, "negative minimum_volume_size"},
		{"minimum above maximum", &csi.GetCapacityResponse{MaximumVolumeSize: i64(1 << 20), MinimumVolumeSize: i64(1 << 30)}, "minimum_volume_size (1073741824 bytes) above its maximum_volume_size (1048576 bytes)"},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := CheckCapacity(c.resp)
			if c.want == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "GetCapacity") {
				t.Fatalf("err %v, want one naming GetCapacity and saying %q", err, c.want)
			}
		})
	}
}
