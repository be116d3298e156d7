package policy

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const twoGrantsYAML = `
# comment
---
apiVersion: policy.csibroker.io/v1alpha1
kind: SecretGrant
metadata:
  name: g
  namespace: store
  generation: 4
  labels: {owner: team}
  annotations: {note: x}
spec:
  drivers: [nfs.csi.example.com]
  secretNames: [creds]
  operations: [NodeStageVolume]
  requesters:
    namespaces: [team-a]
    storageClasses: [fast]
  condition: request.requester.node != ""
status:
  conditions: [{type: Valid, status: "True"}]
---
---
apiVersion: policy.csibroker.io/v1alpha1
kind: SecretGrant
metadata: {name: deny, namespace: store}
spec:
  action: Deny
  drivers: ["*"]
  secretNames: ["*"]
  operations: ["*"]
  requesters:
    namespaceSelector:
      matchExpressions:
      - {key: trust, operator: In, values: [untrusted]}
`

func TestParseGrants(t *testing.T) {
	tests := []struct {
		name  string
		input string
		names []string
	}{
		{"multi-document YAML", twoGrantsYAML, []string{"store/g", "store/deny"}},
		{"YAML list", `
- apiVersion: policy.csibroker.io/v1alpha1
  kind: SecretGrant
  metadata: {name: a, namespace: n1}
  spec: {drivers: [d.example.com], secretNames: [s], operations: [CreateVolume], requesters: {namespaces: [x]}}
- apiVersion: policy.csibroker.io/v1alpha1
  kind: SecretGrant
  metadata: {name: b, namespace: n2}
  spec: {drivers: [d.example.com], secretNames: [s], operations: [CreateVolume], requesters: {namespaces: [x]}}
`, []string{"n1/a", "n2/b"}},
		{"JSON list", `[{"apiVersion": "policy.csibroker.io/v1alpha1", "kind": "SecretGrant", "metadata": {"name": "a", "namespace": "n1"},
			"spec": {"drivers": ["d.example.com"], "secretNames": ["s"], "operations": ["CreateVolume"], "requesters": {"namespaces": ["x"]}}}]`, []string{"n1/a"}},
		{"JSON object", `{"apiVersion": "policy.csibroker.io/v1alpha1", "kind": "SecretGrant", "metadata": {"name": "a", "namespace": "n1", "generation": 2},
			"spec": {"drivers": ["d.example.com"], "secretNames": ["s"], "operations": ["CreateVolume"], "requesters": {"namespaces": ["x"]}}}`, []string{"n1/a"}},
		{"kubectl List", `
apiVersion: v1
kind: List
items:
- apiVersion: policy.csibroker.io/v1alpha1
  kind: SecretGrant
  metadata: {name: a, namespace: n1, creationTimestamp: 2024-01-02T03:04:05Z}
  spec: {drivers: [d.example.com], secretNames: [s], operations: [CreateVolume], requesters: {namespaces: [x]}}
`, []string{"n1/a"}},
		{"empty", "", nil},
		{"only comments", "# nothing\n---\n", nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			grants, err := ParseGrants([]byte(tc.input))
			if err != nil {
				t.Fatal(err)
			}
			var names []string
			for _, g := range grants {
				names = append(names, g.Key())
			}
			if strings.Join(names, ",") != strings.Join(tc.names, ",") {
				t.Fatalf("grants %v, want %v", names, tc.names)
			}
			if _, errs := Compile(grants); len(errs) != 0 {
				t.Fatalf("compile: %v", errs)
			}
		})
	}

	grants, _ := ParseGrants([]byte(twoGrantsYAML))
	g := grants[0]
	if g.Generation != 4 || g.Spec.Condition != `request.requester.node != ""` || g.Spec.Requesters.StorageClasses[0] != "fast" {
		t.Errorf("fields lost: %+v", g)
	}
	if d := grants[1].Spec; d.Action != ActionDeny || d.Requesters.NamespaceSelector.MatchExpressions[0].Values[0] != "untrusted" {
		t.Errorf("deny grant: %+v", d)
	}
}

