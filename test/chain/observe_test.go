package chain

import (
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/telemetry"
)

// startTracedEcho serves the echo driver with an otelgrpc server handler, as
// an instrumented driver would, recording into tp.
func startTracedEcho(t *testing.T, tp *sdktrace.TracerProvider) (*echoDriver, string) {
	t.Helper()
	dir := chaintest.ShortTempDir(t)
	path := filepath.Join(dir, "echo.sock")
	lis, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	e := &echoDriver{cancelled: make(chan struct{}, 16)}
	srv := grpc.NewServer(grpc.StatsHandler(otelgrpc.NewServerHandler(otelgrpc.WithTracerProvider(tp), otelgrpc.WithPropagators(telemetry.Propagator()))))
	csi.RegisterIdentityServer(srv, e)
	csi.RegisterControllerServer(srv, e)
	csi.RegisterSnapshotMetadataServer(srv, secretQuotingSnapshots{})
	go srv.Serve(lis)
	t.Cleanup(func() { srv.Stop(); os.Remove(path) })
	return e, "unix://" + path
}

// secretQuotingSnapshots is a careless driver's streaming method: it sends
// one message, then fails quoting the request's password.
type secretQuotingSnapshots struct {
	csi.UnimplementedSnapshotMetadataServer
}

func (secretQuotingSnapshots) GetMetadataAllocated(req *csi.GetMetadataAllocatedRequest, srv csi.SnapshotMetadata_GetMetadataAllocatedServer) error {
	if err := srv.Send(&csi.GetMetadataAllocatedResponse{VolumeCapacityBytes: 1}); err != nil {
		return err
	}
	return status.Errorf(codes.PermissionDenied, "snapshot service login refused for password %q", req.GetSecrets()["password"])
}

// TestOneTracePerCall checks that a call through the front end makes one
// trace holding the front end's, broker's, proxy's and driver's spans.
func TestOneTracePerCall(t *testing.T) {
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	_, ep := startTracedEcho(t, tp)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, Tracer: tp, Spans: spans})

	// The CSI client has its own span, as a sidecar or k8sbridge would.
	ctx, root := tp.Tracer("test").Start(context.Background(), "provision ns/claim")
	conn := chaintest.Dial(t, c.Front, grpc.WithStatsHandler(otelgrpc.NewClientHandler(otelgrpc.WithTracerProvider(tp), otelgrpc.WithPropagators(telemetry.Propagator()))))
	_, err := csi.NewControllerClient(conn).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "traced"})
	root.End()
	if err != nil {
		t.Fatal(err)
	}
	traceID := root.SpanContext().TraceID()
	// A server's span ends after its answer left, so the driver's (and the
	// proxy's) may end just after the caller has the answer: wait for the
	// seven spans of the call, then check them.
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		n := 0
		for _, s := range spans.Ended() {
			if s.SpanContext().TraceID() == traceID {
				n++
			}
		}
		if n >= 7 {
			break
		}
	}
	byName := map[string]int{}
	var names []string
	for _, s := range spans.Ended() {
		if s.SpanContext().TraceID() != traceID {
			// Readiness probes and connection set-up are not part of the call.
			if strings.Contains(s.Name(), "CreateVolume") {
				t.Errorf("span %q (%s) is in another trace", s.Name(), s.SpanKind())
			}
			continue
		}
		key := s.Name() + "/" + s.SpanKind().String()
		byName[key]++
		names = append(names, key)
	}
	t.Logf("spans in trace %s: %v", traceID, names)
	// Caller's client span, front-end server span, broker's logical-call span,
	// broker → proxy client span, proxy server span (the proxy relays the
	// call's frames, so it has one span per call, whose context the driver
	// receives), driver server span.
	want := map[string]int{
		"csi.v1.Controller/CreateVolume/server":           3, // front end, proxy, driver
		"broker /csi.v1.Controller/CreateVolume/internal": 1,
		"csi.v1.Controller/CreateVolume/client":           2, // caller → front end, broker → proxy
		"provision ns/claim/internal":                     1,
	}
	for k, n := range want {
		if byName[k] != n {
			t.Errorf("%d spans %q in the trace, want %d", byName[k], k, n)
		}
	}
	// The proxy's span is a child of the broker's client span, and the
	// driver's server span a child of the proxy's: the context went through
	// the proxy, not around it.
	// The proxy's span is the server span whose parent is the client span
	// of the broker's logical-call span.
	byID := map[trace.SpanID]sdktrace.ReadOnlySpan{}
	for _, s := range spans.Ended() {
		if s.SpanContext().TraceID() == traceID {
			byID[s.SpanContext().SpanID()] = s
		}
	}
	var proxySpan sdktrace.ReadOnlySpan
	for _, s := range byID {
		client := byID[s.Parent().SpanID()]
		if s.SpanKind() != trace.SpanKindServer || client == nil || client.SpanKind() != trace.SpanKindClient {
			continue
		}
		if b := byID[client.Parent().SpanID()]; b != nil && strings.HasPrefix(b.Name(), "broker ") {
			proxySpan = s
		}
	}
	if proxySpan == nil {
		t.Fatal("no proxy span in the trace")
	}
	var parentKind, childKind string
	for _, s := range spans.Ended() {
		if s.SpanContext().SpanID() == proxySpan.Parent().SpanID() {
			parentKind = s.Name() + "/" + s.SpanKind().String()
		}
		if s.Parent().SpanID() == proxySpan.SpanContext().SpanID() {
			childKind = s.Name() + "/" + s.SpanKind().String()
		}
	}
	if parentKind != "csi.v1.Controller/CreateVolume/client" || childKind != "csi.v1.Controller/CreateVolume/server" {
		t.Errorf("proxy span's parent %q, child %q; want the broker's client span and the driver's server span", parentKind, childKind)
	}
	if code := attrValue(proxySpan.Attributes(), "rpc.response.status_code"); code != "OK" {
		t.Errorf("proxy span rpc.response.status_code = %q", code)
	}
}

