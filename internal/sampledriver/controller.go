package sampledriver

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"

	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// Keys of the contexts the driver returns.
const (
	// VolumeContextPath is the volume directory, in the volume context.
	VolumeContextPath = "path"
	// PublishContextDevicePath is the volume directory, in the publish
	// context of ControllerPublishVolume.
	PublishContextDevicePath = "devicePath"
	// PublishContextReadonly is "true" in the publish context of a
	// read-only ControllerPublishVolume: the node then publishes the
	// volume read-only, whatever NodePublishVolume asks.
	PublishContextReadonly = "readonly"
)

// toStatus maps the pure checks' sentinel errors to gRPC codes; anything
// else is Internal.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	switch {
	case errors.Is(err, errInvalid):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, errOutOfRange):
		return status.Error(codes.OutOfRange, err.Error())
	case errors.Is(err, errBadToken):
		return status.Error(codes.Aborted, err.Error())
	default:
		return status.Error(codes.Internal, err.Error())
	}
}

func invalid(format string, args ...any) error {
	return status.Errorf(codes.InvalidArgument, format, args...)
}

func (s *server) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	types := []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
		csi.ControllerServiceCapability_RPC_GET_CAPACITY,
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
		csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
		csi.ControllerServiceCapability_RPC_GET_SNAPSHOT,
		csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
		csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
		csi.ControllerServiceCapability_RPC_GET_VOLUME,
		csi.ControllerServiceCapability_RPC_MODIFY_VOLUME,
		csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
		csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH,
		csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH,
	}
	if !s.cfg.DisablePublish {
		types = append(types,
			csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME,
			csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES)
		if !s.cfg.NoPublishReadonly {
			types = append(types, csi.ControllerServiceCapability_RPC_PUBLISH_READONLY)
		}
	}
	caps := make([]*csi.ControllerServiceCapability, len(types))
	for i, t := range types {
		caps[i] = &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{
			Rpc: &csi.ControllerServiceCapability_RPC{Type: t},
		}}
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: caps}, nil
}

// csiVolume renders a volume for responses.
func (s *server) csiVolume(v *volume) *csi.Volume {
	out := &csi.Volume{
		VolumeId:      v.ID,
		CapacityBytes: v.CapacityBytes,
		VolumeContext: map[string]string{VolumeContextPath: s.volumeDir(v.ID)},
	}
	switch {
	case v.SourceVolumeID != "":
		out.ContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
			Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: v.SourceVolumeID},
		}}
	case v.SourceSnapshotID != "":
		out.ContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: v.SourceSnapshotID},
		}}
	}
	if len(v.Topology) > 0 {
		out.AccessibleTopology = []*csi.Topology{{Segments: cloneMap(v.Topology)}}
	}
	return out
}

// usedBytes sums the volumes' capacities. Callers hold mu.
func (s *server) usedBytes() int64 {
	var used int64
	for _, v := range s.st.Volumes {
		used += v.CapacityBytes
	}
	return used
}

// contentSource resolves a CreateVolume content source to a directory to
// copy and its size. Callers hold mu.
func (s *server) contentSource(src *csi.VolumeContentSource) (dir string, size int64, volID, snapID string, err error) {
	switch t := src.GetType().(type) {
	case nil:
		if src != nil {
			return "", 0, "", "", invalid("volume content source has no type")
		}
		return "", 0, "", "", nil
	case *csi.VolumeContentSource_Volume:
		id := t.Volume.GetVolumeId()
		if id == "" {
			return "", 0, "", "", invalid("volume content source: volume ID is required")
		}
		v, ok := s.st.Volumes[id]
		if !ok {
			return "", 0, "", "", status.Errorf(codes.NotFound, "source volume %s not found", id)
		}
		return s.volumeDir(id), v.CapacityBytes, id, "", nil
	case *csi.VolumeContentSource_Snapshot:
		id := t.Snapshot.GetSnapshotId()
		if id == "" {
			return "", 0, "", "", invalid("volume content source: snapshot ID is required")
		}
		sn, ok := s.st.Snapshots[id]
		if !ok {
			return "", 0, "", "", status.Errorf(codes.NotFound, "source snapshot %s not found", id)
		}
		return s.snapshotDir(id), sn.SizeBytes, "", id, nil
	default:
		return "", 0, "", "", invalid("unsupported volume content source %T", t)
	}
}

