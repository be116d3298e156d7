package sampledriver

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"google.golang.org/protobuf/proto"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/protosanitizer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

// gracePeriod bounds how long Serve waits for calls in flight once its
// context is done before it cuts them off.
const gracePeriod = 5 * time.Second

// Driver is one instance of the sample CSI driver. Create it with New, serve
// it with Serve or Run, and Close it to release its StateDir.
type Driver struct {
	cfg   Config
	log   *slog.Logger
	inj   *injector
	calls callCounter

	volumesDir   string
	snapshotsDir string
	statePath    string
	store        *stateStore
	lock         *os.File

	mu sync.Mutex // guards st and every change on disk or to mounts
	st *state

	reqMu    sync.Mutex
	requests []*csi.CreateVolumeRequest // last CreateVolume requests, secrets stripped
}

// maxRecorded bounds the CreateVolume requests kept for inspection.
const maxRecorded = 1000

func (d *Driver) record(req *csi.CreateVolumeRequest) {
	cp := proto.Clone(req).(*csi.CreateVolumeRequest)
	cp.Secrets = nil
	d.reqMu.Lock()
	defer d.reqMu.Unlock()
	if len(d.requests) >= maxRecorded {
		d.requests = d.requests[1:]
	}
	d.requests = append(d.requests, cp)
}

// CreateVolumeRequests returns the last CreateVolume requests the driver
// received (at most 1000), without their secrets, oldest first.
func (d *Driver) CreateVolumeRequests() []*csi.CreateVolumeRequest {
	d.reqMu.Lock()
	defer d.reqMu.Unlock()
	return append([]*csi.CreateVolumeRequest(nil), d.requests...)
}

// New validates cfg, applies defaults, takes the StateDir lock and loads the
// state left there by a previous instance.
func New(cfg Config) (*Driver, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("sample driver config: %w", err)
	}
	cfg = cfg.withDefaults()
	dir, err := filepath.Abs(cfg.StateDir)
	if err != nil {
		return nil, fmt.Errorf("state dir: %w", err)
	}
	cfg.StateDir = dir
	d := &Driver{
		cfg:          cfg,
		log:          cfg.Logger.With("driver", cfg.Name, "node", cfg.NodeID),
		inj:          newInjector(cfg.Faults),
		volumesDir:   filepath.Join(dir, "volumes"),
		snapshotsDir: filepath.Join(dir, "snapshots"),
		statePath:    filepath.Join(dir, "state.json"),
	}
	for _, p := range []string{d.volumesDir, d.snapshotsDir} {
		if err := os.MkdirAll(p, 0o755); err != nil {
			return nil, fmt.Errorf("create %s: %w", p, err)
		}
	}
	if d.lock, err = lockDir(dir); err != nil {
		return nil, err
	}
	var torn int64
	if d.store, d.st, torn, err = openStateStore(d.statePath); err != nil {
		d.Close()
		return nil, err
	}
	if torn > 0 {
		d.log.Info("state journal: dropped a last change cut short by a stop (its call never returned)", "bytes", torn)
	}
	d.sweep()
	d.log.Info("sample driver state loaded", "state_dir", dir, "volumes", len(d.st.Volumes),
		"snapshots", len(d.st.Snapshots), "staged", len(d.st.Staged), "published", len(d.st.Published))
	return d, nil
}

