package proxy

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/rawgrpc"
	"github.com/csibroker/csibroker/internal/testutil"
	proxyinfov1 "github.com/csibroker/csibroker/proto/proxyinfo/v1"
)

const trustDomain = "test"

// rawDriver is a driver of raw frames: /csi.t.T/Echo answers each message
// with itself and its metadata (as "got-<key>" headers);
// /csi.t.T/Slow holds each call for 20 ms and counts the calls it holds
// at once; everything else is Unimplemented.
type rawDriver struct {
	active, peak atomic.Int32
}

func (d *rawDriver) handle(_ any, ss grpc.ServerStream) error {
	method, _ := grpc.MethodFromServerStream(ss)
	switch method {
	case "/csi.t.T/Echo":
		md, _ := metadata.FromIncomingContext(ss.Context())
		hd := metadata.MD{}
		for k, v := range md {
			if !strings.HasPrefix(k, ":") {
				hd["got-"+k] = v
			}
		}
		if err := ss.SendHeader(hd); err != nil {
			return err
		}
		for {
			var f rawgrpc.Frame
			if err := ss.RecvMsg(&f); err != nil {
				if errors.Is(err, io.EOF) {
					return nil
				}
				return err
			}
			if err := ss.SendMsg(&f); err != nil {
				return err
			}
		}
	case "/csi.t.T/Slow":
		n := d.active.Add(1)
		defer d.active.Add(-1)
		for p := d.peak.Load(); n > p && !d.peak.CompareAndSwap(p, n); p = d.peak.Load() {
		}
		var f rawgrpc.Frame
		if err := ss.RecvMsg(&f); err != nil {
			return err
		}
		time.Sleep(20 * time.Millisecond)
		return ss.SendMsg(&f)
	}
	return status.Errorf(codes.Unimplemented, "raw driver: %s", method)
}

