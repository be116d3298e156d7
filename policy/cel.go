package policy

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"

	"cel.dev/cel-go/cel"
	"cel.dev/cel-go/checker"
	celast "cel.dev/cel-go/common/ast"
	"cel.dev/cel-go/common/operators"
	"cel.dev/cel-go/common/types"
	"cel.dev/cel-go/ext"
	"cel.dev/cel-go/interpreter"
)

// CEL limits.
const (
	// DefaultCostLimit is the runtime cost budget of one condition
	// evaluation, in CEL cost units (about one per operation: a field access,
	// a comparison, one comprehension step). A typical condition costs under
	// 20. A condition that runs over it is treated as an evaluation error;
	// one that reaches it (nested comprehensions over a claim's labels)
	// took about 3 ms of CPU here.
	DefaultCostLimit uint64 = 10_000
	// decisionBudgetConditions: the conditions evaluated for one decision
	// share a budget of this many per-condition limits; past it, the
	// conditions not yet evaluated count as failing to evaluate (a Deny
	// grant matches, an Allow grant does not), so the grants of one
	// namespace cannot make one decision cost more than a few conditions
	// at their limit.
	decisionBudgetConditions = 4
	// MaxConditionLength is the longest condition accepted, in code points.
	MaxConditionLength = 4096
	// maxConditionDepth bounds the parser's recursion.
	maxConditionDepth = 64
)

var (
	celEnvOnce sync.Once
	celEnv     *cel.Env
	celEnvErr  error
)

// conditionEnv is the one CEL environment for grant conditions: the standard
// library and a single variable `request` of type policy.Request, whose
// fields are named by the JSON tags (request.driver, request.secret.name,
// request.requester.namespaceLabels...). Conditions are type-checked against
// it, so a misspelt field is a compile error, not a runtime deny.
func conditionEnv() (*cel.Env, error) {
	celEnvOnce.Do(func() {
		celEnv, celEnvErr = cel.NewEnv(
			ext.NativeTypes(reflect.TypeFor[Request](), ext.ParseStructTag("json")),
			cel.Variable("request", cel.ObjectType("policy.Request")),
			cel.ParserExpressionSizeLimit(MaxConditionLength),
			cel.ParserRecursionLimit(maxConditionDepth),
		)
	})
	return celEnv, celEnvErr
}

// condition is a compiled grant condition. cel.Program is safe for
// concurrent use.
type condition struct {
	text      string
	costLimit uint64
	prg       cel.Program
	// readsNSLabels: the condition may read request.requester.namespaceLabels
	// (mayReadRequesterField),
	// so it cannot be decided while they are not known (nil).
	readsNSLabels bool
	// readsNode: the condition may read request.requester.node, so it
	// cannot decide a node operation whose node is not known yet (the
	// node secrets of a volume are decided when it is provisioned).
	readsNode bool
}

// errNSLabelsUnknown is the evaluation error of a condition that reads the
// requester's namespace labels while they are not known: like an erroring
// condition, it fails closed (a Deny grant matches, an Allow grant does
// not), as a namespaceSelector does. CEL would see an empty map instead.
var errNSLabelsUnknown = errors.New("the condition reads request.requester.namespaceLabels, and the requester's namespace labels are not known")

// errNodeUnknown is errNSLabelsUnknown for the node of a node operation
// decided before the node is known, as a grant's nodes field decides it
// (rule.nodeUnknownDenies). CEL would see "" instead.
var errNodeUnknown = errors.New("the condition reads request.requester.node, and the node of this node operation is not known when it is decided (at provisioning)")

// compileCondition parses, type-checks and plans text. It fails when the
// expression is not a bool, or when even its cheapest evaluation would run
// over costLimit (such a condition could never be true).
func compileCondition(text string, costLimit uint64) (*condition, error) {
	env, err := conditionEnv()
	if err != nil {
		return nil, fmt.Errorf("CEL environment: %w", err)
	}
	if n := len([]rune(text)); n > MaxConditionLength {
		return nil, fmt.Errorf("%d characters, more than the limit of %d", n, MaxConditionLength)
	}
	ast, iss := env.Compile(text)
	if iss.Err() != nil {
		return nil, errors.New(oneLine(iss.Err().Error()))
	}
	if !ast.OutputType().IsExactType(cel.BoolType) {
		return nil, fmt.Errorf("must evaluate to bool, not %s", ast.OutputType())
	}
	if est, err := env.EstimateCost(ast, noSizeHints{}); err == nil && est.Min > costLimit {
		return nil, fmt.Errorf("costs at least %d to evaluate, more than the limit of %d", est.Min, costLimit)
	}
	prg, err := env.Program(ast,
		cel.CostLimit(costLimit), // tracks the cost too (eval's budget reads it)
		cel.OptimizeRegex(interpreter.MatchesRegexOptimization),
	)
	if err != nil {
		return nil, errors.New(oneLine(err.Error()))
	}
	root := celast.NavigateAST(ast.NativeRep())
	readsLabels := celast.MatchDescendants(root, mayReadRequesterField("namespaceLabels"))
	readsNode := celast.MatchDescendants(root, mayReadRequesterField("node"))
	return &condition{text: text, costLimit: costLimit, prg: prg, readsNSLabels: len(readsLabels) > 0, readsNode: len(readsNode) > 0}, nil
}

