package snapshot

import (
	"context"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	corev1 "k8s.io/api/core/v1"

	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/policy"
)

// deleteContent carries out a content's deletion as csi-snapshotter does:
// with deletionPolicy Delete and a snapshot in its status (not a group
// member's), DeleteSnapshot with the remembered secret, then the status's
// snapshot fields cleared; then, whatever the policy, the content
// finalizer removed. A snapshot whose CreateSnapshot was recorded but
// never reached the status is deleted first (nothing else could find it).
func (c *Controller) deleteContent(ctx context.Context, vsc *snapshotv1.VolumeSnapshotContent) error {
	driver := vsc.Spec.Driver
	if vsc.Spec.DeletionPolicy == snapshotv1.VolumeSnapshotContentDelete && vsc.Status != nil && vsc.Status.SnapshotHandle != nil && vsc.Status.VolumeGroupSnapshotHandle == nil {
		if err := c.deleteSnapshot(ctx, vsc); err != nil {
			c.ops.WithLabelValues(driver, "delete_failed").Inc()
			if ctx.Err() == nil {
				c.b.Log.Warn("snapshot deletion failed; will retry", "content", vsc.Name, "driver", driver, "err", err)
				c.b.EventOnce(ctx, contentRef(vsc), corev1.EventTypeWarning, "SnapshotDeleteError", kube.FailureOf("DeleteSnapshot", err), "Failed to delete snapshot: %v", err)
			}
			return err
		}
		cleared, err := c.patchStatus(ctx, vsc, func(st *snapshotv1.VolumeSnapshotContentStatus) *snapshotv1.VolumeSnapshotContentStatus {
			st.SnapshotHandle, st.ReadyToUse, st.CreationTime, st.RestoreSize = nil, nil, nil, nil
			return st
		})
		if err != nil {
			if ctx.Err() == nil {
				c.b.EventOnce(ctx, contentRef(vsc), corev1.EventTypeWarning, "SnapshotDeleteError", "clear status", "Failed to clear content status: %v", err)
			}
			return fmt.Errorf("snapshot of content %s deleted; clear its status: %w", vsc.Name, err)
		}
		vsc = cleared
		// Counted now: a retry after a failed finalizer removal finds the
		// status cleared and must not count it again, nor as retained.
		c.ops.WithLabelValues(driver, "deleted").Inc()
		c.b.Log.Info("snapshot deleted", "content", vsc.Name, "driver", driver)
	}
	if vsc.Spec.Source.VolumeHandle != nil && vsc.Spec.VolumeSnapshotRef.UID != "" {
		name := snapshotName(c.b.Cfg, vsc)
		e, ok, err := c.intents.Lookup(ctx, name)
		if err != nil {
			return fmt.Errorf("content %s: read the snapshot intent record: %w", vsc.Name, err)
		}
		if ok && e.ContentUID == string(vsc.UID) && (vsc.Status == nil || vsc.Status.SnapshotHandle == nil) {
			c.undo(ctx, e, "its VolumeSnapshotContent is deleted before its status recorded a snapshot")
			if c.intents.Has(name) {
				c.ops.WithLabelValues(driver, "delete_failed").Inc()
				return fmt.Errorf("content %s: the snapshot its CreateSnapshot may have made is not deleted yet", vsc.Name)
			}
		}
	}
	if err := c.removeFinalizer(ctx, vsc); err != nil {
		return fmt.Errorf("remove finalizer %s from content %s: %w", ContentFinalizer, vsc.Name, err)
	}
	if vsc.Spec.DeletionPolicy == snapshotv1.VolumeSnapshotContentRetain {
		c.ops.WithLabelValues(driver, "retained").Inc()
	}
	c.b.ForgetEvents(vsc.UID)
	return nil
}

// deleteSnapshot calls DeleteSnapshot for the content's snapshot.
func (c *Controller) deleteSnapshot(ctx context.Context, vsc *snapshotv1.VolumeSnapshotContent) error {
	driver := vsc.Spec.Driver
	ref, src, err := secretKeys.Remembered(vsc)
	if err != nil {
		return err
	}
	p := &plan{vsc: vsc, driver: driver, secret: ref, secretSource: src}
	if c.b.Cfg.Drivers.NodeLocal(driver) {
		if p.node = c.nodeOf(vsc); p.node == "" {
			return fmt.Errorf("snapshot %s of node-local driver %s: content %s names no node (annotation %s), so no node's proxy can delete it", *vsc.Status.SnapshotHandle, driver, vsc.Name, AnnNode)
		}
	}
	conn, err := c.b.DriverConn(driver, p.node)
	if err != nil {
		return drivers.NewUnreachable(err)
	}
	use := c.secretUse(p, policy.OpDeleteSnapshot)
	if vsc.Spec.VolumeSnapshotRef.UID == "" {
		use.Requester = policy.Requester{Kind: policy.KindVolumeSnapshotContent, Name: vsc.Name, Node: p.node}
	}
	creds, err := c.b.FetchSecret(ctx, use)
	if err != nil {
		return err
	}
	callCtx, cancel := c.b.CallContext(ctx, driver, "DeleteSnapshot")
	defer cancel()
	if _, err := csi.NewControllerClient(conn).DeleteSnapshot(callCtx, &csi.DeleteSnapshotRequest{SnapshotId: *vsc.Status.SnapshotHandle, Secrets: creds}); err != nil {
		return fmt.Errorf("driver %s: DeleteSnapshot %s: %w", driver, *vsc.Status.SnapshotHandle, err)
	}
	return nil
}
