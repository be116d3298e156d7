package health

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"

	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
)

// Controller sweeps the volumes of every registered driver that reports
// volume health, every Config.MonitorInterval, and records on each claim
// the changes of its volume's condition.
type Controller struct {
	b        *kube.Env
	log      *slog.Logger
	interval time.Duration
	// nudge asks for a sweep of every driver now (a driver registered).
	nudge chan struct{}

	abnormal *prometheus.GaugeVec
	notFound *prometheus.GaugeVec
	sweeps   *prometheus.CounterVec
	calls    *prometheus.CounterVec

	mu sync.Mutex
	// states is, per driver and PV, what was last reported (this term).
	states map[string]map[types.UID]*volState
	// busy holds the drivers being swept: a sweep that outlasts the
	// interval is not started again beside itself.
	busy map[string]bool
}

// New is the volume health controller, or nil when monitoring is off
// (a negative MonitorInterval).
func New(b *kube.Env) (*Controller, error) {
	if b.Cfg.MonitorInterval < 0 {
		return nil, nil
	}
	c := &Controller{
		b:        b,
		log:      b.Log.With("controller", "health"),
		interval: b.Cfg.MonitorInterval,
		nudge:    make(chan struct{}, 1),
		abnormal: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "csibroker", Name: "volumes_abnormal",
			Help: "Bound volumes whose driver reported an abnormal condition at the last sweep, by driver.",
		}, []string{"driver"}),
		notFound: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "csibroker", Name: "volumes_not_found",
			Help: "Bound volumes their driver no longer has (deleted or lost outside Kubernetes), by driver.",
		}, []string{"driver"}),
		sweeps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "csibroker", Name: "volume_health_sweeps_total",
			Help: "Volume health sweeps by driver, mode (health-list, health-get, condition-list, condition-get) and result (success; partial: some volumes not observed; failed: nothing concluded; unreachable; skipped: the driver reports no volume health, mode none).",
		}, []string{"driver", "mode", "result"}),
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "csibroker", Name: "volume_health_calls_total",
			Help: "CSI calls made by volume health sweeps, by driver and method.",
		}, []string{"driver", "method"}),
		states: map[string]map[types.UID]*volState{},
		busy:   map[string]bool{},
	}
	if reg := b.Cfg.Registerer; reg != nil {
		for _, col := range []prometheus.Collector{c.abnormal, c.notFound, c.sweeps, c.calls} {
			if err := reg.Register(col); err != nil {
				return nil, fmt.Errorf("health metrics: %w", err)
			}
		}
	}
	return c, nil
}

// EnqueueAll sweeps every driver now (a driver was registered).
func (c *Controller) EnqueueAll() {
	select {
	case c.nudge <- struct{}{}:
	default:
	}
}

// Run sweeps at once, then every interval, until ctx ends; it waits for
// the sweeps in flight. What was reported is forgotten at each term's
// start.
func (c *Controller) Run(ctx context.Context) {
	c.mu.Lock()
	clear(c.states)
	c.mu.Unlock()
	c.abnormal.Reset()
	c.notFound.Reset()
	// A standby exports nothing: what it knew is the last term's.
	defer c.notFound.Reset()
	defer c.abnormal.Reset()
	var wg sync.WaitGroup
	defer wg.Wait()
	t := time.NewTicker(c.interval)
	defer t.Stop()
	for {
		names := c.b.Cfg.Drivers.DriverNames()
		c.forgetUnregistered(names)
		for _, d := range names {
			if !c.begin(d) {
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.end(d)
				c.sweepDriver(ctx, d)
			}()
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-c.nudge:
		}
	}
}

// forgetUnregistered drops what is known of drivers not in names (and
// not being swept), and their gauges.
func (c *Controller) forgetUnregistered(names []string) {
	registered := make(map[string]bool, len(names))
	for _, n := range names {
		registered[n] = true
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for d := range c.states {
		if !registered[d] && !c.busy[d] {
			delete(c.states, d)
			c.abnormal.DeleteLabelValues(d)
			c.notFound.DeleteLabelValues(d)
		}
	}
}

func (c *Controller) begin(driver string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.busy[driver] {
		return false
	}
	c.busy[driver] = true
	return true
}

func (c *Controller) end(driver string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.busy, driver)
}