// startRawDriver serves a rawDriver and returns its endpoint.
func startRawDriver(t testing.TB) (*rawDriver, string) {
	t.Helper()
	sock := filepath.Join(testutil.ShortTempDir(t), "d.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	d := &rawDriver{}
	srv := grpc.NewServer(grpc.ForceServerCodecV2(rawgrpc.Codec{}), grpc.UnknownServiceHandler(d.handle))
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	return d, "unix://" + sock
}

// testProxy is a running proxy and a broker's connection to it.
type testProxy struct {
	p     *Proxy
	conn  *grpc.ClientConn
	reg   *prometheus.Registry
	spans *tracetest.SpanRecorder
	logs  *testutil.SyncBuffer
	ca    *mtls.CA
	addr  string
}

// startProxy serves a proxy in front of endpoint (cfg's other fields as
// given, TLS and telemetry filled here) and dials it as the broker.
func startProxy(t testing.TB, endpoint string, cfg Config) *testProxy {
	t.Helper()
	now := time.Now()
	ca, err := mtls.NewCA("proxy test CA", now.Add(-time.Hour), now.Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	issue := func(id string) *mtls.Material {
		m, err := ca.IssueMaterial(mtls.Leaf{ID: id, NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	tp := &testProxy{reg: prometheus.NewRegistry(), spans: tracetest.NewSpanRecorder(), logs: &testutil.SyncBuffer{}, ca: ca}
	cfg.DriverEndpoint = endpoint
	cfg.TLS = mtls.ServerConfig(mtls.StaticSource{M: issue(mtls.DriverID(trustDomain, "d"))}, mtls.AuthorizeOneOf(mtls.BrokerID(trustDomain)))
	cfg.Logger = slog.New(slog.NewTextHandler(tp.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	cfg.TracerProvider = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(tp.spans))
	cfg.Propagator = propagation.TraceContext{}
	cfg.Registerer, cfg.Gatherer = tp.reg, tp.reg
	cfg.Version = "test"
	tp.p, err = New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tp.addr = lis.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- tp.p.Serve(ctx, lis) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
		tp.p.Close()
	})
	tp.conn = tp.dial(t, issue(mtls.BrokerID(trustDomain)))
	return tp
}

func (tp *testProxy) dial(t testing.TB, m *mtls.Material) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+tp.addr, grpc.WithTransportCredentials(credentials.NewTLS(
		mtls.ClientConfig(mtls.StaticSource{M: m}, mtls.AuthorizeOneOf(mtls.DriverID(trustDomain, "d"))))),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(rawgrpc.Codec{})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func invoke(ctx context.Context, conn *grpc.ClientConn, method string) error {
	return conn.Invoke(ctx, method, &rawgrpc.Frame{}, &rawgrpc.Frame{})
}

func TestForwardsCSIAndOnlyCSI(t *testing.T) {
	_, ep := startRawDriver(t)
	tp := startProxy(t, ep, Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	// A stream both ways, with binary metadata and the caller's trace.
	caller := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5}, TraceFlags: trace.FlagsSampled})
	md := metadata.MD{"x-bin": {string([]byte{0, 0xff})}}
	propagation.TraceContext{}.Inject(trace.ContextWithSpanContext(ctx, caller), rawgrpc.MDCarrier(md))
	s, err := tp.conn.NewStream(metadata.NewOutgoingContext(ctx, md), rawgrpc.StreamDesc, "/csi.t.T/Echo")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range []string{"a", "bb", ""} {
		if err := s.SendMsg(&rawgrpc.Frame{Payload: []byte(m)}); err != nil {
			t.Fatal(err)
		}
		var f rawgrpc.Frame
		if err := s.RecvMsg(&f); err != nil || string(f.Payload) != m {
			t.Fatalf("echo of %q: %q, %v", m, f.Payload, err)
		}
	}
	s.CloseSend()
	if err := s.RecvMsg(&rawgrpc.Frame{}); !errors.Is(err, io.EOF) {
		t.Fatalf("end of the stream: %v", err)
	}
	hd, _ := s.Header()
	if got := hd.Get("got-x-bin"); len(got) != 1 || got[0] != string([]byte{0, 0xff}) {
		t.Errorf("binary metadata at the driver: %q", got)
	}
	// W3C trace context: the driver's parent is the proxy's server span,
	// in the caller's trace.
	// (The server span ends as the call's status is written: maybe just
	// after the caller has read it.)
	spans := tp.spans.Ended()
	for deadline := time.Now().Add(5 * time.Second); len(spans) == 0 && time.Now().Before(deadline); spans = tp.spans.Ended() {
		time.Sleep(5 * time.Millisecond)
	}
	if len(spans) != 1 {
		t.Fatalf("%d proxy spans, want 1", len(spans))
	}
	sp := spans[0]
	if sp.SpanContext().TraceID() != caller.TraceID() || sp.Parent().SpanID() != caller.SpanID() || sp.SpanKind() != trace.SpanKindServer {
		t.Errorf("proxy span %v (parent %v), want a server span in the caller's trace", sp.SpanContext(), sp.Parent())
	}
	got := propagation.TraceContext{}.Extract(context.Background(), propagation.HeaderCarrier{"Traceparent": hd.Get("got-traceparent")})
	if sc := trace.SpanContextFromContext(got); sc.SpanID() != sp.SpanContext().SpanID() || sc.TraceID() != caller.TraceID() {
		t.Errorf("the driver's traceparent %q, want the proxy's span %v", hd.Get("got-traceparent"), sp.SpanContext())
	}
	if n := len(hd.Get("got-traceparent")); n != 1 {
		t.Errorf("the driver got %d traceparent values, want the proxy's only", n)
	}

	// Only CSI services are forwarded.
	if err := invoke(ctx, tp.conn, "/grpc.health.v1.Health/Check"); status.Code(err) != codes.Unimplemented || !strings.Contains(err.Error(), "not a CSI method") {
		t.Errorf("non-CSI method: %v", err)
	}
	// The driver's own answers pass unchanged.
	if err := invoke(ctx, tp.conn, "/csi.t.T/Nope"); status.Code(err) != codes.Unimplemented || status.Convert(err).Message() != "raw driver: /csi.t.T/Nope" {
		t.Errorf("the driver's Unimplemented: %v", err)
	}
}

// TestOwnInfoAPI: the proxy answers ProxyInfo itself, from the driver's
// GetPluginInfo and Probe.
func TestOwnInfoAPI(t *testing.T) {
	_, ep := startRawDriver(t)
	tp := startProxy(t, ep, Config{Node: "n1"})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	info, err := proxyinfov1.NewProxyInfoClient(tp.conn).GetInfo(ctx, &proxyinfov1.GetInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	// The raw driver does not implement Identity: said, not failed.
	if info.GetNode() != "n1" || info.GetProxyVersion() != "test" || info.GetDriverReady() || !strings.Contains(info.GetDriverError(), "Unimplemented") {
		t.Errorf("info = %v", info)
	}
}

// TestDriverCallsBounded: however many calls arrive, on however many
// connections, the driver never has more than MaxConcurrentCalls at once,
// and the calls over the bound wait rather than fail.
func TestDriverCallsBounded(t *testing.T) {
	d, ep := startRawDriver(t)
	tp := startProxy(t, ep, Config{MaxConcurrentCalls: 4})
	now := time.Now()
	second, err := tp.ca.IssueMaterial(mtls.Leaf{ID: mtls.BrokerID(trustDomain), NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	conns := []*grpc.ClientConn{tp.conn, tp.dial(t, second)}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for i := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- invoke(ctx, conns[i%2], "/csi.t.T/Slow")
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("a call over the bound: %v", err)
		}
	}
	if p := d.peak.Load(); p > 4 || p < 2 {
		t.Errorf("the driver had at most %d calls at once, want 4 at most (and more than 1)", p)
	}
}

// TestMetricLabelsBounded: the grpc_server_* series name known methods
// with their kind, every other path _OTHER, and every status code outside
// gRPC's range Unknown.
func TestMetricLabelsBounded(t *testing.T) {
	_, ep := startRawDriver(t)
	tp := startProxy(t, ep, Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i := range 20 {
		invoke(ctx, tp.conn, "/csi.v9.Future/M"+string(rune('a'+i)))
	}
	invoke(ctx, tp.conn, "/csi.v1.Identity/Probe")
	invoke(ctx, tp.conn, "/csi.v1.Node/NodeGetInfo")
	mfs, err := tp.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	series := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "grpc_server_started_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			l := map[string]string{}
			for _, p := range m.GetLabel() {
				l[p.GetName()] = p.GetValue()
			}
			series[l["grpc_type"]+" "+l["grpc_service"]+"/"+l["grpc_method"]] = m.GetCounter().GetValue()
		}
	}
	want := map[string]float64{
		"bidi_stream _OTHER/_OTHER":     20,
		"unary csi.v1.Identity/Probe":   1,
		"unary csi.v1.Node/NodeGetInfo": 1,
	}
	for k, v := range want {
		if series[k] != v {
			t.Errorf("%s: %v, want %v (series %v)", k, series[k], v, series)
		}
	}
	if len(series) != len(want) {
		t.Errorf("series %v, want only %v", series, want)
	}
}

// TestDriverDown: with no driver, calls fail with Unavailable naming the
// socket, /readyz fails, and the proxy says so once, not at every call.
func TestDriverDown(t *testing.T) {
	ep := "unix://" + filepath.Join(testutil.ShortTempDir(t), "missing.sock")
	tp := startProxy(t, ep, Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i := range 3 {
		err := invoke(ctx, tp.conn, "/csi.v1.Identity/Probe")
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "csibroker proxy: driver at") || !strings.Contains(err.Error(), "missing.sock") {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	if err := tp.p.Ready(ctx); err == nil || !strings.Contains(err.Error(), "missing.sock") {
		t.Errorf("Ready: %v", err)
	}
	logs := tp.logs.String()
	if n := strings.Count(logs, "cannot reach the driver's socket"); n != 1 {
		t.Errorf("the unreachable driver logged %d times, want once:\n%s", n, logs)
	}
}

// TestExpiredBrokerRefused: a broker connection whose certificate expires
// while it is open has its next call refused with Unavailable (said at
// INFO: a routine renewal looks so) and is closed; the driver never sees
// the call.
func TestExpiredBrokerRefused(t *testing.T) {
	d, ep := startRawDriver(t)
	tp := startProxy(t, ep, Config{})
	expiry := time.Now().Add(1500 * time.Millisecond)
	m, err := tp.ca.IssueMaterial(mtls.Leaf{ID: mtls.BrokerID(trustDomain), NotBefore: time.Now().Add(-time.Minute), NotAfter: expiry})
	if err != nil {
		t.Fatal(err)
	}
	conn := tp.dial(t, m)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := invoke(ctx, conn, "/csi.t.T/Slow"); err != nil {
		t.Fatalf("a call before expiry: %v", err)
	}
	time.Sleep(time.Until(expiry) + 100*time.Millisecond)
	before := d.peak.Load()
	d.peak.Store(0)
	if err := invoke(ctx, conn, "/csi.t.T/Slow"); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("a call after expiry: %v, want Unavailable naming the expiry", err)
	}
	if d.peak.Load() != 0 || before != 1 {
		t.Error("the driver saw the refused call")
	}
	for conn.GetState() == connectivity.Ready {
		if !conn.WaitForStateChange(ctx, connectivity.Ready) {
			t.Fatal("the proxy kept the expired broker's connection open")
		}
	}
	if l := tp.logs.String(); !strings.Contains(l, "level=INFO") || !strings.Contains(l, "expired since the handshake") || strings.Contains(l, "level=WARN") {
		t.Errorf("want an INFO line about the expiry and no warning:\n%s", l)
	}
}
