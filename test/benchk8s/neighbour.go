package main

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/csibroker/csibroker/internal/testenv"
)

// The neighbour scenario's two drivers, their classes (Retain: the harness
// removes the volumes itself, fast, whatever the side left) and, for
// garbage, the topology key driver A's CSINode lists.
const (
	neighbourA      = "bench-a.csibroker.io"
	neighbourB      = "bench-b.csibroker.io"
	neighbourZone   = "bench.csibroker.io/zone"
	neighbourNode   = "bench-node-1"
	neighbourClassA = "neighbour-a"
	neighbourClassB = "neighbour-b"
)

// neighbourResult is one run of the neighbour scenario: one side, one mode.
type neighbourResult struct {
	Side string `json:"side"`
	Mode string `json:"mode"`
	Rep  int    `json:"rep"`
	// Seconds from creating each of B's claims to its being Bound.
	Alone  []float64 `json:"b_alone_seconds"`
	Beside []float64 `json:"b_beside_a_seconds"`
	// The provisioner's part of each: from kube-controller-manager's
	// annotation of the claim to its PV.
	AloneProv  []float64 `json:"b_alone_provisioner_seconds"`
	BesideProv []float64 `json:"b_beside_a_provisioner_seconds"`
	// ACalls is how many CreateVolume calls A's driver had received when
	// B's claims beside A began; APending how many of A's claims were not
	// Bound when the last of them was.
	ACalls   int `json:"a_createvolume_calls"`
	APending int `json:"a_pending_at_end"`
}

// aDriverFlags is what driver A's sample driver is started with in a mode:
// -v 1 always (its CreateVolume requests are counted from its log).
func aDriverFlags(mode string) []string {
	flags := []string{"-v", "1"}
	switch mode {
	case modeHang:
		// Cut short by the caller's timeout (csibroker's call timeout,
		// external-provisioner's --timeout 10s), then asked again.
		flags = append(flags, "--fault", "CreateVolume=latency:10h")
	case modeGarbage:
		// The volume is placed in this segment, and the answer names it
		// whole: "bad!key" is no label key, so the answer is refused.
		flags = append(flags, "--controller-segment", neighbourZone+"=z1,bad!key=x")
	}
	return flags
}

// scenarioNeighbour (issue 35): while driver A has many claims pending,
// B's claims one at a time, against B's alone in the same run; A answers
// normally (its backlog waits for its budget), hangs every CreateVolume,
// or answers every CreateVolume with a volume that must be refused. For
// the sidecars, A and B have an external-provisioner each: separate
// processes, the reference.
func (h *Harness) scenarioNeighbour(ctx context.Context) error {
	for class, drv := range map[string]string{neighbourClassA: neighbourA, neighbourClassB: neighbourB} {
		if err := h.ensureStorageClass(ctx, class, drv, corev1.PersistentVolumeReclaimRetain); err != nil {
			return err
		}
	}
	// With garbage, A advertises topology: Immediate claims get the
	// cluster's topology (both sides' default --immediate-topology), which
	// needs a node whose CSINode lists A with the key.
	if _, err := h.env.AddNodes(ctx, testenv.NodeSpec{Name: neighbourNode, Labels: map[string]string{neighbourZone: "z1"}}); err != nil {
		return err
	}
	if err := h.env.AddCSINode(ctx, neighbourNode, neighbourA, "node-1", []string{neighbourZone}); err != nil {
		return err
	}
	for _, mode := range h.cfg.NeighbourModes {
		var runs []*neighbourResult
		for rep := range h.cfg.Reps {
			for _, side := range sidesInOrder(rep) {
				r, err := h.neighbourRun(ctx, side, mode, rep)
				if err != nil {
					return fmt.Errorf("%s, A %s, rep %d: %w", side, mode, rep+1, err)
				}
				h.logf("  %-20s A %-7s rep %d: B to Bound, median %.2fs alone, %.2fs beside A; slowest %.2fs alone, %.2fs beside A (A: %d CreateVolume calls before, %d claims pending after)",
					side, mode, rep+1, median(r.Alone), median(r.Beside), percentile(r.Alone, 100), percentile(r.Beside, 100), r.ACalls, r.APending)
				runs = append(runs, r)
				h.report.addRun(map[string]any{"scenario": "neighbour", "result": r})
			}
		}
		h.neighbourTable(mode, runs)
		h.report.flush(h.out)
	}
	return nil
}

