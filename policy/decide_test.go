package policy

import (
	"fmt"
	"strings"
	"testing"
)

const (
	testDriver = "nfs.csi.example.com"
	testNS     = "store"
)

// spec is the grant every case starts from: it admits exactly baseReq().
func spec(mut ...func(*GrantSpec)) GrantSpec {
	s := GrantSpec{
		Drivers:     []string{testDriver},
		SecretNames: []string{"creds"},
		Operations:  []Operation{OpNodeStageVolume},
		Requesters:  Requesters{Namespaces: []string{"team-a"}},
	}
	for _, m := range mut {
		m(&s)
	}
	return s
}

func grant(ns, name string, mut ...func(*GrantSpec)) Grant {
	return Grant{Namespace: ns, Name: name, Spec: spec(mut...)}
}

func baseReq(mut ...func(*Request)) Request {
	r := Request{
		Driver:    testDriver,
		Operation: OpNodeStageVolume,
		Secret:    SecretRef{Namespace: testNS, Name: "creds"},
		Source:    Source{Kind: SourceStorageClassParameter, Key: "csi.storage.k8s.io/node-stage-secret-name"},
		Requester: Requester{
			Kind:            KindPersistentVolumeClaim,
			Namespace:       "team-a",
			Name:            "data",
			NamespaceLabels: map[string]string{"kubernetes.io/metadata.name": "team-a", "team": "a", "tier": "gold"},
			Labels:          map[string]string{"app": "db"},
			StorageClass:    "fast",
			Node:            "node-1",
		},
	}
	for _, m := range mut {
		m(&r)
	}
	return r
}

func mustCompile(t testing.TB, grants []Grant, opts ...CompileOption) *RuleSet {
	t.Helper()
	rs, errs := Compile(grants, opts...)
	for _, e := range errs {
		t.Fatalf("unexpected rule error: %v", e)
	}
	return rs
}

func sel(s *LabelSelector) func(*GrantSpec) {
	return func(g *GrantSpec) { g.Requesters = Requesters{NamespaceSelector: s} }
}

func expr(key string, op LabelSelectorOperator, values ...string) *LabelSelector {
	return &LabelSelector{MatchExpressions: []LabelSelectorRequirement{{Key: key, Operator: op, Values: values}}}
}

// allowAll is an Allow grant of every secret of testNS to every driver,
// operation and requester.
func allowAll() Grant {
	return grant(testNS, "allow-all", func(s *GrantSpec) {
		s.Drivers, s.SecretNames, s.Operations = []string{"*"}, []string{"*"}, []Operation{"*"}
		s.Requesters = Requesters{Namespaces: []string{"*"}}
	})
}

func cond(c string) func(*GrantSpec) { return func(g *GrantSpec) { g.Condition = c } }

