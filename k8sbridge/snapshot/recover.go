package snapshot

import (
	"bytes"
	"context"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/internal/budget"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/snapshots"
	"github.com/csibroker/csibroker/policy"
)

// Entry is one CreateSnapshot in flight, recorded before the call so that
// a snapshot the driver made is never forgotten: if the broker dies, or
// the content vanishes, before the content's status records the snapshot,
// recovery asks the same CreateSnapshot again (idempotent by name) to learn
// the snapshot's ID, and deletes it.
type Entry struct {
	// SnapshotName is the CSI name (<prefix>-<VolumeSnapshot UID>): the
	// entry's key.
	SnapshotName string `json:"snapshotName"`
	Driver       string `json:"driver"`
	ContentName  string `json:"contentName"`
	ContentUID   string `json:"contentUID"`
	// The VolumeSnapshot the content is bound to.
	SnapshotNamespace string `json:"snapshotNamespace"`
	SnapshotRefName   string `json:"snapshotRefName"`
	SnapshotUID       string `json:"snapshotUID"`
	// Request is the CreateSnapshotRequest without secrets,
	// protobuf-encoded, to be asked again exactly.
	Request []byte `json:"request"`
	// Secret is the snapshotter secret's reference (never its content)
	// and where it came from, decided again by the policy on recovery.
	Secret       *corev1.SecretReference `json:"secret,omitempty"`
	SecretSource *policy.Source          `json:"secretSource,omitempty"`
	// NamespaceLabels of the VolumeSnapshot's namespace, for a decision
	// after the namespace is gone (nil: unknown).
	NamespaceLabels map[string]string `json:"namespaceLabels"`
	// Node is the node-local driver's node whose proxy makes the snapshot.
	Node    string      `json:"node,omitempty"`
	Created metav1.Time `json:"created"`
}

// Key is the entry's key in the record.
func (e Entry) Key() string { return e.SnapshotName }

// DriverName is the driver the snapshot is made by.
func (e Entry) DriverName() string { return e.Driver }

// Bound is the content the call was made for, and its VolumeSnapshot's UID.
func (e Entry) Bound() (content, contentUID, refUID string) {
	return e.ContentName, e.ContentUID, e.SnapshotUID
}

// snapshotName is csi-snapshotter's name for the snapshot of vsc:
// <prefix>-<VolumeSnapshot UID>, the UID without dashes and cut to
// SnapshotNameUUIDLength when that is positive.
func snapshotName(cfg kube.Config, vsc *snapshotv1.VolumeSnapshotContent) string {
	return snapshots.Name(cfg.SnapshotNamePrefix, string(vsc.Spec.VolumeSnapshotRef.UID), cfg.SnapshotNameUUIDLength)
}

// recovery settles the record's entries at the start of the term, every
// RecoveryInterval and when a content with an entry goes.
func (c *Controller) recovery() *snapshots.Recovery[Entry] {
	return &snapshots.Recovery[Entry]{What: "snapshot", Record: c.intents, Inflight: &c.inflight, Foreign: c.b.Foreign,
		Settle: snapshots.Settler(c.frame, c.intents, c.undo), Log: c.b.Log}
}

func (c *Controller) recoveryLoop(ctx context.Context) {
	c.recovery().Loop(ctx, c.b.Cfg.RecoveryInterval, c.recoverNow)
}

func (c *Controller) recoverAll(ctx context.Context) { c.recovery().All(ctx) }

