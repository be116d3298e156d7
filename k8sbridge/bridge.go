package k8sbridge

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/client-go/tools/record"

	"github.com/csibroker/csibroker/k8sbridge/attach"
	"github.com/csibroker/csibroker/k8sbridge/capacity"
	"github.com/csibroker/csibroker/k8sbridge/groupsnapshot"
	"github.com/csibroker/csibroker/k8sbridge/health"
	"github.com/csibroker/csibroker/k8sbridge/intent"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/modify"
	"github.com/csibroker/csibroker/k8sbridge/provision"
	"github.com/csibroker/csibroker/k8sbridge/resize"
	"github.com/csibroker/csibroker/k8sbridge/shard"
	"github.com/csibroker/csibroker/k8sbridge/snapshot"
)

// controller is one loop that runs while this replica leads.
type controller interface {
	// Run works until ctx ends (the term is over).
	Run(ctx context.Context)
	// EnqueueAll looks at every object of the controller again: a driver
	// was registered, whose objects were skipped when last seen.
	EnqueueAll()
}

// ctl makes a controller package's constructor one of New's list; a
// constructor that returns nil (the controller is not wanted) adds none.
func ctl[C any, P interface {
	*C
	controller
}](mk func(*kube.Env) (P, error)) func(*kube.Env) (controller, error) {
	return func(e *kube.Env) (controller, error) {
		c, err := mk(e)
		if err != nil || c == nil {
			return nil, err
		}
		return c, nil
	}
}

// Bridge runs the Kubernetes side of csibroker: one set of informers for all
// drivers, and the controllers, under one leader election.
type Bridge struct {
	// Env is what the controllers share (clients, listers, Events, the
	// intent record, the drivers' capabilities).
	*kube.Env

	synced []cache.InformerSynced
	// waitFor are more things the controllers wait for (WaitFor), with
	// what /readyz says while they are not there.
	waitFor []readiness

	prov  *provision.Provisioner
	del   *provision.Deleter
	extra []controller

	leaderMu sync.Mutex
	leading  bool
	leader   string

	// keepLeaseOnStop (tests) makes a stop look like a crash: the Lease is
	// not released, so a standby must wait for it to expire.
	keepLeaseOnStop bool

	// shards shares the drivers out among the replicas (per-driver
	// leader election); nil: one Lease for everything.
	shards *shard.Manager
	// acquired is nudged when this replica starts leading a driver, so
	// that its objects are looked at again at once.
	acquired chan struct{}
}

// New builds the bridge, its informers and its controllers (nothing runs
// until Run).
func New(cfg Config) (*Bridge, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("k8sbridge config: %w", err)
	}
	shards, err := newShards(&cfg)
	if err != nil {
		return nil, err
	}
	env, synced, err := kube.NewEnv(cfg)
	if err != nil {
		return nil, err
	}
	b := &Bridge{Env: env, synced: synced, shards: shards, acquired: make(chan struct{}, 1)}
	b.shareIntents()
	b.prov = provision.NewProvisioner(env)
	b.del = provision.NewDeleter(env, b.prov)
	env.On(env.Factory.Core().V1().PersistentVolumeClaims().Informer(), b.prov.ClaimHandler())
	env.On(env.Factory.Core().V1().PersistentVolumes().Informer(), b.del.VolumeHandler())
	// The other controllers, in the order their handlers see each event.
	for _, mk := range []func(*kube.Env) (controller, error){
		ctl(attach.New),
		ctl(capacity.New),
		ctl(health.New),
		ctl(modify.New),
		ctl(provision.NewSourceProtector),
		ctl(resize.New),
		ctl(snapshot.New),
		ctl(groupsnapshot.New),
	} {
		c, err := mk(env)
		if err != nil {
			return nil, err
		}
		if c != nil {
			b.extra = append(b.extra, c)
		}
	}
	// Informers the controllers added (the snapshot API's, when served).
	b.synced = append(b.synced, env.TakeSynced()...)
	if err := env.StartHandlers(); err != nil {
		return nil, err
	}
	return b, nil
}

// Leader reports whether this replica leads and who does.
func (b *Bridge) Leader() (bool, string) {
	b.leaderMu.Lock()
	defer b.leaderMu.Unlock()
	return b.leading, b.leader
}

// Recorder records Events through the bridge's broadcaster, on the Events'
// own client budget; they are sent while Run runs.
func (b *Bridge) Recorder() record.EventRecorder { return b.Env.Recorder }

// Client is the bridge's rate-limited Kubernetes client.
func (b *Bridge) Client() kubernetes.Interface { return b.Cfg.Client }

// InformerClient is the client of the bridge's informers, whose lists and
// watches have a budget of their own (another informer, such as proxy
// discovery's, should use it too).
func (b *Bridge) InformerClient() kubernetes.Interface { return b.Cfg.InformerClient }

