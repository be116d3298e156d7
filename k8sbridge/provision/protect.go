package provision

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/retry"

	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
)

// Source protection, as external-provisioner does it. A claim that is the
// source of a clone gets cloneFinalizer before CreateVolume is asked to
// copy it, so deleting it mid-copy leaves it (and its volume) in place
// until no claim that clones it is still Pending; then sourceProtector
// takes the finalizer off and the deletion goes on. A VolumeSnapshot being
// restored gets snapshotFinalizer the same way; it comes off as soon as no
// claim restoring it is Pending (a restoring claim bound or deleted looks
// again, and a sweep every snapshotSweep finds those no claim brought
// back), deleted or not, as upstream takes it off after each restore. The
// names are external-provisioner's, so objects it protected are released
// here too.
const (
	CloneFinalizer    = "provisioner.storage.kubernetes.io/cloning-protection"
	SnapshotFinalizer = "provisioner.storage.kubernetes.io/volumesnapshot-as-source-protection"
)

// sourceRecheck is how long a deleted source waiting for its copies waits
// before it is looked at again without news (a copy's own update, which
// re-queues it, is the usual way).
const sourceRecheck = time.Minute

// snapshotSweep is how often a term lists the VolumeSnapshots holding
// SnapshotFinalizer (and once at its start), to release those no claim's
// update brought back: a restoring claim deleted while no replica led, or
// a finalizer added just after its claim was looked at.
const snapshotSweep = 10 * time.Minute

// Queue keys: the kind of source, then its namespace/name.
const (
	claimKeyPrefix    = "claim:"
	snapshotKeyPrefix = "snapshot:"
)

// SourceProtector releases the sources of clones and restores once no
// claim copying them is Pending.
type SourceProtector struct {
	b     *kube.Env
	queue *kube.TermQueue
	// claims indexes the Pending claims by the source they copy
	// (pendingSourceIndex), so a source's look finds its copies without
	// listing its namespace.
	claims cache.Indexer
}

// pendingSourceIndex indexes each Pending claim that copies a source by
// the source's queue key (claimKeyPrefix or snapshotKeyPrefix, then
// namespace/name).
const pendingSourceIndex = "csibroker.io/pending-source"

func pendingSourceKeys(obj any) ([]string, error) {
	c, ok := obj.(*corev1.PersistentVolumeClaim)
	if !ok || c.Status.Phase != corev1.ClaimPending {
		return nil, nil
	}
	if src := cloneSourceOf(c); src != "" {
		return []string{claimKeyPrefix + c.Namespace + "/" + src}, nil
	}
	if snap := snapshotSourceOf(c); snap != "" {
		return []string{snapshotKeyPrefix + c.Namespace + "/" + snap}, nil
	}
	return nil, nil
}

func NewSourceProtector(b *kube.Env) (*SourceProtector, error) {
	inf := b.Factory.Core().V1().PersistentVolumeClaims().Informer()
	if err := inf.AddIndexers(cache.Indexers{pendingSourceIndex: pendingSourceKeys}); err != nil {
		return nil, fmt.Errorf("source protection: %w", err)
	}
	p := &SourceProtector{b: b, queue: b.NewTermQueue("source-protection"), claims: inf.GetIndexer()}
	b.Metrics.QueueDepth("source-protection", p.queue.Len)
	p.queue.ReportOn(func(key string) (corev1.ObjectReference, bool) {
		// A snapshot's key names no object here (no snapshot lister):
		// its panic is logged and counted only.
		if k, ok := strings.CutPrefix(key, claimKeyPrefix); ok {
			return b.ClaimOfKey(k)
		}
		return corev1.ObjectReference{}, false
	})
	b.On(inf, cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { p.claimChanged(nil, obj) },
		UpdateFunc: func(old, obj any) { p.claimChanged(old, obj) },
		DeleteFunc: func(obj any) {
			if c, ok := kube.Deleted[*corev1.PersistentVolumeClaim](obj); ok {
				p.claimDone(c)
			}
		},
	})
	return p, nil
}

