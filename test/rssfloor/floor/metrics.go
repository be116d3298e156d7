//go:build metrics

package main

import (
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// The metrics layer: a Prometheus registry with the Go and process
// collectors and one histogram vector, served and scraped once.
func init() {
	names = append(names, "metrics")
	layers = append(layers, func(mux *http.ServeMux, base string) error {
		reg := prometheus.NewRegistry()
		h := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "floor_seconds", Help: "floor", Buckets: prometheus.ExponentialBuckets(1e-5, 2, 20)}, []string{"method", "code"})
		reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), h)
		h.WithLabelValues("Probe", "OK").Observe(1e-4)
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		return get(base + "/metrics")
	})
}
