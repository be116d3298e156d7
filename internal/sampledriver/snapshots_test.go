package sampledriver

import (
	"fmt"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

// mustSnapshot snapshots volume vol as name.
func mustSnapshot(t testing.TB, c clients, name, vol string) *csi.Snapshot {
	t.Helper()
	resp, err := c.CreateSnapshot(ctxT(t), &csi.CreateSnapshotRequest{Name: name, SourceVolumeId: vol})
	if err != nil {
		t.Fatalf("CreateSnapshot %s: %v", name, err)
	}
	return resp.GetSnapshot()
}

// listAll pages through ListSnapshots max entries at a time.
func listAll(t testing.TB, c clients, req *csi.ListSnapshotsRequest, max int32) (ids []string, pages int) {
	t.Helper()
	req.MaxEntries = max
	for {
		resp, err := c.ListSnapshots(ctxT(t), req)
		if err != nil {
			t.Fatalf("ListSnapshots %v: %v", req, err)
		}
		pages++
		if max > 0 && len(resp.GetEntries()) > int(max) {
			t.Fatalf("page of %d entries, max %d", len(resp.GetEntries()), max)
		}
		for _, e := range resp.GetEntries() {
			ids = append(ids, e.GetSnapshot().GetSnapshotId())
		}
		if resp.GetNextToken() == "" {
			return ids, pages
		}
		req.StartingToken = resp.GetNextToken()
	}
}

// TestListSnapshotsPaging: pages of max_entries cover every snapshot once,
// in ID order; the filters by snapshot ID and source volume narrow it; a
// token the driver did not hand out is Aborted.
func TestListSnapshotsPaging(t *testing.T) {
	ep, _ := StartTest(t, Config{})
	c := dial(t, ep)
	a, b := mustCreate(t, c, "a", 1<<20), mustCreate(t, c, "b", 1<<20)
	var all, ofA []string
	for i := range 5 {
		vol := a
		if i%2 == 1 {
			vol = b
		}
		sn := mustSnapshot(t, c, fmt.Sprintf("s%d", i), vol.GetVolumeId())
		all = append(all, sn.GetSnapshotId())
		if vol == a {
			ofA = append(ofA, sn.GetSnapshotId())
		}
	}
	slices.Sort(all)
	slices.Sort(ofA)
	for _, max := range []int32{0, 1, 2, 5, 6} {
		got, pages := listAll(t, c, &csi.ListSnapshotsRequest{}, max)
		if !slices.Equal(got, all) {
			t.Errorf("max %d: listed %v, want %v", max, got, all)
		}
		if want := 1 + (len(all)-1)/max32(max, len(all)); pages != want {
			t.Errorf("max %d: %d pages, want %d", max, pages, want)
		}
	}
	if got, _ := listAll(t, c, &csi.ListSnapshotsRequest{SourceVolumeId: a.GetVolumeId()}, 2); !slices.Equal(got, ofA) {
		t.Errorf("by source volume: %v, want %v", got, ofA)
	}
	if got, _ := listAll(t, c, &csi.ListSnapshotsRequest{SnapshotId: all[3]}, 2); !slices.Equal(got, all[3:4]) {
		t.Errorf("by snapshot ID: %v, want %v", got, all[3:4])
	}
	if got, _ := listAll(t, c, &csi.ListSnapshotsRequest{SnapshotId: "ss-none"}, 0); len(got) != 0 {
		t.Errorf("by an unknown snapshot ID: %v, want none", got)
	}
	_, err := c.ListSnapshots(ctxT(t), &csi.ListSnapshotsRequest{StartingToken: "not-a-token"})
	wantCode(t, "ListSnapshots with a bad token", err, codes.Aborted)
	_, err = c.ListSnapshots(ctxT(t), &csi.ListSnapshotsRequest{MaxEntries: -1})
	wantCode(t, "ListSnapshots with max_entries -1", err, codes.InvalidArgument)
}

// max32 is the page size max means for n entries (0: all of them).
func max32(max int32, n int) int {
	if max == 0 {
		return n
	}
	return int(max)
}

// TestSnapshotReadyAfter: with SnapshotReadyAfter, a new snapshot is not
// ready; CreateSnapshot asked again returns the same snapshot, becoming
// ready once the time has passed, and GetSnapshot and ListSnapshots agree.
func TestSnapshotReadyAfter(t *testing.T) {
	const after = 400 * time.Millisecond
	ep, d := StartTest(t, Config{SnapshotReadyAfter: after})
	c := dial(t, ep)
	vol := mustCreate(t, c, "v", 1<<20)
	first := mustSnapshot(t, c, "s", vol.GetVolumeId())
	if first.GetReadyToUse() {
		t.Fatalf("a new snapshot is ready: %v", first)
	}
	deadline := time.Now().Add(10 * time.Second)
	var last *csi.Snapshot
	for last = first; !last.GetReadyToUse(); {
		if time.Now().After(deadline) {
			t.Fatalf("snapshot not ready after 10s: %v", last)
		}
		time.Sleep(50 * time.Millisecond)
		last = mustSnapshot(t, c, "s", vol.GetVolumeId())
		if last.GetSnapshotId() != first.GetSnapshotId() || !last.GetCreationTime().AsTime().Equal(first.GetCreationTime().AsTime()) {
			t.Fatalf("CreateSnapshot again: %v, want the same snapshot as %v", last, first)
		}
	}
	if waited := time.Since(first.GetCreationTime().AsTime()); waited < after {
		t.Errorf("ready %s after it was cut, want at least %s", waited, after)
	}
	got, err := c.GetSnapshot(ctxT(t), &csi.GetSnapshotRequest{SnapshotId: first.GetSnapshotId()})
	if err != nil || !got.GetSnapshot().GetReadyToUse() {
		t.Errorf("GetSnapshot = %v, %v; want ready", got, err)
	}
	list, err := c.ListSnapshots(ctxT(t), &csi.ListSnapshotsRequest{SnapshotId: first.GetSnapshotId()})
	if err != nil || len(list.GetEntries()) != 1 || !list.GetEntries()[0].GetSnapshot().GetReadyToUse() {
		t.Errorf("ListSnapshots = %v, %v; want it ready", list, err)
	}
	other := mustCreate(t, c, "other", 1<<20)
	_, err = c.CreateSnapshot(ctxT(t), &csi.CreateSnapshotRequest{Name: "s", SourceVolumeId: other.GetVolumeId()})
	wantCode(t, "CreateSnapshot of the same name from another volume", err, codes.AlreadyExists)
	if n := len(d.Snapshots()); n != 1 {
		t.Errorf("%d snapshots, want 1", n)
	}
}

func TestSnapshotReadyAfterMustNotBeNegative(t *testing.T) {
	cfg := Config{NodeID: "n", StateDir: os.TempDir(), SnapshotReadyAfter: -time.Second}
	if err := cfg.Validate(); err == nil {
		t.Fatal("Validate accepted a negative SnapshotReadyAfter")
	}
}

// dialGroup returns a GroupController client on endpoint.
func dialGroup(t testing.TB, ep string) csi.GroupControllerClient {
	t.Helper()
	return csi.NewGroupControllerClient(dial(t, ep).conn)
}

func groupReq(name string, vols ...string) *csi.CreateVolumeGroupSnapshotRequest {
	return &csi.CreateVolumeGroupSnapshotRequest{Name: name, SourceVolumeIds: vols}
}

func memberIDs(g *csi.VolumeGroupSnapshot) []string {
	var ids []string
	for _, s := range g.GetSnapshots() {
		ids = append(ids, s.GetSnapshotId())
	}
	return ids
}

// hasGroupService reports whether the plugin advertises GROUP_CONTROLLER_SERVICE.
func hasGroupService(t testing.TB, c clients) bool {
	t.Helper()
	caps, err := c.GetPluginCapabilities(ctxT(t), &csi.GetPluginCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, cp := range caps.GetCapabilities() {
		if cp.GetService().GetType() == csi.PluginCapability_Service_GROUP_CONTROLLER_SERVICE {
			return true
		}
	}
	return false
}

// TestGroupSnapshots: a group snapshot cuts one snapshot per volume, each
// carrying the group's ID; asked again by name it is the same group, with
// other volumes it is AlreadyExists; its members restore like any
// snapshot but are deleted only with the group; Get checks the member
// list; Delete removes all of it and is idempotent.
func TestGroupSnapshots(t *testing.T) {
	ep, d := StartTest(t, Config{})
	c, g := dial(t, ep), dialGroup(t, ep)
	if !hasGroupService(t, c) {
		t.Fatal("GROUP_CONTROLLER_SERVICE not advertised")
	}
	caps, err := g.GroupControllerGetCapabilities(ctxT(t), &csi.GroupControllerGetCapabilitiesRequest{})
	if err != nil || len(caps.GetCapabilities()) != 1 ||
		caps.GetCapabilities()[0].GetRpc().GetType() != csi.GroupControllerServiceCapability_RPC_CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT {
		t.Fatalf("GroupControllerGetCapabilities = %v, %v", caps, err)
	}
	var vols []string
	for i := range 3 {
		vols = append(vols, mustCreate(t, c, fmt.Sprintf("v%d", i), 1<<20).GetVolumeId())
	}
	resp, err := g.CreateVolumeGroupSnapshot(ctxT(t), groupReq("grp", vols...))
	if err != nil {
		t.Fatal(err)
	}
	grp := resp.GetGroupSnapshot()
	checkGroup(t, grp, vols)
	again, err := g.CreateVolumeGroupSnapshot(ctxT(t), groupReq("grp", vols[2], vols[0], vols[1]))
	if err != nil || again.GetGroupSnapshot().GetGroupSnapshotId() != grp.GetGroupSnapshotId() ||
		!slices.Equal(memberIDs(again.GetGroupSnapshot()), memberIDs(grp)) {
		t.Fatalf("CreateVolumeGroupSnapshot again = %v, %v; want %v", again, err, grp)
	}
	_, err = g.CreateVolumeGroupSnapshot(ctxT(t), groupReq("grp", vols[:2]...))
	wantCode(t, "the same name with other volumes", err, codes.AlreadyExists)
	_, err = g.CreateVolumeGroupSnapshot(ctxT(t), &csi.CreateVolumeGroupSnapshotRequest{Name: "grp", SourceVolumeIds: vols, Parameters: map[string]string{"k": "v"}})
	wantCode(t, "the same name with other parameters", err, codes.AlreadyExists)

	member := grp.GetSnapshots()[1].GetSnapshotId()
	_, err = c.DeleteSnapshot(ctxT(t), &csi.DeleteSnapshotRequest{SnapshotId: member})
	wantCode(t, "DeleteSnapshot of a group member", err, codes.InvalidArgument)
	restore := createReq("restored", 1<<20)
	restore.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: member}}}
	if _, err := c.CreateVolume(ctxT(t), restore); err != nil {
		t.Fatalf("restore a member: %v", err)
	}
	list, _ := listAll(t, c, &csi.ListSnapshotsRequest{SourceVolumeId: vols[1]}, 0)
	if !slices.Equal(list, []string{member}) {
		t.Errorf("ListSnapshots of %s = %v, want [%s]", vols[1], list, member)
	}

	get, err := g.GetVolumeGroupSnapshot(ctxT(t), &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: grp.GetGroupSnapshotId(), SnapshotIds: memberIDs(grp)})
	if err != nil || get.GetGroupSnapshot().GetGroupSnapshotId() != grp.GetGroupSnapshotId() || !get.GetGroupSnapshot().GetReadyToUse() {
		t.Fatalf("GetVolumeGroupSnapshot = %v, %v", get, err)
	}
	_, err = g.GetVolumeGroupSnapshot(ctxT(t), &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: grp.GetGroupSnapshotId(), SnapshotIds: []string{member}})
	wantCode(t, "GetVolumeGroupSnapshot with a wrong member list", err, codes.InvalidArgument)
	_, err = g.DeleteVolumeGroupSnapshot(ctxT(t), &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: grp.GetGroupSnapshotId(), SnapshotIds: []string{member}})
	wantCode(t, "DeleteVolumeGroupSnapshot with a wrong member list", err, codes.InvalidArgument)

	for range 2 { // idempotent
		if _, err := g.DeleteVolumeGroupSnapshot(ctxT(t), &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: grp.GetGroupSnapshotId(), SnapshotIds: memberIDs(grp)}); err != nil {
			t.Fatalf("DeleteVolumeGroupSnapshot: %v", err)
		}
	}
	_, err = g.GetVolumeGroupSnapshot(ctxT(t), &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: grp.GetGroupSnapshotId()})
	wantCode(t, "GetVolumeGroupSnapshot after the delete", err, codes.NotFound)
	if s, gs := d.Snapshots(), d.GroupSnapshots(); len(s) != 0 || len(gs) != 0 {
		t.Errorf("left after the delete: snapshots %v, groups %v", s, gs)
	}
	for _, sn := range grp.GetSnapshots() {
		if _, err := os.Stat(d.snapshotDir(sn.GetSnapshotId())); !os.IsNotExist(err) {
			t.Errorf("snapshot directory of %s: %v, want it gone", sn.GetSnapshotId(), err)
		}
	}
}

