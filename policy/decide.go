package policy

import "strings"

// Decide answers req in the rule set's mode. It never blocks and is safe for
// concurrent use. A nil rule set admits nobody.
//
// Order of evaluation (the first that applies decides; see the package
// documentation):
//
//  1. mode off: allowed, nothing evaluated;
//  2. a malformed request: denied (RuleInvalidRequest);
//  3. an invalid Deny grant in the secret's namespace: denied (fail closed);
//  4. a matching Deny grant: denied, whatever the Allow grants say; a Deny
//     grant whose condition fails to evaluate counts as matching;
//  5. a matching Allow grant: allowed (the first by name decides the Rule);
//  6. an Allow grant whose condition failed to evaluate: denied, naming it;
//  7. otherwise denied (RuleDefaultDeny).
//
// Only grants in the secret's own namespace are consulted. In audit mode a
// deny becomes an allow with WouldDeny set.
func (rs *RuleSet) Decide(req Request) Decision {
	if rs == nil {
		rs = emptyRuleSet
	}
	if rs.mode == ModeOff {
		return offDecision(&req)
	}
	return decisionFor(rs.mode, &req, rs.evaluate(&req))
}

// evaluate decides req as enforce mode would.
func (rs *RuleSet) evaluate(req *Request) verdict {
	if err := req.validate(); err != nil {
		return verdict{rule: RuleInvalidRequest, reason: "invalid request, denied: " + err.Error()}
	}
	if l := rs.lockAll; l != nil {
		return verdict{rule: l.Key(), reason: reasonf(req, "grant ", l.Key(), " is an invalid Deny grant without a namespace, so every secret is denied until it is fixed (",
			truncate(l.Message, 200), "); denied ", reqDesc)}
	}
	ns := rs.byNS[req.Secret.Namespace]
	if ns == nil {
		return defaultDeny(req)
	}
	if l := ns.lock; l != nil {
		return verdict{rule: l.Key(), reason: reasonf(req, "grant ", l.Key(), " is an invalid Deny grant, so every secret in namespace ",
			l.Namespace, " is denied until it is fixed (", truncate(l.Message, 200), "); denied ", reqDesc)}
	}

	// Candidate lists: grants naming this driver or "*", and this secret
	// name exactly or by pattern. Each list is in grant order.
	var cands [4]*ruleLists
	n := 0
	for _, d := range [2]string{req.Driver, Wildcard} {
		b := ns.byDriver[d]
		if b == nil {
			continue
		}
		if l := b.exact[req.Secret.Name]; l != nil {
			cands[n] = l
			n++
		}
		if len(b.wild.allow) > 0 || len(b.wild.deny) > 0 {
			cands[n] = &b.wild
			n++
		}
	}
	if n == 0 {
		return defaultDeny(req)
	}
	opBit := req.Operation.bit()
	var act *requestActivation // built on the first condition evaluated

	// Deny grants first: one match decides.
	var deny *rule
	var denyErr error
	for _, l := range cands[:n] {
		for _, r := range l.deny {
			if deny != nil && r.idx >= deny.idx {
				break
			}
			if !r.matches(req, opBit) {
				continue
			}
			var err error // an erroring Deny condition fails closed
			if r.cond != nil {
				if act == nil {
					act = newActivation(req, rs.costLimit)
				}
				var ok bool
				if ok, err = r.cond.eval(act); err == nil && !ok {
					continue
				}
			}
			deny, denyErr = r, err
			break
		}
	}
	if deny != nil {
		unknown := ""
		if _, listed := deny.namespaces[req.Requester.Namespace]; !deny.anyRequester && !listed && req.Requester.NamespaceLabels == nil {
			unknown = "; the requester's namespace labels are not known, which counts as a match of its namespaceSelector (fail closed)"
		}
		if deny.nodes != nil && deny.nodeUnknownDenies(req) {
			unknown += "; the node is not known when this secret is handed out (any node may use the volume), which counts as a match of its nodes (fail closed)"
		}
		if denyErr != nil {
			return verdict{rule: deny.key, reason: reasonf(req, "deny grant ", deny.key, " denies ", reqDesc, unknown,
				"; its condition failed to evaluate, which counts as a match (fail closed): ", denyErr.Error())}
		}
		return verdict{rule: deny.key, reason: reasonf(req, "deny grant ", deny.key, " denies ", reqDesc, unknown)}
	}

	// Allow grants: the first match (by grant name) decides.
	var allow, errRule *rule
	var condErr error
	for _, l := range cands[:n] {
		for _, r := range l.allow {
			if allow != nil && r.idx >= allow.idx {
				break
			}
			if !r.matches(req, opBit) {
				continue
			}
			if r.cond != nil {
				if act == nil {
					act = newActivation(req, rs.costLimit)
				}
				ok, err := r.cond.eval(act)
				if err != nil {
					if errRule == nil || r.idx < errRule.idx {
						errRule, condErr = r, err
					}
					continue
				}
				if !ok {
					continue
				}
			}
			allow = r
			break
		}
	}
	switch {
	case allow != nil:
		return verdict{allowed: true, rule: allow.key, reason: reasonf(req, "grant ", allow.key, " allows ", reqDesc)}
	case errRule != nil:
		return verdict{rule: errRule.key, reason: reasonf(req, "no grant allows ", reqDesc,
			"; the condition of grant ", errRule.key, " failed to evaluate: ", condErr.Error())}
	}
	return defaultDeny(req)
}

