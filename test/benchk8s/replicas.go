package main

// The replicas scenario (issue 35, "Replicas"): twenty drivers behind one
// broker replica (leader election on, one Lease: today's default mode)
// against three replicas sharing the drivers out through per-driver
// Leases (--leader-election-mode per-driver), each replica its own
// process with its own --identity, all on loopback. Then, with three
// replicas running and claims created at a steady pace, one replica is
// SIGKILLed; every claim's creation → Bound is measured, and the longest
// wait of the killed replica's drivers' claims is set against the lease
// duration plus one retry period.

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"

	"github.com/csibroker/csibroker/k8sbridge/shard"
)

// leaderLock is the broker's leader Lease (and the driver Leases' prefix).
const leaderLock = "csibroker-leader"

// leaseTimings are the broker's --leader-election-lease-duration,
// -renew-deadline and -retry-period, written "3s/2.5s/0.5s".
type leaseTimings struct {
	Lease, Renew, Retry time.Duration
}

func (l leaseTimings) String() string {
	return l.Lease.String() + "/" + l.Renew.String() + "/" + l.Retry.String()
}

func (l leaseTimings) flags() []string {
	return []string{"--leader-election-lease-duration", l.Lease.String(), "--leader-election-renew-deadline", l.Renew.String(),
		"--leader-election-retry-period", l.Retry.String()}
}

func parseLeaseTimings(s string) (leaseTimings, error) {
	parts := strings.Split(strings.TrimSpace(s), "/")
	if len(parts) != 3 {
		return leaseTimings{}, fmt.Errorf("%q: want LEASE/RENEW/RETRY, e.g. 3s/2.5s/0.5s", s)
	}
	var d [3]time.Duration
	for i, p := range parts {
		v, err := time.ParseDuration(p)
		if err != nil || v <= 0 {
			return leaseTimings{}, fmt.Errorf("%q: %q is no positive duration", s, p)
		}
		d[i] = v
	}
	l := leaseTimings{d[0], d[1], d[2]}
	if l.Lease%time.Second != 0 || l.Renew >= l.Lease || l.Retry >= l.Renew {
		return leaseTimings{}, fmt.Errorf("%q: want whole seconds of lease, and lease > renew > retry", s)
	}
	return l, nil
}

// ReplicasConfig holds the replicas scenario's flags.
type ReplicasConfig struct {
	Drivers  int
	Claims   manySetting // claims per driver @ kube-controller-manager's client rate
	Replicas int         // replicas in per-driver mode
	KillRate float64     // kill test: claims created per second
	KillFor  time.Duration
	Lease    leaseTimings
}

func defaultReplicasConfig() ReplicasConfig {
	return ReplicasConfig{Drivers: 20, Claims: manySetting{20, rate{200, 400}}, Replicas: 3, KillRate: 10, KillFor: 30 * time.Second,
		Lease: leaseTimings{3 * time.Second, 2500 * time.Millisecond, 500 * time.Millisecond}}
}

func registerReplicasFlags(fs *flag.FlagSet, c *ReplicasConfig) {
	fs.IntVar(&c.Drivers, "replicas-drivers", c.Drivers, "replicas: how many drivers")
	fs.Func("replicas-claims", "replicas: claims per driver @ kube-controller-manager client QPS/burst (default 20@200/400)", func(s string) error {
		m, err := parseManySetting(s)
		c.Claims = m
		return err
	})
	fs.IntVar(&c.Replicas, "replicas-count", c.Replicas, "replicas: broker replicas in per-driver mode (against one in single mode)")
	fs.Float64Var(&c.KillRate, "replicas-kill-rate", c.KillRate, "replicas, kill test: claims created per second (round robin over the drivers)")
	fs.DurationVar(&c.KillFor, "replicas-kill-for", c.KillFor, "replicas, kill test: how long claims are created; one replica is SIGKILLed after a third of it")
	fs.Func("replicas-lease", "replicas: every broker's leader-election lease duration/renew deadline/retry period (default 3s/2.5s/0.5s, the broker's defaults)", func(s string) error {
		l, err := parseLeaseTimings(s)
		c.Lease = l
		return err
	})
}

