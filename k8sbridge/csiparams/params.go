package csiparams

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/k8sbridge/secrets"
)

// StorageClass parameter keys the provisioner itself reads or writes.
const (
	// ParamFSType is the filesystem type of Filesystem-mode volumes.
	ParamFSType = secrets.ParameterPrefix + "fstype"
	// ParamPVCName, ParamPVCNamespace and ParamPVName are added to the driver's
	// parameters with --extra-create-metadata, and to its mutable parameters
	// with --extra-modify-metadata.
	ParamPVCName      = secrets.ParameterPrefix + "pvc/name"
	ParamPVCNamespace = secrets.ParameterPrefix + "pvc/namespace"
	ParamPVName       = secrets.ParameterPrefix + "pv/name"
)

// legacyFSTypeKey is the unprefixed fstype key (any case), deprecated but
// still read by upstream, and passed on to the driver since it has no prefix.
const legacyFSTypeKey = "fstype"

// ErrInvalidParameters is wrapped by the errors of CreateParameters,
// VolumeCapabilities and CapacityRange: the StorageClass or the claim asks for
// something that cannot be provisioned as it stands.
var ErrInvalidParameters = errors.New("invalid provisioning parameters")

// knownPrefixedParams are the csi.storage.k8s.io/ keys stripped before the
// parameters go to the driver.
func knownPrefixedParams() map[string]bool {
	known := map[string]bool{
		ParamFSType:                         true,
		secrets.ParamDefaultSecretName:      true,
		secrets.ParamDefaultSecretNamespace: true,
	}
	for _, k := range secrets.Kinds() {
		name, ns := secrets.ParamKeys(k)
		known[name], known[ns] = true, true
	}
	return known
}

// classFSType is the fstype params set, from csi.storage.k8s.io/fstype or
// the deprecated "fstype" key (any case), and the keys that set one (more
// than one is an error CreateParameters reports).
func classFSType(params map[string]string) (fsType string, keys []string) {
	for k, v := range params {
		if k == ParamFSType || strings.ToLower(k) == legacyFSTypeKey {
			keys = append(keys, k)
			fsType = v
		}
	}
	return fsType, keys
}

// CreateParameters removes the csi.storage.k8s.io/ keys the provisioner understands (secrets, fstype) from the class parameters and returns the rest for the driver plus the fstype; an unknown csi.storage.k8s.io/ key is an error naming it (as upstream). With extraMetadata, adds csi.storage.k8s.io/pvc/name, /pvc/namespace, /pv/name.
//
// The fstype comes from csi.storage.k8s.io/fstype or the deprecated "fstype"
// key (any case; kept in the driver's parameters, as upstream does); setting
// it more than once is an error. When the class sets none, the fstype is
// defaultFSType (external-provisioner's --default-fstype; empty: none, the
// driver's choice). Unprefixed deprecated secret keys
// (csiProvisionerSecretName...) stay in the driver's parameters, as upstream.
// params is not modified; driverParams is never nil on success.
func CreateParameters(params map[string]string, extraMetadata bool, pvName string, claim *corev1.PersistentVolumeClaim, defaultFSType string) (driverParams map[string]string, fsType string, err error) {
	fsType, fsKeys := classFSType(params)
	if len(fsKeys) > 1 {
		slices.Sort(fsKeys)
		return nil, "", fmt.Errorf("fstype set more than once, by parameters %s: %w", strings.Join(fsKeys, ", "), ErrInvalidParameters)
	}
	if fsType == "" {
		fsType = defaultFSType
	}

	known := knownPrefixedParams()
	var unknown []string
	driverParams = make(map[string]string, len(params)+3)
	for k, v := range params {
		switch {
		case !strings.HasPrefix(k, secrets.ParameterPrefix):
			driverParams[k] = v
		case !known[k]:
			unknown = append(unknown, k)
		}
	}
	if len(unknown) > 0 {
		slices.Sort(unknown)
		return nil, "", fmt.Errorf("unknown parameter %s: the prefix %s is reserved for the provisioner: %w",
			strings.Join(unknown, ", "), secrets.ParameterPrefix, ErrInvalidParameters)
	}

	if extraMetadata {
		if claim == nil {
			return nil, "", fmt.Errorf("extra create metadata needs the claim: %w", ErrInvalidParameters)
		}
		driverParams[ParamPVCName] = claim.Name
		driverParams[ParamPVCNamespace] = claim.Namespace
		driverParams[ParamPVName] = pvName
	}
	return driverParams, fsType, nil
}

