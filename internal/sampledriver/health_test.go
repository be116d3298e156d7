package sampledriver

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// legacyCondition decodes the legacy volume_condition (field 2) of a
// status, as a CO on CSI v1.12 reads it.
func legacyCondition(t *testing.T, st proto.Message) (abnormal bool, msg string, ok bool) {
	t.Helper()
	b := st.ProtoReflect().GetUnknown()
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			t.Fatalf("bad unknown fields %x", st.ProtoReflect().GetUnknown())
		}
		b = b[n:]
		if num != 2 || typ != protowire.BytesType {
			b = b[protowire.ConsumeFieldValue(num, typ, b):]
			continue
		}
		inner, n := protowire.ConsumeBytes(b)
		b = b[n:]
		ok = true
		for len(inner) > 0 {
			num, typ, n := protowire.ConsumeTag(inner)
			inner = inner[n:]
			switch {
			case num == 1 && typ == protowire.VarintType:
				v, n := protowire.ConsumeVarint(inner)
				abnormal, inner = v != 0, inner[n:]
			case num == 2 && typ == protowire.BytesType:
				v, n := protowire.ConsumeBytes(inner)
				msg, inner = string(v), inner[n:]
			default:
				inner = inner[protowire.ConsumeFieldValue(num, typ, inner):]
			}
		}
	}
	return abnormal, msg, ok
}

func TestVolumeConditionMarkedAbnormalAndBack(t *testing.T) {
	ep, d := StartTest(t, Config{})
	c := dial(t, ep)
	ctx := ctxT(t)
	caps := controllerCaps(t, c)
	for _, want := range []csi.ControllerServiceCapability_RPC_Type{VolumeConditionCapability, csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES, csi.ControllerServiceCapability_RPC_GET_VOLUME,
		csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH, csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH} {
		if !caps[want] {
			t.Errorf("capability %v not advertised: %v", want, caps)
		}
	}
	vol, err := c.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)}})
	if err != nil {
		t.Fatal(err)
	}
	id := vol.GetVolume().GetVolumeId()
	check := func(wantAbnormal bool, wantMsg string) {
		t.Helper()
		lv, err := c.ListVolumes(ctx, &csi.ListVolumesRequest{})
		if err != nil || len(lv.GetEntries()) != 1 {
			t.Fatalf("ListVolumes: %v %v", lv, err)
		}
		ab, msg, ok := legacyCondition(t, lv.GetEntries()[0].GetStatus())
		if !ok || ab != wantAbnormal || (wantMsg != "" && msg != wantMsg) {
			t.Errorf("ListVolumes condition: abnormal %v %q (present %v), want %v %q", ab, msg, ok, wantAbnormal, wantMsg)
		}
		gv, err := c.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: id})
		if err != nil {
			t.Fatal(err)
		}
		if ab, msg, ok := legacyCondition(t, gv.GetStatus()); !ok || ab != wantAbnormal || (wantMsg != "" && msg != wantMsg) {
			t.Errorf("ControllerGetVolume condition: abnormal %v %q (present %v)", ab, msg, ok)
		}
		gh, err := c.ControllerGetVolumeHealth(ctx, &csi.ControllerGetVolumeHealthRequest{VolumeId: id})
		if err != nil {
			t.Fatal(err)
		}
		if got := len(gh.GetVolumeHealth().GetHealthStatuses()) > 0; got != wantAbnormal {
			t.Errorf("ControllerGetVolumeHealth: %v", gh)
		}
		lh, err := c.ControllerListVolumeHealth(ctx, &csi.ControllerListVolumeHealthRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if got := len(lh.GetEntries()) == 1; got != wantAbnormal {
			t.Errorf("ControllerListVolumeHealth: %v", lh)
		}
	}
	check(false, "")
	if err := d.SetVolumeCondition(id, true, "disk failing"); err != nil {
		t.Fatal(err)
	}
	check(true, "disk failing")
	if err := d.SetVolumeCondition(id, false, ""); err != nil {
		t.Fatal(err)
	}
	check(false, "")
	// The demo's way: a file in the state dir.
	if err := os.WriteFile(filepath.Join(d.Config().StateDir, "health", id), []byte("from a file\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	check(true, "from a file")
	if err := d.SetVolumeCondition("no-such", true, "x"); err == nil {
		t.Fatal("marking a volume that does not exist succeeded")
	}
}

func TestHealthSwitchedOff(t *testing.T) {
	ep, _ := StartTest(t, Config{Health: HealthConfig{NoVolumeCondition: true, NoVolumeHealth: true, NoListVolumes: true}})
	c := dial(t, ep)
	ctx := ctxT(t)
	caps := controllerCaps(t, c)
	for _, gone := range []csi.ControllerServiceCapability_RPC_Type{VolumeConditionCapability, csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES, csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH, csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH} {
		if caps[gone] {
			t.Errorf("capability %v still advertised", gone)
		}
	}
	if !caps[csi.ControllerServiceCapability_RPC_GET_VOLUME] {
		t.Error("GET_VOLUME dropped")
	}
	vol, err := c.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)}})
	if err != nil {
		t.Fatal(err)
	}
	gv, err := c.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: vol.GetVolume().GetVolumeId()})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, ok := legacyCondition(t, gv.GetStatus()); ok {
		t.Error("ControllerGetVolume still carries a condition")
	}
	if _, err := c.ListVolumes(ctx, &csi.ListVolumesRequest{}); codeOf(err) != codes.Unimplemented {
		t.Errorf("ListVolumes: %v", err)
	}
	if _, err := c.ControllerGetVolumeHealth(ctx, &csi.ControllerGetVolumeHealthRequest{VolumeId: vol.GetVolume().GetVolumeId()}); codeOf(err) != codes.Unimplemented {
		t.Errorf("ControllerGetVolumeHealth: %v", err)
	}
	if _, err := c.ControllerListVolumeHealth(ctx, &csi.ControllerListVolumeHealthRequest{}); codeOf(err) != codes.Unimplemented {
		t.Errorf("ControllerListVolumeHealth: %v", err)
	}
}
