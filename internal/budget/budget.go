// Package budget is the broker's client budget for Kubernetes object
// writes when it serves many drivers: a total whose size follows the
// number of drivers, split into one share per driver.
//
// A single external-provisioner has a client budget of its own (5 QPS,
// burst 10, by default); five of them have five. A broker serving five
// drivers with one such budget provisions five times slower (measured: see
// BENCHMARKS.md), so by default the total grows with the registered
// drivers: N drivers get N sidecars' budgets.
//
// Each driver's share is a token bucket of its own, as each sidecar's
// client is, so one driver's backlog never empties the bucket another
// driver's next write needs. A share lends what its driver does not use:
// a driver whose bucket is empty may take a token from another driver's
// bucket while that one holds more than half its burst. A quiet driver
// thus keeps half its burst for its next writes, and a busy driver beside
// quiet ones gets nearly the whole total. Writes that wait are served a
// driver at a time in turn (round robin), and a driver's own writes in the
// order they asked. A write names its driver through its context
// (WithDriver); writes that name none, or a driver not registered, get a
// share of their own besides the total's.
//
// Limiter implements client-go's flowcontrol.RateLimiter, so it is a
// rest.Config's RateLimiter. It does no I/O; its dispatcher goroutine runs
// only while writes wait.
package budget

import (
	"context"
	"math"
	"slices"
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

// share is one of n equal parts of s (a burst of at least one).
func (s Size) share(n int) Size {
	n = max(n, 1)
	return Size{QPS: s.QPS / float64(n), Burst: max(1, s.Burst/n)}
}

// Limiter is a total budget split into fair, lending per-driver shares.
type Limiter struct {
	mu      sync.Mutex
	total   Size
	share   Size
	buckets map[string]*rate.Limiter
	lenders []string             // the buckets' drivers, in lending turn
	lend    int                  // index into lenders of the next asked
	queues  map[string][]*waiter // per driver, in arrival order
	turns   []string             // drivers with waiters, in turn order
	next    int                  // index into turns of the next driver served
	running bool                 // the dispatcher runs
	stopped bool
	stop    chan struct{}
	wake    chan struct{} // a resize or a new driver waiting: look again
	// onGrant, if set (tests), is told each grant's driver, in order.
	onGrant func(driver string)
}

type waiter struct {
	ready   chan struct{}
	granted bool // under Limiter.mu
	gone    bool // its caller stopped waiting (under Limiter.mu)
}

// New makes a Limiter of size total, shared among drivers.
func New(total Size, drivers []string) *Limiter {
	l := &Limiter{buckets: map[string]*rate.Limiter{}, queues: map[string][]*waiter{},
		stop: make(chan struct{}), wake: make(chan struct{}, 1)}
	l.Resize(total, drivers)
	return l
}

// Resize changes the total and the drivers it is shared among: a new
// driver's bucket starts full, a driver gone (with no write waiting) loses
// its; waiting writes keep their places.
func (l *Limiter) Resize(total Size, drivers []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.total = total
	l.share = total.share(len(drivers))
	for d, b := range l.buckets {
		if !slices.Contains(drivers, d) && len(l.queues[d]) == 0 {
			delete(l.buckets, d)
			continue
		}
		b.SetLimit(rate.Limit(l.share.QPS))
		b.SetBurst(l.share.Burst)
	}
	for _, d := range drivers {
		l.bucket(d)
	}
	l.lenders = slices.Sorted(func(yield func(string) bool) {
		for d := range l.buckets {
			if !yield(d) {
				return
			}
		}
	})
	l.poke()
}

// QPS is the total's rate.
func (l *Limiter) QPS() float32 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return float32(l.total.QPS)
}

// TryAccept takes a token for a write that names no driver if one is free
// now and no write is waiting.
func (l *Limiter) TryAccept() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.turns) == 0 && l.take("", time.Now())
}

// Accept waits for a token.
func (l *Limiter) Accept() { _ = l.Wait(context.Background()) }

