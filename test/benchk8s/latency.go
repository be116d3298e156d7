package main

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// latencyResult is one run of the latency scenario for one side.
type latencyResult struct {
	Side      string    `json:"side"`
	Rep       int       `json:"rep"`
	Seconds   []float64 `json:"seconds"`    // each claim, creation → Bound
	PVSeconds []float64 `json:"pv_seconds"` // each claim, creation → its PV seen
	// SpanExports counts the OTLP export requests the harness's sink got
	// from the side's start until it stopped (csibroker with tracing: its
	// spans were sent).
	SpanExports int64 `json:"span_exports"`
}

// scenarioLatency (issue 35): the latency a person waits for. Claims are
// created one after another, each once the previous one is Bound, at the
// sidecars' default client QPS 5/10; csibroker with its intent record,
// policy (-policy-mode) and tracing (-tracing) as configured.
func (h *Harness) scenarioLatency(ctx context.Context) error {
	const sc = "bench-latency"
	if err := h.ensureStorageClass(ctx, sc, benchDriver, corev1.PersistentVolumeReclaimRetain); err != nil {
		return err
	}
	var runs []*latencyResult
	for rep := range h.cfg.Reps {
		for _, side := range sidesInOrder(rep) {
			r, err := h.latencyRun(ctx, sc, side, rep)
			if err != nil {
				return fmt.Errorf("%s rep %d: %w", side, rep+1, err)
			}
			h.logf("  %-20s latency rep %d: %d claims, creation → Bound p50 %.0f ms, p99 %.0f ms, mean %.0f ms",
				side, rep+1, len(r.Seconds), percentile(r.Seconds, 50)*1000, percentile(r.Seconds, 99)*1000, mean(r.Seconds)*1000)
			runs = append(runs, r)
			h.report.addRun(map[string]any{"scenario": "latency", "result": r})
		}
	}
	figs := []struct {
		label string
		v     func(r *latencyResult) float64
	}{
		{"p50 ms, creation → Bound", func(r *latencyResult) float64 { return percentile(r.Seconds, 50) * 1000 }},
		{"p99 ms, creation → Bound (nearest rank)", func(r *latencyResult) float64 { return percentile(r.Seconds, 99) * 1000 }},
		{"mean ms, creation → Bound", func(r *latencyResult) float64 { return mean(r.Seconds) * 1000 }},
		{"fastest ms, creation → Bound", func(r *latencyResult) float64 { return percentile(r.Seconds, 0) * 1000 }},
		{"p50 ms, creation → the PV exists (the provisioner's part)", func(r *latencyResult) float64 { return percentile(r.PVSeconds, 50) * 1000 }},
		{"p99 ms, creation → the PV exists", func(r *latencyResult) float64 { return percentile(r.PVSeconds, 99) * 1000 }},
	}
	var rows []*row
	for _, f := range figs {
		rw := &row{label: f.label, prec: 0}
		for _, r := range runs {
			rw.add(r.Side, f.v(r))
		}
		rows = append(rows, rw)
	}
	h.report.table(fmt.Sprintf("One claim at a time (issue 35): %d Immediate claims, each created once the previous one is Bound (one more first, not counted); "+
		"client QPS/burst %s; csibroker with its intent record, --policy-mode %s, tracing %s",
		h.cfg.LatencyClaims, sidecarDefaults, h.cfg.PolicyMode, map[bool]string{true: "exported", false: "not exported"}[h.cfg.Tracing]), rows, "")
	for _, r := range runs {
		if r.Side == sideBroker {
			h.report.printf("\ncsibroker run %d: %d OTLP span exports received by the harness's sink.\n", r.Rep+1, r.SpanExports)
		}
	}
	return nil
}

func (h *Harness) latencyRun(ctx context.Context, sc, side string, rep int) (*latencyResult, error) {
	tag := dnsName("l", short(side), "r"+fmt.Sprint(rep))
	ns := tag
	if err := h.createNamespace(ctx, ns); err != nil {
		return nil, err
	}
	defer h.deleteNamespace(context.WithoutCancel(ctx), ns)
	drv, err := h.startDriver(ctx, tag, benchDriver)
	if err != nil {
		return nil, err
	}
	defer drv.proc.stop(5 * time.Second)
	tr, err := h.newTracker(ctx, ns, "")
	if err != nil {
		return nil, err
	}
	defer tr.stop()
	exports0 := int64(0)
	if h.sink != nil {
		exports0 = h.sink.requests.Load()
	}
	d, err := h.deploy(ctx, side, deployOpts{tag: tag, drivers: []*driverInst{drv}, rate: sidecarDefaults})
	if err != nil {
		return nil, err
	}
	// The volumes are removed once the side has stopped.
	defer func() {
		d.stop()
		_ = h.removeVolumes(context.WithoutCancel(ctx), ns)
		_ = h.forgetIntents(context.WithoutCancel(ctx))
	}()
	// The first claim, not counted, waits for the side to start.
	if _, err := h.boundInTurn(ctx, tr, ns, "warm", sc, 1, 0, 2*time.Minute, d.died); err != nil {
		return nil, err
	}
	m, err := h.boundInTurn(ctx, tr, ns, "c", sc, h.cfg.LatencyClaims, 1, time.Minute, d.died)
	if err != nil {
		return nil, err
	}
	secs, pvSecs := m.bound, m.pv
	r := &latencyResult{Side: side, Rep: rep, Seconds: secs, PVSeconds: pvSecs}
	// Stopped first: csibroker sends the spans it still holds on SIGTERM.
	d.stop()
	if h.sink != nil {
		r.SpanExports = h.sink.requests.Load() - exports0
	}
	return r, nil
}
