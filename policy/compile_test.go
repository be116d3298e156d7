package policy

import (
	"strings"
	"testing"
)

func TestCompileRejectsInvalidGrants(t *testing.T) {
	tests := []struct {
		name       string
		grant      Grant
		want       []string // substrings of the message
		failClosed bool
	}{
		{"no namespace", Grant{Name: "g", Spec: spec()}, []string{"metadata.namespace", "not a valid namespace"}, false},
		{"bad name", Grant{Namespace: testNS, Name: "Bad_Name", Spec: spec()}, []string{"metadata.name"}, false},
		{"bad action", grant(testNS, "g", func(s *GrantSpec) { s.Action = "Maybe" }), []string{`spec.action: "Maybe" is not Allow or Deny`}, true},
		{"no drivers", grant(testNS, "g", func(s *GrantSpec) { s.Drivers = nil }), []string{"spec.drivers: must list at least one", "admits nobody"}, false},
		{"empty drivers list", grant(testNS, "g", func(s *GrantSpec) { s.Drivers = []string{} }), []string{"spec.drivers: must list"}, false},
		{"bad driver", grant(testNS, "g", func(s *GrantSpec) { s.Drivers = []string{"-bad-"} }), []string{`spec.drivers: "-bad-" is not a valid CSI driver name`}, false},
		{"no secret names", grant(testNS, "g", func(s *GrantSpec) { s.SecretNames = nil }), []string{"spec.secretNames: must list at least one"}, false},
		{"bad secret pattern", grant(testNS, "g", func(s *GrantSpec) { s.SecretNames = []string{"*foo"} }), []string{`spec.secretNames: "*foo" is not a valid pattern`}, false},
		{"inner star", grant(testNS, "g", func(s *GrantSpec) { s.SecretNames = []string{"a*b"} }), []string{`"a*b"`}, false},
		{"double star", grant(testNS, "g", func(s *GrantSpec) { s.SecretNames = []string{"a**"} }), []string{`"a**"`}, false},
		{"bad secret name", grant(testNS, "g", func(s *GrantSpec) { s.SecretNames = []string{"Creds"} }), []string{`spec.secretNames: "Creds" is not a valid secret name`}, false},
		{"no operations", grant(testNS, "g", func(s *GrantSpec) { s.Operations = nil }), []string{"spec.operations: must list at least one"}, false},
		{"unknown operation", grant(testNS, "g", func(s *GrantSpec) { s.Operations = []Operation{"NodeGetInfo"} }), []string{`spec.operations: "NodeGetInfo" is not a CSI operation`, "NodeStageVolume"}, false},
		{"no requesters", grant(testNS, "g", func(s *GrantSpec) { s.Requesters = Requesters{} }), []string{"spec.requesters: must set namespaces or namespaceSelector"}, false},
		{"empty namespaces list", grant(testNS, "g", func(s *GrantSpec) { s.Requesters.Namespaces = []string{} }), []string{"spec.requesters: must set"}, false},
		{"bad namespace", grant(testNS, "g", func(s *GrantSpec) { s.Requesters.Namespaces = []string{"Team A"} }), []string{`spec.requesters.namespaces: "Team A"`}, false},
		{"bad selector operator", grant(testNS, "g", sel(expr("team", "Like", "a"))), []string{`spec.requesters.namespaceSelector.matchExpressions[0].operator: "Like"`}, false},
		{"In without values", grant(testNS, "g", sel(expr("team", LabelSelectorOpIn))), []string{"matchExpressions[0].values: must not be empty for operator In"}, false},
		{"Exists with values", grant(testNS, "g", sel(expr("team", LabelSelectorOpExists, "a"))), []string{"matchExpressions[0].values: must be empty for operator Exists"}, false},
		{"bad label key", grant(testNS, "g", sel(&LabelSelector{MatchLabels: map[string]string{"bad key": "a"}})), []string{`matchLabels: key "bad key"`}, false},
		{"bad label value", grant(testNS, "g", sel(&LabelSelector{MatchLabels: map[string]string{"team": "a b"}})), []string{`matchLabels[team]: "a b"`}, false},
		{"empty storage class list", grant(testNS, "g", func(s *GrantSpec) { s.Requesters.StorageClasses = []string{} }), []string{"spec.requesters.storageClasses: must not be an empty list; omit the field"}, false},
		{"empty nodes list", grant(testNS, "g", func(s *GrantSpec) { s.Requesters.Nodes = []string{} }), []string{"spec.requesters.nodes: must not be an empty list"}, false},
		{"bad storage class", grant(testNS, "g", func(s *GrantSpec) { s.Requesters.StorageClasses = []string{"Fast!"} }), []string{`"Fast!" is not a valid StorageClass name`}, false},
		{"CEL syntax error", grant(testNS, "g", cond(`request.driver ==`)), []string{"spec.condition:", "Syntax error"}, false},
		{"CEL unknown field", grant(testNS, "g", cond(`request.drvier == "x"`)), []string{"spec.condition:", "undefined field 'drvier'"}, false},
		{"CEL unknown variable", grant(testNS, "g", cond(`secret.data["password"] == "x"`)), []string{"spec.condition:", "undeclared reference"}, false},
		{"CEL not bool", grant(testNS, "g", cond(`request.driver`)), []string{"spec.condition: must evaluate to bool, not string"}, false},
		{"CEL blank", grant(testNS, "g", cond("   ")), []string{"spec.condition: is blank"}, false},
		{"CEL too long", grant(testNS, "g", cond(`request.driver == "`+strings.Repeat("x", MaxConditionLength)+`"`)), []string{"spec.condition:", "limit"}, false},
		{"CEL always over cost", grant(testNS, "g", cond(`[1,2,3,4,5,6,7,8,9,10].map(a, [1,2,3,4,5,6,7,8,9,10].map(b, [1,2,3,4,5,6,7,8,9,10].map(c, [1,2,3,4,5,6,7,8,9,10].map(d, a+b+c+d)))).size() > 0`)),
			[]string{"spec.condition: costs at least", "more than the limit"}, false},
		{"CEL too deep", grant(testNS, "g", cond(strings.Repeat("(", 100)+"true"+strings.Repeat(")", 100))), []string{"spec.condition:"}, false},
		{"invalid deny fails closed", grant(testNS, "g", func(s *GrantSpec) { s.Action = ActionDeny; s.Operations = nil }), []string{"spec.operations"}, true},
		{"several problems at once", grant(testNS, "g", func(s *GrantSpec) { s.Drivers = nil; s.Operations = nil; s.Condition = "1" }),
			[]string{"spec.drivers", "spec.operations", "spec.condition"}, false},
	}
	valid := grant(testNS, "valid", func(s *GrantSpec) { s.SecretNames = []string{"other"} })
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rs, errs := Compile([]Grant{tc.grant, valid})
			if len(errs) != 1 {
				t.Fatalf("got %d errors, want 1: %v", len(errs), errs)
			}
			e := errs[0]
			if e.Namespace != tc.grant.Namespace || e.Name != tc.grant.Name {
				t.Errorf("error names %s, want %s", e.Key(), tc.grant.Key())
			}
			for _, w := range tc.want {
				if !strings.Contains(e.Message, w) {
					t.Errorf("message %q lacks %q", e.Message, w)
				}
			}
			if strings.ContainsAny(e.Message, "\n\r") {
				t.Errorf("message spans lines: %q", e.Message)
			}
			if e.FailClosed != tc.failClosed {
				t.Errorf("FailClosed = %v, want %v", e.FailClosed, tc.failClosed)
			}
			if rs.Len() != 1 || len(rs.Errors()) != 1 {
				t.Errorf("Len %d Errors %d, want the valid grant only", rs.Len(), len(rs.Errors()))
			}
			// The invalid grant is not applied (baseReq would match it)...
			d := rs.Decide(baseReq())
			if d.Allowed {
				t.Errorf("invalid grant applied: %+v", d)
			}
			// ...and the valid grant still is, unless the namespace fails closed.
			d = rs.Decide(baseReq(func(r *Request) { r.Secret.Name = "other" }))
			if d.Allowed == tc.failClosed {
				t.Errorf("valid grant: %+v (fail closed %v)", d, tc.failClosed)
			}
		})
	}
}