func TestDecide(t *testing.T) {
	base := []Grant{grant(testNS, "g")}
	// A Deny grant whose condition reads the requester's namespace labels.
	denyRestricted := grant(testNS, "deny-restricted", func(s *GrantSpec) {
		s.Action = ActionDeny
		s.Requesters = Requesters{Namespaces: []string{"*"}}
		s.Condition = `"tier" in request.requester.namespaceLabels && request.requester.namespaceLabels["tier"] == "restricted"`
	})
	tests := []struct {
		name    string
		grants  []Grant
		req     Request
		allowed bool
		rule    string
		reason  []string // substrings the reason must hold
		not     []string // substrings it must not hold
		invalid int      // grants Compile must refuse (every other grant compiles)
	}{
		{name: "no grants: default deny", req: baseReq(), rule: RuleDefaultDeny,
			reason: []string{"no grant in namespace store allows", testDriver, "store/creds", "NodeStageVolume", "PersistentVolumeClaim team-a/data"}},
		{name: "exact match", grants: base, req: baseReq(), allowed: true, rule: "store/g",
			reason: []string{"grant store/g allows", testDriver, "store/creds", "NodeStageVolume"}},

		// driver
		{name: "other driver", grants: base, req: baseReq(func(r *Request) { r.Driver = "other.csi.example.com" }), rule: RuleDefaultDeny},
		{name: "driver wildcard", grants: []Grant{grant(testNS, "g", func(s *GrantSpec) { s.Drivers = []string{"*"} })},
			req: baseReq(func(r *Request) { r.Driver = "other.csi.example.com" }), allowed: true, rule: "store/g"},
		{name: "second of two drivers", grants: []Grant{grant(testNS, "g", func(s *GrantSpec) { s.Drivers = []string{"a.example.com", testDriver} })},
			req: baseReq(), allowed: true, rule: "store/g"},

		// secret name
		{name: "other secret", grants: base, req: baseReq(func(r *Request) { r.Secret.Name = "creds2" }), rule: RuleDefaultDeny},
		{name: "secret prefix matches", grants: []Grant{grant(testNS, "g", func(s *GrantSpec) { s.SecretNames = []string{"cre*"} })},
			req: baseReq(), allowed: true, rule: "store/g"},
		{name: "secret prefix does not match", grants: []Grant{grant(testNS, "g", func(s *GrantSpec) { s.SecretNames = []string{"team-*"} })},
			req: baseReq(), rule: RuleDefaultDeny},
		{name: "secret wildcard", grants: []Grant{grant(testNS, "g", func(s *GrantSpec) { s.SecretNames = []string{"*"} })},
			req: baseReq(func(r *Request) { r.Secret.Name = "anything" }), allowed: true, rule: "store/g"},
		{name: "exact and prefix in one grant, exact hit", grants: []Grant{grant(testNS, "g", func(s *GrantSpec) { s.SecretNames = []string{"x-*", "creds"} })},
			req: baseReq(), allowed: true, rule: "store/g"},
		{name: "exact and prefix in one grant, prefix hit", grants: []Grant{grant(testNS, "g", func(s *GrantSpec) { s.SecretNames = []string{"x-*", "creds"} })},
			req: baseReq(func(r *Request) { r.Secret.Name = "x-1" }), allowed: true, rule: "store/g"},

		// operation
		{name: "other operation", grants: base, req: baseReq(func(r *Request) { r.Operation = OpNodePublishVolume }), rule: RuleDefaultDeny},
		{name: "operation wildcard", grants: []Grant{grant(testNS, "g", func(s *GrantSpec) { s.Operations = []Operation{"*"} })},
			req: baseReq(func(r *Request) { r.Operation = OpDeleteSnapshot }), allowed: true, rule: "store/g"},
		{name: "unknown operation is invalid, even with wildcard", grants: []Grant{grant(testNS, "g", func(s *GrantSpec) { s.Operations = []Operation{"*"} })},
			req: baseReq(func(r *Request) { r.Operation = "NodeGetInfo" }), rule: RuleInvalidRequest, reason: []string{"invalid request", "NodeGetInfo"}},

		// requester namespace names
		{name: "other requester namespace", grants: base, req: baseReq(func(r *Request) { r.Requester.Namespace = "team-b" }), rule: RuleDefaultDeny},
		{name: "no requester namespace, names listed", grants: base, req: baseReq(func(r *Request) { r.Requester.Namespace = "" }), rule: RuleDefaultDeny},
		{name: "requester wildcard admits cluster-scoped requester",
			grants: []Grant{grant(testNS, "g", func(s *GrantSpec) { s.Requesters.Namespaces = []string{"*"} })},
			req: baseReq(func(r *Request) {
				r.Requester = Requester{Kind: KindVolumeAttachment, Name: "csi-123", Node: "node-1"}
			}), allowed: true, rule: "store/g", reason: []string{"VolumeAttachment csi-123"}},

		// requester namespace selector
		{name: "matchLabels matches", grants: []Grant{grant(testNS, "g", sel(&LabelSelector{MatchLabels: map[string]string{"team": "a"}}))},
			req: baseReq(), allowed: true, rule: "store/g"},
		{name: "matchLabels differs", grants: []Grant{grant(testNS, "g", sel(&LabelSelector{MatchLabels: map[string]string{"team": "b"}}))},
			req: baseReq(), rule: RuleDefaultDeny},
		{name: "In matches", grants: []Grant{grant(testNS, "g", sel(expr("tier", LabelSelectorOpIn, "silver", "gold")))},
			req: baseReq(), allowed: true, rule: "store/g"},
		{name: "In differs", grants: []Grant{grant(testNS, "g", sel(expr("tier", LabelSelectorOpIn, "silver")))},
			req: baseReq(), rule: RuleDefaultDeny},
		{name: "In, label missing", grants: []Grant{grant(testNS, "g", sel(expr("zone", LabelSelectorOpIn, "z1")))},
			req: baseReq(), rule: RuleDefaultDeny},
		{name: "NotIn matches other value", grants: []Grant{grant(testNS, "g", sel(expr("tier", LabelSelectorOpNotIn, "bronze")))},
			req: baseReq(), allowed: true, rule: "store/g"},
		{name: "NotIn matches missing label", grants: []Grant{grant(testNS, "g", sel(expr("zone", LabelSelectorOpNotIn, "z1")))},
			req: baseReq(), allowed: true, rule: "store/g"},
		{name: "NotIn excludes", grants: []Grant{grant(testNS, "g", sel(expr("tier", LabelSelectorOpNotIn, "gold")))},
			req: baseReq(), rule: RuleDefaultDeny},
		{name: "Exists", grants: []Grant{grant(testNS, "g", sel(expr("team", LabelSelectorOpExists)))},
			req: baseReq(), allowed: true, rule: "store/g"},
		{name: "Exists, missing", grants: []Grant{grant(testNS, "g", sel(expr("zone", LabelSelectorOpExists)))},
			req: baseReq(), rule: RuleDefaultDeny},
		{name: "DoesNotExist", grants: []Grant{grant(testNS, "g", sel(expr("zone", LabelSelectorOpDoesNotExist)))},
			req: baseReq(), allowed: true, rule: "store/g"},
		{name: "DoesNotExist, present", grants: []Grant{grant(testNS, "g", sel(expr("team", LabelSelectorOpDoesNotExist)))},
			req: baseReq(), rule: RuleDefaultDeny},
		{name: "selector never matches unknown (nil) labels, even NotIn",
			grants: []Grant{grant(testNS, "g", sel(expr("tier", LabelSelectorOpNotIn, "bronze")))},
			req:    baseReq(func(r *Request) { r.Requester.NamespaceLabels = nil }), rule: RuleDefaultDeny},
		{name: "selector matches known empty labels with DoesNotExist",
			grants: []Grant{grant(testNS, "g", sel(expr("tier", LabelSelectorOpDoesNotExist)))},
			req:    baseReq(func(r *Request) { r.Requester.NamespaceLabels = map[string]string{} }), allowed: true, rule: "store/g"},
		{name: "empty selector selects every namespace", grants: []Grant{grant(testNS, "g", sel(&LabelSelector{}))},
			req: baseReq(func(r *Request) { r.Requester.Namespace = "zzz" }), allowed: true, rule: "store/g"},
		{name: "empty selector does not select a request without namespace", grants: []Grant{grant(testNS, "g", sel(&LabelSelector{}))},
			req: baseReq(func(r *Request) { r.Requester.Namespace = "" }), rule: RuleDefaultDeny},
		{name: "names or selector: selector hit",
			grants: []Grant{grant(testNS, "g", func(s *GrantSpec) {
				s.Requesters = Requesters{Namespaces: []string{"team-z"}, NamespaceSelector: &LabelSelector{MatchLabels: map[string]string{"team": "a"}}}
			})},
			req: baseReq(), allowed: true, rule: "store/g"},

		// storage class
		{name: "storage class listed", grants: []Grant{grant(testNS, "g", func(s *GrantSpec) { s.Requesters.StorageClasses = []string{"slow", "fast"} })},
			req: baseReq(), allowed: true, rule: "store/g"},
		{name: "storage class not listed", grants: []Grant{grant(testNS, "g", func(s *GrantSpec) { s.Requesters.StorageClasses = []string{"slow"} })},
			req: baseReq(), rule: RuleDefaultDeny},
		{name: "storage classes set, request has none", grants: []Grant{grant(testNS, "g", func(s *GrantSpec) { s.Requesters.StorageClasses = []string{"fast"} })},
			req: baseReq(func(r *Request) { r.Requester.StorageClass = "" }), rule: RuleDefaultDeny},
		{name: "storage classes omitted: any, even none", grants: base,
			req: baseReq(func(r *Request) { r.Requester.StorageClass = "" }), allowed: true, rule: "store/g"},

		// node
		{name: "node listed", grants: []Grant{grant(testNS, "g", func(s *GrantSpec) { s.Requesters.Nodes = []string{"node-1"} })},
			req: baseReq(), allowed: true, rule: "store/g"},
		{name: "node not listed", grants: []Grant{grant(testNS, "g", func(s *GrantSpec) { s.Requesters.Nodes = []string{"node-2"} })},
			req: baseReq(), rule: RuleDefaultDeny},
		{name: "nodes set, request has none", grants: []Grant{grant(testNS, "g", func(s *GrantSpec) { s.Requesters.Nodes = []string{"node-1"} })},
			req: baseReq(func(r *Request) { r.Requester.Node = "" }), rule: RuleDefaultDeny},

		// CEL conditions
		{name: "condition true", grants: []Grant{grant(testNS, "g", cond(`request.requester.labels["app"] == "db" && request.requester.node.startsWith("node-")`))},
			req: baseReq(), allowed: true, rule: "store/g"},
		{name: "condition false", grants: []Grant{grant(testNS, "g", cond(`request.requester.node == "node-9"`))},
			req: baseReq(), rule: RuleDefaultDeny},
		{name: "condition over every field", grants: []Grant{grant(testNS, "g", cond(`request.driver == "`+testDriver+`" &&
			request.operation == "NodeStageVolume" && request.secret.namespace == "store" && request.secret.name == "creds" &&
			request.source.kind == "StorageClassParameter" && request.requester.kind == "PersistentVolumeClaim" &&
			request.requester.namespace == "team-a" && request.requester.name == "data" &&
			request.requester.namespaceLabels["team"] == "a" && request.requester.storageClass == "fast"`))},
			req: baseReq(), allowed: true, rule: "store/g"},
		{name: "condition ties secret to requester namespace", grants: []Grant{grant(testNS, "g", func(s *GrantSpec) {
			s.SecretNames = []string{"*"}
			s.Condition = `request.secret.name == request.requester.namespace + "-creds"`
		})},
			req: baseReq(func(r *Request) { r.Secret.Name = "team-b-creds" }), rule: RuleDefaultDeny},
		{name: "condition error denies, naming grant and error", grants: []Grant{grant(testNS, "g", cond(`request.requester.labels["missing"] == "x"`))},
			req: baseReq(), rule: "store/g", reason: []string{"failed to evaluate", "no such key", "store/g"}},
		{name: "condition over cost limit denies",
			grants: []Grant{grant(testNS, "g", cond(`request.requester.labels.all(a, request.requester.labels.all(b, a != b || true))`))},
			req:    baseReq(func(r *Request) { r.Requester.Labels = manyLabels(200) }), rule: "store/g", reason: []string{"failed to evaluate", "cost limit"}},
		{name: "condition error does not hide another allow",
			grants: []Grant{grant(testNS, "a", cond(`request.requester.labels["missing"] == "x"`)), grant(testNS, "b")},
			req:    baseReq(), allowed: true, rule: "store/b"},

		// conflicting grants
		{name: "deny beats allow",
			grants: []Grant{grant(testNS, "a-allow"), grant(testNS, "z-deny", func(s *GrantSpec) { s.Action = ActionDeny })},
			req:    baseReq(), rule: "store/z-deny", reason: []string{"deny grant store/z-deny denies"}},
		{name: "deny beats wildcard allow",
			grants: []Grant{
				allowAll(),
				grant(testNS, "deny-gold", func(s *GrantSpec) {
					s.Action = ActionDeny
					s.Requesters = Requesters{NamespaceSelector: expr("tier", LabelSelectorOpIn, "gold")}
				}),
			},
			req: baseReq(), rule: "store/deny-gold"},
		{name: "deny selector, requester's namespace labels unknown: fails closed",
			grants: []Grant{
				allowAll(),
				grant(testNS, "deny-untrusted", func(s *GrantSpec) {
					s.Action = ActionDeny
					s.Requesters = Requesters{NamespaceSelector: &LabelSelector{MatchLabels: map[string]string{"tier": "untrusted"}}}
				}),
			},
			req: baseReq(func(r *Request) { r.Requester.NamespaceLabels = nil }), rule: "store/deny-untrusted",
			reason: []string{"deny grant store/deny-untrusted denies", "namespace labels are not known", "fail closed"}},
		{name: "deny condition over namespace labels, labels unknown: fails closed",
			grants: []Grant{
				allowAll(),
				denyRestricted,
			},
			req: baseReq(func(r *Request) { r.Requester.NamespaceLabels = nil }), rule: "store/deny-restricted",
			reason: []string{"deny grant store/deny-restricted denies", "namespace labels are not known", "fail closed"}},
		{name: "deny condition over namespace labels, known labels that do not match: the allow decides",
			grants: []Grant{
				allowAll(),
				denyRestricted,
			},
			req: baseReq(), allowed: true, rule: "store/allow-all"},
		{name: "deny naming nodes, node operation with its node not known: fails closed",
			grants: []Grant{allowAll(), grant(testNS, "deny-edge", func(s *GrantSpec) {
				s.Action, s.Requesters = ActionDeny, Requesters{Namespaces: []string{"*"}, Nodes: []string{"edge-1"}}
			})},
			req: baseReq(func(r *Request) { r.Requester.Node = "" }), rule: "store/deny-edge",
			reason: []string{"deny grant store/deny-edge denies", "the node is not known", "fail closed"}},
		{name: "deny naming nodes, node operation on another node: the allow decides",
			grants: []Grant{allowAll(), grant(testNS, "deny-edge", func(s *GrantSpec) {
				s.Action, s.Requesters = ActionDeny, Requesters{Namespaces: []string{"*"}, Nodes: []string{"edge-1"}}
			})},
			req: baseReq(), allowed: true, rule: "store/allow-all"},
		{name: "deny naming nodes, controller operation with no node: the allow decides",
			grants: []Grant{allowAll(), grant(testNS, "deny-edge", func(s *GrantSpec) {
				s.Action, s.Requesters = ActionDeny, Requesters{Namespaces: []string{"*"}, Nodes: []string{"edge-1"}}
			})},
			req: baseReq(func(r *Request) { r.Operation, r.Requester.Node = OpCreateVolume, "" }), allowed: true, rule: "store/allow-all"},
		{name: "allow naming nodes, node operation with its node not known: no match",
			grants: []Grant{grant(testNS, "allow-edge", func(s *GrantSpec) {
				s.Requesters = Requesters{Namespaces: []string{"*"}, Nodes: []string{"node-1"}}
			})},
			req: baseReq(func(r *Request) { r.Requester.Node = "" }), rule: RuleDefaultDeny},
		{name: "deny condition over the node, node operation with its node not known: fails closed",
			grants: []Grant{allowAll(), grant(testNS, "deny-dmz", func(s *GrantSpec) {
				s.Action, s.Requesters, s.Condition = ActionDeny, Requesters{Namespaces: []string{"*"}}, `request.requester.node.startsWith("dmz-")`
			})},
			req: baseReq(func(r *Request) { r.Requester.Node = "" }), rule: "store/deny-dmz",
			reason: []string{"deny grant store/deny-dmz", "node of this node operation is not known"}},
		{name: "allow condition over the node, node operation with its node not known: no match",
			grants: []Grant{grant(testNS, "allow-not-dmz", cond(`!request.requester.node.startsWith("dmz-")`))},
			req:    baseReq(func(r *Request) { r.Requester.Node = "" }), rule: "store/allow-not-dmz",
			reason: []string{"failed to evaluate", "node of this node operation is not known"}},
		{name: "allow condition over the node, node known: decides as usual",
			grants: []Grant{grant(testNS, "allow-not-dmz", cond(`!request.requester.node.startsWith("dmz-")`))},
			req:    baseReq(), allowed: true, rule: "store/allow-not-dmz"},
		{name: "allow condition over the node, controller operation with no node: decides as usual",
			grants: []Grant{grant(testNS, "allow-not-dmz", func(s *GrantSpec) {
				s.Operations, s.Condition = []Operation{OpCreateVolume}, `!request.requester.node.startsWith("dmz-")`
			})},
			req: baseReq(func(r *Request) { r.Operation, r.Requester.Node = OpCreateVolume, "" }), allowed: true, rule: "store/allow-not-dmz"},
		{name: "allow condition over namespace labels, labels unknown: no match",
			grants: []Grant{grant(testNS, "g", cond(`!has(request.requester.namespaceLabels.tier)`))},
			req:    baseReq(func(r *Request) { r.Requester.NamespaceLabels = nil }), rule: "store/g",
			reason: []string{"failed to evaluate", "namespace labels are not known"}},
		{name: "allow condition not over namespace labels, labels unknown: decides as usual",
			grants: []Grant{grant(testNS, "g", cond(`request.requester.labels["app"] == "db"`))},
			req:    baseReq(func(r *Request) { r.Requester.NamespaceLabels = nil }), allowed: true, rule: "store/g"},
		{name: "deny selector, known labels that do not match: the allow decides",
			grants: []Grant{
				allowAll(),
				grant(testNS, "deny-untrusted", func(s *GrantSpec) {
					s.Action = ActionDeny
					s.Requesters = Requesters{NamespaceSelector: &LabelSelector{MatchLabels: map[string]string{"tier": "untrusted"}}}
				}),
			},
			req: baseReq(), allowed: true, rule: "store/allow-all"},
		{name: "allow selector, requester's namespace labels unknown: no match",
			grants: []Grant{grant(testNS, "g", sel(expr("tier", LabelSelectorOpIn, "gold")))},
			req:    baseReq(func(r *Request) { r.Requester.NamespaceLabels = nil }), rule: RuleDefaultDeny},
		{name: "the deny that decides is the one named, with its own condition's error",
			grants: []Grant{
				// Found second (any driver), but first by name: it decides.
				grant(testNS, "a-deny-any-driver", func(s *GrantSpec) { s.Action, s.Drivers = ActionDeny, []string{"*"} }),
				// Found first (this driver), with a condition that errors.
				grant(testNS, "b-deny", func(s *GrantSpec) {
					s.Action = ActionDeny
					s.Condition = `request.requester.labels["missing"] == "x"`
				}),
			},
			req: baseReq(), rule: "store/a-deny-any-driver", not: []string{"failed to evaluate"}},
		{name: "deny not matching leaves allow",
			grants: []Grant{grant(testNS, "allow"), grant(testNS, "deny", func(s *GrantSpec) {
				s.Action = ActionDeny
				s.Operations = []Operation{OpCreateVolume}
			})},
			req: baseReq(), allowed: true, rule: "store/allow"},
		{name: "deny with false condition leaves allow",
			grants: []Grant{grant(testNS, "allow"), grant(testNS, "deny", func(s *GrantSpec) {
				s.Action = ActionDeny
				s.Condition = `request.requester.labels["app"] == "web"`
			})},
			req: baseReq(), allowed: true, rule: "store/allow"},
		{name: "deny with erroring condition fails closed",
			grants: []Grant{grant(testNS, "allow"), grant(testNS, "deny", func(s *GrantSpec) {
				s.Action = ActionDeny
				s.Condition = `request.requester.labels["missing"] == "x"`
			})},
			req: baseReq(), rule: "store/deny", reason: []string{"fail closed", "no such key"}},
		{name: "allows are a union; first by name reported",
			grants: []Grant{
				grant(testNS, "b", func(s *GrantSpec) { s.SecretNames = []string{"*"} }),
				grant(testNS, "a"),
				grant(testNS, "c", func(s *GrantSpec) { s.Operations = []Operation{OpCreateVolume} }),
			},
			req: baseReq(), allowed: true, rule: "store/a"},
		{name: "allows are a union: the other grant admits",
			grants: []Grant{grant(testNS, "a", func(s *GrantSpec) { s.Operations = []Operation{OpCreateVolume} }), grant(testNS, "b")},
			req:    baseReq(), allowed: true, rule: "store/b"},

		// namespaces
		{name: "grant in requester namespace cannot admit a secret elsewhere",
			grants: []Grant{grant("team-a", "g", func(s *GrantSpec) {
				s.SecretNames, s.Drivers, s.Operations = []string{"*"}, []string{"*"}, []Operation{"*"}
				s.Requesters = Requesters{Namespaces: []string{"*"}}
			})},
			req: baseReq(), rule: RuleDefaultDeny, reason: []string{"no grant in namespace store"}},
		{name: "grant in store cannot admit the same name in team-a", grants: base,
			req: baseReq(func(r *Request) { r.Secret.Namespace = "team-a" }), rule: RuleDefaultDeny},

		// invalid grants
		{name: "invalid allow grant is not applied",
			grants: []Grant{grant(testNS, "g", cond(`request.nosuchfield == 1`))},
			req:    baseReq(), rule: RuleDefaultDeny, invalid: 1},
		{name: "invalid deny grant locks its namespace",
			grants: []Grant{grant(testNS, "allow"), grant(testNS, "deny", func(s *GrantSpec) {
				s.Action = ActionDeny
				s.Condition = `request.nosuchfield == 1`
			})},
			req: baseReq(), rule: "store/deny", reason: []string{"invalid Deny grant", "every secret in namespace store"}, invalid: 1},
		{name: "deny grant without a namespace locks every namespace",
			grants: []Grant{grant("other", "allow"), grant("", "deny", func(s *GrantSpec) { s.Action = ActionDeny })},
			req:    baseReq(func(r *Request) { r.Secret.Namespace = "other" }), rule: "/deny",
			reason: []string{"invalid Deny grant without a namespace", "every secret is denied"}, invalid: 1},
		{name: "invalid deny grant does not affect other namespaces",
			grants: []Grant{grant("other", "allow"), grant(testNS, "deny", func(s *GrantSpec) {
				s.Action = ActionDeny
				s.Drivers = nil
			})},
			req: baseReq(func(r *Request) { r.Secret.Namespace = "other" }), allowed: true, rule: "other/allow", invalid: 1},

		// malformed requests
		{name: "empty driver", grants: base, req: baseReq(func(r *Request) { r.Driver = "" }), rule: RuleInvalidRequest},
		{name: "empty secret name", grants: base, req: baseReq(func(r *Request) { r.Secret.Name = "" }), rule: RuleInvalidRequest},
		{name: "control characters in requester", grants: base,
			req: baseReq(func(r *Request) { r.Requester.Name = "x\nlevel=ERROR" }), rule: RuleInvalidRequest, reason: []string{`x\nlevel=ERROR`}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rs, errs := Compile(tc.grants)
			// A grant refused by mistake would leave many cases at their
			// default deny for the wrong reason.
			if len(errs) != tc.invalid {
				t.Fatalf("Compile refused %d grants, want %d: %v", len(errs), tc.invalid, errs)
			}
			d := rs.Decide(tc.req)
			if d.Allowed != tc.allowed || d.Rule != tc.rule {
				t.Fatalf("Decide = allowed %v rule %q, want allowed %v rule %q\nreason: %s", d.Allowed, d.Rule, tc.allowed, tc.rule, d.Reason)
			}
			if d.Mode != ModeEnforce || d.WouldDeny {
				t.Errorf("mode %q wouldDeny %v, want enforce, false", d.Mode, d.WouldDeny)
			}
			if d.Driver != tc.req.Driver || d.Operation != tc.req.Operation || d.Secret != tc.req.Secret {
				t.Errorf("decision does not carry the request's driver/operation/secret: %+v", d)
			}
			for _, s := range tc.reason {
				if !strings.Contains(d.Reason, s) {
					t.Errorf("reason %q lacks %q", d.Reason, s)
				}
			}
			for _, s := range tc.not {
				if strings.Contains(d.Reason, s) {
					t.Errorf("reason %q holds %q", d.Reason, s)
				}
			}
			if strings.ContainsAny(d.Reason, "\n\r") {
				t.Errorf("reason has a line break: %q", d.Reason)
			}
		})
	}
}

