package sampledriver

import (
	"context"
	"os"
	"sort"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Snapshots: a snapshot is a copy of the volume directory, cut at once and
// ready to use Config.SnapshotReadyAfter after it was cut (at once by
// default), as a driver that uploads its snapshots would report it.

// snapshotReady reports whether sn has been processed.
func (s *server) snapshotReady(sn *snapshot) bool {
	return time.Since(sn.Created) >= s.cfg.SnapshotReadyAfter
}

func (s *server) csiSnapshot(sn *snapshot) *csi.Snapshot {
	out := &csi.Snapshot{
		SnapshotId:      sn.ID,
		SourceVolumeId:  sn.SourceVolumeID,
		SizeBytes:       sn.SizeBytes,
		CreationTime:    timestamppb.New(sn.Created),
		ReadyToUse:      s.snapshotReady(sn),
		GroupSnapshotId: sn.GroupID,
	}
	// accessible_topology is optional and left out: csi-sanity v5.6.0
	// compares it with gomega's Equal, i.e. reflect.DeepEqual on protobuf
	// messages, which fails on their internal state even when equal.
	return out
}

// snapshotByName finds the snapshot of its own named name. Callers hold mu.
func (s *server) snapshotByName(name string) *snapshot {
	for _, sn := range s.st.Snapshots {
		if sn.GroupID == "" && sn.Name == name {
			return sn
		}
	}
	return nil
}

func (s *server) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	switch {
	case req.GetName() == "":
		return nil, invalid("name is required")
	case req.GetSourceVolumeId() == "":
		return nil, invalid("source volume ID is required")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	// Asked again (the CO polls until the snapshot is ready): the same
	// snapshot, as it is now.
	if sn := s.snapshotByName(req.GetName()); sn != nil {
		if sn.SourceVolumeID != req.GetSourceVolumeId() {
			return nil, status.Errorf(codes.AlreadyExists, "snapshot %q exists for volume %s", sn.Name, sn.SourceVolumeID)
		}
		return &csi.CreateSnapshotResponse{Snapshot: s.csiSnapshot(sn)}, nil
	}
	v, ok := s.st.Volumes[req.GetSourceVolumeId()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "source volume %s not found", req.GetSourceVolumeId())
	}
	// A snapshot is where its volume is: the requirements are held
	// against that (after the lookup by name, so a retry gets its
	// snapshot).
	if !topologyAllows(v.Topology, req.GetAccessibilityRequirements()) {
		return nil, status.Errorf(codes.ResourceExhausted, "cannot snapshot volume %s, in %s, in the requisite topologies", v.ID, FormatTopology(v.Topology))
	}
	sn, err := s.cutSnapshot(v, req.GetName(), req.GetParameters(), "", time.Now().UTC())
	if err != nil {
		return nil, err
	}
	if err := s.save(snapshotKey(sn.ID)); err != nil {
		s.dropSnapshots(sn)
		return nil, status.Error(codes.Internal, err.Error())
	}
	s.log.Info("snapshot created", "snapshot_id", sn.ID, "name", sn.Name, "volume_id", v.ID)
	return &csi.CreateSnapshotResponse{Snapshot: s.csiSnapshot(sn)}, nil
}

// cutSnapshot copies volume v into a new snapshot and adds it to the state
// (not yet saved). Callers hold mu.
func (s *server) cutSnapshot(v *volume, name string, params map[string]string, groupID string, at time.Time) (*snapshot, error) {
	sn := &snapshot{
		ID:             newID("ss-"),
		Name:           name,
		SourceVolumeID: v.ID,
		SizeBytes:      v.CapacityBytes,
		Parameters:     cloneMap(params),
		Topology:       cloneMap(v.Topology),
		Created:        at,
		GroupID:        groupID,
	}
	dir := s.snapshotDir(sn.ID)
	if err := copyTree(s.volumeDir(v.ID), dir); err != nil {
		_ = os.RemoveAll(dir)
		return nil, status.Errorf(codes.Internal, "copy volume %s: %v", v.ID, err)
	}
	s.st.Snapshots[sn.ID] = sn
	return sn, nil
}

// dropSnapshots undoes cutSnapshot for each of sns. Callers hold mu.
func (s *server) dropSnapshots(sns ...*snapshot) {
	for _, sn := range sns {
		delete(s.st.Snapshots, sn.ID)
		_ = os.RemoveAll(s.snapshotDir(sn.ID))
	}
}

func (s *server) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	id := req.GetSnapshotId()
	if id == "" {
		return nil, invalid("snapshot ID is required")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	sn, ok := s.st.Snapshots[id]
	if !ok {
		return &csi.DeleteSnapshotResponse{}, nil
	}
	if sn.GroupID != "" {
		return nil, invalid("snapshot %s is part of group snapshot %s: delete the group", id, sn.GroupID)
	}
	delete(s.st.Snapshots, id)
	if err := s.save(snapshotKey(id)); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if err := os.RemoveAll(s.snapshotDir(id)); err != nil {
		s.log.Warn("remove snapshot directory", "snapshot_id", id, "error", err)
	}
	s.log.Info("snapshot deleted", "snapshot_id", id)
	return &csi.DeleteSnapshotResponse{}, nil
}

// ListSnapshots pages through the snapshots in ID order, filtered by
// snapshot ID and source volume ID; a token is the ID to resume at (an
// unknown token is Aborted, see page).
func (s *server) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var ids []string
	for id, sn := range s.st.Snapshots {
		if req.GetSnapshotId() != "" && id != req.GetSnapshotId() {
			continue
		}
		if req.GetSourceVolumeId() != "" && sn.SourceVolumeID != req.GetSourceVolumeId() {
			continue
		}
		ids = append(ids, id)
	}
	sort.Strings(ids)
	ids, next, err := page(ids, req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, toStatus(err)
	}
	resp := &csi.ListSnapshotsResponse{NextToken: next}
	for _, id := range ids {
		resp.Entries = append(resp.Entries, &csi.ListSnapshotsResponse_Entry{Snapshot: s.csiSnapshot(s.st.Snapshots[id])})
	}
	return resp, nil
}

func (s *server) GetSnapshot(ctx context.Context, req *csi.GetSnapshotRequest) (*csi.GetSnapshotResponse, error) {
	id := req.GetSnapshotId()
	if id == "" {
		return nil, invalid("snapshot ID is required")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	sn, ok := s.st.Snapshots[id]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "snapshot %s not found", id)
	}
	return &csi.GetSnapshotResponse{Snapshot: s.csiSnapshot(sn)}, nil
}
