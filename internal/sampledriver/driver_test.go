package sampledriver

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

func codeOf(err error) codes.Code { return status.Code(err) }

// clients bundles the three CSI clients of one connection.
type clients struct {
	csi.IdentityClient
	csi.ControllerClient
	csi.NodeClient
	conn *grpc.ClientConn
}

func dial(t testing.TB, endpoint string) clients {
	t.Helper()
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return clients{csi.NewIdentityClient(conn), csi.NewControllerClient(conn), csi.NewNodeClient(conn), conn}
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func createReq(name string, bytes int64) *csi.CreateVolumeRequest {
	return &csi.CreateVolumeRequest{
		Name:               name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: bytes},
		VolumeCapabilities: []*csi.VolumeCapability{mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)},
	}
}

func mustCreate(t testing.TB, c clients, name string, bytes int64) *csi.Volume {
	t.Helper()
	resp, err := c.CreateVolume(ctxT(t), createReq(name, bytes))
	if err != nil {
		t.Fatalf("CreateVolume %s: %v", name, err)
	}
	return resp.GetVolume()
}

func wantCode(t testing.TB, what string, err error, want codes.Code) {
	t.Helper()
	if got := codeOf(err); got != want {
		t.Fatalf("%s: code %v (%v), want %v", what, got, err, want)
	}
}

// mountPaths makes short staging and target parent dirs for node tests.
func mountPaths(t testing.TB) (staging, target string) {
	t.Helper()
	base, err := os.MkdirTemp("", "sdm")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	staging = filepath.Join(base, "staging")
	if err := os.Mkdir(staging, 0o750); err != nil {
		t.Fatal(err)
	}
	return staging, filepath.Join(base, "pods", "target")
}

// attachAndMount runs ControllerPublish, NodeStage and NodePublish.
func attachAndMount(t testing.TB, c clients, vol *csi.Volume, node, staging, target string, readonly bool) {
	t.Helper()
	ctx := ctxT(t)
	capa := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
	pub, err := c.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
		VolumeId: vol.GetVolumeId(), NodeId: node, VolumeCapability: capa, VolumeContext: vol.GetVolumeContext(),
	})
	if err != nil {
		t.Fatalf("ControllerPublishVolume: %v", err)
	}
	if _, err := c.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
		VolumeId: vol.GetVolumeId(), StagingTargetPath: staging, VolumeCapability: capa,
		PublishContext: pub.GetPublishContext(), VolumeContext: vol.GetVolumeContext(),
	}); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	if _, err := c.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
		VolumeId: vol.GetVolumeId(), StagingTargetPath: staging, TargetPath: target, VolumeCapability: capa,
		Readonly: readonly, PublishContext: pub.GetPublishContext(), VolumeContext: vol.GetVolumeContext(),
	}); err != nil {
		t.Fatalf("NodePublishVolume: %v", err)
	}
}

func unmountAndDetach(t testing.TB, c clients, volID, node, staging, target string) {
	t.Helper()
	ctx := ctxT(t)
	if _, err := c.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: volID, TargetPath: target}); err != nil {
		t.Fatalf("NodeUnpublishVolume: %v", err)
	}
	if _, err := c.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: volID, StagingTargetPath: staging}); err != nil {
		t.Fatalf("NodeUnstageVolume: %v", err)
	}
	if _, err := c.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: volID, NodeId: node}); err != nil {
		t.Fatalf("ControllerUnpublishVolume: %v", err)
	}
}

func TestIdentity(t *testing.T) {
	for _, tc := range []struct {
		name     string
		cfg      Config
		wantTopo bool
	}{
		{"plain", Config{}, false},
		{"topology", Config{Topology: map[string]string{"zone": "z1"}}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ep, _ := StartTest(t, tc.cfg)
			c := dial(t, ep)
			info, err := c.GetPluginInfo(ctxT(t), &csi.GetPluginInfoRequest{})
			if err != nil || info.GetName() != DefaultName || info.GetVendorVersion() != DefaultVersion {
				t.Fatalf("GetPluginInfo = %v, %v", info, err)
			}
			caps, err := c.GetPluginCapabilities(ctxT(t), &csi.GetPluginCapabilitiesRequest{})
			if err != nil {
				t.Fatal(err)
			}
			var ctrl, topo bool
			for _, cp := range caps.GetCapabilities() {
				switch cp.GetService().GetType() {
				case csi.PluginCapability_Service_CONTROLLER_SERVICE:
					ctrl = true
				case csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS:
					topo = true
				}
			}
			if !ctrl || topo != tc.wantTopo {
				t.Fatalf("capabilities %v: controller=%v topology=%v", caps, ctrl, topo)
			}
			probe, err := c.Probe(ctxT(t), &csi.ProbeRequest{})
			if err != nil || !probe.GetReady().GetValue() {
				t.Fatalf("Probe = %v, %v", probe, err)
			}
		})
	}
}

