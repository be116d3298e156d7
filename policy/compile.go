package policy

import (
	"cmp"
	"fmt"
	"slices"
	"strings"

	"github.com/csibroker/csibroker/internal/csiname"
)

// CompileOption adjusts Compile.
type CompileOption func(*compileConfig)

type compileConfig struct {
	mode      Mode
	costLimit uint64
	previous  *RuleSet
}

// WithMode sets the mode the rule set decides in. Default: the previous rule
// set's mode (WithPrevious), else ModeEnforce.
func WithMode(m Mode) CompileOption { return func(c *compileConfig) { c.mode = m } }

// WithCostLimit sets the CEL runtime cost budget per condition evaluation.
// Default: the previous rule set's, else DefaultCostLimit.
func WithCostLimit(n uint64) CompileOption { return func(c *compileConfig) { c.costLimit = n } }

// WithPrevious reuses the compiled conditions of rs for grants whose
// condition text (and cost limit) did not change, so a reload compiles only
// what changed, and inherits rs's mode and cost limit unless set.
func WithPrevious(rs *RuleSet) CompileOption { return func(c *compileConfig) { c.previous = rs } }

// RuleError reports one invalid grant. The grant is not applied; the other
// grants are.
type RuleError struct {
	Namespace  string
	Name       string
	Generation int64
	// Message lists every problem found, "; "-separated, each prefixed with
	// its field path (e.g. "spec.drivers: must list at least one driver").
	Message string
	// FailClosed: the grant was a Deny grant (or its action could not be
	// read), so instead of being dropped, which would widen access, it
	// denies every request for a secret in its namespace until fixed (in
	// every namespace, when its namespace is missing or not a name).
	FailClosed bool
}

// Key is "namespace/name".
func (e RuleError) Key() string { return e.Namespace + "/" + e.Name }

func (e RuleError) Error() string {
	s := "secretgrant " + e.Key() + ": " + e.Message
	if e.FailClosed {
		s += " (invalid Deny grant: every secret in namespace " + e.Namespace + " is denied until it is fixed)"
	} else {
		s += " (not applied)"
	}
	return s
}

// RuleSet is an immutable, compiled set of grants. It is safe for concurrent
// use; replace it as a whole (see Store).
type RuleSet struct {
	mode      Mode
	costLimit uint64
	valid     int
	byNS      map[string]*nsRules
	// lockAll is the first invalid Deny grant whose namespace is not a
	// namespace name (a file's grant without metadata.namespace): the
	// secrets it meant to protect are unknown, so every one is denied.
	lockAll *RuleError
	errs    []RuleError
	conds   map[string]*condition // by condition text, for WithPrevious
}

// nsRules holds the grants of one namespace, that is, every grant that can
// admit a secret of that namespace.
type nsRules struct {
	byDriver map[string]*bucket // driver name, or "*"
	lock     *RuleError         // first invalid Deny grant: fail closed
}

// bucket holds the grants for one (namespace, driver) pair, split by how
// they name secrets. Lists are in grant order (namespace, name).
type bucket struct {
	exact map[string]*ruleLists // by exact secret name
	wild  ruleLists             // grants with a "prefix*" or "*" secret name
}

type ruleLists struct{ allow, deny []*rule }

// rule is a compiled, valid grant.
type rule struct {
	idx       int // position in (namespace, name) order: lower decides first
	key       string
	namespace string
	action    Action

	anyDriver bool
	drivers   []string

	anySecret   bool
	secretNames map[string]struct{}
	prefixes    []string

	ops uint32

	anyRequester bool
	namespaces   map[string]struct{}
	nsSelector   *selector
	storageClass []string // nil: any
	nodes        []string // nil: any

	cond *condition
}

// emptyRuleSet admits nobody.
var emptyRuleSet = &RuleSet{mode: ModeEnforce, costLimit: DefaultCostLimit}