// sweep removes what a crash left in the state directory: the directories
// of volumes and snapshots the state does not hold (made, or renamed to be
// deleted, just before the driver stopped) and temporary state files. The
// state is the truth: nothing it names is touched.
func (d *Driver) sweep() {
	remove := func(path, why string) {
		if err := os.RemoveAll(path); err != nil {
			d.log.Warn("state dir: cannot remove a leftover", "path", path, "why", why, "err", err)
			return
		}
		d.log.Info("state dir: removed a leftover", "path", path, "why", why)
	}
	for _, dir := range []struct {
		path  string
		known func(string) bool
	}{
		{d.volumesDir, func(id string) bool { _, ok := d.st.Volumes[id]; return ok }},
		{d.snapshotsDir, func(id string) bool { _, ok := d.st.Snapshots[id]; return ok }},
	} {
		entries, err := os.ReadDir(dir.path)
		if err != nil {
			continue
		}
		for _, e := range entries {
			if id, ok := strings.CutPrefix(e.Name(), ".deleted-"); ok && dir.known(id) {
				// Renamed for deletion, but the state still holds the
				// volume (the crash came before the state was saved):
				// the volume is not deleted, so its data goes back.
				if err := os.Rename(filepath.Join(dir.path, e.Name()), filepath.Join(dir.path, id)); err != nil {
					d.log.Warn("state dir: cannot restore a volume renamed for deletion", "volume_id", id, "err", err)
				} else {
					d.log.Info("state dir: restored a volume whose deletion was not saved", "volume_id", id)
				}
				continue
			}
			if !dir.known(e.Name()) {
				remove(filepath.Join(dir.path, e.Name()), "not in the state (a crash between making or deleting it and saving the state)")
			}
		}
	}
	if tmps, err := filepath.Glob(filepath.Join(filepath.Dir(d.statePath), "."+filepath.Base(d.statePath)+".*.tmp")); err == nil {
		for _, p := range tmps {
			remove(p, "an unfinished state write")
		}
	}
	if journals, err := filepath.Glob(strings.TrimSuffix(d.statePath, ".json") + ".*.journal"); err == nil {
		for _, p := range journals {
			if p != d.store.journal.Name() {
				remove(p, "a state journal the state no longer names")
			}
		}
	}
}

// Close releases the StateDir lock. Mounts stay (see UnmountAll).
func (d *Driver) Close() error {
	d.mu.Lock()
	serr := d.store.close()
	d.mu.Unlock()
	if d.lock == nil {
		return serr
	}
	err := d.lock.Close()
	d.lock = nil
	return errors.Join(serr, err)
}

// Config returns the effective configuration (with defaults applied).
func (d *Driver) Config() Config { return d.cfg }

// Serve serves CSI on lis until ctx is done, then stops gracefully (calls in
// flight get gracePeriod to finish). It returns nil after a stop caused by
// ctx, or the listener's error.
func (d *Driver) Serve(ctx context.Context, lis net.Listener) error {
	srv := grpc.NewServer(append([]grpc.ServerOption{grpc.ChainUnaryInterceptor(d.logInterceptor, d.faultInterceptor)}, d.cfg.ServerOptions...)...)
	s := &server{Driver: d}
	csi.RegisterIdentityServer(srv, s)
	csi.RegisterControllerServer(srv, s)
	csi.RegisterNodeServer(srv, s)
	if !d.cfg.DisableGroupSnapshots {
		csi.RegisterGroupControllerServer(srv, &groupServer{server: s})
	}

	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(lis) }()
	d.log.Info("serving CSI", "address", lis.Addr().String())
	select {
	case err := <-errc:
		return fmt.Errorf("serve CSI: %w", err)
	case <-ctx.Done():
	}
	stopped := make(chan struct{})
	go func() {
		srv.GracefulStop()
		close(stopped)
	}()
	t := time.NewTimer(gracePeriod)
	defer t.Stop()
	select {
	case <-stopped:
	case <-t.C:
		d.log.Warn("calls still in flight after grace period; stopping hard")
		srv.Stop()
		<-stopped
	}
	<-errc
	d.log.Info("stopped serving CSI")
	return nil
}

// Run listens on Config.Endpoint (removing a stale socket file first) and
// serves until ctx is done.
func (d *Driver) Run(ctx context.Context) error {
	if d.cfg.Endpoint == "" {
		return errors.New("sample driver: no endpoint configured")
	}
	path, err := SocketPath(d.cfg.Endpoint)
	if err != nil {
		return err
	}
	if err := removeStaleSocket(path); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("create socket dir: %w", err)
	}
	lis, err := net.Listen("unix", path)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", path, err)
	}
	defer os.Remove(path)
	return d.Serve(ctx, lis)
}

