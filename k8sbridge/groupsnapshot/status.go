package groupsnapshot

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	groupv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/secrets"
	"github.com/csibroker/csibroker/policy"
)

// patchMeta writes change's changes to the content's metadata as a merge
// patch carrying its resourceVersion; no write when nothing changes.
func (c *Controller) patchMeta(ctx context.Context, g *groupv1.VolumeGroupSnapshotContent, change func(*groupv1.VolumeGroupSnapshotContent)) (*groupv1.VolumeGroupSnapshotContent, error) {
	cur := g.DeepCopy()
	change(cur)
	patch, err := kube.MergePatch(g, cur, g.ResourceVersion)
	if err != nil || patch == nil {
		return g, err
	}
	return c.client.GroupsnapshotV1().VolumeGroupSnapshotContents().Patch(ctx, g.Name, types.MergePatchType, patch, metav1.PatchOptions{})
}

// patchStatus is patchMeta for the status subresource.
func (c *Controller) patchStatus(ctx context.Context, g *groupv1.VolumeGroupSnapshotContent, change func(*groupv1.VolumeGroupSnapshotContentStatus) *groupv1.VolumeGroupSnapshotContentStatus) (*groupv1.VolumeGroupSnapshotContent, error) {
	cur := g.DeepCopy()
	cur.Status = change(cur.Status)
	patch, err := kube.MergePatch(g, cur, g.ResourceVersion)
	if err != nil || patch == nil {
		return g, err
	}
	return c.client.GroupsnapshotV1().VolumeGroupSnapshotContents().Patch(ctx, g.Name, types.MergePatchType, patch, metav1.PatchOptions{}, "status")
}

// writeStatus records a group snapshot in the content's status as
// csi-snapshotter does: the handle and creation time once, readyToUse as
// the driver says (an error is cleared when it becomes ready), and the
// members (volumeSnapshotInfoList: each volume's snapshot, its creation
// time, readiness and restore size) once, from the first answer that
// names them; the snapshot-controller makes the member VolumeSnapshots
// and their contents from that list.
func (c *Controller) writeStatus(ctx context.Context, g *groupv1.VolumeGroupSnapshotContent, handle string, ready bool, created time.Time, members []*csi.Snapshot) (*groupv1.VolumeGroupSnapshotContent, error) {
	return c.patchStatus(ctx, g, func(st *groupv1.VolumeGroupSnapshotContentStatus) *groupv1.VolumeGroupSnapshotContentStatus {
		if st == nil {
			st = &groupv1.VolumeGroupSnapshotContentStatus{}
		}
		if st.VolumeGroupSnapshotHandle == nil {
			st.VolumeGroupSnapshotHandle = &handle
		}
		if st.ReadyToUse == nil || *st.ReadyToUse != ready {
			st.ReadyToUse = &ready
			if ready {
				st.Error = nil
			}
		}
		if st.CreationTime == nil {
			at := metav1.NewTime(created)
			st.CreationTime = &at
		}
		if len(st.VolumeSnapshotInfoList) == 0 {
			for _, s := range members {
				st.VolumeSnapshotInfoList = append(st.VolumeSnapshotInfoList, memberInfo(s))
			}
		}
		return st
	})
}

// memberInfo is one member's entry, in csi-snapshotter's units (creation
// time in nanoseconds; no restore size for a size of 0).
func memberInfo(s *csi.Snapshot) groupv1.VolumeSnapshotInfo {
	ready := s.GetReadyToUse()
	info := groupv1.VolumeSnapshotInfo{VolumeHandle: s.GetSourceVolumeId(), SnapshotHandle: s.GetSnapshotId(), ReadyToUse: &ready}
	if t := s.GetCreationTime(); t != nil {
		at := t.AsTime().UnixNano()
		info.CreationTime = &at
	}
	if n := s.GetSizeBytes(); n != 0 {
		info.RestoreSize = &n
	}
	return info
}

// writeError sets the status error (and readyToUse false), unless the
// status says msg already.
func (c *Controller) writeError(ctx context.Context, g *groupv1.VolumeGroupSnapshotContent, msg string) error {
	if st := g.Status; st != nil && st.Error != nil && st.Error.Message != nil && *st.Error.Message == msg {
		return nil
	}
	_, err := c.patchStatus(ctx, g, func(st *groupv1.VolumeGroupSnapshotContentStatus) *groupv1.VolumeGroupSnapshotContentStatus {
		if st == nil {
			st = &groupv1.VolumeGroupSnapshotContentStatus{}
		}
		no, now := false, metav1.Now()
		st.ReadyToUse, st.Error = &no, &snapshotv1.VolumeSnapshotError{Time: &now, Message: &msg}
		return st
	})
	return err
}

