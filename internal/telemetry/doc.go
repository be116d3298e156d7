// Package telemetry sets up what every csibroker component shares: the slog
// logger (with client-go's klog routed into it), OpenTelemetry tracing from the
// standard OTEL_* environment variables, and small helpers for endpoints.
//
// # Logs
//
// NewLogger maps --v onto slog levels: 0 logs info and above, 1-3 add
// detail, 4 and above log at debug level, which includes sanitized CSI
// requests and responses. Secrets are stripped before any CSI message
// reaches a logger, at every level; this package never sees them.
//
// CapVerbosity caps a library's logging below a given verbosity whatever
// --v is. The broker routes client-go through it at 7, because client-go
// logs API response bodies, Secrets included, from 8.
//
// # Tracing
//
// NewTracerProvider reads OTEL_TRACES_EXPORTER (a comma-separated list:
// "otlp", the default, "console", "none"), OTEL_EXPORTER_OTLP_* (protocol
// "http/protobuf", the default, or "grpc"), OTEL_TRACES_SAMPLER,
// OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME. With none of
// OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_ENDPOINT and
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT set, spans are still made (their trace
// IDs reach Events and logs) but exported nowhere.
//
// Only trace exporters are linked, not the metric and log exporters an
// autoexport package would pull in, so the proxy binary stays small.
//
// Propagator is W3C trace context (and baggage), used on every hop, so the
// caller's, front end's, broker's, proxy's and an instrumented driver's
// spans form one trace.
//
// ShutdownTracing flushes within TracingShutdownTimeout: a stopping process
// does not wait on an exporter that does not answer.
//
// # Exemplars
//
// ObserveTraced records a histogram observation with the trace ID of a
// sampled span as its exemplar (label trace_id), which the OpenMetrics
// format carries to Prometheus and a dashboard turns into a link to the
// trace.
package telemetry