func removeStaleSocket(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.Mode()&os.ModeSocket == 0 {
		return fmt.Errorf("endpoint %s exists and is not a socket", path)
	}
	if err := os.Remove(path); err != nil {
		return fmt.Errorf("remove stale socket: %w", err)
	}
	return nil
}

// logInterceptor logs every call through protosanitizer, never raw.
func (d *Driver) logInterceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	start := time.Now()
	method := shortMethod(info.FullMethod)
	if d.log.Enabled(ctx, slog.LevelDebug) {
		d.log.Debug("csi request", "method", method, "request", protosanitizer.StripSecrets(req).String())
	}
	resp, err := handler(ctx, req)
	if err != nil {
		st := status.Convert(err)
		d.log.Info("csi call failed", "method", method, "code", st.Code().String(), "error", st.Message(), "duration", time.Since(start))
	} else if d.log.Enabled(ctx, slog.LevelDebug-4) {
		d.log.Log(ctx, slog.LevelDebug-4, "csi response", "method", method, "response", protosanitizer.StripSecrets(resp).String(), "duration", time.Since(start))
	}
	return resp, err
}

// save persists the entries of d.st named by keys (all of it if none)
// before the call that changed them returns; on failure it reloads the
// last durable state so memory never runs ahead of disk. Callers hold d.mu.
func (d *Driver) save(keys ...stateKey) error {
	var err error
	if len(keys) == 0 || d.store.unsure {
		err = d.store.writeAll(d.st)
	} else if err = d.store.appendChanges(d.st, keys); err == nil && d.store.wantsRewrite() {
		// The change is saved in the journal; folding it into a new
		// snapshot can fail without failing the call.
		if werr := d.store.writeAll(d.st); werr != nil {
			d.log.Warn("state journal not folded into a new snapshot", "err", werr)
		}
	}
	if errors.Is(err, errRenamedNotSynced) {
		// In place (a restart reads it): the call's work stands, and
		// undoing it would leave the state naming what is gone.
		d.log.Warn("state saved, but not yet durable", "err", err)
		return nil
	}
	if err != nil {
		if st, _, _, lerr := readState(d.statePath, d.store.size); lerr == nil {
			d.st = st
		}
		return fmt.Errorf("save state: %w", err)
	}
	return nil
}

func (d *Driver) volumeDir(id string) string   { return filepath.Join(d.volumesDir, id) }
func (d *Driver) snapshotDir(id string) string { return filepath.Join(d.snapshotsDir, id) }

func newID(prefix string) string {
	b := make([]byte, 8)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return prefix + hex.EncodeToString(b)
}

// VolumeInfo describes a volume of this driver's controller side.
type VolumeInfo struct {
	ID                string
	Name              string
	CapacityBytes     int64
	Path              string // the volume directory
	Parameters        map[string]string
	MutableParameters map[string]string
	Topology          map[string]string
	SourceVolumeID    string
	SourceSnapshotID  string
	PublishedNodes    []string // sorted node IDs from ControllerPublishVolume
	Created           time.Time
}