// Wait waits for a token, behind the writes ctx's driver already waits
// for and in turn with the other drivers' writes, or until ctx is done.
func (l *Limiter) Wait(ctx context.Context) error {
	d := DriverOf(ctx)
	l.mu.Lock()
	if len(l.queues[d]) == 0 && l.takeNow(d, time.Now()) {
		l.mu.Unlock()
		return nil
	}
	if l.stopped {
		l.mu.Unlock()
		return context.Canceled
	}
	w := &waiter{ready: make(chan struct{})}
	if len(l.queues[d]) == 0 {
		l.turns = append(l.turns, d)
		l.poke()
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

// takeNow is take for a write that arrives: its own bucket always, a loan
// only while no other write waits (those are served in turn first).
func (l *Limiter) takeNow(d string, now time.Time) bool {
	if len(l.turns) == 0 {
		return l.take(d, now)
	}
	return l.bucket(d).AllowN(now, 1)
}

// take takes a token for driver d: from its own bucket, or else lent by
// another bucket that holds more than half its burst, the lenders asked in
// turn. Under l.mu.
func (l *Limiter) take(d string, now time.Time) bool {
	if l.bucket(d).AllowN(now, 1) {
		return true
	}
	for i := range l.lenders {
		k := (l.lend + i) % len(l.lenders)
		e := l.lenders[k]
		if b := l.buckets[e]; e != d && b.TokensAt(now) >= keep(b)+1 {
			b.AllowN(now, 1)
			l.lend = (k + 1) % len(l.lenders)
			return true
		}
	}
	return false
}

// keep is how many tokens a bucket keeps for its own driver.
func keep(b *rate.Limiter) float64 { return float64(b.Burst() / 2) }

// bucket is d's bucket, made (full, of one share) if d has none. Under l.mu.
func (l *Limiter) bucket(d string) *rate.Limiter {
	b, ok := l.buckets[d]
	if !ok {
		b = rate.NewLimiter(rate.Limit(l.share.QPS), l.share.Burst)
		l.buckets[d] = b
		l.lenders = append(l.lenders, d)
	}
	return b
}

// poke wakes the dispatcher to look again. Under l.mu.
func (l *Limiter) poke() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// dispatch hands out tokens to the waiting writes, a driver at a time in
// turn, until none waits.
func (l *Limiter) dispatch() {
	for {
		l.mu.Lock()
		granted, wait := l.grant(time.Now())
		l.mu.Unlock()
		if granted {
			continue
		}
		if wait < 0 {
			return // nobody waits
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-l.wake:
			t.Stop()
		case <-l.stop:
			t.Stop()
			return
		}
	}
}

// idle is the longest the dispatcher sleeps when no bucket refills.
const idle = time.Minute

// grant gives one token to the next waiting write in turn that can have
// one now. If none can, it says how long until one might (negative when
// no write waits any more: the dispatcher then stops). Under l.mu.
func (l *Limiter) grant(now time.Time) (bool, time.Duration) {
	l.dropGone()
	if len(l.turns) == 0 {
		l.running = false
		return false, -1
	}
	for i := range l.turns {
		k := (l.next + i) % len(l.turns)
		d := l.turns[k]
		if !l.take(d, now) {
			continue
		}
		q := l.queues[d]
		w := q[0]
		if q = q[1:]; len(q) == 0 {
			delete(l.queues, d)
			l.turns = slices.Delete(l.turns, k, k+1)
			l.next = k
		} else {
			l.queues[d] = q
			l.next = k + 1
		}
		w.granted = true
		close(w.ready)
		if l.onGrant != nil {
			l.onGrant(d)
		}
		return true, 0
	}
	return false, l.untilToken(now)
}

// dropGone removes the writes that stopped waiting. Under l.mu.
func (l *Limiter) dropGone() {
	for d, q := range l.queues {
		q = slices.DeleteFunc(q, func(w *waiter) bool { return w.gone })
		if len(q) > 0 {
			l.queues[d] = q
			continue
		}
		delete(l.queues, d)
		if k := slices.Index(l.turns, d); k >= 0 {
			l.turns = slices.Delete(l.turns, k, k+1)
		}
	}
}

// untilToken is how long until a waiting driver's bucket holds a token, or
// some bucket can lend one. Under l.mu.
func (l *Limiter) untilToken(now time.Time) time.Duration {
	soonest := idle
	for _, d := range l.turns {
		soonest = min(soonest, refill(l.buckets[d], 1, now))
	}
	for _, b := range l.buckets {
		soonest = min(soonest, refill(b, keep(b)+1, now))
	}
	return max(soonest, time.Millisecond)
}

// refill is how long until b holds n tokens (idle if it never will).
func refill(b *rate.Limiter, n float64, now time.Time) time.Duration {
	have := b.TokensAt(now)
	if have >= n {
		return 0
	}
	if b.Limit() == rate.Inf {
		return 0
	}
	if b.Limit() <= 0 {
		return idle
	}
	s := (n - have) / float64(b.Limit())
	if s > idle.Seconds() || math.IsNaN(s) {
		return idle
	}
	return time.Duration(s * float64(time.Second))
}
