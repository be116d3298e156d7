package kube

import (
	"slices"
	"strings"
)

// Annotations and finalizers shared with external-provisioner, so that claims
// and volumes move between the sidecar and the broker without changes.
const (
	AnnStorageProvisioner     = "volume.kubernetes.io/storage-provisioner"
	AnnBetaStorageProvisioner = "volume.beta.kubernetes.io/storage-provisioner"
	AnnSelectedNode           = "volume.kubernetes.io/selected-node"
	AnnProvisionedBy          = "pv.kubernetes.io/provisioned-by"
	// AnnMigratedTo: the PV controller's mark on objects of in-tree
	// plugins that CSI migration moved to the CSI driver it names.
	AnnMigratedTo         = "pv.kubernetes.io/migrated-to"
	AnnDeletionSecretName = "volume.kubernetes.io/provisioner-deletion-secret-name"
	AnnDeletionSecretNS   = "volume.kubernetes.io/provisioner-deletion-secret-namespace"
	AnnModifySecretName   = "volume.kubernetes.io/controller-modify-secret-name"
	AnnModifySecretNS     = "volume.kubernetes.io/controller-modify-secret-namespace"
	// AnnBetaStorageClass is the claim's class before spec.storageClassName,
	// still read first by Kubernetes and the sidecars.
	AnnBetaStorageClass = "volume.beta.kubernetes.io/storage-class"
	FinalizerVolume     = "external-provisioner.volume.kubernetes.io/finalizer"
	// AnnVolumeNode records the node of a node-local driver's volume.
	AnnVolumeNode = "csibroker.io/node"
)

// Names shared with external-attacher, external-resizer and earlier
// csibroker releases.
const (
	// AnnNamespaceLabels records, on a PV, the labels of its claim's namespace
	// at provisioning, and on a VolumeAttachment of a PV that records none, at
	// publishing, for policy decisions after the namespace is deleted.
	AnnNamespaceLabels      = "csibroker.io/claim-namespace-labels"
	AnnVANodeID             = "csi.alpha.kubernetes.io/node-id"
	AnnNodeIDs              = "csi.volume.kubernetes.io/nodeid"
	AttacherFinalizerPrefix = "external-attacher/"
	// AnnStorageResizer is set by kube-controller-manager on claims of
	// in-tree volumes migrated to CSI: the CSI driver that must expand them.
	AnnStorageResizer = "volume.kubernetes.io/storage-resizer"
	// AnnNodeExpansionNotRequired tells the kubelet that the controller
	// finished the expansion (it skips the node step of RWX volumes).
	AnnNodeExpansionNotRequired = "volume.kubernetes.io/node-expansion-not-required"
)

// AttacherFinalizer is external-attacher's finalizer name for driver: every
// character outside [a-zA-Z0-9-] becomes '-', and a name ending in '-' gets
// an 'X' ("ebs.csi.aws.com" → "external-attacher/ebs-csi-aws-com").
func AttacherFinalizer(driver string) string {
	b := []byte(driver)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-') {
			b[i] = '-'
		}
	}
	if len(b) == 0 || b[len(b)-1] == '-' {
		b = append(b, 'X')
	}
	return AttacherFinalizerPrefix + string(b)
}

// AttacherFinalizers are the finalizer names an attachment of driver may
// carry: external-attacher's, and the one earlier csibroker releases wrote
// (only '/' replaced), which detach also honours and removes.
func AttacherFinalizers(driver string) []string {
	cur, legacy := AttacherFinalizer(driver), AttacherFinalizerPrefix+strings.ReplaceAll(driver, "/", "-")
	if cur == legacy {
		return []string{cur}
	}
	return []string{cur, legacy}
}

// HasAttacherFinalizer reports whether finalizers hold one of driver's.
func HasAttacherFinalizer(finalizers []string, driver string) bool {
	for _, f := range AttacherFinalizers(driver) {
		if slices.Contains(finalizers, f) {
			return true
		}
	}
	return false
}

// WithoutAttacherFinalizers is finalizers without any of driver's.
func WithoutAttacherFinalizers(finalizers []string, driver string) []string {
	for _, f := range AttacherFinalizers(driver) {
		finalizers = RemoveString(finalizers, f)
	}
	return finalizers
}