// claimChanged queues a deleted clone source that holds cloneFinalizer,
// and the sources of a claim whose copy is over (it left Pending just
// now: a resync or a start does not look them up again; the sweep does).
func (p *SourceProtector) claimChanged(oldObj, obj any) {
	c, ok := obj.(*corev1.PersistentVolumeClaim)
	if !ok {
		return
	}
	if c.DeletionTimestamp != nil && slices.Contains(c.Finalizers, CloneFinalizer) {
		p.queue.Add(claimKeyPrefix + c.Namespace + "/" + c.Name)
	}
	if old, ok := oldObj.(*corev1.PersistentVolumeClaim); ok && old.Status.Phase == corev1.ClaimPending && c.Status.Phase != corev1.ClaimPending {
		p.claimDone(c)
	}
}

// claimDone queues the sources of c, which copies them no more (it is
// bound, lost or gone).
func (p *SourceProtector) claimDone(c *corev1.PersistentVolumeClaim) {
	if src := cloneSourceOf(c); src != "" {
		p.queue.Add(claimKeyPrefix + c.Namespace + "/" + src)
	}
	if snap := snapshotSourceOf(c); snap != "" {
		p.queue.Add(snapshotKeyPrefix + c.Namespace + "/" + snap)
	}
}

// cloneSourceOf names the claim c clones ("" for none).
func cloneSourceOf(c *corev1.PersistentVolumeClaim) string {
	if ds := c.Spec.DataSource; ds != nil && ds.Kind == "PersistentVolumeClaim" && (ds.APIGroup == nil || *ds.APIGroup == "") {
		return ds.Name
	}
	return ""
}

// snapshotSourceOf names the VolumeSnapshot c restores ("" for none).
func snapshotSourceOf(c *corev1.PersistentVolumeClaim) string {
	if ds := c.Spec.DataSource; ds != nil && ds.Kind == SnapshotKind && ds.APIGroup != nil && *ds.APIGroup == SnapshotGroup {
		return ds.Name
	}
	return ""
}

func (p *SourceProtector) Run(ctx context.Context) {
	p.queue.Work(ctx, 1, p.EnqueueAll, func(ctx context.Context, key string) (time.Duration, error) {
		requeue, err := p.sync(ctx, key)
		if err != nil {
			p.b.Log.Warn("source protection: releasing a clone or restore source failed; will retry", "source", key, "err", err)
		}
		return requeue, err
	}, p.sweepSnapshots)
}