func (s *server) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	s.record(req)
	if req.GetName() == "" {
		return nil, invalid("name is required")
	}
	if err := checkCapabilities(req.GetVolumeCapabilities()); err != nil {
		return nil, toStatus(err)
	}
	if err := checkMutableParameters(req.GetMutableParameters()); err != nil {
		return nil, toStatus(err)
	}
	if err := checkParameters(req.GetParameters()); err != nil {
		return nil, toStatus(err)
	}
	if _, err := pickSize(req.GetCapacityRange(), 0); err != nil {
		return nil, toStatus(err)
	}
	segments := s.segments()
	if req.GetAccessibilityRequirements() != nil && len(segments) == 0 {
		return nil, invalid("accessibility_requirements set, but this plugin does not advertise VOLUME_ACCESSIBILITY_CONSTRAINTS")
	}
	placed, ok := pickSegment(segments, req.GetAccessibilityRequirements())

	s.mu.Lock()
	defer s.mu.Unlock()

	// A volume of this name is looked up before its source: a retry must
	// get the volume even if the source was deleted since it was made.
	cs := req.GetVolumeContentSource()
	srcVol, srcSnap := cs.GetVolume().GetVolumeId(), cs.GetSnapshot().GetSnapshotId()
	if cs != nil && srcVol == "" && srcSnap == "" {
		_, _, _, _, err := s.contentSource(cs) // malformed: its error
		return nil, err
	}
	for _, v := range s.st.Volumes {
		if v.Name != req.GetName() {
			continue
		}
		switch {
		case !sizeFits(v.CapacityBytes, req.GetCapacityRange()):
			return nil, status.Errorf(codes.AlreadyExists, "volume %q exists with %d bytes, outside the requested range", v.Name, v.CapacityBytes)
		case !mapsEqual(v.Parameters, req.GetParameters()):
			return nil, status.Errorf(codes.AlreadyExists, "volume %q exists with other parameters", v.Name)
		case !mapsEqual(v.MutableParameters, userMutable(req.GetMutableParameters())):
			return nil, status.Errorf(codes.AlreadyExists, "volume %q exists with other mutable parameters", v.Name)
		case v.SourceVolumeID != srcVol || v.SourceSnapshotID != srcSnap:
			return nil, status.Errorf(codes.AlreadyExists, "volume %q exists with another content source", v.Name)
		case len(v.Topology) > 0 && !topologyAllows(v.Topology, req.GetAccessibilityRequirements()):
			// The spec: OK only for a volume accessible from the
			// requirements; AlreadyExists for one incompatible with them.
			return nil, status.Errorf(codes.AlreadyExists, "volume %q exists in %s, outside the requisite topologies", v.Name, FormatTopology(v.Topology))
		}
		return &csi.CreateVolumeResponse{Volume: s.csiVolume(v)}, nil
	}
	if !ok {
		// After the lookup by name: a retry of a volume made gets it (or
		// AlreadyExists), not ResourceExhausted.
		var served []string
		for _, seg := range segments {
			served = append(served, FormatTopology(seg))
		}
		return nil, status.Errorf(codes.ResourceExhausted, "cannot provision in the requisite topologies: this driver serves %s", strings.Join(served, "; "))
	}
	srcDir, srcSize, _, _, err := s.contentSource(cs)
	if err != nil {
		return nil, err
	}

	size, err := pickSize(req.GetCapacityRange(), srcSize)
	if err != nil {
		return nil, toStatus(err)
	}
	if size > s.cfg.CapacityBytes {
		return nil, status.Errorf(codes.OutOfRange, "size %d exceeds the pool's %d bytes", size, s.cfg.CapacityBytes)
	}
	if free := s.cfg.CapacityBytes - s.usedBytes(); size > free {
		return nil, status.Errorf(codes.ResourceExhausted, "insufficient capacity: %d bytes requested, %d free", size, free)
	}

	v := &volume{
		ID:                newID("sv-"),
		Name:              req.GetName(),
		CapacityBytes:     size,
		Parameters:        cloneMap(req.GetParameters()),
		MutableParameters: userMutable(req.GetMutableParameters()),
		Topology:          cloneMap(placed),
		SourceVolumeID:    srcVol,
		SourceSnapshotID:  srcSnap,
		Created:           time.Now().UTC(),
	}
	dir := s.volumeDir(v.ID)
	if srcDir != "" {
		err = copyTree(srcDir, dir)
	} else {
		err = os.Mkdir(dir, 0o755)
	}
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, status.Errorf(codes.Internal, "create volume directory: %v", err)
	}
	s.st.Volumes[v.ID] = v
	if err := s.save(volumeKey(v.ID)); err != nil {
		_ = os.RemoveAll(dir)
		return nil, status.Error(codes.Internal, err.Error())
	}
	s.log.Info("volume created", "volume_id", v.ID, "name", v.Name, "bytes", size)
	return &csi.CreateVolumeResponse{Volume: s.csiVolume(v)}, nil
}