// mayReadRequesterField matches the expressions through which a condition
// may read the requester's field (named as in CEL, its JSON name; e.g.
// request.requester.namespaceLabels): the field of a requester or a dyn
// value (a select or has()), the name as the key of an index into one (like
// dyn(request.requester)['namespaceLabels']), an index by a computed key
// into a dyn value, and the request or requester used whole. A false match
// only makes a condition fail closed while the field is unknown; a miss
// would let it see the field empty.
func mayReadRequesterField(field string) func(celast.NavigableExpr) bool {
	return func(e celast.NavigableExpr) bool { return mayRead(e, field) }
}

func mayRead(e celast.NavigableExpr, field string) bool {
	// The request or its requester used whole (compared, put in a list,
	// passed to a function) carries the field with it.
	if t := e.Type(); t.Kind() == types.StructKind && (t.TypeName() == "policy.Request" || t.TypeName() == "policy.Requester") {
		if p, ok := e.Parent(); !ok || p.Kind() != celast.SelectKind {
			return true
		}
	}
	switch e.Kind() {
	case celast.SelectKind:
		// The field of a requester, or of a value that may be one; a
		// field of that name elsewhere (a label "node") is not it.
		return e.AsSelect().FieldName() == field && mayBeRequester(e.Children())
	case celast.LiteralKind:
		// The name as the key of an index into a value that may be the
		// requester; the same string elsewhere is data.
		s, ok := e.AsLiteral().(types.String)
		if !ok || string(s) != field {
			return false
		}
		p, ok := e.Parent()
		if !ok || p.Kind() != celast.CallKind || (p.AsCall().FunctionName() != operators.Index && p.AsCall().FunctionName() != operators.OptIndex) {
			return false
		}
		args := p.Children()
		return len(args) == 2 && args[1].ID() == e.ID() && mayBeRequester(args[:1])
	case celast.CallKind:
		call := e.AsCall()
		if call.FunctionName() != operators.Index && call.FunctionName() != operators.OptIndex {
			return false
		}
		args := e.Children()
		if len(args) != 2 || args[1].Kind() == celast.LiteralKind {
			return false
		}
		k := args[0].Type().Kind()
		return k == types.DynKind || k == types.AnyKind
	}
	return false
}

// mayBeRequester reports whether the first of operands is typed as the
// requester, or is a value the checker could not type (dyn), which may be.
func mayBeRequester(operands []celast.NavigableExpr) bool {
	if len(operands) == 0 {
		return false
	}
	t := operands[0].Type()
	switch t.Kind() {
	case types.DynKind, types.AnyKind:
		return true
	case types.StructKind:
		return t.TypeName() == "policy.Requester"
	}
	return false
}

// eval runs the condition. An error (no such key, cost limit exceeded, a
// non-bool result) is returned as such; the caller decides what it means.
func (c *condition) eval(act *requestActivation) (bool, error) {
	if c.readsNSLabels && act.req.Requester.NamespaceLabels == nil {
		return false, errNSLabelsUnknown
	}
	if c.readsNode && act.req.Requester.Node == "" && act.req.Operation.onNode() {
		return false, errNodeUnknown
	}
	if act.spent >= act.budget {
		return false, fmt.Errorf("not evaluated: this decision's conditions already cost %d, its budget (%d conditions at the cost limit)", act.spent, decisionBudgetConditions)
	}
	out, det, err := c.prg.Eval(act)
	if det != nil {
		if cost := det.ActualCost(); cost != nil {
			act.spent += *cost
		}
	}
	if err != nil {
		return false, errors.New(truncate(oneLine(err.Error()), 200))
	}
	b, ok := out.(types.Bool)
	if !ok {
		return false, fmt.Errorf("evaluated to %s, not bool", out.Type())
	}
	return bool(b), nil
}

// requestActivation binds `request` without building a map per evaluation,
// and keeps the cost of the decision's conditions so far.
type requestActivation struct {
	req           *Request
	spent, budget uint64
}

func (a *requestActivation) ResolveName(name string) (any, bool) {
	if name == "request" {
		return a.req, true
	}
	return nil, false
}

func (a *requestActivation) Parent() interpreter.Activation { return nil }

// noSizeHints gives the cost estimator nothing: sizes of request fields are
// unknown, so only the minimum cost of an estimate is meaningful.
type noSizeHints struct{}

func (noSizeHints) EstimateSize(checker.AstNode) *checker.SizeEstimate { return nil }
func (noSizeHints) EstimateCallCost(string, string, *checker.AstNode, []checker.AstNode) *checker.CallEstimate {
	return nil
}

// oneLine folds CEL's multi-line error rendering into one line for a status
// message: it keeps the messages and drops the source excerpt and caret
// lines (" | request.drvier", " | .......^").
func oneLine(s string) string {
	var parts []string
	for _, line := range strings.Split(s, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "|") {
			continue
		}
		line = strings.TrimPrefix(strings.TrimSpace(line), "ERROR: ")
		line = strings.TrimPrefix(line, "<input>:")
		if line = strings.Join(strings.Fields(line), " "); line != "" {
			parts = append(parts, line)
		}
	}
	return strings.Join(parts, "; ")
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	return string(r[:n]) + "..."
}
