package sampledriver

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func (s *server) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	types := []csi.NodeServiceCapability_RPC_Type{
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
		csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
		csi.NodeServiceCapability_RPC_GET_VOLUME_HEALTH,
		csi.NodeServiceCapability_RPC_GET_STORAGE_HEALTH,
	}
	caps := make([]*csi.NodeServiceCapability, len(types))
	for i, t := range types {
		caps[i] = &csi.NodeServiceCapability{Type: &csi.NodeServiceCapability_Rpc{
			Rpc: &csi.NodeServiceCapability_RPC{Type: t},
		}}
	}
	return &csi.NodeGetCapabilitiesResponse{Capabilities: caps}, nil
}

func (s *server) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	resp := &csi.NodeGetInfoResponse{NodeId: s.cfg.NodeID, MaxVolumesPerNode: s.cfg.MaxVolumesPerNode}
	if len(s.cfg.Topology) > 0 {
		resp.AccessibleTopology = &csi.Topology{Segments: cloneMap(s.cfg.Topology)}
	}
	return resp, nil
}

// nodeVolumeSource finds the directory to stage for a volume: this
// instance's own volume, the directory it was staged from before, or the
// directory named by the publish context (or, without the publish step, the
// volume context) that a controller instance returned. When the driver has
// the publish step, the volume must have been published to this node.
// Callers hold mu.
func (s *server) nodeVolumeSource(id string, publishCtx, volumeCtx map[string]string) (string, error) {
	if v, ok := s.st.Volumes[id]; ok {
		if !s.cfg.DisablePublish {
			if _, ok := v.Attachments[s.cfg.NodeID]; !ok {
				return "", status.Errorf(codes.FailedPrecondition, "volume %s is not published to node %s", id, s.cfg.NodeID)
			}
		}
		return s.volumeDir(id), nil
	}
	if st, ok := s.st.Staged[id]; ok {
		return st.Source, nil
	}
	p := publishCtx[PublishContextDevicePath]
	if !s.cfg.DisablePublish && p == "" {
		return "", status.Errorf(codes.FailedPrecondition, "volume %s: no %s in the publish context (was it published to this node?)", id, PublishContextDevicePath)
	}
	if p == "" {
		p = volumeCtx[VolumeContextPath]
	}
	if p == "" {
		return "", status.Errorf(codes.NotFound, "volume %s not found", id)
	}
	// Only a sample-driver volume directory is acceptable: .../volumes/<id>.
	if !filepath.IsAbs(p) || filepath.Clean(p) != p || filepath.Base(p) != id || filepath.Base(filepath.Dir(p)) != "volumes" {
		return "", status.Errorf(codes.NotFound, "volume %s: %q is not a sample driver volume directory", id, p)
	}
	if fi, err := os.Stat(p); err != nil || !fi.IsDir() {
		return "", status.Errorf(codes.NotFound, "volume %s: directory %s not found", id, p)
	}
	return p, nil
}

// volumeKnown reports whether this node knows the volume at all. Callers
// hold mu.
func (s *server) volumeKnown(id string) bool {
	if _, ok := s.st.Volumes[id]; ok {
		return true
	}
	if _, ok := s.st.Staged[id]; ok {
		return true
	}
	for _, p := range s.st.Published {
		if p.VolumeID == id {
			return true
		}
	}
	return false
}

// volumeAt returns the directory a volume shows at path when path is its
// staging or target path on this node. Callers hold mu.
func (s *server) volumeAt(id, path string) (src string, ok bool) {
	path = filepath.Clean(path)
	if st, found := s.st.Staged[id]; found && st.Path == path {
		return st.Source, true
	}
	if p, found := s.st.Published[path]; found && p.VolumeID == id {
		return p.Source, true
	}
	return "", false
}