// Compile validates and compiles grants. Invalid grants are reported, one
// RuleError each, and are not applied, never partly: the valid grants make
// up the rule set. An invalid Deny grant fails closed (RuleError.FailClosed):
// its namespace is locked down until it is fixed, because dropping a deny
// would widen access. Duplicate namespace/name pairs (possible in a file) are
// all rejected. Errors come in (namespace, name) order.
func Compile(grants []Grant, opts ...CompileOption) (*RuleSet, []RuleError) {
	cfg := compileConfig{}
	for _, o := range opts {
		o(&cfg)
	}
	prev := cfg.previous
	if cfg.mode == "" {
		cfg.mode = ModeEnforce
		if prev != nil {
			cfg.mode = prev.mode
		}
	}
	if cfg.costLimit == 0 {
		cfg.costLimit = DefaultCostLimit
		if prev != nil {
			cfg.costLimit = prev.costLimit
		}
	}

	rs := &RuleSet{
		mode:      cfg.mode,
		costLimit: cfg.costLimit,
		byNS:      make(map[string]*nsRules),
		conds:     make(map[string]*condition),
	}
	if _, err := ParseMode(string(cfg.mode)); err != nil {
		// An unknown mode must not weaken anything: enforce.
		rs.mode = ModeEnforce
	}

	order := make([]int, len(grants))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int {
		return cmp.Or(cmp.Compare(grants[a].Namespace, grants[b].Namespace), cmp.Compare(grants[a].Name, grants[b].Name))
	})
	count := make(map[string]int, len(grants))
	for i := range grants {
		count[grants[i].Key()]++
	}

	var errs []RuleError
	for idx, gi := range order {
		g := &grants[gi]
		r, problems := rs.compileGrant(g, idx, prev)
		if n := count[g.Key()]; n > 1 {
			problems = append(problems, fmt.Sprintf("metadata: %d grants are named %s; every copy is rejected", n, g.Key()))
		}
		if len(problems) > 0 {
			e := RuleError{Namespace: g.Namespace, Name: g.Name, Generation: g.Generation, Message: strings.Join(problems, "; ")}
			switch {
			case g.Spec.Action == "" || g.Spec.Action == ActionAllow:
			case dnsLabel(g.Namespace):
				e.FailClosed = true
				ns := rs.namespace(g.Namespace)
				if ns.lock == nil {
					lock := e
					ns.lock = &lock
				}
			default:
				e.FailClosed = true
				e.Message += "; as a Deny grant without a valid metadata.namespace, it denies every secret in every namespace until fixed"
				if rs.lockAll == nil {
					lock := e
					rs.lockAll = &lock
				}
			}
			errs = append(errs, e)
			continue
		}
		rs.add(g, r)
		rs.valid++
	}
	rs.errs = errs
	return rs, slices.Clone(errs)
}

func (rs *RuleSet) namespace(ns string) *nsRules {
	n := rs.byNS[ns]
	if n == nil {
		n = &nsRules{byDriver: make(map[string]*bucket)}
		rs.byNS[ns] = n
	}
	return n
}

// add indexes r under its namespace, each driver (or "*"), and each exact
// secret name (or the wildcard list).
func (rs *RuleSet) add(g *Grant, r *rule) {
	ns := rs.namespace(g.Namespace)
	drivers := r.drivers
	if r.anyDriver {
		drivers = []string{Wildcard}
	}
	for _, d := range dedupe(drivers) {
		b := ns.byDriver[d]
		if b == nil {
			b = &bucket{exact: make(map[string]*ruleLists)}
			ns.byDriver[d] = b
		}
		if r.anySecret || len(r.prefixes) > 0 {
			b.wild.add(r)
		}
		if r.anySecret {
			continue
		}
		for name := range r.secretNames {
			l := b.exact[name]
			if l == nil {
				l = &ruleLists{}
				b.exact[name] = l
			}
			l.add(r)
		}
	}
}

func (l *ruleLists) add(r *rule) {
	if r.action == ActionDeny {
		l.deny = append(l.deny, r)
	} else {
		l.allow = append(l.allow, r)
	}
}

func dedupe(in []string) []string {
	out := slices.Clone(in)
	slices.Sort(out)
	return slices.Compact(out)
}

