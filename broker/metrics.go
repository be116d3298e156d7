package broker

import (
	"strings"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the broker's CSI client metrics.
type Metrics struct {
	calls    *prometheus.HistogramVec
	sidecar  *prometheus.HistogramVec
	retries  *prometheus.CounterVec
	inflight *prometheus.GaugeVec
	connDesc *prometheus.Desc
	b        *Broker // for connection states, read at scrape time
}

// CallBuckets run from 10µs to 2 minutes so both an in-memory driver's
// microseconds and a slow cloud API's minutes land in a bucket of their own.
var CallBuckets = prometheus.ExponentialBucketsRange(10e-6, 120, 28)

// sidecarBuckets are csi-lib-utils' buckets, so existing dashboards that read
// csi_sidecar_operations_seconds keep their quantiles.
var sidecarBuckets = []float64{0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 25, 50, 120, 300, 600}

func newMetrics() *Metrics {
	return &Metrics{
		calls: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "csibroker", Subsystem: "csi", Name: "call_duration_seconds",
			Help:    "Duration of CSI calls from the broker to drivers, retries included, by driver, method and gRPC status code.",
			Buckets: CallBuckets,
		}, []string{"driver", "method", "code"}),
		sidecar: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "csi_sidecar_operations_seconds",
			Help:    "Container Storage Interface operation duration with gRPC error code status total (compatible with the CSI sidecars).",
			Buckets: sidecarBuckets,
		}, []string{"driver_name", "method_name", "grpc_status_code"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "csibroker", Subsystem: "csi", Name: "retries_total",
			Help: "CSI call attempts that were retried, by driver, method and the gRPC code that caused the retry.",
		}, []string{"driver", "method", "code"}),
		inflight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "csibroker", Subsystem: "csi", Name: "inflight_calls",
			Help: "CSI calls from the broker to drivers in flight now.",
		}, []string{"driver", "method"}),
		connDesc: prometheus.NewDesc("csibroker_proxy_connection_state",
			"State of the broker's connection to each proxy: 1 for its current connectivity state (gRPC's state names: IDLE, CONNECTING, READY, TRANSIENT_FAILURE, SHUTDOWN).",
			[]string{"driver", "node", "address", "state"}, nil),
	}
}

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	m.calls.Describe(ch)
	m.sidecar.Describe(ch)
	m.retries.Describe(ch)
	m.inflight.Describe(ch)
	ch <- m.connDesc
}

// Collect implements prometheus.Collector.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	m.calls.Collect(ch)
	m.sidecar.Collect(ch)
	m.retries.Collect(ch)
	m.inflight.Collect(ch)
	if m.b == nil {
		return
	}
	for _, ps := range m.b.proxyStates() {
		ch <- prometheus.MustNewConstMetric(m.connDesc, prometheus.GaugeValue, 1, ps.driver, ps.node, ps.address, ps.state)
	}
}

// shortMethod turns "/csi.v1.Controller/CreateVolume" into "CreateVolume".
func shortMethod(full string) string {
	if i := strings.LastIndexByte(full, '/'); i >= 0 {
		return full[i+1:]
	}
	return full
}
