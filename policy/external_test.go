package policy

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// opa is a real HTTP server on 127.0.0.1 standing in for OPA.
type opa struct {
	*httptest.Server
	calls atomic.Int64
	last  atomic.Pointer[[]byte] // last request body
}

func newOPA(t *testing.T, h func(w http.ResponseWriter, r *http.Request)) *opa {
	t.Helper()
	o := &opa{}
	o.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		o.calls.Add(1)
		body, _ := io.ReadAll(r.Body)
		o.last.Store(&body)
		h(w, r)
	}))
	t.Cleanup(o.Close)
	return o
}

func answer200(body string) func(http.ResponseWriter, *http.Request) {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, body)
	}
}

func newExternal(t *testing.T, url string, mut ...func(*ExternalConfig)) *External {
	t.Helper()
	cfg := ExternalConfig{
		URL:            url,
		Path:           "csibroker/allow",
		AttemptTimeout: 100 * time.Millisecond,
		Timeout:        2 * time.Second,
		MaxAttempts:    3,
		RetryWaitMin:   time.Millisecond,
		RetryWaitMax:   5 * time.Millisecond,
		CacheTTL:       -1,
	}
	for _, m := range mut {
		m(&cfg)
	}
	e, err := NewExternal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func TestExternalAnswers(t *testing.T) {
	tests := []struct {
		name      string
		handler   func(http.ResponseWriter, *http.Request)
		allowed   bool
		calls     int64 // attempts expected; 0: don't check
		reason    []string
		notReason []string
	}{
		{name: "allow", handler: answer200(`{"result": true}`), allowed: true, calls: 1,
			reason: []string{"external decision point http://", "/v1/data/csibroker/allow allows driver " + testDriver}},
		{name: "allow object", handler: answer200(`{"result": {"allow": true, "reason": "ok by tenant policy"}}`), allowed: true,
			reason: []string{"ok by tenant policy"}},
		{name: "deny", handler: answer200(`{"result": false}`), calls: 1, reason: []string{"denies driver " + testDriver, "store/creds", "NodeStageVolume"}},
		{name: "deny with reason", handler: answer200(`{"decision_id": "1", "result": {"allow": false, "reason": "tenant over quota"}}`),
			reason: []string{"denies", "tenant over quota"}},
		{name: "reason is sanitized", handler: answer200(`{"result": {"allow": false, "reason": "bad\nlevel=ERROR msg=forged"}}`),
			reason: []string{"bad?level=ERROR"}, notReason: []string{"\n"}},
		{name: "undefined document", handler: answer200(`{}`), calls: 1, reason: []string{"denied (fail closed)", `no "result"`}},
		{name: "null result", handler: answer200(`{"result": null}`), reason: []string{`no "result"`}},
		{name: "string result", handler: answer200(`{"result": "yes"}`), reason: []string{"neither a boolean nor"}},
		{name: "object without allow", handler: answer200(`{"result": {"reason": "x"}}`), reason: []string{`no boolean "allow"`}},
		{name: "allow not a bool", handler: answer200(`{"result": {"allow": "true"}}`), reason: []string{`result is not {"allow": bool`}},
		{name: "garbage body", handler: answer200(`<html>hello</html>`), reason: []string{"fail closed", "not a JSON object"}},
		{name: "truncated body", handler: answer200(`{"result": tr`), reason: []string{"not a JSON object"}},
		{name: "huge body", handler: answer200(`{"result": true, "pad": "` + strings.Repeat("x", maxExternalBody) + `"}`), reason: []string{"larger than"}},
		{name: "HTTP 500 is retried, then denies", handler: func(w http.ResponseWriter, r *http.Request) {
			http.Error(w, "boom", http.StatusInternalServerError)
		}, calls: 3, reason: []string{"fail closed", "HTTP 500", "boom"}},
		{name: "HTTP 403 is not retried", handler: func(w http.ResponseWriter, r *http.Request) {
			http.Error(w, "forbidden", http.StatusForbidden)
		}, calls: 1, reason: []string{"HTTP 403"}},
		{name: "HTTP 500 then 200 allows", handler: func() func(http.ResponseWriter, *http.Request) {
			var n atomic.Int64
			return func(w http.ResponseWriter, r *http.Request) {
				if n.Add(1) == 1 {
					http.Error(w, "warming up", http.StatusServiceUnavailable)
					return
				}
				io.WriteString(w, `{"result": true}`)
			}
		}(), allowed: true, calls: 2},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			srv := newOPA(t, tc.handler)
			e := newExternal(t, srv.URL)
			d := e.Decide(context.Background(), baseReq())
			if d.Allowed != tc.allowed || d.Rule != RuleExternal {
				t.Fatalf("allowed %v rule %q, want %v %q; reason: %s", d.Allowed, d.Rule, tc.allowed, RuleExternal, d.Reason)
			}
			for _, s := range tc.reason {
				if !strings.Contains(d.Reason, s) {
					t.Errorf("reason %q lacks %q", d.Reason, s)
				}
			}
			for _, s := range tc.notReason {
				if strings.Contains(d.Reason, s) {
					t.Errorf("reason %q holds %q", d.Reason, s)
				}
			}
			if tc.calls != 0 && srv.calls.Load() != tc.calls {
				t.Errorf("server saw %d requests, want %d", srv.calls.Load(), tc.calls)
			}
		})
	}
}