func defaultDeny(req *Request) verdict {
	return verdict{rule: RuleDefaultDeny, reason: reasonf(req, "no grant in namespace ", req.Secret.Namespace, " allows ", reqDesc)}
}

// newActivation copies req so that only requests reaching a CEL condition
// pay for a heap copy.
func newActivation(req *Request, costLimit uint64) *requestActivation {
	cp := *req
	return &requestActivation{req: &cp, budget: decisionBudgetConditions * costLimit}
}

// matches checks every field but the condition. The index already chose
// grants by namespace, driver and secret name; they are checked again here so
// that no indexing mistake can ever admit a secret a grant does not name.
func (r *rule) matches(req *Request, opBit uint32) bool {
	if r.ops&opBit == 0 || r.namespace != req.Secret.Namespace {
		return false
	}
	if !r.anyDriver && !contains(r.drivers, req.Driver) {
		return false
	}
	if !r.anySecret {
		if _, ok := r.secretNames[req.Secret.Name]; !ok && !r.matchesPrefix(req.Secret.Name) {
			return false
		}
	}
	rq := &req.Requester
	if !r.anyRequester {
		if rq.Namespace == "" {
			return false
		}
		_, listed := r.namespaces[rq.Namespace]
		if !listed && !r.selects(rq.NamespaceLabels) {
			return false
		}
	}
	if r.storageClass != nil && !contains(r.storageClass, rq.StorageClass) {
		return false
	}
	if r.nodes != nil && !contains(r.nodes, rq.Node) && !r.nodeUnknownDenies(req) {
		return false
	}
	return true
}

// nodeUnknownDenies: a node operation's secret decided before its node is
// known (a node stage secret is written into the PV at provisioning, for
// whichever node's kubelet uses the volume) fails closed against a grant
// that names nodes, as unknown namespace labels do against a selector: a
// Deny grant matches it, an Allow grant does not.
func (r *rule) nodeUnknownDenies(req *Request) bool {
	return r.action == ActionDeny && req.Requester.Node == "" && req.Operation.onNode()
}

// selects reports whether the grant's namespaceSelector picks a namespace
// with these labels. Labels not known (nil) fail closed both ways: an Allow
// grant's selector does not pick the namespace, a Deny grant's does.
func (r *rule) selects(labels map[string]string) bool {
	if r.nsSelector == nil {
		return false
	}
	if labels == nil {
		return r.action == ActionDeny
	}
	return r.nsSelector.matches(labels)
}

func (r *rule) matchesPrefix(name string) bool {
	for _, p := range r.prefixes {
		if strings.HasPrefix(name, p) {
			return true
		}
	}
	return false
}
