package telemetry

import (
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
)

// ExemplarTraceLabel is the exemplar label that holds a trace ID, the name
// Grafana's Prometheus data source looks for by default.
const ExemplarTraceLabel = "trace_id"

// ObserveTraced records v in o, with sc's trace ID as the exemplar when sc
// is a sampled span's (an unsampled trace is exported nowhere: its ID would
// lead nowhere), so a dashboard can open the trace behind an observation.
// Prometheus client libraries keep one exemplar per bucket, the latest, and
// serve them only in the OpenMetrics format (promhttp.HandlerOpts
// EnableOpenMetrics).
func ObserveTraced(o prometheus.Observer, v float64, sc trace.SpanContext) {
	if eo, ok := o.(prometheus.ExemplarObserver); ok && sc.IsSampled() {
		eo.ObserveWithExemplar(v, prometheus.Labels{ExemplarTraceLabel: sc.TraceID().String()})
		return
	}
	o.Observe(v)
}
