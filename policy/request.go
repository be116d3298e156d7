package policy

import (
	"fmt"
	"strings"

	"github.com/csibroker/csibroker/internal/csiname"
)

// Operation is the CSI RPC a secret is wanted for. The values are the CSI
// method names of the RPCs whose requests carry a secrets map.
type Operation string

// Operations whose CSI requests carry secrets.
const (
	OpCreateVolume               Operation = "CreateVolume"
	OpDeleteVolume               Operation = "DeleteVolume"
	OpControllerPublishVolume    Operation = "ControllerPublishVolume"
	OpControllerUnpublishVolume  Operation = "ControllerUnpublishVolume"
	OpValidateVolumeCapabilities Operation = "ValidateVolumeCapabilities"
	OpControllerExpandVolume     Operation = "ControllerExpandVolume"
	OpControllerModifyVolume     Operation = "ControllerModifyVolume"
	OpCreateSnapshot             Operation = "CreateSnapshot"
	OpDeleteSnapshot             Operation = "DeleteSnapshot"
	OpListSnapshots              Operation = "ListSnapshots"
	OpNodeStageVolume            Operation = "NodeStageVolume"
	OpNodePublishVolume          Operation = "NodePublishVolume"
	OpNodeExpandVolume           Operation = "NodeExpandVolume"
	OpCreateVolumeGroupSnapshot  Operation = "CreateVolumeGroupSnapshot"
	OpDeleteVolumeGroupSnapshot  Operation = "DeleteVolumeGroupSnapshot"
	OpGetVolumeGroupSnapshot     Operation = "GetVolumeGroupSnapshot"
)

// AnyOperation in a grant's operations list matches every known operation.
const AnyOperation Operation = "*"

// knownOperations is the closed set of operations, in a fixed order: the
// position of an operation is its bit in a compiled grant's operation mask.
var knownOperations = [...]Operation{
	OpCreateVolume, OpDeleteVolume,
	OpControllerPublishVolume, OpControllerUnpublishVolume,
	OpValidateVolumeCapabilities,
	OpControllerExpandVolume, OpControllerModifyVolume,
	OpCreateSnapshot, OpDeleteSnapshot, OpListSnapshots,
	OpNodeStageVolume, OpNodePublishVolume, OpNodeExpandVolume,
	OpCreateVolumeGroupSnapshot, OpDeleteVolumeGroupSnapshot, OpGetVolumeGroupSnapshot,
}

// Operations returns every operation a grant can name, in a stable order.
func Operations() []Operation {
	return append([]Operation(nil), knownOperations[:]...)
}

// bit returns the operation's bit in an operation mask, or 0 when the
// operation is unknown (an unknown operation is matched by no grant).
func (o Operation) bit() uint32 {
	for i, k := range knownOperations {
		if k == o {
			return 1 << uint(i)
		}
	}
	return 0
}

// Valid reports whether o is one of the known operations ("*" is not).
func (o Operation) Valid() bool { return o.bit() != 0 }

// onNode reports whether the operation runs on a node: its secret goes to
// that node's plugin, wherever the volume is used.
func (o Operation) onNode() bool {
	return o == OpNodeStageVolume || o == OpNodePublishVolume || o == OpNodeExpandVolume
}

// SecretRef names a Kubernetes Secret. It is a reference only: this package
// never sees secret content.
type SecretRef struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
}

func (r SecretRef) String() string { return r.Namespace + "/" + r.Name }

// SourceKind says where a secret reference came from.
type SourceKind string

// Sources of secret references.
const (
	// SourceStorageClassParameter: a literal
	// csi.storage.k8s.io/<op>-secret-name/-namespace StorageClass parameter
	// (or the snapshot/group snapshot class equivalent).
	SourceStorageClassParameter SourceKind = "StorageClassParameter"
	// SourcePVField: a secret reference stored in the PersistentVolume's
	// spec.csi (e.g. nodeStageSecretRef).
	SourcePVField SourceKind = "PVField"
	// SourceTemplate: a StorageClass parameter whose value was a template
	// such as ${pvc.namespace}; Source.Template holds the unresolved text.
	SourceTemplate SourceKind = "Template"
	// SourceStatic: configured outside Kubernetes (standalone broker).
	SourceStatic SourceKind = "Static"
)

// Source says where a secret reference came from.
type Source struct {
	Kind SourceKind `json:"kind"`
	// Key is the StorageClass parameter key or the PV field path the
	// reference was read from.
	Key string `json:"key,omitempty"`
	// Template is the unresolved template text, for SourceTemplate.
	Template string `json:"template,omitempty"`
}