// checkGroup checks that grp has one ready member per volume, in order,
// each naming the group.
func checkGroup(t testing.TB, grp *csi.VolumeGroupSnapshot, vols []string) {
	t.Helper()
	if grp.GetGroupSnapshotId() == "" || grp.GetCreationTime() == nil || !grp.GetReadyToUse() || len(grp.GetSnapshots()) != len(vols) {
		t.Fatalf("group snapshot %v of %v", grp, vols)
	}
	for i, sn := range grp.GetSnapshots() {
		if sn.GetSourceVolumeId() != vols[i] || sn.GetGroupSnapshotId() != grp.GetGroupSnapshotId() || !sn.GetReadyToUse() || sn.GetSnapshotId() == "" {
			t.Errorf("member %d: %v, want a ready snapshot of %s in group %s", i, sn, vols[i], grp.GetGroupSnapshotId())
		}
	}
}

// TestGroupSnapshotRefusals: bad requests are InvalidArgument, a missing
// volume NotFound, and none of them leaves a snapshot behind.
func TestGroupSnapshotRefusals(t *testing.T) {
	ep, d := StartTest(t, Config{})
	c, g := dial(t, ep), dialGroup(t, ep)
	v := mustCreate(t, c, "v", 1<<20).GetVolumeId()
	for _, tc := range []struct {
		what string
		req  *csi.CreateVolumeGroupSnapshotRequest
		want codes.Code
	}{
		{"no name", groupReq("", v), codes.InvalidArgument},
		{"no volumes", groupReq("g"), codes.InvalidArgument},
		{"an empty volume ID", groupReq("g", v, ""), codes.InvalidArgument},
		{"a volume twice", groupReq("g", v, v), codes.InvalidArgument},
		{"a missing volume", groupReq("g", v, "vol-missing"), codes.NotFound},
	} {
		_, err := g.CreateVolumeGroupSnapshot(ctxT(t), tc.req)
		wantCode(t, tc.what, err, tc.want)
	}
	_, err := g.GetVolumeGroupSnapshot(ctxT(t), &csi.GetVolumeGroupSnapshotRequest{})
	wantCode(t, "GetVolumeGroupSnapshot without an ID", err, codes.InvalidArgument)
	_, err = g.DeleteVolumeGroupSnapshot(ctxT(t), &csi.DeleteVolumeGroupSnapshotRequest{})
	wantCode(t, "DeleteVolumeGroupSnapshot without an ID", err, codes.InvalidArgument)
	if s, gs := d.Snapshots(), d.GroupSnapshots(); len(s) != 0 || len(gs) != 0 {
		t.Errorf("left after refusals: snapshots %v, groups %v", s, gs)
	}
}

