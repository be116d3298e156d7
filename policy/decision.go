package policy

import (
	"fmt"
	"strconv"
	"strings"
)

// Mode says how decisions are applied.
type Mode string

// Modes, in the order an administrator rolls policy out: off, audit, enforce.
const (
	// ModeEnforce: a deny is a deny. The default, and deny by default: an
	// empty rule set admits nobody.
	ModeEnforce Mode = "enforce"
	// ModeAudit: rules are evaluated, and a request they would deny is
	// allowed with Decision.WouldDeny set, so it can be logged and counted.
	ModeAudit Mode = "audit"
	// ModeOff: nothing is evaluated, everything is allowed, and the decision
	// says so.
	ModeOff Mode = "off"
)

// ParseMode parses a --policy-mode style value. The empty string is enforce.
func ParseMode(s string) (Mode, error) {
	switch Mode(s) {
	case "", ModeEnforce:
		return ModeEnforce, nil
	case ModeAudit, ModeOff:
		return Mode(s), nil
	}
	return "", fmt.Errorf("policy mode %q: want %q, %q or %q", s, ModeEnforce, ModeAudit, ModeOff)
}

// Rule names used in Decision.Rule when no grant decided.
const (
	// RuleDefaultDeny: no grant allowed the request.
	RuleDefaultDeny = "default-deny"
	// RuleModeOff: policy is off; nothing was evaluated.
	RuleModeOff = "mode-off"
	// RuleInvalidRequest: the request itself was malformed (unknown
	// operation, empty driver or secret name...).
	RuleInvalidRequest = "invalid-request"
	// RuleExternal: the external decision point decided.
	RuleExternal = "external"
)

// Result values, for a metric's decision label (see Decision.Result).
const (
	ResultAllow     = "allow"
	ResultDeny      = "deny"
	ResultWouldDeny = "would-deny"
)

// Decision is the answer to a Request. It carries the request's driver,
// operation and secret reference so a caller can count and report it
// without keeping the request around. It never holds secret content.
type Decision struct {
	// Allowed: the caller may fetch the secret and make the CSI call.
	Allowed bool
	// Mode the decision was made in.
	Mode Mode
	// WouldDeny: audit mode allowed a request that enforce mode would deny.
	WouldDeny bool
	// Rule is "namespace/name" of the grant that decided, or one of
	// RuleDefaultDeny, RuleModeOff, RuleInvalidRequest, RuleExternal.
	Rule string
	// Reason is for humans (logs, Events): it names the secret reference,
	// the driver, the operation, the requester and the rule.
	Reason string

	Driver    string
	Operation Operation
	Secret    SecretRef
}

// Result is "allow", "deny" or "would-deny" (audit mode): the value of a
// metric's decision label. Mode says whether an allow was evaluated at all.
func (d Decision) Result() string {
	switch {
	case !d.Allowed:
		return ResultDeny
	case d.WouldDeny:
		return ResultWouldDeny
	default:
		return ResultAllow
	}
}

// verdict is a decision before the mode is applied.
type verdict struct {
	allowed bool
	rule    string
	reason  string
}

// decisionFor applies mode to v.
func decisionFor(mode Mode, req *Request, v verdict) Decision {
	d := Decision{
		Allowed:   v.allowed,
		Mode:      mode,
		Rule:      v.rule,
		Reason:    v.reason,
		Driver:    req.Driver,
		Operation: req.Operation,
		Secret:    req.Secret,
	}
	if mode == ModeAudit && !v.allowed {
		d.Allowed = true
		d.WouldDeny = true
		d.Reason = "audit mode, allowed but would deny: " + v.reason
	}
	return d
}

// offDecision is the decision of ModeOff.
func offDecision(req *Request) Decision {
	return Decision{
		Allowed:   true,
		Mode:      ModeOff,
		Rule:      RuleModeOff,
		Reason:    "policy mode is off: not evaluated, " + describeQuoted(req) + " allowed",
		Driver:    req.Driver,
		Operation: req.Operation,
		Secret:    req.Secret,
	}
}

// describe renders a validated request for reasons: driver, secret,
// operation, requester.
func describe(req *Request) string { return reasonf(req, reqDesc) }

// reqDesc, as a reasonf part, stands for the request's description.
const reqDesc = "\x00request\x00"

// reasonf concatenates parts, replacing reqDesc by the description of a
// validated request, with a single allocation: reasons are built on every
// decision.
func reasonf(req *Request, parts ...string) string {
	rq := &req.Requester
	n := 0
	for _, p := range parts {
		if p == reqDesc {
			n += 64 + len(req.Driver) + len(req.Secret.Namespace) + len(req.Secret.Name) + len(req.Operation) +
				len(rq.Kind) + len(rq.Namespace) + len(rq.Name)
		} else {
			n += len(p)
		}
	}
	var b strings.Builder
	b.Grow(n)
	for _, p := range parts {
		if p != reqDesc {
			b.WriteString(p)
			continue
		}
		b.WriteString("driver ")
		b.WriteString(req.Driver)
		b.WriteString(" receiving secret ")
		b.WriteString(req.Secret.Namespace)
		b.WriteByte('/')
		b.WriteString(req.Secret.Name)
		b.WriteString(" for ")
		b.WriteString(string(req.Operation))
		b.WriteString(" on behalf of ")
		rq.writeTo(&b)
	}
	return b.String()
}

// describeQuoted renders a request that was not validated, quoting (and
// bounding) every field so nothing odd reaches a log line or an Event.
func describeQuoted(req *Request) string {
	return "driver " + quote(req.Driver) + " receiving secret " + quote(req.Secret.Namespace) + "/" + quote(req.Secret.Name) +
		" for " + quote(string(req.Operation)) + " on behalf of " + quote(req.Requester.String())
}

// quote quotes s, cut to 100 characters, for messages about bad input.
func quote(s string) string { return strconv.Quote(truncate(s, 100)) }
