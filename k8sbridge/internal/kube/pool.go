package kube

import "sync"

// Pool is the workers of one term of a controller: base of them free for
// any driver's work, plus one for every driver slot taken (SlotTaken, told
// by DriverSlots.Notify), which stops once the slot is given back. An
// operation that holds its driver's slot holds its worker through the
// driver's call; without the extra workers, one driver whose calls hang
// would hold every worker once its slots were as many as the workers (the
// default), and every other driver's work would wait for its timeouts.
// So at most base plus every driver's slots run: as many as one sidecar
// per driver would.
type Pool struct {
	worker func() // one worker's loop, which ends when Surplus says so

	mu            sync.Mutex
	base, running int
	held          int  // driver slots taken
	closed        bool // the term is ending: no more workers
	wg            sync.WaitGroup
}

func NewPool(base int) *Pool { return &Pool{base: base} }

// Start runs the base workers, each calling worker, which loops while
// Surplus is false (and ends when its work does).
func (p *Pool) Start(worker func()) {
	p.mu.Lock()
	p.worker = worker
	p.mu.Unlock()
	for range p.base {
		p.add()
	}
}

// Go runs f beside the workers; Stop waits for it too.
func (p *Pool) Go(f func()) {
	p.wg.Add(1)
	go func() { defer p.wg.Done(); f() }()
}

// add starts a worker if fewer run than base plus the slots held.
func (p *Pool) add() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || p.worker == nil || p.running >= p.base+p.held {
		return
	}
	p.running++
	p.wg.Add(1)
	go func() { defer p.wg.Done(); p.worker() }()
}

// SlotTaken counts a driver slot taken (a worker more) or given back (the
// next worker to finish an item stops).
func (p *Pool) SlotTaken(taken bool) {
	p.mu.Lock()
	if taken {
		p.held++
	} else if p.held > 0 {
		p.held--
	}
	p.mu.Unlock()
	if taken {
		p.add()
	}
}

// Surplus reports whether the calling worker is one too many, and if so
// counts it gone: it must return.
func (p *Pool) Surplus() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.running > p.base+p.held {
		p.running--
		return true
	}
	return false
}

// Stop starts no more workers and waits for every one, and for what Go
// ran, to return (the caller ended their work: a shut-down queue, a
// cancelled context).
func (p *Pool) Stop() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.wg.Wait()
}
