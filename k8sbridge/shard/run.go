package shard

import (
	"context"
	"fmt"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
)

// Run keeps the member Lease renewed and this replica's share of the
// driver Leases, every RetryPeriod, until ctx ends. Then, with release,
// it gives every driver up and its member Lease (the bridge calls it once
// its controllers have stopped); without, it leaves them to expire, as a
// crash would.
func (m *Manager) Run(ctx context.Context, release bool) {
	m.factory.Start(ctx.Done())
	defer m.factory.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), m.synced) {
		return
	}
	t := time.NewTicker(m.cfg.RetryPeriod)
	defer t.Stop()
	var releasing sync.WaitGroup
	for {
		m.step(ctx, &releasing)
		select {
		case <-ctx.Done():
			releasing.Wait()
			m.stop(release)
			return
		case <-t.C:
		}
	}
}

// step is one round: renew, look, plan, act.
func (m *Manager) step(ctx context.Context, releasing *sync.WaitGroup) {
	if err := m.renewMember(ctx); err != nil && ctx.Err() == nil {
		m.log.Warn("member lease not renewed", "err", err)
	}
	now := time.Now()
	m.mu.Lock()
	valid := m.memberValidLocked(now)
	m.mu.Unlock()
	if !valid {
		m.loseAll("the member lease was not renewed within the renew deadline")
		return
	}
	members := m.observe(now)
	m.checkHeld()
	registered := m.cfg.Drivers.DriverNames()
	holders := map[string]string{}
	m.mu.Lock()
	for d := range m.held {
		holders[d] = m.cfg.Identity
	}
	m.mu.Unlock()
	for _, d := range registered {
		if _, mine := holders[d]; mine {
			continue
		}
		if h, _ := m.holder(d, now); h != "" && h != m.cfg.Identity {
			holders[d] = h
		}
	}
	p := Decide(State{Me: m.cfg.Identity, Drivers: registered, Members: members, Holders: holders})
	for _, d := range p.Release {
		releasing.Add(1)
		go func() { defer releasing.Done(); m.release(d) }()
	}
	// Takes wait no longer than a round: the member Lease's next renewal
	// must not wait behind a slow API server; what is left is taken in
	// the next round.
	actx, cancel := context.WithTimeout(ctx, m.cfg.RetryPeriod)
	defer cancel()
	gone := map[string]bool{}
	taken := 0
	for _, d := range append(p.Acquire, p.Alternates...) {
		if taken == len(p.Acquire) || actx.Err() != nil {
			return
		}
		if m.acquire(actx, d, gone) {
			taken++
		}
	}
}

// renewMember writes the member Lease, held by this replica and renewed now.
func (m *Manager) renewMember(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, m.cfg.RenewDeadline)
	defer cancel()
	start := time.Now()
	now := metav1.NewTime(start)
	m.mu.Lock()
	acquired, loaded := m.memberAcquired, m.memberLoaded
	m.mu.Unlock()
	if acquired.IsZero() {
		acquired = now
	}
	rec := resourcelock.LeaderElectionRecord{HolderIdentity: m.cfg.Identity, LeaseDurationSeconds: m.leaseSeconds(), AcquireTime: acquired, RenewTime: now}
	var err error
	if loaded {
		err = m.member.Update(ctx, rec)
	}
	if !loaded || apierrors.IsConflict(err) {
		_, _, err = m.member.Get(ctx)
		switch {
		case apierrors.IsNotFound(err):
			err = m.member.Create(ctx, rec)
		case err == nil:
			err = m.member.Update(ctx, rec)
		}
	}
	if err != nil {
		return fmt.Errorf("member lease %s/%s: %w", m.cfg.Namespace, m.member.LeaseMeta.Name, err)
	}
	m.mu.Lock()
	if m.renewed.IsZero() {
		m.log.Info("member lease held; sharing the drivers with the other replicas")
	}
	m.renewed, m.memberAcquired, m.memberLoaded = start, acquired, true
	m.mu.Unlock()
	return nil
}

// leaseSeconds is the lease duration as the Lease records it, rounded up:
// others then never judge it expired before this replica stops leading.
func (m *Manager) leaseSeconds() int {
	return max(1, int((m.cfg.LeaseDuration+time.Second-1)/time.Second))
}