func controllerCaps(t *testing.T, c clients) map[csi.ControllerServiceCapability_RPC_Type]bool {
	t.Helper()
	resp, err := c.ControllerGetCapabilities(ctxT(t), &csi.ControllerGetCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	m := map[csi.ControllerServiceCapability_RPC_Type]bool{}
	for _, cp := range resp.GetCapabilities() {
		m[cp.GetRpc().GetType()] = true
	}
	return m
}

func TestDisablePublish(t *testing.T) {
	ep, d := StartTest(t, Config{DisablePublish: true})
	c := dial(t, ep)
	caps := controllerCaps(t, c)
	if caps[csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME] || caps[csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES] {
		t.Fatalf("publish capabilities advertised with DisablePublish: %v", caps)
	}
	if !caps[csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME] || !caps[csi.ControllerServiceCapability_RPC_CLONE_VOLUME] {
		t.Fatalf("missing capabilities: %v", caps)
	}
	vol := mustCreate(t, c, "trivial-attach", 1<<20)
	_, err := c.ControllerPublishVolume(ctxT(t), &csi.ControllerPublishVolumeRequest{
		VolumeId: vol.GetVolumeId(), NodeId: "node-1", VolumeCapability: mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER),
	})
	wantCode(t, "ControllerPublishVolume with DisablePublish", err, codes.Unimplemented)

	// The node side works from the volume context alone.
	staging, target := mountPaths(t)
	capa := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
	ctx := ctxT(t)
	if _, err := c.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging,
		VolumeCapability: capa, VolumeContext: vol.GetVolumeContext()}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging,
		TargetPath: target, VolumeCapability: capa, VolumeContext: vol.GetVolumeContext()}); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(target, "f"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(d.Volumes()[0].Path, "f")); err != nil {
		t.Fatalf("file written through the mount is not in the volume: %v", err)
	}
	if _, err := c.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: vol.GetVolumeId(), TargetPath: target}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()}); err != nil {
		t.Fatal(err)
	}
}

func TestCreateVolumeSemantics(t *testing.T) {
	zone := "topology.kubernetes.io/zone"
	ep, d := StartTest(t, Config{CapacityBytes: 10 << 20, Topology: map[string]string{zone: "z1"}})
	c := dial(t, ep)
	ctx := ctxT(t)
	freeBytes := func(topo *csi.Topology) int64 {
		t.Helper()
		resp, err := c.GetCapacity(ctx, &csi.GetCapacityRequest{AccessibleTopology: topo})
		if err != nil {
			t.Fatal(err)
		}
		return resp.GetAvailableCapacity()
	}
	if got := freeBytes(nil); got != 10<<20 {
		t.Fatalf("free before = %d", got)
	}

	v1 := mustCreate(t, c, "pvc-1", 4<<20)
	if v1.GetCapacityBytes() != 4<<20 || len(v1.GetAccessibleTopology()) != 1 || v1.GetAccessibleTopology()[0].GetSegments()[zone] != "z1" {
		t.Fatalf("volume %v", v1)
	}
	if again := mustCreate(t, c, "pvc-1", 4<<20); again.GetVolumeId() != v1.GetVolumeId() {
		t.Fatalf("same name, same size: new volume %s", again.GetVolumeId())
	}
	_, err := c.CreateVolume(ctx, createReq("pvc-1", 5<<20))
	wantCode(t, "same name, bigger size", err, codes.AlreadyExists)
	req := createReq("pvc-1", 4<<20)
	req.Parameters = map[string]string{"tier": "premium"}
	_, err = c.CreateVolume(ctx, req)
	wantCode(t, "same name, other parameters", err, codes.AlreadyExists)

	if got := freeBytes(nil); got != 6<<20 {
		t.Fatalf("free after 4MiB = %d", got)
	}
	if got := freeBytes(&csi.Topology{Segments: map[string]string{zone: "z2"}}); got != 0 {
		t.Fatalf("free in another zone = %d", got)
	}
	if got := freeBytes(&csi.Topology{Segments: map[string]string{zone: "z1"}}); got != 6<<20 {
		t.Fatalf("free in our zone = %d", got)
	}

	_, err = c.CreateVolume(ctx, createReq("too-big", 7<<20))
	wantCode(t, "more than free", err, codes.ResourceExhausted)
	_, err = c.CreateVolume(ctx, createReq("bigger-than-pool", 11<<20))
	wantCode(t, "more than the pool", err, codes.OutOfRange)

	req = createReq("elsewhere", 1<<20)
	req.AccessibilityRequirements = &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{zone: "z2"}}}}
	_, err = c.CreateVolume(ctx, req)
	wantCode(t, "requisite excludes our zone", err, codes.ResourceExhausted)
	req.AccessibilityRequirements.Requisite = append(req.AccessibilityRequirements.Requisite, &csi.Topology{Segments: map[string]string{zone: "z1"}})
	if _, err := c.CreateVolume(ctx, req); err != nil {
		t.Fatalf("requisite including our zone: %v", err)
	}

	req = createReq("block", 1<<20)
	req.VolumeCapabilities = []*csi.VolumeCapability{{
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
	}}
	_, err = c.CreateVolume(ctx, req)
	wantCode(t, "block volume", err, codes.InvalidArgument)

	// Clone: the content is copied and the source recorded.
	src := v1
	if err := os.WriteFile(filepath.Join(volumePath(t, d, src.GetVolumeId()), "data"), []byte("hello"), 0o600); err != nil {
		t.Fatal(err)
	}
	req = createReq("clone", 0)
	req.CapacityRange = nil
	req.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
		Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: src.GetVolumeId()},
	}}
	cl, err := c.CreateVolume(ctx, req)
	if err != nil {
		t.Fatalf("clone: %v", err)
	}
	if cl.GetVolume().GetCapacityBytes() != src.GetCapacityBytes() || cl.GetVolume().GetContentSource().GetVolume().GetVolumeId() != src.GetVolumeId() {
		t.Fatalf("clone %v of %v", cl.GetVolume(), src)
	}
	b, err := os.ReadFile(filepath.Join(volumePath(t, d, cl.GetVolume().GetVolumeId()), "data"))
	if err != nil || string(b) != "hello" {
		t.Fatalf("clone content %q, %v", b, err)
	}
	req.Name = "clone-of-nothing"
	req.VolumeContentSource.GetVolume().VolumeId = "sv-missing"
	_, err = c.CreateVolume(ctx, req)
	wantCode(t, "clone of a missing volume", err, codes.NotFound)
	// Expand grows only, within the pool.
	exp, err := c.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: v1.GetVolumeId(), CapacityRange: &csi.CapacityRange{RequiredBytes: 5 << 20}})
	if err != nil || exp.GetCapacityBytes() != 5<<20 || !exp.GetNodeExpansionRequired() {
		t.Fatalf("expand = %v, %v", exp, err)
	}
	exp, err = c.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: v1.GetVolumeId(), CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20}})
	if err != nil || exp.GetCapacityBytes() != 5<<20 {
		t.Fatalf("expand to a smaller size = %v, %v; want the current size", exp, err)
	}
	_, err = c.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: v1.GetVolumeId(), CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20, LimitBytes: 2 << 20}})
	wantCode(t, "shrink below the limit", err, codes.OutOfRange)
	_, err = c.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: v1.GetVolumeId(), CapacityRange: &csi.CapacityRange{RequiredBytes: 50 << 20}})
	wantCode(t, "expand beyond the pool", err, codes.ResourceExhausted)
	_, err = c.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: "sv-missing", CapacityRange: &csi.CapacityRange{RequiredBytes: 1}})
	wantCode(t, "expand a missing volume", err, codes.NotFound)

	// Delete is idempotent and frees capacity.
	for _, v := range d.Volumes() {
		for i := 0; i < 2; i++ {
			if _, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.ID}); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := os.Stat(v.Path); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("volume directory %s left: %v", v.Path, err)
		}
	}
	// A retried clone whose source was deleted since gets the clone: the
	// name is looked up first.
	src2 := mustCreate(t, c, "src2", 1<<20)
	req.Name = "clone2"
	req.VolumeContentSource.GetVolume().VolumeId = src2.GetVolumeId()
	cl2, err := c.CreateVolume(ctx, req)
	if err != nil {
		t.Fatalf("clone2: %v", err)
	}
	if _, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: src2.GetVolumeId()}); err != nil {
		t.Fatal(err)
	}
	again, err := c.CreateVolume(ctx, req)
	if err != nil || again.GetVolume().GetVolumeId() != cl2.GetVolume().GetVolumeId() {
		t.Fatalf("clone2 retried after its source was deleted: %v, %v; want %s", again.GetVolume(), err, cl2.GetVolume().GetVolumeId())
	}
	req.VolumeContentSource.GetVolume().VolumeId = ""
	_, err = c.CreateVolume(ctx, req)
	wantCode(t, "content source without an ID", err, codes.InvalidArgument)
	if _, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: cl2.GetVolume().GetVolumeId()}); err != nil {
		t.Fatal(err)
	}

	if got := freeBytes(nil); got != 10<<20 {
		t.Fatalf("free after deleting all = %d", got)
	}
}

