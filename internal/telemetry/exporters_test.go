package telemetry

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

func TestSpanExporters(t *testing.T) {
	for _, tc := range []struct {
		name, exporter, protocol string
		want                     int
		wantErr                  string
	}{
		{name: "default is otlp over http", exporter: "", want: 1},
		{name: "none", exporter: "none", want: 0},
		{name: "console", exporter: "console", want: 1},
		{name: "otlp over grpc", exporter: "otlp", protocol: "grpc", want: 1},
		{name: "two exporters", exporter: "otlp, console", want: 2},
		{name: "unknown exporter", exporter: "zipkin", wantErr: `OTEL_TRACES_EXPORTER "zipkin"`},
		{name: "unknown protocol", exporter: "otlp", protocol: "http/json", wantErr: `OTEL_EXPORTER_OTLP_PROTOCOL "http/json"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("OTEL_TRACES_EXPORTER", tc.exporter)
			t.Setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "")
			t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", tc.protocol)
			t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
			exps, err := spanExporters(context.Background())
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want it to contain %s", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(exps) != tc.want {
				t.Fatalf("%d exporters, want %d", len(exps), tc.want)
			}
			for _, e := range exps {
				_ = e.Shutdown(context.Background())
			}
		})
	}
}

// stuckProcessor is a span processor whose flush never finishes (an
// exporter whose collector is gone).
// stuckProcessor never flushes; it records the deadline it was given.
type stuckProcessor struct{ deadline chan time.Time }

func (stuckProcessor) OnStart(context.Context, sdktrace.ReadWriteSpan) {}
func (stuckProcessor) OnEnd(sdktrace.ReadOnlySpan)                     {}
func (p stuckProcessor) ForceFlush(ctx context.Context) error          { return p.stuck(ctx) }
func (p stuckProcessor) Shutdown(ctx context.Context) error            { return p.stuck(ctx) }

func (p stuckProcessor) stuck(ctx context.Context) error {
	dl, _ := ctx.Deadline() // zero: none
	select {
	case p.deadline <- dl:
	default:
	}
	<-ctx.Done()
	return ctx.Err()
}

// TestShutdownTracingIsBounded: stopping does not wait on an exporter that
// cannot flush past TracingShutdownTimeout, and says what was lost.
func TestShutdownTracingIsBounded(t *testing.T) {
	prev := TracingShutdownTimeout
	TracingShutdownTimeout = 200 * time.Millisecond
	t.Cleanup(func() { TracingShutdownTimeout = prev })
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, nil))
	sp := stuckProcessor{deadline: make(chan time.Time, 1)}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sp))
	start := time.Now()
	ShutdownTracing(context.Background(), tp, log)
	// Bounded by the deadline it handed the exporter (ShutdownTracing
	// returned, so the wait ended with it).
	select {
	case dl := <-sp.deadline:
		// TracingShutdownTimeout from when ShutdownTracing made it, which
		// is a moment after start (a second allows for a stalled machine).
		if dl.IsZero() || dl.Sub(start) < TracingShutdownTimeout || dl.Sub(start) > TracingShutdownTimeout+time.Second {
			t.Fatalf("the exporter was given deadline %v (%v after the start), want %v from the start of the shutdown", dl, dl.Sub(start), TracingShutdownTimeout)
		}
	default:
		t.Fatal("the exporter was never asked to flush or shut down")
	}
	if !strings.Contains(buf.String(), "spans not exported before stopping") {
		t.Fatalf("nothing logged: %q", buf.String())
	}
}

// TestServiceNameFromTheEnvironment: OTEL_SERVICE_NAME names the spans'
// service, and a malformed entry of OTEL_RESOURCE_ATTRIBUTES loses only
// itself: the service name and the well-formed entries stay.
func TestServiceNameFromTheEnvironment(t *testing.T) {
	for _, attrs := range []string{"team=storage", "team=storage,oops"} {
		t.Run(attrs, func(t *testing.T) {
			t.Setenv("OTEL_SERVICE_NAME", "mysvc")
			t.Setenv("OTEL_RESOURCE_ATTRIBUTES", attrs)
			rec := tracetest.NewSpanRecorder()
			tp, err := NewTracerProvider(context.Background(), "csibroker-proxy", rec)
			if err != nil {
				t.Fatal(err)
			}
			defer tp.Shutdown(context.Background())
			_, span := tp.Tracer("test").Start(context.Background(), "op")
			span.End()
			got := map[string]string{}
			for _, kv := range rec.Ended()[0].Resource().Attributes() {
				got[string(kv.Key)] = kv.Value.String()
			}
			if got["service.name"] != "mysvc" || got["team"] != "storage" {
				t.Fatalf("resource service.name=%q team=%q, want mysvc and storage", got["service.name"], got["team"])
			}
		})
	}
}
