package snapshot

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/snapshots"
	"github.com/csibroker/csibroker/k8sbridge/secrets"
	"github.com/csibroker/csibroker/policy"
)

// plan is everything a CreateSnapshot needs, settled before anything is
// written or called.
type plan struct {
	vsc          *snapshotv1.VolumeSnapshotContent
	driver, node string
	conn         grpc.ClientConnInterface
	req          *csi.CreateSnapshotRequest // without secrets
	secret       *corev1.SecretReference
	secretSource policy.Source
	// annotations the content is to carry while the snapshot is made: the
	// being-created mark, and the deletion secret and node when they are
	// not there yet.
	annotations map[string]string
}

// create makes (or, asked again, looks at) a dynamic content's snapshot:
// the plan, the intent record, the being-created mark, CreateSnapshot,
// then the status, as csi-snapshotter does.
func (c *Controller) create(ctx context.Context, vsc *snapshotv1.VolumeSnapshotContent) error {
	p, err := c.prepare(ctx, vsc)
	if err != nil {
		return c.createFailed(ctx, vsc, "not_called", err)
	}
	use := c.secretUse(p, policy.OpCreateSnapshot)
	creds, err := c.b.FetchSecret(ctx, use)
	if err != nil {
		return c.createFailed(ctx, vsc, "not_called", err)
	}
	recorded := hasHandle(vsc)
	var entry Entry
	if !recorded {
		// The snapshot may be made by this call: its intent is durable
		// first, and the content marked, so that neither a content gone
		// meanwhile nor a broker killed after the call loses it.
		if entry, err = c.recordEntry(ctx, p); err == nil {
			entry, err = snapshots.Intend(ctx, c.intents, entry, sameCall)
		}
		if err != nil {
			return c.createFailed(ctx, vsc, "not_called", fmt.Errorf("record the snapshot's intent: %w", err))
		}
		c.inflight.Store(entry.SnapshotName, true)
		defer c.inflight.Delete(entry.SnapshotName)
		if vsc, err = c.patchMeta(ctx, vsc, snapshots.Annotate[*snapshotv1.VolumeSnapshotContent](p.annotations)); err != nil {
			return c.createFailed(ctx, p.vsc, "not_called", fmt.Errorf("mark content %s being created: %w", p.vsc.Name, err))
		}
	}
	req := withoutSecrets(p.req)
	req.Secrets = creds
	callCtx, cancel := c.b.CallContext(ctx, p.driver, "CreateSnapshot")
	resp, err := csi.NewControllerClient(p.conn).CreateSnapshot(callCtx, req)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return err // the term ended: the next leader asks again
		}
		if isFinal(err) {
			// The driver is not making it: the mark goes, and so does
			// the intent (nothing is in progress).
			if !recorded {
				c.intents.Remove(entry.Key())
			}
			if cur, rerr := c.patchMeta(ctx, vsc, func(m *snapshotv1.VolumeSnapshotContent) { delete(m.Annotations, AnnBeingCreated) }); rerr == nil {
				vsc = cur
			}
		}
		return c.createFailed(ctx, vsc, "failed", fmt.Errorf("failed to take snapshot of the volume %s: %w", *vsc.Spec.Source.VolumeHandle, err))
	}
	snap := resp.GetSnapshot()
	ready := snap.GetReadyToUse()
	updated, err := c.writeStatus(ctx, vsc, snap.GetSnapshotId(), ready, creationTime(snap), snap.GetSizeBytes(), "")
	if apierrors.IsConflict(err) {
		// Changed during the call (the snapshot-controller marked it
		// being deleted, say): written again over what is there now,
		// rather than asking the driver again.
		var fresh *snapshotv1.VolumeSnapshotContent
		if fresh, err = c.client.SnapshotV1().VolumeSnapshotContents().Get(ctx, vsc.Name, metav1.GetOptions{}); err == nil {
			if string(fresh.UID) != string(vsc.UID) {
				err = apierrors.NewNotFound(snapshotv1.Resource("volumesnapshotcontents"), vsc.Name)
			} else {
				updated, err = c.writeStatus(ctx, fresh, snap.GetSnapshotId(), ready, creationTime(snap), snap.GetSizeBytes(), "")
			}
		}
	}
	if apierrors.IsNotFound(err) && !recorded {
		// The content went while its snapshot was made: the snapshot
		// goes too, so none is left that nothing records.
		c.undo(ctx, entry, "its VolumeSnapshotContent went while CreateSnapshot ran")
		return nil
	}
	if err != nil {
		// The entry stays: the next attempt asks again and gets the same
		// snapshot, or recovery deletes it.
		return c.createFailed(ctx, vsc, "failed", fmt.Errorf("record snapshot %s in the status of content %s: %w", snap.GetSnapshotId(), vsc.Name, err))
	}
	if !recorded {
		c.intents.Remove(entry.Key())
		c.b.Event(ctx, contentRef(updated), corev1.EventTypeNormal, "SnapshotCreated", "Snapshot %s of volume %s created by driver %s (ready to use: %t)", snap.GetSnapshotId(), *vsc.Spec.Source.VolumeHandle, p.driver, ready)
		c.b.Log.Info("snapshot created", "content", vsc.Name, "driver", p.driver, "snapshot_id", snap.GetSnapshotId(), "ready", ready, "node", p.node)
	}
	if _, err := c.patchMeta(ctx, updated, func(m *snapshotv1.VolumeSnapshotContent) { delete(m.Annotations, AnnBeingCreated) }); err != nil {
		return fmt.Errorf("remove the %s annotation from content %s: %w", AnnBeingCreated, vsc.Name, err)
	}
	c.b.ForgetEvents(vsc.UID)
	if !ready {
		c.ops.WithLabelValues(p.driver, "not_ready").Inc()
		return errNotReady
	}
	c.ops.WithLabelValues(p.driver, "created").Inc()
	return nil
}

