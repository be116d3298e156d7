// Package telemetry sets up what every csibroker component shares: the slog
// logger (with client-go's klog routed into it), OpenTelemetry tracing from the
// standard OTEL_* environment variables, and small helpers for endpoints.
package telemetry