// unit is the volumes one proxy answers for: the driver's controller, or
// one node of a node-local driver.
type unit struct {
	node string
	pvs  []*corev1.PersistentVolume
}

// volumesOf is the driver's bound PVs, by the proxy that holds them (a
// node-local driver's PV that names no node is left out: no proxy could
// be asked).
func (c *Controller) volumesOf(driver string) (all []*corev1.PersistentVolume, units []unit) {
	pvs, err := c.b.Volumes.List(labels.Everything())
	if err != nil {
		return nil, nil
	}
	nodeLocal := c.b.Cfg.Drivers.NodeLocal(driver)
	byNode := map[string][]*corev1.PersistentVolume{}
	for _, pv := range pvs {
		if !watched(pv, driver) {
			continue
		}
		all = append(all, pv)
		node := ""
		if nodeLocal {
			if node = c.b.NodeOfPV(pv); node == "" {
				c.log.Debug("node-local volume names no node; its health is not asked", "pv", pv.Name, "driver", driver)
				continue
			}
		}
		byNode[node] = append(byNode[node], pv)
	}
	for n, l := range byNode {
		units = append(units, unit{node: n, pvs: l})
	}
	sort.Slice(units, func(i, j int) bool { return units[i].node < units[j].node })
	return all, units
}

// watched: a bound, live CSI volume of driver with a claim to report on.
func watched(pv *corev1.PersistentVolume, driver string) bool {
	return pv.Spec.CSI != nil && pv.Spec.CSI.Driver == driver && pv.Spec.CSI.VolumeHandle != "" &&
		pv.Status.Phase == corev1.VolumeBound && pv.Spec.ClaimRef != nil && pv.DeletionTimestamp == nil
}

// sweepDriver observes every watched volume of driver once and reports
// what changed. A panic (a bug a driver's answer hits) fails this sweep
// only.
func (c *Controller) sweepDriver(ctx context.Context, driver string) {
	defer c.recover(driver)
	all, units := c.volumesOf(driver)
	defer c.settle(driver, all)
	if len(all) == 0 {
		return // nothing to watch: the driver is not asked
	}
	caps, err := c.b.Caps.Get(ctx, driver)
	if err != nil {
		c.sweeps.WithLabelValues(driver, "unknown", "unreachable").Inc()
		c.log.Info("volume health: driver capabilities unknown; sweep skipped", "driver", driver, "err", err)
		return
	}
	m := modeOf(caps)
	if m == modeNone {
		c.sweeps.WithLabelValues(driver, m.String(), "skipped").Inc()
		return
	}
	// A node-local driver's nodes are asked side by side: one node whose
	// proxy does not answer holds up only its own volumes.
	var wg sync.WaitGroup
	sem := make(chan struct{}, unitWorkers)
	for _, u := range units {
		select {
		case <-ctx.Done():
		case sem <- struct{}{}:
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() { <-sem }()
				defer c.recover(driver)
				c.sweepUnit(ctx, driver, m, caps, u)
			}()
		}
	}
	wg.Wait()
}

