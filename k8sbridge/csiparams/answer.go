package csiparams

import (
	"errors"
	"fmt"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"k8s.io/apimachinery/pkg/util/validation"
)

// ErrNoVolumeID is CheckCreatedVolume's error for an answer that names no
// volume: nothing can be deleted, and the same request is asked again.
var ErrNoVolumeID = errors.New("the driver's CreateVolume answer holds no volume ID")

// CheckCreatedVolume checks a driver's CreateVolume answer before it is
// used: it names a volume, its capacity is not negative, and its
// accessible topology is made of valid label keys and values (the PV's
// node affinity is built from them, and the API server refuses a PV whose
// affinity is not). A driver is not trusted to get these right.
func CheckCreatedVolume(vol *csi.Volume) error {
	if vol.GetVolumeId() == "" {
		return ErrNoVolumeID
	}
	if c := vol.GetCapacityBytes(); c < 0 {
		return fmt.Errorf("the driver's CreateVolume answer has a negative capacity (%d bytes)", c)
	}
	for i, t := range vol.GetAccessibleTopology() {
		for k, v := range t.GetSegments() {
			if errs := validation.IsQualifiedName(k); len(errs) > 0 {
				return fmt.Errorf("the driver's CreateVolume answer: accessible topology %d: key %q is not a label key: %s", i, k, strings.Join(errs, "; "))
			}
			if errs := validation.IsValidLabelValue(v); len(errs) > 0 {
				return fmt.Errorf("the driver's CreateVolume answer: accessible topology %d: %s=%q is not a label value: %s", i, k, v, strings.Join(errs, "; "))
			}
		}
	}
	return nil
}
