package budget

import (
	"context"
	"errors"
	"fmt"
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
	// One token now (the burst), then none for a long time: every write
	// below queues before any is served; the bucket then grows.
	l := New(Size{QPS: 0.001, Burst: 1})
	defer l.Stop()
	if err := l.Wait(context.Background()); err != nil { // takes the burst
		t.Fatal(err)
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
	l.Resize(Size{QPS: 1000, Burst: 1})
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
	l := New(Size{QPS: 0.001, Burst: 1})
	defer l.Stop()
	l.Accept()
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
	l.Resize(Size{QPS: 1000, Burst: 1})
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
	l := New(Size{QPS: 0.01, Burst: 1}) // one token per 100 s
	defer l.Stop()
	l.Accept()
	var wg sync.WaitGroup
	for i := range 5 {
		wg.Add(1)
		go func() { defer wg.Done(); l.Wait(WithDriver(context.Background(), fmt.Sprint(i))) }()
	}
	waitQueued(t, l, 5)
	l.Resize(Size{QPS: 1000, Burst: 10})
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatalf("%d writes still waiting after the bucket grew", l.queued())
	}
	if q := l.QPS(); q != 1000 {
		t.Fatalf("QPS %v after the resize", q)
	}
}

// TestTryAcceptLeavesTokensToWaiters: TryAccept takes no token while a
// write waits.
func TestTryAcceptLeavesTokensToWaiters(t *testing.T) {
	l := New(Size{QPS: 1, Burst: 1})
	defer l.Stop()
	if !l.TryAccept() {
		t.Fatal("a full bucket refused TryAccept")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go l.Wait(ctx)
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
