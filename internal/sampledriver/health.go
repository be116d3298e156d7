package sampledriver

// Volume health: what the driver says of its volumes' condition, in both
// the spec it is built on (CSI v1.13: ControllerGetVolumeHealth and
// ControllerListVolumeHealth, capabilities GET_VOLUME_HEALTH and
// LIST_VOLUME_HEALTH) and the one most drivers in use are built on (CSI up
// to v1.12: the VOLUME_CONDITION capability, value 11, and a
// volume_condition in the statuses of ListVolumes and ControllerGetVolume,
// field 2; v1.13 removed both and reserved their numbers, so they are
// written here as raw protobuf).
//
// A volume is abnormal while <StateDir>/health/<volume-id> exists; the
// file's content is the condition's message (SetVolumeCondition writes and
// removes it; the demo can use echo and rm). A volume whose directory is
// gone is abnormal too (INACCESSIBLE).

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// HealthConfig switches the driver's volume health APIs off, one by one
// (the zero value offers them all).
type HealthConfig struct {
	// NoVolumeCondition drops the legacy VOLUME_CONDITION capability and
	// the conditions in ListVolumes and ControllerGetVolume answers.
	NoVolumeCondition bool
	// NoVolumeHealth drops GET_VOLUME_HEALTH and LIST_VOLUME_HEALTH;
	// their RPCs answer Unimplemented.
	NoVolumeHealth bool
	// NoListVolumeHealth drops LIST_VOLUME_HEALTH alone.
	NoListVolumeHealth bool
	// NoListVolumes drops LIST_VOLUMES (and LIST_VOLUMES_PUBLISHED_NODES);
	// ListVolumes answers Unimplemented.
	NoListVolumes bool
}

// VolumeConditionCapability is the legacy VOLUME_CONDITION controller
// capability (CSI up to v1.12).
const VolumeConditionCapability = csi.ControllerServiceCapability_RPC_Type(11)

// healthDirName is the folder of the abnormal markers under StateDir.
const healthDirName = "health"

// healthCapabilities adjusts the advertised capabilities to cfg.Health.
func (s *server) healthCapabilities(types []csi.ControllerServiceCapability_RPC_Type) []csi.ControllerServiceCapability_RPC_Type {
	h := s.cfg.Health
	drop := map[csi.ControllerServiceCapability_RPC_Type]bool{
		csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH:            h.NoVolumeHealth,
		csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH:           h.NoVolumeHealth || h.NoListVolumeHealth,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES:                 h.NoListVolumes,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES: h.NoListVolumes,
	}
	out := types[:0]
	for _, t := range types {
		if !drop[t] {
			out = append(out, t)
		}
	}
	if !h.NoVolumeCondition {
		out = append(out, VolumeConditionCapability)
	}
	return out
}

// SetVolumeCondition marks volume id abnormal with message, or normal
// again.
func (d *Driver) SetVolumeCondition(id string, abnormal bool, message string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.st.Volumes[id]; !ok {
		return fmt.Errorf("volume %s not found", id)
	}
	p := d.healthMarker(id)
	if !abnormal {
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	return os.WriteFile(p, []byte(message), 0o644)
}

func (d *Driver) healthMarker(id string) string {
	return filepath.Join(d.cfg.StateDir, healthDirName, filepath.Base(id))
}

// marked is the message of volume id's abnormal marker, if it has one.
func (d *Driver) marked(id string) (string, bool) {
	b, err := os.ReadFile(d.healthMarker(id))
	if err != nil {
		return "", false
	}
	return strings.TrimSpace(string(b)), true
}

// markedHealth is the health entry of volume id's marker, if any.
func (d *Driver) markedHealth(id string) []*csi.VolumeHealth_VolumeHealthEntry {
	msg, ok := d.marked(id)
	if !ok {
		return nil
	}
	return []*csi.VolumeHealth_VolumeHealthEntry{{Status: csi.VolumeHealthErrorType_DEGRADED, Reason: "MarkedAbnormal", Message: msg}}
}

// setLegacyCondition writes volume id's legacy condition into status (a
// ListVolumes or ControllerGetVolume status), as a driver on CSI v1.12
// sends it, unless the condition is switched off. Callers hold mu.
func (s *server) setLegacyCondition(st proto.Message, id string) {
	if s.cfg.Health.NoVolumeCondition {
		return
	}
	var msgs []string
	for _, e := range s.volumeHealth(id).GetHealthStatuses() {
		msgs = append(msgs, e.GetMessage())
	}
	var inner []byte
	if len(msgs) > 0 {
		inner = protowire.AppendTag(inner, 1, protowire.VarintType) // abnormal
		inner = protowire.AppendVarint(inner, 1)
		inner = protowire.AppendTag(inner, 2, protowire.BytesType) // message
		inner = protowire.AppendString(inner, strings.Join(msgs, "; "))
	} else {
		inner = protowire.AppendTag(inner, 2, protowire.BytesType)
		inner = protowire.AppendString(inner, "volume is healthy")
	}
	b := protowire.AppendTag(nil, 2, protowire.BytesType) // VolumeStatus.volume_condition
	b = protowire.AppendBytes(b, inner)
	st.ProtoReflect().SetUnknown(b)
}

// healthOff is the answer of a health RPC switched off (nil: on).
func (s *server) healthOff(list bool) error {
	h := s.cfg.Health
	if h.NoVolumeHealth || list && h.NoListVolumeHealth {
		return status.Error(codes.Unimplemented, "volume health is switched off in this driver")
	}
	return nil
}

// listVolumesOff is ListVolumes' answer when switched off (nil: on).
func (s *server) listVolumesOff() error {
	if s.cfg.Health.NoListVolumes {
		return status.Error(codes.Unimplemented, "ListVolumes is switched off in this driver")
	}
	return nil
}