func TestExternalInputHoldsOnlyReferences(t *testing.T) {
	var gotPath, gotMethod, gotCT, gotAuth string
	srv := newOPA(t, func(w http.ResponseWriter, r *http.Request) {
		gotPath, gotMethod, gotCT, gotAuth = r.URL.Path, r.Method, r.Header.Get("Content-Type"), r.Header.Get("Authorization")
		io.WriteString(w, `{"result": true}`)
	})
	e := newExternal(t, srv.URL+"/", func(c *ExternalConfig) {
		c.Path = "/csibroker/allow/"
		c.Header = http.Header{"Authorization": {"Bearer t0ken"}}
	})
	if !e.Decide(context.Background(), baseReq()).Allowed {
		t.Fatal("denied")
	}
	if gotPath != "/v1/data/csibroker/allow" || gotMethod != http.MethodPost || gotCT != "application/json" || gotAuth != "Bearer t0ken" {
		t.Errorf("path %q method %q content type %q auth %q", gotPath, gotMethod, gotCT, gotAuth)
	}
	var body struct {
		Input map[string]json.RawMessage `json:"input"`
	}
	if err := json.Unmarshal(*srv.last.Load(), &body); err != nil {
		t.Fatal(err)
	}
	var keys []string
	for k := range body.Input {
		keys = append(keys, k)
	}
	for _, k := range []string{"driver", "operation", "secret", "source", "requester"} {
		if _, ok := body.Input[k]; !ok {
			t.Errorf("input lacks %q (has %v)", k, keys)
		}
	}
	if len(body.Input) != 5 {
		t.Errorf("input has keys %v, want exactly the Request fields", keys)
	}
	if string(body.Input["secret"]) != `{"namespace":"store","name":"creds"}` {
		t.Errorf("secret = %s, want the reference only", body.Input["secret"])
	}
}

func TestExternalSlowFailsClosed(t *testing.T) {
	release := make(chan struct{})
	srv := newOPA(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-release:
		}
	})
	defer close(release) // before srv.Close (cleanup), so handlers return
	e := newExternal(t, srv.URL, func(c *ExternalConfig) {
		c.AttemptTimeout = 30 * time.Millisecond
		c.MaxAttempts = 2
		c.Timeout = time.Second
	})
	d := e.Decide(context.Background(), baseReq())
	if d.Allowed {
		t.Fatalf("slow endpoint allowed: %+v", d)
	}
	for _, s := range []string{"denied (fail closed)", "timed out", "after 2 attempt(s)"} {
		if !strings.Contains(d.Reason, s) {
			t.Errorf("reason %q lacks %q", d.Reason, s)
		}
	}
	if n := srv.calls.Load(); n != 2 {
		t.Errorf("attempts %d, want 2", n)
	}

	// The whole-decision timeout bounds it too, whatever the attempts.
	e = newExternal(t, srv.URL, func(c *ExternalConfig) {
		c.AttemptTimeout = time.Minute
		c.Timeout = 50 * time.Millisecond
	})
	d = e.Decide(context.Background(), baseReq())
	if d.Allowed || !strings.Contains(d.Reason, "no answer within 50ms") {
		t.Errorf("decision timeout: %+v", d)
	}

	// So does the caller's context.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	d = e.Decide(ctx, baseReq())
	if d.Allowed || !strings.Contains(d.Reason, "cancelled") {
		t.Errorf("cancelled: %+v", d)
	}
}

func TestExternalDownFailsClosed(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close() // nothing listens there now: connection refused
	e := newExternal(t, "http://"+addr)
	d := e.Decide(context.Background(), baseReq())
	if d.Allowed {
		t.Fatalf("down endpoint allowed: %+v", d)
	}
	for _, s := range []string{"fail closed", "unreachable", "after 3 attempt(s)", "connection refused"} {
		if !strings.Contains(d.Reason, s) {
			t.Errorf("reason %q lacks %q", d.Reason, s)
		}
	}
}

