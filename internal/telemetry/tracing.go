package telemetry

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
)

// Propagator is the W3C trace-context (and baggage) propagator every hop uses.
func Propagator() propagation.TextMapPropagator {
	return propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
}

// exporterConfigured reports whether the environment asks for an exporter.
func exporterConfigured() bool {
	for _, k := range []string{"OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"} {
		if os.Getenv(k) != "" {
			return true
		}
	}
	return false
}

// NewTracerProvider builds a tracer provider configured by the standard
// OTEL_* environment variables (OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_*,
// OTEL_TRACES_SAMPLER, OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME). With none
// of the exporter variables set, spans are still made (trace IDs reach Events
// and logs) but exported nowhere. extra span processors (tests) are added.
func NewTracerProvider(ctx context.Context, service string, extra ...sdktrace.SpanProcessor) (*sdktrace.TracerProvider, error) {
	res, err := resource.Merge(resource.Default(), resource.NewWithAttributes(semconv.SchemaURL, semconv.ServiceName(service)))
	if err != nil && !errors.Is(err, resource.ErrSchemaURLConflict) {
		return nil, err
	}
	// A malformed entry in OTEL_RESOURCE_ATTRIBUTES gives an error and the
	// resource of the entries that parsed (OTEL_SERVICE_NAME with them),
	// which is kept: one bad entry must not drop the service's name.
	if env, _ := resource.New(ctx, resource.WithFromEnv()); env != nil {
		if merged, err := resource.Merge(res, env); err == nil {
			res = merged
		}
	}
	opts := []sdktrace.TracerProviderOption{sdktrace.WithResource(res)}
	if exporterConfigured() {
		exps, err := spanExporters(ctx)
		if err != nil {
			return nil, err
		}
		for _, exp := range exps {
			opts = append(opts, sdktrace.WithBatcher(exp))
		}
	}
	for _, p := range extra {
		opts = append(opts, sdktrace.WithSpanProcessor(p))
	}
	return sdktrace.NewTracerProvider(opts...), nil
}

// spanExporters builds the exporters OTEL_TRACES_EXPORTER names (a comma
// separated list; default otlp): "otlp" over the protocol of
// OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL
// ("http/protobuf", the default, or "grpc"), "console" to standard output, and
// "none". The OTLP exporters read the rest of OTEL_EXPORTER_OTLP_* themselves.
// Only trace exporters are linked: the proxy binary stays small.
func spanExporters(ctx context.Context) ([]sdktrace.SpanExporter, error) {
	names := os.Getenv("OTEL_TRACES_EXPORTER")
	if strings.TrimSpace(names) == "" {
		names = "otlp"
	}
	var out []sdktrace.SpanExporter
	for _, name := range strings.Split(names, ",") {
		switch name = strings.TrimSpace(name); name {
		case "none":
		case "console":
			exp, err := stdouttrace.New()
			if err != nil {
				return nil, fmt.Errorf("OTEL_TRACES_EXPORTER console: %w", err)
			}
			out = append(out, exp)
		case "otlp":
			proto := os.Getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
			if proto == "" {
				proto = os.Getenv("OTEL_EXPORTER_OTLP_PROTOCOL")
			}
			var exp sdktrace.SpanExporter
			var err error
			switch proto {
			case "", "http/protobuf":
				exp, err = otlptracehttp.New(ctx)
			case "grpc":
				exp, err = otlptracegrpc.New(ctx)
			default:
				return nil, fmt.Errorf("OTEL_EXPORTER_OTLP_PROTOCOL %q: want http/protobuf or grpc", proto)
			}
			if err != nil {
				return nil, fmt.Errorf("OTEL_TRACES_EXPORTER otlp: %w", err)
			}
			out = append(out, exp)
		default:
			return nil, fmt.Errorf("OTEL_TRACES_EXPORTER %q: want otlp, console or none", name)
		}
	}
	return out, nil
}

// TracingShutdownTimeout bounds ShutdownTracing: a stopping process does not
// wait on an exporter whose collector is gone past its own grace period.
var TracingShutdownTimeout = 5 * time.Second

// ShutdownTracing flushes and stops tp within TracingShutdownTimeout (ctx's
// cancellation aside: it is the process's, which is ending), and logs what
// could not be flushed.
func ShutdownTracing(ctx context.Context, tp *sdktrace.TracerProvider, log *slog.Logger) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), TracingShutdownTimeout)
	defer cancel()
	if err := tp.Shutdown(ctx); err != nil && log != nil {
		log.Warn("tracing: spans not exported before stopping", "err", err, "timeout", TracingShutdownTimeout)
	}
}