// Requester kinds commonly used by callers. Kind is free text; these are
// the names the Kubernetes bridge uses.
const (
	KindPersistentVolumeClaim = "PersistentVolumeClaim"
	KindPersistentVolume      = "PersistentVolume"
	KindVolumeAttachment      = "VolumeAttachment"
	KindVolumeSnapshot        = "VolumeSnapshot"
	KindVolumeSnapshotContent = "VolumeSnapshotContent"
	// A group snapshot's requester: its VolumeGroupSnapshot, or for a
	// pre-provisioned content not bound yet the content.
	KindVolumeGroupSnapshot        = "VolumeGroupSnapshot"
	KindVolumeGroupSnapshotContent = "VolumeGroupSnapshotContent"
)

// Requester is the object on whose behalf the operation runs.
type Requester struct {
	Kind string `json:"kind"`
	// Namespace is the namespace on whose behalf the operation runs: the
	// PVC's namespace, or for cluster-scoped objects (PV, VolumeAttachment)
	// the namespace of the bound claim. Empty when there is none; only a grant
	// listing "*" in requesters.namespaces admits an empty namespace.
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	// NamespaceLabels are the labels of the requesting namespace. nil means
	// "not known", which fails closed: an Allow grant's namespaceSelector
	// does not pick the namespace, a Deny grant's does. Pass a non-nil map,
	// even empty, when the labels are known.
	NamespaceLabels map[string]string `json:"namespaceLabels"`
	// Labels are the requesting object's own labels.
	Labels map[string]string `json:"labels"`
	// StorageClass is the StorageClass name ("" when none).
	StorageClass string `json:"storageClass"`
	// Node is the node name for node operations and for controller
	// operations bound to a node (ControllerPublishVolume); "" otherwise.
	Node string `json:"node"`
}

// String describes the requester for reasons, e.g.
// "PersistentVolumeClaim team-a/data".
func (r Requester) String() string {
	var b strings.Builder
	r.writeTo(&b)
	return b.String()
}

func (r *Requester) writeTo(b *strings.Builder) {
	kind := r.Kind
	if kind == "" {
		kind = "requester"
	}
	switch {
	case r.Namespace != "" && r.Name != "":
		b.WriteString(kind)
		b.WriteByte(' ')
		b.WriteString(r.Namespace)
		b.WriteByte('/')
		b.WriteString(r.Name)
	case r.Name != "":
		b.WriteString(kind)
		b.WriteByte(' ')
		b.WriteString(r.Name)
	case r.Namespace != "":
		b.WriteString(kind)
		b.WriteString(" in namespace ")
		b.WriteString(r.Namespace)
	default:
		b.WriteString("unknown requester")
	}
}

// Request is one question to the policy: may Driver receive Secret for
// Operation on behalf of Requester? The JSON form is the input sent to an
// external decision point, and the field names are those of the CEL variable
// `request` (request.driver, request.secret.name, request.requester.labels...).
type Request struct {
	Driver    string    `json:"driver"`
	Operation Operation `json:"operation"`
	Secret    SecretRef `json:"secret"`
	Source    Source    `json:"source"`
	Requester Requester `json:"requester"`
}

// validate checks the fields that identify the request and appear in
// decision reasons and logs. A request that fails it is denied: the caller
// is confused, and its strings must not reach an Event unescaped.
func (r *Request) validate() error {
	if !csiname.Valid(r.Driver) {
		return fmt.Errorf("driver name %s is not a valid CSI driver name", quote(r.Driver))
	}
	if !r.Operation.Valid() {
		return fmt.Errorf("operation %s is not a known CSI operation with secrets", quote(string(r.Operation)))
	}
	if !safeName(r.Secret.Namespace, 63) || !safeName(r.Secret.Name, 253) {
		return fmt.Errorf("secret reference %s/%s is not a valid namespace/name", quote(r.Secret.Namespace), quote(r.Secret.Name))
	}
	rq := &r.Requester
	if !optSafeName(rq.Kind, 63) || !optSafeName(rq.Namespace, 63) || !optSafeName(rq.Name, 253) ||
		!optSafeName(rq.StorageClass, 253) || !optSafeName(rq.Node, 253) {
		return fmt.Errorf("requester %s %s/%s (storage class %s, node %s) has an invalid name",
			quote(rq.Kind), quote(rq.Namespace), quote(rq.Name), quote(rq.StorageClass), quote(rq.Node))
	}
	return nil
}