// TestGroupSnapshotReadyAfter: a group is ready only once all its members
// are.
func TestGroupSnapshotReadyAfter(t *testing.T) {
	ep, _ := StartTest(t, Config{SnapshotReadyAfter: 300 * time.Millisecond})
	c, g := dial(t, ep), dialGroup(t, ep)
	vols := []string{mustCreate(t, c, "a", 1<<20).GetVolumeId(), mustCreate(t, c, "b", 1<<20).GetVolumeId()}
	resp, err := g.CreateVolumeGroupSnapshot(ctxT(t), groupReq("grp", vols...))
	if err != nil {
		t.Fatal(err)
	}
	grp := resp.GetGroupSnapshot()
	if grp.GetReadyToUse() || grp.GetSnapshots()[0].GetReadyToUse() {
		t.Fatalf("a new group snapshot is ready: %v", grp)
	}
	deadline := time.Now().Add(10 * time.Second)
	for !grp.GetReadyToUse() {
		if time.Now().After(deadline) {
			t.Fatalf("group not ready after 10s: %v", grp)
		}
		time.Sleep(50 * time.Millisecond)
		again, err := g.CreateVolumeGroupSnapshot(ctxT(t), groupReq("grp", vols...))
		if err != nil || again.GetGroupSnapshot().GetGroupSnapshotId() != grp.GetGroupSnapshotId() {
			t.Fatalf("CreateVolumeGroupSnapshot again = %v, %v", again, err)
		}
		grp = again.GetGroupSnapshot()
	}
	checkGroup(t, grp, vols)
}