func TestCompileDuplicatesRejected(t *testing.T) {
	rs, errs := Compile([]Grant{grant(testNS, "g"), grant(testNS, "g"), grant(testNS, "h", func(s *GrantSpec) { s.SecretNames = []string{"x"} })})
	if len(errs) != 2 || !strings.Contains(errs[0].Message, "2 grants are named store/g") {
		t.Fatalf("errs %v", errs)
	}
	if rs.Len() != 1 || rs.Decide(baseReq()).Allowed {
		t.Fatal("a duplicated grant was applied")
	}
}

func TestCompileErrorsAreOrderedAndCarryGeneration(t *testing.T) {
	bad := func(ns, name string, gen int64) Grant {
		g := grant(ns, name, func(s *GrantSpec) { s.Drivers = nil })
		g.Generation = gen
		return g
	}
	_, errs := Compile([]Grant{bad("b", "y", 3), bad("a", "z", 1), bad("b", "x", 2)})
	var keys []string
	for _, e := range errs {
		keys = append(keys, e.Key())
	}
	if strings.Join(keys, ",") != "a/z,b/x,b/y" {
		t.Fatalf("order %v", keys)
	}
	if errs[0].Generation != 1 || errs[2].Generation != 3 {
		t.Errorf("generations %d %d", errs[0].Generation, errs[2].Generation)
	}
	if !strings.HasPrefix(errs[0].Error(), "secretgrant a/z: spec.drivers") || !strings.HasSuffix(errs[0].Error(), "(not applied)") {
		t.Errorf("Error() = %q", errs[0].Error())
	}
}

