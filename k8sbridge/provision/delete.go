package provision

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	"github.com/csibroker/csibroker/internal/budget"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/secrets"
	"github.com/csibroker/csibroker/policy"
)

// Deleter deletes the volumes of Released PVs whose reclaim policy is Delete,
// then the PVs.
type Deleter struct {
	b     *kube.Env
	prov  *Provisioner // deletes the volumes (as recovery does)
	queue *kube.TermQueue
	slots *kube.DriverSlots // deletions in progress per driver (PerDriverWorkers)
	// done holds the UIDs of the PVs whose volume was deleted and whose
	// object was let go, until the informer sees them gone: an event that
	// arrives before the cache catches up does not delete the volume again.
	doneMu sync.Mutex
	done   map[types.UID]struct{}
}

func NewDeleter(b *kube.Env, prov *Provisioner) *Deleter {
	d := &Deleter{b: b, prov: prov, queue: b.NewTermQueue("delete"), done: map[types.UID]struct{}{}}
	d.slots = d.queue.WithSlots(b.Cfg.PerDriverWorkers)
	d.queue.ReportOn(b.PVOfKey)
	b.Metrics.QueueDepth("delete", d.queue.Len)
	return d
}

func (d *Deleter) VolumeHandler() cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { d.enqueue(obj) },
		UpdateFunc: func(_, obj any) { d.enqueue(obj) },
		DeleteFunc: func(obj any) {
			if pv, ok := kube.Deleted[*corev1.PersistentVolume](obj); ok {
				d.doneMu.Lock()
				delete(d.done, pv.UID)
				d.doneMu.Unlock()
				d.b.ForgetEvents(pv.UID)
			}
		},
	}
}

func (d *Deleter) isDone(uid types.UID) bool {
	d.doneMu.Lock()
	defer d.doneMu.Unlock()
	_, ok := d.done[uid]
	return ok
}

func (d *Deleter) ours(pv *corev1.PersistentVolume) bool {
	driver := deletionDriver(pv)
	return driver != "" && d.b.Registered(driver)
}

// deletionDriver is the driver that deletes pv's volume: a CSI PV's own
// when it provisioned it; for an in-tree PV that CSI migration moves to a
// driver, that driver when the in-tree plugin provisioned the PV (before
// the migration, or through a migrated class) or the PV controller marked
// it migrated to the driver, as external-provisioner decides. "" for none.
func deletionDriver(pv *corev1.PersistentVolume) string {
	if pv.Spec.CSI != nil {
		if pv.Annotations[kube.AnnProvisionedBy] == pv.Spec.CSI.Driver {
			return pv.Spec.CSI.Driver
		}
		return ""
	}
	driver := kube.PVDriver(pv)
	if driver == "" {
		return ""
	}
	if plugin, err := kube.Migration.GetInTreePluginNameFromSpec(pv, nil); err == nil && pv.Annotations[kube.AnnProvisionedBy] == plugin {
		return driver
	}
	if pv.Annotations[kube.AnnMigratedTo] == driver {
		return driver
	}
	return ""
}

func (d *Deleter) enqueue(obj any) {
	pv, ok := obj.(*corev1.PersistentVolume)
	if !ok || !d.ours(pv) || !(needsDelete(pv) || protectionStale(pv) || protectionMissing(pv)) {
		return
	}
	d.queue.Add(pv.Name)
}

// protectionStale: the PV carries the finalizer that keeps it until its
// volume is deleted, but its reclaim policy is no longer Delete (an admin
// changed it to keep the data), so no deletion will ever come to remove
// it; as external-provisioner does, it is removed.
func protectionStale(pv *corev1.PersistentVolume) bool {
	return pv.Spec.PersistentVolumeReclaimPolicy != corev1.PersistentVolumeReclaimDelete && kube.HasFinalizer(pv, kube.FinalizerVolume)
}

// protectionMissing: a Bound PV reclaimed by Delete lacks the finalizer
// (an external-provisioner older than it made the PV, or someone removed
// it). Without it, deleting the PV object would leak its volume; as
// external-provisioner does, it is added.
func protectionMissing(pv *corev1.PersistentVolume) bool {
	return pv.Spec.PersistentVolumeReclaimPolicy == corev1.PersistentVolumeReclaimDelete && pv.Status.Phase == corev1.VolumeBound &&
		pv.DeletionTimestamp == nil && !kube.HasFinalizer(pv, kube.FinalizerVolume)
}

