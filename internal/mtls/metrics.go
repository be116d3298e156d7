package mtls

import "github.com/prometheus/client_golang/prometheus"

// Metrics of a Source, for alerting before a certificate expires or while
// rotated files are being refused.
var (
	notAfterDesc = prometheus.NewDesc("csibroker_tls_certificate_not_after_timestamp_seconds",
		"When the certificate in use expires (Unix time).", nil, nil)
	reloadsDesc = prometheus.NewDesc("csibroker_tls_reloads_total",
		"Certificate files taken into use after a change.", nil, nil)
	failuresDesc = prometheus.NewDesc("csibroker_tls_reload_failures_total",
		"Changed certificate files refused (the previous material stays in use).", nil, nil)
)

// reloadCounter is what a FileSource adds to a Source.
type reloadCounter interface {
	Reloads() int64
	Failures() int64
}

type collector struct{ src Source }

// NewCollector reports src's certificate expiry and, for a source that
// reloads files, its reloads and refused files (zero for a static one).
func NewCollector(src Source) prometheus.Collector { return collector{src: src} }

func (c collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- notAfterDesc
	ch <- reloadsDesc
	ch <- failuresDesc
}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	if m := c.src.Current(); m != nil && m.Leaf != nil {
		ch <- prometheus.MustNewConstMetric(notAfterDesc, prometheus.GaugeValue, float64(m.Leaf.NotAfter.Unix()))
	}
	var reloads, failures int64
	if rc, ok := c.src.(reloadCounter); ok {
		reloads, failures = rc.Reloads(), rc.Failures()
	}
	ch <- prometheus.MustNewConstMetric(reloadsDesc, prometheus.CounterValue, float64(reloads))
	ch <- prometheus.MustNewConstMetric(failuresDesc, prometheus.CounterValue, float64(failures))
}