func TestCompileDoesNotModifyInput(t *testing.T) {
	gs := []Grant{grant("b", "g"), grant("a", "g", func(s *GrantSpec) { s.Drivers = []string{"z.example.com", "a.example.com", "z.example.com"} })}
	Compile(gs)
	if gs[0].Namespace != "b" || gs[1].Spec.Drivers[0] != "z.example.com" {
		t.Fatal("Compile reordered its input")
	}
}

func TestWithPreviousRecompilesChangedConditions(t *testing.T) {
	c1, c2 := `request.requester.node == "a"`, `request.requester.node == "b"`
	prev := mustCompile(t, []Grant{grant(testNS, "g", cond(c1))})
	next := mustCompile(t, []Grant{grant(testNS, "g", cond(c1)), grant(testNS, "h", cond(c2))}, WithPrevious(prev))
	if next.conds[c1] != prev.conds[c1] || next.conds[c2] == nil {
		t.Fatal("WithPrevious: unchanged condition not reused, or new one missing")
	}
	other := mustCompile(t, []Grant{grant(testNS, "g", cond(c1))}, WithPrevious(prev), WithCostLimit(5))
	if other.conds[c1] == prev.conds[c1] || other.CostLimit() != 5 {
		t.Fatal("a changed cost limit must recompile")
	}
}

func TestSelectorMatches(t *testing.T) {
	s, probs := compileSelector("sel", &LabelSelector{
		MatchLabels: map[string]string{"a": "1"},
		MatchExpressions: []LabelSelectorRequirement{
			{Key: "b", Operator: LabelSelectorOpIn, Values: []string{"x", "y"}},
			{Key: "c", Operator: LabelSelectorOpNotIn, Values: []string{"bad"}},
			{Key: "d", Operator: LabelSelectorOpExists},
			{Key: "example.com/e", Operator: LabelSelectorOpDoesNotExist},
		},
	})
	if len(probs) != 0 {
		t.Fatal(probs)
	}
	tests := []struct {
		labels map[string]string
		want   bool
	}{
		{map[string]string{"a": "1", "b": "x", "d": ""}, true},
		{map[string]string{"a": "1", "b": "y", "c": "ok", "d": "z"}, true},
		{map[string]string{"a": "2", "b": "x", "d": ""}, false},
		{map[string]string{"b": "x", "d": ""}, false},
		{map[string]string{"a": "1", "b": "z", "d": ""}, false},
		{map[string]string{"a": "1", "b": "x", "c": "bad", "d": ""}, false},
		{map[string]string{"a": "1", "b": "x"}, false},
		{map[string]string{"a": "1", "b": "x", "d": "", "example.com/e": ""}, false},
		{map[string]string{}, false},
		{nil, false},
	}
	for i, tc := range tests {
		if got := s.matches(tc.labels); got != tc.want {
			t.Errorf("%d: matches(%v) = %v, want %v", i, tc.labels, got, tc.want)
		}
	}
}
