package sampledriver

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"

	"github.com/csibroker/csibroker/internal/csiname"
)

// Defaults applied by New to zero-valued Config fields.
const (
	DefaultName          = "sample.csibroker.io"
	DefaultVersion       = "0.1.0"
	DefaultCapacityBytes = int64(1) << 40 // 1 TiB
	// DefaultVolumeSize is the size of a volume created without a capacity
	// range (or with only a limit above it).
	DefaultVolumeSize = int64(1) << 30 // 1 GiB
)

// Config configures a Driver. Zero values take the defaults above; NodeID and
// StateDir are required.
type Config struct {
	// Name is the CSI driver name returned by GetPluginInfo.
	Name string
	// NodeID is this instance's node ID (NodeGetInfo) and a node that
	// ControllerPublishVolume accepts.
	NodeID string
	// StateDir holds state.json, its journal, and the volume and snapshot
	// directories.
	StateDir string
	// Endpoint is where Run listens: unix:///path or unix:/path (or a
	// plain absolute path). Serve ignores it.
	Endpoint string
	// Version is the vendor version returned by GetPluginInfo.
	Version string
	// Topology is this instance's accessible segment, e.g.
	// {"topology.kubernetes.io/zone": "z1"}. When set, the driver
	// advertises VOLUME_ACCESSIBILITY_CONSTRAINTS, volumes are accessible
	// from this segment only and CreateVolume fails with ResourceExhausted
	// when the requisite topologies exclude it.
	Topology map[string]string
	// ControllerSegments are the segments the controller can place volumes
	// in (a multi-zone storage system). CreateVolume picks the first
	// preferred one, then the first requisite one. Empty: Topology only.
	ControllerSegments []map[string]string
	// CapacityBytes is the total pool; GetCapacity reports what is free.
	CapacityBytes int64
	// MaxVolumesPerNode is reported by NodeGetInfo and enforced by
	// ControllerPublishVolume per node (0: no limit).
	MaxVolumesPerNode int64
	// Nodes lists node IDs, besides NodeID, that ControllerPublishVolume
	// accepts (the node instances of a multi-instance setup). "*" accepts
	// any node ID; otherwise an unknown node is NotFound.
	Nodes []string
	// Faults are injected by a server interceptor.
	Faults Faults
	// DisablePublish removes the PUBLISH_UNPUBLISH_VOLUME capability
	// (no attach step), for "trivial attach" tests.
	DisablePublish bool
	// NoPublishReadonly removes the PUBLISH_READONLY capability: a
	// read-only ControllerPublishVolume is then InvalidArgument, as a
	// strict driver answers it.
	NoPublishReadonly bool
	// SnapshotReadyAfter is how long a new snapshot (or group snapshot)
	// reports ready_to_use=false after it is cut, as a driver that uploads
	// its snapshots does; CreateSnapshot asked again with the same name and
	// source returns it with its readiness of the moment. 0: ready at once.
	SnapshotReadyAfter time.Duration
	// DisableGroupSnapshots leaves out the GroupController service (and
	// the GROUP_CONTROLLER_SERVICE plugin capability).
	DisableGroupSnapshots bool
	// Logger receives lifecycle messages at Info and sanitized requests at
	// Debug (responses at Debug-4). Nil discards.
	Logger *slog.Logger
	// ServerOptions are added to the CSI server's own (an OpenTelemetry
	// stats handler, so the driver's spans join its callers' traces).
	ServerOptions []grpc.ServerOption
}

// csiNameRE is the driver name format csi-sanity checks, which is stricter
// than the CSI spec's (csiname) in one way: letters at both ends.
var csiNameRE = regexp.MustCompile(`^[a-zA-Z][A-Za-z0-9-._]{0,61}[a-zA-Z]$`)