func TestParseGrantsErrors(t *testing.T) {
	obj := func(s string) string {
		return "apiVersion: policy.csibroker.io/v1alpha1\nkind: SecretGrant\nmetadata: {name: a, namespace: n}\n" + s
	}
	validSpec := "spec: {drivers: [d], secretNames: [s], operations: [CreateVolume], requesters: {namespaces: [x]}}\n"
	tests := []struct{ name, input, want string }{
		{"bad YAML", "a: [b", "document 1"},
		{"bad YAML in second document", obj(validSpec) + "---\nfoo: : bar\n", "document 2"},
		{"wrong kind", "apiVersion: policy.csibroker.io/v1alpha1\nkind: Secret\n" + validSpec, `kind "Secret"`},
		{"wrong apiVersion", "apiVersion: v1\nkind: SecretGrant\n" + validSpec, `apiVersion "v1"`},
		{"unknown spec field", obj("spec: {drivers: [d], secretName: [s], operations: [CreateVolume], requesters: {namespaces: [x]}}"), `unknown field "secretName"`},
		{"unknown nested field", obj("spec: {drivers: [d], secretNames: [s], operations: [CreateVolume], requesters: {namespace: [x]}}"), `unknown field "requesters.namespace"`},
		{"field name in another case", obj("spec: {drivers: [d], secretNames: [s], operations: [CreateVolume], requesters: {namespaces: [x]}, Action: Deny}"), `unknown field "Action"`},
		{"JSON key given twice", `{"apiVersion": "policy.csibroker.io/v1alpha1", "kind": "SecretGrant", "metadata": {"name": "g", "namespace": "n"}, "spec": {"action": "Deny", "drivers": ["d"], "secretNames": ["s"], "operations": ["CreateVolume"], "requesters": {"namespaces": ["x"]}, "action": "Allow"}}`, `duplicate field "spec.action"`},
		// A number encoding/json keeps but the duplicate check's decoder
		// refuses: the file is refused, not its duplicate let by (this
		// loaded an Allow grant).
		{"JSON key given twice after a number out of range", `{"apiVersion": "policy.csibroker.io/v1alpha1", "kind": "SecretGrant", "metadata": {"name": "g", "namespace": "n", "annotations": {"x": 1e400}}, "spec": {"action": "Deny", "drivers": ["d"], "secretNames": ["s"], "operations": ["CreateVolume"], "requesters": {"namespaces": ["x"]}, "action": "Allow"}}`, `JSON input: `},
		{"JSON key given twice in a list item", `[{"apiVersion": "policy.csibroker.io/v1alpha1", "kind": "SecretGrant", "metadata": {"name": "g", "namespace": "n"}, "spec": {"action": "Deny", "drivers": ["d"], "secretNames": ["s"], "operations": ["CreateVolume"], "requesters": {"namespaces": ["x", "y"], "namespaces": ["z"]}}}]`, `duplicate field "[0].spec.requesters.namespaces"`},
		{"unknown top-level field", obj(validSpec) + "extra: 1\n", `unknown field "extra"`},
		{"wrong type", obj("spec: {drivers: d, secretNames: [s], operations: [CreateVolume], requesters: {namespaces: [x]}}"), "cannot unmarshal"},
		{"no spec", obj(""), "has no spec"},
		{"scalar document", "hello", "want a SecretGrant object"},
		{"list item error names the item", "- " + strings.ReplaceAll(obj(validSpec), "\n", "\n  ") + "\n- 3\n", "item 2"},
		{"JSON trailing data", `{"a": 1} {"b": 2}`, "trailing data"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseGrants([]byte(tc.input))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to mention %q", err, tc.want)
			}
		})
	}
}