func manyLabels(n int) map[string]string {
	m := make(map[string]string, n)
	for i := range n {
		m["label-"+itoa(i)] = "v"
	}
	return m
}

func itoa(i int) string {
	if i == 0 {
		return "0"
	}
	var b []byte
	for ; i > 0; i /= 10 {
		b = append([]byte{byte('0' + i%10)}, b...)
	}
	return string(b)
}

func TestDecideModes(t *testing.T) {
	grants := []Grant{grant(testNS, "g")}
	allowedReq := baseReq()
	deniedReq := baseReq(func(r *Request) { r.Secret.Name = "other" })
	tests := []struct {
		mode      Mode
		req       Request
		allowed   bool
		wouldDeny bool
		rule      string
		result    string
		reason    string
	}{
		{ModeEnforce, allowedReq, true, false, "store/g", ResultAllow, "grant store/g allows"},
		{ModeEnforce, deniedReq, false, false, RuleDefaultDeny, ResultDeny, "no grant in namespace store allows"},
		{ModeAudit, allowedReq, true, false, "store/g", ResultAllow, "grant store/g allows"},
		{ModeAudit, deniedReq, true, true, RuleDefaultDeny, ResultWouldDeny, "audit mode, allowed but would deny: no grant"},
		{ModeOff, allowedReq, true, false, RuleModeOff, ResultAllow, "policy mode is off"},
		{ModeOff, deniedReq, true, false, RuleModeOff, ResultAllow, "policy mode is off"},
		{ModeOff, baseReq(func(r *Request) { r.Operation = "Bogus" }), true, false, RuleModeOff, ResultAllow, `"Bogus"`},
		{ModeAudit, baseReq(func(r *Request) { r.Operation = "Bogus" }), true, true, RuleInvalidRequest, ResultWouldDeny, "invalid request"},
	}
	for _, tc := range tests {
		t.Run(string(tc.mode)+"/"+tc.req.Secret.Name+"/"+string(tc.req.Operation), func(t *testing.T) {
			rs := mustCompile(t, grants, WithMode(tc.mode))
			d := rs.Decide(tc.req)
			if d.Allowed != tc.allowed || d.WouldDeny != tc.wouldDeny || d.Rule != tc.rule || d.Mode != tc.mode || d.Result() != tc.result {
				t.Fatalf("got %+v (result %s), want allowed %v wouldDeny %v rule %s mode %s result %s", d, d.Result(), tc.allowed, tc.wouldDeny, tc.rule, tc.mode, tc.result)
			}
			if !strings.Contains(d.Reason, tc.reason) {
				t.Errorf("reason %q lacks %q", d.Reason, tc.reason)
			}
		})
	}
}