// Validate reports the first problem with c, treating zero values that have
// a default as valid.
func (c Config) Validate() error {
	var errs []error
	if c.Name != "" {
		if err := csiname.Check(c.Name); err != nil {
			errs = append(errs, err)
		} else if !csiNameRE.MatchString(c.Name) {
			errs = append(errs, fmt.Errorf("driver name %q: must be at least 2 characters and begin and end with a letter (csi-sanity checks that)", c.Name))
		}
	}
	if c.NodeID == "" {
		errs = append(errs, errors.New("node ID is required"))
	} else if len(c.NodeID) > 256 {
		errs = append(errs, errors.New("node ID is longer than 256 bytes"))
	}
	if c.StateDir == "" {
		errs = append(errs, errors.New("state dir is required"))
	}
	if c.Endpoint != "" {
		if _, err := SocketPath(c.Endpoint); err != nil {
			errs = append(errs, err)
		}
	}
	for k, v := range c.Topology {
		if k == "" || strings.ContainsAny(k, "=, ") || strings.ContainsAny(v, "=, ") {
			errs = append(errs, fmt.Errorf("topology %q=%q: keys must be non-empty and neither keys nor values may contain '=', ',' or spaces", k, v))
		}
	}
	if c.CapacityBytes < 0 {
		errs = append(errs, fmt.Errorf("capacity %d: must not be negative", c.CapacityBytes))
	}
	if c.MaxVolumesPerNode < 0 {
		errs = append(errs, fmt.Errorf("max volumes per node %d: must not be negative", c.MaxVolumesPerNode))
	}
	for _, n := range c.Nodes {
		if n == "" {
			errs = append(errs, errors.New("nodes: empty node ID"))
		}
	}
	if c.SnapshotReadyAfter < 0 {
		errs = append(errs, fmt.Errorf("snapshot ready-after %s: must not be negative", c.SnapshotReadyAfter))
	}
	if err := c.Faults.Validate(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// withDefaults returns c with zero-valued fields set to their defaults.
func (c Config) withDefaults() Config {
	if c.Name == "" {
		c.Name = DefaultName
	}
	if c.Version == "" {
		c.Version = DefaultVersion
	}
	if c.CapacityBytes == 0 {
		c.CapacityBytes = DefaultCapacityBytes
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	c.Topology = cloneMap(c.Topology)
	c.Nodes = append([]string(nil), c.Nodes...)
	c.Faults = c.Faults.clone()
	return c
}

// SocketPath returns the filesystem path of a unix endpoint: unix:///path,
// unix:/path or an absolute path.
func SocketPath(endpoint string) (string, error) {
	var p string
	switch {
	case strings.HasPrefix(endpoint, "unix://"):
		p = strings.TrimPrefix(endpoint, "unix://")
	case strings.HasPrefix(endpoint, "unix:"):
		p = strings.TrimPrefix(endpoint, "unix:")
	case strings.HasPrefix(endpoint, "/"):
		p = endpoint
	default:
		return "", fmt.Errorf("endpoint %q: want unix:///path or unix:/path", endpoint)
	}
	if !strings.HasPrefix(p, "/") {
		return "", fmt.Errorf("endpoint %q: socket path must be absolute", endpoint)
	}
	if len(p) > 107 {
		return "", fmt.Errorf("endpoint %q: socket path longer than 107 bytes", endpoint)
	}
	return p, nil
}

// ParseTopology parses "key=value,key2=value2" (empty string: no topology).
func ParseTopology(s string) (map[string]string, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return nil, nil
	}
	m := map[string]string{}
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("topology %q: want key=value[,key=value...]", s)
		}
		if _, dup := m[k]; dup {
			return nil, fmt.Errorf("topology %q: key %q given twice", s, k)
		}
		m[k] = v
	}
	return m, nil
}

// FormatTopology is the inverse of ParseTopology, with sorted keys.
func FormatTopology(m map[string]string) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + m[k]
	}
	return strings.Join(parts, ",")
}

var sizeSuffixes = map[string]int64{
	"":   1,
	"k":  1000,
	"K":  1000,
	"M":  1000 * 1000,
	"G":  1000 * 1000 * 1000,
	"T":  1000 * 1000 * 1000 * 1000,
	"P":  1000 * 1000 * 1000 * 1000 * 1000,
	"Ki": 1 << 10,
	"Mi": 1 << 20,
	"Gi": 1 << 30,
	"Ti": 1 << 40,
	"Pi": 1 << 50,
}

// ParseSize parses a byte count: a plain integer or one with a Kubernetes
// quantity suffix (Ki, Mi, Gi, Ti, Pi binary; k/K, M, G, T, P decimal).
func ParseSize(s string) (int64, error) {
	s = strings.TrimSpace(s)
	i := len(s)
	for i > 0 && (s[i-1] < '0' || s[i-1] > '9') {
		i--
	}
	num, suffix := s[:i], s[i:]
	mult, ok := sizeSuffixes[suffix]
	if !ok || num == "" {
		return 0, fmt.Errorf("size %q: want an integer with an optional suffix (Ki, Mi, Gi, Ti, Pi, k, M, G, T, P)", s)
	}
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("size %q: %w", s, err)
	}
	if n < 0 || (n > 0 && mult > math.MaxInt64/n) {
		return 0, fmt.Errorf("size %q: out of range", s)
	}
	return n * mult, nil
}

func cloneMap(m map[string]string) map[string]string {
	if len(m) == 0 {
		return nil
	}
	out := make(map[string]string, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}