// Ready reports whether the informer caches have synced; standby replicas
// keep theirs warm too, so a standby is ready as soon as the leader is. The
// broker's /readyz answers with it.
func (b *Bridge) Ready() error {
	for _, synced := range b.synced {
		if !synced() {
			return errors.New("kubernetes informer caches have not synced yet")
		}
	}
	for _, w := range b.waitFor {
		if !w.ready() {
			return errors.New(w.what)
		}
	}
	return nil
}

type readiness struct {
	ready func() bool
	what  string // said while not ready
}

// WaitFor makes the controllers wait, as for the informer caches, until
// ready reports true (the secret policy's grants loaded, so no claim is
// decided against an empty rule set); /readyz says what while it does not.
// Call it before Run.
func (b *Bridge) WaitFor(ready func() bool, what string) {
	b.waitFor = append(b.waitFor, readiness{ready: ready, what: what})
}

// Intents exposes the intent record (tests, status).
func (b *Bridge) Intents() *intent.Store { return b.Env.Intents }

// Run starts the informers (standby replicas keep warm caches too), waits for
// them, then runs the controllers while this replica holds the lease.
func (b *Bridge) Run(ctx context.Context) error {
	b.Broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: b.Cfg.EventClient.CoreV1().Events("")})
	defer b.Broadcaster.Shutdown()
	b.Factory.Start(ctx.Done())
	defer b.Factory.Shutdown()
	start := time.Now()
	if !cache.WaitForCacheSync(ctx.Done(), b.synced...) {
		return fmt.Errorf("informer caches did not sync: %w", ctx.Err())
	}
	b.Log.Info("informer caches synced", "took", time.Since(start).Round(time.Millisecond))
	for _, w := range b.waitFor {
		if w.ready() {
			continue
		}
		b.Log.Info("waiting before running the controllers", "for", w.what)
		if err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(context.Context) (bool, error) { return w.ready(), nil }); err != nil {
			return nil // stopped while waiting
		}
	}
	if !b.Cfg.LeaderElection {
		b.setLeader(true, b.Cfg.Identity)
		b.lead(ctx)
		return nil
	}
	if b.shards != nil {
		return b.runSharded(ctx)
	}
	return b.elect(ctx, b.lead)
}

// elect runs term while this replica holds the leader Lease, until ctx
// ends; the Lease is released once the last term has returned.
func (b *Bridge) elect(ctx context.Context, term func(context.Context)) error {
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Name: b.Cfg.LeaderElectionLockName, Namespace: b.Cfg.LeaderElectionNamespace},
		Client:     b.Cfg.LeaseClient.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: b.Cfg.Identity, EventRecorder: b.Env.Recorder},
	}
	for ctx.Err() == nil {
		// client-go starts OnStartedLeading in a goroutine and returns from
		// Run without waiting for it: a new term must not begin before the
		// last one's controllers have stopped.
		var termMu sync.Mutex
		var termDone chan struct{}
		// The elector runs until the process stops and the term's
		// controllers have stopped (below): the lease is released only
		// then, so a standby cannot start while this leader's workers
		// are still finishing. Not by client-go (ReleaseOnCancel): it
		// releases as soon as a renewal fails, before the term's context
		// is even cancelled, and a standby would lead at once beside
		// workers still running. A lease that failed to renew is left to
		// expire: a standby may take it once the lease duration has
		// passed since the last renewal, when this leader has given up
		// (the renew deadline, shorter) but its workers may still be
		// ending their calls. No write is fenced against that overlap;
		// the intent record's writes carry its resource version, so
		// neither leader's write replaces the other's record: a batch
		// that conflicts is applied again to what the other wrote.
		elCtx, elCancel := context.WithCancel(context.WithoutCancel(ctx))
		le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
			Lock:            lock,
			LeaseDuration:   b.Cfg.LeaderElectionLease,
			RenewDeadline:   b.Cfg.LeaderElectionRenew,
			RetryPeriod:     b.Cfg.LeaderElectionRetry,
			ReleaseOnCancel: false,
			Name:            b.Cfg.LeaderElectionLockName,
			Callbacks: leaderelection.LeaderCallbacks{
				OnStartedLeading: func(leCtx context.Context) {
					done := make(chan struct{})
					termMu.Lock()
					termDone = done
					termMu.Unlock()
					defer close(done)
					if leCtx.Err() != nil || ctx.Err() != nil {
						// Started after Run had returned (client-go
						// starts this in a goroutine, and cancels leCtx
						// as Run returns): the loop may be in the
						// next term already, which must not be
						// disturbed.
						return
					}
					// The term ends when the lease is lost or when the
					// process stops, whichever comes first.
					termCtx, endTerm := context.WithCancel(leCtx)
					defer endTerm()
					stop := context.AfterFunc(ctx, endTerm)
					defer stop()
					b.Log.Info("became leader", "identity", b.Cfg.Identity)
					b.setLeader(true, b.Cfg.Identity)
					// Also here: OnStoppedLeading may have run between the
					// check above and the line before.
					defer b.setLeader(false, "")
					term(termCtx)
				},
				OnStoppedLeading: func() {
					b.Log.Info("stopped leading", "identity", b.Cfg.Identity)
					b.setLeader(false, "")
				},
				OnNewLeader: func(id string) {
					b.leaderMu.Lock()
					b.leader = id
					b.leaderMu.Unlock()
					if id != b.Cfg.Identity {
						b.Log.Info("leader is another replica", "leader", id)
					}
				},
			},
		})
		if err != nil {
			elCancel()
			return err
		}
		ran := make(chan struct{})
		go func() {
			select {
			case <-ran:
				return
			case <-ctx.Done():
			}
			// The process stops: the term first, then the elector;
			// the lease is released by hand after both (below).
			termMu.Lock()
			done := termDone
			termMu.Unlock()
			if done != nil {
				<-done
			}
			elCancel()
		}()
		le.Run(elCtx)
		close(ran)
		elCancel()
		termMu.Lock()
		done := termDone
		termMu.Unlock()
		if done != nil {
			<-done
		}
		if ctx.Err() != nil && !b.keepLeaseOnStop {
			b.releaseLease(lock)
		}
	}
	return nil
}