func TestEmptyRuleSetDeniesEverything(t *testing.T) {
	for name, rs := range map[string]*RuleSet{"nil": nil, "empty": mustCompile(t, nil), "zero store": new(Store).Load()} {
		d := rs.Decide(baseReq())
		if d.Allowed || d.Rule != RuleDefaultDeny || d.Mode != ModeEnforce {
			t.Errorf("%s: %+v, want default deny in enforce mode", name, d)
		}
	}
}

func TestWithModeKeepsRules(t *testing.T) {
	rs := mustCompile(t, []Grant{grant(testNS, "g")})
	audit := rs.WithMode(ModeAudit)
	if rs.Mode() != ModeEnforce || audit.Mode() != ModeAudit || audit.Len() != 1 {
		t.Fatalf("modes %s/%s len %d", rs.Mode(), audit.Mode(), audit.Len())
	}
	if d := audit.Decide(baseReq(func(r *Request) { r.Secret.Name = "x" })); !d.Allowed || !d.WouldDeny {
		t.Errorf("audit decision %+v", d)
	}
	if rs.WithMode("bogus").Mode() != ModeEnforce {
		t.Error("an unknown mode must become enforce")
	}
	if rs, _ := Compile(nil, WithMode("bogus")); rs.Mode() != ModeEnforce {
		t.Error("Compile with an unknown mode must enforce")
	}
}

