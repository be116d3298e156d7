package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/base64"
	"flag"
	"fmt"
	"io"
	stdlog "log"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/budget"
	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/telemetry"
	"github.com/csibroker/csibroker/internal/testutil"
	"github.com/csibroker/csibroker/policy"
)

// The clients of built-in kinds send and ask for the encoding of
// --kube-api-content-type; an unknown encoding is refused by name.
func TestBuiltinClientEncoding(t *testing.T) {
	for _, tc := range []struct {
		contentType, wantAccept string
	}{
		{runtime.ContentTypeProtobuf, runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON},
		{runtime.ContentTypeJSON, runtime.ContentTypeJSON + ", */*"}, // client-go's default
	} {
		t.Run(tc.contentType, func(t *testing.T) {
			var mu sync.Mutex
			var gotType, gotAccept string
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				gotType, gotAccept = r.Header.Get("Content-Type"), r.Header.Get("Accept")
				mu.Unlock()
				http.Error(w, "refused by the test", http.StatusTeapot)
			}))
			defer srv.Close()
			f := &kubeFlags{ContentType: tc.contentType}
			c, err := f.builtinClient(&rest.Config{Host: srv.URL})
			if err != nil {
				t.Fatal(err)
			}
			_, err = c.CoreV1().ConfigMaps("ns").Create(context.Background(), &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "cm"}}, metav1.CreateOptions{})
			if err == nil {
				t.Fatal("create succeeded against a server that refuses every request")
			}
			mu.Lock()
			defer mu.Unlock()
			if gotType != tc.contentType {
				t.Errorf("Content-Type %q, want %q", gotType, tc.contentType)
			}
			if gotAccept != tc.wantAccept {
				t.Errorf("Accept %q, want %q", gotAccept, tc.wantAccept)
			}
		})
	}

	f := &kubeFlags{Mode: "off", PolicyMode: "enforce", QPS: 5, Burst: 10, Budget: budgetPerDriver, EventsQPS: 20, EventsBurst: 50,
		LeaseDuration: 3e9, RenewDeadline: 2e9, RetryPeriod: 5e8, WorkerThreads: 1, RetryIntervalStart: 1e9, RetryIntervalMax: 1e9,
		ContentType: "application/yaml", VolumeNameUUIDLength: -1, SnapshotNamePrefix: "snapshot", SnapshotUUIDLength: -1, GroupSnapshotPrefix: "groupsnapshot", GroupSnapshotUUIDLen: -1}
	err := f.validate()
	if err == nil || !strings.Contains(err.Error(), "--kube-api-content-type") {
		t.Errorf("validate of an unknown encoding: %v, want an error naming --kube-api-content-type", err)
	}
	f.ContentType = runtime.ContentTypeProtobuf
	if err := f.validate(); err != nil {
		t.Errorf("validate of the default encoding: %v", err)
	}
}