// releaseLease gives the lease up as the process stops, once the term's
// controllers have stopped, if this replica still holds it: the record is
// read and written back free with its resourceVersion, so a lease another
// replica took meanwhile is left alone.
func (b *Bridge) releaseLease(lock *resourcelock.LeaseLock) {
	ctx, cancel := context.WithTimeout(context.Background(), b.Cfg.LeaderElectionRenew)
	defer cancel()
	rec, _, err := lock.Get(ctx)
	if err != nil || rec.HolderIdentity != b.Cfg.Identity {
		return
	}
	now := metav1.NewTime(time.Now())
	free := resourcelock.LeaderElectionRecord{LeaderTransitions: rec.LeaderTransitions, LeaseDurationSeconds: 1, RenewTime: now, AcquireTime: now}
	if err := lock.Update(ctx, free); err != nil {
		b.Log.Warn("releasing the leader lease failed; it expires by itself", "err", err)
		return
	}
	b.Log.Info("leader lease released", "identity", b.Cfg.Identity)
}

func (b *Bridge) setLeader(leading bool, id string) {
	b.leaderMu.Lock()
	b.leading = leading
	if id != "" {
		b.leader = id
	}
	b.leaderMu.Unlock()
	v := 0.0
	if leading {
		v = 1
	}
	b.Metrics.Leader.Set(v)
}

// lead runs every controller until ctx ends (the lease is lost or the
// process stops), then waits for them.
func (b *Bridge) lead(ctx context.Context) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// What was reported is of a term: another leader may have reported
	// other things since, and an Event dropped as the last term ended may
	// be remembered as sent.
	b.ResetEvents()
	// Before any worker may record an intent: Run, started below with
	// them, may come later.
	b.Env.Intents.StartTerm()
	// The drivers known before the controllers list their objects: one
	// registered from here on is seen as new, and its objects listed again.
	known := map[string]bool{}
	for _, n := range b.Cfg.Drivers.DriverNames() {
		known[n] = true
	}
	var wg sync.WaitGroup
	run := func(f func(context.Context)) {
		wg.Add(1)
		go func() { defer wg.Done(); f(ctx) }()
	}
	run(b.Env.Intents.Run)
	run(b.prov.Run)
	run(b.del.Run)
	run(b.prov.RecoveryLoop)
	for _, c := range b.extra {
		run(c.Run)
	}
	run(func(ctx context.Context) { b.watchRegistrations(ctx, known) })
	<-ctx.Done()
	wg.Wait()
}

// watchRegistrations re-lists claims, volumes and attachments when a driver
// is registered (a static entry at start-up, or a proxy discovered later):
// objects of a driver the broker did not know yet were skipped when they
// were last seen.
func (b *Bridge) watchRegistrations(ctx context.Context, known map[string]bool) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-b.acquired:
		}
		added := false
		now := map[string]bool{}
		for _, n := range b.Cfg.Drivers.DriverNames() {
			now[n] = true
			if !known[n] {
				added = true
				b.Log.Info("driver registered: looking at its objects again", "driver", n)
			}
		}
		known = now
		if !added {
			continue
		}
		b.prov.EnqueueAll()
		b.del.EnqueueAll()
		for _, c := range b.extra {
			c.EnqueueAll()
		}
	}
}