// compileGrant validates g and builds its rule. Every problem is collected,
// so a status message tells the author everything at once.
func (rs *RuleSet) compileGrant(g *Grant, idx int, prev *RuleSet) (*rule, []string) {
	var p []string
	add := func(format string, args ...any) { p = append(p, fmt.Sprintf(format, args...)) }
	s := &g.Spec
	r := &rule{idx: idx, key: g.Key(), namespace: g.Namespace, action: s.Action}

	if !dnsLabel(g.Namespace) {
		add("metadata.namespace: %q is not a valid namespace name (a grant only admits secrets of its own namespace)", g.Namespace)
	}
	if !dnsSubdomain(g.Name) {
		add("metadata.name: %q is not a valid object name", g.Name)
	}
	switch s.Action {
	case "":
		r.action = ActionAllow
	case ActionAllow, ActionDeny:
	default:
		add("spec.action: %q is not Allow or Deny", s.Action)
	}

	if len(s.Drivers) == 0 {
		add(`spec.drivers: must list at least one CSI driver name (or "*" for any driver); an empty list admits nobody`)
	}
	for _, d := range s.Drivers {
		switch {
		case d == Wildcard:
			r.anyDriver = true
		case csiname.Valid(d):
			r.drivers = append(r.drivers, d)
		default:
			add("spec.drivers: %q is not a valid CSI driver name", d)
		}
	}

	if len(s.SecretNames) == 0 {
		add(`spec.secretNames: must list at least one secret name, "prefix*" pattern or "*"; an empty list admits nobody`)
	}
	for _, n := range s.SecretNames {
		switch {
		case n == Wildcard:
			r.anySecret = true
		case strings.Contains(n, Wildcard):
			prefix := strings.TrimSuffix(n, Wildcard)
			if !dnsSubdomainPrefix(prefix) {
				add(`spec.secretNames: %q is not a valid pattern (a secret name prefix followed by a single trailing "*")`, n)
			}
			r.prefixes = append(r.prefixes, prefix)
		case dnsSubdomain(n):
			if r.secretNames == nil {
				r.secretNames = make(map[string]struct{}, len(s.SecretNames))
			}
			r.secretNames[n] = struct{}{}
		default:
			add("spec.secretNames: %q is not a valid secret name", n)
		}
	}

	if len(s.Operations) == 0 {
		add(`spec.operations: must list at least one operation (or "*" for all); an empty list admits nobody`)
	}
	for _, o := range s.Operations {
		switch {
		case o == AnyOperation:
			r.ops = ^uint32(0)
		case o.Valid():
			r.ops |= o.bit()
		default:
			add("spec.operations: %q is not a CSI operation with secrets (one of %s, or \"*\")", o, opList())
		}
	}

	rq := &s.Requesters
	if len(rq.Namespaces) == 0 && rq.NamespaceSelector == nil {
		add("spec.requesters: must set namespaces or namespaceSelector; a grant without them admits nobody")
	}
	for _, n := range rq.Namespaces {
		switch {
		case n == Wildcard:
			r.anyRequester = true
		case dnsLabel(n):
			if r.namespaces == nil {
				r.namespaces = make(map[string]struct{}, len(rq.Namespaces))
			}
			r.namespaces[n] = struct{}{}
		default:
			add("spec.requesters.namespaces: %q is not a valid namespace name", n)
		}
	}
	if rq.NamespaceSelector != nil {
		sel, probs := compileSelector("spec.requesters.namespaceSelector", rq.NamespaceSelector)
		p = append(p, probs...)
		r.nsSelector = sel
	}
	r.storageClass = nameList(rq.StorageClasses, "spec.requesters.storageClasses", "StorageClass", add)
	r.nodes = nameList(rq.Nodes, "spec.requesters.nodes", "node", add)

	switch {
	case s.Condition == "":
	case strings.TrimSpace(s.Condition) == "":
		add("spec.condition: is blank; omit it or write a CEL expression")
	default:
		c, err := rs.condition(s.Condition, prev)
		if err != nil {
			add("spec.condition: %v", err)
		}
		r.cond = c
	}
	return r, p
}

// nameList validates an optional list of object names: nil means "any",
// an explicitly empty list is ambiguous and rejected.
func nameList(in []string, path, what string, add func(string, ...any)) []string {
	if in == nil {
		return nil
	}
	if len(in) == 0 {
		add("%s: must not be an empty list; omit the field to allow any %s", path, what)
		return nil
	}
	for _, n := range in {
		if !dnsSubdomain(n) {
			add("%s: %q is not a valid %s name", path, n, what)
		}
	}
	return dedupe(in)
}

// condition compiles text, reusing this rule set's or the previous rule
// set's program for the same text and cost limit.
func (rs *RuleSet) condition(text string, prev *RuleSet) (*condition, error) {
	if c := rs.conds[text]; c != nil {
		return c, nil
	}
	if prev != nil && prev.costLimit == rs.costLimit {
		if c := prev.conds[text]; c != nil {
			rs.conds[text] = c
			return c, nil
		}
	}
	c, err := compileCondition(text, rs.costLimit)
	if err != nil {
		return nil, err
	}
	rs.conds[text] = c
	return c, nil
}

func opList() string {
	var b strings.Builder
	for i, o := range knownOperations {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(string(o))
	}
	return b.String()
}

// Mode is the mode this rule set decides in.
func (rs *RuleSet) Mode() Mode {
	if rs == nil {
		return ModeEnforce
	}
	return rs.mode
}

// CostLimit is the CEL cost budget per condition evaluation.
func (rs *RuleSet) CostLimit() uint64 {
	if rs == nil {
		return DefaultCostLimit
	}
	return rs.costLimit
}

// Len is the number of valid grants applied.
func (rs *RuleSet) Len() int {
	if rs == nil {
		return 0
	}
	return rs.valid
}

// Errors are the invalid grants, as Compile returned them.
func (rs *RuleSet) Errors() []RuleError {
	if rs == nil {
		return nil
	}
	return slices.Clone(rs.errs)
}

// WithMode returns a rule set with the same compiled grants deciding in
// mode m (an unknown mode is enforce). The receiver is not changed.
func (rs *RuleSet) WithMode(m Mode) *RuleSet {
	if rs == nil {
		rs = emptyRuleSet
	}
	cp := *rs
	if _, err := ParseMode(string(m)); err != nil || m == "" {
		m = ModeEnforce
	}
	cp.mode = m
	return &cp
}