// needsDelete: a Released PV reclaimed by Delete (its claim is gone). One
// being deleted without the volume-deletion finalizer is not (as in
// external-provisioner): its volume was deleted already, the finalizer
// removed after it (by this or an earlier leader), and the object only
// waits for other finalizers. A Failed PV is not either, as in
// external-provisioner: the PV controller marks a PV Failed when it finds
// something wrong with it, which an administrator looks at before its
// volume goes.
func needsDelete(pv *corev1.PersistentVolume) bool {
	if pv.DeletionTimestamp != nil && !kube.HasFinalizer(pv, kube.FinalizerVolume) {
		return false
	}
	return pv.Spec.PersistentVolumeReclaimPolicy == corev1.PersistentVolumeReclaimDelete && pv.Status.Phase == corev1.VolumeReleased
}

func (d *Deleter) Run(ctx context.Context) {
	d.queue.Work(ctx, d.b.Cfg.WorkerThreads, d.EnqueueAll, d.sync)
}

func (d *Deleter) EnqueueAll() {
	if pvs, err := d.b.Volumes.List(labels.Everything()); err == nil {
		for _, pv := range pvs {
			d.enqueue(pv)
		}
	}
}

// sync reclaims PV name if it is due: its volume deleted, then the object.
// It returns waitForSlot while the driver is busy, and a positive duration
// to look at the PV again then (its node-local volume's node is gone).
func (d *Deleter) sync(ctx context.Context, name string) (time.Duration, error) {
	pv, err := d.b.Volumes.Get(name)
	if apierrors.IsNotFound(err) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	if !d.ours(pv) {
		return 0, nil
	}
	if protectionStale(pv) {
		if err := d.patchFinalizer(ctx, name, false); err != nil {
			err = fmt.Errorf("remove finalizer %s from pv %s (reclaim policy %s): %w", kube.FinalizerVolume, name, pv.Spec.PersistentVolumeReclaimPolicy, err)
			d.finalizerFailed(ctx, pv, err)
			return 0, err
		}
		d.b.Log.Info("removed the volume-deletion finalizer of a PV no longer reclaimed by Delete", "pv", name, "reclaim_policy", string(pv.Spec.PersistentVolumeReclaimPolicy))
		return 0, nil
	}
	if protectionMissing(pv) {
		if err := d.patchFinalizer(ctx, name, true); err != nil {
			// Without it, deleting the PV object first leaks its volume.
			err = fmt.Errorf("add finalizer %s to pv %s, which keeps its volume from leaking if the PV is deleted first: %w", kube.FinalizerVolume, name, err)
			d.finalizerFailed(ctx, pv, err)
			return 0, err
		}
		d.b.Log.Info("added the volume-deletion finalizer to a bound PV that lacked it", "pv", name)
		return 0, nil
	}
	if !needsDelete(pv) || d.isDone(pv.UID) {
		return 0, nil
	}
	driver := deletionDriver(pv)
	spec, err := kube.CSISpec(pv) // a migrated in-tree PV's translation
	if err != nil {
		d.warn(ctx, pv, err.Error(), "%v", err)
		return 0, err
	}
	// --per-driver-workers: one slow driver cannot take every worker.
	if !d.slots.Acquire(driver, name) {
		return kube.WaitForSlot, nil
	}
	defer d.slots.Release(driver)
	d.b.TestHook("delete", driver, name)
	ctx = budget.WithDriver(ctx, driver) // its writes wait in turn with other drivers'
	return d.reclaim(ctx, pv, driver, spec.CSI.VolumeHandle)
}

// finalizerFailed reports a refused finalizer write (RBAC, an admission
// webhook or policy): a log line on every attempt, an Event on pv once per
// failure.
func (d *Deleter) finalizerFailed(ctx context.Context, pv *corev1.PersistentVolume, err error) {
	d.b.Log.Warn("updating the volume-deletion finalizer failed (will retry)", "pv", pv.Name, "err", err)
	d.b.EventOnce(ctx, kube.PVRef(pv), corev1.EventTypeWarning, "FinalizerUpdateFailed", kube.FailureOf("", err), "%v", err)
}

// warn logs a failed deletion attempt and records it as a
// VolumeFailedDelete Event on pv once per failure (eventOnce; what names
// the failure).
func (d *Deleter) warn(ctx context.Context, pv *corev1.PersistentVolume, what, format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	d.b.Log.Warn("volume deletion failed", "pv", pv.Name, "err", msg)
	d.b.EventOnce(ctx, kube.PVRef(pv), corev1.EventTypeWarning, "VolumeFailedDelete", what, "%s", msg)
}