func (c ReplicasConfig) validate() []error {
	var errs []error
	if c.Drivers < 1 || c.Replicas < 2 {
		errs = append(errs, errors.New("-replicas-drivers must be positive and -replicas-count at least 2"))
	}
	if c.Drivers < c.Replicas {
		errs = append(errs, errors.New("-replicas-drivers must be at least -replicas-count (every replica leads a driver)"))
	}
	if c.KillRate <= 0 || c.KillFor < 3*c.Lease.Lease {
		errs = append(errs, fmt.Errorf("-replicas-kill-rate must be positive and -replicas-kill-for at least three lease durations (%s)", 3*c.Lease.Lease))
	}
	return errs
}

// replicasResult is one throughput run: one replica (single Lease) or
// several (per-driver Leases).
type replicasResult struct {
	Replicas  int    `json:"replicas"`
	Mode      string `json:"mode"`
	Drivers   int    `json:"drivers"`
	PerDriver int    `json:"claims_per_driver"`
	KCM       string `json:"kube_controller_manager_qps"`
	Rep       int    `json:"rep"`

	BoundSeconds float64 `json:"bound_seconds"` // first replica started → every claim Bound
	DelSeconds   float64 `json:"del_seconds"`   // claims deleted → every PV gone
	CPUProv      float64 `json:"cpu_prov_seconds"`
	CPUDel       float64 `json:"cpu_del_seconds"`
	// Led is how many drivers each replica leads once settled (the
	// driver Leases' holderIdentity; single mode: the leader Lease's
	// holder leads all).
	Led map[string]int `json:"led"`
	// SettleSeconds: first replica started → the drivers shared out
	// evenly (per-driver mode).
	SettleSeconds float64 `json:"settle_seconds"`
}

// killResult is one kill test.
type killResult struct {
	Rep           int            `json:"rep"`
	Claims        int            `json:"claims"`
	Killed        string         `json:"killed"`
	KilledLeader  bool           `json:"killed_held_leader_lease"`
	KilledDrivers []string       `json:"killed_drivers"`
	LedAfter      map[string]int `json:"led_after"`
	// Seconds: SIGKILL → every driver of the killed replica's held by a
	// survivor.
	TakeoverSeconds float64 `json:"takeover_seconds"`
	// Creation → Bound of every claim, of the killed replica's drivers
	// and of the others.
	Killed50  float64 `json:"killed_p50_seconds"`
	KilledMax float64 `json:"killed_max_seconds"`
	Others50  float64 `json:"others_p50_seconds"`
	OthersMax float64 `json:"others_max_seconds"`
	// KilledAffected counts the killed drivers' claims created within the
	// lease duration before the kill and up to the takeover.
	KilledAffected int     `json:"killed_affected"`
	LeaseRetry     float64 `json:"lease_plus_retry_seconds"`

	killedAt, takenAt time.Time
}

func (h *Harness) scenarioReplicas(ctx context.Context) error {
	rc := h.cfg.ReplicasCfg
	h.stopCluster()
	if err := h.startClusterKCM(ctx, "replicas", rc.Claims.KCM); err != nil {
		return err
	}
	names := make([]string, rc.Drivers)
	for i := range names {
		names[i] = fmt.Sprintf("bench-%d.csibroker.io", i+1)
		if err := h.ensureStorageClass(ctx, fmt.Sprintf("bench-%d", i+1), names[i], corev1.PersistentVolumeReclaimDelete); err != nil {
			return err
		}
	}
	var runs []*replicasResult
	var kills []*killResult
	for rep := range h.cfg.Reps {
		counts := []int{1, rc.Replicas}
		if rep%2 == 1 {
			counts = []int{rc.Replicas, 1}
		}
		for _, n := range counts {
			r, err := h.replicasRun(ctx, names, n, rep)
			if err != nil {
				return fmt.Errorf("%d replica(s), rep %d: %w", n, rep+1, err)
			}
			h.logf("  %d replica(s) %-10s %d drivers × %d claims, rep %d: all Bound in %.1fs, all PVs gone %.1fs after deletion; CPU %.1fs / %.1fs; led %s",
				n, r.Mode, len(names), rc.Claims.PerDriver, rep+1, r.BoundSeconds, r.DelSeconds, r.CPUProv, r.CPUDel, fmtLed(r.Led))
			runs = append(runs, r)
			h.report.addRun(map[string]any{"scenario": "replicas", "result": r})
		}
		k, err := h.killRun(ctx, names, rep)
		if err != nil {
			return fmt.Errorf("kill test, rep %d: %w", rep+1, err)
		}
		h.logf("  kill test rep %d: killed %s (%d drivers%s); survivors took them in %.2fs; longest creation → Bound %.2fs (its drivers) / %.2fs (others), lease + retry %.1fs",
			rep+1, k.Killed, len(k.KilledDrivers), map[bool]string{true: ", held the leader Lease"}[k.KilledLeader], k.TakeoverSeconds, k.KilledMax, k.OthersMax, k.LeaseRetry)
		kills = append(kills, k)
		h.report.addRun(map[string]any{"scenario": "replicas-kill", "result": k})
	}
	h.replicasTables(runs, kills)
	return nil
}

