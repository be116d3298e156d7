// Package policy decides whether driver D may receive secret S for CSI
// operation O on behalf of requester R. Decisions are pure functions over plain
// data; loaders turn files, Kubernetes objects (as plain data) or an external
// decision point into rule sets. No Kubernetes client and no gRPC here.
//
// # What it owns
//
//   - Request and Decision, plain data. A Decision names the rule that
//     decided and a human reason (secret reference, driver, operation,
//     requester), and carries driver, operation and Result() for metrics. It
//     never holds secret content: this package only ever sees references.
//   - Grant / GrantSpec: the SecretGrant custom resource
//     (policy.csibroker.io/v1alpha1, deploy/crds/) as plain data, with JSON
//     tags equal to the CRD's field names, so a controller can convert an
//     unstructured object's spec with runtime.DefaultUnstructuredConverter.
//   - Compile: grants to an immutable, indexed RuleSet, reporting invalid
//     grants one RuleError each; RuleSet.Decide; Store, an atomic holder so a
//     reload never blocks a decision.
//   - ParseGrants / LoadFile: grant files (YAML or JSON) for the standalone
//     broker.
//   - External: an optional OPA-compatible decision point over HTTP, failing
//     closed; Authorizer combines it with the local grants.
//   - Audit: one structured log line per decision.
//
// It must not: import client-go, k8s.io/api or gRPC; fetch secrets; count
// metrics (callers count from Decision).
//
// # Semantics
//
// Deny by default once enforced: an empty rule set admits nobody. Modes are
// enforce, audit (evaluate; a would-be deny is allowed and flagged
// WouldDeny) and off (allow everything, Rule "mode-off").
//
// A grant lives in the secret's namespace (the ReferenceGrant pattern): only
// a grant in namespace N can admit a secret in N, whatever it says. A grant
// matches a request when all of these hold:
//
//   - spec.drivers lists the driver, or "*";
//   - spec.secretNames lists the secret's name exactly, or a "prefix*"
//     pattern it starts with, or "*" (every secret of the namespace);
//   - spec.operations lists the operation, or "*";
//   - the requester's namespace is in spec.requesters.namespaces, or is
//     selected by spec.requesters.namespaceSelector over the namespace's
//     labels ("*" in namespaces admits every requester, including ones with
//     no namespace; when the namespace's labels are not known (nil), an
//     Allow grant's selector does not select it and a Deny grant's does:
//     both fail closed);
//   - spec.requesters.storageClasses, if set, lists the StorageClass;
//   - spec.requesters.nodes, if set, lists the node;
//   - spec.condition, if set, evaluates to true (a condition that fails to
//     evaluate, reads request.requester.namespaceLabels while they are
//     not known, or reads request.requester.node for a node operation
//     whose node is not known yet, fails closed like a selector: a Deny
//     grant matches, an Allow grant does not).
//
// drivers, secretNames, operations and one of namespaces/namespaceSelector
// are required and must be non-empty: an empty list admits nobody, and
// Compile rejects such a grant rather than keep a rule that cannot match.
// storageClasses and nodes are optional narrowing; omitted means any, and an
// explicitly empty list is rejected as ambiguous.
//
// Precedence: a matching Deny grant (spec.action: Deny) beats any number of
// matching Allow grants; matching Allow grants are a union (any one allows;
// the first by name is reported). A condition that fails to evaluate (no
// such key, over the cost limit) makes a Deny grant match (fail closed) and
// an Allow grant not match; if nothing else allows, the denial names that
// grant and the evaluation error.
//
// Invalid grants are not applied, never partly; the valid ones are. The one
// exception fails closed: an invalid Deny grant denies every secret of its
// namespace until fixed, because dropping a deny would widen access.
//
// # Conditions
//
// spec.condition is a CEL expression that must be a bool. It sees one
// variable, request, with these fields (the JSON names of Request):
//
//	request.driver                       string
//	request.operation                    string, e.g. "NodeStageVolume"
//	request.secret.namespace             string
//	request.secret.name                  string
//	request.source.kind                  "StorageClassParameter", "PVField", "Template", "Static"
//	request.source.key                   string, the parameter key or PV field
//	request.source.template              string, the unresolved template
//	request.requester.kind               string, e.g. "PersistentVolumeClaim"
//	request.requester.namespace          string
//	request.requester.name               string
//	request.requester.namespaceLabels    map(string, string)
//	request.requester.labels             map(string, string)
//	request.requester.storageClass       string
//	request.requester.node               string
//
// Conditions are type-checked and planned once per change (Compile; Store
// reuses unchanged ones) and run under a cost limit (DefaultCostLimit), so a
// rule cannot burn CPU: running over it is an evaluation error. The
// conditions evaluated for one decision (Deny grants first, then Allow
// grants in name order) also share a budget of four conditions at that
// limit; past it, the ones not yet evaluated count as failing to evaluate
// (fail closed). Conditions that cost tens of units, as most do, never
// come near it.
//
// # External decision point
//
// External POSTs {"input": <Request as JSON>} to <url>/v1/data/<path> (OPA's
// data API) and expects {"result": bool} or {"result": {"allow": bool,
// "reason": string}}. Per-attempt and per-decision timeouts, bounded retries
// and a short TTL cache keyed by the whole input; a slow, unreachable or
// confused endpoint means deny (fail closed) with a reason saying which.
// Authorizer asks it only after the local grants allowed: both must allow
// (or, with ExternalOnly, it decides alone).
package policy
