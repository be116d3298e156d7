package snapshot

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/secrets"
	"github.com/csibroker/csibroker/policy"
)

// patchMeta writes change's changes to the content's metadata as a merge
// patch carrying its resourceVersion (a conflict retries with the newer
// content); no write when nothing changes.
func (c *Controller) patchMeta(ctx context.Context, vsc *snapshotv1.VolumeSnapshotContent, change func(*snapshotv1.VolumeSnapshotContent)) (*snapshotv1.VolumeSnapshotContent, error) {
	cur := vsc.DeepCopy()
	change(cur)
	patch, err := kube.MergePatch(vsc, cur, vsc.ResourceVersion)
	if err != nil || patch == nil {
		return vsc, err
	}
	return c.client.SnapshotV1().VolumeSnapshotContents().Patch(ctx, vsc.Name, types.MergePatchType, patch, metav1.PatchOptions{})
}

// patchStatus is patchMeta for the status subresource.
func (c *Controller) patchStatus(ctx context.Context, vsc *snapshotv1.VolumeSnapshotContent, change func(*snapshotv1.VolumeSnapshotContentStatus) *snapshotv1.VolumeSnapshotContentStatus) (*snapshotv1.VolumeSnapshotContent, error) {
	cur := vsc.DeepCopy()
	cur.Status = change(cur.Status)
	patch, err := kube.MergePatch(vsc, cur, vsc.ResourceVersion)
	if err != nil || patch == nil {
		return vsc, err
	}
	return c.client.SnapshotV1().VolumeSnapshotContents().Patch(ctx, vsc.Name, types.MergePatchType, patch, metav1.PatchOptions{}, "status")
}

// writeStatus records a snapshot in the content's status as csi-snapshotter
// does: the handle, creation time and restore size once, readyToUse as the
// driver says (an error is cleared when the snapshot becomes ready).
func (c *Controller) writeStatus(ctx context.Context, vsc *snapshotv1.VolumeSnapshotContent, handle string, ready bool, created time.Time, size int64, group string) (*snapshotv1.VolumeSnapshotContent, error) {
	return c.patchStatus(ctx, vsc, func(st *snapshotv1.VolumeSnapshotContentStatus) *snapshotv1.VolumeSnapshotContentStatus {
		at := created.UnixNano()
		if st == nil {
			st = &snapshotv1.VolumeSnapshotContentStatus{}
		}
		if st.SnapshotHandle == nil {
			st.SnapshotHandle = &handle
		}
		if st.ReadyToUse == nil || *st.ReadyToUse != ready {
			st.ReadyToUse = &ready
			if ready {
				st.Error = nil
			}
		}
		if st.CreationTime == nil {
			st.CreationTime = &at
		}
		if st.RestoreSize == nil && size > 0 {
			st.RestoreSize = &size
		}
		if st.VolumeGroupSnapshotHandle == nil && group != "" {
			st.VolumeGroupSnapshotHandle = &group
		}
		return st
	})
}

// writeError sets the status error (and readyToUse false), unless the
// status says msg already.
func (c *Controller) writeError(ctx context.Context, vsc *snapshotv1.VolumeSnapshotContent, msg string) error {
	if st := vsc.Status; st != nil && st.Error != nil && st.Error.Message != nil && *st.Error.Message == msg {
		return nil
	}
	_, err := c.patchStatus(ctx, vsc, func(st *snapshotv1.VolumeSnapshotContentStatus) *snapshotv1.VolumeSnapshotContentStatus {
		if st == nil {
			st = &snapshotv1.VolumeSnapshotContentStatus{}
		}
		no, now := false, metav1.Now()
		st.ReadyToUse, st.Error = &no, &snapshotv1.VolumeSnapshotError{Time: &now, Message: &msg}
		return st
	})
	return err
}

// settled: a ready content; the being-created mark left by a failed write
// goes, and so does an entry left in the record.
func (c *Controller) settled(ctx context.Context, vsc *snapshotv1.VolumeSnapshotContent) error {
	if vsc.Spec.Source.VolumeHandle != nil && vsc.Spec.VolumeSnapshotRef.UID != "" {
		if name := snapshotName(c.b.Cfg, vsc); c.intents.Has(name) {
			c.intents.Remove(name)
		}
	}
	_, err := c.patchMeta(ctx, vsc, func(m *snapshotv1.VolumeSnapshotContent) { delete(m.Annotations, AnnBeingCreated) })
	return err
}