// TestGroupSnapshotsSurviveRestart: a group and its members are in the
// state a new driver on the same StateDir reads.
func TestGroupSnapshotsSurviveRestart(t *testing.T) {
	dir := t.TempDir()
	c, _, stop := serveOn(t, Config{NodeID: "n", StateDir: dir})
	vols := []string{mustCreate(t, c, "a", 1<<20).GetVolumeId(), mustCreate(t, c, "b", 1<<20).GetVolumeId()}
	g := csi.NewGroupControllerClient(c.conn)
	resp, err := g.CreateVolumeGroupSnapshot(ctxT(t), groupReq("grp", vols...))
	if err != nil {
		t.Fatal(err)
	}
	stop()
	_, d2, _ := serveOn(t, Config{NodeID: "n", StateDir: dir})
	gs := d2.GroupSnapshots()
	if len(gs) != 1 || gs[0].ID != resp.GetGroupSnapshot().GetGroupSnapshotId() || !slices.Equal(gs[0].SnapshotIDs, memberIDs(resp.GetGroupSnapshot())) {
		t.Fatalf("groups after restart: %+v, want %v", gs, resp.GetGroupSnapshot())
	}
	for _, s := range d2.Snapshots() {
		if s.GroupID != gs[0].ID {
			t.Errorf("snapshot %+v after restart: want group %s", s, gs[0].ID)
		}
	}
}

// TestDisableGroupSnapshots: the knob removes the service and its plugin
// capability.
func TestDisableGroupSnapshots(t *testing.T) {
	ep, _ := StartTest(t, Config{DisableGroupSnapshots: true})
	if hasGroupService(t, dial(t, ep)) {
		t.Fatal("GROUP_CONTROLLER_SERVICE advertised with DisableGroupSnapshots")
	}
	_, err := dialGroup(t, ep).GroupControllerGetCapabilities(ctxT(t), &csi.GroupControllerGetCapabilitiesRequest{})
	wantCode(t, "GroupControllerGetCapabilities with DisableGroupSnapshots", err, codes.Unimplemented)
}
