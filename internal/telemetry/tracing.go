package telemetry

import (
	"context"
	"errors"
	"os"

	"go.opentelemetry.io/contrib/exporters/autoexport"
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
	if env, err := resource.New(ctx, resource.WithFromEnv()); err == nil {
		if merged, err := resource.Merge(res, env); err == nil {
			res = merged
		}
	}
	opts := []sdktrace.TracerProviderOption{sdktrace.WithResource(res)}
	if exporterConfigured() {
		exp, err := autoexport.NewSpanExporter(ctx)
		if err != nil {
			return nil, err
		}
		if !autoexport.IsNoneSpanExporter(exp) {
			opts = append(opts, sdktrace.WithBatcher(exp))
		}
	}
	for _, p := range extra {
		opts = append(opts, sdktrace.WithSpanProcessor(p))
	}
	return sdktrace.NewTracerProvider(opts...), nil
}