// refresh fills a pre-provisioned content's status (or a group member's)
// from ListSnapshots by the snapshot's ID, with the class's
// snapshotter-list secret; a driver without LIST_SNAPSHOTS makes the
// snapshot ready as it is named, as csi-snapshotter does.
func (c *Controller) refresh(ctx context.Context, vsc *snapshotv1.VolumeSnapshotContent) error {
	driver := vsc.Spec.Driver
	handle := ""
	if vsc.Spec.Source.SnapshotHandle != nil {
		handle = *vsc.Spec.Source.SnapshotHandle
	} else {
		handle = *vsc.Status.SnapshotHandle
	}
	fail := func(result string, err error) error {
		c.ops.WithLabelValues(driver, result).Inc()
		if ctx.Err() == nil {
			c.reportError(ctx, vsc, "SnapshotContentCheckandUpdateFailed", "Failed to check and update snapshot content", err)
		}
		return err
	}
	caps, err := c.b.Caps.Get(ctx, driver)
	if err != nil {
		c.b.Caps.Forget(driver)
		return fail("not_called", drivers.NewUnreachable(fmt.Errorf("driver %s is not reachable: %w", driver, err)))
	}
	ready, created, size, group := true, time.Now(), int64(0), ""
	if caps.ListSnapshots {
		snap, err := c.listSnapshot(ctx, vsc, handle)
		if err != nil {
			return fail("failed", err)
		}
		ready, created, size, group = snap.GetReadyToUse(), creationTime(snap), snap.GetSizeBytes(), snap.GetGroupSnapshotId()
	}
	if _, err := c.writeStatus(ctx, vsc, handle, ready, created, size, group); err != nil {
		return fail("failed", fmt.Errorf("record snapshot %s in the status of content %s: %w", handle, vsc.Name, err))
	}
	c.b.ForgetEvents(vsc.UID)
	if !ready {
		c.ops.WithLabelValues(driver, "not_ready").Inc()
		return errNotReady
	}
	c.ops.WithLabelValues(driver, "imported").Inc()
	c.b.Log.Info("snapshot content imported", "content", vsc.Name, "driver", driver, "snapshot_id", handle)
	return nil
}

// listSnapshot asks the driver for snapshot id (ListSnapshots by ID).
func (c *Controller) listSnapshot(ctx context.Context, vsc *snapshotv1.VolumeSnapshotContent, id string) (*csi.Snapshot, error) {
	driver := vsc.Spec.Driver
	p := &plan{vsc: vsc, driver: driver}
	if n := vsc.Spec.VolumeSnapshotClassName; n != nil && *n != "" {
		class, err := c.classes.Get(*n)
		if err != nil {
			return nil, fmt.Errorf("VolumeSnapshotClass %s of content %s: %w", *n, vsc.Name, err)
		}
		if class.Driver != driver {
			return nil, fmt.Errorf("VolumeSnapshotClass %s is of driver %s, not %s (the content's spec.driver)", *n, class.Driver, driver)
		}
		if p.secret, err = secrets.SnapshotRef(secrets.SnapshotterList, class.Parameters, vsc.Name, nil); err != nil {
			return nil, fmt.Errorf("VolumeSnapshotClass %s: %w", *n, err)
		}
		p.secretSource = secrets.SnapshotPolicySource(secrets.SnapshotterList, class.Parameters)
	}
	if c.b.Cfg.Drivers.NodeLocal(driver) {
		if p.node = c.nodeOf(vsc); p.node == "" {
			return nil, fmt.Errorf("snapshot %s of node-local driver %s: content %s names no node (annotation %s)", id, driver, vsc.Name, AnnNode)
		}
	}
	conn, err := c.b.DriverConn(driver, p.node)
	if err != nil {
		return nil, drivers.NewUnreachable(err)
	}
	use := c.secretUse(p, policy.OpListSnapshots)
	if vsc.Spec.VolumeSnapshotRef.UID == "" {
		use.Requester = policy.Requester{Kind: policy.KindVolumeSnapshotContent, Name: vsc.Name, Node: p.node}
	}
	creds, err := c.b.FetchSecret(ctx, use)
	if err != nil {
		return nil, err
	}
	callCtx, cancel := c.b.CallContext(ctx, driver, "ListSnapshots")
	defer cancel()
	resp, err := csi.NewControllerClient(conn).ListSnapshots(callCtx, &csi.ListSnapshotsRequest{SnapshotId: id, Secrets: creds})
	if err != nil {
		return nil, fmt.Errorf("failed to list snapshot %s: %s", id, kube.StatusText(err))
	}
	for _, e := range resp.GetEntries() {
		if e.GetSnapshot().GetSnapshotId() == id {
			return e.GetSnapshot(), nil
		}
	}
	return nil, fmt.Errorf("driver %s does not know snapshot %s (ListSnapshots by its ID found none)", driver, id)
}

// removeFinalizer takes the snapshot-controller's content finalizer off.
func (c *Controller) removeFinalizer(ctx context.Context, vsc *snapshotv1.VolumeSnapshotContent) error {
	if !slices.Contains(vsc.Finalizers, ContentFinalizer) {
		return nil
	}
	_, err := c.patchMeta(ctx, vsc, func(m *snapshotv1.VolumeSnapshotContent) {
		m.Finalizers = kube.RemoveString(m.Finalizers, ContentFinalizer)
	})
	return err
}