// Volumes returns the driver's volumes sorted by ID, e.g. to check that none
// leaked.
func (d *Driver) Volumes() []VolumeInfo {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]VolumeInfo, 0, len(d.st.Volumes))
	for _, v := range d.st.Volumes {
		out = append(out, VolumeInfo{
			ID:                v.ID,
			Name:              v.Name,
			CapacityBytes:     v.CapacityBytes,
			Path:              d.volumeDir(v.ID),
			Parameters:        cloneMap(v.Parameters),
			MutableParameters: cloneMap(v.MutableParameters),
			Topology:          cloneMap(v.Topology),
			SourceVolumeID:    v.SourceVolumeID,
			SourceSnapshotID:  v.SourceSnapshotID,
			PublishedNodes:    sortedKeys(v.Attachments),
			Created:           v.Created,
		})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// SnapshotInfo describes a snapshot.
type SnapshotInfo struct {
	ID             string
	Name           string // empty for a member of a group snapshot
	SourceVolumeID string
	SizeBytes      int64
	Path           string
	Created        time.Time
	GroupID        string // the group snapshot it belongs to, if any
}

// Snapshots returns the driver's snapshots sorted by ID.
func (d *Driver) Snapshots() []SnapshotInfo {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]SnapshotInfo, 0, len(d.st.Snapshots))
	for _, s := range d.st.Snapshots {
		out = append(out, SnapshotInfo{ID: s.ID, Name: s.Name, SourceVolumeID: s.SourceVolumeID,
			SizeBytes: s.SizeBytes, Path: d.snapshotDir(s.ID), Created: s.Created, GroupID: s.GroupID})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// GroupSnapshotInfo describes a group snapshot.
type GroupSnapshotInfo struct {
	ID          string
	Name        string
	SnapshotIDs []string // its members, in source volume order
	Created     time.Time
}

// GroupSnapshots returns the driver's group snapshots sorted by ID.
func (d *Driver) GroupSnapshots() []GroupSnapshotInfo {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]GroupSnapshotInfo, 0, len(d.st.Groups))
	for _, g := range d.st.Groups {
		out = append(out, GroupSnapshotInfo{ID: g.ID, Name: g.Name, SnapshotIDs: slices.Clone(g.SnapshotIDs), Created: g.Created})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// Mount kinds in NodeMount.
const (
	MountStage   = "stage"
	MountPublish = "publish"
)

// NodeMount is a bind mount this driver's node side made.
type NodeMount struct {
	VolumeID string
	Kind     string // MountStage or MountPublish
	Path     string // staging or target path
	Readonly bool
}

// NodeMounts returns this node's stage and publish mounts, sorted by path.
func (d *Driver) NodeMounts() []NodeMount {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []NodeMount
	for _, s := range d.st.Staged {
		out = append(out, NodeMount{VolumeID: s.VolumeID, Kind: MountStage, Path: s.Path})
	}
	for _, p := range d.st.Published {
		out = append(out, NodeMount{VolumeID: p.VolumeID, Kind: MountPublish, Path: p.TargetPath, Readonly: p.Readonly})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Path < out[j].Path })
	return out
}

// UnmountAll undoes every publish and stage mount this node recorded (and
// removes the targets it created), as a node drain would. Tests use it to
// clean up after a CO that did not.
func (d *Driver) UnmountAll() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	var errs []error
	for t := range d.st.Published {
		if err := unmount(t); err != nil {
			errs = append(errs, err)
			continue
		}
		if err := os.Remove(t); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
		delete(d.st.Published, t)
	}
	for id, s := range d.st.Staged {
		if err := unmount(s.Path); err != nil {
			errs = append(errs, err)
			continue
		}
		delete(d.st.Staged, id)
	}
	if err := d.save(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Calls returns the number of calls received per CSI method name
// ("CreateVolume", ...), including calls that failed or were faulted.
func (d *Driver) Calls() map[string]int64 { return d.calls.snapshot() }

// CallCount returns the number of calls received for one method.
func (d *Driver) CallCount(method string) int64 { return d.calls.get(method) }

// CallTimes returns when each of the last (at most 1000) calls of method
// reached the driver, before any injected latency or fault, oldest first;
// failed and faulted calls included. With fewer than 1000 calls, the i-th
// time is that of the call CallCount counted as i+1.
func (d *Driver) CallTimes(method string) []time.Time { return d.calls.arrivals(method) }

func sortedKeys[V any](m map[string]V) []string {
	if len(m) == 0 {
		return nil
	}
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// server implements the CSI services on top of a Driver.
type server struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer
	csi.UnimplementedNodeServer
	*Driver
}