// VolumeCapabilities maps a claim's access modes and volume mode (Block/Filesystem, fsType, mount options from the class) to CSI capabilities as upstream does (RWOP → SINGLE_NODE_SINGLE_WRITER when the driver supports SINGLE_NODE_MULTI_WRITER, else SINGLE_NODE_WRITER); error for an unsupported mode.
//
// As upstream, each access mode of the claim becomes one capability:
//
//	access mode      | driver without SINGLE_NODE_MULTI_WRITER | with it
//	ReadWriteOnce    | SINGLE_NODE_WRITER                      | SINGLE_NODE_MULTI_WRITER
//	ReadWriteOncePod | SINGLE_NODE_WRITER                      | SINGLE_NODE_SINGLE_WRITER
//	ReadOnlyMany     | MULTI_NODE_READER_ONLY                  | MULTI_NODE_READER_ONLY
//	ReadWriteMany    | MULTI_NODE_MULTI_WRITER                 | MULTI_NODE_MULTI_WRITER
//
// A Block claim gets a block access type (fsType and mount options do not
// apply); any other claim a mount with fsType and the class's mount options.
func VolumeCapabilities(claim *corev1.PersistentVolumeClaim, fsType string, mountOptions []string, singleNodeMultiWriter bool) ([]*csi.VolumeCapability, error) {
	if claim == nil {
		return nil, fmt.Errorf("no claim: %w", ErrInvalidParameters)
	}
	if len(claim.Spec.AccessModes) == 0 {
		return nil, fmt.Errorf("claim %s/%s has no access modes: %w", claim.Namespace, claim.Name, ErrInvalidParameters)
	}
	block := false
	switch m := VolumeMode(claim.Spec.VolumeMode); m {
	case corev1.PersistentVolumeBlock:
		block = true
	case corev1.PersistentVolumeFilesystem:
	default:
		return nil, fmt.Errorf("claim %s/%s: unsupported volume mode %q: %w", claim.Namespace, claim.Name, m, ErrInvalidParameters)
	}
	caps := make([]*csi.VolumeCapability, 0, len(claim.Spec.AccessModes))
	for _, am := range claim.Spec.AccessModes {
		mode, err := csiAccessMode(am, singleNodeMultiWriter)
		if err != nil {
			return nil, fmt.Errorf("claim %s/%s: %w", claim.Namespace, claim.Name, err)
		}
		c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
		if block {
			c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
		} else {
			c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{
				FsType:     fsType,
				MountFlags: slices.Clone(mountOptions),
			}}
		}
		caps = append(caps, c)
	}
	return caps, nil
}

func csiAccessMode(am corev1.PersistentVolumeAccessMode, singleNodeMultiWriter bool) (csi.VolumeCapability_AccessMode_Mode, error) {
	switch am {
	case corev1.ReadWriteOnce:
		if singleNodeMultiWriter {
			return csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER, nil
		}
		return csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, nil
	case corev1.ReadWriteOncePod:
		if singleNodeMultiWriter {
			return csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER, nil
		}
		return csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, nil
	case corev1.ReadOnlyMany:
		return csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY, nil
	case corev1.ReadWriteMany:
		return csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, nil
	}
	return csi.VolumeCapability_AccessMode_UNKNOWN, fmt.Errorf("unsupported access mode %q: %w", am, ErrInvalidParameters)
}

// VolumeName is <prefix>-<claim UID>, the UID truncated to uuidLength when 0 < uuidLength < len (upstream --volume-name-uuid-length).
//
// As upstream, a truncated UID also loses its dashes (the first uuidLength
// characters of the UID without dashes); uuidLength <= 0 (upstream's default
// is -1) keeps the UID whole, dashes included. The caller checks that prefix
// and uid are not empty (upstream refuses both).
func VolumeName(prefix string, uid types.UID, uuidLength int) string {
	id := string(uid)
	if uuidLength > 0 {
		id = strings.ReplaceAll(id, "-", "")
		if uuidLength < len(id) {
			id = id[:uuidLength]
		}
	}
	return prefix + "-" + id
}

