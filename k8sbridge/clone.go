package k8sbridge

import (
	"context"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
)

// Clone protection, as external-provisioner does it: a claim that is the
// source of a clone gets cloneFinalizer before CreateVolume is asked to
// copy it, so deleting it mid-copy leaves it (and its volume) in place
// until no claim that clones it is still Pending; then cloneProtector
// takes the finalizer off and the deletion goes on. The name is
// external-provisioner's, so claims it protected are released here too.
const cloneFinalizer = "provisioner.storage.kubernetes.io/cloning-protection"

// cloneRecheck is how long a deleted source waiting for its clones waits
// before it is looked at again without news (a clone's own update, which
// re-queues it, is the usual way).
const cloneRecheck = time.Minute

func init() { extraControllers = append(extraControllers, newCloneProtector) }

// cloneProtector releases deleted clone sources whose clones are done.
type cloneProtector struct {
	b     *Bridge
	queue *termQueue
}

func newCloneProtector(b *Bridge) (controller, error) {
	p := &cloneProtector{b: b, queue: newTermQueue("clone-protection", b.cfg.RetryIntervalStart, b.cfg.RetryIntervalMax)}
	b.metrics.queueDepth("clone-protection", p.queue.Len)
	b.on(b.factory.Core().V1().PersistentVolumeClaims().Informer(), cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { p.claimChanged(obj) },
		UpdateFunc: func(_, obj any) { p.claimChanged(obj) },
		DeleteFunc: func(obj any) {
			if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			p.claimChanged(obj)
		},
	})
	return p, nil
}

// claimChanged queues a deleted source that holds the finalizer, and the
// source of a clone (which may be waiting for this claim).
func (p *cloneProtector) claimChanged(obj any) {
	c, ok := obj.(*corev1.PersistentVolumeClaim)
	if !ok {
		return
	}
	if c.DeletionTimestamp != nil && slices.Contains(c.Finalizers, cloneFinalizer) {
		p.queue.Add(c.Namespace + "/" + c.Name)
	}
	if src := cloneSourceOf(c); src != "" {
		p.queue.Add(c.Namespace + "/" + src)
	}
}

// cloneSourceOf names the claim c clones ("" for none).
func cloneSourceOf(c *corev1.PersistentVolumeClaim) string {
	if ds := c.Spec.DataSource; ds != nil && ds.Kind == "PersistentVolumeClaim" && (ds.APIGroup == nil || *ds.APIGroup == "") {
		return ds.Name
	}
	return ""
}

func (p *cloneProtector) run(ctx context.Context) {
	p.queue.work(ctx, 1, p.enqueueAll, func(ctx context.Context, key string) (time.Duration, error) {
		requeue, err := p.sync(ctx, key)
		if err != nil {
			p.b.log.Warn("clone protection: releasing a deleted clone source failed; will retry", "claim", key, "err", err)
		}
		return requeue, err
	})
}

// enqueueAll queues every deleted claim that holds the finalizer (start
// of a term: deletions while another replica led are in the cache).
func (p *cloneProtector) enqueueAll() {
	claims, err := p.b.claims.List(labels.Everything())
	if err != nil {
		return
	}
	for _, c := range claims {
		if c.DeletionTimestamp != nil && slices.Contains(c.Finalizers, cloneFinalizer) {
			p.queue.Add(c.Namespace + "/" + c.Name)
		}
	}
}

// sync takes the finalizer off a deleted source once no claim cloning it
// is Pending; until then it looks again after cloneRecheck.
func (p *cloneProtector) sync(ctx context.Context, key string) (time.Duration, error) {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return 0, nil
	}
	src, err := p.b.claims.PersistentVolumeClaims(ns).Get(name)
	if apierrors.IsNotFound(err) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	if src.DeletionTimestamp == nil || !slices.Contains(src.Finalizers, cloneFinalizer) {
		return 0, nil
	}
	if pending := p.pendingClones(src); len(pending) > 0 {
		p.b.log.Debug("clone protection: deleted claim kept while claims cloning it are pending", "claim", key, "pending", pending)
		return cloneRecheck, nil
	}
	cur := src.DeepCopy()
	cur.Finalizers = slices.DeleteFunc(cur.Finalizers, func(f string) bool { return f == cloneFinalizer })
	patch, err := twoWayPatch(src, cur, &corev1.PersistentVolumeClaim{}, src.ResourceVersion)
	if err != nil || patch == nil {
		return 0, err
	}
	_, err = p.b.cfg.Client.CoreV1().PersistentVolumeClaims(ns).Patch(ctx, name, types.StrategicMergePatchType, patch, metav1.PatchOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return 0, nil
	case err != nil:
		return 0, fmt.Errorf("remove finalizer %s: %w", cloneFinalizer, err)
	}
	p.b.log.Info("clone protection: deleted claim released, no clone of it is pending", "claim", key)
	return 0, nil
}

// pendingClones names the Pending claims of src's namespace that clone it.
func (p *cloneProtector) pendingClones(src *corev1.PersistentVolumeClaim) []string {
	claims, err := p.b.claims.PersistentVolumeClaims(src.Namespace).List(labels.Everything())
	if err != nil {
		return []string{"(claims not listed: " + err.Error() + ")"}
	}
	var out []string
	for _, c := range claims {
		if c.Status.Phase == corev1.ClaimPending && cloneSourceOf(c) == src.Name {
			out = append(out, c.Name)
		}
	}
	return out
}

// protectCloneSource puts cloneFinalizer on the claim that claim clones,
// before CreateVolume is asked to copy it (a strategic merge patch adds
// it to the list; the API server refuses a new finalizer on a claim being
// deleted, which fails this attempt, and the next finds the source
// deleted).
func (p *provisioner) protectCloneSource(ctx context.Context, claim *corev1.PersistentVolumeClaim) error {
	name := cloneSourceOf(claim)
	if name == "" {
		return nil
	}
	if src, err := p.b.claims.PersistentVolumeClaims(claim.Namespace).Get(name); err == nil && slices.Contains(src.Finalizers, cloneFinalizer) {
		return nil
	}
	patch := []byte(`{"metadata":{"finalizers":["` + cloneFinalizer + `"]}}`)
	if _, err := p.b.cfg.Client.CoreV1().PersistentVolumeClaims(claim.Namespace).Patch(ctx, name, types.StrategicMergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("protect clone source claim %s/%s with finalizer %s: %w", claim.Namespace, name, cloneFinalizer, err)
	}
	return nil
}