func TestParseMode(t *testing.T) {
	for in, want := range map[string]Mode{"": ModeEnforce, "enforce": ModeEnforce, "audit": ModeAudit, "off": ModeOff} {
		if got, err := ParseMode(in); err != nil || got != want {
			t.Errorf("ParseMode(%q) = %q, %v", in, got, err)
		}
	}
	if _, err := ParseMode("Enforce"); err == nil {
		t.Error("ParseMode accepts a wrong case")
	}
}

func TestCostLimitOption(t *testing.T) {
	// The same condition fits the default budget and not a tiny one.
	g := []Grant{grant(testNS, "g", cond(`request.requester.labels.all(k, k.startsWith("label-"))`))}
	req := baseReq(func(r *Request) { r.Requester.Labels = manyLabels(50) })
	if d := mustCompile(t, g).Decide(req); !d.Allowed {
		t.Fatalf("default budget: %s", d.Reason)
	}
	d := mustCompile(t, g, WithCostLimit(20)).Decide(req)
	if d.Allowed || !strings.Contains(d.Reason, "cost limit") {
		t.Fatalf("tiny budget: %+v", d)
	}
}

func TestStoreSwapAndUpdate(t *testing.T) {
	var s Store
	if d := s.Decide(baseReq()); d.Allowed {
		t.Fatal("zero Store allowed")
	}
	errs := s.Update([]Grant{grant(testNS, "g", cond(`request.requester.node != ""`))})
	if len(errs) != 0 || !s.Decide(baseReq()).Allowed {
		t.Fatalf("after Update: errs %v, decision %+v", errs, s.Decide(baseReq()))
	}
	first := s.Load()
	s.SetMode(ModeAudit)
	if s.Load().Mode() != ModeAudit {
		t.Fatal("SetMode")
	}
	// Update inherits the mode and reuses the compiled condition.
	s.Update([]Grant{grant(testNS, "g", cond(`request.requester.node != ""`)), grant(testNS, "h")})
	cur := s.Load()
	if cur.Mode() != ModeAudit || cur.Len() != 2 {
		t.Fatalf("mode %s len %d", cur.Mode(), cur.Len())
	}
	if cur.conds[`request.requester.node != ""`] != first.conds[`request.requester.node != ""`] {
		t.Error("unchanged condition was recompiled")
	}
	old := s.Swap(nil)
	if old != cur || s.Decide(baseReq()).Allowed {
		t.Fatal("Swap(nil) must install the deny-all rule set")
	}
}