// withoutSecrets is a copy of the request (the plan's stays without secrets).
func withoutSecrets(r *csi.CreateSnapshotRequest) *csi.CreateSnapshotRequest {
	return &csi.CreateSnapshotRequest{SourceVolumeId: r.GetSourceVolumeId(), Name: r.GetName(), Parameters: r.GetParameters()}
}

func creationTime(s *csi.Snapshot) time.Time {
	if t := s.GetCreationTime(); t != nil && (t.GetSeconds() != 0 || t.GetNanos() != 0) {
		return t.AsTime()
	}
	return time.Now()
}

// prepare settles a dynamic content's CreateSnapshot: bound, with a class
// of its driver, a driver that makes snapshots, parameters, the secret's
// reference and, for a node-local driver, the node of the source volume.
func (c *Controller) prepare(ctx context.Context, vsc *snapshotv1.VolumeSnapshotContent) (*plan, error) {
	driver := vsc.Spec.Driver
	ref := vsc.Spec.VolumeSnapshotRef
	if ref.UID == "" {
		return nil, fmt.Errorf("cannot create snapshot: content %s is not bound to a VolumeSnapshot (spec.volumeSnapshotRef.uid is empty)", vsc.Name)
	}
	if vsc.Spec.VolumeSnapshotClassName == nil || *vsc.Spec.VolumeSnapshotClassName == "" {
		return nil, fmt.Errorf("cannot create snapshot: content %s names no VolumeSnapshotClass (a dynamic snapshot needs one)", vsc.Name)
	}
	className := *vsc.Spec.VolumeSnapshotClassName
	class, err := c.classes.Get(className)
	if err != nil {
		if apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("VolumeSnapshotClass %s not found", className)
		}
		return nil, err
	}
	if class.Driver != driver {
		return nil, fmt.Errorf("VolumeSnapshotClass %s is of driver %s, not %s (the content's spec.driver): not snapshotted", className, class.Driver, driver)
	}
	caps, err := c.b.Caps.Get(ctx, driver)
	if err != nil {
		c.b.Caps.Forget(driver)
		return nil, drivers.NewUnreachable(fmt.Errorf("driver %s is not reachable: %w", driver, err))
	}
	if !caps.Snapshot {
		return nil, fmt.Errorf("driver %s does not make snapshots (no CREATE_DELETE_SNAPSHOT controller capability)", driver)
	}
	params, err := snapshots.DriverParameters(class.Parameters)
	if err != nil {
		return nil, fmt.Errorf("VolumeSnapshotClass %s: %w", className, err)
	}
	if c.b.Cfg.ExtraCreateMetadata {
		params[ParamSnapshotName], params[ParamSnapshotNamespace], params[ParamContentName] = ref.Name, ref.Namespace, vsc.Name
	}
	p := &plan{vsc: vsc, driver: driver, annotations: map[string]string{AnnBeingCreated: "yes"},
		req: &csi.CreateSnapshotRequest{SourceVolumeId: *vsc.Spec.Source.VolumeHandle, Name: snapshotName(c.b.Cfg, vsc), Parameters: params}}
	if p.secret, p.secretSource, err = secretKeys.Of(vsc, ref, className, class.Parameters, p.annotations); err != nil {
		return nil, err
	}
	if c.b.Cfg.Drivers.NodeLocal(driver) {
		if p.node = c.nodeOf(vsc); p.node == "" {
			return nil, fmt.Errorf("volume %s of node-local driver %s: no PersistentVolume of it names its node (annotation %s or a single hostname in its node affinity), so no node's proxy can snapshot it", p.req.SourceVolumeId, driver, kube.AnnVolumeNode)
		}
		if vsc.Annotations[AnnNode] == "" {
			p.annotations[AnnNode] = p.node
		}
	}
	if p.conn, err = c.b.DriverConn(driver, p.node); err != nil {
		return nil, drivers.NewUnreachable(err)
	}
	return p, nil
}

