package main

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// manyResult is one run of the manydrivers scenario for one side.
type manyResult struct {
	Side      string `json:"side"`
	Drivers   int    `json:"drivers"`
	PerDriver int    `json:"claims_per_driver"`
	KCM       string `json:"kube_controller_manager_qps"`
	Rep       int    `json:"rep"`

	BoundSeconds float64 `json:"bound_seconds"` // side started → every claim Bound
	DelSeconds   float64 `json:"del_seconds"`   // claims deleted → every PV gone
	// CPU seconds of every process of the side (provisioners; broker and
	// proxies), while provisioning and while deleting.
	CPUProv float64 `json:"cpu_prov_seconds"`
	CPUDel  float64 `json:"cpu_del_seconds"`
}

// scenarioManyDrivers (issue 35): N drivers, M Immediate claims each,
// created while no provisioner runs, then one external-provisioner per
// driver against one broker and a proxy per driver, all at the sidecars'
// default client QPS 5/10 (the broker's per-driver budget makes that N
// times 5/10). Each -many-claims setting gets its own control plane, with
// kube-controller-manager at the setting's client rate.
func (h *Harness) scenarioManyDrivers(ctx context.Context) error {
	for si, set := range h.cfg.ManySettings {
		// The control plane runScenarios started has kube-controller-
		// manager at 2000/4000: replaced by one at the setting's rate.
		h.stopCluster()
		if err := h.startClusterKCM(ctx, fmt.Sprintf("manydrivers-%d", si+1), set.KCM); err != nil {
			return err
		}
		for _, n := range h.cfg.ManyDrivers {
			names := make([]string, n)
			for i := range names {
				names[i] = fmt.Sprintf("bench-%d.csibroker.io", i+1)
				if err := h.ensureStorageClass(ctx, fmt.Sprintf("bench-%d", i+1), names[i], corev1.PersistentVolumeReclaimDelete); err != nil {
					return err
				}
			}
			var runs []*manyResult
			for rep := range h.cfg.Reps {
				for _, side := range sidesInOrder(rep) {
					r, err := h.manyDriversRun(ctx, side, names, set, rep)
					if err != nil {
						return fmt.Errorf("%s, %d drivers × %d claims, kube-controller-manager %s, rep %d: %w", side, n, set.PerDriver, set.KCM, rep+1, err)
					}
					h.logf("  %-20s %d drivers × %d claims, kube-controller-manager %s, rep %d: all Bound in %.1fs, all PVs gone %.1fs after deletion; CPU %.1fs / %.1fs",
						side, n, set.PerDriver, set.KCM, rep+1, r.BoundSeconds, r.DelSeconds, r.CPUProv, r.CPUDel)
					runs = append(runs, r)
					h.report.addRun(map[string]any{"scenario": "manydrivers", "result": r})
				}
			}
			h.manyDriversTable(n, set, runs)
			h.report.flush(h.out)
		}
	}
	return nil
}

func (h *Harness) manyDriversRun(ctx context.Context, side string, names []string, set manySetting, rep int) (*manyResult, error) {
	tag := dnsName("m", fmt.Sprint(len(names)), fmt.Sprint(set.PerDriver), short(side), "r"+fmt.Sprint(rep))
	ns := tag
	if err := h.createNamespace(ctx, ns); err != nil {
		return nil, err
	}
	defer h.deleteNamespace(context.WithoutCancel(ctx), ns)
	drivers, err := h.startDrivers(ctx, tag, names)
	if err != nil {
		return nil, err
	}
	defer stopDrivers(drivers)
	tr, err := h.newTracker(ctx, ns, "")
	if err != nil {
		return nil, err
	}
	defer tr.stop()

	// Every claim exists before the side starts.
	total := len(names) * set.PerDriver
	for i := range names {
		if err := h.createClaims(ctx, ns, fmt.Sprintf("d%d", i+1), fmt.Sprintf("bench-%d", i+1), set.PerDriver); err != nil {
			return nil, err
		}
	}
	if _, err := tr.wait(ctx, 2*time.Minute, "claims created", func(s state) bool { return s.claims == total }, nil); err != nil {
		return nil, err
	}

	d, err := h.deploy(ctx, side, deployOpts{tag: tag, drivers: drivers, rate: sidecarDefaults})
	if err != nil {
		return nil, err
	}
	defer d.stop()
	t0 := d.controllers[0].started
	// Paced by each driver's budget (one PV create per claim) and by the
	// PV binder (about four writes per claim at kube-controller-manager's
	// rate).
	paced := func(perClaim float64) time.Duration {
		s := float64(set.PerDriver)*perClaim/sidecarDefaults.QPS + float64(total)*4/set.KCM.QPS
		return max(4*time.Duration(s*float64(time.Second)), 3*time.Minute)
	}
	tBound, err := tr.wait(ctx, paced(1.5), "every claim Bound", func(s state) bool { return s.pvs >= total && s.bound >= total }, d.died)
	if err != nil {
		return nil, err
	}
	cpuC, cpuH := d.cpu()

	tDel := time.Now()
	if err := h.deleteClaimsEach(ctx, ns); err != nil {
		return nil, err
	}
	tGone, err := tr.wait(ctx, paced(3), "every PV deleted", func(s state) bool { return s.pvs == 0 && s.claims == 0 }, d.died)
	if err != nil {
		return nil, err
	}
	cpuC2, cpuH2 := d.cpu()
	return &manyResult{
		Side: side, Drivers: len(names), PerDriver: set.PerDriver, KCM: set.KCM.String(), Rep: rep,
		BoundSeconds: tBound.Sub(t0).Seconds(), DelSeconds: tGone.Sub(tDel).Seconds(),
		CPUProv: cpuC + cpuH, CPUDel: cpuC2 + cpuH2 - cpuC - cpuH,
	}, nil
}

func (h *Harness) manyDriversTable(n int, set manySetting, runs []*manyResult) {
	total := float64(n * set.PerDriver)
	figs := []struct {
		label string
		prec  int
		v     func(r *manyResult) float64
	}{
		{"seconds, side started → every claim Bound", 1, func(r *manyResult) float64 { return r.BoundSeconds }},
		{"seconds, claims deleted → every PV gone", 1, func(r *manyResult) float64 { return r.DelSeconds }},
		{"claims Bound per second", 2, func(r *manyResult) float64 { return total / r.BoundSeconds }},
		{"CPU seconds, every process of the side, provisioning", 2, func(r *manyResult) float64 { return r.CPUProv }},
		{"CPU seconds, every process of the side, deletion", 2, func(r *manyResult) float64 { return r.CPUDel }},
	}
	var rows []*row
	for _, f := range figs {
		rw := &row{label: f.label, prec: f.prec}
		for _, r := range runs {
			rw.add(r.Side, f.v(r))
		}
		rows = append(rows, rw)
	}
	h.report.table(fmt.Sprintf("Many drivers (issue 35): %d drivers × %d Immediate claims (%d), created before the side starts; client QPS/burst %s per driver "+
		"(csibroker: its defaults, --kube-api-budget per-driver); kube-controller-manager client QPS/burst %s; csibroker = 1 broker + %d proxies",
		n, set.PerDriver, n*set.PerDriver, sidecarDefaults, set.KCM, n), rows, fmt.Sprintf("%d external-provisioners", n))
}