// sweepSnapshots queues the VolumeSnapshots holding snapshotFinalizer at
// the start of the term and every snapshotSweep.
func (p *SourceProtector) sweepSnapshots(ctx context.Context) {
	if p.b.Cfg.SnapshotClient == nil {
		return
	}
	t := time.NewTicker(snapshotSweep)
	defer t.Stop()
	for {
		p.sweepSnapshotsOnce(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (p *SourceProtector) sweepSnapshotsOnce(ctx context.Context) {
	opts := metav1.ListOptions{Limit: 500}
	for {
		l, err := p.b.Cfg.SnapshotClient.SnapshotV1().VolumeSnapshots("").List(ctx, opts)
		switch {
		case apierrors.IsNotFound(err):
			p.b.Log.Debug("source protection: the VolumeSnapshot API is not served; no snapshot to look at")
			return
		case err != nil:
			if ctx.Err() == nil {
				p.b.Log.Warn("source protection: listing VolumeSnapshots failed; looked at again at the next sweep", "err", err)
			}
			return
		}
		for _, s := range l.Items {
			if slices.Contains(s.Finalizers, SnapshotFinalizer) {
				p.queue.Add(snapshotKeyPrefix + s.Namespace + "/" + s.Name)
			}
		}
		if l.Continue == "" {
			return
		}
		opts.Continue = l.Continue
	}
}

// EnqueueAll queues every deleted claim that holds cloneFinalizer (start
// of a term: deletions while another replica led are in the cache).
// Snapshots are looked at when a claim restoring one leaves Pending.
func (p *SourceProtector) EnqueueAll() {
	claims, err := p.b.Claims.List(labels.Everything())
	if err != nil {
		return
	}
	for _, c := range claims {
		if c.DeletionTimestamp != nil && slices.Contains(c.Finalizers, CloneFinalizer) {
			p.queue.Add(claimKeyPrefix + c.Namespace + "/" + c.Name)
		}
	}
}

func (p *SourceProtector) sync(ctx context.Context, key string) (time.Duration, error) {
	switch {
	case strings.HasPrefix(key, claimKeyPrefix):
		return p.syncClaim(ctx, strings.TrimPrefix(key, claimKeyPrefix))
	case strings.HasPrefix(key, snapshotKeyPrefix):
		return 0, p.syncSnapshot(ctx, strings.TrimPrefix(key, snapshotKeyPrefix))
	}
	return 0, nil
}

// syncClaim takes cloneFinalizer off a deleted source once no claim
// cloning it is Pending; until then it looks again after sourceRecheck.
func (p *SourceProtector) syncClaim(ctx context.Context, key string) (time.Duration, error) {
	src, err := p.b.CachedClaim(key)
	if src == nil || err != nil {
		return 0, err
	}
	ns, name := src.Namespace, src.Name
	if src.DeletionTimestamp == nil || !slices.Contains(src.Finalizers, CloneFinalizer) {
		return 0, nil
	}
	if pending := p.pending(claimKeyPrefix + key); len(pending) > 0 {
		p.b.Log.Debug("source protection: deleted claim kept while claims cloning it are pending", "claim", key, "pending", pending)
		return sourceRecheck, nil
	}
	cur := src.DeepCopy()
	cur.Finalizers = slices.DeleteFunc(cur.Finalizers, func(f string) bool { return f == CloneFinalizer })
	patch, err := kube.TwoWayPatch(src, cur, &corev1.PersistentVolumeClaim{}, src.ResourceVersion)
	if err != nil || patch == nil {
		return 0, err
	}
	_, err = p.b.Cfg.Client.CoreV1().PersistentVolumeClaims(ns).Patch(ctx, name, types.StrategicMergePatchType, patch, metav1.PatchOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return 0, nil
	case err != nil:
		return 0, fmt.Errorf("remove finalizer %s: %w", CloneFinalizer, err)
	}
	p.b.Log.Info("source protection: deleted claim released, no clone of it is pending", "claim", key)
	return 0, nil
}

// syncSnapshot takes snapshotFinalizer off a VolumeSnapshot once no claim
// restoring it is Pending.
func (p *SourceProtector) syncSnapshot(ctx context.Context, key string) error {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil || p.b.Cfg.SnapshotClient == nil {
		return nil
	}
	if pending := p.pending(snapshotKeyPrefix + key); len(pending) > 0 {
		p.b.Log.Debug("source protection: VolumeSnapshot kept while claims restoring it are pending", "snapshot", key, "pending", pending)
		return nil // their own updates bring it back
	}
	snap, err := p.b.Cfg.SnapshotClient.SnapshotV1().VolumeSnapshots(ns).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if !slices.Contains(snap.Finalizers, SnapshotFinalizer) {
		return nil
	}
	// Looked at again right before the write: a restore that began since
	// the first look found the finalizer there and wrote nothing.
	if len(p.pending(snapshotKeyPrefix+key)) > 0 {
		return nil
	}
	if err := PatchSnapshotFinalizer(p.b, ctx, snap, false); err != nil {
		return err
	}
	p.b.Log.Info("source protection: VolumeSnapshot released, no restore of it is pending", "snapshot", key)
	return nil
}

// pending names the Pending claims that copy the source of queue key key
// (a claim being deleted still counts: its driver may still be copying).
func (p *SourceProtector) pending(key string) []string {
	objs, err := p.claims.ByIndex(pendingSourceIndex, key)
	if err != nil {
		return []string{"(claims not indexed: " + err.Error() + ")"}
	}
	out := make([]string, 0, len(objs))
	for _, o := range objs {
		out = append(out, o.(*corev1.PersistentVolumeClaim).Name)
	}
	slices.Sort(out)
	return out
}

// protectSource puts cloneFinalizer on the claim that claim clones, or
// SnapshotFinalizer on the VolumeSnapshot it restores (snap, as this
// attempt read it), before CreateVolume is asked to copy it. The API
// server refuses a new finalizer on an object being deleted, which fails
// this attempt; the next finds the source deleted and says so.
func (p *Provisioner) protectSource(ctx context.Context, claim *corev1.PersistentVolumeClaim, snap *snapshotv1.VolumeSnapshot) error {
	if name := cloneSourceOf(claim); name != "" {
		if src, err := p.b.Claims.PersistentVolumeClaims(claim.Namespace).Get(name); err == nil && slices.Contains(src.Finalizers, CloneFinalizer) {
			return nil
		}
		patch := []byte(`{"metadata":{"finalizers":["` + CloneFinalizer + `"]}}`)
		if _, err := p.b.Cfg.Client.CoreV1().PersistentVolumeClaims(claim.Namespace).Patch(ctx, name, types.StrategicMergePatchType, patch, metav1.PatchOptions{}); err != nil {
			return fmt.Errorf("protect clone source claim %s/%s with finalizer %s: %w", claim.Namespace, name, CloneFinalizer, err)
		}
	}
	if snap != nil && !slices.Contains(snap.Finalizers, SnapshotFinalizer) {
		return ProtectSnapshot(p.b, ctx, snap)
	}
	return nil
}

// ProtectSnapshot adds snapshotFinalizer to snap. A conflict (claims
// restoring the same snapshot at once each add it from what they read) is
// no failure: the snapshot is read again, and the finalizer added to that
// unless another worker's patch already did.
func ProtectSnapshot(b *kube.Env, ctx context.Context, snap *snapshotv1.VolumeSnapshot) error {
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		err := PatchSnapshotFinalizer(b, ctx, snap, true)
		if !apierrors.IsConflict(err) {
			return err
		}
		fresh, gerr := b.Cfg.SnapshotClient.SnapshotV1().VolumeSnapshots(snap.Namespace).Get(ctx, snap.Name, metav1.GetOptions{})
		switch {
		case gerr != nil:
			return fmt.Errorf("protect VolumeSnapshot %s/%s with finalizer %s: read it again after a conflict: %w", snap.Namespace, snap.Name, SnapshotFinalizer, gerr)
		case fresh.UID != snap.UID:
			// Not the snapshot this attempt checked any more: the next
			// attempt reads and checks it from the start.
			return fmt.Errorf("protect VolumeSnapshot %s/%s with finalizer %s: it was made again meanwhile", snap.Namespace, snap.Name, SnapshotFinalizer)
		case slices.Contains(fresh.Finalizers, SnapshotFinalizer):
			return nil
		case fresh.DeletionTimestamp != nil:
			return fmt.Errorf("protect VolumeSnapshot %s/%s with finalizer %s: it is being deleted", snap.Namespace, snap.Name, SnapshotFinalizer)
		}
		snap = fresh
		return err
	})
}

// PatchSnapshotFinalizer adds or removes snapshotFinalizer on snap, with a
// JSON merge patch (a CRD takes no strategic merge patch) carrying snap's
// resourceVersion, so a list changed since is not overwritten. A snapshot
// gone is no error when removing.
func PatchSnapshotFinalizer(b *kube.Env, ctx context.Context, snap *snapshotv1.VolumeSnapshot, add bool) error {
	cur := snap.DeepCopy()
	if add {
		cur.Finalizers = append(cur.Finalizers, SnapshotFinalizer)
	} else {
		cur.Finalizers = slices.DeleteFunc(cur.Finalizers, func(f string) bool { return f == SnapshotFinalizer })
	}
	patch, err := kube.MergePatch(snap, cur, snap.ResourceVersion)
	if err != nil || patch == nil {
		return err
	}
	_, err = b.Cfg.SnapshotClient.SnapshotV1().VolumeSnapshots(snap.Namespace).Patch(ctx, snap.Name, types.MergePatchType, patch, metav1.PatchOptions{})
	switch {
	case err == nil, !add && apierrors.IsNotFound(err):
		return nil
	case add:
		return fmt.Errorf("protect VolumeSnapshot %s/%s with finalizer %s: %w", snap.Namespace, snap.Name, SnapshotFinalizer, err)
	}
	return fmt.Errorf("remove finalizer %s from VolumeSnapshot %s/%s: %w", SnapshotFinalizer, snap.Namespace, snap.Name, err)
}
