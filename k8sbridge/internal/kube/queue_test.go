package kube

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/csibroker/csibroker/internal/testutil"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"
)

// slotsUnderTest is a driverSlots whose woken keys are recorded in order.
type slotsUnderTest struct {
	*DriverSlots
	woken []string
}

func newSlotsUnderTest(limit int) *slotsUnderTest {
	s := &slotsUnderTest{}
	s.DriverSlots = NewDriverSlots(limit, func(key string) { s.woken = append(s.woken, key) })
	return s
}

func (s *slotsUnderTest) mustAcquire(t *testing.T, driver, key string, want bool) {
	t.Helper()
	if got := s.Acquire(driver, key); got != want {
		t.Fatalf("acquire(%s, %s) = %v, want %v", driver, key, got, want)
	}
}

// empty: nothing taken, handed or waiting is left behind.
func (s *slotsUnderTest) empty(t *testing.T) {
	t.Helper()
	if len(s.busy)+len(s.line)+len(s.waiting)+len(s.handed) != 0 {
		t.Errorf("left behind: busy %v, line %v, waiting %v, handed %v", s.busy, s.line, s.waiting, s.handed)
	}
}

// TestDriverSlots: each driver has PerDriverWorkers slots of its own; a
// slot given back with nobody waiting can be taken again, and a driver
// with none taken leaves nothing behind.
func TestDriverSlots(t *testing.T) {
	s := newSlotsUnderTest(2)
	s.mustAcquire(t, "a", "k1", true)
	s.mustAcquire(t, "a", "k2", true)
	s.mustAcquire(t, "b", "k3", true) // b has its own
	s.mustAcquire(t, "a", "", false)  // recovery: no key, so no place in line
	s.Release("a")
	s.mustAcquire(t, "a", "k4", true)
	if len(s.woken) != 0 {
		t.Errorf("woke %v with nobody in line", s.woken)
	}
	s.Release("a")
	s.Release("a")
	s.Release("b")
	s.empty(t)
}

// TestDriverSlotsServeTheLineInOrder: keys that find their driver at the
// limit wait in line and are handed the freed slots first come first
// served; a newcomer cannot take a slot handed to a key in line; a key
// that comes back while in line keeps its place.
func TestDriverSlotsServeTheLineInOrder(t *testing.T) {
	s := newSlotsUnderTest(1)
	s.mustAcquire(t, "a", "first", true)
	for _, k := range []string{"w1", "w2", "w3"} {
		s.mustAcquire(t, "a", k, false)
	}
	s.mustAcquire(t, "a", "w1", false) // queued again by an update: keeps its place
	if got := s.waitingLen(); got != 3 {
		t.Errorf("waitingLen %d, want 3", got)
	}
	s.Release("a")
	if !slices.Equal(s.woken, []string{"w1"}) {
		t.Fatalf("woken %v, want [w1]", s.woken)
	}
	s.mustAcquire(t, "a", "newcomer", false) // the slot is w1's
	s.mustAcquire(t, "a", "w1", true)
	s.Release("a")
	s.mustAcquire(t, "a", "w2", true)
	s.Release("a")
	s.mustAcquire(t, "a", "w3", true)
	s.Release("a")
	s.mustAcquire(t, "a", "newcomer", true)
	s.Release("a")
	if want := []string{"w1", "w2", "w3", "newcomer"}; !slices.Equal(s.woken, want) {
		t.Errorf("woken in the order %v, want %v", s.woken, want)
	}
	s.empty(t)
}

// TestDriverSlotsSettleAnUntakenSlot: a key handed a slot whose handler
// returns without taking it (its object went) passes the slot on to the
// next in line, or frees it; reset drops the lines and the handed slots
// of a term that ended.
func TestDriverSlotsSettleAnUntakenSlot(t *testing.T) {
	s := newSlotsUnderTest(1)
	s.mustAcquire(t, "a", "first", true)
	s.mustAcquire(t, "a", "gone", false)
	s.mustAcquire(t, "a", "next", false)
	s.Release("a")   // handed to "gone"
	s.settle("gone") // its handler found nothing to do
	if want := []string{"gone", "next"}; !slices.Equal(s.woken, want) {
		t.Fatalf("woken %v, want %v", s.woken, want)
	}
	s.settle("next")
	s.empty(t)

	// A key handed a slot of a driver it no longer asks for passes it on.
	s.mustAcquire(t, "a", "first", true)
	s.mustAcquire(t, "a", "moved", false)
	s.Release("a")
	s.mustAcquire(t, "b", "moved", true)
	s.Release("b")
	s.empty(t)

	// A term ends with a slot taken, one handed and keys in line.
	s.mustAcquire(t, "a", "k1", true)
	s.mustAcquire(t, "a", "k2", false)
	s.mustAcquire(t, "a", "k3", false)
	s.mustAcquire(t, "b", "k4", true)
	s.Release("a") // handed to k2, whose queue shut down
	s.reset()
	if got := s.waitingLen(); got != 0 {
		t.Errorf("waitingLen %d after reset, want 0", got)
	}
	s.mustAcquire(t, "a", "k3", true) // a's only slot was handed, not taken
	s.Release("a")
	s.Release("b") // k4's handler, still running at the reset
	s.empty(t)
}

