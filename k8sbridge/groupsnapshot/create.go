package groupsnapshot

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	groupv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/snapshots"
	"github.com/csibroker/csibroker/k8sbridge/secrets"
	"github.com/csibroker/csibroker/policy"
)

// plan is everything a CreateVolumeGroupSnapshot needs, settled before
// anything is written or called.
type plan struct {
	g            *groupv1.VolumeGroupSnapshotContent
	driver       string
	conn         grpc.ClientConnInterface
	req          *csi.CreateVolumeGroupSnapshotRequest // without secrets
	secret       *corev1.SecretReference
	secretSource policy.Source
	// annotations the content is to carry while the group snapshot is
	// made: the being-created mark, and the deletion secret when it is
	// not there yet.
	annotations map[string]string
}

// create makes a dynamic group content's group snapshot: the plan, the
// intent record, the being-created mark, CreateVolumeGroupSnapshot, then
// the status with its members, as csi-snapshotter does.
func (c *Controller) create(ctx context.Context, g *groupv1.VolumeGroupSnapshotContent) error {
	p, err := c.prepare(ctx, g)
	if err != nil {
		return c.createFailed(ctx, g, "not_called", err)
	}
	creds, err := c.b.FetchSecret(ctx, c.secretUse(g, p.secret, p.secretSource, policy.OpCreateVolumeGroupSnapshot))
	if err != nil {
		return c.createFailed(ctx, g, "not_called", err)
	}
	// The group snapshot may be made by this call: its intent is durable
	// first, and the content marked, so that neither a content gone
	// meanwhile nor a broker killed after the call loses it.
	entry, err := c.recordEntry(ctx, p)
	if err == nil {
		entry, err = snapshots.Intend(ctx, c.intents, entry, sameCall)
	}
	if err != nil {
		return c.createFailed(ctx, g, "not_called", fmt.Errorf("record the group snapshot's intent: %w", err))
	}
	c.inflight.Store(entry.Name, true)
	defer c.inflight.Delete(entry.Name)
	if g, err = c.patchMeta(ctx, g, snapshots.Annotate[*groupv1.VolumeGroupSnapshotContent](p.annotations)); err != nil {
		return c.createFailed(ctx, p.g, "not_called", fmt.Errorf("mark content %s being created: %w", p.g.Name, err))
	}
	req := &csi.CreateVolumeGroupSnapshotRequest{Name: p.req.GetName(), SourceVolumeIds: p.req.GetSourceVolumeIds(), Parameters: p.req.GetParameters(), Secrets: creds}
	callCtx, cancel := c.b.CallContext(ctx, p.driver, "CreateVolumeGroupSnapshot")
	resp, err := csi.NewGroupControllerClient(p.conn).CreateVolumeGroupSnapshot(callCtx, req)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return err // the term ended: the next leader asks again
		}
		if snapshots.IsFinal(err) {
			// The driver is not making it: the mark and the intent go.
			c.intents.Remove(entry.Key())
			if cur, rerr := c.patchMeta(ctx, g, func(m *groupv1.VolumeGroupSnapshotContent) { delete(m.Annotations, AnnBeingCreated) }); rerr == nil {
				g = cur
			}
		}
		return c.createFailed(ctx, g, "failed", fmt.Errorf("failed to take group snapshot of the volumes %v: %w", g.Spec.Source.VolumeHandles, err))
	}
	gs := resp.GetGroupSnapshot()
	updated, err := c.recordCreated(ctx, g, gs)
	if apierrors.IsNotFound(err) {
		// The content went while its group snapshot was made: the group
		// snapshot goes too.
		c.undo(ctx, entry, "its VolumeGroupSnapshotContent went while CreateVolumeGroupSnapshot ran")
		return nil
	}
	if err != nil {
		// The entry stays: the next attempt asks again and gets the same
		// group snapshot, or recovery deletes it.
		return c.createFailed(ctx, g, "failed", fmt.Errorf("record group snapshot %s in the status of content %s: %w", gs.GetGroupSnapshotId(), g.Name, err))
	}
	c.intents.Remove(entry.Key())
	c.b.Event(ctx, contentRef(updated), corev1.EventTypeNormal, "GroupSnapshotCreated", "Group snapshot %s of %d volumes created by driver %s (ready to use: %t)",
		gs.GetGroupSnapshotId(), len(gs.GetSnapshots()), p.driver, gs.GetReadyToUse())
	c.b.Log.Info("group snapshot created", "content", g.Name, "driver", p.driver, "group_snapshot_id", gs.GetGroupSnapshotId(), "snapshots", len(gs.GetSnapshots()), "ready", gs.GetReadyToUse())
	if _, err := c.patchMeta(ctx, updated, func(m *groupv1.VolumeGroupSnapshotContent) { delete(m.Annotations, AnnBeingCreated) }); err != nil {
		return fmt.Errorf("remove the %s annotation from content %s: %w", AnnBeingCreated, g.Name, err)
	}
	c.b.ForgetEvents(g.UID)
	if !gs.GetReadyToUse() {
		c.ops.WithLabelValues(p.driver, "not_ready").Inc()
		return errNotReady
	}
	c.ops.WithLabelValues(p.driver, "created").Inc()
	return nil
}