func volumePath(t testing.TB, d *Driver, id string) string {
	t.Helper()
	for _, v := range d.Volumes() {
		if v.ID == id {
			return v.Path
		}
	}
	t.Fatalf("volume %s not found", id)
	return ""
}

func TestListVolumesPaging(t *testing.T) {
	ep, _ := StartTest(t, Config{})
	c := dial(t, ep)
	ctx := ctxT(t)
	want := map[string]bool{}
	for _, n := range []string{"a", "b", "c", "d", "e"} {
		want[mustCreate(t, c, n, 1<<20).GetVolumeId()] = true
	}
	first := ""
	for id := range want {
		first = id
		break
	}
	if _, err := c.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: first, NodeId: "node-1",
		VolumeCapability: mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)}); err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	tok := ""
	for pages := 0; ; pages++ {
		resp, err := c.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: 2, StartingToken: tok})
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.GetEntries()) > 2 {
			t.Fatalf("page of %d entries", len(resp.GetEntries()))
		}
		for _, e := range resp.GetEntries() {
			id := e.GetVolume().GetVolumeId()
			if seen[id] {
				t.Fatalf("volume %s listed twice", id)
			}
			seen[id] = true
			nodes := e.GetStatus().GetPublishedNodeIds()
			if (id == first) != (len(nodes) == 1 && nodes[0] == "node-1") {
				t.Fatalf("volume %s published nodes %v", id, nodes)
			}
		}
		if tok = resp.GetNextToken(); tok == "" {
			break
		}
		if pages > 5 {
			t.Fatal("too many pages")
		}
	}
	if len(seen) != len(want) {
		t.Fatalf("listed %d volumes, want %d", len(seen), len(want))
	}
	_, err := c.ListVolumes(ctx, &csi.ListVolumesRequest{StartingToken: "garbage"})
	wantCode(t, "bad token", err, codes.Aborted)
	_, err = c.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: -1})
	wantCode(t, "negative max entries", err, codes.InvalidArgument)
	gv, err := c.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: first})
	if err != nil || len(gv.GetStatus().GetPublishedNodeIds()) != 1 {
		t.Fatalf("ControllerGetVolume = %v, %v", gv, err)
	}
	_, err = c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: first})
	wantCode(t, "delete a published volume", err, codes.FailedPrecondition)
}

