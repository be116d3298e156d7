package main

import (
	"context"
	"fmt"
	"math"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// memResult is one memory measurement of one side at one level.
type memResult struct {
	Side      string  `json:"side"`
	Rep       int     `json:"rep"`
	Pairs     int     `json:"pairs"`
	RSS       int64   `json:"rss_bytes"` // provisioner or broker, VmRSS once steady
	HWM       int64   `json:"hwm_bytes"`
	HelperRSS int64   `json:"helper_rss_bytes"`
	Anon      int64   `json:"rss_anon_bytes"` // anonymous RSS of the provisioner or broker
	Seconds   float64 `json:"seconds_to_steady"`
	CPU       float64 `json:"cpu_seconds_to_steady"` // start-up: informers listed and processed everything
	HeapInuse int64   `json:"heap_inuse_bytes"`      // go_memstats_heap_inuse_bytes from the process's /metrics
}

func (h *Harness) scenarioMemory(ctx context.Context) error {
	const sc, ns = "bench-retain", "prebound"
	if err := h.ensureStorageClass(ctx, sc, benchDriver, corev1.PersistentVolumeReclaimRetain); err != nil {
		return err
	}
	if err := h.createNamespace(ctx, ns); err != nil {
		return err
	}
	results := map[int][]*memResult{}
	created := 0
	for _, level := range h.cfg.MemLevels {
		if level > created {
			t0 := time.Now()
			if err := h.createPrebound(ctx, ns, sc, benchDriver, created, level); err != nil {
				return err
			}
			// kube-controller-manager binds pre-bound pairs at ~30/s on a
			// 2-CPU VM (1,000 in 31 s); 20 ms a pair was too tight for
			// 10,000. How long binding takes is not what is measured.
			err := pollUntil(ctx, max(2*time.Minute, time.Duration(level)*60*time.Millisecond), fmt.Sprintf("%d pre-bound claims Bound", level), func() (bool, error) {
				b, _, err := h.countBound(ctx, ns)
				return b >= level, err
			})
			if err != nil {
				return err
			}
			created = level
			h.logf("  %d pre-bound PV/PVC pairs created and Bound in %s", level, time.Since(t0).Round(time.Second))
		}
		for rep := range h.cfg.Reps {
			for _, side := range sidesInOrder(rep) {
				r, err := h.memoryRun(ctx, side, level, rep)
				if err != nil {
					return fmt.Errorf("%s %d pairs rep %d: %w", side, level, rep+1, err)
				}
				h.logf("  %-20s %6d pairs rep %d: RSS %.1f MiB (peak %.1f), steady after %.0fs", side, level, rep+1, float64(r.RSS)/mib, float64(r.HWM)/mib, r.Seconds)
				results[level] = append(results[level], r)
				h.report.addRun(map[string]any{"scenario": "memory", "result": r})
			}
		}
	}
	var rows []*row
	for _, level := range h.cfg.MemLevels {
		rw := &row{label: fmt.Sprintf("RSS MiB with %d pairs", level), prec: 1}
		for _, r := range results[level] {
			rw.add(r.Side, float64(r.RSS)/mib)
		}
		rows = append(rows, rw)
	}
	for _, level := range h.cfg.MemLevels {
		rw := &row{label: fmt.Sprintf("anonymous RSS MiB with %d pairs", level), prec: 1}
		for _, r := range results[level] {
			rw.add(r.Side, float64(r.Anon)/mib)
		}
		rows = append(rows, rw)
	}
	// KiB per pair against the same side's 0-pair figure of the same repetition.
	for _, level := range h.cfg.MemLevels[1:] {
		rw := &row{label: fmt.Sprintf("KiB per pair, 0 → %d pairs", level), prec: 2}
		for _, r := range results[level] {
			base := math.NaN()
			for _, b := range results[0] {
				if b.Side == r.Side && b.Rep == r.Rep {
					base = float64(b.RSS)
				}
			}
			rw.add(r.Side, (float64(r.RSS)-base)/float64(level)/1024)
		}
		rows = append(rows, rw)
	}
	for _, level := range h.cfg.MemLevels {
		rw := &row{label: fmt.Sprintf("Go heap in use MiB with %d pairs (go_memstats_heap_inuse_bytes)", level), prec: 1}
		for _, r := range results[level] {
			rw.add(r.Side, float64(r.HeapInuse)/mib)
		}
		rows = append(rows, rw)
	}
	for _, level := range h.cfg.MemLevels[1:] {
		rw := &row{label: fmt.Sprintf("KiB of Go heap in use per pair, 0 → %d pairs", level), prec: 2}
		for _, r := range results[level] {
			base := math.NaN()
			for _, b := range results[0] {
				if b.Side == r.Side && b.Rep == r.Rep {
					base = float64(b.HeapInuse)
				}
			}
			rw.add(r.Side, (float64(r.HeapInuse)-base)/float64(level)/1024)
		}
		rows = append(rows, rw)
	}
	for _, level := range h.cfg.MemLevels {
		rw := &row{label: fmt.Sprintf("CPU seconds from start to steady with %d pairs", level), prec: 2}
		for _, r := range results[level] {
			rw.add(r.Side, r.CPU)
		}
		rows = append(rows, rw)
	}
	rw := &row{label: "proxy RSS MiB (csibroker only, at the largest level)", prec: 1, noRatio: true}
	last := h.cfg.MemLevels[len(h.cfg.MemLevels)-1]
	for _, r := range results[last] {
		if r.Side == sideBroker {
			rw.add(r.Side, float64(r.HelperRSS)/mib)
		}
	}
	rows = append(rows, rw)
	h.report.table("Memory per volume: pre-bound PV/PVC pairs (reclaim Retain) of the driver, provisioner or broker RSS once steady", rows, "")
	return nil
}

// memoryRun starts a side against the cluster as it is, waits until its RSS
// is steady (informers listed and processed everything) and measures it.
func (h *Harness) memoryRun(ctx context.Context, side string, level, rep int) (*memResult, error) {
	tag := dnsName("m", fmt.Sprint(level), short(side), fmt.Sprint(rep))
	drv, err := h.startDriver(ctx, tag, benchDriver)
	if err != nil {
		return nil, err
	}
	defer drv.proc.stop(5 * time.Second)
	d, err := h.deploy(ctx, side, deployOpts{tag: tag, drivers: []*driverInst{drv}, rate: rate{5, 10}})
	if err != nil {
		return nil, err
	}
	defer d.stop()
	p := d.controllers[0]
	// Steady: at least 8s after start, and the last three 1s samples of RSS
	// and CPU time unchanged within 1% and 20ms.
	var rss []int64
	var cpu []float64
	deadline := time.Now().Add(90 * time.Second)
	for {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(time.Second):
		}
		if err := d.died(); err != nil {
			return nil, err
		}
		r, _, _ := p.memory()
		c, _ := p.cpuSeconds()
		rss, cpu = append(rss, r), append(cpu, c)
		if time.Since(p.started) >= 8*time.Second && len(rss) >= 3 && steady(rss[len(rss)-3:], cpu[len(cpu)-3:]) {
			break
		}
		if time.Now().After(deadline) {
			h.logf("  %s: RSS not steady after 90s; taking the last sample", p.name)
			break
		}
	}
	r := &memResult{Side: side, Rep: rep, Pairs: level, Seconds: time.Since(p.started).Seconds()}
	r.RSS, r.HWM = memory(d.controllers)
	r.CPU, _ = p.cpuSeconds()
	if ss, err := scrape(ctx, d.metrics[0], "go_memstats_heap_inuse_bytes"); err == nil && len(ss) > 0 {
		r.HeapInuse = int64(ss[0].value)
	}
	if m, err := p.smaps(); err == nil {
		r.Anon = m.anon
	}
	r.HelperRSS, _ = memory(d.helpers)
	return r, nil
}

func steady(rss []int64, cpu []float64) bool {
	lo, hi := rss[0], rss[0]
	for _, v := range rss {
		lo, hi = min(lo, v), max(hi, v)
	}
	return float64(hi-lo) <= 0.01*float64(hi) && cpu[len(cpu)-1]-cpu[0] <= 0.02
}
