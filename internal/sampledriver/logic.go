package sampledriver

// Pure decisions over request data, table-tested in logic_test.go.

import (
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// Sentinel errors of the pure checks; the gRPC edge maps them to codes.
var (
	errInvalid    = errors.New("invalid argument")
	errOutOfRange = errors.New("out of range")
	errBadToken   = errors.New("invalid starting token")
)

// checkCapability reports why cap is not supported, or nil. Volumes are
// directories: mount access with any access mode, no block.
func checkCapability(c *csi.VolumeCapability) error {
	if c == nil {
		return fmt.Errorf("%w: nil volume capability", errInvalid)
	}
	switch c.GetAccessType().(type) {
	case *csi.VolumeCapability_Mount:
	case *csi.VolumeCapability_Block:
		return fmt.Errorf("%w: block access is not supported (volumes are directories)", errInvalid)
	default:
		return fmt.Errorf("%w: volume capability has no access type", errInvalid)
	}
	switch c.GetAccessMode().GetMode() {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
		csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY,
		csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:
		return nil
	case csi.VolumeCapability_AccessMode_UNKNOWN:
		if c.GetAccessMode() == nil {
			return fmt.Errorf("%w: volume capability has no access mode", errInvalid)
		}
		return fmt.Errorf("%w: access mode UNKNOWN", errInvalid)
	default:
		return fmt.Errorf("%w: unknown access mode %d", errInvalid, c.GetAccessMode().GetMode())
	}
}

// checkCapabilities requires at least one capability and checks each.
func checkCapabilities(caps []*csi.VolumeCapability) error {
	if len(caps) == 0 {
		return fmt.Errorf("%w: volume capabilities are required", errInvalid)
	}
	for _, c := range caps {
		if err := checkCapability(c); err != nil {
			return err
		}
	}
	return nil
}

func singleNode(m csi.VolumeCapability_AccessMode_Mode) bool {
	switch m {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:
		return true
	}
	return false
}

func readerOnly(m csi.VolumeCapability_AccessMode_Mode) bool {
	return m == csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY ||
		m == csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY
}

// pickSize chooses a new volume's size from its capacity range: the required
// bytes, else the content source's size minBytes, else the default size
// capped by the limit. A size below minBytes is out of range.
func pickSize(cr *csi.CapacityRange, minBytes int64) (int64, error) {
	req, lim := cr.GetRequiredBytes(), cr.GetLimitBytes()
	if req < 0 || lim < 0 {
		return 0, fmt.Errorf("%w: negative capacity range", errInvalid)
	}
	if lim > 0 && req > lim {
		return 0, fmt.Errorf("%w: required bytes %d exceed limit bytes %d", errInvalid, req, lim)
	}
	size := req
	switch {
	case size > 0:
	case minBytes > 0:
		size = minBytes
	default:
		size = DefaultVolumeSize
		if lim > 0 && size > lim {
			size = lim
		}
	}
	if lim > 0 && size > lim {
		return 0, fmt.Errorf("%w: the source's %d bytes exceed limit bytes %d", errOutOfRange, size, lim)
	}
	if size < minBytes {
		return 0, fmt.Errorf("%w: size %d is smaller than the source's %d bytes", errOutOfRange, size, minBytes)
	}
	return size, nil
}

// sizeFits reports whether an existing size satisfies a capacity range.
func sizeFits(size int64, cr *csi.CapacityRange) bool {
	if size < cr.GetRequiredBytes() {
		return false
	}
	return cr.GetLimitBytes() == 0 || size <= cr.GetLimitBytes()
}

// topologyMatches reports whether a segment set (ours) lies in topology t:
// every segment of t has the same value in ours.
func topologyMatches(ours map[string]string, t *csi.Topology) bool {
	for k, v := range t.GetSegments() {
		if got, ok := ours[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// topologyAllows reports whether a volume accessible from ours satisfies
// the requirement: with requisite topologies, one must match; preferred
// ones only order choices, which a single-segment driver does not have.
func topologyAllows(ours map[string]string, req *csi.TopologyRequirement) bool {
	if len(ours) == 0 || len(req.GetRequisite()) == 0 {
		return true
	}
	for _, t := range req.GetRequisite() {
		if topologyMatches(ours, t) {
			return true
		}
	}
	return false
}

// pickSegment chooses where a volume goes among the segments the controller
// can place volumes in: the first preferred topology that one of them
// matches, else the first requisite one, else the first segment. ok is false
// when requisite topologies exclude every segment.
func pickSegment(segments []map[string]string, req *csi.TopologyRequirement) (map[string]string, bool) {
	if len(segments) == 0 {
		return nil, true
	}
	allowed := func(seg map[string]string) bool { return topologyAllows(seg, req) }
	for _, t := range req.GetPreferred() {
		for _, seg := range segments {
			if topologyMatches(seg, t) && allowed(seg) {
				return seg, true
			}
		}
	}
	for _, t := range req.GetRequisite() {
		for _, seg := range segments {
			if topologyMatches(seg, t) {
				return seg, true
			}
		}
	}
	if len(req.GetRequisite()) > 0 {
		return nil, false
	}
	return segments[0], true
}

// Supported mutable parameters (ControllerModifyVolume, CreateVolume).
const (
	MutableIOPS = "iops" // a positive integer
	MutableTier = "tier" // "standard" or "premium"
)

// Metadata keys a CO may add to the mutable parameters (external-resizer's
// --extra-modify-metadata): accepted and not kept, as a driver that only
// uses them to tag the volume would.
var mutableMetadata = map[string]bool{
	"csi.storage.k8s.io/pvc/name": true, "csi.storage.k8s.io/pvc/namespace": true, "csi.storage.k8s.io/pv/name": true,
}

// userMutable is p without the CO's metadata keys (nil for nil), which the
// driver neither keeps nor compares.
func userMutable(p map[string]string) map[string]string {
	if p == nil {
		return nil
	}
	out := make(map[string]string, len(p))
	for k, v := range p {
		if !mutableMetadata[k] {
			out[k] = v
		}
	}
	return out
}

// checkMutableParameters rejects unknown keys and bad values.
func checkMutableParameters(p map[string]string) error {
	for k, v := range p {
		if mutableMetadata[k] {
			continue
		}
		switch k {
		case MutableIOPS:
			if n, err := strconv.ParseInt(v, 10, 64); err != nil || n <= 0 {
				return fmt.Errorf("%w: mutable parameter %s=%q: want a positive integer", errInvalid, k, v)
			}
		case MutableTier:
			if v != "standard" && v != "premium" {
				return fmt.Errorf("%w: mutable parameter %s=%q: want standard or premium", errInvalid, k, v)
			}
		default:
			return fmt.Errorf("%w: mutable parameter %q is not supported (supported: %s, %s)", errInvalid, k, MutableIOPS, MutableTier)
		}
	}
	return nil
}

// Supported CreateVolume parameters. Anything else is refused with
// InvalidArgument naming the key, as a real driver refuses what it does not
// understand.
const (
	ParamLabel = "label" // free text, stored with the volume
	ParamTier  = "tier"  // "standard" or "premium"
	// The keys external-provisioner (and the broker) add with
	// --extra-create-metadata.
	ParamPVCName      = "csi.storage.k8s.io/pvc/name"
	ParamPVCNamespace = "csi.storage.k8s.io/pvc/namespace"
	ParamPVName       = "csi.storage.k8s.io/pv/name"
)

// checkParameters rejects unknown keys and bad values.
func checkParameters(p map[string]string) error {
	for k, v := range p {
		switch k {
		case ParamLabel, ParamPVCName, ParamPVCNamespace, ParamPVName:
		case ParamTier:
			if v != "standard" && v != "premium" {
				return fmt.Errorf("%w: parameter %s=%q: want standard or premium", errInvalid, k, v)
			}
		default:
			return fmt.Errorf("%w: unknown parameter %q (supported: %s, %s)", errInvalid, k, ParamLabel, ParamTier)
		}
	}
	return nil
}

const tokenPrefix = "sd1."

// encodeToken makes a page token that resumes listing at key (inclusive).
func encodeToken(key string) string {
	return tokenPrefix + base64.RawURLEncoding.EncodeToString([]byte(key))
}

// decodeToken returns the key a token resumes at; "" is the start.
func decodeToken(tok string) (string, error) {
	if tok == "" {
		return "", nil
	}
	rest, ok := strings.CutPrefix(tok, tokenPrefix)
	if !ok {
		return "", fmt.Errorf("%w %q", errBadToken, tok)
	}
	b, err := base64.RawURLEncoding.DecodeString(rest)
	if err != nil || len(b) == 0 {
		return "", fmt.Errorf("%w %q", errBadToken, tok)
	}
	return string(b), nil
}

// page selects from sorted keys the ones starting at the token's key, at
// most max (0: all), and the token of the next page ("" when done).
func page(sorted []string, tok string, max int32) (keys []string, next string, err error) {
	if max < 0 {
		return nil, "", fmt.Errorf("%w: max_entries %d is negative", errInvalid, max)
	}
	start, err := decodeToken(tok)
	if err != nil {
		return nil, "", err
	}
	i := 0
	for i < len(sorted) && sorted[i] < start {
		i++
	}
	rest := sorted[i:]
	if max > 0 && len(rest) > int(max) {
		return rest[:max], encodeToken(rest[max]), nil
	}
	return rest, "", nil
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}
