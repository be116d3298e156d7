package groupsnapshot

import (
	"bytes"
	"context"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	groupv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/internal/budget"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/snapshots"
	"github.com/csibroker/csibroker/policy"
)

// Entry is one CreateVolumeGroupSnapshot in flight, recorded before the
// call so that a group snapshot the driver made is never forgotten: if the
// broker dies, or the content vanishes, before the content's status
// records it, recovery asks the same call again (idempotent by name) to
// learn the group's ID and members, and deletes it.
type Entry struct {
	// Name is the CSI name (<prefix>-<VolumeGroupSnapshot UID>): the key.
	Name        string `json:"name"`
	Driver      string `json:"driver"`
	ContentName string `json:"contentName"`
	ContentUID  string `json:"contentUID"`
	// The VolumeGroupSnapshot the content is bound to.
	GroupNamespace string `json:"groupNamespace"`
	GroupName      string `json:"groupName"`
	GroupUID       string `json:"groupUID"`
	// Request is the CreateVolumeGroupSnapshotRequest without secrets,
	// protobuf-encoded, to be asked again exactly.
	Request []byte `json:"request"`
	// Secret is the group snapshotter secret's reference (never its
	// content), decided again by the policy on recovery.
	Secret       *corev1.SecretReference `json:"secret,omitempty"`
	SecretSource *policy.Source          `json:"secretSource,omitempty"`
	// NamespaceLabels of the VolumeGroupSnapshot's namespace, for a
	// decision after the namespace is gone (nil: unknown).
	NamespaceLabels map[string]string `json:"namespaceLabels"`
	Created         metav1.Time       `json:"created"`
}

// Key is the entry's key in the record.
func (e Entry) Key() string { return e.Name }

// DriverName is the driver the group snapshot is made by.
func (e Entry) DriverName() string { return e.Driver }

// Bound is the content the call was made for, and its
// VolumeGroupSnapshot's UID.
func (e Entry) Bound() (content, contentUID, refUID string) {
	return e.ContentName, e.ContentUID, e.GroupUID
}

// groupSnapshotName is csi-snapshotter's name for the group snapshot of
// g: <prefix>-<VolumeGroupSnapshot UID>, the UID without dashes and cut to
// GroupSnapshotNameUUIDLength when that is positive.
func groupSnapshotName(cfg kube.Config, g *groupv1.VolumeGroupSnapshotContent) string {
	return snapshots.Name(cfg.GroupSnapshotNamePrefix, string(g.Spec.VolumeGroupSnapshotRef.UID), cfg.GroupSnapshotNameUUIDLength)
}

// recovery settles the record's entries at the start of the term, every
// RecoveryInterval and when a content with an entry goes.
func (c *Controller) recovery() *snapshots.Recovery[Entry] {
	return &snapshots.Recovery[Entry]{What: "group snapshot", Record: c.intents, Inflight: &c.inflight, Foreign: c.b.Foreign,
		Settle: snapshots.Settler(c.frame, c.intents, c.undo), Log: c.b.Log}
}

func (c *Controller) recoveryLoop(ctx context.Context) {
	c.recovery().Loop(ctx, c.b.Cfg.RecoveryInterval, c.recoverNow)
}

func (c *Controller) recoverAll(ctx context.Context) { c.recovery().All(ctx) }

