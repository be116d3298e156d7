package telemetry

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
)

func TestObserveTraced(t *testing.T) {
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	for _, tc := range []struct {
		name     string
		sc       trace.SpanContext
		exemplar string // the trace_id label wanted, "" for none
	}{
		{name: "sampled span", sc: trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled}), exemplar: tid.String()},
		{name: "span not sampled", sc: trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid})},
		{name: "no span", sc: trace.SpanContext{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "h_seconds", Help: "h", Buckets: prometheus.ExponentialBucketsRange(1e-5, 100, 20)}, []string{"l"})
			reg := prometheus.NewPedanticRegistry()
			reg.MustRegister(h)
			ObserveTraced(h.WithLabelValues("x"), 0.003, tc.sc)
			mfs, err := reg.Gather()
			if err != nil {
				t.Fatal(err)
			}
			hist := mfs[0].GetMetric()[0].GetHistogram()
			if hist.GetSampleCount() != 1 {
				t.Fatalf("sample count %d, want 1", hist.GetSampleCount())
			}
			var got []string
			for _, b := range hist.GetBucket() {
				if ex := b.GetExemplar(); ex != nil {
					for _, lp := range ex.GetLabel() {
						got = append(got, lp.GetName()+"="+lp.GetValue())
					}
					if ex.GetValue() != 0.003 {
						t.Errorf("exemplar value %v, want 0.003", ex.GetValue())
					}
				}
			}
			switch {
			case tc.exemplar == "" && len(got) > 0:
				t.Errorf("exemplar labels %v, want none", got)
			case tc.exemplar != "" && (len(got) != 1 || got[0] != "trace_id="+tc.exemplar):
				t.Errorf("exemplar labels %v, want [trace_id=%s]", got, tc.exemplar)
			}
		})
	}
}