func TestControllerPublishRules(t *testing.T) {
	ep, _ := StartTest(t, Config{NodeID: "n1", Nodes: []string{"n2", "n3"}, MaxVolumesPerNode: 2})
	c := dial(t, ep)
	ctx := ctxT(t)
	pub := func(vol, node string, mode csi.VolumeCapability_AccessMode_Mode, ro bool) error {
		_, err := c.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: node, VolumeCapability: mountCap(mode), Readonly: ro})
		return err
	}
	const (
		snw  = csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
		mnmw = csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER
		mnsw = csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER
	)
	a := mustCreate(t, c, "a", 1<<20).GetVolumeId()
	b := mustCreate(t, c, "b", 1<<20).GetVolumeId()
	x := mustCreate(t, c, "x", 1<<20).GetVolumeId()
	y := mustCreate(t, c, "y", 1<<20).GetVolumeId()

	for _, step := range []struct {
		what string
		err  error
		want codes.Code
	}{
		{"publish a to n1", pub(a, "n1", snw, false), codes.OK},
		{"again, same", pub(a, "n1", snw, false), codes.OK},
		{"again, read-only", pub(a, "n1", snw, true), codes.AlreadyExists},
		{"single-node volume to a second node", pub(a, "n2", snw, false), codes.FailedPrecondition},
		{"unknown node", pub(b, "n9", snw, false), codes.NotFound},
		{"missing volume", pub("sv-missing", "n1", snw, false), codes.NotFound},
		{"multi-writer to n1", pub(b, "n1", mnmw, false), codes.OK},
		{"multi-writer to n2", pub(b, "n2", mnmw, false), codes.OK},
		{"third volume on n1 exceeds the limit", pub(x, "n1", mnmw, false), codes.ResourceExhausted},
		{"single writer to n2", pub(x, "n2", mnsw, false), codes.OK},
		{"second writer to n3", pub(x, "n3", mnsw, false), codes.FailedPrecondition},
		{"reader to n3", pub(x, "n3", mnsw, true), codes.OK},
		{"no capability", func() error {
			_, err := c.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: y, NodeId: "n3"})
			return err
		}(), codes.InvalidArgument},
	} {
		if got := codeOf(step.err); got != step.want {
			t.Fatalf("%s: %v (%v), want %v", step.what, got, step.err, step.want)
		}
	}
	for _, n := range []string{"n1", "n2", "n9"} {
		if _, err := c.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: b, NodeId: n}); err != nil {
			t.Fatalf("unpublish b from %s: %v", n, err)
		}
	}
	if _, err := c.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: x}); err != nil {
		t.Fatalf("unpublish x from all nodes: %v", err)
	}
	if _, err := c.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "sv-gone", NodeId: "n1"}); err != nil {
		t.Fatalf("unpublish a missing volume: %v", err)
	}
	gv, err := c.ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: x})
	if err != nil {
		t.Fatal(err)
	}
	if len(gv.GetStatus().GetPublishedNodeIds()) != 0 {
		t.Fatalf("x still published to %v", gv.GetStatus().GetPublishedNodeIds())
	}
}