// TestClientGoNeverLogsSecrets: with --v=10, client-go's own logging (it
// logs response bodies from V(8)) goes through the broker's logger capped
// at V(7): a Secret read by the broker's client leaves no trace of its
// value in the log. The same read logged without the cap shows the value,
// so the test sees a leak when there is one.
func TestClientGoNeverLogsSecrets(t *testing.T) {
	const canary = "canary-0f3c9a7e-client-go"
	leaks := []string{canary, base64.StdEncoding.EncodeToString([]byte(canary))}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"kind":"Secret","apiVersion":"v1","metadata":{"name":"creds","namespace":"ns"},"data":{"password":%q}}`, leaks[1])
	}))
	defer srv.Close()
	defer klog.ClearLogger()
	read := func(log *slog.Logger) {
		t.Helper()
		klog.SetSlogLogger(log)
		f := &kubeFlags{ContentType: runtime.ContentTypeJSON}
		c, err := f.builtinClient(&rest.Config{Host: srv.URL})
		if err != nil {
			t.Fatal(err)
		}
		s, err := c.CoreV1().Secrets("ns").Get(context.Background(), "creds", metav1.GetOptions{})
		if err != nil || string(s.Data["password"]) != canary {
			t.Fatalf("secret read: %v, %v", s, err)
		}
	}
	var uncapped, capped testutil.SyncBuffer
	read(telemetry.NewLogger(&uncapped, 10, false))
	if !strings.Contains(uncapped.String(), leaks[1]) {
		t.Fatalf("client-go did not log the response body at V(10) without the cap; this test cannot see a leak:\n%s", uncapped.String())
	}
	read(clientGoLogger(telemetry.NewLogger(&capped, 10, false)))
	for _, leak := range leaks {
		if strings.Contains(capped.String(), leak) {
			t.Fatalf("the secret's value is in the broker's log:\n%s", capped.String())
		}
	}
}

// TestBrokerFlagsRefusedTogether: flag values that would let the broker
// start and then misbehave (no drivers, a panic, claims sharing a volume
// name) are refused at start, each naming its flag.
func TestBrokerFlagsRefusedTogether(t *testing.T) {
	base := func() BrokerCommandConfig {
		var c BrokerCommandConfig
		fs := flag.NewFlagSet("broker", flag.ContinueOnError)
		c.TLS.Register(fs)
		c.Log.Register(fs)
		c.Kube.register(fs)
		c.RegistryFile, c.MetricsPath, c.Timeout, c.RetryAttempts, c.RetryStart, c.RetryMax = "r.yaml", "/metrics", time.Second, 1, time.Millisecond, time.Second
		c.TLS.Cert, c.TLS.Key, c.TLS.CA = "c", "k", "ca"
		c.Kube.Mode = "off"
		return c
	}
	if c := base(); c.Validate() != nil {
		t.Fatalf("the base configuration is refused: %v", c.Validate())
	}
	for _, tc := range []struct {
		name, want string
		mut        func(*BrokerCommandConfig)
	}{
		{"discovery without Kubernetes", "--discover-proxies", func(c *BrokerCommandConfig) { c.RegistryFile, c.Kube.DiscoverProxies = "", "app=proxy" }},
		{"policy file never re-read", "--policy-reload-interval", func(c *BrokerCommandConfig) { c.Kube.PolicyFile, c.Kube.PolicyInterval = "p.yaml", 0 }},
		{"OPA CA file without its URL", "--policy-opa-ca-file is for the external decision point", func(c *BrokerCommandConfig) { c.Kube.PolicyCAFile = "ca.pem" }},
		{"OPA token file without its URL", "--policy-opa-token-file is for the external decision point", func(c *BrokerCommandConfig) { c.Kube.PolicyToken = "t" }},
		{"OPA CA file for plain http", "--policy-opa-ca-file is for an https://", func(c *BrokerCommandConfig) {
			c.Kube.PolicyURL, c.Kube.PolicyCAFile = "http://127.0.0.1:8181", "ca.pem"
		}},
		{"short volume name UID", "--volume-name-uuid-length", func(c *BrokerCommandConfig) { c.Kube.VolumeNameUUIDLength = 4 }},
		{"short snapshot name UID", "--snapshot-name-uuid-length", func(c *BrokerCommandConfig) { c.Kube.SnapshotUUIDLength = 4 }},
		{"no snapshot name prefix", "--snapshot-name-prefix", func(c *BrokerCommandConfig) { c.Kube.SnapshotNamePrefix = "" }},
		{"short group snapshot name UID", "--groupsnapshot-name-uuid-length", func(c *BrokerCommandConfig) { c.Kube.GroupSnapshotUUIDLen = 4 }},
		{"no group snapshot name prefix", "--groupsnapshot-name-prefix", func(c *BrokerCommandConfig) { c.Kube.GroupSnapshotPrefix = "" }},
		{"metrics path without slash", "--metrics-path", func(c *BrokerCommandConfig) { c.MetricsPath = "metrics" }},
		{"metrics path on the health endpoint", "--metrics-path", func(c *BrokerCommandConfig) { c.MetricsPath = "/readyz" }},
		{"metrics path that ServeMux panics on", "--metrics-path", func(c *BrokerCommandConfig) { c.MetricsPath = "/metrics{" }},
		{"no workers", "--worker-threads", func(c *BrokerCommandConfig) { c.Kube.WorkerThreads = 0 }},
		{"negative per-driver workers", "--per-driver-workers", func(c *BrokerCommandConfig) { c.Kube.PerDriverWorkers = -1 }},
		{"backoff start above its max", "--retry-interval-start", func(c *BrokerCommandConfig) { c.Kube.RetryIntervalStart = time.Hour }},
		{"no backoff", "--retry-interval-start", func(c *BrokerCommandConfig) { c.Kube.RetryIntervalStart = 0 }},
		{"renew deadline within client-go's jitter of the retry period", "--leader-election-retry-period", func(c *BrokerCommandConfig) { c.Kube.RetryPeriod = 2500 * time.Millisecond }},
		{"per-driver leader election without leader election", "--leader-election-mode per-driver needs --leader-election", func(c *BrokerCommandConfig) { c.Kube.LeaderElectionMode = "per-driver" }},
		{"unknown leader election mode", `--leader-election-mode "sharded": want single or per-driver`, func(c *BrokerCommandConfig) { c.Kube.LeaderElectionMode = "sharded" }},
		{"no retry period", "--leader-election-retry-period", func(c *BrokerCommandConfig) { c.Kube.RetryPeriod = 0 }},
		{"lease duration the Lease cannot record", "--leader-election-lease-duration 3.5s: must be whole seconds", func(c *BrokerCommandConfig) { c.Kube.LeaseDuration = 3500 * time.Millisecond }},
		{"lease duration under a second", "--leader-election-lease-duration 800ms: must be whole seconds", func(c *BrokerCommandConfig) {
			c.Kube.LeaseDuration, c.Kube.RenewDeadline, c.Kube.RetryPeriod = 800*time.Millisecond, 600*time.Millisecond, 100*time.Millisecond
		}},
		{"discovery selector that does not parse", "--discover-proxies", func(c *BrokerCommandConfig) { c.Kube.Mode, c.Kube.DiscoverProxies = "on", "app in (a" }},
		{"Kubernetes flags with Kubernetes off", "--leader-election, --policy-file: Kubernetes flags, but Kubernetes is off here (--kubernetes off)", func(c *BrokerCommandConfig) {
			c.Kube.given = []string{"--leader-election", "--policy-file"}
		}},
		{"Kubernetes flags with no cluster found", "--kubernetes auto, no --kubeconfig, not in a pod", func(c *BrokerCommandConfig) {
			t.Setenv("KUBERNETES_SERVICE_HOST", "")
			c.Kube.Mode, c.Kube.given = "auto", []string{"--worker-threads"}
		}},
	} {
		c := base()
		tc.mut(&c)
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error naming %s", tc.name, err, tc.want)
		}
	}
}

// TestRetryFlagsFillPartialRegistryEntries: a registry entry's retry block
// that sets some fields takes the others from the --csi-retry-* flags.
func TestRetryFlagsFillPartialRegistryEntries(t *testing.T) {
	cfg := &BrokerCommandConfig{RetryAttempts: 1, RetryStart: time.Second, RetryMax: 5 * time.Second}
	for _, tc := range []struct {
		in, want broker.RetryConfig
	}{
		{broker.RetryConfig{}, broker.RetryConfig{MaxAttempts: 1, IntervalStart: time.Second, IntervalMax: 5 * time.Second}},
		{broker.RetryConfig{IntervalMax: 10 * time.Second}, broker.RetryConfig{MaxAttempts: 1, IntervalStart: time.Second, IntervalMax: 10 * time.Second}},
		{broker.RetryConfig{MaxAttempts: 6}, broker.RetryConfig{MaxAttempts: 6, IntervalStart: time.Second, IntervalMax: 5 * time.Second}},
		// One interval set, on the other side of the flag's: the other
		// follows it, so the entry is not refused for what it did not say.
		{broker.RetryConfig{IntervalMax: 50 * time.Millisecond}, broker.RetryConfig{MaxAttempts: 1, IntervalStart: 50 * time.Millisecond, IntervalMax: 50 * time.Millisecond}},
		{broker.RetryConfig{IntervalStart: 8 * time.Second}, broker.RetryConfig{MaxAttempts: 1, IntervalStart: 8 * time.Second, IntervalMax: 8 * time.Second}},
	} {
		got := cfg.fillRetry(tc.in)
		if got != tc.want {
			t.Errorf("registry %+v with the flags: %+v, want %+v", tc.in, got, tc.want)
		}
		if err := (broker.DriverConfig{Name: "d", Controller: &broker.ProxyConfig{Address: "x:1"}, Retry: got}).Validate(); err != nil {
			t.Errorf("registry %+v filled from the flags is refused: %v", tc.in, err)
		}
	}
}

// TestPolicyOPAOverTLSWithBearerToken: with --policy-opa-ca-file and
// --policy-opa-token-file the broker asks an https decision point behind a
// private CA, sending the token from the file; without the CA file the
// same server is not trusted, and a wrong token is refused by the server;
// each failure denies (fail closed) with a reason saying why. The token is
// a canary: it appears in no log line (debug level) and no reason.
func TestPolicyOPAOverTLSWithBearerToken(t *testing.T) {
	const canary = "opa-token-canary-5e1b9c"
	now := time.Now()
	ca, err := mtls.NewCA("opa test CA", now.Add(-time.Hour), now.Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	certPEM, keyPEM, err := ca.Issue(mtls.Leaf{IPs: []net.IP{net.IPv4(127, 0, 0, 1)}, NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	var asked atomic.Int64
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		asked.Add(1)
		w.Header().Set("Content-Type", "application/json")
		if r.Header.Get("Authorization") != "Bearer "+canary {
			w.WriteHeader(http.StatusUnauthorized)
			io.WriteString(w, `{"code": "unauthorized", "message": "authentication failed"}`)
			return
		}
		io.WriteString(w, `{"result": true}`)
	}))
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{cert}}
	srv.Config.ErrorLog = stdlog.New(io.Discard, "", 0) // the untrusting client's handshake
	srv.StartTLS()
	defer srv.Close()

	dir := t.TempDir()
	caFile, tokenFile, wrongToken := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "token"), filepath.Join(dir, "wrong")
	for f, data := range map[string]string{caFile: string(ca.CertPEM), tokenFile: canary + "\n", wrongToken: "not-the-token"} {
		if err := os.WriteFile(f, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	req := policy.Request{Driver: "opa.csi.test", Operation: policy.OpCreateVolume, Secret: policy.SecretRef{Namespace: "ns", Name: "creds"}}
	decide := func(caPath, token string) policy.Decision {
		t.Helper()
		var f kubeFlags
		f.register(flag.NewFlagSet("broker", flag.ContinueOnError))
		f.Mode, f.PolicyURL, f.PolicyCAFile, f.PolicyToken = "off", srv.URL, caPath, token
		if err := f.validate(); err != nil {
			t.Fatalf("flags refused: %v", err)
		}
		a, _, err := f.authorizer(log)
		if err != nil {
			t.Fatal(err)
		}
		if (caPath != "") != (f.policyCA != nil) {
			t.Fatalf("CA file %q, reloaded bundle %v", caPath, f.policyCA)
		}
		d := a.External.Decide(context.Background(), req)
		if strings.Contains(d.Reason, canary) {
			t.Errorf("the token is in the decision's reason: %s", d.Reason)
		}
		return d
	}

	if d := decide(caFile, tokenFile); !d.Allowed {
		t.Fatalf("CA file and token: denied: %s", d.Reason)
	}
	if d := decide("", tokenFile); d.Allowed || !strings.Contains(d.Reason, "certificate signed by unknown authority") {
		t.Errorf("no CA file (system roots): allowed %v, reason %q; want a denial saying the certificate is not trusted", d.Allowed, d.Reason)
	}
	before := asked.Load()
	if d := decide(caFile, wrongToken); d.Allowed || !strings.Contains(d.Reason, "HTTP 401") {
		t.Errorf("wrong token: allowed %v, reason %q; want a denial saying HTTP 401", d.Allowed, d.Reason)
	}
	if asked.Load() == before {
		t.Error("the wrong token never reached the server")
	}
	if d := decide(caFile, ""); d.Allowed {
		t.Error("no token: allowed")
	}
	if _, _, err := (&kubeFlags{PolicyMode: "enforce", PolicyURL: srv.URL, PolicyToken: filepath.Join(dir, "missing")}).authorizer(log); err == nil ||
		!strings.Contains(err.Error(), "--policy-opa-token-file") {
		t.Errorf("missing token file: %v, want an error naming --policy-opa-token-file", err)
	}
	if strings.Contains(logs.String(), canary) {
		t.Errorf("the token is in the log:\n%s", logs.String())
	}
}

// TestPolicyOPAURLCredentialsNeverPrinted: a --policy-opa-url carrying a
// password (user info) or a token (query, fragment, or a path that is
// really user info) is refused at start naming the flag, and neither the
// error nor anything written says the credential. The URL is said, where
// it is, as scheme://host/path; the warning about a token over plain http
// says it so too.
func TestPolicyOPAURLCredentialsNeverPrinted(t *testing.T) {
	canaries := []string{"hunter2", "S3CRET"}
	leaked := func(s string) string {
		for _, c := range canaries {
			if strings.Contains(s, c) {
				return c
			}
		}
		return ""
	}
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte("opa-token\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		url   string
		extra []string
	}{
		{"password, with a CA file", "http://admin:hunter2@opa:8181", []string{"--policy-opa-ca-file", "ca.crt"}},
		{"password", "https://admin:hunter2@opa:8181", nil},
		{"token in the query, with a token file", "http://opa.example:8181/?token=S3CRET", []string{"--policy-opa-token-file", tokenFile}},
		{"token in the query, with a CA file", "http://opa:8181?token=S3CRET", []string{"--policy-opa-ca-file", "ca.crt"}},
		{"token in the fragment", "https://opa:8181/#S3CRET", nil},
		{"both", "https://admin:hunter2@opa:8181/v?token=S3CRET", []string{"--policy-opa-ca-file", "ca.crt"}},
		{"another scheme", "ftp://admin:hunter2@opa/?token=S3CRET", nil},
		{"no scheme: user info read as a path", "http//admin:hunter2@opa:8181", nil},
		{"no host: user info read as opaque", "http:admin:hunter2@opa:8181", nil},
		{"does not parse", "http://admin:hunter2@opa:8181/%zz?token=S3CRET", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			args := append([]string{"broker", "--kubernetes", "on", "--driver-registry", filepath.Join(dir, "none.yaml"),
				"--tls-cert", "c", "--tls-key", "k", "--tls-ca", "ca", "--policy-opa-url", tc.url}, tc.extra...)
			err := run(context.Background(), args, &stdout, &stderr)
			if err == nil || !strings.Contains(err.Error(), "--policy-opa-url") {
				t.Fatalf("broker --policy-opa-url %s: %v, want it refused naming --policy-opa-url", tc.url, err)
			}
			for what, s := range map[string]string{"error": err.Error(), "stdout": stdout.String(), "stderr": stderr.String()} {
				if c := leaked(s); c != "" {
					t.Errorf("%s says %q: %s", what, c, s)
				}
			}
		})
	}

	// Past the flags' check, the policy's own code reports the URL:
	// its warning and its start line say scheme://host/path only.
	var logs testutil.SyncBuffer
	log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	f := &kubeFlags{PolicyMode: "enforce", PolicyPath: "csibroker/allow", PolicyToken: tokenFile,
		PolicyURL: "http://admin:hunter2@opa.example:8181/base?token=S3CRET"}
	if _, err := f.policyHTTPClient(log); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs.String(), "plain http") || !strings.Contains(logs.String(), "url=http://opa.example:8181/base") {
		t.Errorf("no warning naming http://opa.example:8181/base about the token over plain http:\n%s", logs.String())
	}
	if _, _, err := f.authorizer(log); err == nil || leaked(err.Error()) != "" {
		t.Errorf("authorizer with a password and a token in the URL: %v, want it refused without saying them", err)
	}
	f.PolicyURL = "http://opa.example:8181/base"
	if _, _, err := f.authorizer(log); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs.String(), "external=http://opa.example:8181/base") {
		t.Errorf("the start line does not name the decision point:\n%s", logs.String())
	}
	if c := leaked(logs.String()); c != "" {
		t.Errorf("the log says %q:\n%s", c, logs.String())
	}
}

// TestBudgetFollowsTheDrivers: by default the objects' budget is
// --kube-api-qps/-burst per registered driver (N sidecars' worth for N
// drivers); --kube-api-budget=fixed keeps it as given.
func TestBudgetFollowsTheDrivers(t *testing.T) {
	for _, c := range []struct {
		mode    string
		drivers int
		want    budget.Size
	}{
		{budgetPerDriver, 0, budget.Size{QPS: 5, Burst: 10}},
		{budgetPerDriver, 1, budget.Size{QPS: 5, Burst: 10}},
		{budgetPerDriver, 5, budget.Size{QPS: 25, Burst: 50}},
		{budgetPerDriver, 20, budget.Size{QPS: 100, Burst: 200}},
		{budgetFixed, 20, budget.Size{QPS: 5, Burst: 10}},
	} {
		f := &kubeFlags{QPS: 5, Burst: 10, Budget: c.mode}
		if got := f.budgetSize(c.drivers); got != c.want {
			t.Errorf("%s with %d drivers: %v, want %v", c.mode, c.drivers, got, c.want)
		}
	}
}

// TestBudgetFollowsTheLedDrivers: the objects' budget is resized to the
// drivers this replica leads as they change (a driver taken over, one
// handed on).
func TestBudgetFollowsTheLedDrivers(t *testing.T) {
	f := &kubeFlags{QPS: 5, Burst: 10, Budget: budgetPerDriver}
	f.budget = budget.New(f.budgetSize(3), []string{"a", "b", "c"})
	var mu sync.Mutex
	led := []string{"a"}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		f.followDrivers(ctx, func() []string { mu.Lock(); defer mu.Unlock(); return append([]string(nil), led...) }, slog.New(slog.DiscardHandler))
	}()
	defer func() { cancel(); <-done }()
	wait := func(want float32) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); f.budget.QPS() != want; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("budget QPS %v, want %v", f.budget.QPS(), want)
			}
		}
	}
	mu.Lock()
	led = []string{"a", "b"}
	mu.Unlock()
	wait(10)
	mu.Lock()
	led = []string{"b"}
	mu.Unlock()
	wait(5)
}
