// Package budget is the broker's client budget for Kubernetes object
// writes when it serves many drivers: one token bucket whose size follows
// the number of drivers, shared fairly among them.
//
// A single external-provisioner has a client budget of its own (5 QPS,
// burst 10, by default); five of them have five. A broker serving five
// drivers with one such budget provisions five times slower (measured: see
// BENCHMARKS.md), so by default the bucket grows with the registered
// drivers: N drivers get N sidecars' budgets. And one budget shared by
// many drivers must not let one driver's backlog delay another's writes:
// the tokens go to the drivers that wait in turn (round robin), and to a
// driver's own writes in the order they asked. A write names its driver
// through its context (WithDriver); writes that name none share one turn.
//
// Limiter implements client-go's flowcontrol.RateLimiter, so it is a
// rest.Config's RateLimiter. It does no I/O; its dispatcher goroutine runs
// only while writes wait.
package budget

import (
	"context"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

type driverKey struct{}

// WithDriver names the driver whose write ctx carries.
func WithDriver(ctx context.Context, driver string) context.Context {
	return context.WithValue(ctx, driverKey{}, driver)
}

// DriverOf is the driver ctx names ("" for none).
func DriverOf(ctx context.Context) string {
	d, _ := ctx.Value(driverKey{}).(string)
	return d
}

// Size is a token bucket's rate and burst.
type Size struct {
	QPS   float64
	Burst int
}

// Times is s for n drivers (at least one).
func (s Size) Times(n int) Size {
	n = max(n, 1)
	return Size{QPS: s.QPS * float64(n), Burst: s.Burst * n}
}

// Limiter is a fair, resizable token bucket.
type Limiter struct {
	lim *rate.Limiter

	mu      sync.Mutex
	queues  map[string][]*waiter // per driver, in arrival order
	turns   []string             // drivers with waiters, in turn order
	next    int                  // index into turns of the next driver served
	running bool                 // the dispatcher runs
	stopped bool
	stop    chan struct{}
	resized chan struct{} // wakes the dispatcher to reserve at the new rate
	// onGrant, if set (tests), is told each grant's driver, in order.
	onGrant func(driver string)
}

type waiter struct {
	ready   chan struct{}
	granted bool // under Limiter.mu
	gone    bool // its caller stopped waiting (under Limiter.mu)
}

// New makes a Limiter of size s.
func New(s Size) *Limiter {
	return &Limiter{lim: rate.NewLimiter(rate.Limit(s.QPS), s.Burst), queues: map[string][]*waiter{},
		stop: make(chan struct{}), resized: make(chan struct{}, 1)}
}

// Resize changes the bucket's rate and burst; waiting writes keep their
// places.
func (l *Limiter) Resize(s Size) {
	l.lim.SetLimit(rate.Limit(s.QPS))
	l.lim.SetBurst(s.Burst)
	select {
	case l.resized <- struct{}{}:
	default:
	}
}

// QPS is the bucket's current rate.
func (l *Limiter) QPS() float32 { return float32(l.lim.Limit()) }

// TryAccept takes a token if one is free now and no write is waiting.
func (l *Limiter) TryAccept() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.turns) == 0 && l.lim.Allow()
}

// Accept waits for a token.
func (l *Limiter) Accept() { _ = l.Wait(context.Background()) }

// Wait waits for a token, behind the writes ctx's driver already waits
// for and in turn with the other drivers' writes, or until ctx is done.
func (l *Limiter) Wait(ctx context.Context) error {
	l.mu.Lock()
	if len(l.turns) == 0 && l.lim.Allow() {
		l.mu.Unlock()
		return nil
	}
	if l.stopped {
		l.mu.Unlock()
		return context.Canceled
	}
	w := &waiter{ready: make(chan struct{})}
	d := DriverOf(ctx)
	if len(l.queues[d]) == 0 {
		l.turns = append(l.turns, d)
	}
	l.queues[d] = append(l.queues[d], w)
	if !l.running {
		l.running = true
		go l.dispatch()
	}
	l.mu.Unlock()
	select {
	case <-w.ready:
		return nil
	case <-ctx.Done():
		l.mu.Lock()
		defer l.mu.Unlock()
		if w.granted {
			return nil // the token was ours already
		}
		w.gone = true
		return ctx.Err()
	}
}

// Stop ends the dispatcher; writes still waiting wait for their contexts.
func (l *Limiter) Stop() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.stopped {
		l.stopped = true
		close(l.stop)
	}
}

// dispatch hands out tokens to the waiting writes, a driver at a time in
// turn, until none waits.
func (l *Limiter) dispatch() {
	for {
		r := l.lim.Reserve()
		if d := r.Delay(); d > 0 {
			t := time.NewTimer(d)
			select {
			case <-t.C:
			case <-l.resized:
				// Reserved at the old rate: reserve again at the new.
				t.Stop()
				r.Cancel()
				continue
			case <-l.stop:
				t.Stop()
				r.Cancel()
				return
			}
		}
		if !l.grant() {
			r.Cancel() // nobody took it (every waiter left)
			return
		}
	}
}

// grant gives one token to the next waiting write in turn; false when no
// write waits any more (the dispatcher then stops).
func (l *Limiter) grant() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for len(l.turns) > 0 {
		if l.next >= len(l.turns) {
			l.next = 0
		}
		d := l.turns[l.next]
		q := l.queues[d]
		w := q[0]
		q = q[1:]
		if len(q) == 0 {
			delete(l.queues, d)
			l.turns = append(l.turns[:l.next], l.turns[l.next+1:]...)
		} else {
			l.queues[d] = q
			l.next++
		}
		if w.gone {
			continue
		}
		w.granted = true
		close(w.ready)
		if l.onGrant != nil {
			l.onGrant(d)
		}
		return true
	}
	l.running = false
	return false
}
