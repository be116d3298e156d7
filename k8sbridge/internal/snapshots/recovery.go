package snapshots

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/csibroker/csibroker/k8sbridge/intent"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
)

// Recovery settles the entries of a snapshot intent record that no worker
// is settling: those of the record's own drivers (per-driver leadership
// leaves the others to their leaders) whose snapshot is not being made now.
type Recovery[T intent.Entry] struct {
	What     string // "snapshot", "group snapshot": for its log lines
	Record   *intent.Record[T]
	Inflight *sync.Map // keys of the entries workers are making now
	Foreign  func(driver string) bool
	Settle   func(ctx context.Context, e T)
	Log      *slog.Logger
}

// Loop settles the entries at once, then every interval and whenever now
// receives, until ctx ends.
func (r *Recovery[T]) Loop(ctx context.Context, interval time.Duration, now <-chan struct{}) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		r.All(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-now:
		}
	}
}

// All is one pass over the record.
func (r *Recovery[T]) All(ctx context.Context) {
	entries, err := r.Record.List(ctx)
	if err != nil {
		if ctx.Err() == nil {
			r.Log.Warn(r.What+" recovery: cannot read the intent record; will retry", "err", err)
		}
		return
	}
	for _, e := range entries {
		if ctx.Err() != nil {
			return
		}
		if _, busy := r.Inflight.Load(e.Key()); busy {
			continue // a worker is making it now, and settles it itself
		}
		if r.Foreign(e.DriverName()) {
			continue // per-driver leadership: its driver's leader settles it
		}
		r.Settle(ctx, e)
	}
}

// Entry is a snapshot intent entry: the content its call was made for.
type Entry interface {
	intent.Entry
	// Bound is the content's name and UID and the UID of the (group)
	// snapshot it was bound to.
	Bound() (content, contentUID, refUID string)
}

// Settler is a Recovery's Settle over contents s: it drops an entry whose
// content records its snapshot, leaves one whose content is still being
// worked on, and undoes one whose content is gone.
func Settler[T Entry, C Content[C]](s *Contents[C], r *intent.Record[T], undo func(ctx context.Context, e T, why string)) func(context.Context, T) {
	return func(ctx context.Context, e T) {
		name, uid, refUID := e.Bound()
		c, found, err := s.current(ctx, name, uid)
		if err != nil {
			s.Env.Log.Warn(s.What+" recovery: cannot read the content; will retry", "content", name, "err", err)
			return
		}
		if found && (string(c.GetUID()) == uid || string(s.Ref(c).UID) == refUID) {
			if s.Recorded(c) {
				r.Remove(e.Key()) // recorded on the content
			}
			return // its own sync goes on (a content made again for the same snapshot takes it over)
		}
		undo(ctx, e, "its "+s.Kind+" "+name+" is gone")
	}
}

// current is content name from the cache when it holds the one of uid,
// else from the API server (the cache may lag behind); found is false
// when there is none.
func (s *Contents[C]) current(ctx context.Context, name, uid string) (c C, found bool, err error) {
	c, err = s.Lister.Get(name)
	if err == nil && string(c.GetUID()) == uid {
		return c, true, nil
	}
	c, err = s.Fetch(ctx, name)
	if apierrors.IsNotFound(err) {
		return c, false, nil
	}
	return c, err == nil, err
}

// NewRecord is a snapshot intent record, ConfigMap name in the broker's
// namespace: written on the intents' budget when there is one, read on
// the informers', shared by per-driver leadership (entries of drivers
// another replica leads are that replica's to write).
func NewRecord[T intent.Entry](b *kube.Env, name, purpose string) *intent.Record[T] {
	r := intent.NewRecord[T](b.Cfg.Client, b.Cfg.Namespace, name, purpose, b.Log)
	if b.Cfg.IntentClient != nil && b.Cfg.IntentBudget != nil {
		r.UseBudget(b.Cfg.IntentClient, b.Cfg.IntentBudget.Wait)
	}
	r.UseReader(b.Cfg.InformerClient)
	r.Share(func(d string) bool { return !b.Foreign(d) })
	return r
}

// Name is csi-snapshotter's name for the snapshot of the (group) snapshot
// of uid: <prefix>-<uid>, the UID without dashes and cut to n when n is
// positive.
func Name(prefix, uid string, n int) string {
	if n > 0 {
		uid = strings.ReplaceAll(uid, "-", "")
		if n < len(uid) {
			uid = uid[:n]
		}
	}
	return prefix + "-" + uid
}
