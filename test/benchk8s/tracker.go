package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"
)

// tracker follows, by watch, the claims of one namespace, the PVs bound to
// them and (optionally) the Leases of another namespace, and stamps each
// change with the local time it was seen. Waiting on a watch instead of
// polling lists keeps the harness's own load on the apiserver small and equal
// for both sides.
type tracker struct {
	ns string

	mu           sync.Mutex
	changed      chan struct{} // closed and replaced on every change
	claims       map[string]bool
	annotatedAt  map[string]time.Time // claim → first seen with the provisioner annotation
	pvs          map[string]time.Time
	pvOfClaim    map[string]time.Time // claim → its PV first seen
	pvAdds       []time.Time          // every PV of ns seen, in order
	leaseHolders map[string]string
	leaseChanges []leaseChange

	cancel context.CancelFunc
}

type leaseChange struct {
	at     time.Time
	lease  string
	holder string
}

func (h *Harness) newTracker(ctx context.Context, ns, leaseNS string) (*tracker, error) {
	t := &tracker{ns: ns, changed: make(chan struct{}), claims: map[string]bool{}, annotatedAt: map[string]time.Time{},
		pvs: map[string]time.Time{}, pvOfClaim: map[string]time.Time{}, leaseHolders: map[string]string{}}
	ctx, cancel := context.WithCancel(ctx)
	t.cancel = cancel

	nsf := informers.NewSharedInformerFactoryWithOptions(h.client, 0, informers.WithNamespace(ns))
	pvcInf := nsf.Core().V1().PersistentVolumeClaims().Informer()
	_, _ = pvcInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { t.claim(o, false) },
		UpdateFunc: func(_, o any) { t.claim(o, false) },
		DeleteFunc: func(o any) { t.claim(o, true) },
	})
	cf := informers.NewSharedInformerFactory(h.client, 0)
	pvInf := cf.Core().V1().PersistentVolumes().Informer()
	_, _ = pvInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { t.pv(o, false) },
		UpdateFunc: func(_, o any) { t.pv(o, false) },
		DeleteFunc: func(o any) { t.pv(o, true) },
	})
	synced := []cache.InformerSynced{pvcInf.HasSynced, pvInf.HasSynced}
	if leaseNS != "" {
		lf := informers.NewSharedInformerFactoryWithOptions(h.client, 0, informers.WithNamespace(leaseNS))
		lInf := lf.Coordination().V1().Leases().Informer()
		_, _ = lInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc:    func(o any) { t.lease(o) },
			UpdateFunc: func(_, o any) { t.lease(o) },
		})
		synced = append(synced, lInf.HasSynced)
		lf.Start(ctx.Done())
	}
	nsf.Start(ctx.Done())
	cf.Start(ctx.Done())
	sctx, scancel := context.WithTimeout(ctx, 60*time.Second)
	defer scancel()
	if !cache.WaitForCacheSync(sctx.Done(), synced...) {
		cancel()
		return nil, fmt.Errorf("tracker: caches not synced")
	}
	return t, nil
}

func (t *tracker) stop() { t.cancel() }

func (t *tracker) notify() {
	close(t.changed)
	t.changed = make(chan struct{})
}

func (t *tracker) claim(o any, deleted bool) {
	if d, ok := o.(cache.DeletedFinalStateUnknown); ok {
		o = d.Obj
	}
	c, ok := o.(*corev1.PersistentVolumeClaim)
	if !ok {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if deleted {
		delete(t.claims, c.Name)
		delete(t.annotatedAt, c.Name)
	} else {
		t.claims[c.Name] = c.Status.Phase == corev1.ClaimBound
		if _, seen := t.annotatedAt[c.Name]; !seen && c.Annotations[annStorageProvisioner] != "" {
			t.annotatedAt[c.Name] = time.Now()
		}
	}
	t.notify()
}

func (t *tracker) pv(o any, deleted bool) {
	if d, ok := o.(cache.DeletedFinalStateUnknown); ok {
		o = d.Obj
	}
	pv, ok := o.(*corev1.PersistentVolume)
	if !ok || pv.Spec.ClaimRef == nil || pv.Spec.ClaimRef.Namespace != t.ns {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if deleted {
		delete(t.pvs, pv.Name)
		delete(t.pvOfClaim, pv.Spec.ClaimRef.Name)
	} else if _, seen := t.pvs[pv.Name]; !seen {
		now := time.Now()
		t.pvs[pv.Name] = now
		t.pvOfClaim[pv.Spec.ClaimRef.Name] = now
		t.pvAdds = append(t.pvAdds, now)
	}
	t.notify()
}

func (t *tracker) lease(o any) {
	l, ok := o.(*coordinationv1.Lease)
	if !ok {
		return
	}
	holder := ""
	if l.Spec.HolderIdentity != nil {
		holder = *l.Spec.HolderIdentity
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.leaseHolders[l.Name] != holder {
		t.leaseHolders[l.Name] = holder
		t.leaseChanges = append(t.leaseChanges, leaseChange{at: time.Now(), lease: l.Name, holder: holder})
		t.notify()
	}
}

// state is a snapshot of what the tracker has seen.
type state struct {
	claims, bound, pvs int
	pvAdds             []time.Time
	leaseChanges       []leaseChange
	leaseHolders       map[string]string
}

// annStorageProvisioner is kube-controller-manager's mark on a claim for
// an external provisioner: neither side provisions a claim before it.
const annStorageProvisioner = "volume.kubernetes.io/storage-provisioner"

// provisionerPart is how long claim waited from kube-controller-manager's
// annotation to its PV, as the tracker saw them (false if it saw neither).
func (t *tracker) provisionerPart(claim string) (time.Duration, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	a, okA := t.annotatedAt[claim]
	p, okP := t.pvOfClaim[claim]
	return p.Sub(a), okA && okP
}

func (t *tracker) snapshot() state {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.snapshotLocked()
}

func (t *tracker) snapshotLocked() state {
	s := state{claims: len(t.claims), pvs: len(t.pvs), pvAdds: t.pvAdds, leaseChanges: t.leaseChanges, leaseHolders: map[string]string{}}
	for _, b := range t.claims {
		if b {
			s.bound++
		}
	}
	for k, v := range t.leaseHolders {
		s.leaseHolders[k] = v
	}
	return s
}

// wait blocks until cond holds (checked on every change), the context ends,
// timeout passes or check (called every second, e.g. "has a process died?")
// fails. It returns the time of the change that satisfied cond.
func (t *tracker) wait(ctx context.Context, timeout time.Duration, what string, cond func(s state) bool, check func() error) (time.Time, error) {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		t.mu.Lock()
		s := t.snapshotLocked()
		ch := t.changed
		t.mu.Unlock()
		if cond(s) {
			return time.Now(), nil
		}
		select {
		case <-ch:
		case <-tick.C:
			if check != nil {
				if err := check(); err != nil {
					return time.Time{}, fmt.Errorf("waiting for %s: %w", what, err)
				}
			}
		case <-deadline.C:
			return time.Time{}, fmt.Errorf("waiting for %s: not done after %s (claims %d, bound %d, PVs %d)", what, timeout, s.claims, s.bound, s.pvs)
		case <-ctx.Done():
			return time.Time{}, ctx.Err()
		}
	}
}