func TestNodeMounts(t *testing.T) {
	ep, d := StartTest(t, Config{})
	c := dial(t, ep)
	ctx := ctxT(t)
	vol := mustCreate(t, c, "mounted", 8<<20)
	staging, target := mountPaths(t)
	capa := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)

	// Staging needs the volume published to this node first.
	_, err := c.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging, VolumeCapability: capa})
	wantCode(t, "stage before ControllerPublish", err, codes.FailedPrecondition)
	// Publishing needs it staged.
	_, err = c.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging, TargetPath: target, VolumeCapability: capa})
	wantCode(t, "publish before stage", err, codes.FailedPrecondition)

	attachAndMount(t, c, vol, "node-1", staging, target, false)
	for _, p := range []string{staging, target} {
		if ok, err := isMountPoint(p); err != nil || !ok {
			t.Fatalf("%s is not a mount point: %v", p, err)
		}
	}
	// Idempotent.
	attachAndMount(t, c, vol, "node-1", staging, target, false)
	// A stage that is not identical (another access mode) is refused, as
	// the spec asks; a publish without a staging path is
	// FailedPrecondition, the spec's code for it.
	pub, err := c.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol.GetVolumeId(), NodeId: "node-1", VolumeCapability: capa})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging, PublishContext: pub.GetPublishContext(),
		VolumeCapability: mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)})
	wantCode(t, "stage again with another access mode", err, codes.AlreadyExists)
	_, err = c.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vol.GetVolumeId(), TargetPath: target, VolumeCapability: capa})
	wantCode(t, "publish without a staging path", err, codes.FailedPrecondition)
	if err := os.WriteFile(filepath.Join(target, "f"), []byte("data"), 0o644); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(volumePath(t, d, vol.GetVolumeId()), "f")); err != nil || string(b) != "data" {
		t.Fatalf("volume content %q, %v", b, err)
	}
	// Read-only at the same target is incompatible.
	_, err = c.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging,
		TargetPath: target, VolumeCapability: capa, Readonly: true})
	wantCode(t, "read-only over read-write", err, codes.AlreadyExists)

	// A second, read-only target.
	roTarget := filepath.Join(filepath.Dir(target), "ro")
	if _, err := c.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging,
		TargetPath: roTarget, VolumeCapability: capa, Readonly: true}); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(roTarget, "f")); err != nil || string(b) != "data" {
		t.Fatalf("read-only target content %q, %v", b, err)
	}
	if err := os.WriteFile(filepath.Join(roTarget, "g"), nil, 0o644); !errors.Is(err, syscall.EROFS) {
		t.Fatalf("write to read-only target: %v, want EROFS", err)
	}

	// A publish whose record was lost (the driver stopped after the bind
	// mount, before saving): the same publish, retried, adopts the mount;
	// a mount of something else at a target is still refused.
	lost := filepath.Join(filepath.Dir(target), "lost")
	if err := os.MkdirAll(lost, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := bindMount(staging, lost, false); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if ok, _ := isMountPoint(lost); ok {
			_ = unmount(lost)
		}
	})
	if _, err := c.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging,
		TargetPath: lost, VolumeCapability: capa}); err != nil {
		t.Fatalf("publish retried over its own unrecorded mount: %v", err)
	}
	if _, err := c.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: vol.GetVolumeId(), TargetPath: lost}); err != nil {
		t.Fatal(err)
	}
	if ok, err := isMountPoint(lost); err != nil || ok {
		t.Fatalf("the adopted mount at %s is still mounted after unpublish: %v", lost, err)
	}
	other := filepath.Join(filepath.Dir(target), "other")
	if err := os.MkdirAll(other, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := bindMount(t.TempDir(), other, false); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unmount(other) })
	_, err = c.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging,
		TargetPath: other, VolumeCapability: capa})
	wantCode(t, "publish over a mount of something else", err, codes.AlreadyExists)

	// Stats and expansion at the target.
	stats, err := c.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: vol.GetVolumeId(), VolumePath: target})
	if err != nil || stats.GetUsage()[0].GetTotal() != 8<<20 || stats.GetUsage()[0].GetUsed() != 4 {
		t.Fatalf("stats = %v, %v", stats, err)
	}
	_, err = c.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: vol.GetVolumeId(), VolumePath: "/elsewhere"})
	wantCode(t, "stats elsewhere", err, codes.NotFound)
	if _, err := c.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: vol.GetVolumeId(), CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}}); err != nil {
		t.Fatal(err)
	}
	ne, err := c.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: vol.GetVolumeId(), VolumePath: target, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20}})
	if err != nil || ne.GetCapacityBytes() != 16<<20 {
		t.Fatalf("NodeExpandVolume = %v, %v", ne, err)
	}
	_, err = c.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: vol.GetVolumeId(), VolumePath: target, CapacityRange: &csi.CapacityRange{RequiredBytes: 32 << 20}})
	wantCode(t, "node expand beyond the controller size", err, codes.OutOfRange)

	// Unstage while published is refused; delete while staged too.
	_, err = c.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging})
	wantCode(t, "unstage while published", err, codes.FailedPrecondition)

	if _, err := c.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: vol.GetVolumeId(), TargetPath: roTarget}); err != nil {
		t.Fatal(err)
	}
	unmountAndDetach(t, c, vol.GetVolumeId(), "node-1", staging, target)
	// Idempotent, and the targets are gone.
	unmountAndDetach(t, c, vol.GetVolumeId(), "node-1", staging, target)
	for _, p := range []string{target, roTarget} {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("target %s left: %v", p, err)
		}
	}
	if ok, err := isMountPoint(staging); err != nil || ok {
		t.Fatalf("staging path %s still mounted (%v)", staging, err)
	}
	if m := d.NodeMounts(); len(m) != 0 {
		t.Fatalf("mounts left: %v", m)
	}
	if _, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()}); err != nil {
		t.Fatal(err)
	}
}

// TestSplitInstances runs one controller instance and one node instance with
// separate state, as a controller Deployment and a node DaemonSet would.
func TestSplitInstances(t *testing.T) {
	ctrlEP, ctrl := StartTest(t, Config{NodeID: "controller", Nodes: []string{"worker-1"}})
	nodeEP, node := StartTest(t, Config{NodeID: "worker-1"})
	cc, nc := dial(t, ctrlEP), dial(t, nodeEP)
	ctx := ctxT(t)
	vol := mustCreate(t, cc, "split", 1<<20)
	capa := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
	pub, err := cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol.GetVolumeId(), NodeId: "worker-1", VolumeCapability: capa})
	if err != nil {
		t.Fatal(err)
	}
	staging, target := mountPaths(t)
	_, err = nc.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging, VolumeCapability: capa})
	wantCode(t, "stage without a publish context", err, codes.FailedPrecondition)
	bad := map[string]string{PublishContextDevicePath: "/etc"}
	_, err = nc.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging, VolumeCapability: capa, PublishContext: bad})
	wantCode(t, "stage a path that is not a volume", err, codes.NotFound)
	if _, err := nc.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging,
		VolumeCapability: capa, PublishContext: pub.GetPublishContext()}); err != nil {
		t.Fatal(err)
	}
	if _, err := nc.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging,
		TargetPath: target, VolumeCapability: capa, PublishContext: pub.GetPublishContext()}); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(target, "f"), []byte("split"), 0o644); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(volumePath(t, ctrl, vol.GetVolumeId()), "f")); string(b) != "split" {
		t.Fatalf("controller's volume directory has %q", b)
	}
	if len(node.Volumes()) != 0 || len(node.NodeMounts()) != 2 || len(ctrl.NodeMounts()) != 0 {
		t.Fatalf("node volumes %v, node mounts %v, controller mounts %v", node.Volumes(), node.NodeMounts(), ctrl.NodeMounts())
	}
	if _, err := nc.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: vol.GetVolumeId(), VolumePath: target}); err != nil {
		t.Fatal(err)
	}
	unmountAndDetach(t, clients{nc.IdentityClient, cc.ControllerClient, nc.NodeClient, nil}, vol.GetVolumeId(), "worker-1", staging, target)
	if _, err := cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()}); err != nil {
		t.Fatal(err)
	}
}

// serveOn starts a driver on an existing state dir and returns a stop func
// that waits for Serve to return and closes the driver.
func serveOn(t *testing.T, cfg Config) (clients, *Driver, func()) {
	t.Helper()
	sockDir, err := os.MkdirTemp("", "sd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	d, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("unix", filepath.Join(sockDir, "csi.sock"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Serve(ctx, lis) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Serve: %v", err)
			}
			d.Close()
		})
	}
	t.Cleanup(stop)
	return dial(t, "unix://"+filepath.Join(sockDir, "csi.sock")), d, stop
}