// checkHeld ends the term of each driver whose Lease another member took
// (it judged this replica's member Lease expired).
func (m *Manager) checkHeld() {
	m.mu.Lock()
	var lost []string
	for d, t := range m.held {
		l, err := m.leases.Get(DriverLease(m.cfg.Name, d))
		if err != nil {
			continue
		}
		rec := resourcelock.LeaseSpecToLeaderElectionRecord(&l.Spec)
		// A cache behind this replica's own take shows fewer
		// transitions; a take by another shows more.
		if rec.HolderIdentity != m.cfg.Identity && rec.LeaderTransitions > t.transitions {
			lost = append(lost, d)
		}
	}
	m.mu.Unlock()
	for _, d := range lost {
		m.lose(d, "another replica holds its lease")
	}
}

// acquire takes driver's Lease if it is free: no holder, this replica, or
// a holder whose member Lease has not changed for its duration (checked
// again on the API server before the take, once per holder and round:
// gone holds the answers). The take is a write with the resource version
// the cache has: of two members taking at once, one wins; a cache behind
// loses, and the next round sees more.
func (m *Manager) acquire(ctx context.Context, driver string, gone map[string]bool) bool {
	ctx, cancel := context.WithTimeout(ctx, m.cfg.RenewDeadline)
	defer cancel()
	now := metav1.NewTime(time.Now())
	rec := resourcelock.LeaderElectionRecord{HolderIdentity: m.cfg.Identity, LeaseDurationSeconds: m.leaseSeconds(), AcquireTime: now, RenewTime: now}
	leases := m.cfg.Client.CoordinationV1().Leases(m.cfg.Namespace)
	_, cur := m.holder(driver, now.Time)
	from := ""
	var taken *coordinationv1.Lease
	var err error
	if cur == nil {
		l := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: DriverLease(m.cfg.Name, driver), Namespace: m.cfg.Namespace,
			Labels:      map[string]string{LabelElection: m.cfg.Name, LabelKind: "driver"},
			Annotations: map[string]string{LabelDriver: driver}}, Spec: resourcelock.LeaderElectionRecordToLeaseSpec(&rec)}
		if len(validation.IsValidLabelValue(driver)) == 0 {
			l.Labels[LabelDriver] = driver
		}
		taken, err = leases.Create(ctx, l, metav1.CreateOptions{})
	} else {
		prev := resourcelock.LeaseSpecToLeaderElectionRecord(&cur.Spec)
		from = prev.HolderIdentity
		if from != "" && from != m.cfg.Identity {
			dead, ok := gone[from]
			if !ok {
				dead = m.expired(ctx, from)
				gone[from] = dead
			}
			if !dead {
				return false
			}
		}
		rec.LeaderTransitions = prev.LeaderTransitions
		if from != m.cfg.Identity {
			rec.LeaderTransitions++
		}
		l := cur.DeepCopy()
		l.Spec = resourcelock.LeaderElectionRecordToLeaseSpec(&rec)
		taken, err = leases.Update(ctx, l, metav1.UpdateOptions{})
	}
	if err != nil {
		if ctx.Err() == nil {
			m.log.Debug("driver lease not taken", "driver", driver, "err", err)
		}
		return false
	}
	if m.cfg.Handover != nil {
		m.cfg.Handover(driver, true)
	}
	tctx, end := context.WithCancel(context.Background())
	m.mu.Lock()
	m.held[driver] = &term{lease: taken, ctx: tctx, cancel: end, transitions: rec.LeaderTransitions}
	n := len(m.held)
	m.mu.Unlock()
	m.gauge.WithLabelValues(driver, m.cfg.Identity).Set(1)
	m.log.Info("leading driver", "driver", driver, "from", from, "leading", n)
	if m.cfg.Started != nil {
		m.cfg.Started(driver)
	}
	return true
}