func (s *server) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, invalid("volume ID is required")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.st.Volumes[id]
	if !ok {
		return &csi.DeleteVolumeResponse{}, nil
	}
	if len(v.Attachments) > 0 {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is still published to nodes %v", id, sortedKeys(v.Attachments))
	}
	if st, ok := s.st.Staged[id]; ok {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is still staged at %s", id, st.Path)
	}
	// Rename first so a crash never leaves a half-deleted directory under
	// a live volume ID.
	dir := s.volumeDir(id)
	trash := filepath.Join(s.volumesDir, ".deleted-"+id)
	if err := os.Rename(dir, trash); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, status.Errorf(codes.Internal, "delete volume directory: %v", err)
	}
	delete(s.st.Volumes, id)
	if err := s.save(volumeKey(id)); err != nil {
		_ = os.Rename(trash, dir)
		return nil, status.Error(codes.Internal, err.Error())
	}
	if err := os.RemoveAll(trash); err != nil {
		s.log.Warn("remove deleted volume directory", "path", trash, "error", err)
	}
	s.log.Info("volume deleted", "volume_id", id, "name", v.Name)
	return &csi.DeleteVolumeResponse{}, nil
}

// nodeKnown reports whether ControllerPublishVolume accepts node.
func (s *server) nodeKnown(node string) bool {
	if node == s.cfg.NodeID {
		return true
	}
	for _, n := range s.cfg.Nodes {
		if n == node || n == AllMethods {
			return true
		}
	}
	return false
}

func (s *server) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	if s.cfg.DisablePublish {
		return nil, status.Error(codes.Unimplemented, "ControllerPublishVolume is disabled")
	}
	if s.cfg.NoPublishReadonly && req.GetReadonly() {
		return nil, status.Error(codes.InvalidArgument, "readonly publish asked of a driver without PUBLISH_READONLY")
	}
	id, node := req.GetVolumeId(), req.GetNodeId()
	switch {
	case id == "":
		return nil, invalid("volume ID is required")
	case node == "":
		return nil, invalid("node ID is required")
	case req.GetVolumeCapability() == nil:
		return nil, invalid("volume capability is required")
	}
	if err := checkCapability(req.GetVolumeCapability()); err != nil {
		return nil, toStatus(err)
	}
	mode := req.GetVolumeCapability().GetAccessMode().GetMode()

	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.st.Volumes[id]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s not found", id)
	}
	if !s.nodeKnown(node) {
		return nil, status.Errorf(codes.NotFound, "node %s not found", node)
	}
	if a, ok := v.Attachments[node]; ok {
		if a.Readonly != req.GetReadonly() || a.AccessMode != int32(mode) {
			return nil, status.Errorf(codes.AlreadyExists, "volume %s is published to node %s with readonly=%v, access mode %s",
				id, node, a.Readonly, csi.VolumeCapability_AccessMode_Mode(a.AccessMode))
		}
		return &csi.ControllerPublishVolumeResponse{PublishContext: cloneMap(a.PublishContext)}, nil
	}
	for other, a := range v.Attachments {
		om := csi.VolumeCapability_AccessMode_Mode(a.AccessMode)
		if singleNode(mode) || singleNode(om) {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s is published to node %s and its access mode allows a single node", id, other)
		}
		if (mode == csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER || om == csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER) &&
			!req.GetReadonly() && !a.Readonly {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s is published writable to node %s and allows a single writer", id, other)
		}
	}
	if max := s.cfg.MaxVolumesPerNode; max > 0 {
		var n int64
		for _, ov := range s.st.Volumes {
			if _, ok := ov.Attachments[node]; ok {
				n++
			}
		}
		if n >= max {
			return nil, status.Errorf(codes.ResourceExhausted, "node %s has the maximum of %d volumes published", node, max)
		}
	}
	a := &attachment{
		Readonly:       req.GetReadonly(),
		AccessMode:     int32(mode),
		PublishContext: map[string]string{PublishContextDevicePath: s.volumeDir(id)},
	}
	if req.GetReadonly() {
		a.PublishContext[PublishContextReadonly] = "true"
	}
	if v.Attachments == nil {
		v.Attachments = map[string]*attachment{}
	}
	v.Attachments[node] = a
	if err := s.save(volumeKey(id)); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	s.log.Info("volume published", "volume_id", id, "node_id", node, "readonly", a.Readonly)
	return &csi.ControllerPublishVolumeResponse{PublishContext: cloneMap(a.PublishContext)}, nil
}