func TestExternalDoesNotFollowRedirects(t *testing.T) {
	elsewhere := newOPA(t, answer200(`{"result": true}`))
	srv := newOPA(t, func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, elsewhere.URL+"/v1/data/csibroker/allow", http.StatusTemporaryRedirect)
	})
	d := newExternal(t, srv.URL).Decide(context.Background(), baseReq())
	if d.Allowed || !strings.Contains(d.Reason, "HTTP 307") || elsewhere.calls.Load() != 0 {
		t.Fatalf("redirect: %+v, elsewhere saw %d", d, elsewhere.calls.Load())
	}
}

func TestExternalCache(t *testing.T) {
	srv := newOPA(t, func(w http.ResponseWriter, r *http.Request) {
		var in struct {
			Input Request `json:"input"`
		}
		json.NewDecoder(r.Body).Decode(&in)
		io.WriteString(w, `{"result": true}`)
	})
	e := newExternal(t, srv.URL, func(c *ExternalConfig) { c.CacheTTL = time.Minute })
	now := time.Unix(1000, 0)
	e.cache.now = func() time.Time { return now }

	for range 5 {
		if d := e.Decide(context.Background(), baseReq()); !d.Allowed {
			t.Fatal(d.Reason)
		}
	}
	if n := srv.calls.Load(); n != 1 {
		t.Fatalf("5 identical decisions made %d requests, want 1", n)
	}
	// Any field of the request is part of the key.
	e.Decide(context.Background(), baseReq(func(r *Request) { r.Requester.Labels = map[string]string{"app": "web"} }))
	e.Decide(context.Background(), baseReq(func(r *Request) { r.Operation = OpNodePublishVolume }))
	if n := srv.calls.Load(); n != 3 {
		t.Fatalf("requests %d, want 3", n)
	}
	// Expired entries are asked again.
	now = now.Add(time.Minute)
	e.Decide(context.Background(), baseReq())
	if n := srv.calls.Load(); n != 4 {
		t.Fatalf("after expiry: requests %d, want 4", n)
	}
}

func TestExternalCachesDeniesNotFailures(t *testing.T) {
	var status atomic.Int64
	status.Store(http.StatusInternalServerError)
	srv := newOPA(t, func(w http.ResponseWriter, r *http.Request) {
		if s := int(status.Load()); s != http.StatusOK {
			w.WriteHeader(s)
			return
		}
		io.WriteString(w, `{"result": false}`)
	})
	e := newExternal(t, srv.URL, func(c *ExternalConfig) { c.CacheTTL = time.Minute; c.MaxAttempts = 1 })
	e.Decide(context.Background(), baseReq())
	e.Decide(context.Background(), baseReq())
	if n := srv.calls.Load(); n != 2 {
		t.Fatalf("failures were cached: %d requests, want 2", n)
	}
	status.Store(http.StatusOK)
	e.Decide(context.Background(), baseReq())
	d := e.Decide(context.Background(), baseReq())
	if n := srv.calls.Load(); n != 3 || d.Allowed {
		t.Fatalf("deny not cached: %d requests, decision %+v", n, d)
	}
}

func TestDecisionCacheBounded(t *testing.T) {
	c := newDecisionCache(time.Minute, 3)
	for _, k := range []string{"a", "b", "c", "d", "e"} {
		c.put(k, answer{allowed: true})
	}
	if c.len() != 3 {
		t.Fatalf("len %d, want 3", c.len())
	}
	if _, ok := c.get("e"); !ok {
		t.Fatal("the newest entry was dropped")
	}
}

func TestExternalConfigValidate(t *testing.T) {
	for name, cfg := range map[string]ExternalConfig{
		"no URL":                    {Path: "p"},
		"bad scheme":                {URL: "ftp://h", Path: "p"},
		"no host":                   {URL: "http://", Path: "p"},
		"user info":                 {URL: "http://u:secret@h", Path: "p"},
		"user info, bad scheme":     {URL: "ftp://u:secret@h", Path: "p"},
		"user info read as a path":  {URL: "http//u:secret@h", Path: "p"},
		"user info read as opaque":  {URL: "http:u:secret@h", Path: "p"},
		"unparsable with user info": {URL: "http://u:secret@h\x7f", Path: "p"},
		"query":                     {URL: "http://h?token=secret", Path: "p"},
		"fragment":                  {URL: "http://h#secret", Path: "p"},
		"no path":                   {URL: "http://h"},
		"dot-dot path":              {URL: "http://h", Path: "a/../b"},
		"negative":                  {URL: "http://h", Path: "p", Timeout: -1},
		"negative tries":            {URL: "http://h", Path: "p", MaxAttempts: -1},
	} {
		if _, err := NewExternal(cfg); err == nil {
			t.Errorf("%s: accepted", name)
		} else if strings.Contains(err.Error(), "secret") {
			t.Errorf("%s: error leaks the URL's password, query or fragment: %v", name, err)
		}
	}
	if _, err := NewExternal(ExternalConfig{URL: "https://opa.example.com:8181", Path: "csibroker/allow"}); err != nil {
		t.Errorf("valid config: %v", err)
	}
}

