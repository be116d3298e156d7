package testenv

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/csibroker/csibroker/internal/telemetry"
)

func TestJaegerMissingBinaryFailsWithHowToFix(t *testing.T) {
	_, err := StartJaeger(context.Background(), JaegerOptions{Binary: filepath.Join(t.TempDir(), "jaeger")})
	if err == nil {
		t.Fatal("StartJaeger without a binary succeeded")
	}
	for _, want := range []string{"make test", "hack/jaeger.sh", JaegerVersion, JaegerEnv} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
}

func TestDefaultJaegerPathBesideTheControlPlane(t *testing.T) {
	t.Setenv("CSIBROKER_CACHE", "/cache/root")
	if got, want := DefaultJaegerPath(), "/cache/root/jaeger/jaeger-"+JaegerVersion+"/jaeger"; got != want {
		t.Errorf("DefaultJaegerPath() = %s, want %s (where hack/jaeger.sh builds it)", got, want)
	}
}

// A span exported with the standard OTEL_* variables, over either OTLP
// protocol, is read back from the query API; Stop ends the process and
// removes its directory.
func TestJaegerReceivesOTLP(t *testing.T) {
	j := NewJaeger(t)
	ctx := t.Context()
	for _, proto := range []string{"grpc", "http/protobuf"} {
		service := "testenv-" + strings.ReplaceAll(proto, "/", "-")
		for _, kv := range j.OTLPEnv(service, proto) {
			k, v, _ := strings.Cut(kv, "=")
			t.Setenv(k, v)
		}
		tp, err := telemetry.NewTracerProvider(ctx, service)
		if err != nil {
			t.Fatal(err)
		}
		_, span := tp.Tracer("testenv").Start(ctx, "op "+proto)
		id := span.SpanContext().TraceID().String()
		span.End()
		if err := tp.Shutdown(ctx); err != nil {
			t.Fatalf("%s: export: %v", proto, err)
		}
		err = WaitFor(ctx, 10*time.Second, "trace "+id+" in Jaeger", func(ctx context.Context) (bool, string, error) {
			tr, err := j.Trace(ctx, id)
			if errors.Is(err, ErrTraceNotFound) {
				return false, err.Error(), nil
			}
			if err != nil {
				return false, "", err
			}
			if len(tr.Spans) != 1 || tr.Spans[0].OperationName != "op "+proto || tr.Service(tr.Spans[0]) != service {
				return false, "", errors.New("unexpected trace")
			}
			return true, "", nil
		})
		if err != nil {
			t.Fatalf("%s: %v", proto, err)
		}
		traces, err := j.Traces(ctx, service, nil)
		if err != nil || len(traces) != 1 || traces[0].TraceID != id {
			t.Errorf("%s: search of service %s: %d traces (%v), want trace %s", proto, service, len(traces), err, id)
		}
	}

	// Its own telemetry is off: it dials nothing (such as the default
	// OTLP port, where its query API would send its own traces) that
	// another Jaeger on the machine might hold.
	if _, err := j.Services(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(6 * time.Second) // a batch span processor's default delay
	if log := j.LogTail(200); strings.Contains(log, ":4317") {
		t.Errorf("jaeger dials the default OTLP port:\n%s", log)
	}

	pid, dir := j.PID(), j.Dir
	j.Stop()
	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("jaeger (pid %d) still running after Stop: %v", pid, err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("%s left behind after Stop (%v)", dir, err)
	}
}
