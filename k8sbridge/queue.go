package k8sbridge

import (
	"context"
	"sync"
	"time"

	"k8s.io/client-go/util/workqueue"
)

// termQueue is a rate-limited workqueue that exists only while this replica
// leads: every leadership term gets a fresh one (a shut-down workqueue drops
// every Add), and informer handlers that fire between terms add nothing,
// since each term starts by listing everything from the caches.
type termQueue struct {
	name       string
	start, max time.Duration

	mu sync.Mutex
	q  workqueue.TypedRateLimitingInterface[string]
}

func newTermQueue(name string, start, max time.Duration) *termQueue {
	return &termQueue{name: name, start: start, max: max}
}

// begin makes the queue of a new term.
func (t *termQueue) begin() workqueue.TypedRateLimitingInterface[string] {
	q := workqueue.NewTypedRateLimitingQueueWithConfig(
		workqueue.NewTypedItemExponentialFailureRateLimiter[string](t.start, t.max),
		workqueue.TypedRateLimitingQueueConfig[string]{Name: t.name})
	t.mu.Lock()
	t.q = q
	t.mu.Unlock()
	return q
}

// end shuts the term's queue down.
func (t *termQueue) end() {
	t.mu.Lock()
	q := t.q
	t.q = nil
	t.mu.Unlock()
	if q != nil {
		q.ShutDown()
	}
}

func (t *termQueue) current() workqueue.TypedRateLimitingInterface[string] {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.q
}

// Add enqueues key if a term is running.
func (t *termQueue) Add(key string) {
	if q := t.current(); q != nil {
		q.Add(key)
	}
}

// Forget drops key's backoff if a term is running.
func (t *termQueue) Forget(key string) {
	if q := t.current(); q != nil {
		q.Forget(key)
	}
}

// Len is the number of waiting keys (0 between terms).
func (t *termQueue) Len() int {
	if q := t.current(); q != nil {
		return q.Len()
	}
	return 0
}

// work runs one term of a controller: a fresh queue filled by fill, n
// workers calling handle for each key until ctx ends. handle's error requeues
// the key with its backoff; a positive duration requeues it plainly (waiting,
// not failing); otherwise the key's backoff is forgotten.
func (t *termQueue) work(ctx context.Context, n int, fill func(), handle func(context.Context, string) (time.Duration, error), extra ...func(context.Context)) {
	q := t.begin()
	defer t.end()
	fill()
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				key, quit := q.Get()
				if quit {
					return
				}
				if ctx.Err() != nil {
					// The term is over: a shut-down queue still hands out
					// what it holds; the next term lists everything again.
					q.Done(key)
					continue
				}
				requeue, err := handle(ctx, key)
				switch {
				case err != nil:
					q.AddRateLimited(key)
				case requeue > 0:
					q.AddAfter(key, requeue)
				default:
					q.Forget(key)
				}
				q.Done(key)
			}
		}()
	}
	for _, f := range extra {
		wg.Add(1)
		go func() { defer wg.Done(); f(ctx) }()
	}
	<-ctx.Done()
	q.ShutDown()
	wg.Wait()
}

// driverBusyRetry is how soon a key whose driver has no free slot is looked
// at again: a plain requeue, since waiting for a slot is not a failure.
const driverBusyRetry = 200 * time.Millisecond

// driverSlots counts each driver's operations in progress against
// Config.PerDriverWorkers, so that one slow driver cannot take every worker
// of a controller. Each controller that honours the limit has its own:
// --worker-threads and --per-driver-workers (whose default is
// --worker-threads) count one controller's workers, and expansions waiting
// for a slow driver must not hold up provisioning for it.
type driverSlots struct {
	limit int // Validate makes it at least 1

	mu   sync.Mutex
	busy map[string]int
}

func newDriverSlots(limit int) *driverSlots {
	return &driverSlots{limit: limit, busy: map[string]int{}}
}

// acquire takes one of driver's slots; false means the driver is at its
// limit and the caller requeues its key after driverBusyRetry.
func (s *driverSlots) acquire(driver string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.busy[driver] >= s.limit {
		return false
	}
	s.busy[driver]++
	return true
}

// release gives back a slot taken by acquire.
func (s *driverSlots) release(driver string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.busy[driver]--; s.busy[driver] <= 0 {
		delete(s.busy, driver)
	}
}