// replicaIDs are the identities of n replicas of run tag.
func replicaIDs(tag string, n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s-%c", tag, 'a'+i)
	}
	return ids
}

// deployReplicas starts the proxies and n broker replicas with leader
// election in ns: single mode for one, per-driver mode for more.
func (h *Harness) deployReplicas(ctx context.Context, tag, ns string, drivers []*driverInst, n int) (*deployment, error) {
	extra := h.cfg.ReplicasCfg.Lease.flags()
	if n > 1 {
		extra = append(extra, "--leader-election-mode", "per-driver")
	}
	saved := h.cfg.BrokerFlags
	h.cfg.BrokerFlags = append(extra, saved...) // the user's -broker-flags come last and win
	defer func() { h.cfg.BrokerFlags = saved }()
	return h.deploy(ctx, sideBroker, deployOpts{tag: tag, drivers: drivers, rate: sidecarDefaults, leaderElection: true, identities: replicaIDs(tag, n), leaseNS: ns})
}

// ledBy counts the drivers each of ids leads as the tracker sees the
// Leases: per driver Lease with several replicas, the leader Lease's
// holder leads every driver with one.
func ledBy(s state, names, ids []string) map[string]int {
	led := map[string]int{}
	for _, id := range ids {
		led[id] = 0
	}
	if len(ids) == 1 {
		if s.leaseHolders[leaderLock] == ids[0] {
			led[ids[0]] = len(names)
		}
		return led
	}
	for _, d := range names {
		if holder := s.leaseHolders[shard.DriverLease(leaderLock, d)]; slices.Contains(ids, holder) {
			led[holder]++
		}
	}
	return led
}

// balanced says whether every driver is led by one of ids and each leads
// its even share (D/N or ⌈D/N⌉).
func balanced(led map[string]int, drivers int, ids []string) bool {
	lo, hi, sum := drivers/len(ids), (drivers+len(ids)-1)/len(ids), 0
	for _, id := range ids {
		n := led[id]
		if n < lo || n > hi {
			return false
		}
		sum += n
	}
	return sum == drivers
}

