package main

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/internal/testenv"
)

// benchNode is the fake node volumes are attached to with -attach.
const benchNode = "bench-node-1"

// driversResult is one run of the many-drivers scenario for one side.
type driversResult struct {
	Side        string         `json:"side"`
	Rep         int            `json:"rep"`
	RSS         int64          `json:"rss_bytes"` // every process of the side, VmRSS after settling
	ControlRSS  int64          `json:"controllers_rss_bytes"`
	HelperRSS   int64          `json:"helpers_rss_bytes"`
	PerProcess  map[string]int `json:"rss_mib_per_process"`
	PerAnon     map[string]int `json:"rss_anon_mib_per_process"`
	Watches     int            `json:"watches"`        // from the audit log, this side's clients
	WatchGauge  int            `json:"watches_gauge"`  // apiserver_longrunning_requests{verb=WATCH}, delta from before the side started
	WatchByKind map[string]int `json:"watch_by_kind"`  // held, by resource
	WatchStarts map[string]int `json:"watch_starts"`   // started since the side started, by resource
	PSS         int64          `json:"pss_bytes"`      // proportional set size: shared binary pages split among sharers
	Anon        int64          `json:"rss_anon_bytes"` // anonymous RSS (heap, stacks)
	Attached    int            `json:"attached"`
}

func (h *Harness) driverNames() []string {
	names := make([]string, h.cfg.Drivers)
	for i := range names {
		names[i] = fmt.Sprintf("bench-%d.csibroker.io", i+1)
	}
	return names
}

func (h *Harness) scenarioDrivers(ctx context.Context) error {
	names := h.driverNames()
	for i, n := range names {
		if err := h.ensureStorageClass(ctx, fmt.Sprintf("bench-%d", i+1), n, corev1.PersistentVolumeReclaimDelete); err != nil {
			return err
		}
	}
	if h.cfg.Attach {
		if _, err := h.env.AddNodes(ctx, testenv.NodeSpec{Name: benchNode}); err != nil {
			return err
		}
		for _, n := range names {
			if err := h.env.AddCSINode(ctx, benchNode, n, "node-1", nil); err != nil {
				return err
			}
		}
	}
	var runs []*driversResult
	for rep := range h.cfg.Reps {
		for _, side := range sidesInOrder(rep) {
			r, err := h.driversRun(ctx, side, names, rep)
			if err != nil {
				return fmt.Errorf("%s rep %d: %w", side, rep+1, err)
			}
			h.logf("  %-20s %d drivers rep %d: RSS %.1f MiB (controllers %.1f, helpers %.1f), WATCH held %d (gauge delta %d) %v",
				side, len(names), rep+1, float64(r.RSS)/mib, float64(r.ControlRSS)/mib, float64(r.HelperRSS)/mib, r.Watches, r.WatchGauge, r.WatchByKind)
			runs = append(runs, r)
			h.report.addRun(map[string]any{"scenario": "drivers", "result": r})
		}
	}
	sideLabel := fmt.Sprintf("%d external-provisioners", len(names))
	helpers := "proxies"
	if h.cfg.Attach {
		sideLabel += fmt.Sprintf(" + %d external-attachers", len(names))
	}
	figs := []struct {
		label string
		prec  int
		v     func(r *driversResult) float64
	}{
		{"total RSS MiB (every process of the side)", 1, func(r *driversResult) float64 { return float64(r.RSS) / mib }},
		{"total PSS MiB (pages of a shared binary split among its processes)", 1, func(r *driversResult) float64 { return float64(r.PSS) / mib }},
		{"total anonymous RSS MiB (heap, stacks; not the binaries' pages)", 1, func(r *driversResult) float64 { return float64(r.Anon) / mib }},
		{"RSS MiB, provisioners / broker", 1, func(r *driversResult) float64 { return float64(r.ControlRSS) / mib }},
		{"RSS MiB, attachers / " + helpers, 1, func(r *driversResult) float64 { return float64(r.HelperRSS) / mib }},
		{"WATCH requests held (audit log, by user agent)", 0, func(r *driversResult) float64 { return float64(r.Watches) }},
		{"WATCH requests held (apiserver_longrunning_requests delta)", 0, func(r *driversResult) float64 { return float64(r.WatchGauge) }},
	}
	var rows []*row
	for _, f := range figs {
		rw := &row{label: f.label, prec: f.prec}
		for _, r := range runs {
			rw.add(r.Side, f.v(r))
		}
		rows = append(rows, rw)
	}
	attach := "no attach (pass -attach for external-attachers and VolumeAttachments)"
	if h.cfg.Attach {
		attach = "every volume attached to a node through a VolumeAttachment"
	}
	h.report.table(fmt.Sprintf("Many drivers: %d drivers, %d Bound claims each, %s; csibroker = 1 broker + %d proxies", len(names), h.cfg.ClaimsPerDriver, attach, len(names)), rows, sideLabel)
	for _, side := range []string{sideSidecar, sideBroker} {
		for _, r := range runs {
			if r.Side == side {
				h.report.printf("\n%s (run %d): WATCH requests held by resource: %s (started: %s); RSS MiB by process: %s; anonymous RSS MiB by process: %s\n", side, r.Rep+1, fmtMap(r.WatchByKind), fmtMap(r.WatchStarts), fmtMap(r.PerProcess), fmtMap(r.PerAnon))
				break
			}
		}
	}
	return nil
}

func fmtMap(m map[string]int) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(parts, ", ")
}