// expired checks on the API server that holder's member Lease is gone,
// released, or still the record this replica saw change more than its
// duration ago.
func (m *Manager) expired(ctx context.Context, holder string) bool {
	if m.live(holder, time.Now()) {
		return false
	}
	name := MemberLease(m.cfg.Name, holder)
	m.mu.Lock()
	o, seen := m.seen[name]
	m.mu.Unlock()
	l, err := m.cfg.Client.CoordinationV1().Leases(m.cfg.Namespace).Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return true
	case err != nil:
		return false
	}
	rec := resourcelock.LeaseSpecToLeaderElectionRecord(&l.Spec)
	if rec.HolderIdentity != holder {
		return true // released
	}
	return seen && l.ResourceVersion == o.rv
}

// release gives driver up: no new work at once, calls in flight may end
// for Drain, then are cancelled; then its Lease is written free.
func (m *Manager) release(driver string) {
	m.mu.Lock()
	t := m.held[driver]
	if t == nil || t.releasing {
		m.mu.Unlock()
		return
	}
	t.releasing = true
	inflight := t.inflight
	var idle chan struct{}
	if inflight > 0 {
		idle = make(chan struct{})
		t.idle = idle
	}
	m.mu.Unlock()
	m.log.Info("giving driver up to balance the replicas", "driver", driver, "calls_in_flight", inflight)
	if idle != nil {
		timer := time.NewTimer(m.cfg.Drain)
		select {
		case <-idle:
		case <-timer.C:
			m.log.Warn("calls still in flight after the drain time: cancelled", "driver", driver, "drain", m.cfg.Drain)
		}
		timer.Stop()
	}
	m.end(driver, t)
	ctx, cancel := context.WithTimeout(context.Background(), m.cfg.RenewDeadline)
	defer cancel()
	now := metav1.NewTime(time.Now())
	free := resourcelock.LeaderElectionRecord{LeaseDurationSeconds: 1, AcquireTime: now, RenewTime: now, LeaderTransitions: t.transitions}
	l := t.lease.DeepCopy()
	l.Spec = resourcelock.LeaderElectionRecordToLeaseSpec(&free)
	if _, err := m.cfg.Client.CoordinationV1().Leases(m.cfg.Namespace).Update(ctx, l, metav1.UpdateOptions{}); err != nil {
		m.log.Warn("driver lease not written free; it expires with the member lease", "driver", driver, "err", err)
		return
	}
	m.log.Info("driver lease released", "driver", driver)
}

// end ends the term of driver: its calls are cancelled, the bridge told.
func (m *Manager) end(driver string, t *term) {
	t.cancel()
	m.mu.Lock()
	if m.held[driver] == t {
		delete(m.held, driver)
	}
	m.mu.Unlock()
	if m.cfg.Handover != nil {
		m.cfg.Handover(driver, false)
	}
	m.gauge.DeleteLabelValues(driver, m.cfg.Identity)
}

// lose ends driver's term at once (its Lease is another's, or may be).
func (m *Manager) lose(driver, why string) {
	m.mu.Lock()
	t := m.held[driver]
	m.mu.Unlock()
	if t == nil {
		return
	}
	m.log.Warn("stopped leading driver", "driver", driver, "why", why)
	m.end(driver, t)
}

func (m *Manager) loseAll(why string) {
	m.mu.Lock()
	var ds []string
	for d := range m.held {
		ds = append(ds, d)
	}
	m.mu.Unlock()
	for _, d := range ds {
		m.lose(d, why)
	}
}

// stop ends every term as the process stops: with release, the driver
// Leases and the member Lease are written free (each driver's calls have
// ended by then), else left to expire.
func (m *Manager) stop(release bool) {
	if !release {
		m.loseAll("the replica stops")
		return
	}
	m.mu.Lock()
	var ds []string
	for d := range m.held {
		ds = append(ds, d)
	}
	m.mu.Unlock()
	var wg sync.WaitGroup
	for _, d := range ds {
		wg.Add(1)
		go func() { defer wg.Done(); m.release(d) }()
	}
	wg.Wait()
	m.mu.Lock()
	loaded := m.memberLoaded
	m.mu.Unlock()
	if !loaded {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), m.cfg.RenewDeadline)
	defer cancel()
	now := metav1.NewTime(time.Now())
	if err := m.member.Update(ctx, resourcelock.LeaderElectionRecord{LeaseDurationSeconds: 1, AcquireTime: now, RenewTime: now}); err != nil {
		m.log.Warn("member lease not written free; it expires", "err", err)
	}
}