func (s *server) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	if s.cfg.DisablePublish {
		return nil, status.Error(codes.Unimplemented, "ControllerUnpublishVolume is disabled")
	}
	id, node := req.GetVolumeId(), req.GetNodeId()
	if id == "" {
		return nil, invalid("volume ID is required")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.st.Volumes[id]
	if !ok || len(v.Attachments) == 0 {
		// Spec: a volume or node that is gone counts as unpublished.
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	if node == "" {
		v.Attachments = nil
	} else {
		if _, ok := v.Attachments[node]; !ok {
			return &csi.ControllerUnpublishVolumeResponse{}, nil
		}
		delete(v.Attachments, node)
	}
	if err := s.save(volumeKey(id)); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	s.log.Info("volume unpublished", "volume_id", id, "node_id", node)
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}

func (s *server) ValidateVolumeCapabilities(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, invalid("volume ID is required")
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, invalid("volume capabilities are required")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.st.Volumes[id]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s not found", id)
	}
	unconfirmed := func(msg string) (*csi.ValidateVolumeCapabilitiesResponse, error) {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: msg}, nil
	}
	for _, c := range req.GetVolumeCapabilities() {
		if err := checkCapability(c); err != nil {
			return unconfirmed(err.Error())
		}
	}
	if req.GetParameters() != nil && !mapsEqual(req.GetParameters(), v.Parameters) {
		return unconfirmed("parameters differ from the volume's")
	}
	if req.GetMutableParameters() != nil && !mapsEqual(userMutable(req.GetMutableParameters()), v.MutableParameters) {
		return unconfirmed("mutable parameters differ from the volume's")
	}
	if req.GetVolumeContext() != nil && !mapsEqual(req.GetVolumeContext(), s.csiVolume(v).GetVolumeContext()) {
		return unconfirmed("volume context differs from the volume's")
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeContext:      req.GetVolumeContext(),
		VolumeCapabilities: req.GetVolumeCapabilities(),
		Parameters:         req.GetParameters(),
		MutableParameters:  req.GetMutableParameters(),
	}}, nil
}

// sortedVolumeIDs returns the volume IDs in order. Callers hold mu.
func (s *server) sortedVolumeIDs() []string {
	return sortedKeys(s.st.Volumes)
}

func (s *server) ListVolumes(ctx context.Context, req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ids, next, err := page(s.sortedVolumeIDs(), req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, toStatus(err)
	}
	resp := &csi.ListVolumesResponse{NextToken: next}
	for _, id := range ids {
		v := s.st.Volumes[id]
		e := &csi.ListVolumesResponse_Entry{Volume: s.csiVolume(v)}
		if !s.cfg.DisablePublish {
			e.Status = &csi.ListVolumesResponse_VolumeStatus{PublishedNodeIds: sortedKeys(v.Attachments)}
		}
		resp.Entries = append(resp.Entries, e)
	}
	return resp, nil
}

func (s *server) ControllerGetVolume(ctx context.Context, req *csi.ControllerGetVolumeRequest) (*csi.ControllerGetVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, invalid("volume ID is required")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.st.Volumes[id]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s not found", id)
	}
	return &csi.ControllerGetVolumeResponse{
		Volume: s.csiVolume(v),
		Status: &csi.ControllerGetVolumeResponse_VolumeStatus{PublishedNodeIds: sortedKeys(v.Attachments)},
	}, nil
}

// segments are the topology segments volumes are made in: the controller
// segments, or the node's topology, or none.
func (s *server) segments() []map[string]string {
	if len(s.cfg.ControllerSegments) > 0 {
		return s.cfg.ControllerSegments
	}
	if len(s.cfg.Topology) > 0 {
		return []map[string]string{s.cfg.Topology}
	}
	return nil
}

