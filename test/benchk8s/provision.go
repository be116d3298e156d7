package main

import (
	"context"
	"fmt"
	"math"
	"regexp"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// benchDriver is the sample driver's name in the single-driver scenarios.
const benchDriver = "bench.csibroker.io"

// provResult is one provisioning run of one side.
type provResult struct {
	Side string `json:"side"`
	N    int    `json:"n"`
	QPS  string `json:"qps"`
	Rep  int    `json:"rep"`

	PVSeconds    float64 `json:"pv_seconds"`    // start → every PV exists
	BoundSeconds float64 `json:"bound_seconds"` // start → every PV exists and every claim is Bound
	DelSeconds   float64 `json:"del_seconds"`   // claims deleted → every PV gone

	CPUProv       float64 `json:"cpu_prov_seconds"` // controller (provisioner or broker), start → all Bound
	CPUDel        float64 `json:"cpu_del_seconds"`  // controller, during deletion
	HelperCPUProv float64 `json:"helper_cpu_prov_seconds"`
	HelperCPUDel  float64 `json:"helper_cpu_del_seconds"`
	// SwitchesProv counts the controller's context switches, start → all
	// Bound: the thread wake-ups behind the scheduler's share of the CPU.
	SwitchesProv  float64 `json:"ctx_switches_prov"`
	PeakRSS       int64   `json:"peak_rss_bytes"`
	HelperPeakRSS int64   `json:"helper_peak_rss_bytes"`

	APIProv apiCounts `json:"api_prov"`
	APIDel  apiCounts `json:"api_del"`
}

var notDNS = regexp.MustCompile(`[^a-z0-9]+`)

// dnsName makes a DNS-1123 label out of parts.
func dnsName(parts ...string) string {
	return strings.Trim(notDNS.ReplaceAllString(strings.ToLower(strings.Join(parts, "-")), "-"), "-")
}

func short(side string) string {
	switch side {
	case sideSidecar:
		return "s"
	case sideFloor:
		return "f"
	}
	return "b"
}

// clientPrefixes are the user-agent classes of a side's API clients.
func clientPrefixes(side string) []string {
	switch side {
	case sideSidecar:
		return []string{"csi-provisioner", "csi-attacher"}
	case sideFloor:
		return []string{"minprov"}
	}
	return []string{"csibroker"}
}

func (h *Harness) scenarioProvision(ctx context.Context) error {
	const sc = "bench-delete"
	if err := h.ensureStorageClass(ctx, sc, benchDriver, corev1.PersistentVolumeReclaimDelete); err != nil {
		return err
	}
	if err := h.noteRequestMetricLabels(ctx); err != nil {
		return err
	}
	for _, n := range h.cfg.N {
		for _, q := range h.cfg.QPS {
			var runs []*provResult
			for rep := range h.cfg.repsFor(q) {
				sides := sidesInOrder(rep)
				if h.cfg.Floor {
					sides = append(sides, sideFloor)
				}
				for _, side := range sides {
					r, err := h.provisionRun(ctx, sc, side, n, q, rep, false)
					if err != nil {
						return fmt.Errorf("%s N=%d QPS %s rep %d: %w", side, n, q, rep+1, err)
					}
					h.logf("  %-20s N=%d QPS %-7s rep %d: %.2f volumes/s, %.2f deletions/s, %.2f ms CPU/volume, peak RSS %.1f MiB, writes/volume %.2f (events %.2f)",
						side, n, q, rep+1, float64(n)/r.BoundSeconds, float64(n)/r.DelSeconds, r.CPUProv/float64(n)*1000, float64(r.PeakRSS)/mib,
						float64(r.APIProv.total(writeVerbs, "events"))/float64(n), float64(r.APIProv.total(writeVerbs)-r.APIProv.total(writeVerbs, "events"))/float64(n))
					runs = append(runs, r)
					h.provResults = append(h.provResults, r)
					h.report.addRun(map[string]any{"scenario": "provision", "result": r})
				}
			}
			h.provisionTable(n, q, runs)
			if h.cfg.Floor {
				h.floorTable(n, q, runs)
			}
			if h.cfg.Perf {
				stripped := h.bins.csibroker
				h.bins.csibroker = h.bins.csibrokerSyms
				_, err := h.provisionRun(ctx, sc, sideBroker, n, q, h.cfg.repsFor(q), true)
				h.bins.csibroker = stripped
				if err != nil {
					return fmt.Errorf("csibroker N=%d QPS %s under perf: %w", n, q, err)
				}
			}
			h.report.flush(h.out)
		}
	}
	return nil
}

func (h *Harness) provisionRun(ctx context.Context, sc, side string, n int, q rate, rep int, profile bool) (_ *provResult, err error) {
	tag := dnsName("p", fmt.Sprint(n), short(side), q.String(), "r"+fmt.Sprint(rep))
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

	// The claims exist before the provisioner starts.
	if err := h.createClaims(ctx, ns, "c", sc, n); err != nil {
		return nil, err
	}
	if _, err := tr.wait(ctx, time.Minute, "claims created", func(s state) bool { return s.claims == n }, nil); err != nil {
		return nil, err
	}
	mark0 := h.audit.settle(ctx, 300*time.Millisecond, 5*time.Second)

	d, err := h.deploy(ctx, side, deployOpts{tag: tag, drivers: []*driverInst{drv}, rate: q})
	if err != nil {
		return nil, err
	}
	defer d.stop()
	t0 := d.controllers[0].started
	var perf *perfRecord
	if profile {
		if perf, err = h.startPerf(tag, d.controllers[0]); err != nil {
			return nil, err
		}
		defer perf.stop()
	}
	// One write per volume at q QPS, plus the PV binder's work.
	timeout := timeoutFor(n, q.QPS, 1.5)
	tPV, err := tr.wait(ctx, timeout, "every PV", func(s state) bool { return s.pvs >= n }, d.died)
	if err != nil {
		return nil, err
	}
	tBound, err := tr.wait(ctx, timeout, "every claim Bound", func(s state) bool { return s.pvs >= n && s.bound >= n }, d.died)
	if err != nil {
		return nil, err
	}
	cpuC, cpuH := d.cpu()
	swC := d.switches()
	mark1 := h.audit.mark()
	if perf != nil {
		top, err := perf.finish(ctx)
		if err != nil {
			return nil, err
		}
		h.report.printf("\ncsibroker under perf (an extra run, not counted above; %.2f ms CPU per volume under perf), start → all Bound, hottest functions (self; then cumulative):\n\n```\n%s```\n", cpuC/float64(n)*1000, top)
	}

	tDel := time.Now()
	if err := h.deleteClaims(ctx, ns); err != nil {
		return nil, err
	}
	tGone, err := tr.wait(ctx, timeoutFor(n, q.QPS, 3), "every PV deleted", func(s state) bool { return s.pvs == 0 && s.claims == 0 }, d.died)
	if err != nil {
		return nil, err
	}
	cpuC2, cpuH2 := d.cpu()
	_, hwmC := memory(d.controllers)
	_, hwmH := memory(d.helpers)
	d.stop()
	mark2 := h.audit.settle(ctx, 300*time.Millisecond, 5*time.Second)

	r := &provResult{
		Side: side, N: n, QPS: q.String(), Rep: rep,
		PVSeconds: tPV.Sub(t0).Seconds(), BoundSeconds: tBound.Sub(t0).Seconds(), DelSeconds: tGone.Sub(tDel).Seconds(),
		CPUProv: cpuC, CPUDel: cpuC2 - cpuC, SwitchesProv: float64(swC), HelperCPUProv: cpuH, HelperCPUDel: cpuH2 - cpuH,
		PeakRSS: hwmC, HelperPeakRSS: hwmH,
	}
	evProv, err := h.audit.read(mark0, mark1)
	if err != nil {
		return nil, err
	}
	evDel, err := h.audit.read(mark1, mark2)
	if err != nil {
		return nil, err
	}
	r.APIProv = countAPI(evProv, clientPrefixes(side)...)
	r.APIDel = countAPI(evDel, clientPrefixes(side)...)
	return r, nil
}

func (h *Harness) provisionTable(n int, q rate, runs []*provResult) {
	fn := float64(n)
	type fig struct {
		label   string
		prec    int
		v       func(r *provResult) float64
		noRatio bool
	}
	nonEvent := func(c apiCounts) float64 { return float64(c.total(writeVerbs, "events")) }
	events := func(c apiCounts) float64 { return float64(c.total(writeVerbs) - c.total(writeVerbs, "events")) }
	figs := []fig{
		{"volumes/s (start → all PVs exist and all claims Bound)", 2, func(r *provResult) float64 { return fn / r.BoundSeconds }, false},
		{"seconds to all PVs", 2, func(r *provResult) float64 { return r.PVSeconds }, false},
		{"deletions/s (claims deleted → all PVs gone)", 2, func(r *provResult) float64 { return fn / r.DelSeconds }, false},
		{"CPU ms per volume, provisioner/broker (start → all Bound)", 2, func(r *provResult) float64 { return r.CPUProv / fn * 1000 }, false},
		{"context switches per volume, provisioner/broker threads (start → all Bound)", 1, func(r *provResult) float64 { return r.SwitchesProv / fn }, false},
		{"CPU ms per volume, + proxy", 2, func(r *provResult) float64 { return (r.CPUProv + r.HelperCPUProv) / fn * 1000 }, false},
		{"CPU ms per deletion, provisioner/broker", 2, func(r *provResult) float64 { return r.CPUDel / fn * 1000 }, false},
		{"CPU ms per deletion, + proxy", 2, func(r *provResult) float64 { return (r.CPUDel + r.HelperCPUDel) / fn * 1000 }, false},
		{"peak RSS MiB, provisioner/broker", 1, func(r *provResult) float64 { return float64(r.PeakRSS) / mib }, false},
		{"peak RSS MiB, + proxy", 1, func(r *provResult) float64 { return float64(r.PeakRSS+r.HelperPeakRSS) / mib }, false},
		{"API requests per volume (provisioning, all verbs)", 2, func(r *provResult) float64 { return float64(r.APIProv.total(nil)) / fn }, false},
		{"API writes per volume, objects (not Events)", 2, func(r *provResult) float64 { return nonEvent(r.APIProv) / fn }, false},
		{"API writes per volume, Events", 2, func(r *provResult) float64 { return events(r.APIProv) / fn }, false},
		{"API requests per deletion (all verbs)", 2, func(r *provResult) float64 { return float64(r.APIDel.total(nil)) / fn }, false},
		{"API writes per deletion, objects (not Events)", 2, func(r *provResult) float64 { return nonEvent(r.APIDel) / fn }, false},
		{"API writes per deletion, Events", 2, func(r *provResult) float64 { return events(r.APIDel) / fn }, false},
		{"API writes per volume, whole create+delete cycle, objects", 2, func(r *provResult) float64 { return (nonEvent(r.APIProv) + nonEvent(r.APIDel)) / fn }, false},
		{"API writes per volume, whole cycle, Events (what was sent before the process stopped)", 2, func(r *provResult) float64 { return (events(r.APIProv) + events(r.APIDel)) / fn }, false},
	}
	var rows []*row
	for _, f := range figs {
		rw := &row{label: f.label, prec: f.prec, noRatio: f.noRatio}
		for _, side := range []string{sideSidecar, sideBroker} {
			for _, r := range runs {
				if r.Side == side {
					rw.add(side, f.v(r))
				}
			}
		}
		rows = append(rows, rw)
	}
	h.report.table(fmt.Sprintf("Provisioning: N=%d Immediate claims, client QPS/burst %s, %d worker threads", n, q, h.cfg.WorkerThreads), rows, "")
	// The request mix of each side's median run (by volumes/s).
	for _, side := range []string{sideSidecar, sideBroker} {
		var mine []*provResult
		for _, r := range runs {
			if r.Side == side {
				mine = append(mine, r)
			}
		}
		if len(mine) == 0 {
			continue
		}
		slices.SortFunc(mine, func(a, b *provResult) int { return cmpFloat(a.BoundSeconds, b.BoundSeconds) })
		m := mine[len(mine)/2]
		h.report.printf("\n%s, requests of run %d (N=%d): provisioning: %s (by client: %s); deletion: %s (by client: %s)\n",
			side, m.Rep+1, n, m.APIProv, fmtMap(m.APIProv.ByClient), m.APIDel, fmtMap(m.APIDel.ByClient))
	}
}

// floorTable sets the floor (minprov) beside the sidecar and csibroker:
// CPU and context switches per volume that any client-go provisioner making
// external-provisioner's API calls spends, run by run.
func (h *Harness) floorTable(n int, q rate, runs []*provResult) {
	fn := float64(n)
	figs := []struct {
		label string
		prec  int
		v     func(r *provResult) float64
	}{
		{"CPU ms per volume (start → all Bound)", 2, func(r *provResult) float64 { return r.CPUProv / fn * 1000 }},
		{"context switches per volume (start → all Bound)", 1, func(r *provResult) float64 { return r.SwitchesProv / fn }},
		{"volumes/s (start → all PVs exist and all claims Bound)", 2, func(r *provResult) float64 { return fn / r.BoundSeconds }},
		{"API writes per volume, objects (not Events)", 2, func(r *provResult) float64 { return float64(r.APIProv.total(writeVerbs, "events")) / fn }},
		{"API writes per volume, Events", 2, func(r *provResult) float64 {
			return float64(r.APIProv.total(writeVerbs)-r.APIProv.total(writeVerbs, "events")) / fn
		}},
	}
	for _, other := range []string{sideSidecar, sideBroker} {
		var rows []*row
		for _, f := range figs {
			rw := &row{label: f.label, prec: f.prec}
			for _, r := range runs {
				switch r.Side {
				case other:
					rw.sidecar = append(rw.sidecar, f.v(r))
				case sideFloor:
					rw.broker = append(rw.broker, f.v(r))
				}
			}
			rows = append(rows, rw)
		}
		h.report.tableOf(fmt.Sprintf("Floor against %s: N=%d Immediate claims, client QPS/burst %s (minprov: the same watches, PV create and two Events through client-go, no CSI call)", other, n, q),
			rows, other, "minprov", "minprov/"+other)
	}
}

func cmpFloat(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	case math.IsNaN(a):
		return -1
	}
	return 0
}