// secretKeys are the snapshotter secret's: the class's
// csi.storage.k8s.io/snapshotter-secret-* with their templates, remembered
// on the content in the snapshot-controller's deletion-secret annotations
// (with the being-created mark), and taken from there when they are set.
var secretKeys = snapshots.SecretKeys{Kind: secrets.Snapshotter, AnnName: AnnDeletionSecretName, AnnNS: AnnDeletionSecretNS,
	What: "snapshotter", ClassKind: "VolumeSnapshotClass"}

// secretUse is the policy question for op with the plan's secret.
func (c *Controller) secretUse(p *plan, op policy.Operation) kube.SecretUse {
	ref := p.vsc.Spec.VolumeSnapshotRef
	return kube.SecretUse{Driver: p.driver, Op: op, Ref: p.secret, Source: p.secretSource,
		Requester: policy.Requester{Kind: policy.KindVolumeSnapshot, Namespace: ref.Namespace, Name: ref.Name, Node: p.node}}
}

// nodeOf is the node of a node-local driver's snapshot: recorded on the
// content, else the node of the PersistentVolume of its source volume.
func (c *Controller) nodeOf(vsc *snapshotv1.VolumeSnapshotContent) string {
	if n := vsc.Annotations[AnnNode]; n != "" {
		return n
	}
	if vsc.Spec.Source.VolumeHandle == nil {
		return ""
	}
	pvs, err := c.b.Volumes.List(labels.Everything())
	if err != nil {
		return ""
	}
	for _, pv := range pvs {
		if s := pv.Spec.CSI; s != nil && s.Driver == vsc.Spec.Driver && s.VolumeHandle == *vsc.Spec.Source.VolumeHandle {
			return c.b.NodeOfPV(pv)
		}
	}
	return ""
}

// isFinal is csi-snapshotter's test of a CreateSnapshot error (shared
// with the group controller in k8sbridge/internal/snapshots).
func isFinal(err error) bool { return snapshots.IsFinal(err) }

// createFailed reports a failed create: the content's status error, a
// SnapshotCreationFailed Event (once per failure) and a log line; the
// error retries the content with its backoff.
func (c *Controller) createFailed(ctx context.Context, vsc *snapshotv1.VolumeSnapshotContent, result string, err error) error {
	c.ops.WithLabelValues(vsc.Spec.Driver, result).Inc()
	if ctx.Err() != nil || apierrors.IsConflict(err) {
		return err // the term ended, or a newer content is on its way
	}
	c.reportError(ctx, vsc, "SnapshotCreationFailed", "Failed to create snapshot", err)
	return err
}

// reportError writes "what: err" as the content's status error (no write
// when it says that already), records it as a Warning Event once per
// failure, and logs it.
func (c *Controller) reportError(ctx context.Context, vsc *snapshotv1.VolumeSnapshotContent, reason, what string, err error) {
	msg := what + ": " + err.Error()
	failure := kube.FailureOf(reason, err)
	c.b.Log.Warn(strings.ToLower(what[:1])+what[1:], "content", vsc.Name, "driver", vsc.Spec.Driver, "err", err)
	c.b.EventOnce(ctx, contentRef(vsc), corev1.EventTypeWarning, reason, failure, "%s", msg)
	if werr := c.writeError(ctx, vsc, msg); werr != nil && !apierrors.IsNotFound(werr) && ctx.Err() == nil {
		c.b.Log.Warn("cannot write the content's status error", "content", vsc.Name, "err", werr)
	}
}

func contentRef(vsc *snapshotv1.VolumeSnapshotContent) corev1.ObjectReference {
	return corev1.ObjectReference{Kind: "VolumeSnapshotContent", APIVersion: Group + "/v1", Name: vsc.Name, UID: vsc.UID, ResourceVersion: vsc.ResourceVersion}
}
