package groupsnapshot

import (
	"context"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	groupv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	corev1 "k8s.io/api/core/v1"

	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/policy"
)

// deleteContent carries out a group content's deletion as csi-snapshotter
// does: with deletionPolicy Delete and a group snapshot in its status,
// DeleteVolumeGroupSnapshot with the remembered secret and the members'
// snapshot IDs, then the status's group fields cleared; then, whatever the
// policy, the content finalizer removed. A group snapshot whose create was
// recorded but never reached the status is deleted first.
func (c *Controller) deleteContent(ctx context.Context, g *groupv1.VolumeGroupSnapshotContent) error {
	driver := g.Spec.Driver
	recorded := groupHandle(g) != ""
	if g.Spec.DeletionPolicy == snapshotv1.VolumeSnapshotContentDelete && recorded {
		if err := c.deleteGroup(ctx, g); err != nil {
			c.ops.WithLabelValues(driver, "delete_failed").Inc()
			if ctx.Err() == nil {
				c.b.Log.Warn("group snapshot deletion failed; will retry", "content", g.Name, "driver", driver, "err", err)
				c.b.EventOnce(ctx, contentRef(g), corev1.EventTypeWarning, "GroupSnapshotDeleteError", kube.FailureOf("DeleteVolumeGroupSnapshot", err), "Failed to delete group snapshot: %v", err)
			}
			return err
		}
		cleared, err := c.patchStatus(ctx, g, func(st *groupv1.VolumeGroupSnapshotContentStatus) *groupv1.VolumeGroupSnapshotContentStatus {
			st.VolumeGroupSnapshotHandle, st.ReadyToUse, st.CreationTime, st.Error = nil, nil, nil, nil
			return st
		})
		if err != nil {
			if ctx.Err() == nil {
				c.b.EventOnce(ctx, contentRef(g), corev1.EventTypeWarning, "GroupSnapshotDeleteError", "clear status", "Failed to clear content status: %v", err)
			}
			return fmt.Errorf("group snapshot of content %s deleted; clear its status: %w", g.Name, err)
		}
		g = cleared
		// Counted now: a retry after a failed finalizer removal finds the
		// status cleared and must not count it again, nor as retained.
		c.ops.WithLabelValues(driver, "deleted").Inc()
		c.b.Log.Info("group snapshot deleted", "content", g.Name, "driver", driver)
	}
	if len(g.Spec.Source.VolumeHandles) > 0 && g.Spec.VolumeGroupSnapshotRef.UID != "" && !recorded {
		name := groupSnapshotName(c.b.Cfg, g)
		e, ok, err := c.intents.Lookup(ctx, name)
		if err != nil {
			return fmt.Errorf("content %s: read the group snapshot intent record: %w", g.Name, err)
		}
		if ok && e.ContentUID == string(g.UID) {
			c.undo(ctx, e, "its VolumeGroupSnapshotContent is deleted before its status recorded a group snapshot")
			if c.intents.Has(name) {
				c.ops.WithLabelValues(driver, "delete_failed").Inc()
				return fmt.Errorf("content %s: the group snapshot its CreateVolumeGroupSnapshot may have made is not deleted yet", g.Name)
			}
		}
	}
	if err := c.removeFinalizer(ctx, g); err != nil {
		return fmt.Errorf("remove finalizer %s from content %s: %w", ContentFinalizer, g.Name, err)
	}
	if g.Spec.DeletionPolicy == snapshotv1.VolumeSnapshotContentRetain {
		c.ops.WithLabelValues(driver, "retained").Inc()
	}
	c.b.ForgetEvents(g.UID)
	return nil
}

// deleteGroup calls DeleteVolumeGroupSnapshot for the content's group.
func (c *Controller) deleteGroup(ctx context.Context, g *groupv1.VolumeGroupSnapshotContent) error {
	driver, handle, ids := g.Spec.Driver, groupHandle(g), memberIDs(g)
	if len(ids) == 0 {
		return fmt.Errorf("cannot delete group snapshot %s of content %s: no snapshots found in the group snapshot", handle, g.Name)
	}
	ref, src, err := secretKeys.Remembered(g)
	if err != nil {
		return err
	}
	conn, err := c.conn(driver)
	if err != nil {
		return err
	}
	creds, err := c.b.FetchSecret(ctx, c.secretUse(g, ref, src, policy.OpDeleteVolumeGroupSnapshot))
	if err != nil {
		return err
	}
	callCtx, cancel := c.b.CallContext(ctx, driver, "DeleteVolumeGroupSnapshot")
	defer cancel()
	if _, err := csi.NewGroupControllerClient(conn).DeleteVolumeGroupSnapshot(callCtx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: handle, SnapshotIds: ids, Secrets: creds}); err != nil {
		return fmt.Errorf("driver %s: DeleteVolumeGroupSnapshot %s: %w", driver, handle, err)
	}
	return nil
}