// noteRequestMetricLabels writes into the report which labels
// apiserver_request_total and apiserver_longrunning_requests have on this
// apiserver, i.e. why requests are counted from the audit log.
func (h *Harness) noteRequestMetricLabels(ctx context.Context) error {
	ss, err := h.scrapeAPIServer(ctx, "apiserver_request_total", "apiserver_longrunning_requests")
	if err != nil {
		return err
	}
	labels := map[string][]string{}
	for _, s := range ss {
		if _, ok := labels[s.name]; ok {
			continue
		}
		for k := range s.labels {
			labels[s.name] = append(labels[s.name], k)
		}
		slices.Sort(labels[s.name])
	}
	h.report.printf("API requests are counted per client from the kube-apiserver audit log (user agent of each request: `csi-provisioner/...`, `csi-attacher/...`, `csibroker/<version> (objects|events|leader-election|informers)`), ")
	h.report.printf("because on kube-apiserver %s `apiserver_request_total` has the labels {%s} (no client or user agent) and the control plane has a single admin token. ",
		"v1.36.3", strings.Join(labels["apiserver_request_total"], ", "))
	h.report.printf("`apiserver_longrunning_requests` has {%s}. A WATCH is counted when it starts; every other request when it completes.\n",
		strings.Join(labels["apiserver_longrunning_requests"], ", "))
	return nil
}
