package main

import (
	"cmp"
	"context"
	"fmt"
	"strconv"
	"time"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapshotclient "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"

	"github.com/csibroker/csibroker/internal/testenv"
)

// The snapshots scenario (issue 33, "Side by side"): N VolumeSnapshots of
// sample-driver claims are created while no snapshotter runs (the real
// snapshot-controller makes their contents), then the side starts: the
// real csi-snapshotter on the driver socket, or csibroker with its proxy.
// Measured: the time from its start until every content is readyToUse,
// then the deletions, the side's CPU and its API requests per snapshot;
// and the final contents of the two sides are compared field by field.

// snapController is the snapshot-controller's client rate: high, as the
// controller-manager's, so that the part both sides share is never the
// limit.
var snapController = rate{2000, 4000}

// snapResult is one snapshots run of one side.
type snapResult struct {
	Side string `json:"side"`
	N    int    `json:"n"`
	QPS  string `json:"qps"`
	Rep  int    `json:"rep"`

	ReadySeconds float64 `json:"ready_seconds"` // side started → every content readyToUse
	DelSeconds   float64 `json:"del_seconds"`   // snapshots deleted → every content gone, the driver holding none

	CPUReady       float64   `json:"cpu_ready_seconds"`  // the snapshotter or broker, start → all ready
	CPUCreate      float64   `json:"cpu_create_seconds"` // start → the contents quiet (what it does after ready too)
	CPUDel         float64   `json:"cpu_del_seconds"`
	HelperCPUReady float64   `json:"helper_cpu_ready_seconds"` // the proxy
	PeakRSS        int64     `json:"peak_rss_bytes"`
	APIReady       apiCounts `json:"api_ready"` // start → the contents quiet
	APIDel         apiCounts `json:"api_del"`
	// SnapshotControllerAPI counts snapshot-controller's requests while
	// the side made the snapshots ready (the same work on both sides).
	SnapshotControllerAPI apiCounts `json:"snapshot_controller_api_ready"`

	contents map[string]*snapshotv1.VolumeSnapshotContent // final, ready
}

// snapLabel names a side of the snapshots scenario.
func snapLabel(side string) string {
	if side == sideSidecar {
		return "csi-snapshotter"
	}
	return side
}

// snapshotClients are the user-agent classes of a side's API clients.
func snapshotClients(side string) []string {
	if side == sideSidecar {
		return []string{"csi-snapshotter"}
	}
	return []string{"csibroker"}
}

func (h *Harness) scenarioSnapshots(ctx context.Context) error {
	if err := h.env.InstallSnapshotCRDs(ctx); err != nil {
		return err
	}
	sc, err := h.snapshotClient()
	if err != nil {
		return err
	}
	h.snaps = sc
	if err := h.ensureSnapshotClass(ctx, benchDriver); err != nil {
		return err
	}
	ctrl, err := h.startSnapshotController(ctx)
	if err != nil {
		return err
	}
	defer ctrl.stop(5 * time.Second)
	n := h.cfg.SnapshotN
	for _, q := range h.cfg.QPS {
		var runs []*snapResult
		for rep := range h.cfg.repsFor(q) {
			for _, side := range sidesInOrder(rep) {
				if !h.cfg.snapshotSide(side) {
					continue
				}
				r, err := h.snapshotRun(ctx, side, n, q, rep, ctrl)
				if err != nil {
					return fmt.Errorf("%s N=%d QPS %s rep %d: %w", side, n, q, rep+1, err)
				}
				h.logf("  %-15s N=%d QPS %-7s rep %d: %.2f snapshots/s ready, %.2f deletions/s, %.2f ms CPU/snapshot, API requests/snapshot %.2f",
					snapLabel(side), n, q, rep+1, float64(n)/r.ReadySeconds, float64(n)/r.DelSeconds, r.CPUReady/float64(n)*1000, float64(r.APIReady.total(nil))/float64(n))
				runs = append(runs, r)
				h.snapResults = append(h.snapResults, r)
				h.report.addRun(map[string]any{"scenario": "snapshots", "result": r})
			}
		}
		h.snapshotTable(n, q, runs)
		h.report.flush(h.out)
	}
	return nil
}

func (h *Harness) snapshotClient() (snapshotclient.Interface, error) {
	cfg := h.env.RESTConfig()
	cfg.QPS, cfg.Burst = 2000, 4000
	cfg.UserAgent = "benchk8s"
	return snapshotclient.NewForConfig(cfg)
}

// startSnapshotController starts the real snapshot-controller (both sides
// use it), at snapController's rate.
func (h *Harness) startSnapshotController(ctx context.Context) (*proc, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	p, err := h.procs.start("snapshot-controller", h.bins.snapshotController, []string{
		"--kubeconfig=" + h.env.Kubeconfig, "--http-endpoint=127.0.0.1:" + strconv.Itoa(port),
		"--kube-api-qps=" + strconv.FormatFloat(snapController.QPS, 'f', -1, 64), "--kube-api-burst=" + strconv.Itoa(snapController.Burst),
		"--worker-threads=" + strconv.Itoa(h.cfg.WorkerThreads), "--feature-gates=CSIVolumeGroupSnapshot=false",
	}, nil)
	if err != nil {
		return nil, err
	}
	return p, waitHTTP(ctx, p, fmt.Sprintf("http://127.0.0.1:%d/metrics", port), 60*time.Second)
}

