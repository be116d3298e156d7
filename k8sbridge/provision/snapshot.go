package provision

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
)

// Restoring a VolumeSnapshot, as external-provisioner does: the snapshot
// must be bound to a VolumeSnapshotContent that is bound back to it, of
// the claim's driver, ready, with a snapshot handle; the claim must ask
// for at least the snapshot's restore size; and a volume mode other than
// the snapshotted volume's needs the content's
// snapshot.storage.kubernetes.io/allow-volume-mode-change annotation
// (external-provisioner's --prevent-volume-mode-conversion, on by
// default). The snapshot-controller, not the broker, makes snapshots.
const (
	SnapshotGroup            = "snapshot.storage.k8s.io"
	SnapshotKind             = "VolumeSnapshot"
	annAllowVolumeModeChange = "snapshot.storage.kubernetes.io/allow-volume-mode-change"
)

// snapshotSource is the content source for a claim that restores a
// VolumeSnapshot of its namespace, and the snapshot as read.
func (p *Provisioner) snapshotSource(ctx context.Context, claim *corev1.PersistentVolumeClaim, driver string, caps drivers.Caps) (*csi.VolumeContentSource, *snapshotv1.VolumeSnapshot, error) {
	name := claim.Spec.DataSource.Name
	if p.b.Cfg.SnapshotClient == nil {
		return nil, nil, fmt.Errorf("data source VolumeSnapshot %q: this broker was started without the %s API client, so it restores no snapshots", name, SnapshotGroup)
	}
	if !caps.Snapshot {
		return nil, nil, fmt.Errorf("driver %s does not support snapshot restore (no CREATE_DELETE_SNAPSHOT capability)", driver)
	}
	snap, err := p.b.Cfg.SnapshotClient.SnapshotV1().VolumeSnapshots(claim.Namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, nil, SnapshotGetError(err, claim.Namespace, name)
	}
	// A snapshot being deleted is refused, unless a restore from it began
	// before (it holds snapshotFinalizer): that restore goes on.
	if snap.DeletionTimestamp != nil && !slices.Contains(snap.Finalizers, SnapshotFinalizer) {
		return nil, nil, fmt.Errorf("VolumeSnapshot %s/%s is being deleted", claim.Namespace, name)
	}
	if snap.Status == nil || snap.Status.BoundVolumeSnapshotContentName == nil || *snap.Status.BoundVolumeSnapshotContentName == "" {
		return nil, nil, fmt.Errorf("VolumeSnapshot %s/%s is not bound to a VolumeSnapshotContent yet", claim.Namespace, name)
	}
	contentName := *snap.Status.BoundVolumeSnapshotContentName
	content, err := p.b.Cfg.SnapshotClient.SnapshotV1().VolumeSnapshotContents().Get(ctx, contentName, metav1.GetOptions{})
	if err != nil {
		return nil, nil, fmt.Errorf("VolumeSnapshotContent %s of VolumeSnapshot %s/%s: %w", contentName, claim.Namespace, name, err)
	}
	// The content must name this snapshot back: a VolumeSnapshot cannot
	// lend its namespace another's content.
	if ref := content.Spec.VolumeSnapshotRef; ref.Name != snap.Name || ref.Namespace != snap.Namespace || ref.UID != snap.UID {
		return nil, nil, fmt.Errorf("VolumeSnapshotContent %s is bound to VolumeSnapshot %s/%s (UID %s), not to %s/%s", contentName, ref.Namespace, ref.Name, ref.UID, claim.Namespace, name)
	}
	if content.Spec.Driver != driver {
		return nil, nil, fmt.Errorf("VolumeSnapshot %s/%s is a snapshot of driver %s, not %s (the claim's StorageClass's)", claim.Namespace, name, content.Spec.Driver, driver)
	}
	if snap.Status.ReadyToUse == nil || !*snap.Status.ReadyToUse {
		return nil, nil, fmt.Errorf("VolumeSnapshot %s/%s is not ready to use yet", claim.Namespace, name)
	}
	if content.Status == nil || content.Status.SnapshotHandle == nil || *content.Status.SnapshotHandle == "" {
		return nil, nil, fmt.Errorf("VolumeSnapshotContent %s of VolumeSnapshot %s/%s has no snapshot handle", contentName, claim.Namespace, name)
	}
	if rs := snap.Status.RestoreSize; rs != nil {
		req := claim.Spec.Resources.Requests[corev1.ResourceStorage]
		if req.Cmp(*rs) < 0 {
			return nil, nil, fmt.Errorf("claim requests %s, less than the restore size %s of VolumeSnapshot %s/%s", req.String(), rs.String(), claim.Namespace, name)
		}
	}
	if from := content.Spec.SourceVolumeMode; from != nil && claim.Spec.VolumeMode != nil && *from != *claim.Spec.VolumeMode {
		if ok, err := strconv.ParseBool(content.Annotations[annAllowVolumeModeChange]); err != nil || !ok {
			return nil, nil, fmt.Errorf("claim's volume mode %s differs from the snapshotted volume's %s, and VolumeSnapshotContent %s does not allow the change (annotation %s: \"true\")",
				*claim.Spec.VolumeMode, *from, contentName, annAllowVolumeModeChange)
		}
	}
	return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: *content.Status.SnapshotHandle}}}, snap, nil
}

// SnapshotGetError says what a failed GET of VolumeSnapshot ns/name means.
// The API server's 404 for an object names it in its details; its 404 for
// an API it does not serve (no VolumeSnapshot CRD installed, or none
// serving v1) names nothing, and saying "not found" then would send a user
// looking for an object that is not the problem.
func SnapshotGetError(err error, ns, name string) error {
	if !apierrors.IsNotFound(err) {
		return fmt.Errorf("VolumeSnapshot %s/%s: %w", ns, name, err)
	}
	var st apierrors.APIStatus
	if errors.As(err, &st) {
		if d := st.Status().Details; d == nil || d.Name == "" {
			return fmt.Errorf("VolumeSnapshot %s/%s: this cluster does not serve the %s/v1 API (install the VolumeSnapshot CRDs and the snapshot-controller to restore snapshots)", ns, name, SnapshotGroup)
		}
	}
	return fmt.Errorf("VolumeSnapshot %s/%s not found", ns, name)
}