func TestInvalidRequestReasonIsBounded(t *testing.T) {
	huge := strings.Repeat("x\n", 1<<20)
	for _, rs := range []*RuleSet{mustCompile(t, nil), mustCompile(t, nil, WithMode(ModeOff))} {
		d := rs.Decide(baseReq(func(r *Request) { r.Driver = huge; r.Requester.Name = huge }))
		if len(d.Reason) > 1000 || strings.ContainsAny(d.Reason, "\n\r") {
			t.Errorf("mode %s: reason of %d bytes: %.200q", rs.Mode(), len(d.Reason), d.Reason)
		}
	}
}

// TestStoreSourcesKeepEachOthersGrants: the policy file and the SecretGrant
// resources are two sources of one store; reloading either keeps the
// other's grants (a file deny survives a SecretGrant change, and the
// SecretGrants survive the file's reload), and each source hears only of
// its own invalid grants.
func TestStoreSourcesKeepEachOthersGrants(t *testing.T) {
	var s Store
	deny := grant(testNS, "admin-deny", func(g *GrantSpec) { g.Action = ActionDeny })
	allow := grant(testNS, "tenant-allow")
	steps := []struct {
		source  string
		grants  []Grant
		allowed bool
	}{
		{SourceFile, []Grant{deny}, false},
		{SourceSecretGrants, []Grant{allow}, false}, // the file's deny stays
		{SourceFile, []Grant{deny}, false},          // a file reload keeps the SecretGrants, deny still wins
		{SourceFile, nil, true},                     // the deny removed from the file: the SecretGrant admits
		{SourceSecretGrants, nil, false},
	}
	for i, st := range steps {
		if errs := s.UpdateSource(st.source, st.grants); len(errs) != 0 {
			t.Fatalf("step %d: %v", i, errs)
		}
		if d := s.Decide(baseReq()); d.Allowed != st.allowed {
			t.Fatalf("step %d (%s, %d grants): allowed %v (%s), want %v", i, st.source, len(st.grants), d.Allowed, d.Reason, st.allowed)
		}
	}

	// The same name in both sources: every copy rejected, each source told.
	fileErrs := s.UpdateSource(SourceFile, []Grant{grant(testNS, "same"), grant(testNS, "file-only", func(g *GrantSpec) { g.Drivers = nil })})
	crdErrs := s.UpdateSource(SourceSecretGrants, []Grant{grant(testNS, "same")})
	if len(crdErrs) == 0 {
		t.Fatal("SecretGrant source: no error for a grant the file defines too")
	}
	for _, e := range crdErrs {
		if e.Key() != testNS+"/same" || !strings.Contains(e.Message, "every copy is rejected") {
			t.Fatalf("SecretGrant source errors: %v", crdErrs)
		}
	}
	if len(fileErrs) != 1 || fileErrs[0].Key() != testNS+"/file-only" {
		t.Fatalf("file source errors: %v (its own invalid grant only; the duplicate came after)", fileErrs)
	}
	if s.Decide(baseReq()).Allowed {
		t.Fatal("a grant defined in both sources was applied")
	}
}