func (h *Harness) neighbourRun(ctx context.Context, side, mode string, rep int) (*neighbourResult, error) {
	tag := dnsName("n", mode, short(side), "r"+fmt.Sprint(rep))
	nsA, nsB := tag+"-a", tag+"-b"
	for _, ns := range []string{nsA, nsB} {
		if err := h.createNamespace(ctx, ns); err != nil {
			return nil, err
		}
		defer h.deleteNamespace(context.WithoutCancel(ctx), ns)
	}
	a, err := h.startDriverWith(ctx, tag, neighbourA, aDriverFlags(mode)...)
	if err != nil {
		return nil, err
	}
	defer a.proc.stop(5 * time.Second)
	b, err := h.startDriverWith(ctx, tag, neighbourB)
	if err != nil {
		return nil, err
	}
	defer b.proc.stop(5 * time.Second)
	trA, err := h.newTracker(ctx, nsA, "")
	if err != nil {
		return nil, err
	}
	defer trA.stop()
	trB, err := h.newTracker(ctx, nsB, "")
	if err != nil {
		return nil, err
	}
	defer trB.stop()

	d, err := h.deploy(ctx, side, deployOpts{tag: tag, drivers: []*driverInst{a, b}, rate: sidecarDefaults})
	if err != nil {
		return nil, err
	}
	// The volumes are removed once the side has stopped.
	defer func() {
		d.stop()
		_ = h.removeVolumes(context.WithoutCancel(ctx), nsA)
		_ = h.removeVolumes(context.WithoutCancel(ctx), nsB)
		_ = h.forgetIntents(context.WithoutCancel(ctx))
	}()
	classA, classB := neighbourClassA, neighbourClassB
	// B's first claim, not counted, waits for the side to start.
	probeTimeout := 5 * time.Minute
	if _, err := h.boundInTurn(ctx, trB, nsB, "warm", classB, 1, 0, probeTimeout, d.died); err != nil {
		return nil, err
	}
	r := &neighbourResult{Side: side, Mode: mode, Rep: rep}
	probes := h.cfg.NeighbourProbes
	alone, err := h.boundInTurn(ctx, trB, nsB, "alone", classB, probes, 1, probeTimeout, d.died)
	if err != nil {
		return nil, err
	}
	r.Alone, r.AloneProv = alone.bound, alone.prov

	// A's backlog, and A at work on it.
	n := h.cfg.NeighbourClaims
	if err := h.createClaims(ctx, nsA, "a", classA, n); err != nil {
		return nil, err
	}
	working := min(20, n)
	if err := pollUntil(ctx, 2*time.Minute, fmt.Sprintf("driver A asked for %d volumes", working), func() (bool, error) {
		if err := d.died(); err != nil {
			return false, err
		}
		c, err := createVolumeCalls(a)
		r.ACalls = c
		return c >= working, err
	}); err != nil {
		return nil, err
	}
	beside, err := h.boundInTurn(ctx, trB, nsB, "beside", classB, probes, 1+probes, probeTimeout, d.died)
	if err != nil {
		return nil, err
	}
	r.Beside, r.BesideProv = beside.bound, beside.prov
	s := trA.snapshot()
	r.APending = n - s.bound
	if r.APending == 0 {
		return nil, fmt.Errorf("driver A had no claim pending any more when B's last claim was Bound: raise -neighbour-claims")
	}
	return r, nil
}

// sideRow is one figure of side's runs, alone against beside A.
func sideRow(runs []*neighbourResult, side, label string, prec int, fig func(r *neighbourResult) (alone, beside float64)) *row {
	rw := &row{label: side + ": " + label, prec: prec}
	for _, r := range runs {
		if r.Side == side {
			alone, beside := fig(r)
			rw.sidecar = append(rw.sidecar, alone)
			rw.broker = append(rw.broker, beside)
		}
	}
	return rw
}

func (h *Harness) neighbourTable(mode string, runs []*neighbourResult) {
	what := map[string]string{
		modeBusy:    "answers normally (its claims wait for its client budget)",
		modeHang:    "hangs every CreateVolume (sample driver fault CreateVolume=latency:10h; each call ends at the caller's timeout)",
		modeGarbage: "answers every CreateVolume with a volume whose accessible topology has a key that is no label key (refused: csiparams.CheckCreatedVolume)",
	}[mode]
	title := fmt.Sprintf("Noisy neighbour (issue 35): driver A %s with %d claims pending; driver B's claims one after another, %d alone then %d beside A; "+
		"client QPS/burst %s per driver (csibroker: its defaults)", what, h.cfg.NeighbourClaims, h.cfg.NeighbourProbes, h.cfg.NeighbourProbes, sidecarDefaults)
	// Per side: B beside A against B alone (want within 2×); the
	// provisioner's part is the side's own (kube-controller-manager's is
	// shared).
	var within []*row
	for _, side := range []string{sideSidecar, sideBroker} {
		within = append(within,
			sideRow(runs, side, "B's median seconds to Bound", 2, func(r *neighbourResult) (float64, float64) {
				return median(r.Alone), median(r.Beside)
			}),
			sideRow(runs, side, "B's slowest seconds to Bound", 2, func(r *neighbourResult) (float64, float64) {
				return percentile(r.Alone, 100), percentile(r.Beside, 100)
			}),
			sideRow(runs, side, "B's median seconds, claim annotated by kube-controller-manager → PV", 3, func(r *neighbourResult) (float64, float64) {
				return median(r.AloneProv), median(r.BesideProv)
			}))
	}
	h.report.tableOf(title, within, "B alone", "B beside A", "beside/alone")
	// Across sides.
	figs := []struct {
		label string
		prec  int
		v     func(r *neighbourResult) float64
	}{
		{"B alone: median seconds to Bound", 2, func(r *neighbourResult) float64 { return median(r.Alone) }},
		{"B beside A: median seconds to Bound", 2, func(r *neighbourResult) float64 { return median(r.Beside) }},
		{"A: CreateVolume calls received when B's claims beside it began", 0, func(r *neighbourResult) float64 { return float64(r.ACalls) }},
		{"A: claims pending when B's last claim was Bound", 0, func(r *neighbourResult) float64 { return float64(r.APending) }},
	}
	var rows []*row
	for _, f := range figs {
		rw := &row{label: f.label, prec: f.prec}
		for _, r := range runs {
			rw.add(r.Side, f.v(r))
		}
		rows = append(rows, rw)
	}
	h.report.table(fmt.Sprintf("Noisy neighbour, A %s: the two sides", mode), rows, "2 external-provisioners")
}
