package csiparams

import (
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// CheckCapacity checks a driver's GetCapacity answer before the capacity
// controller writes it into a CSIStorageCapacity object: the spec says
// none of available_capacity, maximum_volume_size and minimum_volume_size
// may be negative, and a minimum above the maximum leaves no size a
// volume could have. The API server refuses a negative capacity (the
// write would fail on every refresh) but takes a negative
// maximumVolumeSize, which makes the scheduler find no room for any claim
// of the segment. No value is too big otherwise: every int64 is a
// quantity the API server takes, and a maximum above the available
// capacity is a thin pool's honest answer.
func CheckCapacity(resp *csi.GetCapacityResponse) error {
	if c := resp.GetAvailableCapacity(); c < 0 {
		return fmt.Errorf("the driver's GetCapacity answer has a negative available_capacity (%d bytes)", c)
	}
	maxSize, minSize := resp.GetMaximumVolumeSize(), resp.GetMinimumVolumeSize()
	if maxSize != nil && maxSize.GetValue() < 0 {
		return fmt.Errorf("the driver's GetCapacity answer has a negative maximum_volume_size (%d bytes)", maxSize.GetValue())
	}
	if minSize != nil && minSize.GetValue() < 0 {
		return fmt.Errorf("the driver's GetCapacity answer has a negative minimum_volume_size (%d bytes)", minSize.GetValue())
	}
	if maxSize != nil && minSize != nil && minSize.GetValue() > maxSize.GetValue() {
		return fmt.Errorf("the driver's GetCapacity answer has a minimum_volume_size (%d bytes) above its maximum_volume_size (%d bytes)", minSize.GetValue(), maxSize.GetValue())
	}
	return nil
}
