package policy

import "context"

// Authorizer combines the local grants with an optional external decision
// point:
//
//   - The mode is the local rule set's (Rules). Mode off allows without
//     asking anyone.
//   - By default the local grants decide first. A local deny is final: the
//     external point is not asked and cannot override it. A local allow is
//     then checked by the external point, when configured: both must allow.
//   - With ExternalOnly, the local grants are ignored and the external point
//     alone decides (still failing closed, still in the Store's mode).
//
// In audit mode any would-be deny (local or external) is allowed with
// WouldDeny set.
type Authorizer struct {
	// Rules holds the local grants and the mode. nil: no grants, enforce.
	Rules *Store
	// External is optional.
	External *External
	// ExternalOnly makes External the only decider. Without External it
	// denies everything.
	ExternalOnly bool
}

// Decide answers req. It blocks only while asking the external point,
// bounded by its timeout and ctx.
func (a *Authorizer) Decide(ctx context.Context, req Request) Decision {
	var rs *RuleSet
	if a.Rules != nil {
		rs = a.Rules.Load()
	} else {
		rs = emptyRuleSet
	}
	mode := rs.Mode()
	if mode == ModeOff {
		return offDecision(&req)
	}
	if err := req.validate(); err != nil {
		return decisionFor(mode, &req, verdict{rule: RuleInvalidRequest, reason: "invalid request, denied: " + err.Error()})
	}

	if a.ExternalOnly {
		if a.External == nil {
			return decisionFor(mode, &req, verdict{rule: RuleExternal,
				reason: "no external decision point is configured, denied (fail closed) " + describe(&req)})
		}
		return decisionFor(mode, &req, a.External.verdict(ctx, &req))
	}

	v := rs.evaluate(&req)
	if v.allowed && a.External != nil {
		ev := a.External.verdict(ctx, &req)
		if !ev.allowed {
			ev.reason = "grant " + v.rule + " allows, but " + ev.reason
			v = ev
		} else {
			v.reason += "; the external decision point allows too"
		}
	}
	return decisionFor(mode, &req, v)
}