// reclaim deletes the volume of pv, a PV due for deletion, then the PV;
// a positive duration looks at the PV again then.
// handle is the volume's ID (for a migrated in-tree PV, translated).
func (d *Deleter) reclaim(ctx context.Context, pv *corev1.PersistentVolume, driver, handle string) (time.Duration, error) {
	name := pv.Name
	ctx, span := d.b.Tracer.Start(ctx, "delete "+name, trace.WithAttributes(attribute.String("csi.driver", driver), attribute.String("k8s.pv.name", name)))
	defer span.End()

	// Never delete a volume that is still attached somewhere.
	va, err := d.b.AttachmentOf(name)
	if err != nil {
		return 0, err
	}
	if va != nil {
		d.warn(ctx, pv, "attached "+va.Name, "persistentvolume %s is still attached to node %s (VolumeAttachment %s); waiting for detach", name, va.Spec.NodeName, va.Name)
		d.b.Metrics.Deletions.WithLabelValues(driver, "blocked").Inc()
		return 0, fmt.Errorf("pv %s still attached by %s", name, va.Name)
	}

	// The deletion secret the PV records, as external-provisioner reads
	// it: both annotations set name it, both present and empty say there
	// is none; a PV without them (an older provisioner's) has its class's.
	var secretRef *corev1.SecretReference
	n, hasName := pv.Annotations[kube.AnnDeletionSecretName]
	ns, hasNS := pv.Annotations[kube.AnnDeletionSecretNS]
	switch {
	case hasName && hasNS && n != "" && ns != "":
		secretRef = &corev1.SecretReference{Name: n, Namespace: ns}
	case hasName && hasNS:
		if n != "" || ns != "" {
			d.b.Log.Warn("the PV names half a deletion secret; deleting its volume without one", "pv", name, "name", n, "namespace", ns)
			d.b.EventOnce(ctx, kube.PVRef(pv), corev1.EventTypeWarning, "DeletionSecretIncomplete", "half "+n+"/"+ns,
				"annotations %s=%q and %s=%q name half a deletion secret; deleting volume %s without one", kube.AnnDeletionSecretName, n, kube.AnnDeletionSecretNS, ns, handle)
		}
	default:
		if secretRef, err = d.classDeletionSecret(pv); err != nil {
			d.warn(ctx, pv, err.Error(), "%v", err)
			d.b.Metrics.Deletions.WithLabelValues(driver, "failed").Inc()
			return 0, err
		}
	}
	requester := policy.Requester{Kind: policy.KindPersistentVolume, Name: pv.Name, Labels: pv.Labels, StorageClass: pv.Spec.StorageClassName}
	if cr := pv.Spec.ClaimRef; cr != nil {
		requester.Namespace = cr.Namespace
	}
	node := ""
	if d.b.Cfg.Drivers.NodeLocal(driver) {
		node = d.b.NodeOfPV(pv)
		requester.Node = node // the node whose proxy receives the secret
		if node == "" {
			err := kube.ErrNodeUnknown(pv, driver)
			d.warn(ctx, pv, err.Error(), "%v", err)
			d.b.Metrics.Deletions.WithLabelValues(driver, "failed").Inc()
			return 0, fmt.Errorf("pv %s: %w", name, err)
		}
		if _, err := d.b.Nodes.Get(node); apierrors.IsNotFound(err) {
			// Nobody can reach the volume: leave the PV to an administrator
			// instead of retrying forever.
			d.warn(ctx, pv, "node gone "+node,
				"node %s of node-local volume %s no longer exists; the PersistentVolume is left for an administrator (delete it once the volume is dealt with)", node, handle)
			d.b.Metrics.Deletions.WithLabelValues(driver, "node_gone").Inc()
			// Looked at again now and then: the Event is recorded again
			// while the PV stays, and a node back under its name gets
			// the deletion.
			return kube.EventRepeat, nil
		}
	}
	ref := kube.PVRef(pv)
	if err := d.prov.deleteVolumeWith(ctx, driver, node, handle, secretRef, requester, kube.RecordedNamespaceLabels(pv), &ref); err != nil {
		d.warn(ctx, pv, kube.FailureOf("DeleteVolume", err), "%v", err)
		d.b.Metrics.Deletions.WithLabelValues(driver, "failed").Inc()
		return 0, err
	}
	d.b.NoteVolumeChange(kube.VolumeChange{Driver: driver, Node: node, Topo: affinitySegments(pv)})
	// Two writes at most, as external-provisioner: drop our finalizer,
	// then delete the object (or only the former if a user deleted it).
	if kube.HasFinalizer(pv, kube.FinalizerVolume) {
		if err := d.patchFinalizer(ctx, name, false); err != nil {
			d.b.Log.Warn("volume deleted; removing the PV's finalizer failed (will retry)", "pv", name, "err", err)
			return 0, fmt.Errorf("remove finalizer from pv %s: %w", name, err)
		}
	}
	if pv.DeletionTimestamp == nil {
		uid := pv.UID
		err := d.b.Cfg.Client.CoreV1().PersistentVolumes().Delete(ctx, name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}})
		if err != nil && !apierrors.IsNotFound(err) {
			d.b.Log.Warn("volume deleted; deleting the PV failed (will retry)", "pv", name, "err", err)
			return 0, fmt.Errorf("delete pv %s: %w", name, err)
		}
	}
	d.doneMu.Lock()
	d.done[pv.UID] = struct{}{}
	d.doneMu.Unlock()
	d.b.Metrics.Deletions.WithLabelValues(driver, "success").Inc()
	d.b.Log.Info("volume deleted", "pv", name, "driver", driver, "volume_id", handle)
	return 0, nil
}