// TestConditionReadingNamespaceLabelsIndirectly: a condition that reaches
// the namespace labels other than by the field's name (by index through
// dyn, by a computed key) fails closed as well while they are unknown;
// one that cannot reach them decides as usual.
func TestConditionReadingNamespaceLabelsIndirectly(t *testing.T) {
	for _, tc := range []struct {
		cond  string
		reads bool
	}{
		{`!('quarantined' in dyn(request.requester)['namespaceLabels'])`, true},
		{`dyn(request.requester)['namespace' + 'Labels'].size() == 0`, true},
		{`[dyn(request.requester)][0][request.secret.name].size() == 0`, true},
		{`has(dyn(request.requester).namespaceLabels)`, true},
		{`request.requester != policy.Requester{kind: request.requester.kind}`, true},
		{`[request.requester].size() == 1`, true},
		{`request.requester.labels[request.secret.name] == "x"`, false},
		{`has(request.requester.labels) && request.requester.kind == "PersistentVolumeClaim"`, false},
		{`dyn(request.requester)['labels'].size() == 0`, true}, // dyn of the whole requester: it could reach them
	} {
		c, err := compileCondition(tc.cond, DefaultCostLimit)
		if err != nil {
			t.Errorf("%s: %v", tc.cond, err)
			continue
		}
		if c.readsNSLabels != tc.reads {
			t.Errorf("%s: reads namespace labels %v, want %v", tc.cond, c.readsNSLabels, tc.reads)
		}
	}
	// The node, read the same ways; "node" as a label key or value is data.
	for _, tc := range []struct {
		cond  string
		reads bool
	}{
		{`request.requester.node.startsWith("dmz-")`, true},
		{`dyn(request.requester)['node'] != ""`, true},
		{`has(dyn(request.requester).node)`, true},
		{`request.requester.labels["role"] != "node"`, false},
		{`!has(request.requester.labels.node)`, false},
		{`request.requester.labels.exists(k, k == "node")`, false},
	} {
		c, err := compileCondition(tc.cond, DefaultCostLimit)
		if err != nil {
			t.Errorf("%s: %v", tc.cond, err)
			continue
		}
		if c.readsNode != tc.reads {
			t.Errorf("%s: reads the node %v, want %v", tc.cond, c.readsNode, tc.reads)
		}
	}
	// Decided end to end: an allow grant's condition that would be true
	// over empty labels does not match while they are unknown.
	rs := mustCompile(t, []Grant{grant(testNS, "g", cond(`!('quarantined' in dyn(request.requester)['namespaceLabels'])`))})
	d := rs.Decide(baseReq(func(r *Request) { r.Requester.NamespaceLabels = nil }))
	if d.Allowed || !strings.Contains(d.Reason, "namespace labels are not known") {
		t.Fatalf("decision %+v, want denied: the labels are not known", d)
	}
}