// recordCreated writes the group snapshot into the content's status; a
// conflict (the content changed during the call) writes it again over what
// is there now rather than asking the driver again.
func (c *Controller) recordCreated(ctx context.Context, g *groupv1.VolumeGroupSnapshotContent, gs *csi.VolumeGroupSnapshot) (*groupv1.VolumeGroupSnapshotContent, error) {
	updated, err := c.writeStatus(ctx, g, gs.GetGroupSnapshotId(), gs.GetReadyToUse(), creationTime(gs), gs.GetSnapshots())
	if !apierrors.IsConflict(err) {
		return updated, err
	}
	fresh, err := c.client.GroupsnapshotV1().VolumeGroupSnapshotContents().Get(ctx, g.Name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	if fresh.UID != g.UID {
		return nil, apierrors.NewNotFound(groupv1.Resource("volumegroupsnapshotcontents"), g.Name)
	}
	return c.writeStatus(ctx, fresh, gs.GetGroupSnapshotId(), gs.GetReadyToUse(), creationTime(gs), gs.GetSnapshots())
}

func creationTime(gs *csi.VolumeGroupSnapshot) time.Time {
	if t := gs.GetCreationTime(); t != nil && (t.GetSeconds() != 0 || t.GetNanos() != 0) {
		return t.AsTime()
	}
	return time.Now()
}

// prepare settles a dynamic group content's CreateVolumeGroupSnapshot:
// bound, with a class of its driver, a driver that makes group snapshots,
// parameters and the secret's reference.
func (c *Controller) prepare(ctx context.Context, g *groupv1.VolumeGroupSnapshotContent) (*plan, error) {
	driver := g.Spec.Driver
	ref := g.Spec.VolumeGroupSnapshotRef
	if ref.UID == "" {
		return nil, fmt.Errorf("cannot create group snapshot: content %s is not bound to a VolumeGroupSnapshot (spec.volumeGroupSnapshotRef.uid is empty)", g.Name)
	}
	class, err := c.classOf(g)
	if err != nil {
		return nil, err
	}
	if class == nil {
		return nil, fmt.Errorf("cannot create group snapshot: content %s names no VolumeGroupSnapshotClass (a dynamic group snapshot needs one)", g.Name)
	}
	if err := c.checkDriver(ctx, driver); err != nil {
		return nil, err
	}
	params, err := snapshots.DriverParameters(class.Parameters)
	if err != nil {
		return nil, fmt.Errorf("VolumeGroupSnapshotClass %s: %w", class.Name, err)
	}
	if c.b.Cfg.ExtraCreateMetadata {
		params[ParamGroupSnapshotName], params[ParamGroupSnapshotNamespace], params[ParamGroupContentName] = ref.Name, ref.Namespace, g.Name
	}
	p := &plan{g: g, driver: driver, annotations: map[string]string{AnnBeingCreated: "yes"},
		req: &csi.CreateVolumeGroupSnapshotRequest{Name: groupSnapshotName(c.b.Cfg, g), SourceVolumeIds: g.Spec.Source.VolumeHandles, Parameters: params}}
	if p.secret, p.secretSource, err = secretKeys.Of(g, ref, class.Name, class.Parameters, p.annotations); err != nil {
		return nil, err
	}
	if p.conn, err = c.conn(driver); err != nil {
		return nil, err
	}
	return p, nil
}

// classOf is the content's VolumeGroupSnapshotClass, checked to be of its
// driver; nil when it names none.
func (c *Controller) classOf(g *groupv1.VolumeGroupSnapshotContent) (*groupv1.VolumeGroupSnapshotClass, error) {
	n := g.Spec.VolumeGroupSnapshotClassName
	if n == nil || *n == "" {
		return nil, nil
	}
	class, err := c.classes.Get(*n)
	if apierrors.IsNotFound(err) {
		return nil, fmt.Errorf("VolumeGroupSnapshotClass %s not found", *n)
	}
	if err != nil {
		return nil, err
	}
	if class.Driver != g.Spec.Driver {
		return nil, fmt.Errorf("VolumeGroupSnapshotClass %s is of driver %s, not %s (the content's spec.driver): not snapshotted", *n, class.Driver, g.Spec.Driver)
	}
	return class, nil
}

// checkDriver: the driver answers and has the group controller's
// CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT.
func (c *Controller) checkDriver(ctx context.Context, driver string) error {
	caps, err := c.b.Caps.Get(ctx, driver)
	if err != nil {
		c.b.Caps.Forget(driver)
		return drivers.NewUnreachable(fmt.Errorf("driver %s is not reachable: %w", driver, err))
	}
	if !caps.GroupSnapshot {
		return fmt.Errorf("driver %s does not make group snapshots (no GROUP_CONTROLLER_SERVICE with the CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT capability)", driver)
	}
	return nil
}

// conn is the driver's controller connection. Group snapshots of a
// node-local driver are not made: its volumes may be on several nodes,
// and a group is cut by one plugin.
func (c *Controller) conn(driver string) (grpc.ClientConnInterface, error) {
	if c.b.Cfg.Drivers.NodeLocal(driver) {
		return nil, fmt.Errorf("driver %s is node-local: the broker does not make group snapshots of node-local drivers", driver)
	}
	conn, err := c.b.DriverConn(driver, "")
	if err != nil {
		return nil, drivers.NewUnreachable(err)
	}
	return conn, nil
}

// secretKeys are the group snapshotter secret's: the class's
// csi.storage.k8s.io/group-snapshotter-secret-* with their templates,
// remembered on the content in the snapshot-controller's deletion-secret
// annotations (with the being-created mark), and taken from there when
// they are set.
var secretKeys = snapshots.SecretKeys{Kind: secrets.GroupSnapshotter, AnnName: AnnDeletionSecretName, AnnNS: AnnDeletionSecretNS,
	What: "group snapshotter", ClassKind: "VolumeGroupSnapshotClass"}

// secretUse is the policy question for op with secret ref: the
// VolumeGroupSnapshot is the requester, or the content while it is bound
// to none.
func (c *Controller) secretUse(g *groupv1.VolumeGroupSnapshotContent, ref *corev1.SecretReference, src policy.Source, op policy.Operation) kube.SecretUse {
	r := g.Spec.VolumeGroupSnapshotRef
	req := policy.Requester{Kind: policy.KindVolumeGroupSnapshot, Namespace: r.Namespace, Name: r.Name}
	if r.UID == "" {
		req = policy.Requester{Kind: policy.KindVolumeGroupSnapshotContent, Name: g.Name}
	}
	return kube.SecretUse{Driver: g.Spec.Driver, Op: op, Ref: ref, Source: src, Requester: req}
}

// createFailed reports a failed create: the content's status error, a
// GroupSnapshotCreationFailed Event (once per failure) and a log line.
func (c *Controller) createFailed(ctx context.Context, g *groupv1.VolumeGroupSnapshotContent, result string, err error) error {
	c.ops.WithLabelValues(g.Spec.Driver, result).Inc()
	if ctx.Err() != nil || apierrors.IsConflict(err) {
		return err
	}
	c.reportError(ctx, g, "GroupSnapshotCreationFailed", "Failed to create group snapshot", err)
	return err
}

// reportError writes "what: err" as the content's status error (no write
// when it says that already), records it as a Warning Event once per
// failure, and logs it.
func (c *Controller) reportError(ctx context.Context, g *groupv1.VolumeGroupSnapshotContent, reason, what string, err error) {
	msg := what + ": " + err.Error()
	c.b.Log.Warn(strings.ToLower(what[:1])+what[1:], "content", g.Name, "driver", g.Spec.Driver, "err", err)
	c.b.EventOnce(ctx, contentRef(g), corev1.EventTypeWarning, reason, kube.FailureOf(reason, err), "%s", msg)
	if werr := c.writeError(ctx, g, msg); werr != nil && !apierrors.IsNotFound(werr) && ctx.Err() == nil {
		c.b.Log.Warn("cannot write the group content's status error", "content", g.Name, "err", werr)
	}
}

func contentRef(g *groupv1.VolumeGroupSnapshotContent) corev1.ObjectReference {
	return corev1.ObjectReference{Kind: "VolumeGroupSnapshotContent", APIVersion: Group + "/" + Version, Name: g.Name, UID: g.UID, ResourceVersion: g.ResourceVersion}
}
