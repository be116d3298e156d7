package kube

import (
	"context"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/clock"
)

// TermQueue is a rate-limited workqueue that exists only while this replica
// leads: every leadership term gets a fresh one (a shut-down workqueue drops
// every Add), and informer handlers that fire between terms add nothing,
// since each term starts by listing everything from the caches.
type TermQueue struct {
	name       string
	start, max time.Duration
	// log and panics, if set (Env.NewTermQueue), hear of a work item
	// that panicked.
	log    *slog.Logger
	panics *prometheus.CounterVec
	items  *prometheus.CounterVec // handled work items by outcome
	clock  clock.WithTicker       // nil: the real clock
	// event, if set (Env.NewTermQueue), records the Event of a work item
	// that panicked on the object objectOf (ReportOn) names for its key.
	event    func(ctx context.Context, obj corev1.ObjectReference)
	objectOf func(key string) (corev1.ObjectReference, bool)

	slots *DriverSlots // set by withSlots, if the keys take per-driver slots

	mu sync.Mutex
	q  workqueue.TypedRateLimitingInterface[string]
	w  *Pool // the term's workers
}

func NewTermQueue(name string, start, max time.Duration) *TermQueue {
	return &TermQueue{name: name, start: start, max: max}
}

// ReasonWorkItemPanicked is the reason of the Event on the object of a
// work item that panicked.
const ReasonWorkItemPanicked = "WorkItemPanicked"

// NewTermQueue is a controller's queue with the configured backoff, whose
// work items that panic are logged with their stack, counted
// (csibroker_work_item_panics_total) and, once the controller said what
// object a key is of (ReportOn), an Event on that object.
func (e *Env) NewTermQueue(name string) *TermQueue {
	t := NewTermQueue(name, e.Cfg.RetryIntervalStart, e.Cfg.RetryIntervalMax)
	t.log, t.panics, t.items, t.clock = e.Log, e.Metrics.Panics, e.Metrics.WorkItems, e.Cfg.Clock
	t.event = func(ctx context.Context, obj corev1.ObjectReference) {
		// Neither the panic's value nor its stack: they may quote what
		// the handler held (a request, a secret); the log has both.
		e.EventOnce(ctx, obj, corev1.EventTypeWarning, ReasonWorkItemPanicked, "panic",
			"csibroker's %s controller failed on this object with an internal error (a panic; the broker's log has its stack); it is retried with backoff", name)
	}
	return t
}

// ReportOn says what object a key is of (false: none to name), for the
// Event of a work item that panicked. Call it before Work.
func (t *TermQueue) ReportOn(objectOf func(key string) (corev1.ObjectReference, bool)) {
	t.objectOf = objectOf
}

// run calls handle for key. A panic fails the item, which is retried with
// its backoff, never the process: one driver's bad answer, or a bug it
// hits, must not stop the other drivers' work.
func (t *TermQueue) run(ctx context.Context, key string, handle func(context.Context, string) (time.Duration, error)) (requeue time.Duration, err error) {
	defer func() {
		v := recover()
		if v == nil {
			return
		}
		err = fmt.Errorf("%s %s: panic: %v", t.name, key, v)
		notePanic(t.log, t.panics, t.name, key, v)
		t.reportPanic(ctx, key)
	}()
	return handle(ctx, key)
}

// notePanic logs a recovered panic with its stack (from the deferred
// function that recovered it) and counts it.
func notePanic(log *slog.Logger, panics *prometheus.CounterVec, controller, key string, v any) {
	if log != nil {
		log.Error("work item panicked; it fails and is retried with backoff", "controller", controller, "key", key,
			"panic", fmt.Sprint(v), "stack", string(debug.Stack()))
	}
	if panics != nil {
		panics.WithLabelValues(controller).Inc()
	}
}

// Safely runs f as a term queue runs a work item, for the work that is not
// a term queue's (the capacity controller's queue, the attach reconcile):
// a panic ends f, is logged with its stack and counted for controller,
// and never stops the process. It reports whether f panicked; what is to
// be retried is the caller's to say.
func (e *Env) Safely(controller, key string, f func()) (panicked bool) {
	defer func() {
		if v := recover(); v != nil {
			panicked = true
			notePanic(e.Log, e.Metrics.Panics, controller, key, v)
		}
	}()
	f()
	return false
}

// reportPanic records the Event of key's panic on its object, if the
// controller named one; a panic while finding it is logged, not raised.
func (t *TermQueue) reportPanic(ctx context.Context, key string) {
	if t.event == nil || t.objectOf == nil {
		return
	}
	defer func() {
		if v := recover(); v != nil && t.log != nil {
			t.log.Error("reporting a work item's panic panicked", "controller", t.name, "key", key, "panic", fmt.Sprint(v))
		}
	}()
	if obj, ok := t.objectOf(key); ok {
		t.event(ctx, obj)
	}
}