func fmtLed(led map[string]int) string {
	ids := make([]string, 0, len(led))
	for id := range led {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	var parts []string
	for _, id := range ids {
		parts = append(parts, fmt.Sprintf("%s %d", id[strings.LastIndex(id, "-")+1:], led[id]))
	}
	return strings.Join(parts, ", ")
}

// replicasRun is one throughput run with n replicas: every claim created
// before the first replica starts; time to every claim Bound, then to
// every PV gone after one DeleteCollection.
func (h *Harness) replicasRun(ctx context.Context, names []string, n, rep int) (*replicasResult, error) {
	rc := h.cfg.ReplicasCfg
	tag := dnsName("rp", fmt.Sprint(n), "r"+fmt.Sprint(rep))
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
	tr, err := h.newTracker(ctx, ns, ns)
	if err != nil {
		return nil, err
	}
	defer tr.stop()
	total := len(names) * rc.Claims.PerDriver
	for i := range names {
		if err := h.createClaims(ctx, ns, fmt.Sprintf("d%d", i+1), fmt.Sprintf("bench-%d", i+1), rc.Claims.PerDriver); err != nil {
			return nil, err
		}
	}
	if _, err := tr.wait(ctx, 2*time.Minute, "claims created", func(s state) bool { return s.claims == total }, nil); err != nil {
		return nil, err
	}
	d, err := h.deployReplicas(ctx, tag, ns, drivers, n)
	if err != nil {
		return nil, err
	}
	defer d.stop()
	ids := d.identities
	t0 := d.controllers[0].started
	paced := func(perClaim float64) time.Duration {
		s := float64(rc.Claims.PerDriver)*perClaim/sidecarDefaults.QPS + float64(total)*4/rc.Claims.KCM.QPS
		return max(4*time.Duration(s*float64(time.Second)), 3*time.Minute)
	}
	tBound, err := tr.wait(ctx, paced(1.5), "every claim Bound", func(s state) bool { return s.pvs >= total && s.bound >= total }, d.died)
	if err != nil {
		return nil, err
	}
	cpuC, cpuH := d.cpu()
	r := &replicasResult{Replicas: n, Mode: map[bool]string{true: "single", false: "per-driver"}[n == 1], Drivers: len(names),
		PerDriver: rc.Claims.PerDriver, KCM: rc.Claims.KCM.String(), Rep: rep, BoundSeconds: tBound.Sub(t0).Seconds(), CPUProv: cpuC + cpuH}
	// Settled: every driver led, each replica its even share (the lone
	// replica of single mode: the leader Lease).
	tSettled, err := tr.wait(ctx, time.Minute, "the drivers shared out evenly", func(s state) bool {
		return balanced(ledBy(s, names, ids), len(names), ids)
	}, d.died)
	r.Led = ledBy(tr.snapshot(), names, ids)
	if err != nil {
		return nil, fmt.Errorf("%w (led: %s)", err, fmtLed(r.Led))
	}
	r.SettleSeconds = math.NaN()
	if n > 1 {
		// The first change that made it so: the last driver Lease change.
		st := tr.snapshot()
		last := t0
		for _, c := range st.leaseChanges {
			if strings.HasPrefix(c.lease, leaderLock+"-driver-") && c.at.After(last) && !c.at.After(tSettled) {
				last = c.at
			}
		}
		r.SettleSeconds = last.Sub(t0).Seconds()
	}
	tDel := time.Now()
	if err := h.deleteClaims(ctx, ns); err != nil {
		return nil, err
	}
	tGone, err := tr.wait(ctx, paced(3), "every PV deleted", func(s state) bool { return s.pvs == 0 && s.claims == 0 }, d.died)
	if err != nil {
		return nil, err
	}
	cpuC2, cpuH2 := d.cpu()
	r.DelSeconds, r.CPUDel = tGone.Sub(tDel).Seconds(), cpuC2+cpuH2-cpuC-cpuH
	return r, nil
}

// boundWatch stamps each claim of a namespace with the local time it was
// first seen Bound.
type boundWatch struct {
	mu    sync.Mutex
	bound map[string]time.Time
}

func (h *Harness) watchBound(ctx context.Context, ns string) (*boundWatch, error) {
	w := &boundWatch{bound: map[string]time.Time{}}
	f := informers.NewSharedInformerFactoryWithOptions(h.client, 0, informers.WithNamespace(ns))
	inf := f.Core().V1().PersistentVolumeClaims().Informer()
	seen := func(o any) {
		c, ok := o.(*corev1.PersistentVolumeClaim)
		if !ok || c.Status.Phase != corev1.ClaimBound {
			return
		}
		now := time.Now()
		w.mu.Lock()
		if _, ok := w.bound[c.Name]; !ok {
			w.bound[c.Name] = now
		}
		w.mu.Unlock()
	}
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: seen, UpdateFunc: func(_, o any) { seen(o) }})
	f.Start(ctx.Done())
	sctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if !cache.WaitForCacheSync(sctx.Done(), inf.HasSynced) {
		return nil, errors.New("bound watch: cache not synced")
	}
	return w, nil
}

func (w *boundWatch) at(name string) (time.Time, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	t, ok := w.bound[name]
	return t, ok
}

// pacedClaim is one claim of the kill test.
type pacedClaim struct {
	name    string
	driver  string
	created time.Time // just before its create request
}

