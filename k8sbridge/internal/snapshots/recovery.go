package snapshots

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/csibroker/csibroker/k8sbridge/intent"
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
