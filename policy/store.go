package policy

import (
	"slices"
	"sync"
	"sync/atomic"
)

// Store holds the current RuleSet. Decisions load it with one atomic read and
// never wait for a reload; a reload compiles a new RuleSet aside and swaps it
// in. The zero Store is ready and admits nobody (enforce, no grants).
type Store struct {
	cur atomic.Pointer[RuleSet]
	mu  sync.Mutex // serializes updates and SetMode, never taken by readers
	// sources holds each source's grants (the policy file, the SecretGrant
	// resources): the rule set is compiled from all of them, so one
	// source's reload never drops another's grants. Guarded by mu.
	sources map[string][]Grant
}

// Grant sources of a broker.
const (
	SourceFile         = "file"
	SourceSecretGrants = "secretgrants"
)

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

// Update is UpdateSource for a store with one source of grants.
func (s *Store) Update(grants []Grant, opts ...CompileOption) []RuleError {
	return s.UpdateSource("", grants, opts...)
}

// UpdateSource replaces the grants of one source and compiles them with
// every other source's, reusing the current rule set's compiled conditions
// and inheriting its mode and cost limit unless opts say otherwise; it
// installs the result and returns the invalid grants of this source (a
// grant named as one of another source's is invalid in both: every copy
// is rejected). Concurrent updates are serialized so none is lost.
func (s *Store) UpdateSource(source string, grants []Grant, opts ...CompileOption) []RuleError {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.sources == nil {
		s.sources = map[string][]Grant{}
	}
	s.sources[source] = grants
	names := make([]string, 0, len(s.sources))
	for k := range s.sources {
		names = append(names, k)
	}
	slices.Sort(names)
	var union []Grant
	for _, k := range names {
		union = append(union, s.sources[k]...)
	}
	all := append([]CompileOption{WithPrevious(s.Load())}, opts...)
	rs, errs := Compile(union, all...)
	s.cur.Store(rs)
	if len(names) == 1 {
		return errs
	}
	mine := make(map[string]bool, len(grants))
	for i := range grants {
		mine[grants[i].Key()] = true
	}
	return slices.DeleteFunc(errs, func(e RuleError) bool { return !mine[e.Key()] })
}

// SetMode switches the mode of the current rule set without recompiling.
func (s *Store) SetMode(m Mode) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cur.Store(s.Load().WithMode(m))
}