// begin makes the queue and the worker pool of a new term.
func (t *TermQueue) begin(n int) (workqueue.TypedRateLimitingInterface[string], *Pool) {
	q := workqueue.NewTypedRateLimitingQueueWithConfig(
		workqueue.NewTypedItemExponentialFailureRateLimiter[string](t.start, t.max),
		workqueue.TypedRateLimitingQueueConfig[string]{Name: t.name, Clock: t.clock})
	w := NewPool(n)
	t.mu.Lock()
	t.q, t.w = q, w
	t.mu.Unlock()
	return q, w
}

// end shuts the term's queue down.
func (t *TermQueue) end() {
	t.mu.Lock()
	q := t.q
	t.q, t.w = nil, nil
	t.mu.Unlock()
	if q != nil {
		q.ShutDown()
	}
}

// slotTaken tells the term's pool of a driver slot taken or given back.
func (t *TermQueue) slotTaken(taken bool) {
	t.mu.Lock()
	w := t.w
	t.mu.Unlock()
	if w != nil {
		w.SlotTaken(taken)
	}
}

func (t *TermQueue) current() workqueue.TypedRateLimitingInterface[string] {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.q
}

// Add enqueues key if a term is running.
func (t *TermQueue) Add(key string) {
	if q := t.current(); q != nil {
		q.Add(key)
	}
}

// Forget drops key's backoff if a term is running.
func (t *TermQueue) Forget(key string) {
	if q := t.current(); q != nil {
		q.Forget(key)
	}
}

// Len is the number of waiting keys, those in a driver's line included
// (0 between terms). A key in line that an update queued again counts
// twice until it runs.
func (t *TermQueue) Len() int {
	q := t.current()
	if q == nil {
		return 0
	}
	n := q.Len()
	if t.slots != nil {
		n += t.slots.waitingLen()
	}
	return n
}

// Work runs one term of a controller: a fresh queue filled by fill, n
// workers calling handle for each key until ctx ends. handle's error requeues
// the key with its backoff; a positive duration requeues it plainly (waiting,
// not failing); waitForSlot leaves it to its driver's line (its backoff
// kept); otherwise the key's backoff is forgotten.
//
// With per-driver slots (WithSlots), every slot a handler takes starts one
// more worker (Pool): the n stay free for every driver's keys, and a
// driver whose calls hang holds the workers of its own slots only.
func (t *TermQueue) Work(ctx context.Context, n int, fill func(), handle func(context.Context, string) (time.Duration, error), extra ...func(context.Context)) {
	if t.slots != nil {
		t.slots.reset()
	}
	q, w := t.begin(n)
	defer t.end()
	fill()
	w.Start(func() { t.worker(ctx, q, w, handle) })
	for _, f := range extra {
		w.Go(func() { f(ctx) })
	}
	<-ctx.Done()
	q.ShutDown()
	w.Stop()
}

// worker handles keys until the queue shuts down, or until it is one
// worker too many (a slot it started for was given back).
func (t *TermQueue) worker(ctx context.Context, q workqueue.TypedRateLimitingInterface[string], w *Pool, handle func(context.Context, string) (time.Duration, error)) {
	for !w.Surplus() {
		key, quit := q.Get()
		if quit {
			return
		}
		t.handleOne(ctx, q, key, handle)
	}
}

// handleOne runs handle for key and requeues, forgets or leaves it as its
// answer says (see Work).
func (t *TermQueue) handleOne(ctx context.Context, q workqueue.TypedRateLimitingInterface[string], key string, handle func(context.Context, string) (time.Duration, error)) {
	defer q.Done(key)
	if ctx.Err() != nil {
		// The term is over: a shut-down queue still hands out what it
		// holds; the next term lists everything again.
		return
	}
	requeue, err := t.run(ctx, key, handle)
	if t.slots != nil && requeue != WaitForSlot {
		// After waitForSlot, a slot handed to key was handed after its
		// acquire (which takes one handed before): the key is queued
		// again and takes it then.
		t.slots.settle(key)
	}
	outcome := "done"
	switch {
	case err != nil:
		outcome = "retry"
		q.AddRateLimited(key)
	case requeue > 0:
		outcome = "requeue"
		q.AddAfter(key, requeue)
	case requeue == WaitForSlot:
		outcome = "waiting"
	default:
		q.Forget(key)
	}
	if t.items != nil {
		t.items.WithLabelValues(t.name, outcome).Inc()
	}
}

// WaitForSlot is what a handler returns when its key waits in its
// driver's line (driverSlots.acquire said so): neither a failure nor a
// timed requeue, since the slot's release queues the key again.
const WaitForSlot time.Duration = -1