// startSnapshotter starts the real csi-snapshotter on the driver's socket.
func (h *Harness) startSnapshotter(ctx context.Context, o deployOpts) (*deployment, error) {
	d := &deployment{side: sideSidecar}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	p, err := h.procs.start(o.tag+"-snapshotter", h.bins.snapshotter, []string{
		"--csi-address=" + o.drivers[0].sock, "--kubeconfig=" + h.env.Kubeconfig,
		"--kube-api-qps=" + strconv.FormatFloat(o.rate.QPS, 'f', -1, 64), "--kube-api-burst=" + strconv.Itoa(o.rate.Burst),
		"--worker-threads=" + strconv.Itoa(h.cfg.WorkerThreads), "--http-endpoint=127.0.0.1:" + strconv.Itoa(port),
		"--feature-gates=CSIVolumeGroupSnapshot=false",
	}, nil)
	if err != nil {
		return nil, err
	}
	d.controllers = append(d.controllers, p)
	d.metrics = append(d.metrics, fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
	return d, nil
}

func (h *Harness) snapshotRun(ctx context.Context, side string, n int, q rate, rep int, ctrl *proc) (_ *snapResult, err error) {
	tag := dnsName("sn", fmt.Sprint(n), short(side), q.String(), "r"+fmt.Sprint(rep))
	ns := tag
	if err := h.createNamespace(ctx, ns); err != nil {
		return nil, err
	}
	defer h.cleanSnapshotRun(context.WithoutCancel(ctx), ns)
	drv, err := h.startDriver(ctx, tag, benchDriver)
	if err != nil {
		return nil, err
	}
	defer drv.proc.stop(5 * time.Second)
	if err := h.snapshotSources(ctx, drv, ns, n); err != nil {
		return nil, err
	}
	tr, err := newSnapTracker(ctx, h.snaps, ns)
	if err != nil {
		return nil, err
	}
	defer tr.stop()
	// The snapshots, and their contents, exist before the side starts.
	if err := h.createSnapshots(ctx, ns, n); err != nil {
		return nil, err
	}
	if _, err := tr.wait(ctx, timeoutFor(n, snapController.QPS, 4), "contents made by snapshot-controller", func(s snapState) bool { return s.contents == n }, ctrl.died); err != nil {
		return nil, err
	}
	mark0 := h.audit.settle(ctx, 300*time.Millisecond, 5*time.Second)

	var d *deployment
	if side == sideSidecar {
		d, err = h.startSnapshotter(ctx, deployOpts{tag: tag, drivers: []*driverInst{drv}, rate: q})
	} else {
		d, err = h.deploy(ctx, side, deployOpts{tag: tag, drivers: []*driverInst{drv}, rate: q})
	}
	if err != nil {
		return nil, err
	}
	defer d.stop()
	t0 := d.controllers[0].started
	// A few writes per snapshot at q QPS (content status, annotations,
	// Events), plus snapshot-controller's.
	tReady, err := tr.wait(ctx, timeoutFor(n, q.QPS, 6), "every content readyToUse", func(s snapState) bool { return s.ready >= n }, d.died)
	if err != nil {
		return nil, err
	}
	cpuC, cpuH := d.cpu()
	// The contents as the side leaves them, once it is done with them.
	if err := tr.quiet(ctx, 2*time.Second, time.Minute); err != nil {
		return nil, err
	}
	contents := tr.all()
	cpuQ, _ := d.cpu()
	mark1 := h.audit.mark()

	tDel := time.Now()
	if err := h.deleteSnapshots(ctx, ns); err != nil {
		return nil, err
	}
	tGone, err := tr.wait(ctx, timeoutFor(n, q.QPS, 6), "every content deleted", func(s snapState) bool { return s.contents == 0 }, d.died)
	if err != nil {
		return nil, err
	}
	if left, err := driverSnapshots(ctx, drv); err != nil || left != 0 {
		return nil, fmt.Errorf("after the deletions the driver holds %d snapshots (%v)", left, err)
	}
	cpuD, _ := d.cpu()
	_, hwm := memory(d.controllers)
	d.stop()
	mark2 := h.audit.settle(ctx, 300*time.Millisecond, 5*time.Second)

	r := &snapResult{Side: side, N: n, QPS: q.String(), Rep: rep,
		ReadySeconds: tReady.Sub(t0).Seconds(), DelSeconds: tGone.Sub(tDel).Seconds(),
		CPUReady: cpuC, CPUCreate: cpuQ, CPUDel: cpuD - cpuQ, HelperCPUReady: cpuH, PeakRSS: hwm, contents: contents}
	evReady, err := h.audit.read(mark0, mark1)
	if err != nil {
		return nil, err
	}
	evDel, err := h.audit.read(mark1, mark2)
	if err != nil {
		return nil, err
	}
	r.APIReady = countAPI(evReady, snapshotClients(side)...)
	r.APIDel = countAPI(evDel, snapshotClients(side)...)
	r.SnapshotControllerAPI = countAPI(evReady, "snapshot-controller")
	return r, nil
}

// cleanSnapshotRun removes what a run leaves: its snapshots (their
// contents' finalizers are the snapshotter's, gone with it), claims, PVs
// and namespace.
func (h *Harness) cleanSnapshotRun(ctx context.Context, ns string) {
	_ = h.deleteSnapshots(ctx, ns)
	if err := h.removeVolumes(ctx, ns); err != nil {
		h.logf("clean up %s: %v", ns, err)
	}
	h.deleteNamespace(ctx, ns)
}

func (h *Harness) snapshotTable(n int, q rate, runs []*snapResult) {
	fn := float64(n)
	writes := func(c apiCounts) float64 { return float64(c.total(writeVerbs, "events")) / fn }
	events := func(c apiCounts) float64 { return float64(c.total(writeVerbs)-c.total(writeVerbs, "events")) / fn }
	figs := []struct {
		label string
		prec  int
		v     func(r *snapResult) float64
	}{
		{"snapshots/s (side started → every content readyToUse)", 2, func(r *snapResult) float64 { return fn / r.ReadySeconds }},
		{"seconds to every content readyToUse", 2, func(r *snapResult) float64 { return r.ReadySeconds }},
		{"deletions/s (snapshots deleted → every content gone)", 2, func(r *snapResult) float64 { return fn / r.DelSeconds }},
		{"CPU ms per snapshot, snapshotter/broker (start → all ready)", 2, func(r *snapResult) float64 { return r.CPUReady / fn * 1000 }},
		{"CPU ms per snapshot, snapshotter/broker, until the contents are quiet", 2, func(r *snapResult) float64 { return r.CPUCreate / fn * 1000 }},
		{"CPU ms per snapshot, + proxy", 2, func(r *snapResult) float64 { return (r.CPUReady + r.HelperCPUReady) / fn * 1000 }},
		{"CPU ms per deletion, snapshotter/broker", 2, func(r *snapResult) float64 { return r.CPUDel / fn * 1000 }},
		{"peak RSS MiB, snapshotter/broker", 1, func(r *snapResult) float64 { return float64(r.PeakRSS) / mib }},
		{"API requests per snapshot (start → contents quiet, all verbs)", 2, func(r *snapResult) float64 { return float64(r.APIReady.total(nil)) / fn }},
		{"API writes per snapshot, objects (not Events)", 2, func(r *snapResult) float64 { return writes(r.APIReady) }},
		{"API writes per snapshot, Events", 2, func(r *snapResult) float64 { return events(r.APIReady) }},
		{"API requests per deletion (all verbs)", 2, func(r *snapResult) float64 { return float64(r.APIDel.total(nil)) / fn }},
		{"snapshot-controller API requests per snapshot while the side works", 2, func(r *snapResult) float64 { return float64(r.SnapshotControllerAPI.total(nil)) / fn }},
	}
	var rows []*row
	for _, f := range figs {
		rw := &row{label: f.label, prec: f.prec}
		for _, r := range runs {
			rw.add(r.Side, f.v(r))
		}
		rows = append(rows, rw)
	}
	h.report.table(fmt.Sprintf("Snapshots: N=%d VolumeSnapshots made while no snapshotter ran, client QPS/burst %s, %d worker threads (snapshot-controller %s)", n, q, h.cfg.WorkerThreads, snapController),
		rows, "csi-snapshotter "+testenv.SnapshotterVersion)
	var a, b *snapResult
	for _, r := range runs {
		if r.Side == sideSidecar && a == nil {
			a = r
		}
		if r.Side == sideBroker && b == nil {
			b = r
		}
		h.report.printf("\n%s, requests of run %d: creation: %s (by client: %s); deletion: %s\n", snapLabel(r.Side), r.Rep+1, r.APIReady, fmtMap(r.APIReady.ByClient), r.APIDel)
	}
	if a != nil && b != nil {
		if d := h.compareTable(fmt.Sprintf("Final VolumeSnapshotContents, field by field (N=%d, QPS %s, first run of each side)", n, q), a.contents, b.contents); d > 0 {
			h.logf("  the final contents differ in %d fields (see the report)", d)
		}
	} else if one := cmp.Or(a, b); one != nil {
		h.fieldsTable(fmt.Sprintf("Final VolumeSnapshotContents of %s (N=%d, QPS %s; the other side not run)", snapLabel(one.Side), n, q), snapLabel(one.Side), one.contents)
	}
}