// patchFinalizer adds or removes the volume-deletion finalizer of PV name
// with a strategic merge patch, which touches that list entry only: a PV
// changed meanwhile (its phase, a user's deletion) is no conflict, so a
// volume just deleted is not deleted again because its PV moved on. A PV
// already gone is no error.
func (d *Deleter) patchFinalizer(ctx context.Context, name string, add bool) error {
	key := "$deleteFromPrimitiveList/finalizers"
	if add {
		key = "finalizers"
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{key: []string{kube.FinalizerVolume}}})
	if err != nil {
		return err
	}
	_, err = d.b.Cfg.Client.CoreV1().PersistentVolumes().Patch(ctx, name, types.StrategicMergePatchType, patch, metav1.PatchOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

// classDeletionSecret is the provisioner secret of a PV that records none
// (made by an external-provisioner older than the deletion-secret
// annotations): as external-provisioner does, its StorageClass's
// Provisioner secret, resolved for the PV and its claim reference. None if
// the class is gone or names no secret.
func (d *Deleter) classDeletionSecret(pv *corev1.PersistentVolume) (*corev1.SecretReference, error) {
	if pv.Spec.StorageClassName == "" {
		return nil, nil
	}
	class, err := d.b.Classes.Get(pv.Spec.StorageClassName)
	if err != nil {
		return nil, nil
	}
	if pv.Spec.CSI == nil && kube.MigratedDriver(class.Provisioner) != "" {
		// A migrated in-tree class: its secrets are those of its CSI
		// translation, as external-provisioner reads them.
		t, err := kube.Migration.TranslateInTreeStorageClassToCSI(klog.Background(), class.Provisioner, class)
		if err != nil {
			return nil, fmt.Errorf("persistentvolume %s records no deletion secret, and its in-tree StorageClass %q does not translate to CSI: %w", pv.Name, class.Name, err)
		}
		class = t
	}
	claim := &corev1.PersistentVolumeClaim{}
	if cr := pv.Spec.ClaimRef; cr != nil {
		claim.Name, claim.Namespace = cr.Name, cr.Namespace
	}
	ref, err := secrets.Ref(secrets.Provisioner, class.Parameters, pv.Name, claim)
	if err != nil {
		return nil, fmt.Errorf("persistentvolume %s records no deletion secret, and its StorageClass %q's provisioner secret cannot be resolved for it: %w", pv.Name, class.Name, err)
	}
	return ref, nil
}

// affinitySegments are the segments a PV's node affinity pins it to: per
// node selector term, the keys it requires one value of (none: not known).
func affinitySegments(pv *corev1.PersistentVolume) []map[string]string {
	na := pv.Spec.NodeAffinity
	if na == nil || na.Required == nil {
		return nil
	}
	var out []map[string]string
	for _, term := range na.Required.NodeSelectorTerms {
		seg := map[string]string{}
		for _, e := range term.MatchExpressions {
			if e.Operator == corev1.NodeSelectorOpIn && len(e.Values) == 1 {
				seg[e.Key] = e.Values[0]
			}
		}
		out = append(out, seg)
	}
	return out
}

// QueueLen is how many volumes wait in this term's queue, a driver's line
// included.
func (d *Deleter) QueueLen() int { return d.queue.Len() }