// TestDecisionCostBudget: the conditions of one decision share a budget of
// decisionBudgetConditions conditions at the cost limit. Grants whose
// conditions each cost under the limit but together more than the budget
// leave the rest unevaluated, which fails closed; fewer of them do not.
func TestDecisionCostBudget(t *testing.T) {
	const limit = 200
	costly := `request.requester.labels.all(k, k != "") && request.driver == "another.csi.test"`
	req := baseReq(func(r *Request) { r.Requester.Labels = manyLabels(20) })
	c, err := compileCondition(costly, limit)
	if err != nil {
		t.Fatal(err)
	}
	act := newActivation(&req, limit)
	if ok, err := c.eval(act); ok || err != nil {
		t.Fatalf("costly condition: %v %v", ok, err)
	}
	cost := act.spent
	if cost < limit/4 || cost >= limit {
		t.Fatalf("the costly condition costs %d; the test wants it between %d and %d", cost, limit/4, limit)
	}
	grants := func(n int) []Grant {
		var gs []Grant
		for i := 0; i < n; i++ {
			gs = append(gs, grant(testNS, fmt.Sprintf("a%02d", i), cond(costly)))
		}
		return append(gs, grant(testNS, "zz", cond(`true`)))
	}
	within := int(decisionBudgetConditions*limit/cost) - 1
	if d := mustCompile(t, grants(within), WithCostLimit(limit)).Decide(req); !d.Allowed || d.Rule != testNS+"/zz" {
		t.Fatalf("%d costly conditions, within the budget: %+v", within, d)
	}
	over := int(decisionBudgetConditions*limit/cost) + 2
	d := mustCompile(t, grants(over), WithCostLimit(limit)).Decide(req)
	if d.Allowed || !strings.Contains(d.Reason, "not evaluated") {
		t.Fatalf("%d costly conditions, over the budget: %+v", over, d)
	}
}