// TestWorkItemPanicFailsOnlyThatItem: a handler that panics fails its item,
// which is retried with its backoff and logged with its stack, and counted;
// the workers go on with the other items and the process lives on.
func TestWorkItemPanicFailsOnlyThatItem(t *testing.T) {
	var logs testutil.SyncBuffer
	q := NewTermQueue("test", time.Millisecond, 10*time.Millisecond)
	q.log = slog.New(slog.NewTextHandler(&logs, nil))
	q.panics = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "panics"}, []string{"controller"})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var mu sync.Mutex
	calls := map[string]int{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		q.Work(ctx, 2, func() { q.Add("bad"); q.Add("good") }, func(_ context.Context, key string) (time.Duration, error) {
			mu.Lock()
			calls[key]++
			n := calls[key]
			if calls["bad"] >= 2 && calls["good"] >= 1 {
				cancel()
			}
			mu.Unlock()
			if key == "bad" && n == 1 {
				panic("a bug hit handling this item")
			}
			return 0, nil
		})
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatalf("the queue's workers did not go on after a panic: calls %v", calls)
	}
	mu.Lock()
	defer mu.Unlock()
	if calls["bad"] < 2 || calls["good"] != 1 {
		t.Fatalf("calls %v: want the panicking item retried and the other handled once", calls)
	}
	if n := testutil.CounterValue(q.panics.WithLabelValues("test")); n != 1 {
		t.Fatalf("panics counted %v, want 1", n)
	}
	if out := logs.String(); !strings.Contains(out, "work item panicked") || !strings.Contains(out, "key=bad") || !strings.Contains(out, "goroutine") {
		t.Fatalf("log of the panic (want its key and stack):\n%s", out)
	}
}

// TestWorkItemPanicIsAnEventOnItsObject: the panic of an item whose
// controller names its object (ReportOn) is reported there (once per
// attempt, the panic's value and stack kept out of it), and the item is
// retried with its exponential backoff, not in a hot loop: each retry
// waits at least twice as long as the one before (from start), until
// the item stops panicking.
func TestWorkItemPanicIsAnEventOnItsObject(t *testing.T) {
	const start = 20 * time.Millisecond
	q := NewTermQueue("test", start, time.Second)
	var mu sync.Mutex
	var reported []corev1.ObjectReference
	var at []time.Time
	q.event = func(_ context.Context, obj corev1.ObjectReference) {
		mu.Lock()
		defer mu.Unlock()
		reported = append(reported, obj)
	}
	q.ReportOn(func(key string) (corev1.ObjectReference, bool) {
		return corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: "ns", Name: key, UID: types.UID("uid-" + key)}, key != "nameless"
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		q.Work(ctx, 2, func() { q.Add("bad"); q.Add("nameless") }, func(_ context.Context, key string) (time.Duration, error) {
			if key == "nameless" {
				panic("no object to name")
			}
			mu.Lock()
			at = append(at, time.Now())
			n := len(at)
			mu.Unlock()
			if n < 5 {
				panic("secret-value-in-a-panic")
			}
			cancel()
			return 0, nil
		})
	}()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("the panicking item was not retried to its end")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(reported) != 4 {
		t.Fatalf("reported %d panics (%v), want the 4 of the named item", len(reported), reported)
	}
	for _, r := range reported {
		if r.Name != "bad" || r.UID != "uid-bad" {
			t.Fatalf("reported on %+v, want the bad item's object", r)
		}
	}
	for i := 1; i < len(at); i++ {
		if gap, least := at[i].Sub(at[i-1]), start<<(i-1); gap < least {
			t.Errorf("retry %d came %v after the attempt before, want at least %v (backoff)", i, gap, least)
		}
	}
}