func (s *server) GetCapacity(ctx context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	for _, c := range req.GetVolumeCapabilities() {
		if checkCapability(c) != nil {
			return &csi.GetCapacityResponse{}, nil // nothing can be provisioned with it
		}
	}
	if t := req.GetAccessibleTopology(); t != nil {
		segments := s.segments()
		if len(segments) == 0 {
			// The spec: not set unless the plugin advertises it.
			return nil, invalid("accessible_topology set, but this plugin does not advertise VOLUME_ACCESSIBILITY_CONSTRAINTS")
		}
		if !slices.ContainsFunc(segments, func(seg map[string]string) bool { return topologyMatches(seg, t) }) {
			return &csi.GetCapacityResponse{}, nil // not a segment this driver serves
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	free := s.cfg.CapacityBytes - s.usedBytes()
	if free < 0 {
		free = 0
	}
	return &csi.GetCapacityResponse{AvailableCapacity: free, MaximumVolumeSize: wrapperspb.Int64(free)}, nil
}

func (s *server) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	id := req.GetVolumeId()
	switch {
	case id == "":
		return nil, invalid("volume ID is required")
	case req.GetCapacityRange() == nil:
		return nil, invalid("capacity range is required")
	}
	if c := req.GetVolumeCapability(); c != nil {
		if err := checkCapability(c); err != nil {
			return nil, toStatus(err)
		}
	}
	cr := req.GetCapacityRange()
	want, lim := cr.GetRequiredBytes(), cr.GetLimitBytes()
	if want < 0 || lim < 0 || (lim > 0 && want > lim) {
		return nil, invalid("bad capacity range: required %d, limit %d", want, lim)
	}
	if want == 0 {
		want = lim
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.st.Volumes[id]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s not found", id)
	}
	if lim > 0 && v.CapacityBytes > lim {
		return nil, status.Errorf(codes.OutOfRange, "volume %s has %d bytes, above the limit %d: shrinking is not supported", id, v.CapacityBytes, lim)
	}
	if want <= v.CapacityBytes {
		return &csi.ControllerExpandVolumeResponse{CapacityBytes: v.CapacityBytes, NodeExpansionRequired: true}, nil
	}
	if free := s.cfg.CapacityBytes - s.usedBytes(); want-v.CapacityBytes > free {
		return nil, status.Errorf(codes.ResourceExhausted, "insufficient capacity: %d more bytes requested, %d free", want-v.CapacityBytes, free)
	}
	old := v.CapacityBytes
	v.CapacityBytes = want
	if err := s.save(volumeKey(id)); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	s.log.Info("volume expanded", "volume_id", id, "from_bytes", old, "to_bytes", want)
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: want, NodeExpansionRequired: true}, nil
}

func (s *server) ControllerModifyVolume(ctx context.Context, req *csi.ControllerModifyVolumeRequest) (*csi.ControllerModifyVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, invalid("volume ID is required")
	}
	if err := checkMutableParameters(req.GetMutableParameters()); err != nil {
		return nil, toStatus(err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.st.Volumes[id]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s not found", id)
	}
	if len(req.GetMutableParameters()) == 0 {
		return &csi.ControllerModifyVolumeResponse{}, nil
	}
	if v.MutableParameters == nil {
		v.MutableParameters = map[string]string{}
	}
	for k, val := range userMutable(req.GetMutableParameters()) {
		v.MutableParameters[k] = val
	}
	if err := s.save(volumeKey(id)); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.ControllerModifyVolumeResponse{}, nil
}

// volumeHealth reports a volume whose directory is gone as inaccessible.
// Callers hold mu.
func (s *server) volumeHealth(id string) *csi.VolumeHealth {
	h := &csi.VolumeHealth{VolumeId: id}
	if fi, err := os.Stat(s.volumeDir(id)); err != nil || !fi.IsDir() {
		h.HealthStatuses = append(h.HealthStatuses, &csi.VolumeHealth_VolumeHealthEntry{
			Status:  csi.VolumeHealthErrorType_INACCESSIBLE,
			Reason:  "DirectoryMissing",
			Message: fmt.Sprintf("volume directory %s is missing", s.volumeDir(id)),
		})
	}
	return h
}

func (s *server) ControllerGetVolumeHealth(ctx context.Context, req *csi.ControllerGetVolumeHealthRequest) (*csi.ControllerGetVolumeHealthResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, invalid("volume ID is required")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.st.Volumes[id]; !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s not found", id)
	}
	return &csi.ControllerGetVolumeHealthResponse{VolumeHealth: s.volumeHealth(id)}, nil
}

func (s *server) ControllerListVolumeHealth(ctx context.Context, req *csi.ControllerListVolumeHealthRequest) (*csi.ControllerListVolumeHealthResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var abnormal []string
	health := map[string]*csi.VolumeHealth{}
	for _, id := range s.sortedVolumeIDs() {
		if h := s.volumeHealth(id); len(h.HealthStatuses) > 0 {
			abnormal = append(abnormal, id)
			health[id] = h
		}
	}
	ids, next, err := page(abnormal, req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, toStatus(err)
	}
	resp := &csi.ControllerListVolumeHealthResponse{NextToken: next}
	for _, id := range ids {
		resp.Entries = append(resp.Entries, health[id])
	}
	return resp, nil
}