// settled: a ready content; the being-created mark left by a failed write
// goes, and so does an entry left in the record.
func (c *Controller) settled(ctx context.Context, g *groupv1.VolumeGroupSnapshotContent) error {
	if len(g.Spec.Source.VolumeHandles) > 0 && g.Spec.VolumeGroupSnapshotRef.UID != "" {
		if name := groupSnapshotName(c.b.Cfg, g); c.intents.Has(name) {
			c.intents.Remove(name)
		}
	}
	_, err := c.patchMeta(ctx, g, func(m *groupv1.VolumeGroupSnapshotContent) { delete(m.Annotations, AnnBeingCreated) })
	return err
}

// refresh asks GetVolumeGroupSnapshot for a group snapshot the content
// names (a pre-provisioned content's spec.source.groupSnapshotHandles, or
// a dynamic content's recorded handle while it is not ready) and writes
// the status, with the class's group-snapshotter-get secret.
func (c *Controller) refresh(ctx context.Context, g *groupv1.VolumeGroupSnapshotContent) error {
	driver := g.Spec.Driver
	fail := func(result string, err error) error {
		c.ops.WithLabelValues(driver, result).Inc()
		if ctx.Err() == nil {
			c.reportError(ctx, g, "GroupSnapshotContentCheckandUpdateFailed", "Failed to check and update group snapshot content", err)
		}
		return err
	}
	handle, ids := groupHandle(g), memberIDs(g)
	if pre := g.Spec.Source.GroupSnapshotHandles; pre != nil {
		handle = pre.VolumeGroupSnapshotHandle
	}
	if len(ids) == 0 {
		return fail("not_called", fmt.Errorf("cannot get group snapshot %s of content %s: no snapshots found in the group snapshot content", handle, g.Name))
	}
	class, err := c.classOf(g)
	if err != nil {
		return fail("not_called", err)
	}
	use := c.secretUse(g, nil, policy.Source{}, policy.OpGetVolumeGroupSnapshot)
	if class != nil {
		if use.Ref, err = secrets.SnapshotRef(secrets.GroupSnapshotterGet, class.Parameters, g.Name, nil); err != nil {
			return fail("not_called", fmt.Errorf("VolumeGroupSnapshotClass %s: %w", class.Name, err))
		}
		use.Source = secrets.SnapshotPolicySource(secrets.GroupSnapshotterGet, class.Parameters)
	}
	if err := c.checkDriver(ctx, driver); err != nil {
		return fail("not_called", err)
	}
	conn, err := c.conn(driver)
	if err != nil {
		return fail("not_called", err)
	}
	creds, err := c.b.FetchSecret(ctx, use)
	if err != nil {
		return fail("not_called", err)
	}
	callCtx, cancel := c.b.CallContext(ctx, driver, "GetVolumeGroupSnapshot")
	resp, err := csi.NewGroupControllerClient(conn).GetVolumeGroupSnapshot(callCtx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: handle, SnapshotIds: ids, Secrets: creds})
	cancel()
	if err != nil {
		return fail("failed", fmt.Errorf("failed to get group snapshot %s: %s", handle, kube.StatusText(err)))
	}
	gs := resp.GetGroupSnapshot()
	var members []*csi.Snapshot
	if g.Spec.Source.GroupSnapshotHandles == nil {
		members = gs.GetSnapshots() // csi-snapshotter lists no members of a pre-provisioned group
	}
	if _, err := c.writeStatus(ctx, g, handle, gs.GetReadyToUse(), creationTime(gs), members); err != nil {
		return fail("failed", fmt.Errorf("record group snapshot %s in the status of content %s: %w", handle, g.Name, err))
	}
	c.b.ForgetEvents(g.UID)
	if !gs.GetReadyToUse() {
		c.ops.WithLabelValues(driver, "not_ready").Inc()
		return errNotReady
	}
	c.ops.WithLabelValues(driver, "imported").Inc()
	c.b.Log.Info("group snapshot content ready", "content", g.Name, "driver", driver, "group_snapshot_id", handle)
	return nil
}

// memberIDs are the snapshot IDs of the content's members: the status's
// list (dynamic), else the pre-provisioned spec's.
func memberIDs(g *groupv1.VolumeGroupSnapshotContent) []string {
	var ids []string
	if g.Status != nil {
		for _, m := range g.Status.VolumeSnapshotInfoList {
			ids = append(ids, m.SnapshotHandle)
		}
	}
	if len(ids) == 0 && g.Spec.Source.GroupSnapshotHandles != nil {
		ids = slices.Clone(g.Spec.Source.GroupSnapshotHandles.VolumeSnapshotHandles)
	}
	return ids
}

// removeFinalizer takes the snapshot-controller's content finalizer off.
func (c *Controller) removeFinalizer(ctx context.Context, g *groupv1.VolumeGroupSnapshotContent) error {
	if !slices.Contains(g.Finalizers, ContentFinalizer) {
		return nil
	}
	_, err := c.patchMeta(ctx, g, func(m *groupv1.VolumeGroupSnapshotContent) {
		m.Finalizers = kube.RemoveString(m.Finalizers, ContentFinalizer)
	})
	return err
}
