package budget

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

// queued is the number of writes waiting.
func (l *Limiter) queued() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, q := range l.queues {
		n += len(q)
	}
	return n
}

// waitQueued waits until n writes wait.
func waitQueued(t *testing.T, l *Limiter, n int) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); l.queued() < n; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d writes waiting, want %d", l.queued(), n)
		}
	}
}

// waitServed waits until every write of wg is served, or fails after d.
func waitServed(t *testing.T, l *Limiter, wg *sync.WaitGroup, d time.Duration, what string) {
	t.Helper()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%d writes still waiting (%s)", l.queued(), what)
	}
}

// grants records the order in which writes got their tokens.
type grants struct {
	mu    sync.Mutex
	order []string
}

func (g *grants) add(s string) {
	g.mu.Lock()
	g.order = append(g.order, s)
	g.mu.Unlock()
}

// TestTurnsAmongDrivers: a driver with a backlog of writes does not delay
// another driver's write behind it: the other's is served at the next turn;
// a driver's own writes are served in the order they asked.
func TestTurnsAmongDrivers(t *testing.T) {
	// One token now in each bucket (the burst), then none for a long
	// time: every write below queues before any is served; the buckets
	// then grow.
	l := New(Size{QPS: 0.002, Burst: 2}, []string{"a", "b"})
	defer l.Stop()
	for _, d := range []string{"a", "b"} {
		if err := l.Wait(WithDriver(context.Background(), d)); err != nil { // takes its burst
			t.Fatal(err)
		}
	}
	var g grants
	l.onGrant = g.add
	var wg sync.WaitGroup
	start := func(driver string) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := l.Wait(WithDriver(context.Background(), driver)); err != nil {
				t.Error(err)
			}
		}()
	}
	for i := range 10 {
		start("a")
		waitQueued(t, l, i+1)
	}
	start("b")
	waitQueued(t, l, 11)
	l.Resize(Size{QPS: 2000, Burst: 2}, []string{"a", "b"})
	wg.Wait()
	g.mu.Lock()
	order := append([]string(nil), g.order...)
	g.mu.Unlock()
	pos := -1
	for i, s := range order {
		if s == "b" {
			pos = i
		}
	}
	if pos < 0 || pos > 1 {
		t.Fatalf("grant order %v: b's only write came at position %d, want at the next turn", order, pos)
	}
}

// TestLeavingWaiterPassesItsTurn: a write whose context ends stops waiting
// with the context's error, and the token goes to the next write.
func TestLeavingWaiterPassesItsTurn(t *testing.T) {
	l := New(Size{QPS: 0.001, Burst: 1}, []string{"a"})
	defer l.Stop()
	l.Wait(WithDriver(context.Background(), "a"))
	ctx, cancel := context.WithCancel(context.Background())
	gone := make(chan error, 1)
	go func() { gone <- l.Wait(WithDriver(ctx, "a")) }()
	waitQueued(t, l, 1)
	done := make(chan error, 1)
	go func() { done <- l.Wait(WithDriver(context.Background(), "a")) }()
	waitQueued(t, l, 2)
	cancel()
	if err := <-gone; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled waiter: %v", err)
	}
	l.Resize(Size{QPS: 1000, Burst: 1}, []string{"a"})
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the write after a cancelled one never got a token")
	}
}

// TestResizeServesWaitingWrites: a bucket made larger serves the writes
// already waiting at the new rate.
func TestResizeServesWaitingWrites(t *testing.T) {
	l := New(Size{QPS: 0.01, Burst: 1}, []string{"0"}) // one token per 100 s
	defer l.Stop()
	l.Wait(WithDriver(context.Background(), "0"))
	var wg sync.WaitGroup
	for range 5 {
		wg.Add(1)
		go func() { defer wg.Done(); l.Wait(WithDriver(context.Background(), "0")) }()
	}
	waitQueued(t, l, 5)
	l.Resize(Size{QPS: 1000, Burst: 10}, []string{"0", "1"})
	waitServed(t, l, &wg, 10*time.Second, "after the bucket grew")
	if q := l.QPS(); q != 1000 {
		t.Fatalf("QPS %v after the resize", q)
	}
}