func (s *server) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	id, path := req.GetVolumeId(), req.GetStagingTargetPath()
	switch {
	case id == "":
		return nil, invalid("volume ID is required")
	case path == "":
		return nil, invalid("staging target path is required")
	case req.GetVolumeCapability() == nil:
		return nil, invalid("volume capability is required")
	case !filepath.IsAbs(path):
		return nil, invalid("staging target path %q is not absolute", path)
	}
	if err := checkCapability(req.GetVolumeCapability()); err != nil {
		return nil, toStatus(err)
	}
	path = filepath.Clean(path)
	mode := int32(req.GetVolumeCapability().GetAccessMode().GetMode())

	s.mu.Lock()
	defer s.mu.Unlock()
	src, err := s.nodeVolumeSource(id, req.GetPublishContext(), req.GetVolumeContext())
	if err != nil {
		return nil, err
	}
	if st, ok := s.st.Staged[id]; ok && st.Path != path {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is already staged at %s", id, st.Path)
	} else if ok && st.AccessMode != mode {
		// The spec: OK only for a stage identical to the one made.
		return nil, status.Errorf(codes.AlreadyExists, "volume %s is staged at %s with access mode %s", id, path, csi.VolumeCapability_AccessMode_Mode(st.AccessMode))
	}
	for oid, st := range s.st.Staged {
		if oid != id && st.Path == path {
			return nil, status.Errorf(codes.AlreadyExists, "volume %s is staged at %s", oid, path)
		}
	}
	fi, err := os.Stat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if err := os.MkdirAll(path, 0o750); err != nil {
			return nil, status.Errorf(codes.Internal, "create staging path: %v", err)
		}
	case err != nil:
		return nil, status.Errorf(codes.Internal, "staging path: %v", err)
	case !fi.IsDir():
		return nil, invalid("staging target path %s is not a directory", path)
	}
	mounted, err := isMountPoint(path)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "check staging path: %v", err)
	}
	if mounted {
		bound, _, err := boundTo(path, src)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "check staging path: %v", err)
		}
		if !bound {
			return nil, status.Errorf(codes.AlreadyExists, "staging path %s is a mount point of something else", path)
		}
	} else if err := bindMount(src, path, false); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if st, ok := s.st.Staged[id]; ok && st.Source == src && st.AccessMode == mode {
		return &csi.NodeStageVolumeResponse{}, nil
	}
	s.st.Staged[id] = &staging{VolumeID: id, Path: path, Source: src, AccessMode: mode}
	if err := s.save(stagedKey(id)); err != nil {
		if !mounted {
			_ = unmount(path)
		}
		return nil, status.Error(codes.Internal, err.Error())
	}
	s.log.Info("volume staged", "volume_id", id, "staging_path", path)
	return &csi.NodeStageVolumeResponse{}, nil
}

func (s *server) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	id, path := req.GetVolumeId(), req.GetStagingTargetPath()
	switch {
	case id == "":
		return nil, invalid("volume ID is required")
	case path == "":
		return nil, invalid("staging target path is required")
	}
	path = filepath.Clean(path)
	s.mu.Lock()
	defer s.mu.Unlock()
	st, ok := s.st.Staged[id]
	if !ok || st.Path != path {
		// Not staged there as far as the state knows; if the state was
		// lost, the mount may still show this volume's directory.
		if _, local := s.st.Volumes[id]; local {
			if bound, _, err := boundTo(path, s.volumeDir(id)); err == nil && bound {
				if err := unmount(path); err != nil {
					return nil, status.Error(codes.Internal, err.Error())
				}
			}
		}
		return &csi.NodeUnstageVolumeResponse{}, nil
	}
	for t, p := range s.st.Published {
		if p.VolumeID == id {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s is still published at %s", id, t)
		}
	}
	bound, _, err := boundTo(path, st.Source)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "check staging path: %v", err)
	}
	if !bound {
		// The volume's directory is gone (deleted while staged, by a
		// controller instance that cannot see this node's mounts): the
		// mount at the path this volume was staged at is still its own.
		if _, serr := os.Stat(st.Source); errors.Is(serr, fs.ErrNotExist) {
			if bound, err = isMountPoint(path); err != nil {
				return nil, status.Errorf(codes.Internal, "check staging path: %v", err)
			}
		}
	}
	if bound {
		if err := unmount(path); err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
	}
	delete(s.st.Staged, id)
	if err := s.save(stagedKey(id)); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	s.log.Info("volume unstaged", "volume_id", id, "staging_path", path)
	return &csi.NodeUnstageVolumeResponse{}, nil
}