// recover ends a sweep that panicked (a bug a driver's answer hits): it
// is logged with its stack and counted, and the process goes on.
func (c *Controller) recover(driver string) {
	if v := recover(); v != nil {
		c.log.Error("volume health sweep panicked", "driver", driver, "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
		c.b.Metrics.Panics.WithLabelValues("health").Inc()
	}
}

// unitWorkers bounds the proxies of one driver asked at once.
const unitWorkers = 8

// sweepUnit asks one proxy about its volumes and reports.
func (c *Controller) sweepUnit(ctx context.Context, driver string, m mode, caps drivers.Caps, u unit) {
	ctx, span := c.b.Tracer.Start(ctx, "volume health "+driver, trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(
		attribute.String("csi.driver", driver), attribute.String("csibroker.health.mode", m.String()),
		attribute.String("k8s.node.name", u.node), attribute.Int("csibroker.health.volumes", len(u.pvs))))
	defer span.End()
	conn, err := c.b.DriverConn(driver, u.node)
	if err != nil {
		c.sweeps.WithLabelValues(driver, m.String(), "unreachable").Inc()
		c.log.Info("volume health: driver proxy unreachable; sweep skipped", "driver", driver, "node", u.node, "err", err)
		span.SetStatus(otelcodes.Error, err.Error())
		return
	}
	p := &prober{conn: conn, caps: caps, call: func(ctx context.Context, method string) (context.Context, context.CancelFunc) {
		c.calls.WithLabelValues(driver, method).Inc()
		return c.b.CallContext(ctx, driver, method)
	}}
	handles := make([]string, len(u.pvs))
	for i, pv := range u.pvs {
		handles[i] = pv.Spec.CSI.VolumeHandle
	}
	obs, err := p.probe(ctx, m, handles)
	switch {
	case err != nil && (obs == nil || errors.Is(err, errSweep)):
		c.sweeps.WithLabelValues(driver, m.String(), "failed").Inc()
		c.log.Warn("volume health sweep failed; nothing concluded from it", "driver", driver, "node", u.node, "mode", m.String(), "err", err)
		span.SetStatus(otelcodes.Error, err.Error())
		return
	case err != nil:
		c.sweeps.WithLabelValues(driver, m.String(), "partial").Inc()
		c.log.Warn("volume health sweep: some volumes not observed", "driver", driver, "node", u.node, "mode", m.String(), "err", err)
	default:
		c.sweeps.WithLabelValues(driver, m.String(), "success").Inc()
	}
	c.report(ctx, driver, u.pvs, obs)
}

// report moves each observed PV to its new state and records the Events
// of the changes on its claim.
func (c *Controller) report(ctx context.Context, driver string, pvs []*corev1.PersistentVolume, obs map[string]seen) {
	for _, pv := range pvs {
		s, ok := obs[pv.Spec.CSI.VolumeHandle]
		if !ok {
			continue
		}
		c.mu.Lock()
		byPV := c.states[driver]
		if byPV == nil {
			byPV = map[types.UID]*volState{}
			c.states[driver] = byPV
		}
		next, ev := transition(byPV[pv.UID], s, volumeInfo{driver: driver, handle: pv.Spec.CSI.VolumeHandle, pv: pv.Name})
		byPV[pv.UID] = &next
		c.mu.Unlock()
		if ev == nil {
			continue
		}
		cr := pv.Spec.ClaimRef
		claim := corev1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: cr.Namespace, Name: cr.Name, UID: cr.UID}
		c.log.Info("volume condition changed", "driver", driver, "pv", pv.Name, "claim", cr.Namespace+"/"+cr.Name, "reason", ev.reason, "message", ev.msg)
		c.b.Event(ctx, claim, ev.typ, ev.reason, "%s", ev.msg)
	}
}

// settle forgets the PVs of driver that are no longer watched and sets
// the driver's gauges from what is known.
func (c *Controller) settle(driver string, watchedPVs []*corev1.PersistentVolume) {
	live := make(map[types.UID]bool, len(watchedPVs))
	for _, pv := range watchedPVs {
		live[pv.UID] = true
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.states[driver] == nil {
		c.states[driver] = map[types.UID]*volState{} // kept: forgetUnregistered finds the driver's gauges by it
	}
	abnormal, gone := 0, 0
	for uid, st := range c.states[driver] {
		if !live[uid] {
			delete(c.states[driver], uid)
			continue
		}
		switch st.kind {
		case stateAbnormal:
			abnormal++
		case stateGone:
			gone++
		}
	}
	c.abnormal.WithLabelValues(driver).Set(float64(abnormal))
	c.notFound.WithLabelValues(driver).Set(float64(gone))
}