// TestTryAcceptLeavesTokensToWaiters: TryAccept takes no token while a
// write waits.
func TestTryAcceptLeavesTokensToWaiters(t *testing.T) {
	l := New(Size{QPS: 1, Burst: 1}, nil)
	defer l.Stop()
	if !l.TryAccept() {
		t.Fatal("a full bucket refused TryAccept")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go l.Wait(ctx) // the same share as TryAccept's, empty now
	waitQueued(t, l, 1)
	if l.TryAccept() {
		t.Fatal("TryAccept took a token while a write waited")
	}
}

func TestSizeTimes(t *testing.T) {
	for _, c := range []struct {
		n    int
		want Size
	}{
		{0, Size{5, 10}}, {1, Size{5, 10}}, {5, Size{25, 50}}, {20, Size{100, 200}},
	} {
		if got := (Size{5, 10}).Times(c.n); got != c.want {
			t.Errorf("Times(%d) = %v, want %v", c.n, got, c.want)
		}
	}
}

// now is a write that does not wait: a context already done gets a token
// only if one is free at once.
func now(l *Limiter, driver string) bool {
	ctx, cancel := context.WithCancel(WithDriver(context.Background(), driver))
	cancel()
	return l.Wait(ctx) == nil
}

// TestQuietDriverKeepsHalfItsBurst: a busy driver takes its own burst and
// what the quiet drivers' shares lend, down to half their bursts; the
// quiet driver's next writes then find their tokens at once, as beside a
// sidecar of its own.
func TestQuietDriverKeepsHalfItsBurst(t *testing.T) {
	// Three shares of burst 10, refilling once per 1,000 s.
	l := New(Size{QPS: 0.003, Burst: 30}, []string{"a", "b", "c"})
	defer l.Stop()
	took := 0
	for now(l, "a") {
		took++
		if took > 30 {
			t.Fatal("driver a took more than the whole budget")
		}
	}
	if took != 20 {
		t.Errorf("busy driver a took %d tokens at once; want 20 (its 10, and 5 lent by each of b and c)", took)
	}
	for _, d := range []string{"b", "c"} {
		for i := range 5 {
			if !now(l, d) {
				t.Fatalf("quiet driver %s found no token for its write %d beside busy a", d, i+1)
			}
		}
		if now(l, d) {
			t.Errorf("driver %s took a sixth token: more than the half of its burst it kept", d)
		}
	}
}

// TestQuietDriverServedWhileBusyWaits: while a busy driver's backlog
// waits, a quiet driver's write is served at once from what its bucket
// kept, ahead of that backlog.
func TestQuietDriverServedWhileBusyWaits(t *testing.T) {
	l := New(Size{QPS: 0.004, Burst: 4}, []string{"a", "b"}) // shares of burst 2: b lends one
	defer l.Stop()
	for now(l, "a") {
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for range 3 {
		go l.Wait(WithDriver(ctx, "a"))
	}
	waitQueued(t, l, 3)
	if !now(l, "b") {
		t.Fatal("quiet driver b found no token while busy a waited")
	}
}

// TestFixedTotalSharedAmongDrivers: a fixed total is split among the
// registered drivers, and a lone busy driver still gets nearly all of it.
func TestFixedTotalSharedAmongDrivers(t *testing.T) {
	l := New(Size{QPS: 0.004, Burst: 8}, []string{"a", "b", "c", "d"}) // shares of burst 2
	defer l.Stop()
	took := 0
	for now(l, "a") && took < 100 {
		took++
	}
	if took != 5 {
		t.Errorf("driver a took %d tokens of a fixed total of 8 at once; want 5 (its 2, one lent by each other)", took)
	}
	if q := l.QPS(); q != float32(0.004) {
		t.Errorf("QPS %v; want the total's", q)
	}
}

// TestDriverGoneLosesItsShare: a driver no longer registered lends no
// more, and a new one starts with a full bucket.
func TestDriverGoneLosesItsShare(t *testing.T) {
	l := New(Size{QPS: 0.002, Burst: 4}, []string{"a", "b"}) // shares of burst 2
	defer l.Stop()
	l.Resize(Size{QPS: 0.002, Burst: 4}, []string{"a", "c"})
	took := 0
	for now(l, "a") && took < 100 {
		took++
	}
	if took != 3 {
		t.Errorf("driver a took %d tokens; want 3 (its 2, one lent by new c, none by gone b)", took)
	}
}

// TestBacklogServedByLoans: a busy driver's waiting backlog is served by
// its own refills and by the quiet drivers' loans until it is empty.
func TestBacklogServedByLoans(t *testing.T) {
	l := New(Size{QPS: 400, Burst: 4}, []string{"a", "b"})
	defer l.Stop()
	var wg sync.WaitGroup
	for range 100 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := l.Wait(WithDriver(context.Background(), "a")); err != nil {
				t.Error(err)
			}
		}()
	}
	waitServed(t, l, &wg, 20*time.Second, "of driver a's")
}
