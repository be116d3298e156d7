package testenv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"
)

// JaegerVersion is the Jaeger all-in-one hack/jaeger.sh builds.
const JaegerVersion = "v1.76.0"

// JaegerEnv names the environment variable that overrides the path of the
// jaeger binary.
const JaegerEnv = "CSIBROKER_JAEGER"

// DefaultJaegerPath is where hack/jaeger.sh puts the binary:
// ${CSIBROKER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/csibroker}/jaeger/jaeger-<v>/jaeger.
func DefaultJaegerPath() string {
	// DefaultBinDir is <root>/control-plane/<versions>/bin.
	root := filepath.Dir(filepath.Dir(filepath.Dir(DefaultBinDir())))
	return filepath.Join(root, "jaeger", "jaeger-"+JaegerVersion, "jaeger")
}

// JaegerPath is the jaeger binary StartJaeger runs: $CSIBROKER_JAEGER, else
// DefaultJaegerPath.
func JaegerPath() string {
	if p := os.Getenv(JaegerEnv); p != "" {
		return p
	}
	return DefaultJaegerPath()
}

// JaegerBuilt reports whether the jaeger binary is there (the demo uses
// Jaeger only then).
func JaegerBuilt() bool { return isExecutable(JaegerPath()) }

func isExecutable(path string) bool {
	st, err := os.Stat(path)
	return err == nil && !st.IsDir() && st.Mode()&0o111 != 0
}

// JaegerOptions says how to run Jaeger.
type JaegerOptions struct {
	// Binary is the jaeger binary (default JaegerPath()).
	Binary string
	// StartTimeout bounds the start (default 30s).
	StartTimeout time.Duration
	// Logf receives progress lines (default: standard error).
	Logf func(format string, args ...any)
}

// Jaeger is a running Jaeger all-in-one: the OTLP receivers in, in-memory
// storage, the query API out (the module has no web UI). Its methods are
// safe for concurrent use.
type Jaeger struct {
	// OTLPGRPC and OTLPHTTP are the OTLP receivers' host:port on 127.0.0.1.
	OTLPGRPC, OTLPHTTP string
	// QueryURL is the query API's base URL, http://127.0.0.1:<port>
	// (/api/services, /api/traces?service=..., /api/traces/<id>), which a
	// Jaeger UI or Grafana's Jaeger data source can be pointed at.
	QueryURL string
	// Dir holds the configuration and jaeger.log. Removed by Stop unless
	// $CSIBROKER_TESTENV_KEEP is set.
	Dir string

	opts     JaegerOptions
	c        *component
	stopOnce sync.Once
}

// NewJaeger starts Jaeger for one test and stops it at the test's cleanup,
// failing the test (never skipping it) when the binary is missing or it
// cannot start.
func NewJaeger(t testing.TB) *Jaeger {
	t.Helper()
	j, err := StartJaeger(context.Background(), JaegerOptions{Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("testenv: jaeger.log at the failure (last 30 lines):\n%s", j.c.tail(30))
		}
		j.Stop()
	})
	return j
}

// StartJaeger starts Jaeger all-in-one on free loopback ports and returns
// when its query API answers and its OTLP receivers accept connections.
func StartJaeger(ctx context.Context, opts JaegerOptions) (*Jaeger, error) {
	if opts.Binary == "" {
		opts.Binary = JaegerPath()
	}
	if opts.StartTimeout == 0 {
		opts.StartTimeout = 30 * time.Second
	}
	if opts.Logf == nil {
		opts.Logf = func(format string, args ...any) { fmt.Fprintf(os.Stderr, format+"\n", args...) }
	}
	if !isExecutable(opts.Binary) {
		return nil, fmt.Errorf("testenv: jaeger not found at %s: run `make test` (or hack/jaeger.sh build) to build Jaeger %s "+
			"(about 6 minutes the first time on 2 cores, cached after), or set %s to a jaeger binary", opts.Binary, JaegerVersion, JaegerEnv)
	}
	sweepStaleDirs()
	ctx, cancel := context.WithTimeout(ctx, opts.StartTimeout)
	defer cancel()
	for attempt := 1; ; attempt++ {
		j, err := startJaeger(ctx, opts)
		if err == nil {
			return j, nil
		}
		if attempt < 3 && errors.Is(err, errPortTaken) && ctx.Err() == nil {
			opts.Logf("testenv: jaeger: %v; retrying with other ports", errPortTaken)
			continue
		}
		return nil, err
	}
}

// jaegerConfig is Jaeger v2's configuration (an OpenTelemetry Collector
// configuration; v1.76.0's binary takes no flags for these): the built-in
// all-in-one configuration cut down to OTLP in, memory storage and the
// query API, every endpoint on loopback, and none of its own telemetry
// (its metrics would take the fixed port 8888, and the query API traces
// itself by default, to localhost:4317).
const jaegerConfig = `service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    traces:
      level: none
    logs:
      level: warn
extensions:
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 100000
  jaeger_query:
    storage:
      traces: memstore
    enable_tracing: false
    http:
      endpoint: 127.0.0.1:%d
    grpc:
      endpoint: 127.0.0.1:%d
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: 127.0.0.1:%d
      http:
        endpoint: 127.0.0.1:%d
processors:
  batch:
    timeout: 100ms
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
`