func (s *server) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	id, target, staging := req.GetVolumeId(), req.GetTargetPath(), req.GetStagingTargetPath()
	switch {
	case id == "":
		return nil, invalid("volume ID is required")
	case target == "":
		return nil, invalid("target path is required")
	case req.GetVolumeCapability() == nil:
		return nil, invalid("volume capability is required")
	case staging == "":
		// The spec's code for it: the driver has STAGE_UNSTAGE_VOLUME.
		return nil, status.Error(codes.FailedPrecondition, "staging target path is required (the driver has STAGE_UNSTAGE_VOLUME)")
	case !filepath.IsAbs(target):
		return nil, invalid("target path %q is not absolute", target)
	}
	if err := checkCapability(req.GetVolumeCapability()); err != nil {
		return nil, toStatus(err)
	}
	target, staging = filepath.Clean(target), filepath.Clean(staging)
	mode := req.GetVolumeCapability().GetAccessMode().GetMode()
	// Read-only if asked here, by the access mode, or by a read-only
	// ControllerPublishVolume (its publish context says so).
	ro := req.GetReadonly() || readerOnly(mode) || req.GetPublishContext()[PublishContextReadonly] == "true"

	s.mu.Lock()
	defer s.mu.Unlock()
	st, ok := s.st.Staged[id]
	if !ok || st.Path != staging {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is not staged at %s", id, staging)
	}
	if bound, _, err := boundTo(staging, st.Source); err != nil {
		return nil, status.Errorf(codes.Internal, "check staging path: %v", err)
	} else if !bound {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s: staging path %s is not mounted", id, staging)
	}
	if p, ok := s.st.Published[target]; ok {
		if p.VolumeID != id {
			return nil, status.Errorf(codes.AlreadyExists, "target %s is used by volume %s", target, p.VolumeID)
		}
		bound, curRO, err := boundTo(target, p.Source)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "check target path: %v", err)
		}
		if bound {
			if curRO != ro || p.AccessMode != int32(mode) {
				return nil, status.Errorf(codes.AlreadyExists, "volume %s is published at %s with readonly=%v, access mode %s",
					id, target, curRO, csi.VolumeCapability_AccessMode_Mode(p.AccessMode))
			}
			return &csi.NodePublishVolumeResponse{}, nil
		}
		// The record outlived its mount (e.g. a reboot): mount again.
	}
	for t, p := range s.st.Published {
		if p.VolumeID != id || t == target {
			continue
		}
		if mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER ||
			p.AccessMode == int32(csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER) {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s is published at %s and its access mode allows a single publication", id, t)
		}
	}
	created, adopted := false, false
	fi, err := os.Stat(target)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if err := os.MkdirAll(target, 0o750); err != nil {
			return nil, status.Errorf(codes.Internal, "create target path: %v", err)
		}
		created = true
	case err != nil:
		return nil, status.Errorf(codes.Internal, "target path: %v", err)
	case !fi.IsDir():
		return nil, invalid("target path %s exists and is not a directory", target)
	default:
		mounted, err := isMountPoint(target)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "check target path: %v", err)
		}
		if mounted {
			// This volume's own mount, left by a publish whose record was
			// lost (the driver stopped before saving it), is adopted.
			bound, curRO, err := boundTo(target, st.Source)
			if err != nil {
				return nil, status.Errorf(codes.Internal, "check target path: %v", err)
			}
			if !bound || curRO != ro {
				return nil, status.Errorf(codes.AlreadyExists, "target path %s is already a mount point", target)
			}
			adopted = true
		}
	}
	if !adopted {
		if err := bindMount(staging, target, ro); err != nil {
			if created {
				_ = os.Remove(target)
			}
			return nil, status.Error(codes.Internal, err.Error())
		}
	}
	s.st.Published[target] = &publication{VolumeID: id, TargetPath: target, StagingPath: staging, Source: st.Source, Readonly: ro, AccessMode: int32(mode)}
	if err := s.save(publishedKey(target)); err != nil {
		delete(s.st.Published, target)
		if !adopted {
			_ = unmount(target)
		}
		if created {
			_ = os.Remove(target)
		}
		return nil, status.Error(codes.Internal, err.Error())
	}
	s.log.Info("volume published on node", "volume_id", id, "target_path", target, "readonly", ro)
	return &csi.NodePublishVolumeResponse{}, nil
}

func (s *server) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	id, target := req.GetVolumeId(), req.GetTargetPath()
	switch {
	case id == "":
		return nil, invalid("volume ID is required")
	case target == "":
		return nil, invalid("target path is required")
	}
	target = filepath.Clean(target)
	s.mu.Lock()
	defer s.mu.Unlock()
	p, ok := s.st.Published[target]
	if ok && p.VolumeID != id {
		// Someone else's target: nothing of this volume to undo.
		return &csi.NodeUnpublishVolumeResponse{}, nil
	}
	if !ok {
		// Not recorded; if the state was lost, the mount may still show
		// this volume's directory.
		src := ""
		if _, local := s.st.Volumes[id]; local {
			src = s.volumeDir(id)
		} else if st, staged := s.st.Staged[id]; staged {
			src = st.Source
		}
		if src == "" {
			return &csi.NodeUnpublishVolumeResponse{}, nil
		}
		if bound, _, err := boundTo(target, src); err != nil || !bound {
			return &csi.NodeUnpublishVolumeResponse{}, nil
		}
	}
	if err := unmount(target); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if err := os.Remove(target); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, status.Errorf(codes.Internal, "remove target path: %v", err)
	}
	if ok {
		delete(s.st.Published, target)
		if err := s.save(publishedKey(target)); err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
	}
	s.log.Info("volume unpublished on node", "volume_id", id, "target_path", target)
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