// DriverSlots counts each driver's operations in progress against
// Config.PerDriverWorkers, so that one slow driver cannot take every worker
// of a controller. Each controller that honours the limit has its own:
// --worker-threads and --per-driver-workers (whose default is
// --worker-threads) count one controller's workers, and expansions waiting
// for a slow driver must not hold up provisioning for it.
//
// A key that finds its driver at the limit waits in the driver's line,
// first come first served, instead of looking again and again: a slot
// given back goes to the first key in line, which is queued again (wake)
// holding it, so a key that arrives meanwhile cannot take it first. A key
// handed a slot that it does not take (its object changed or went) gives
// it on when its handler returns (settle).
type DriverSlots struct {
	limit int              // Validate makes it at least 1
	wake  func(key string) // queues a key again
	// taken, if set (Notify), hears of every slot taken (true) by
	// Acquire and given back (false) by Release.
	taken func(bool)

	mu      sync.Mutex
	busy    map[string]int      // driver → slots taken or handed to a key
	line    map[string][]string // driver → keys waiting, in arrival order
	waiting map[string]string   // key → the driver whose line it is in
	handed  map[string]string   // key → the driver whose slot it was handed
}

func NewDriverSlots(limit int, wake func(string)) *DriverSlots {
	return &DriverSlots{limit: limit, wake: wake, busy: map[string]int{}, line: map[string][]string{},
		waiting: map[string]string{}, handed: map[string]string{}}
}

// Notify makes taken hear of every slot taken (true) and given back
// (false); Pool.SlotTaken is one. Call it before the slots are used.
func (s *DriverSlots) Notify(taken func(bool)) { s.taken = taken }

// WithSlots gives the queue's keys per-driver slots: a key waiting in a
// driver's line counts in Len, the slot's release queues it again, and
// work settles each key's handed slot after its handler.
func (t *TermQueue) WithSlots(limit int) *DriverSlots {
	t.slots = NewDriverSlots(limit, t.Add)
	t.slots.Notify(t.slotTaken)
	return t.slots
}

// Acquire takes one of driver's slots for key. false means the driver is
// at its limit: key is in the driver's line (keeping its place if it was
// already) and the caller returns waitForSlot. An empty key (work that
// is not a queue's) never waits in line.
func (s *DriverSlots) Acquire(driver, key string) (ok bool) {
	s.mu.Lock()
	var next string
	defer func() {
		s.mu.Unlock()
		if next != "" {
			s.wake(next)
		}
		if ok && s.taken != nil {
			s.taken(true)
		}
	}()
	if d, ok := s.handed[key]; ok {
		delete(s.handed, key)
		if d == driver {
			return true
		}
		next = s.giveBackLocked(d) // its driver changed: the slot goes on
	}
	if s.busy[driver] < s.limit {
		s.busy[driver]++
		return true
	}
	if key != "" && s.waiting[key] == "" {
		s.waiting[key] = driver
		s.line[driver] = append(s.line[driver], key)
	}
	return false
}

// Release gives back a slot taken by acquire.
func (s *DriverSlots) Release(driver string) {
	s.mu.Lock()
	next := s.giveBackLocked(driver)
	s.mu.Unlock()
	if s.taken != nil {
		s.taken(false)
	}
	if next != "" {
		s.wake(next)
	}
}

// settle gives on a slot handed to key that key's handler did not take.
func (s *DriverSlots) settle(key string) {
	s.mu.Lock()
	d, ok := s.handed[key]
	if !ok {
		s.mu.Unlock()
		return
	}
	delete(s.handed, key)
	next := s.giveBackLocked(d)
	s.mu.Unlock()
	if next != "" {
		s.wake(next)
	}
}

// giveBackLocked hands driver's freed slot to the first key in its line,
// which the caller wakes, or frees it if none waits.
func (s *DriverSlots) giveBackLocked(driver string) (next string) {
	if l := s.line[driver]; len(l) > 0 {
		next = l[0]
		if len(l) == 1 {
			delete(s.line, driver)
		} else {
			s.line[driver] = l[1:]
		}
		delete(s.waiting, next)
		s.handed[next] = driver
		return next
	}
	if s.busy[driver]--; s.busy[driver] <= 0 {
		delete(s.busy, driver)
	}
	return ""
}

// reset starts a term: the lines and the slots handed but not taken are
// of the last term's queue, whose keys the new term lists again.
func (s *DriverSlots) reset() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, d := range s.handed {
		if s.busy[d]--; s.busy[d] <= 0 {
			delete(s.busy, d)
		}
	}
	clear(s.handed)
	clear(s.line)
	clear(s.waiting)
}

// waitingLen is the number of keys waiting in a line.
func (s *DriverSlots) waitingLen() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.waiting)
}
