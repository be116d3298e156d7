package policy

import (
	"sync"
	"sync/atomic"
)

// Store holds the current RuleSet. Decisions load it with one atomic read and
// never wait for a reload; a reload compiles a new RuleSet aside and swaps it
// in. The zero Store is ready and admits nobody (enforce, no grants).
type Store struct {
	cur atomic.Pointer[RuleSet]
	mu  sync.Mutex // serializes Update and SetMode, never taken by readers
}

// NewStore returns a Store holding rs (nil: no grants, enforce).
func NewStore(rs *RuleSet) *Store {
	s := &Store{}
	if rs != nil {
		s.cur.Store(rs)
	}
	return s
}

// Load returns the current rule set, never nil.
func (s *Store) Load() *RuleSet {
	if rs := s.cur.Load(); rs != nil {
		return rs
	}
	return emptyRuleSet
}

// Swap installs rs (nil: no grants, enforce) and returns the previous one.
func (s *Store) Swap(rs *RuleSet) *RuleSet {
	if rs == nil {
		rs = emptyRuleSet
	}
	old := s.cur.Swap(rs)
	if old == nil {
		old = emptyRuleSet
	}
	return old
}

// Decide decides req with the current rule set.
func (s *Store) Decide(req Request) Decision { return s.Load().Decide(req) }

// Update compiles grants, reusing the current rule set's compiled conditions
// and inheriting its mode and cost limit unless opts say otherwise, installs
// the result and returns the invalid grants. Concurrent Updates are
// serialized so none is lost.
func (s *Store) Update(grants []Grant, opts ...CompileOption) []RuleError {
	s.mu.Lock()
	defer s.mu.Unlock()
	all := append([]CompileOption{WithPrevious(s.Load())}, opts...)
	rs, errs := Compile(grants, all...)
	s.cur.Store(rs)
	return errs
}

// SetMode switches the mode of the current rule set without recompiling.
func (s *Store) SetMode(m Mode) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cur.Store(s.Load().WithMode(m))
}