func TestRestartKeepsState(t *testing.T) {
	stateDir, err := os.MkdirTemp("", "sdstate")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(stateDir) })
	cfg := Config{NodeID: "node-1", StateDir: stateDir, CapacityBytes: 100 << 20}
	staging, target := mountPaths(t)

	c1, d1, stop1 := serveOn(t, cfg)
	if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Fatalf("second driver on a locked state dir: %v", err)
	}
	vol := mustCreate(t, c1, "persisted", 10<<20)
	attachAndMount(t, c1, vol, "node-1", staging, target, false)
	t.Cleanup(func() { // a failed check must not leave the mounts behind
		for _, p := range []string{target, staging} {
			if ok, _ := isMountPoint(p); ok {
				_ = unmount(p)
			}
		}
	})
	snap, err := c1.CreateSnapshot(ctxT(t), &csi.CreateSnapshotRequest{Name: "snap", SourceVolumeId: vol.GetVolumeId()})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(target, "f"), []byte("kept"), 0o644); err != nil {
		t.Fatal(err)
	}
	before := d1.Volumes()
	stop1()
	// What a crash can leave: a volume renamed for deletion, a volume and
	// a snapshot made but not saved, an unfinished state write.
	leftovers := []string{filepath.Join(stateDir, "volumes", ".deleted-sv-gone"), filepath.Join(stateDir, "volumes", "sv-unsaved"),
		filepath.Join(stateDir, "snapshots", "ss-unsaved"), filepath.Join(stateDir, ".state.json.123.tmp")}
	for _, p := range leftovers {
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// And the volume renamed for a deletion whose state was never saved:
	// it still exists, with its data.
	if err := os.Rename(before[0].Path, filepath.Join(stateDir, "volumes", ".deleted-"+before[0].ID)); err != nil {
		t.Fatal(err)
	}

	c2, d2, stop2 := serveOn(t, cfg)
	defer stop2()
	for _, p := range leftovers {
		if _, err := os.Stat(p); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("leftover %s still there after a restart: %v", p, err)
		}
	}
	if b, err := os.ReadFile(filepath.Join(before[0].Path, "f")); err != nil || string(b) != "kept" {
		t.Fatalf("the volume's own directory after a restart: %q, %v", b, err)
	}
	after := d2.Volumes()
	if len(after) != 1 || after[0].ID != before[0].ID || after[0].CapacityBytes != 10<<20 ||
		len(after[0].PublishedNodes) != 1 || after[0].PublishedNodes[0] != "node-1" {
		t.Fatalf("volumes after restart %+v, before %+v", after, before)
	}
	if len(d2.NodeMounts()) != 2 || len(d2.Snapshots()) != 1 || d2.Snapshots()[0].ID != snap.GetSnapshot().GetSnapshotId() {
		t.Fatalf("mounts %v, snapshots %v after restart", d2.NodeMounts(), d2.Snapshots())
	}
	ctx := ctxT(t)
	// The same name gives the same volume; repeated calls stay idempotent.
	if again := mustCreate(t, c2, "persisted", 10<<20); again.GetVolumeId() != vol.GetVolumeId() {
		t.Fatalf("CreateVolume after restart: new volume %s", again.GetVolumeId())
	}
	attachAndMount(t, c2, vol, "node-1", staging, target, false)
	capResp, err := c2.GetCapacity(ctx, &csi.GetCapacityRequest{})
	if err != nil || capResp.GetAvailableCapacity() != 90<<20 {
		t.Fatalf("capacity after restart %v, %v", capResp, err)
	}
	if b, err := os.ReadFile(filepath.Join(target, "f")); err != nil || string(b) != "kept" {
		t.Fatalf("content after restart %q, %v", b, err)
	}
	unmountAndDetach(t, c2, vol.GetVolumeId(), "node-1", staging, target)
	if _, err := c2.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshot().GetSnapshotId()}); err != nil {
		t.Fatal(err)
	}
	if _, err := c2.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()}); err != nil {
		t.Fatal(err)
	}
	// No temp files are left next to state.json.
	entries, err := os.ReadDir(stateDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if strings.HasSuffix(e.Name(), ".tmp") {
			t.Fatalf("temp file %s left in the state dir", e.Name())
		}
	}
}