func startJaeger(ctx context.Context, opts JaegerOptions) (_ *Jaeger, err error) {
	dir, err := os.MkdirTemp("", dirPrefix+"jaeger-")
	if err != nil {
		return nil, fmt.Errorf("testenv: %w", err)
	}
	registerDir(dir)
	j := &Jaeger{Dir: dir, opts: opts}
	defer func() {
		if err != nil {
			if j.c != nil {
				err = fmt.Errorf("testenv: jaeger: %w\n----- jaeger.log (last 40 lines) -----\n%s", err, j.c.tail(40))
			} else {
				err = fmt.Errorf("testenv: jaeger: %w", err)
			}
			j.stop()
		}
	}()
	if err := os.WriteFile(filepath.Join(dir, ownerPIDFile), []byte(strconv.Itoa(os.Getpid())), 0o600); err != nil {
		return nil, err
	}
	ports, err := freePorts(4)
	if err != nil {
		return nil, err
	}
	queryHTTP, queryGRPC, otlpGRPC, otlpHTTP := ports[0], ports[1], ports[2], ports[3]
	cfg := filepath.Join(dir, "jaeger.yaml")
	if err := os.WriteFile(cfg, fmt.Appendf(nil, jaegerConfig, queryHTTP, queryGRPC, otlpGRPC, otlpHTTP), 0o600); err != nil {
		return nil, err
	}
	j.OTLPGRPC = fmt.Sprintf("127.0.0.1:%d", otlpGRPC)
	j.OTLPHTTP = fmt.Sprintf("127.0.0.1:%d", otlpHTTP)
	j.QueryURL = fmt.Sprintf("http://127.0.0.1:%d", queryHTTP)

	t0 := time.Now()
	c, err := startComponent(dir, "jaeger", opts.Binary, []string{"--config=" + cfg})
	if err != nil {
		return nil, err
	}
	j.c = c
	if err := waitReady(ctx, c, j.QueryURL+"/api/services", nil); err != nil {
		return nil, err
	}
	for _, addr := range []string{j.OTLPGRPC, j.OTLPHTTP} {
		if err := waitListening(ctx, c, addr); err != nil {
			return nil, err
		}
	}
	opts.Logf("testenv: jaeger %s ready in %s (OTLP gRPC %s, OTLP HTTP %s, query API %s)", JaegerVersion, since(t0), j.OTLPGRPC, j.OTLPHTTP, j.QueryURL)
	return j, nil
}

