package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapshotclient "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	snapinformers "github.com/kubernetes-csi/external-snapshotter/client/v8/informers/externalversions"
	"k8s.io/client-go/tools/cache"
)

// snapTracker follows, by watch, the VolumeSnapshotContents bound to
// VolumeSnapshots of one namespace: which exist and which are ready.
type snapTracker struct {
	ns string

	mu       sync.Mutex
	changed  chan struct{} // closed and replaced on every change
	contents map[string]*snapshotv1.VolumeSnapshotContent

	cancel context.CancelFunc
}

// snapState is what the snapTracker has seen.
type snapState struct {
	contents, ready, failed int
}

func newSnapTracker(ctx context.Context, sc snapshotclient.Interface, ns string) (*snapTracker, error) {
	t := &snapTracker{ns: ns, changed: make(chan struct{}), contents: map[string]*snapshotv1.VolumeSnapshotContent{}}
	ctx, t.cancel = context.WithCancel(ctx)
	f := snapinformers.NewSharedInformerFactory(sc, 0)
	inf := f.Snapshot().V1().VolumeSnapshotContents().Informer()
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { t.content(o, false) },
		UpdateFunc: func(_, o any) { t.content(o, false) },
		DeleteFunc: func(o any) { t.content(o, true) },
	})
	f.Start(ctx.Done())
	sctx, scancel := context.WithTimeout(ctx, 60*time.Second)
	defer scancel()
	if !cache.WaitForCacheSync(sctx.Done(), inf.HasSynced) {
		t.cancel()
		return nil, fmt.Errorf("snapshot tracker: cache not synced")
	}
	return t, nil
}

func (t *snapTracker) stop() { t.cancel() }

func (t *snapTracker) content(o any, deleted bool) {
	if d, ok := o.(cache.DeletedFinalStateUnknown); ok {
		o = d.Obj
	}
	c, ok := o.(*snapshotv1.VolumeSnapshotContent)
	if !ok || c.Spec.VolumeSnapshotRef.Namespace != t.ns {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if deleted {
		delete(t.contents, c.Name)
	} else {
		t.contents[c.Name] = c
	}
	close(t.changed)
	t.changed = make(chan struct{})
}

func (t *snapTracker) stateLocked() snapState {
	s := snapState{contents: len(t.contents)}
	for _, c := range t.contents {
		switch st := c.Status; {
		case st != nil && st.ReadyToUse != nil && *st.ReadyToUse:
			s.ready++
		case st != nil && st.Error != nil:
			s.failed++
		}
	}
	return s
}

// all returns the contents seen, by name.
func (t *snapTracker) all() map[string]*snapshotv1.VolumeSnapshotContent {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make(map[string]*snapshotv1.VolumeSnapshotContent, len(t.contents))
	for k, v := range t.contents {
		out[k] = v.DeepCopy()
	}
	return out
}

// quiet waits until no content of the namespace has changed for d (the
// side has finished what it does after readyToUse, such as removing its
// annotations), at most timeout.
func (t *snapTracker) quiet(ctx context.Context, d, timeout time.Duration) error {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		t.mu.Lock()
		ch := t.changed
		t.mu.Unlock()
		idle := time.NewTimer(d)
		select {
		case <-ch:
			idle.Stop()
		case <-idle.C:
			return nil
		case <-deadline.C:
			idle.Stop()
			return fmt.Errorf("contents still changing after %s", timeout)
		case <-ctx.Done():
			idle.Stop()
			return ctx.Err()
		}
	}
}

// wait blocks until cond holds (checked on every change), the context ends,
// timeout passes or check (called every second) fails; it returns the time
// cond was seen to hold.
func (t *snapTracker) wait(ctx context.Context, timeout time.Duration, what string, cond func(s snapState) bool, check func() error) (time.Time, error) {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		t.mu.Lock()
		s, ch := t.stateLocked(), t.changed
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
			return time.Time{}, fmt.Errorf("waiting for %s: not done after %s (contents %d, ready %d, with an error %d)", what, timeout, s.contents, s.ready, s.failed)
		case <-ctx.Done():
			return time.Time{}, ctx.Err()
		}
	}
}