// paceClaims creates n claims at rate per second, round robin over the
// drivers (claim i: driver i mod D), and sends each on out as it is made.
func (h *Harness) paceClaims(ctx context.Context, ns string, names []string, n int, rate float64, out chan<- pacedClaim) error {
	defer close(out)
	t0 := time.Now()
	for i := range n {
		at := t0.Add(time.Duration(float64(i) / rate * float64(time.Second)))
		select {
		case <-time.After(time.Until(at)):
		case <-ctx.Done():
			return ctx.Err()
		}
		di := i % len(names)
		c := pacedClaim{name: fmt.Sprintf("k%d-%05d", di+1, i), driver: names[di], created: time.Now()}
		if _, err := h.client.CoreV1().PersistentVolumeClaims(ns).Create(ctx, claim(ns, c.name, fmt.Sprintf("bench-%d", di+1), ""), metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create claim %s: %w", c.name, err)
		}
		out <- c
	}
	return nil
}

// killRun: replicas in per-driver mode, shared out evenly; claims created
// at a steady pace; after a third of the pace, SIGKILL the replica that
// holds the leader Lease (the coordinator: the worst case, both its
// drivers and the coordinator's duties move), and measure every claim's
// creation → Bound.
func (h *Harness) killRun(ctx context.Context, names []string, rep int) (*killResult, error) {
	rc := h.cfg.ReplicasCfg
	tag := dnsName("rk", "r"+fmt.Sprint(rep))
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
	tr, err := h.newTracker(ctx, ns, ns)
	if err != nil {
		return nil, err
	}
	defer tr.stop()
	bw, err := h.watchBound(ctx, ns)
	if err != nil {
		return nil, err
	}
	d, err := h.deployReplicas(ctx, tag, ns, drivers, rc.Replicas)
	if err != nil {
		return nil, err
	}
	defer d.stop()
	ids := d.identities
	if _, err := tr.wait(ctx, time.Minute, "the drivers shared out evenly", func(s state) bool {
		return balanced(ledBy(s, names, ids), len(names), ids)
	}, d.died); err != nil {
		return nil, fmt.Errorf("%w (led: %s)", err, fmtLed(ledBy(tr.snapshot(), names, ids)))
	}

	total := max(1, int(rc.KillRate*rc.KillFor.Seconds()))
	claims := make(chan pacedClaim, total)
	pctx, pcancel := context.WithCancel(ctx)
	defer pcancel()
	paceErr := make(chan error, 1)
	go func() { paceErr <- h.paceClaims(pctx, ns, names, total, rc.KillRate, claims) }()
	select {
	case <-time.After(rc.KillFor / 3):
	case err := <-paceErr:
		return nil, fmt.Errorf("claims paced out before the kill: %v", err)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	k, survivors, err := h.killOne(ctx, tr, d, names)
	if err != nil {
		return nil, err
	}
	k.Rep, k.Claims = rep, total
	if err := <-paceErr; err != nil {
		return nil, err
	}
	alive := func() error {
		for _, p := range survivors {
			if err := p.died(); err != nil {
				return err
			}
		}
		return nil
	}
	if _, err := tr.wait(ctx, timeoutFor(total, rc.KillRate, 1), "every claim Bound", func(s state) bool { return s.pvs >= total && s.bound >= total }, alive); err != nil {
		return nil, err
	}
	var list []pacedClaim
	for c := range claims {
		list = append(list, c)
	}
	// The tracker and the bound watch are two informers: let the watch
	// catch up with the tracker.
	if err := pollUntil(ctx, 30*time.Second, "the bound watch to see every claim Bound", func() (bool, error) {
		for _, c := range list {
			if _, ok := bw.at(c.name); !ok {
				return false, nil
			}
		}
		return true, nil
	}); err != nil {
		return nil, err
	}
	if err := k.waits(list, bw); err != nil {
		return nil, err
	}
	k.LedAfter = ledBy(tr.snapshot(), names, ids)
	// The survivors delete every volume (and the intent record's entries).
	if err := h.deleteClaims(ctx, ns); err != nil {
		return nil, err
	}
	if _, err := tr.wait(ctx, timeoutFor(total, sidecarDefaults.QPS*float64(len(names)), 3), "every PV deleted", func(s state) bool { return s.pvs == 0 && s.claims == 0 }, alive); err != nil {
		return nil, err
	}
	return k, nil
}

// killOne SIGKILLs the replica holding the leader Lease and waits until the
// survivors lead every driver it led.
func (h *Harness) killOne(ctx context.Context, tr *tracker, d *deployment, names []string) (*killResult, []*proc, error) {
	rc := h.cfg.ReplicasCfg
	ids := d.identities
	s := tr.snapshot()
	victim := s.leaseHolders[leaderLock]
	vi := slices.Index(ids, victim)
	if vi < 0 {
		vi, victim = 0, ids[0]
	}
	k := &killResult{Killed: victim, KilledLeader: s.leaseHolders[leaderLock] == victim, LeaseRetry: (rc.Lease.Lease + rc.Lease.Retry).Seconds()}
	for _, n := range names {
		if s.leaseHolders[shard.DriverLease(leaderLock, n)] == victim {
			k.KilledDrivers = append(k.KilledDrivers, n)
		}
	}
	var survivors []*proc
	var survivorIDs []string
	for i, p := range d.controllers {
		if i != vi {
			survivors, survivorIDs = append(survivors, p), append(survivorIDs, ids[i])
		}
	}
	tKill := time.Now()
	d.controllers[vi].kill()
	k.killedAt = tKill
	tTake, err := tr.wait(ctx, time.Minute+3*rc.Lease.Lease, "the survivors to lead the killed replica's drivers", func(s state) bool {
		for _, n := range k.KilledDrivers {
			if !slices.Contains(survivorIDs, s.leaseHolders[shard.DriverLease(leaderLock, n)]) {
				return false
			}
		}
		return true
	}, nil)
	if err != nil {
		return nil, nil, err
	}
	k.takenAt = tTake
	k.TakeoverSeconds = tTake.Sub(tKill).Seconds()
	return k, survivors, nil
}

// waits fills in the creation → Bound figures.
func (k *killResult) waits(list []pacedClaim, bw *boundWatch) error {
	var killed, others []float64
	for _, c := range list {
		tb, ok := bw.at(c.name)
		if !ok {
			return fmt.Errorf("claim %s: Bound by the tracker's count but never seen Bound by the watch", c.name)
		}
		w := tb.Sub(c.created).Seconds()
		if slices.Contains(k.KilledDrivers, c.driver) {
			killed = append(killed, w)
			if c.created.Before(k.takenAt) && tb.After(k.killedAt) {
				k.KilledAffected++
			}
		} else {
			others = append(others, w)
		}
	}
	k.Killed50, k.KilledMax = percentile(killed, 50), percentile(killed, 100)
	k.Others50, k.OthersMax = percentile(others, 50), percentile(others, 100)
	return nil
}

func (h *Harness) replicasTables(runs []*replicasResult, kills []*killResult) {
	rc := h.cfg.ReplicasCfg
	total := float64(rc.Drivers * rc.Claims.PerDriver)
	figs := []struct {
		label   string
		prec    int
		noRatio bool
		v       func(r *replicasResult) float64
	}{
		{"seconds, first replica started → every claim Bound", 1, false, func(r *replicasResult) float64 { return r.BoundSeconds }},
		{"seconds, claims deleted → every PV gone", 1, false, func(r *replicasResult) float64 { return r.DelSeconds }},
		{"claims Bound per second", 2, false, func(r *replicasResult) float64 { return total / r.BoundSeconds }},
		{"CPU seconds, brokers + proxies, provisioning", 2, false, func(r *replicasResult) float64 { return r.CPUProv }},
		{"CPU seconds, brokers + proxies, deletion", 2, false, func(r *replicasResult) float64 { return r.CPUDel }},
		{"drivers led, most by one replica (settled)", 0, true, func(r *replicasResult) float64 { return float64(maxLed(r.Led)) }},
		{"drivers led, fewest by one replica (settled)", 0, true, func(r *replicasResult) float64 { return float64(minLed(r.Led)) }},
		{"seconds, first replica started → last driver Lease change before settled", 2, true, func(r *replicasResult) float64 { return r.SettleSeconds }},
	}
	var rows []*row
	for _, f := range figs {
		rw := &row{label: f.label, prec: f.prec, noRatio: f.noRatio}
		for _, r := range runs {
			if r.Replicas == 1 {
				rw.sidecar = append(rw.sidecar, f.v(r))
			} else {
				rw.broker = append(rw.broker, f.v(r))
			}
		}
		rows = append(rows, rw)
	}
	h.report.tableOf(fmt.Sprintf("Replicas (issue 35): %d drivers × %d Immediate claims (%d), created before the first replica starts; every replica at its defaults "+
		"(--kube-api-qps 5/10 per driver), leader election %s; kube-controller-manager client QPS/burst %s; one proxy per driver",
		rc.Drivers, rc.Claims.PerDriver, rc.Drivers*rc.Claims.PerDriver, rc.Lease, rc.Claims.KCM), rows,
		"1 replica (single Lease)", fmt.Sprintf("%d replicas (per-driver Leases)", rc.Replicas), fmt.Sprintf("%d/1", rc.Replicas))
	var b strings.Builder
	for _, r := range runs {
		if r.Replicas > 1 {
			fmt.Fprintf(&b, "- rep %d, %d replicas: drivers led once settled: %s\n", r.Rep+1, r.Replicas, fmtLed(r.Led))
		}
	}
	h.report.printf("\n%s", b.String())
	h.killTable(kills)
}

func maxLed(led map[string]int) int {
	n := 0
	for _, v := range led {
		n = max(n, v)
	}
	return n
}

func minLed(led map[string]int) int {
	n := math.MaxInt
	for _, v := range led {
		n = min(n, v)
	}
	return n
}

func (h *Harness) killTable(kills []*killResult) {
	rc := h.cfg.ReplicasCfg
	figs := []struct {
		label string
		prec  int
		v     func(k *killResult) float64
	}{
		{"drivers the killed replica led", 0, func(k *killResult) float64 { return float64(len(k.KilledDrivers)) }},
		{"its drivers' claims pending across the kill", 0, func(k *killResult) float64 { return float64(k.KilledAffected) }},
		{"seconds, SIGKILL → the survivors lead all its drivers", 2, func(k *killResult) float64 { return k.TakeoverSeconds }},
		{"creation → Bound p50 s, other drivers' claims", 2, func(k *killResult) float64 { return k.Others50 }},
		{"creation → Bound longest s, other drivers' claims", 2, func(k *killResult) float64 { return k.OthersMax }},
		{"creation → Bound p50 s, its drivers' claims", 2, func(k *killResult) float64 { return k.Killed50 }},
		{"creation → Bound longest s, its drivers' claims", 2, func(k *killResult) float64 { return k.KilledMax }},
		{"longest, its drivers' claims, over lease + retry", 2, func(k *killResult) float64 { return k.KilledMax / k.LeaseRetry }},
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\n### Replicas, kill test (issue 35): %d replicas in per-driver mode, %d drivers, %.0f claims/s for %s (%d claims) round robin; "+
		"after a third of it, SIGKILL the replica holding the leader Lease; lease %s, renew deadline %s, retry %s (lease + retry %.1f s)\n\n",
		rc.Replicas, rc.Drivers, rc.KillRate, rc.KillFor, max(1, int(rc.KillRate*rc.KillFor.Seconds())), rc.Lease.Lease, rc.Lease.Renew, rc.Lease.Retry,
		(rc.Lease.Lease + rc.Lease.Retry).Seconds())
	b.WriteString("| | median [min–max] | per run |\n|---|---|---|\n")
	for _, f := range figs {
		var v, per []string
		var vals []float64
		for _, k := range kills {
			x := f.v(k)
			vals = append(vals, x)
			per = append(per, fmtNum(x, f.prec))
		}
		v = append(v, fmtStats(vals, f.prec))
		fmt.Fprintf(&b, "| %s | %s | %s |\n", f.label, strings.Join(v, ""), strings.Join(per, ", "))
	}
	b.WriteString("\n")
	for _, k := range kills {
		verdict := "within"
		if k.KilledMax > k.LeaseRetry {
			verdict = "**beyond**"
		}
		fmt.Fprintf(&b, "- rep %d: killed %s (leader Lease: %v), its drivers %s; afterwards led: %s; its drivers' longest wait %.2f s, %s lease + retry (%.1f s)\n",
			k.Rep+1, k.Killed, k.KilledLeader, strings.Join(k.KilledDrivers, " "), fmtLed(k.LedAfter), k.KilledMax, verdict, k.LeaseRetry)
	}
	h.report.printf("%s", b.String())
}