func (s *server) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	id, path := req.GetVolumeId(), req.GetVolumePath()
	switch {
	case id == "":
		return nil, invalid("volume ID is required")
	case path == "":
		return nil, invalid("volume path is required")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.volumeKnown(id) {
		return nil, status.Errorf(codes.NotFound, "volume %s not found", id)
	}
	src, ok := s.volumeAt(id, path)
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s is not staged or published at %s", id, path)
	}
	if bound, _, err := boundTo(path, src); err != nil || !bound {
		return nil, status.Errorf(codes.NotFound, "volume %s is not mounted at %s", id, path)
	}
	used, files, err := diskUsage(path)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "measure volume: %v", err)
	}
	total := s.nodeCapacity(id)
	fsTotal, fsAvail, inodes, freeInodes, err := fsStats(path)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "statfs: %v", err)
	}
	if total == 0 {
		total = fsTotal
	}
	avail := total - used
	if avail > fsAvail {
		avail = fsAvail
	}
	if avail < 0 {
		avail = 0
	}
	return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{
		{Unit: csi.VolumeUsage_BYTES, Total: total, Used: used, Available: avail},
		{Unit: csi.VolumeUsage_INODES, Total: inodes, Used: files, Available: freeInodes},
	}}, nil
}

// nodeCapacity is the size this node knows for a volume (0: unknown).
// Callers hold mu.
func (s *server) nodeCapacity(id string) int64 {
	if st, ok := s.st.Staged[id]; ok && st.ExpandedBytes > 0 {
		return st.ExpandedBytes
	}
	if v, ok := s.st.Volumes[id]; ok {
		return v.CapacityBytes
	}
	return 0
}

func (s *server) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	id, path := req.GetVolumeId(), req.GetVolumePath()
	switch {
	case id == "":
		return nil, invalid("volume ID is required")
	case path == "":
		return nil, invalid("volume path is required")
	}
	if c := req.GetVolumeCapability(); c != nil {
		if err := checkCapability(c); err != nil {
			return nil, toStatus(err)
		}
	}
	cr := req.GetCapacityRange()
	if cr.GetRequiredBytes() < 0 || cr.GetLimitBytes() < 0 {
		return nil, invalid("negative capacity range")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.volumeKnown(id) {
		return nil, status.Errorf(codes.NotFound, "volume %s not found", id)
	}
	if _, ok := s.volumeAt(id, path); !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s is not staged or published at %s", id, path)
	}
	size := cr.GetRequiredBytes()
	if size == 0 {
		size = cr.GetLimitBytes()
	}
	if size == 0 {
		size = s.nodeCapacity(id)
	}
	if v, ok := s.st.Volumes[id]; ok && size > v.CapacityBytes {
		return nil, status.Errorf(codes.OutOfRange, "volume %s has %d bytes; expand it on the controller first", id, v.CapacityBytes)
	}
	if st, ok := s.st.Staged[id]; ok && st.ExpandedBytes != size {
		st.ExpandedBytes = size
		if err := s.save(stagedKey(id)); err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
	}
	return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil
}

func (s *server) NodeGetVolumeHealth(ctx context.Context, req *csi.NodeGetVolumeHealthRequest) (*csi.NodeGetVolumeHealthResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, invalid("volume ID is required")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.volumeKnown(id) {
		return nil, status.Errorf(codes.NotFound, "volume %s not found", id)
	}
	h := &csi.VolumeHealth{VolumeId: id}
	for _, p := range []string{req.GetStagingTargetPath(), req.GetVolumePublishPath()} {
		if p == "" {
			continue
		}
		src, ok := s.volumeAt(id, p)
		bound := false
		if ok {
			bound, _, _ = boundTo(p, src)
		}
		if !bound {
			h.HealthStatuses = append(h.HealthStatuses, &csi.VolumeHealth_VolumeHealthEntry{
				Status:  csi.VolumeHealthErrorType_INACCESSIBLE,
				Reason:  "NotMounted",
				Message: "volume " + id + " is not mounted at " + p,
			})
		}
	}
	return &csi.NodeGetVolumeHealthResponse{VolumeHealth: h}, nil
}

func (s *server) NodeGetStorageHealth(context.Context, *csi.NodeGetStorageHealthRequest) (*csi.NodeGetStorageHealthResponse, error) {
	return &csi.NodeGetStorageHealthResponse{}, nil
}
