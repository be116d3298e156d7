package main

import (
	"context"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// failoverResult is one failover run of one side.
type failoverResult struct {
	Side            string  `json:"side"`
	Rep             int     `json:"rep"`
	PendingAtKill   int     `json:"pending_at_kill"`
	TakeoverSeconds float64 `json:"takeover_seconds"` // SIGKILL → the standby holds the Lease
	NextPVSeconds   float64 `json:"next_pv_seconds"`  // SIGKILL → the first PV the standby creates
	FinishSeconds   float64 `json:"finish_seconds"`   // SIGKILL → every claim Bound
	LeaseDuration   string  `json:"lease_duration"`
}

func (h *Harness) scenarioFailover(ctx context.Context) error {
	const sc = "bench-failover"
	// Retain, so that the harness can clean up without the side.
	if err := h.ensureStorageClass(ctx, sc, benchDriver, corev1.PersistentVolumeReclaimRetain); err != nil {
		return err
	}
	var runs []*failoverResult
	for rep := range h.cfg.Reps {
		for _, side := range sidesInOrder(rep) {
			r, err := h.failoverRun(ctx, sc, side, rep)
			if err != nil {
				return fmt.Errorf("%s rep %d: %w", side, rep+1, err)
			}
			h.logf("  %-20s failover rep %d: %d claims pending at SIGKILL; standby leads after %.2fs, next PV after %.2fs, all Bound after %.1fs",
				side, rep+1, r.PendingAtKill, r.TakeoverSeconds, r.NextPVSeconds, r.FinishSeconds)
			runs = append(runs, r)
			h.report.addRun(map[string]any{"scenario": "failover", "result": r})
		}
	}
	figs := []struct {
		label string
		v     func(r *failoverResult) float64
	}{
		{"claims pending at SIGKILL", func(r *failoverResult) float64 { return float64(r.PendingAtKill) }},
		{"seconds, SIGKILL → standby holds the Lease", func(r *failoverResult) float64 { return r.TakeoverSeconds }},
		{"seconds, SIGKILL → standby creates the next PV", func(r *failoverResult) float64 { return r.NextPVSeconds }},
		{"seconds, SIGKILL → every claim Bound", func(r *failoverResult) float64 { return r.FinishSeconds }},
	}
	var rows []*row
	for _, f := range figs {
		rw := &row{label: f.label, prec: 2}
		for _, r := range runs {
			rw.add(r.Side, f.v(r))
		}
		rows = append(rows, rw)
	}
	h.report.table(fmt.Sprintf("Failover: two replicas with leader election, %d claims at client QPS %s, SIGKILL the leader once it has created some PVs (each side's default lease timings: external-provisioner 15s/10s/5s, csibroker 3s/2.5s/0.5s)",
		h.cfg.FailoverClaims, h.cfg.FailoverQPS), rows, "")
	return nil
}

func (h *Harness) failoverRun(ctx context.Context, sc, side string, rep int) (*failoverResult, error) {
	tag := dnsName("f", short(side), fmt.Sprint(rep))
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
	tr, err := h.newTracker(ctx, ns, ns)
	if err != nil {
		return nil, err
	}
	defer tr.stop()

	ids := []string{tag + "-a", tag + "-b"}
	d, err := h.deploy(ctx, side, deployOpts{tag: tag, drivers: []*driverInst{drv}, rate: h.cfg.FailoverQPS, leaderElection: true, identities: ids, leaseNS: ns})
	if err != nil {
		return nil, err
	}
	defer d.stop()
	defer func() { _ = h.removeVolumes(context.WithoutCancel(ctx), ns) }()

	// The leader: whoever holds a Lease in ns.
	var lease, leader string
	if _, err := tr.wait(ctx, time.Minute, "a leader", func(s state) bool {
		for l, holder := range s.leaseHolders {
			if slices.Contains(ids, holder) {
				lease, leader = l, holder
				return true
			}
		}
		return false
	}, d.died); err != nil {
		return nil, err
	}
	leaderProc := d.controllers[slices.Index(ids, leader)]

	n := h.cfg.FailoverClaims
	if err := h.createClaims(ctx, ns, "c", sc, n); err != nil {
		return nil, err
	}
	working := max(5, n/10)
	if _, err := tr.wait(ctx, timeoutFor(working, h.cfg.FailoverQPS.QPS, 2), "the leader provisioning", func(s state) bool { return s.pvs >= working }, d.died); err != nil {
		return nil, err
	}
	tKill := time.Now()
	leaderProc.kill()
	atKill := tr.snapshot()
	if atKill.pvs >= n {
		return nil, fmt.Errorf("every claim was provisioned before the leader was killed: raise -failover-claims")
	}
	r := &failoverResult{Side: side, Rep: rep, PendingAtKill: n - atKill.pvs}
	var tLease time.Time
	if _, err := tr.wait(ctx, 2*time.Minute, "the standby to take the Lease", func(s state) bool {
		for _, c := range s.leaseChanges {
			if c.at.After(tKill) && c.lease == lease && c.holder != leader && slices.Contains(ids, c.holder) {
				tLease = c.at
				return true
			}
		}
		return false
	}, nil); err != nil {
		return nil, err
	}
	var tPV time.Time
	if _, err := tr.wait(ctx, 2*time.Minute, "the standby's first PV", func(s state) bool {
		for _, at := range s.pvAdds {
			if at.After(tLease) {
				tPV = at
				return true
			}
		}
		return false
	}, nil); err != nil {
		return nil, err
	}
	tDone, err := tr.wait(ctx, timeoutFor(n, h.cfg.FailoverQPS.QPS, 2), "every claim Bound", func(s state) bool { return s.bound >= n && s.pvs >= n }, nil)
	if err != nil {
		return nil, err
	}
	r.TakeoverSeconds = tLease.Sub(tKill).Seconds()
	r.NextPVSeconds = tPV.Sub(tKill).Seconds()
	r.FinishSeconds = tDone.Sub(tKill).Seconds()
	return r, nil
}