// undo deletes the group snapshot an entry's call may have made: asked
// again, the driver names it (or says it made none), and it is deleted.
// The entry goes once the group snapshot is known gone.
func (c *Controller) undo(ctx context.Context, e Entry, why string) {
	log := c.b.Log.With("group_snapshot", e.Name, "driver", e.Driver, "content", e.ContentName)
	ctx = budget.WithDriver(ctx, e.Driver)
	failed := func(msg string, args ...any) {
		log.Warn("group snapshot recovery: "+msg+"; will retry", args...)
		c.recovered.WithLabelValues(e.Driver, "failed").Inc()
	}
	req := &csi.CreateVolumeGroupSnapshotRequest{}
	if err := proto.Unmarshal(e.Request, req); err != nil {
		log.Error("group snapshot recovery: unreadable request in the intent record; left for an administrator", "err", err)
		c.recovered.WithLabelValues(e.Driver, "failed").Inc()
		return
	}
	conn, err := c.b.DriverConn(e.Driver, "")
	if err != nil {
		failed("driver not reachable", "err", err)
		return
	}
	use := kube.SecretUse{Driver: e.Driver, Op: policy.OpCreateVolumeGroupSnapshot, Ref: e.Secret, RecordedNSLabels: e.NamespaceLabels,
		Requester: policy.Requester{Kind: policy.KindVolumeGroupSnapshot, Namespace: e.GroupNamespace, Name: e.GroupName}}
	if e.SecretSource != nil {
		use.Source = *e.SecretSource
	}
	if req.Secrets, err = c.b.FetchSecret(ctx, use); err != nil {
		failed("group snapshotter secret not available", "err", err)
		return
	}
	callCtx, cancel := c.b.CallContext(ctx, e.Driver, "CreateVolumeGroupSnapshot")
	resp, err := csi.NewGroupControllerClient(conn).CreateVolumeGroupSnapshot(callCtx, req)
	cancel()
	if err != nil {
		if ctx.Err() == nil && snapshots.IsFinal(err) {
			log.Info("group snapshot recovery: the driver made no group snapshot; entry dropped", "why", why, "answer", kube.StatusText(err))
			c.intents.Remove(e.Key())
			c.recovered.WithLabelValues(e.Driver, "not_made").Inc()
			return
		}
		failed("CreateVolumeGroupSnapshot asked again failed", "err", kube.StatusText(err))
		return
	}
	gs := resp.GetGroupSnapshot()
	var ids []string
	for _, s := range gs.GetSnapshots() {
		ids = append(ids, s.GetSnapshotId())
	}
	use.Op = policy.OpDeleteVolumeGroupSnapshot
	secrets, err := c.b.FetchSecret(ctx, use)
	if err != nil {
		failed("group snapshotter secret not available for DeleteVolumeGroupSnapshot", "group_snapshot_id", gs.GetGroupSnapshotId(), "err", err)
		return
	}
	callCtx, cancel = c.b.CallContext(ctx, e.Driver, "DeleteVolumeGroupSnapshot")
	_, err = csi.NewGroupControllerClient(conn).DeleteVolumeGroupSnapshot(callCtx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: gs.GetGroupSnapshotId(), SnapshotIds: ids, Secrets: secrets})
	cancel()
	if err != nil {
		failed("DeleteVolumeGroupSnapshot failed", "group_snapshot_id", gs.GetGroupSnapshotId(), "err", kube.StatusText(err))
		return
	}
	c.intents.Remove(e.Key())
	c.recovered.WithLabelValues(e.Driver, "deleted").Inc()
	log.Info("group snapshot recovery: deleted a group snapshot no content records", "group_snapshot_id", gs.GetGroupSnapshotId(), "snapshots", len(ids), "why", why)
}

// sameCall reports whether two entries record the same call of one
// content (a retry needs no new write).
func sameCall(a, b Entry) bool {
	return a.ContentUID == b.ContentUID && bytes.Equal(a.Request, b.Request) &&
		(a.Secret == nil) == (b.Secret == nil) && (a.Secret == nil || *a.Secret == *b.Secret)
}

// recordEntry is the entry of plan p's CreateVolumeGroupSnapshot.
func (c *Controller) recordEntry(ctx context.Context, p *plan) (Entry, error) {
	raw, err := proto.MarshalOptions{Deterministic: true}.Marshal(p.req)
	if err != nil {
		return Entry{}, fmt.Errorf("encode the CreateVolumeGroupSnapshot request: %w", err)
	}
	ref := p.g.Spec.VolumeGroupSnapshotRef
	e := Entry{Name: p.req.GetName(), Driver: p.driver, ContentName: p.g.Name, ContentUID: string(p.g.UID),
		GroupNamespace: ref.Namespace, GroupName: ref.Name, GroupUID: string(ref.UID),
		Request: raw, Secret: p.secret, Created: metav1.Now(),
		NamespaceLabels: c.b.ReadNamespaceLabels(ctx, ref.Namespace)}
	if p.secret != nil {
		src := p.secretSource
		e.SecretSource = &src
	}
	return e, nil
}