func TestStoreLoadFileKeepsOldRulesOnError(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "grants.yaml")
	if err := os.WriteFile(path, []byte(twoGrantsYAML), 0o600); err != nil {
		t.Fatal(err)
	}
	var s Store
	errs, err := s.LoadFile(path)
	if err != nil || len(errs) != 0 || s.Load().Len() != 2 {
		t.Fatalf("load: %v %v len %d", err, errs, s.Load().Len())
	}
	if !s.Decide(baseReq()).Allowed {
		t.Fatal("loaded grant does not apply")
	}
	good := s.Load()

	os.WriteFile(path, []byte("spec: [broken"), 0o600)
	if _, err := s.LoadFile(path); err == nil || !strings.Contains(err.Error(), path) {
		t.Fatalf("broken file: err %v", err)
	}
	if s.Load() != good {
		t.Fatal("a broken file replaced the rules")
	}
	if _, err := s.LoadFile(filepath.Join(dir, "missing.yaml")); err == nil || s.Load() != good {
		t.Fatal("a missing file replaced the rules")
	}

	// A well-formed file with an invalid grant applies the rest.
	os.WriteFile(path, []byte(strings.Replace(twoGrantsYAML, "operations: [NodeStageVolume]", "operations: []", 1)), 0o600)
	errs, err = s.LoadFile(path)
	if err != nil || len(errs) != 1 || errs[0].Key() != "store/g" || s.Load().Len() != 1 {
		t.Fatalf("invalid grant: %v %v", err, errs)
	}
}

func TestExampleGrantsLoad(t *testing.T) {
	grants, err := LoadFile(filepath.Join("..", "deploy", "crds", "examples", "secretgrants.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	rs, errs := Compile(grants)
	if len(errs) != 0 || rs.Len() != 4 {
		t.Fatalf("errors %v, %d grants", errs, rs.Len())
	}
	// As the broker asks them: at provisioning, before any node uses the
	// volume (the NFS driver is not node-local).
	nodeReq := func(ns, secret, node string, trust string) Request {
		return Request{
			Driver: "nfs.csi.example.com", Operation: OpNodeStageVolume,
			Secret:    SecretRef{Namespace: "storage-secrets", Name: secret},
			Requester: Requester{Kind: KindPersistentVolumeClaim, Namespace: ns, Name: "data", Node: node, NamespaceLabels: map[string]string{"trust.example.com/level": trust}},
		}
	}
	for _, tc := range []struct {
		name    string
		req     Request
		allowed bool
		rule    string
	}{
		{"team's own node secret", nodeReq("team-a", "team-a-node", "", "high"), true, "storage-secrets/nfs-node-stage"},
		{"another team's node secret", nodeReq("team-a", "team-b-node", "", "high"), false, RuleDefaultDeny},
		{"untrusted namespace", nodeReq("team-a", "team-a-node", "", "untrusted"), false, "storage-secrets/no-untrusted"},
	} {
		d := rs.Decide(tc.req)
		if d.Allowed != tc.allowed || d.Rule != tc.rule {
			t.Errorf("%s: %+v", tc.name, d)
		}
	}
}

// TestLoadFileRefusesAFileWithNoDocument: a policy file that is empty or
// holds only comments (caught while being rewritten in place) is an error,
// so the store keeps its rules; an explicit empty list loads no grants.
func TestLoadFileRefusesAFileWithNoDocument(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	full := write("full.yaml", `apiVersion: policy.csibroker.io/v1alpha1
kind: SecretGrant
metadata: {name: deny-all, namespace: n1}
spec: {action: Deny, drivers: ["*"], secretNames: ["*"], operations: ["*"], requesters: {namespaces: ["*"]}}
`)
	st := NewStore(nil)
	if errs, err := st.LoadFile(full); err != nil || len(errs) != 0 {
		t.Fatalf("load: %v %v", errs, err)
	}
	for _, content := range []string{"", "  \n", "# being rewritten\n---\n"} {
		if _, err := st.LoadFile(write("partial.yaml", content)); err == nil || !strings.Contains(err.Error(), "no YAML or JSON document") {
			t.Errorf("file %q: %v, want an error", content, err)
		}
		if n := st.Load().Len(); n != 1 {
			t.Errorf("file %q: %d grants in force, want the previous 1", content, n)
		}
	}
	if _, err := st.LoadFile(write("none.yaml", "[]\n")); err != nil {
		t.Fatalf("explicit empty list: %v", err)
	}
	if n := st.Load().Len(); n != 0 {
		t.Errorf("explicit empty list: %d grants in force, want 0", n)
	}
}