// waitListening waits until addr accepts TCP connections.
func waitListening(ctx context.Context, c *component, addr string) error {
	var d net.Dialer
	for {
		if done, werr := c.exited(); done {
			if portTaken(c) {
				return fmt.Errorf("%s: %w", c.name, errPortTaken)
			}
			return fmt.Errorf("%s exited before it was ready: %w", c.name, werr)
		}
		conn, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			conn.Close()
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s not listening on %s: %w", c.name, addr, err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// OTLPEnv is the standard OpenTelemetry environment that makes a process
// export its spans to this Jaeger as service, over OTLP with protocol
// ("grpc" or "http/protobuf"), every span sampled, batches sent every
// 100ms.
func (j *Jaeger) OTLPEnv(service, protocol string) []string {
	endpoint := "http://" + j.OTLPHTTP
	if protocol == "grpc" {
		endpoint = "http://" + j.OTLPGRPC
	}
	return []string{
		"OTEL_SERVICE_NAME=" + service,
		"OTEL_TRACES_EXPORTER=otlp",
		"OTEL_EXPORTER_OTLP_PROTOCOL=" + protocol,
		"OTEL_EXPORTER_OTLP_ENDPOINT=" + endpoint,
		"OTEL_TRACES_SAMPLER=parentbased_always_on",
		"OTEL_BSP_SCHEDULE_DELAY=100",
	}
}

// Stop stops Jaeger (SIGTERM to its process group, SIGKILL after a grace
// period) and removes its directory. It is idempotent.
func (j *Jaeger) Stop() { j.stopOnce.Do(j.stop) }

func (j *Jaeger) stop() {
	if j.c != nil {
		j.c.stop(5 * time.Second)
	}
	defer unregisterDir(j.Dir)
	if os.Getenv(KeepEnv) == "" {
		_ = os.RemoveAll(j.Dir)
	}
}

// PID is the jaeger process's ID.
func (j *Jaeger) PID() int { return j.c.cmd.Process.Pid }

// LogTail returns the last n lines of jaeger.log.
func (j *Jaeger) LogTail(n int) string { return j.c.tail(n) }

// JaegerTrace is a trace as Jaeger's query API returns it.
type JaegerTrace struct {
	TraceID   string                   `json:"traceID"`
	Spans     []JaegerSpan             `json:"spans"`
	Processes map[string]JaegerProcess `json:"processes"`
}

// JaegerSpan is one span of a JaegerTrace. StartTime and Duration are in
// microseconds.
type JaegerSpan struct {
	TraceID       string            `json:"traceID"`
	SpanID        string            `json:"spanID"`
	OperationName string            `json:"operationName"`
	References    []JaegerReference `json:"references"`
	StartTime     int64             `json:"startTime"`
	Duration      int64             `json:"duration"`
	Tags          []JaegerKeyValue  `json:"tags"`
	Logs          []struct {
		Timestamp int64            `json:"timestamp"`
		Fields    []JaegerKeyValue `json:"fields"`
	} `json:"logs"`
	ProcessID string `json:"processID"`
}

// JaegerReference is a span's parent (refType CHILD_OF) or link.
type JaegerReference struct {
	RefType string `json:"refType"`
	TraceID string `json:"traceID"`
	SpanID  string `json:"spanID"`
}

// JaegerKeyValue is a tag (attribute) or a log field.
type JaegerKeyValue struct {
	Key   string `json:"key"`
	Type  string `json:"type"`
	Value any    `json:"value"`
}

// JaegerProcess is the resource that made a span: its service name and
// resource attributes.
type JaegerProcess struct {
	ServiceName string           `json:"serviceName"`
	Tags        []JaegerKeyValue `json:"tags"`
}

// Tag returns the value of the span's tag key as a string, and whether
// the span has it.
func (s JaegerSpan) Tag(key string) (string, bool) {
	for _, kv := range s.Tags {
		if kv.Key == key {
			return fmt.Sprint(kv.Value), true
		}
	}
	return "", false
}

// Parent is the span ID of the span's parent ("" for a root).
func (s JaegerSpan) Parent() string {
	for _, r := range s.References {
		if r.RefType == "CHILD_OF" {
			return r.SpanID
		}
	}
	return ""
}

// Service is the name of the service that made s.
func (t JaegerTrace) Service(s JaegerSpan) string { return t.Processes[s.ProcessID].ServiceName }

type jaegerResponse struct {
	Data   []JaegerTrace `json:"data"`
	Errors []struct {
		Code int    `json:"code"`
		Msg  string `json:"msg"`
	} `json:"errors"`
}

// Trace reads one trace by its hex ID. A trace Jaeger does not have (yet)
// is an error wrapping ErrTraceNotFound.
func (j *Jaeger) Trace(ctx context.Context, traceID string) (JaegerTrace, error) {
	traces, err := j.get(ctx, "/api/traces/"+url.PathEscape(traceID))
	if err != nil {
		return JaegerTrace{}, err
	}
	if len(traces) != 1 {
		return JaegerTrace{}, fmt.Errorf("trace %s: %d traces in the answer, want 1", traceID, len(traces))
	}
	return traces[0], nil
}

// ErrTraceNotFound is the query API's 404 for a trace.
var ErrTraceNotFound = errors.New("trace not found")

// Traces searches the traces of service (the query API's
// /api/traces?service=...&limit=...; extra query parameters, such as
// operation or tags, are added).
func (j *Jaeger) Traces(ctx context.Context, service string, extra url.Values) ([]JaegerTrace, error) {
	q := url.Values{"service": {service}, "limit": {"100"}, "lookback": {"1h"}}
	for k, v := range extra {
		q[k] = v
	}
	return j.get(ctx, "/api/traces?"+q.Encode())
}

// Services lists the services Jaeger has spans of.
func (j *Jaeger) Services(ctx context.Context) ([]string, error) {
	var out struct {
		Data []string `json:"data"`
	}
	if err := j.getJSON(ctx, "/api/services", &out); err != nil {
		return nil, err
	}
	return out.Data, nil
}

func (j *Jaeger) get(ctx context.Context, path string) ([]JaegerTrace, error) {
	var out jaegerResponse
	if err := j.getJSON(ctx, path, &out); err != nil {
		return nil, err
	}
	if len(out.Errors) > 0 {
		if out.Errors[0].Code == http.StatusNotFound {
			return nil, fmt.Errorf("%s: %w", path, ErrTraceNotFound)
		}
		return nil, fmt.Errorf("%s: %d: %s", path, out.Errors[0].Code, out.Errors[0].Msg)
	}
	return out.Data, nil
}

var jaegerClient = &http.Client{Timeout: 10 * time.Second}

func (j *Jaeger) getJSON(ctx context.Context, path string, v any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, j.QueryURL+path, nil)
	if err != nil {
		return err
	}
	resp, err := jaegerClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return err
	}
	if resp.StatusCode == http.StatusNotFound {
		return fmt.Errorf("%s: %w", path, ErrTraceNotFound)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s: %.300s", path, resp.Status, body)
	}
	if err := json.Unmarshal(body, v); err != nil {
		return fmt.Errorf("GET %s: %w", path, err)
	}
	return nil
}