func TestRunRemovesStaleSocket(t *testing.T) {
	dir, err := os.MkdirTemp("", "sd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "csi.sock")
	// A stale socket: bound, then its listener dropped without unlinking.
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()

	d, err := New(Config{NodeID: "n1", StateDir: filepath.Join(dir, "state"), Endpoint: "unix:" + sock})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	c := dial(t, "unix://"+sock)
	var probeErr error
	for i := 0; i < 100; i++ {
		if _, probeErr = c.Probe(ctxT(t), &csi.ProbeRequest{}); probeErr == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if probeErr != nil {
		t.Fatalf("Probe over the endpoint: %v", probeErr)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if _, err := os.Stat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket left after Run: %v", err)
	}

	// A regular file at the endpoint is not removed.
	if err := os.WriteFile(sock, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	// Bounded: a Run that took the file's place would serve until then.
	rctx, rcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer rcancel()
	if err := d.Run(rctx); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Fatalf("Run over a regular file: %v", err)
	}
}

func TestLogsNeverShowSecrets(t *testing.T) {
	var buf bytes.Buffer
	var mu sync.Mutex
	logger := slog.New(slog.NewTextHandler(lockedWriter{&mu, &buf}, &slog.HandlerOptions{Level: slog.LevelDebug - 4}))
	ep, _ := StartTest(t, Config{Logger: logger})
	c := dial(t, ep)
	req := createReq("secretive", 1<<20)
	req.Secrets = map[string]string{"password": "hunter2-very-secret"}
	if _, err := c.CreateVolume(ctxT(t), req); err != nil {
		t.Fatal(err)
	}
	_, _ = c.DeleteVolume(ctxT(t), &csi.DeleteVolumeRequest{Secrets: map[string]string{"token": "hunter2-very-secret"}})
	mu.Lock()
	defer mu.Unlock()
	out := buf.String()
	if !strings.Contains(out, "csi request") || !strings.Contains(out, "secretive") || !strings.Contains(out, "csi call failed") {
		t.Fatalf("requests were not logged:\n%s", out)
	}
	if strings.Contains(out, "hunter2") {
		t.Fatalf("a secret reached the log:\n%s", out)
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  *bytes.Buffer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// BenchmarkCreateDelete measures a CreateVolume and DeleteVolume pair, each
// a durable state write (fsync of the file and the directory).
func BenchmarkCreateDelete(b *testing.B) {
	ep, _ := StartTest(b, Config{})
	c := dial(b, ep)
	ctx := ctxT(b)
	for i := 0; b.Loop(); i++ {
		v := mustCreate(b, c, "bench-"+strconv.Itoa(i), 1<<20)
		if _, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.GetVolumeId()}); err != nil {
			b.Fatal(err)
		}
	}
}

func TestCreateVolumeRejectsUnknownParameters(t *testing.T) {
	for _, c := range []struct {
		name   string
		params map[string]string
		ok     bool
	}{
		{"none", nil, true},
		{"label and tier", map[string]string{ParamLabel: "x", ParamTier: "standard"}, true},
		{"extra create metadata", map[string]string{ParamPVCName: "c", ParamPVCNamespace: "n", ParamPVName: "p"}, true},
		{"unknown key", map[string]string{"colour": "red"}, false},
		{"bad tier", map[string]string{ParamTier: "gold"}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := checkParameters(c.params)
			if (err == nil) != c.ok {
				t.Fatalf("err = %v, ok %v", err, c.ok)
			}
			if err != nil && !strings.Contains(err.Error(), "parameter") {
				t.Fatalf("err %v does not name the parameter", err)
			}
		})
	}
}

func TestPickSegment(t *testing.T) {
	z := func(v string) map[string]string { return map[string]string{"zone": v} }
	tp := func(v string) *csi.Topology { return &csi.Topology{Segments: z(v)} }
	segs := []map[string]string{z("a"), z("b"), z("c")}
	for _, c := range []struct {
		name string
		req  *csi.TopologyRequirement
		want string
		ok   bool
	}{
		{"no requirement", nil, "a", true},
		{"preferred first", &csi.TopologyRequirement{Requisite: []*csi.Topology{tp("a"), tp("b"), tp("c")}, Preferred: []*csi.Topology{tp("c"), tp("a")}}, "c", true},
		{"requisite only", &csi.TopologyRequirement{Requisite: []*csi.Topology{tp("b")}}, "b", true},
		{"preferred outside requisite is ignored", &csi.TopologyRequirement{Requisite: []*csi.Topology{tp("b")}, Preferred: []*csi.Topology{tp("a")}}, "b", true},
		{"requisite elsewhere", &csi.TopologyRequirement{Requisite: []*csi.Topology{tp("x")}}, "", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, ok := pickSegment(segs, c.req)
			if ok != c.ok || (ok && got["zone"] != c.want) {
				t.Fatalf("got %v %v, want %s %v", got, ok, c.want, c.ok)
			}
		})
	}
}

// TestGetCapacityOfControllerSegments: a driver serving controller
// segments reports its free space for those segments only, as CreateVolume
// makes volumes in them only.
func TestGetCapacityOfControllerSegments(t *testing.T) {
	zone := "topology.kubernetes.io/zone"
	ep, _ := StartTest(t, Config{CapacityBytes: 10 << 20, ControllerSegments: []map[string]string{{zone: "z1"}, {zone: "z2"}}})
	c := dial(t, ep)
	ctx := ctxT(t)
	for z, want := range map[string]int64{"z1": 10 << 20, "z2": 10 << 20, "z3": 0} {
		resp, err := c.GetCapacity(ctx, &csi.GetCapacityRequest{AccessibleTopology: &csi.Topology{Segments: map[string]string{zone: z}}})
		if err != nil {
			t.Fatal(err)
		}
		if resp.GetAvailableCapacity() != want {
			t.Errorf("capacity in %s: %d, want %d", z, resp.GetAvailableCapacity(), want)
		}
	}
}

// TestTopologyOnlyWithTheCapability: a driver without topology does not
// advertise VOLUME_ACCESSIBILITY_CONSTRAINTS, and refuses requests that
// carry one, as the spec forbids sending it then (a strict driver would).
func TestTopologyOnlyWithTheCapability(t *testing.T) {
	ep, _ := StartTest(t, Config{CapacityBytes: 10 << 20})
	c := dial(t, ep)
	ctx := ctxT(t)
	topo := &csi.Topology{Segments: map[string]string{"kubernetes.io/hostname": "n1"}}
	if _, err := c.GetCapacity(ctx, &csi.GetCapacityRequest{AccessibleTopology: topo}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("GetCapacity with a topology: %v, want InvalidArgument", err)
	}
	if resp, err := c.GetCapacity(ctx, &csi.GetCapacityRequest{}); err != nil || resp.GetAvailableCapacity() != 10<<20 {
		t.Errorf("GetCapacity without one: %v, %v", resp, err)
	}
	_, err := c.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)},
		AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{topo}}})
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("CreateVolume with accessibility requirements: %v, want InvalidArgument", err)
	}
}