func TestExternalRejectsMalformedRequestWithoutAsking(t *testing.T) {
	srv := newOPA(t, answer200(`{"result": true}`))
	d := newExternal(t, srv.URL).Decide(context.Background(), baseReq(func(r *Request) { r.Driver = "" }))
	if d.Allowed || d.Rule != RuleInvalidRequest || srv.calls.Load() != 0 {
		t.Fatalf("%+v, %d calls", d, srv.calls.Load())
	}
}

func TestAuthorizerCombination(t *testing.T) {
	allowSrv := newOPA(t, answer200(`{"result": true}`))
	denySrv := newOPA(t, answer200(`{"result": {"allow": false, "reason": "change freeze"}}`))
	allowExt, denyExt := newExternal(t, allowSrv.URL), newExternal(t, denySrv.URL)
	rules := func(mode Mode) *Store { return NewStore(mustCompile(t, []Grant{grant(testNS, "g")}, WithMode(mode))) }

	tests := []struct {
		name      string
		a         *Authorizer
		req       Request
		allowed   bool
		wouldDeny bool
		rule      string
		reason    string
		asked     *opa // must have been asked once, if set
		notAsked  *opa // must not have been asked, if set
	}{
		{name: "local deny is final; external not asked", a: &Authorizer{Rules: rules(ModeEnforce), External: allowExt},
			req: baseReq(func(r *Request) { r.Secret.Name = "x" }), rule: RuleDefaultDeny, notAsked: allowSrv},
		{name: "both allow", a: &Authorizer{Rules: rules(ModeEnforce), External: allowExt},
			req: baseReq(), allowed: true, rule: "store/g", reason: "external decision point allows too", asked: allowSrv},
		{name: "local allows, external denies", a: &Authorizer{Rules: rules(ModeEnforce), External: denyExt},
			req: baseReq(), rule: RuleExternal, reason: "grant store/g allows, but external decision point", asked: denySrv},
		{name: "audit: external deny is a would-deny", a: &Authorizer{Rules: rules(ModeAudit), External: denyExt},
			req: baseReq(), allowed: true, wouldDeny: true, rule: RuleExternal, reason: "change freeze", asked: denySrv},
		{name: "off: nobody asked", a: &Authorizer{Rules: rules(ModeOff), External: denyExt},
			req: baseReq(), allowed: true, rule: RuleModeOff, notAsked: denySrv},
		{name: "no external: local decides", a: &Authorizer{Rules: rules(ModeEnforce)},
			req: baseReq(), allowed: true, rule: "store/g"},
		{name: "nil rules: deny", a: &Authorizer{External: allowExt},
			req: baseReq(), rule: RuleDefaultDeny, notAsked: allowSrv},
		{name: "external only allows without grants", a: &Authorizer{External: allowExt, ExternalOnly: true},
			req: baseReq(func(r *Request) { r.Secret.Name = "x" }), allowed: true, rule: RuleExternal, asked: allowSrv},
		{name: "external only denies", a: &Authorizer{Rules: rules(ModeEnforce), External: denyExt, ExternalOnly: true},
			req: baseReq(), rule: RuleExternal, reason: "change freeze", asked: denySrv},
		{name: "external only without external denies", a: &Authorizer{Rules: rules(ModeEnforce), ExternalOnly: true},
			req: baseReq(), rule: RuleExternal, reason: "no external decision point is configured"},
		{name: "malformed request: nobody asked", a: &Authorizer{Rules: rules(ModeEnforce), External: allowExt, ExternalOnly: true},
			req: baseReq(func(r *Request) { r.Operation = "" }), rule: RuleInvalidRequest, notAsked: allowSrv},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before := map[*opa]int64{allowSrv: allowSrv.calls.Load(), denySrv: denySrv.calls.Load()}
			d := tc.a.Decide(context.Background(), tc.req)
			if d.Allowed != tc.allowed || d.WouldDeny != tc.wouldDeny || d.Rule != tc.rule {
				t.Fatalf("got allowed %v wouldDeny %v rule %q, want %v %v %q; reason: %s", d.Allowed, d.WouldDeny, d.Rule, tc.allowed, tc.wouldDeny, tc.rule, d.Reason)
			}
			if !strings.Contains(d.Reason, tc.reason) {
				t.Errorf("reason %q lacks %q", d.Reason, tc.reason)
			}
			if tc.asked != nil && tc.asked.calls.Load()-before[tc.asked] != 1 {
				t.Errorf("external point asked %d times, want 1", tc.asked.calls.Load()-before[tc.asked])
			}
			if tc.notAsked != nil && tc.notAsked.calls.Load() != before[tc.notAsked] {
				t.Errorf("external point asked")
			}
		})
	}
}