func (h *Harness) driversRun(ctx context.Context, side string, names []string, rep int) (*driversResult, error) {
	tag := dnsName("d", short(side), fmt.Sprint(rep))
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

	gauge0, err := h.watchesHeld(ctx)
	if err != nil {
		return nil, err
	}
	mark0 := h.audit.settle(ctx, 300*time.Millisecond, 5*time.Second)
	q := rate{200, 400}
	d, err := h.deploy(ctx, side, deployOpts{tag: tag, drivers: drivers, rate: q, attach: h.cfg.Attach})
	if err != nil {
		return nil, err
	}
	defer d.stop()
	for i := range names {
		if err := h.createClaims(ctx, ns, fmt.Sprintf("d%d", i+1), fmt.Sprintf("bench-%d", i+1), h.cfg.ClaimsPerDriver); err != nil {
			return nil, err
		}
	}
	total := len(names) * h.cfg.ClaimsPerDriver
	if _, err := tr.wait(ctx, timeoutFor(total, q.QPS, 2), "every claim Bound", func(s state) bool { return s.bound >= total && s.pvs >= total }, d.died); err != nil {
		return nil, err
	}
	r := &driversResult{Side: side, Rep: rep}
	if h.cfg.Attach {
		n, err := h.attachAll(ctx, ns, d)
		if err != nil {
			return nil, err
		}
		r.Attached = n
	}
	// Settle: let caches, queues and the runtime reach their steady state.
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(5 * time.Second):
	}
	r.RSS, _ = memory(d.all())
	r.PerAnon = map[string]int{}
	for _, p := range d.all() {
		m, err := p.smaps()
		if err != nil {
			return nil, err
		}
		r.PSS += m.pss
		r.Anon += m.anon
		r.PerAnon[strings.TrimPrefix(p.name, tag+"-")] = int(m.anon / mib)
	}
	r.ControlRSS, _ = memory(d.controllers)
	r.HelperRSS, _ = memory(d.helpers)
	r.PerProcess = map[string]int{}
	for _, p := range d.all() {
		rss, _, _ := p.memory()
		r.PerProcess[strings.TrimPrefix(p.name, tag+"-")] = int(rss / mib)
	}
	gauge1, err := h.watchesHeld(ctx)
	if err != nil {
		return nil, err
	}
	r.WatchGauge = gauge1 - gauge0
	evs, err := h.audit.read(mark0, h.audit.mark())
	if err != nil {
		return nil, err
	}
	api := countAPI(evs, clientPrefixes(side)...)
	r.Watches = api.WatchesOpen
	r.WatchByKind = map[string]int{}
	r.WatchStarts = map[string]int{}
	for k, v := range api.WatchesOpenBy {
		if v != 0 {
			r.WatchByKind[k] = v
		}
	}
	for k, v := range api.ByVerbResource {
		if res, ok := strings.CutPrefix(k, "watch "); ok {
			r.WatchStarts[res] += v
		}
	}

	// Clean up through the side itself: detach, then delete the volumes.
	if h.cfg.Attach {
		if err := h.detachAll(ctx, d); err != nil {
			return nil, err
		}
	}
	if err := h.deleteClaims(ctx, ns); err != nil {
		return nil, err
	}
	if _, err := tr.wait(ctx, timeoutFor(total, q.QPS, 3), "every PV deleted", func(s state) bool { return s.pvs == 0 }, d.died); err != nil {
		return nil, err
	}
	return r, nil
}

// attachAll creates a VolumeAttachment to benchNode for every PV of ns, as
// the attach/detach controller would for a pod on that node, and waits until
// each is attached.
func (h *Harness) attachAll(ctx context.Context, ns string, d *deployment) (int, error) {
	pvs, err := h.client.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return 0, err
	}
	var mine []corev1.PersistentVolume
	for _, pv := range pvs.Items {
		if pv.Spec.ClaimRef != nil && pv.Spec.ClaimRef.Namespace == ns && pv.Spec.CSI != nil {
			mine = append(mine, pv)
		}
	}
	err = parallel(ctx, 0, len(mine), 16, func(ctx context.Context, i int) error {
		pv := mine[i]
		_, err := h.client.StorageV1().VolumeAttachments().Create(ctx, &storagev1.VolumeAttachment{
			ObjectMeta: metav1.ObjectMeta{Name: "va-" + pv.Name, Labels: map[string]string{"bench": ns}},
			Spec: storagev1.VolumeAttachmentSpec{
				Attacher: pv.Spec.CSI.Driver, NodeName: benchNode,
				Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &pv.Name},
			},
		}, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			return err
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("create VolumeAttachments: %w", err)
	}
	attached := 0
	err = pollUntil(ctx, 2*time.Minute, "every VolumeAttachment attached (csibroker: pass its attach flag with -broker-flags)", func() (bool, error) {
		if err := d.died(); err != nil {
			return false, err
		}
		l, err := h.client.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{LabelSelector: "bench=" + ns})
		if err != nil {
			return false, err
		}
		attached = 0
		for _, va := range l.Items {
			if va.Status.Attached {
				attached++
			}
		}
		return attached == len(mine), nil
	})
	return attached, err
}

// detachAll deletes the VolumeAttachments and waits until the side has
// detached them (removed its finalizer).
func (h *Harness) detachAll(ctx context.Context, d *deployment) error {
	if err := h.client.StorageV1().VolumeAttachments().DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: "bench"}); err != nil {
		return err
	}
	return pollUntil(ctx, 2*time.Minute, "every VolumeAttachment detached", func() (bool, error) {
		if err := d.died(); err != nil {
			return false, err
		}
		l, err := h.client.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{LabelSelector: "bench"})
		return err == nil && len(l.Items) == 0, err
	})
}
