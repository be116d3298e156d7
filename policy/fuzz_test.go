package policy

import (
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// FuzzCompileGrant feeds rule input (YAML or JSON, including CEL text) to
// ParseGrants and Compile, and a condition to a grant that would otherwise
// admit baseReq. Nothing may panic, every grant is either applied or
// reported, and nothing is admitted across namespaces.
func FuzzCompileGrant(f *testing.F) {
	f.Add([]byte(twoGrantsYAML), `request.requester.labels["app"] == "db"`)
	if data, err := os.ReadFile(filepath.Join("..", "deploy", "crds", "examples", "secretgrants.yaml")); err == nil {
		f.Add(data, `request.secret.name.startsWith("cre") && request.requester.node != ""`)
	}
	f.Add([]byte(`[{"apiVersion": "policy.csibroker.io/v1alpha1", "kind": "SecretGrant", "metadata": {"name": "a", "namespace": "store"},
		"spec": {"drivers": ["*"], "secretNames": ["cre*"], "operations": ["*"], "requesters": {"namespaces": ["*"]}, "condition": "1 == 1"}}]`),
		`request.requester.labels.all(k, k.size() < 10)`)
	f.Add([]byte("apiVersion: policy.csibroker.io/v1alpha1\nkind: SecretGrant\nmetadata: {name: x, namespace: store}\nspec:\n  action: Deny\n  drivers: ['*']\n  secretNames: ['*']\n  operations: ['*']\n  requesters: {namespaceSelector: {}}\n  condition: 'request.nosuch'\n"),
		`[1,2,3].map(x, x * 2).exists(y, y > 4)`)
	f.Add([]byte("a: [b"), `request.driver ==`)
	f.Add([]byte("kind: List\nitems: [1, {kind: SecretGrant}]"), `"a".matches("(")`)
	f.Add([]byte(`{}`), `int(request.requester.labels["x"]) > 0`)
	f.Add([]byte(""), strings.Repeat("!", 300)+"true")
	f.Add([]byte("- &a [*a, *a]\n"), `request.requester.namespaceLabels.exists(k, request.requester.namespaceLabels[k] == "gold")`)

	f.Fuzz(func(t *testing.T, data []byte, condition string) {
		req := baseReq()
		if grants, err := ParseGrants(data); err == nil {
			rs, errs := Compile(grants)
			if rs.Len()+len(errs) != len(grants) {
				t.Fatalf("%d grants: %d applied + %d errors", len(grants), rs.Len(), len(errs))
			}
			for _, e := range errs {
				if e.Message == "" {
					t.Fatalf("empty message for %s", e.Key())
				}
			}
			checkDecision(t, rs, req)
		}

		g := grant(testNS, "g", cond(condition))
		rs, errs := Compile([]Grant{g})
		if len(errs) > 0 {
			if strings.ContainsAny(errs[0].Message, "\n\r") {
				t.Fatalf("multi-line message: %q", errs[0].Message)
			}
			if d := rs.Decide(req); d.Allowed {
				t.Fatalf("invalid grant applied: %+v", d)
			}
			return
		}
		checkDecision(t, rs, req)
		checkDecision(t, rs, baseReq(func(r *Request) { r.Requester.Labels = manyLabels(100) }))
	})
}

// checkDecision: whatever the rules, an allow names a grant of the secret's
// namespace, and a reason is one non-empty line.
func checkDecision(t *testing.T, rs *RuleSet, req Request) Decision {
	t.Helper()
	d := rs.Decide(req)
	if d.Reason == "" || strings.ContainsAny(d.Reason, "\n\r") {
		t.Fatalf("bad reason %q", d.Reason)
	}
	if d.Allowed && rs.Mode() == ModeEnforce && !strings.HasPrefix(d.Rule, req.Secret.Namespace+"/") {
		t.Fatalf("allowed by %q, not a grant of namespace %q", d.Rule, req.Secret.Namespace)
	}
	return d
}

var (
	fuzzRulesOnce sync.Once
	fuzzRules     *RuleSet
)

// fuzzRuleSet has grants of every shape in a few namespaces.
func fuzzRuleSet(t *testing.T) *RuleSet {
	fuzzRulesOnce.Do(func() {
		var gs []Grant
		for _, ns := range []string{"store", "team-a", "a"} {
			gs = append(gs,
				grant(ns, "exact"),
				grant(ns, "prefix", func(s *GrantSpec) { s.SecretNames = []string{"c*", "team-*"}; s.Drivers = []string{"*"} }),
				grant(ns, "all", func(s *GrantSpec) {
					s.SecretNames, s.Operations = []string{"*"}, []Operation{"*"}
					s.Requesters = Requesters{Namespaces: []string{"*"}}
					s.Condition = `request.requester.labels["app"] == "db" || request.requester.node.endsWith("-1")`
				}),
				grant(ns, "selector", sel(&LabelSelector{
					MatchLabels:      map[string]string{"team": "a"},
					MatchExpressions: []LabelSelectorRequirement{{Key: "tier", Operator: LabelSelectorOpNotIn, Values: []string{"bronze"}}},
				})),
				grant(ns, "sc-node", func(s *GrantSpec) {
					s.Drivers = []string{"*"}
					s.Requesters.StorageClasses = []string{"fast"}
					s.Requesters.Nodes = []string{"node-1"}
				}),
				grant(ns, "deny", func(s *GrantSpec) {
					s.Action = ActionDeny
					s.Drivers, s.SecretNames, s.Operations = []string{"*"}, []string{"*"}, []Operation{"*"}
					s.Requesters = Requesters{NamespaceSelector: expr("trust", LabelSelectorOpIn, "none")}
					s.Condition = `int(request.requester.labels["level"]) > 3`
				}),
			)
		}
		rs, errs := Compile(gs)
		if len(errs) > 0 {
			panic(errs[0].Error())
		}
		fuzzRules = rs
	})
	return fuzzRules
}

// FuzzDecide feeds arbitrary request fields to a rule set with grants of
// every shape, in every mode. Nothing may panic; enforce never admits across
// namespaces; audit allows exactly what enforce would, flagging the rest;
// off allows everything.
func FuzzDecide(f *testing.F) {
	f.Add(testDriver, "NodeStageVolume", "store", "creds", "PersistentVolumeClaim", "team-a", "data", "fast", "node-1", "team", "a", true)
	f.Add("x.example.com", "CreateVolume", "team-a", "team-b-creds", "VolumeAttachment", "", "csi-1", "", "node-1", "app", "db", false)
	f.Add("", "", "", "", "", "", "", "", "", "", "", false)
	f.Add(testDriver, "*", "store", "*", "Pod", "team-a", "x\ny", "fast", "node-1", "level", "9", true)
	f.Add("-bad-", "NodeGetInfo", "Store", "c/../d", "k", "ns", "n", "sc", "node", "trust", "none", true)
	f.Add(testDriver, "DeleteVolume", "a", "c", "PersistentVolume", "a", "pv-1", "fast", "", "level", "x", true)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))

	f.Fuzz(func(t *testing.T, driver, op, secretNS, secretName, kind, reqNS, reqName, sc, node, labelKey, labelValue string, nsLabelsKnown bool) {
		req := Request{
			Driver:    driver,
			Operation: Operation(op),
			Secret:    SecretRef{Namespace: secretNS, Name: secretName},
			Source:    Source{Kind: SourceTemplate, Template: labelValue},
			Requester: Requester{
				Kind: kind, Namespace: reqNS, Name: reqName, StorageClass: sc, Node: node,
				Labels: map[string]string{labelKey: labelValue, "level": labelValue},
			},
		}
		if nsLabelsKnown {
			req.Requester.NamespaceLabels = map[string]string{labelKey: labelValue, "team": labelValue}
		}
		rs := fuzzRuleSet(t)
		enforce := checkDecision(t, rs, req)
		Audit(log, req, enforce)

		audit := rs.WithMode(ModeAudit).Decide(req)
		if !audit.Allowed || audit.WouldDeny == enforce.Allowed || audit.Rule != enforce.Rule {
			t.Fatalf("audit %+v disagrees with enforce %+v", audit, enforce)
		}
		if off := rs.WithMode(ModeOff).Decide(req); !off.Allowed || off.Rule != RuleModeOff || strings.ContainsAny(off.Reason, "\n\r") {
			t.Fatalf("off: %+v", off)
		}
	})
}
