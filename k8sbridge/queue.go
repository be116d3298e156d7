package k8sbridge

import (
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
