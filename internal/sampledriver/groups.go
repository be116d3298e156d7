package sampledriver

import (
	"context"
	"os"
	"slices"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Group snapshots (the GroupController service, off with
// Config.DisableGroupSnapshots): one snapshot per source volume, cut under
// the driver's lock, so no call changes a volume between two of them. The
// member snapshots are ordinary snapshots with a group ID: listed, got and
// restored like any other, but deleted only with their group.

// groupServer serves the GroupController service on top of a Driver.
type groupServer struct {
	csi.UnimplementedGroupControllerServer
	*server
}

func (s *groupServer) GroupControllerGetCapabilities(context.Context, *csi.GroupControllerGetCapabilitiesRequest) (*csi.GroupControllerGetCapabilitiesResponse, error) {
	return &csi.GroupControllerGetCapabilitiesResponse{Capabilities: []*csi.GroupControllerServiceCapability{{
		Type: &csi.GroupControllerServiceCapability_Rpc{Rpc: &csi.GroupControllerServiceCapability_RPC{
			Type: csi.GroupControllerServiceCapability_RPC_CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT,
		}},
	}}}, nil
}

// csiGroup renders g for responses: ready once every member is.
func (s *groupServer) csiGroup(g *group) *csi.VolumeGroupSnapshot {
	out := &csi.VolumeGroupSnapshot{GroupSnapshotId: g.ID, CreationTime: timestamppb.New(g.Created), ReadyToUse: true}
	for _, id := range g.SnapshotIDs {
		sn := s.csiSnapshot(s.st.Snapshots[id])
		out.Snapshots = append(out.Snapshots, sn)
		out.ReadyToUse = out.ReadyToUse && sn.GetReadyToUse()
	}
	return out
}

// groupByName finds the group snapshot named name. Callers hold mu.
func (s *groupServer) groupByName(name string) *group {
	for _, g := range s.st.Groups {
		if g.Name == name {
			return g
		}
	}
	return nil
}

// sourceVolumes are the source volume IDs of g's members, in order.
// Callers hold mu.
func (s *groupServer) sourceVolumes(g *group) []string {
	out := make([]string, len(g.SnapshotIDs))
	for i, id := range g.SnapshotIDs {
		out[i] = s.st.Snapshots[id].SourceVolumeID
	}
	return out
}

func checkGroupRequest(req *csi.CreateVolumeGroupSnapshotRequest) error {
	if req.GetName() == "" {
		return invalid("name is required")
	}
	vols := req.GetSourceVolumeIds()
	if len(vols) == 0 {
		return invalid("source volume IDs are required")
	}
	for i, v := range vols {
		if v == "" {
			return invalid("source volume ID %d is empty", i)
		}
		if slices.Contains(vols[:i], v) {
			return invalid("source volume %s is given twice", v)
		}
	}
	return nil
}

// sameSet reports whether a and b hold the same strings, in any order.
func sameSet(a, b []string) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.Sort(a)
	slices.Sort(b)
	return slices.Equal(a, b)
}

func (s *groupServer) CreateVolumeGroupSnapshot(ctx context.Context, req *csi.CreateVolumeGroupSnapshotRequest) (*csi.CreateVolumeGroupSnapshotResponse, error) {
	if err := checkGroupRequest(req); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if g := s.groupByName(req.GetName()); g != nil {
		if !sameSet(s.sourceVolumes(g), req.GetSourceVolumeIds()) || !mapsEqual(g.Parameters, req.GetParameters()) {
			return nil, status.Errorf(codes.AlreadyExists, "group snapshot %q exists with other source volumes or parameters", g.Name)
		}
		return &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: s.csiGroup(g)}, nil
	}
	vols := make([]*volume, len(req.GetSourceVolumeIds()))
	for i, id := range req.GetSourceVolumeIds() {
		v, ok := s.st.Volumes[id]
		if !ok {
			return nil, status.Errorf(codes.NotFound, "source volume %s not found", id)
		}
		vols[i] = v
	}
	g, err := s.cutGroup(req.GetName(), req.GetParameters(), vols)
	if err != nil {
		return nil, err
	}
	s.log.Info("group snapshot created", "group_snapshot_id", g.ID, "name", g.Name, "snapshots", len(g.SnapshotIDs))
	return &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: s.csiGroup(g)}, nil
}

// cutGroup snapshots vols as one group and saves it; on failure nothing of
// it is left. Callers hold mu.
func (s *groupServer) cutGroup(name string, params map[string]string, vols []*volume) (*group, error) {
	g := &group{ID: newID("gs-"), Name: name, Parameters: cloneMap(params), Created: time.Now().UTC()}
	keys := []stateKey{groupKey(g.ID)}
	var cut []*snapshot
	for _, v := range vols {
		sn, err := s.cutSnapshot(v, "", params, g.ID, g.Created)
		if err != nil {
			s.dropSnapshots(cut...)
			return nil, err
		}
		cut = append(cut, sn)
		g.SnapshotIDs = append(g.SnapshotIDs, sn.ID)
		keys = append(keys, snapshotKey(sn.ID))
	}
	s.st.Groups[g.ID] = g
	if err := s.save(keys...); err != nil {
		delete(s.st.Groups, g.ID)
		s.dropSnapshots(cut...)
		return nil, status.Error(codes.Internal, err.Error())
	}
	return g, nil
}

// lookupGroup finds group snapshot id and checks the caller's list of its
// snapshots, if any. Callers hold mu.
func (s *groupServer) lookupGroup(id string, snapshotIDs []string) (*group, error) {
	if id == "" {
		return nil, invalid("group snapshot ID is required")
	}
	g, ok := s.st.Groups[id]
	if !ok {
		return nil, nil
	}
	if len(snapshotIDs) > 0 && !sameSet(g.SnapshotIDs, snapshotIDs) {
		return nil, invalid("snapshot IDs %v are not those of group snapshot %s", snapshotIDs, id)
	}
	return g, nil
}

func (s *groupServer) DeleteVolumeGroupSnapshot(ctx context.Context, req *csi.DeleteVolumeGroupSnapshotRequest) (*csi.DeleteVolumeGroupSnapshotResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	g, err := s.lookupGroup(req.GetGroupSnapshotId(), req.GetSnapshotIds())
	if err != nil || g == nil {
		return &csi.DeleteVolumeGroupSnapshotResponse{}, err
	}
	delete(s.st.Groups, g.ID)
	keys := []stateKey{groupKey(g.ID)}
	for _, id := range g.SnapshotIDs {
		delete(s.st.Snapshots, id)
		keys = append(keys, snapshotKey(id))
	}
	if err := s.save(keys...); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	for _, id := range g.SnapshotIDs {
		if err := os.RemoveAll(s.snapshotDir(id)); err != nil {
			s.log.Warn("remove snapshot directory", "snapshot_id", id, "error", err)
		}
	}
	s.log.Info("group snapshot deleted", "group_snapshot_id", g.ID)
	return &csi.DeleteVolumeGroupSnapshotResponse{}, nil
}

func (s *groupServer) GetVolumeGroupSnapshot(ctx context.Context, req *csi.GetVolumeGroupSnapshotRequest) (*csi.GetVolumeGroupSnapshotResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	g, err := s.lookupGroup(req.GetGroupSnapshotId(), req.GetSnapshotIds())
	if err != nil {
		return nil, err
	}
	if g == nil {
		return nil, status.Errorf(codes.NotFound, "group snapshot %s not found", req.GetGroupSnapshotId())
	}
	return &csi.GetVolumeGroupSnapshotResponse{GroupSnapshot: s.csiGroup(g)}, nil
}
