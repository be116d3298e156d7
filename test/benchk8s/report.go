package main

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/csibroker/csibroker/internal/testenv"
)

// Side names as printed.
const (
	sideSidecar = "external-provisioner"
	sideBroker  = "csibroker"
	// sideFloor is test/benchk8s/minprov (-floor): external-provisioner's
	// API calls through client-go and nothing else.
	sideFloor = "minimal client-go provisioner"
)

// report collects tables as the scenarios finish and prints them.
type report struct {
	mu      sync.Mutex
	pending strings.Builder
	runs    []map[string]any // every run's figures, for -json
}

func newReport() *report { return &report{} }

func (r *report) printf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	fmt.Fprintf(&r.pending, format, args...)
}

func (r *report) flush(w io.Writer) {
	r.mu.Lock()
	defer r.mu.Unlock()
	io.WriteString(w, r.pending.String())
	r.pending.Reset()
}

func (r *report) addRun(m map[string]any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.runs = append(r.runs, m)
}

func (r *report) header(h *Harness) {
	r.printf("# csibroker vs the CSI sidecars on a local control plane\n\n")
	r.printf("- date: %s\n", time.Now().UTC().Format("2006-01-02 15:04 UTC"))
	r.printf("- machine: %s\n", machine())
	r.printf("- control plane: etcd v3.6.8, kube-apiserver and kube-controller-manager v1.36.3 (controller-manager client QPS 2000/4000), audit log at Metadata level\n")
	r.printf("- sidecars: external-provisioner v6.3.0, external-attacher v4.13.0, csi-snapshotter and snapshot-controller %s; csibroker: %s\n", testenv.SnapshotterVersion, h.rev)
	r.printf("- csibroker: --policy-mode %s, tracing %s, one proxy per driver over mTLS (%s); sidecars on the driver socket\n",
		h.cfg.PolicyMode, map[bool]string{true: "exported over OTLP/HTTP to a sink", false: "spans made, not exported"}[h.cfg.Tracing],
		map[bool]string{true: "csibroker-proxy, the proxy built alone", false: "`csibroker proxy`"}[h.bins.proxy != ""])
	r.printf("- Events: the sidecar sends them through its one client at the setting's QPS/burst; csibroker through its Events client at its default 20/50, or at the setting's QPS/burst where that is higher (the same budget as the sidecar's, so that its Events are sent, and their CPU counted, within the measured window)\n")
	r.printf("- repetitions: %d (provisioning below 50 QPS: %d), sidecar and csibroker alternately (the order flips every repetition)\n", h.cfg.Reps, h.cfg.repsFor(rate{QPS: 1}))
	r.printf("- command: benchk8s %s\n\n", strings.Join(h.args, " "))
}

// row is one measured figure for both sides, one value per repetition
// (NaN where a repetition has none).
type row struct {
	label   string
	prec    int // decimals
	sidecar []float64
	broker  []float64
	noRatio bool
}

func (r *row) add(side string, v float64) {
	if side == sideSidecar {
		r.sidecar = append(r.sidecar, v)
	} else {
		r.broker = append(r.broker, v)
	}
}

// table prints rows as: label | sidecar median [min–max] | csibroker median
// [min–max] | csibroker/sidecar per run | median ratio.
func (r *report) table(title string, rows []*row, sideLabel string) {
	if sideLabel == "" {
		sideLabel = sideSidecar
	}
	r.tableOf(title, rows, sideLabel, "csibroker", "csibroker/sidecar")
}

// tableOf is table with both columns named: left holds row.sidecar, right
// row.broker, and ratio names right/left.
func (r *report) tableOf(title string, rows []*row, left, right, ratio string) {
	var b strings.Builder
	fmt.Fprintf(&b, "\n### %s\n\n", title)
	fmt.Fprintf(&b, "| | %s median [min–max] | %s median [min–max] | %s per run | ratio of medians |\n|---|---|---|---|---|\n", left, right, ratio)
	for _, rw := range rows {
		var ratios []string
		for i := range min(len(rw.sidecar), len(rw.broker)) {
			ratios = append(ratios, fmtRatio(rw.broker[i], rw.sidecar[i]))
		}
		ratioCol, medRatio := strings.Join(ratios, ", "), fmtRatio(median(rw.broker), median(rw.sidecar))
		if rw.noRatio {
			ratioCol, medRatio = "", ""
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s |\n", rw.label, fmtStats(rw.sidecar, rw.prec), fmtStats(rw.broker, rw.prec), ratioCol, medRatio)
	}
	r.printf("%s", b.String())
}

func fmtStats(v []float64, prec int) string {
	v = finite(v)
	if len(v) == 0 {
		return "–"
	}
	if len(v) == 1 {
		return fmtNum(v[0], prec)
	}
	return fmt.Sprintf("%s [%s–%s]", fmtNum(median(v), prec), fmtNum(slices.Min(v), prec), fmtNum(slices.Max(v), prec))
}

func fmtNum(v float64, prec int) string { return fmt.Sprintf("%.*f", prec, v) }

func fmtRatio(a, b float64) string {
	if math.IsNaN(a) || math.IsNaN(b) || b == 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f", a/b)
}

func finite(v []float64) []float64 {
	var out []float64
	for _, x := range v {
		if !math.IsNaN(x) && !math.IsInf(x, 0) {
			out = append(out, x)
		}
	}
	return out
}

func median(v []float64) float64 {
	v = finite(v)
	if len(v) == 0 {
		return math.NaN()
	}
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

const mib = 1024 * 1024

// sidesInOrder alternates which side goes first, repetition by repetition.
func sidesInOrder(rep int) []string {
	if rep%2 == 0 {
		return []string{sideSidecar, sideBroker}
	}
	return []string{sideBroker, sideSidecar}
}
