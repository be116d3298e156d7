package policy

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"slices"
	"strings"
	"testing"
)

func TestAuditLine(t *testing.T) {
	req := baseReq(func(r *Request) {
		r.Requester.Labels = map[string]string{"app": "label-value-must-not-appear"}
		r.Requester.NamespaceLabels = map[string]string{"team": "nslabel-value-must-not-appear"}
		r.Source = Source{Kind: SourceTemplate, Key: "csi.storage.k8s.io/node-stage-secret-name", Template: "${pvc.annotations['template-must-not-appear']}"}
	})
	rs := mustCompile(t, []Grant{grant(testNS, "g")})
	for _, tc := range []struct {
		name  string
		req   Request
		level string
		want  map[string]string
	}{
		{"allow", req, "INFO", map[string]string{LogKeyDecision: ResultAllow, LogKeyRule: "store/g"}},
		{"deny", func() Request { r := req; r.Secret.Name = "other"; return r }(), "WARN",
			map[string]string{LogKeyDecision: ResultDeny, LogKeyRule: RuleDefaultDeny, LogKeySecretName: "other"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var buf bytes.Buffer
			logger := slog.New(slog.NewJSONHandler(&buf, nil))
			Audit(logger, tc.req, rs.Decide(tc.req))

			if n := strings.Count(buf.String(), "\n"); n != 1 {
				t.Fatalf("%d lines, want 1: %s", n, buf.String())
			}
			for _, s := range []string{"label-value-must-not-appear", "nslabel-value-must-not-appear", "template-must-not-appear"} {
				if strings.Contains(buf.String(), s) {
					t.Errorf("audit line holds %q: %s", s, buf.String())
				}
			}
			var line map[string]any
			if err := json.Unmarshal(buf.Bytes(), &line); err != nil {
				t.Fatal(err)
			}
			var keys []string
			for k := range line {
				keys = append(keys, k)
			}
			slices.Sort(keys)
			wantKeys := []string{"level", "msg", "time", LogKeyDecision, LogKeyMode, LogKeyRule, LogKeyDriver, LogKeyOperation,
				LogKeySecretNamespace, LogKeySecretName, LogKeySource, LogKeySourceKey, LogKeyRequesterKind,
				LogKeyRequesterNamespace, LogKeyRequesterName, LogKeyStorageClass, LogKeyNode, LogKeyReason}
			slices.Sort(wantKeys)
			if !slices.Equal(keys, wantKeys) {
				t.Errorf("keys %v, want %v", keys, wantKeys)
			}
			want := map[string]string{
				"level": tc.level, "msg": AuditMessage, LogKeyMode: "enforce", LogKeyDriver: testDriver,
				LogKeyOperation: "NodeStageVolume", LogKeySecretNamespace: "store", LogKeySecretName: "creds",
				LogKeySource: "Template", LogKeyRequesterKind: "PersistentVolumeClaim", LogKeyRequesterNamespace: "team-a",
				LogKeyRequesterName: "data", LogKeyStorageClass: "fast", LogKeyNode: "node-1",
			}
			for k, v := range tc.want {
				want[k] = v
			}
			for k, v := range want {
				if line[k] != v {
					t.Errorf("%s = %v, want %q", k, line[k], v)
				}
			}
		})
	}
}

func TestAuditAuditModeAndNilLogger(t *testing.T) {
	Audit(nil, baseReq(), Decision{}) // no panic
	var buf bytes.Buffer
	logger := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelWarn}))
	rs := mustCompile(t, []Grant{grant(testNS, "g")}, WithMode(ModeAudit))
	Audit(logger, baseReq(), rs.Decide(baseReq())) // allow: below Warn, not written
	if buf.Len() != 0 {
		t.Fatalf("allow written at Warn level: %s", buf.String())
	}
	req := baseReq(func(r *Request) { r.Secret.Name = "x" })
	Audit(logger, req, rs.Decide(req))
	if !strings.Contains(buf.String(), `"decision":"would-deny"`) || !strings.Contains(buf.String(), `"mode":"audit"`) {
		t.Fatalf("would-deny line: %s", buf.String())
	}
}