func attrValue(kvs []attribute.KeyValue, key string) string {
	for _, kv := range kvs {
		if string(kv.Key) == key {
			return kv.Value.String()
		}
	}
	return ""
}

// TestCanarySecretNeverLeaks sends a canary secret in CreateVolume (and in a
// failing call) at the highest log verbosity, then looks for it in every log
// line, span attribute and event, and every metric.
func TestCanarySecretNeverLeaks(t *testing.T) {
	const canary = "CANARY-7f3a9c-do-not-leak"
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	_, ep := startTracedEcho(t, tp)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, Tracer: tp, Spans: spans, LogLevel: -8})
	conn := chaintest.Dial(t, c.Front)
	client := csi.NewControllerClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	secrets := map[string]string{"password": canary, "token": canary}
	if _, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "canary", Secrets: secrets}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "canary-fail", Secrets: secrets, Parameters: map[string]string{"code": "9"}}); err == nil {
		t.Fatal("the failing call succeeded")
	}
	if _, err := client.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "x", Secrets: secrets}); err == nil {
		t.Fatal("DeleteVolume on the echo driver should be unimplemented")
	}
	// A driver that quotes the secret in its error: the caller gets its
	// code and message with the value stripped.
	_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "canary-echo", Secrets: secrets, Parameters: map[string]string{"echo-secret": "true"}})
	if msg := status.Convert(err).Message(); status.Code(err) != codes.PermissionDenied || strings.Contains(msg, canary) || !strings.Contains(msg, `login refused for password "***stripped***"`) {
		t.Fatalf("a driver error quoting the secret reached the caller as %v", err)
	}
	// A secret with characters that quoting, JSON and URLs escape, in
	// each of those forms, base64 and hex, and in status details.
	const canary2 = `CANARY-2b"9\z<&> é+/`
	escaped := []string{canary2, strconv.Quote(canary2), strconv.QuoteToASCII(canary2), url.QueryEscape(canary2), url.PathEscape(canary2),
		base64.StdEncoding.EncodeToString([]byte(canary2)), hex.EncodeToString([]byte(canary2))}
	if j, err := json.Marshal(canary2); err == nil {
		escaped = append(escaped, string(j))
	}
	for i, e := range escaped {
		if len(e) > 2 && e[0] == '"' {
			escaped[i] = e[1 : len(e)-1]
		}
	}
	for _, mode := range []string{"true", "json", "url", "base64", "hex", "details", "details-url"} {
		_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "canary2-" + mode, Secrets: map[string]string{"password": canary2},
			Parameters: map[string]string{"echo-secret": mode}})
		st := status.Convert(err)
		if st.Code() != codes.PermissionDenied || st.Message() == "" {
			t.Fatalf("echo-secret=%s: %v", mode, err)
		}
		for _, e := range escaped {
			if strings.Contains(st.Message(), e) {
				t.Errorf("echo-secret=%s: the secret, as %q, reached the caller in %q", mode, e, st.Message())
			}
		}
		for _, d := range st.Proto().GetDetails() {
			for _, e := range escaped {
				if strings.Contains(string(d.GetValue()), e) {
					t.Errorf("echo-secret=%s: the secret, as %q, reached the caller in a status detail", mode, e)
				}
			}
		}
		details := strings.HasPrefix(mode, "details")
		if details && len(st.Details()) != 1 {
			t.Errorf("echo-secret=%s: %d details, want the one without the secret", mode, len(st.Details()))
		}
		if !details && !strings.Contains(st.Message(), "***stripped***") {
			t.Errorf("echo-secret=%s: message %q, want the secret stripped", mode, st.Message())
		}
	}
	// A streaming method (secrets in its request too) whose driver quotes
	// the secret in the status that ends the stream.
	for _, secret := range []string{canary, canary2} {
		stream, err := csi.NewSnapshotMetadataClient(conn).GetMetadataAllocated(ctx, &csi.GetMetadataAllocatedRequest{SnapshotId: "s", Secrets: map[string]string{"password": secret}})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := stream.Recv(); err != nil {
			t.Fatalf("the stream's first message: %v", err)
		}
		_, err = stream.Recv()
		st := status.Convert(err)
		if st.Code() != codes.PermissionDenied || !strings.Contains(st.Message(), `login refused for password "***stripped***"`) {
			t.Fatalf("a stream's status quoting the secret reached the caller as %v", err)
		}
		for _, e := range append([]string{canary}, escaped...) {
			if strings.Contains(st.Message(), e) {
				t.Errorf("the secret, as %q, reached a stream's caller in %q", e, st.Message())
			}
		}
	}

	logs := c.Logs.String()
	if !strings.Contains(logs, `"csi request"`) || !strings.Contains(logs, "***stripped***") {
		t.Fatalf("debug logging did not log the sanitized request; the check below would prove nothing:\n%s", logs)
	}
	if strings.Contains(logs, canary) {
		t.Fatalf("canary in logs:\n%s", logs)
	}
	for _, e := range escaped {
		if strings.Contains(logs, e) {
			t.Fatalf("the second canary, as %q, in logs:\n%s", e, logs)
		}
	}
	forms := append([]string{canary}, escaped...)
	leaks := func(v string) bool {
		return slices.ContainsFunc(forms, func(f string) bool { return strings.Contains(v, f) })
	}
	for _, s := range spans.Started() { // ended or not: a server span may end after its caller has the answer
		check := func(where string, kvs []attribute.KeyValue) {
			for _, kv := range kvs {
				if leaks(kv.Value.String()) || leaks(string(kv.Key)) {
					t.Errorf("a canary in span %q %s attribute %s", s.Name(), where, kv.Key)
				}
			}
		}
		check("", s.Attributes())
		for _, ev := range s.Events() {
			check("event "+ev.Name, ev.Attributes)
			if leaks(ev.Name) {
				t.Errorf("a canary in span %q event name", s.Name())
			}
		}
		if leaks(s.Status().Description) {
			t.Errorf("a canary in span %q status %q", s.Name(), s.Status().Description)
		}
	}
	if len(spans.Ended()) == 0 {
		t.Fatal("no spans recorded")
	}
	mfs, gerr := c.Registry.Gather()
	if gerr != nil || len(mfs) == 0 {
		t.Fatalf("metrics: %d families, %v", len(mfs), gerr)
	}
	for _, mf := range mfs {
		if leaks(mf.String()) {
			t.Fatalf("a canary in metric %s", mf.GetName())
		}
	}
}