// TestUnstageAfterTheVolumeWasDeleted: with separate controller and node
// instances the controller cannot see the node's staging; a volume deleted
// while staged still has its staging mount removed by NodeUnstageVolume
// (its directory is gone, the mount is still this volume's).
func TestUnstageAfterTheVolumeWasDeleted(t *testing.T) {
	ctrlEP, _ := StartTest(t, Config{NodeID: "controller", Nodes: []string{"worker-1"}})
	nodeEP, _ := StartTest(t, Config{NodeID: "worker-1"})
	cc, nc := dial(t, ctrlEP), dial(t, nodeEP)
	ctx := ctxT(t)
	vol := mustCreate(t, cc, "gone-while-staged", 1<<20)
	capa := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
	pub, err := cc.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol.GetVolumeId(), NodeId: "worker-1", VolumeCapability: capa})
	if err != nil {
		t.Fatal(err)
	}
	staging, _ := mountPaths(t)
	if _, err := nc.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging,
		VolumeCapability: capa, PublishContext: pub.GetPublishContext()}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if ok, _ := isMountPoint(staging); ok {
			_ = unmount(staging)
		}
	})
	if _, err := cc.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol.GetVolumeId(), NodeId: "worker-1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := cc.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()}); err != nil {
		t.Fatal(err)
	}
	if _, err := nc.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	if ok, err := isMountPoint(staging); err != nil || ok {
		t.Fatalf("staging path %s still mounted after unstage: %v", staging, err)
	}
}

// TestReadOnlyControllerPublishReachesTheNode: a read-only
// ControllerPublishVolume makes the node publish the volume read-only,
// even when NodePublishVolume does not ask for it (the spec: the SP MUST
// publish it read-only).
func TestReadOnlyControllerPublishReachesTheNode(t *testing.T) {
	ep, _ := StartTest(t, Config{})
	c := dial(t, ep)
	ctx := ctxT(t)
	vol := mustCreate(t, c, "ro", 8<<20)
	staging, target := mountPaths(t)
	capa := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
	pub, err := c.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol.GetVolumeId(), NodeId: "node-1", VolumeCapability: capa, Readonly: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging, VolumeCapability: capa, PublishContext: pub.GetPublishContext()}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging, TargetPath: target,
		VolumeCapability: capa, PublishContext: pub.GetPublishContext()}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unmountAndDetach(t, c, vol.GetVolumeId(), "node-1", staging, target) })
	if err := os.WriteFile(filepath.Join(target, "f"), nil, 0o644); !errors.Is(err, syscall.EROFS) {
		t.Fatalf("write to a volume published read-only by the controller: %v, want EROFS", err)
	}
}

// TestCreateVolumeIdempotencyKeepsToTopology: a CreateVolume of a name
// that exists elsewhere than the requisite topologies is AlreadyExists,
// not OK with a volume the caller cannot use, nor ResourceExhausted when
// no segment fits (the name is looked up first); the same request again is
// OK with the volume.
func TestCreateVolumeIdempotencyKeepsToTopology(t *testing.T) {
	zone := "topology.kubernetes.io/zone"
	ep, _ := StartTest(t, Config{CapacityBytes: 10 << 20, ControllerSegments: []map[string]string{{zone: "z1"}, {zone: "z2"}}})
	c := dial(t, ep)
	ctx := ctxT(t)
	create := func(z string) (*csi.CreateVolumeResponse, error) {
		return c.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)},
			CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20}, AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{zone: z}}}}})
	}
	first, err := create("z1")
	if err != nil {
		t.Fatal(err)
	}
	again, err := create("z1")
	if err != nil || again.GetVolume().GetVolumeId() != first.GetVolume().GetVolumeId() {
		t.Fatalf("the same request again: %v, %v; want the same volume", again, err)
	}
	_, err = create("z2")
	wantCode(t, "the name again in another zone", err, codes.AlreadyExists)
	_, err = create("z3")
	wantCode(t, "the name again in a zone the driver does not serve", err, codes.AlreadyExists)
}

// TestCreateSnapshotKeepsToItsVolumesTopology: a snapshot is where its
// volume is, whatever segment this instance serves first: requisite
// topologies that hold the volume's are OK, others ResourceExhausted.
func TestCreateSnapshotKeepsToItsVolumesTopology(t *testing.T) {
	zone := "topology.kubernetes.io/zone"
	in := func(z string) *csi.TopologyRequirement {
		return &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{zone: z}}}}
	}
	ep, _ := StartTest(t, Config{CapacityBytes: 10 << 20, Topology: map[string]string{zone: "z1"}, ControllerSegments: []map[string]string{{zone: "z1"}, {zone: "z2"}}})
	c := dial(t, ep)
	ctx := ctxT(t)
	vol, err := c.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20}, AccessibilityRequirements: in("z2")})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "in-z2", SourceVolumeId: vol.GetVolume().GetVolumeId(), AccessibilityRequirements: in("z2")}); err != nil {
		t.Fatalf("a snapshot in its volume's zone: %v", err)
	}
	_, err = c.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "in-z1", SourceVolumeId: vol.GetVolume().GetVolumeId(), AccessibilityRequirements: in("z1")})
	wantCode(t, "a snapshot required in another zone than its volume's", err, codes.ResourceExhausted)
}