// TestPanicEventNamesNoPanicValue: the Event a panic makes on its object
// says which controller failed and that it is retried, and quotes
// neither the panic's value nor its stack.
func TestPanicEventNamesNoPanicValue(t *testing.T) {
	rec := record.NewFakeRecorder(4)
	e := &Env{Log: slog.New(slog.DiscardHandler), Recorder: rec, Metrics: &Metrics{Panics: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "p"}, []string{"controller"})}}
	q := e.NewTermQueue("provision")
	q.ReportOn(func(key string) (corev1.ObjectReference, bool) {
		return corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: "ns", Name: key, UID: "u1"}, true
	})
	_, err := q.run(context.Background(), "claim", func(context.Context, string) (time.Duration, error) { panic("password=hunter2") })
	if err == nil {
		t.Fatal("a panicking item did not fail")
	}
	select {
	case ev := <-rec.Events:
		if !strings.Contains(ev, ReasonWorkItemPanicked) || !strings.Contains(ev, "provision controller") || !strings.Contains(ev, "retried with backoff") {
			t.Fatalf("event %q", ev)
		}
		if strings.Contains(ev, "hunter2") || strings.Contains(ev, "goroutine") {
			t.Fatalf("event quotes the panic: %q", ev)
		}
	default:
		t.Fatal("no Event on the item's object")
	}
}

// TestHungDriverHoldsOnlyItsSlotsWorkers: with as many slots per driver
// as workers (the default), a driver whose every call hangs holds its
// slots' workers only: another driver's key is handled meanwhile, the hung
// driver never has more calls in flight than its slots, and once its
// calls end the pool is back to its workers.
func TestHungDriverHoldsOnlyItsSlotsWorkers(t *testing.T) {
	const n = 2
	q := NewTermQueue("test", time.Millisecond, 10*time.Millisecond)
	slots := q.WithSlots(n)
	block := make(chan struct{})
	var inA, mostA atomic.Int32
	handledB := make(chan struct{})
	var doneA atomic.Int32
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		fill := func() {
			for i := range 5 {
				q.Add(fmt.Sprintf("a/%d", i))
			}
			q.Add("b/0")
		}
		q.Work(ctx, n, fill, func(_ context.Context, key string) (time.Duration, error) {
			driver, _, _ := strings.Cut(key, "/")
			if !slots.Acquire(driver, key) {
				return WaitForSlot, nil
			}
			defer slots.Release(driver)
			if driver == "b" {
				close(handledB)
				return 0, nil
			}
			now := inA.Add(1)
			defer inA.Add(-1)
			for m := mostA.Load(); now > m && !mostA.CompareAndSwap(m, now); m = mostA.Load() {
			}
			<-block
			doneA.Add(1)
			return 0, nil
		})
	}()
	select {
	case <-handledB:
	case <-time.After(10 * time.Second):
		t.Fatal("driver b's key waited for driver a's hung calls")
	}
	if m := mostA.Load(); m != n {
		t.Errorf("driver a had %d calls in flight at most, want its %d slots", m, n)
	}
	close(block)
	back := func() (bool, string) {
		q.mu.Lock()
		w := q.w
		q.mu.Unlock()
		w.mu.Lock()
		defer w.mu.Unlock()
		return doneA.Load() == 5 && w.running == n && w.held == 0, fmt.Sprintf("a's keys done %d, %d workers running, %d slots held", doneA.Load(), w.running, w.held)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		ok, state := back()
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("pool not back to its %d workers: %s", n, state)
		}
	}
	cancel()
	<-done
	if m := mostA.Load(); m > n {
		t.Errorf("driver a had %d calls in flight, more than its %d slots", m, n)
	}
}

// TestSafely: work that is not a term queue's fails alone on a panic, as
// a work item does: logged with its stack, counted, reported to the
// caller; work that does not panic runs as it is.
func TestSafely(t *testing.T) {
	var logs testutil.SyncBuffer
	e := &Env{Log: slog.New(slog.NewTextHandler(&logs, nil)), Metrics: &Metrics{Panics: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "p"}, []string{"controller"})}}
	ran := false
	if e.Safely("capacity", "d c s", func() { ran = true }) || !ran {
		t.Fatal("work that did not panic: reported as panicked, or not run")
	}
	if !e.Safely("capacity", "d c s", func() { panic("a bug") }) {
		t.Fatal("a panic not reported")
	}
	if n := testutil.CounterValue(e.Metrics.Panics.WithLabelValues("capacity")); n != 1 {
		t.Fatalf("panics counted %v, want 1", n)
	}
	if out := logs.String(); !strings.Contains(out, "controller=capacity") || !strings.Contains(out, "goroutine") {
		t.Fatalf("log of the panic (want its controller and stack):\n%s", out)
	}
}