// CapacityRange from the claim's storage request (error if missing or not positive).
//
// RequiredBytes is the request rounded up to a whole byte; no limit is set,
// as upstream.
func CapacityRange(claim *corev1.PersistentVolumeClaim) (*csi.CapacityRange, error) {
	if claim == nil {
		return nil, fmt.Errorf("no claim: %w", ErrInvalidParameters)
	}
	q, ok := claim.Spec.Resources.Requests[corev1.ResourceStorage]
	if !ok {
		return nil, fmt.Errorf("claim %s/%s requests no storage: %w", claim.Namespace, claim.Name, ErrInvalidParameters)
	}
	if q.Sign() <= 0 {
		return nil, fmt.Errorf("claim %s/%s requests %s of storage; it must be positive: %w", claim.Namespace, claim.Name, q.String(), ErrInvalidParameters)
	}
	if err := FitsCSISize(q); err != nil {
		return nil, fmt.Errorf("claim %s/%s: %w", claim.Namespace, claim.Name, err)
	}
	return &csi.CapacityRange{RequiredBytes: q.Value()}, nil
}

// FitsCSISize refuses a size CSI cannot carry (its sizes are int64 bytes):
// Quantity.Value would wrap it to 0 or a negative number without a word.
func FitsCSISize(q resource.Quantity) error {
	if q.CmpInt64(math.MaxInt64) > 0 {
		return fmt.Errorf("a size of %s is more than CSI can express (at most %d bytes): %w", q.String(), int64(math.MaxInt64), ErrInvalidParameters)
	}
	return nil
}

// CreateErrorClass classifies a CreateVolume error like external-provisioner:
type CreateErrorClass int

// The classes of CreateVolume errors.
const (
	// CreateFinal: the volume is not being created; report the error and
	// retry with backoff (a retry may succeed once the cause is fixed).
	CreateFinal CreateErrorClass = iota
	// CreateInProgress: the volume may exist or still be in the making; the
	// same CreateVolume must be issued again (same name) until it gives a
	// final answer, and the claim must not be given up on.
	CreateInProgress
	// CreateReschedule: the driver cannot create the volume in the selected
	// node's topology; remove the selected-node annotation so the scheduler
	// picks another node.
	CreateReschedule
)

func (c CreateErrorClass) String() string {
	switch c {
	case CreateFinal:
		return "Final"
	case CreateInProgress:
		return "InProgress"
	case CreateReschedule:
		return "Reschedule"
	}
	return fmt.Sprintf("CreateErrorClass(%d)", int(c))
}

// ClassifyCreateError classifies a CreateVolume error as upstream's checkError:
//
//	code                                         | class
//	Canceled, DeadlineExceeded, Unavailable,     | CreateInProgress
//	Aborted                                      |
//	ResourceExhausted, hasSelectedNode           | CreateReschedule
//	ResourceExhausted, no selected node          | CreateFinal
//	every other code (OK, Unknown,               | CreateFinal
//	InvalidArgument, NotFound, AlreadyExists,    |
//	PermissionDenied, FailedPrecondition,        |
//	OutOfRange, Unimplemented, Internal,         |
//	DataLoss, Unauthenticated)                   |
//	not a gRPC status (context errors, a failed  | CreateInProgress
//	dial...)                                     |
//
// A wrapped status (fmt.Errorf("...: %w", st.Err())) counts as its code.
// An error of a call the broker retried after an Unavailable attempt
// (EarlierAttemptUnavailable) is CreateInProgress whatever its code: that
// attempt may have made the volume, so the intent must stay.
// hasSelectedNode must be true only when rescheduling can help, which upstream
// spells "the driver supports topology and a node is selected"; without
// topology the next CreateVolume would be the same.
func ClassifyCreateError(err error, hasSelectedNode bool) CreateErrorClass {
	if broker.EarlierAttemptUnavailable(err) {
		return CreateInProgress
	}
	st, ok := status.FromError(err)
	if !ok {
		// Not from the driver: the call may never have left, or may have
		// been cut off after the driver began; be safe.
		return CreateInProgress
	}
	switch st.Code() {
	case codes.Canceled, codes.DeadlineExceeded, codes.Unavailable, codes.Aborted:
		return CreateInProgress
	case codes.ResourceExhausted:
		if hasSelectedNode {
			return CreateReschedule
		}
		return CreateFinal
	}
	return CreateFinal
}

// VolumeMode is a claim's or volume's mode: unset is Filesystem, as the
// API server defaults it.
func VolumeMode(m *corev1.PersistentVolumeMode) corev1.PersistentVolumeMode {
	if m == nil {
		return corev1.PersistentVolumeFilesystem
	}
	return *m
}