// undo deletes the snapshot an entry's CreateSnapshot may have made:
// asked again, the driver names it (or says it made none), and it is
// deleted. The entry goes once the snapshot is known gone.
func (c *Controller) undo(ctx context.Context, e Entry, why string) {
	log := c.b.Log.With("snapshot", e.SnapshotName, "driver", e.Driver, "content", e.ContentName, "node", e.Node)
	ctx = budget.WithDriver(ctx, e.Driver)
	req := &csi.CreateSnapshotRequest{}
	if err := proto.Unmarshal(e.Request, req); err != nil {
		log.Error("snapshot recovery: unreadable request in the intent record; left for an administrator", "err", err)
		c.recovered.WithLabelValues(e.Driver, "failed").Inc()
		return
	}
	conn, err := c.b.DriverConn(e.Driver, e.Node)
	if err != nil {
		log.Warn("snapshot recovery: driver not reachable; will retry", "err", err)
		c.recovered.WithLabelValues(e.Driver, "failed").Inc()
		return
	}
	use := kube.SecretUse{Driver: e.Driver, Op: policy.OpCreateSnapshot, Ref: e.Secret, RecordedNSLabels: e.NamespaceLabels,
		Requester: policy.Requester{Kind: policy.KindVolumeSnapshot, Namespace: e.SnapshotNamespace, Name: e.SnapshotRefName, Node: e.Node}}
	if e.SecretSource != nil {
		use.Source = *e.SecretSource
	}
	secrets, err := c.b.FetchSecret(ctx, use)
	if err != nil {
		log.Warn("snapshot recovery: snapshotter secret not available; will retry", "err", err)
		c.recovered.WithLabelValues(e.Driver, "failed").Inc()
		return
	}
	req.Secrets = secrets
	callCtx, cancel := c.b.CallContext(ctx, e.Driver, "CreateSnapshot")
	resp, err := csi.NewControllerClient(conn).CreateSnapshot(callCtx, req)
	cancel()
	if err != nil {
		if ctx.Err() == nil && isFinal(err) {
			// The driver is not making it and did not make it.
			log.Info("snapshot recovery: the driver made no snapshot; entry dropped", "why", why, "answer", kube.StatusText(err))
			c.intents.Remove(e.Key())
			c.recovered.WithLabelValues(e.Driver, "not_made").Inc()
			return
		}
		log.Warn("snapshot recovery: CreateSnapshot asked again failed; will retry", "err", kube.StatusText(err))
		c.recovered.WithLabelValues(e.Driver, "failed").Inc()
		return
	}
	id := resp.GetSnapshot().GetSnapshotId()
	use.Op = policy.OpDeleteSnapshot
	if secrets, err = c.b.FetchSecret(ctx, use); err != nil {
		log.Warn("snapshot recovery: snapshotter secret not available for DeleteSnapshot; will retry", "snapshot_id", id, "err", err)
		c.recovered.WithLabelValues(e.Driver, "failed").Inc()
		return
	}
	callCtx, cancel = c.b.CallContext(ctx, e.Driver, "DeleteSnapshot")
	_, err = csi.NewControllerClient(conn).DeleteSnapshot(callCtx, &csi.DeleteSnapshotRequest{SnapshotId: id, Secrets: secrets})
	cancel()
	if err != nil {
		log.Warn("snapshot recovery: DeleteSnapshot failed; will retry", "snapshot_id", id, "err", kube.StatusText(err))
		c.recovered.WithLabelValues(e.Driver, "failed").Inc()
		return
	}
	c.intents.Remove(e.Key())
	c.recovered.WithLabelValues(e.Driver, "deleted").Inc()
	log.Info("snapshot recovery: deleted a snapshot no content records", "snapshot_id", id, "why", why)
}

// sameCall reports whether two entries record the same call of one
// content (a retry needs no new write; a changed request does, since
// recovery asks again exactly what is recorded).
func sameCall(a, b Entry) bool {
	return a.ContentUID == b.ContentUID && a.Node == b.Node && bytes.Equal(a.Request, b.Request) &&
		(a.Secret == nil) == (b.Secret == nil) && (a.Secret == nil || *a.Secret == *b.Secret)
}

// recordEntry is the entry of plan p's CreateSnapshot.
func (c *Controller) recordEntry(ctx context.Context, p *plan) (Entry, error) {
	raw, err := proto.MarshalOptions{Deterministic: true}.Marshal(p.req)
	if err != nil {
		return Entry{}, fmt.Errorf("encode the CreateSnapshot request: %w", err)
	}
	ref := p.vsc.Spec.VolumeSnapshotRef
	e := Entry{SnapshotName: p.req.GetName(), Driver: p.driver, ContentName: p.vsc.Name, ContentUID: string(p.vsc.UID),
		SnapshotNamespace: ref.Namespace, SnapshotRefName: ref.Name, SnapshotUID: string(ref.UID),
		Request: raw, Secret: p.secret, Node: p.node, Created: metav1.Now(),
		NamespaceLabels: c.b.ReadNamespaceLabels(ctx, ref.Namespace)}
	if p.secret != nil {
		src := p.secretSource
		e.SecretSource = &src
	}
	return e, nil
}
