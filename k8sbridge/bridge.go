package k8sbridge

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	snapshotclient "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/client-go/tools/record"

	"github.com/csibroker/csibroker/k8sbridge/intent"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/policy"
)

// SecretPolicy decides whether a driver may receive a secret; policy.Authorizer
// satisfies it.
type SecretPolicy interface {
	Decide(ctx context.Context, req policy.Request) policy.Decision
}

// Config is everything the bridge needs; cmd/ fills it from flags.
type Config struct {
	// Client is the rate-limited client for objects (--kube-api-qps/-burst).
	Client kubernetes.Interface
	// EventClient has a budget of its own so Events are never starved by
	// object writes; LeaseClient the same for leader election.
	EventClient kubernetes.Interface
	LeaseClient kubernetes.Interface
	// InformerClient lists and watches for the informers, with a budget of
	// its own: filling or refilling the caches (nine LISTs at start, a
	// relist after a watch expires) then never waits behind object writes,
	// nor writes behind it. Defaults to Client.
	InformerClient kubernetes.Interface
	// IntentClient and IntentBudget, set together: IntentClient reaches the
	// API server like Client but without a rate limiter, and IntentBudget
	// is Client's rate limiter. The intent record then takes each
	// request's token from Client's budget before it cuts its batch, so a
	// write that waited behind PV writes carries every claim that arrived
	// meanwhile (intent.Store.UseBudget). Unset: the record writes through
	// Client.
	IntentClient kubernetes.Interface
	IntentBudget interface{ Wait(context.Context) error }
	// SnapshotClient reads VolumeSnapshots and their contents for claims
	// restored from one (and marks a snapshot in use); nil refuses such
	// claims with an Event.
	SnapshotClient snapshotclient.Interface

	Drivers Drivers
	Policy  SecretPolicy

	// Namespace holds the broker's Lease and intent record.
	Namespace string
	// Identity of this replica (pod name) for the Lease and Events.
	Identity string

	LeaderElection         bool
	LeaderElectionLease    time.Duration
	LeaderElectionRenew    time.Duration
	LeaderElectionRetry    time.Duration
	LeaderElectionLockName string
	// LeaderElectionNamespace holds the Lease (default Namespace).
	LeaderElectionNamespace string

	VolumeNamePrefix     string
	VolumeNameUUIDLength int
	ExtraCreateMetadata  bool
	// ExtraModifyMetadata adds csi.storage.k8s.io/pvc/name, /pvc/namespace
	// and /pv/name to ControllerModifyVolume's mutable parameters
	// (external-resizer's --extra-modify-metadata).
	ExtraModifyMetadata bool
	// DefaultFSType is the filesystem of mount volumes whose class names
	// none (external-provisioner's --default-fstype); empty: none.
	DefaultFSType string
	// ControllerPublishReadOnly marks the PVs of claims whose only access
	// mode is ReadOnlyMany read-only (spec.csi.readOnly), so the driver is
	// asked to attach them read-only (external-provisioner's
	// --controller-publish-readonly).
	ControllerPublishReadOnly bool
	StrictTopology            bool
	ImmediateTopology         bool
	// CapacityForImmediateBinding publishes capacity for Immediate classes
	// too (the scheduler reads it for WaitForFirstConsumer claims only).
	CapacityForImmediateBinding bool

	WorkerThreads int
	// PerDriverWorkers bounds concurrent operations per driver so a slow
	// driver cannot take every worker.
	PerDriverWorkers   int
	RetryIntervalStart time.Duration
	RetryIntervalMax   time.Duration
	// Timeout bounds one CreateVolume/DeleteVolume call (the broker's client
	// chain retries inside it).
	Timeout time.Duration
	// RecoveryInterval is how often leaked-volume recovery runs (it also
	// runs when a claim being provisioned is deleted).
	RecoveryInterval time.Duration
	ResyncPeriod     time.Duration

	Logger         *slog.Logger
	TracerProvider trace.TracerProvider
	Registerer     prometheus.Registerer
}

// Validate checks the configuration and fills defaults.
func (c *Config) Validate() error {
	var errs []error
	if c.Client == nil {
		errs = append(errs, errors.New("kubernetes client is required"))
	}
	if c.Drivers == nil {
		errs = append(errs, errors.New("drivers are required"))
	}
	if c.Policy == nil {
		errs = append(errs, errors.New("a secret policy is required (use policy mode off to allow everything)"))
	}
	if c.Namespace == "" {
		errs = append(errs, errors.New("namespace is required"))
	}
	if c.VolumeNamePrefix == "" {
		c.VolumeNamePrefix = "pvc"
	}
	if c.EventClient == nil {
		c.EventClient = c.Client
	}
	if c.LeaseClient == nil {
		c.LeaseClient = c.Client
	}
	if c.InformerClient == nil {
		c.InformerClient = c.Client
	}
	if c.Identity == "" {
		c.Identity = "csibroker"
	}
	if c.LeaderElectionLease <= 0 {
		c.LeaderElectionLease = 3 * time.Second
	}
	if c.LeaderElectionRenew <= 0 {
		c.LeaderElectionRenew = 2500 * time.Millisecond
	}
	if c.LeaderElectionRetry <= 0 {
		c.LeaderElectionRetry = 500 * time.Millisecond
	}
	if c.LeaderElectionRenew >= c.LeaderElectionLease {
		errs = append(errs, errors.New("leader election renew deadline must be shorter than the lease duration"))
	}
	if c.LeaderElectionNamespace == "" {
		c.LeaderElectionNamespace = c.Namespace
	}
	if c.LeaderElectionLockName == "" {
		c.LeaderElectionLockName = "csibroker-leader"
	}
	if c.WorkerThreads <= 0 {
		c.WorkerThreads = 100
	}
	if c.PerDriverWorkers <= 0 {
		c.PerDriverWorkers = c.WorkerThreads
	}
	if c.RetryIntervalStart <= 0 {
		c.RetryIntervalStart = time.Second
	}
	if c.RetryIntervalMax <= 0 {
		c.RetryIntervalMax = 5 * time.Minute
	}
	if c.Timeout <= 0 {
		c.Timeout = time.Minute
	}
	if c.ResyncPeriod == 0 {
		c.ResyncPeriod = 10 * time.Minute
	}
	if c.RecoveryInterval <= 0 {
		c.RecoveryInterval = time.Minute
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.TracerProvider == nil {
		c.TracerProvider = noop.NewTracerProvider()
	}
	return errors.Join(errs...)
}

// controller is one loop that runs while this replica leads.
type controller interface {
	run(ctx context.Context)
}

// volumeChange is a volume made or deleted at a driver, or a CreateVolume
// refused for want of room: where its storage is, as far as known.
type volumeChange struct {
	driver string
	class  string              // "": any class of the driver (a pool serves them all)
	node   string              // a node-local driver's node ("": not node-local, or not known)
	topo   []map[string]string // the volume's accessible segments (none: not known)
}

// noteVolumeChange tells the controllers that follow volumes (capacity).
func (b *Bridge) noteVolumeChange(v volumeChange) {
	for _, f := range b.volumeChanged {
		f(v)
	}
}

// deleted is the object of an informer's delete event as a T, unwrapped
// from the tombstone of a deletion seen only by a relist.
func deleted[T any](obj any) (T, bool) {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	o, ok := obj.(T)
	return o, ok
}

// driverLookup is what the broker adds to Drivers: whether one driver is
// registered, without listing them all (asked on every informer event).
type driverLookup interface {
	HasDriver(name string) bool
}

// registered says whether driver is one of the broker's drivers.
func (b *Bridge) registered(driver string) bool {
	if l, ok := b.cfg.Drivers.(driverLookup); ok {
		return l.HasDriver(driver)
	}
	return slices.Contains(b.cfg.Drivers.DriverNames(), driver)
}

// extraControllers are built by New after the provisioner and deleter; each
// controller's file adds its constructor from init, so controllers can be
// added without touching this file. A constructor registers its informer
// handlers on b.factory.
var extraControllers []func(b *Bridge) (controller, error)

// Bridge runs the Kubernetes side of csibroker: one set of informers for all
// drivers, and the controllers, under one leader election.
type Bridge struct {
	cfg     Config
	log     *slog.Logger
	tracer  trace.Tracer
	metrics *metrics

	factory     informers.SharedInformerFactory
	claims      corelisters.PersistentVolumeClaimLister
	volumes     corelisters.PersistentVolumeLister
	classes     storagelisters.StorageClassLister
	nodes       corelisters.NodeLister
	csiNodes    storagelisters.CSINodeLister
	attachments storagelisters.VolumeAttachmentLister
	namespaces  corelisters.NamespaceLister
	synced      []cache.InformerSynced
	// waitFor are more things the controllers wait for (WaitFor), with
	// what /readyz says while they are not there.
	waitFor []readiness

	recorder record.EventRecorder
	// sent is what eventOnce recorded last on each object, per reason.
	sent        eventMemory
	broadcaster record.EventBroadcaster
	caps        *capsCache
	intents     *intent.Store

	prov  *provisioner
	del   *deleter
	fans  []*fanout // handlers being added (New), registered at its end
	extra []controller
	// volumeChanged are told of each volume made or deleted (capacity
	// refreshes what it took or freed); set up by New, read-only after.
	volumeChanged []func(volumeChange)

	leaderMu sync.Mutex
	leading  bool
	leader   string

	// keepLeaseOnStop (tests) makes a stop look like a crash: the Lease is
	// not released, so a standby must wait for it to expire.
	keepLeaseOnStop bool
}

// New builds the bridge and its informers (nothing runs until Run).
func New(cfg Config) (*Bridge, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("k8sbridge config: %w", err)
	}
	b := &Bridge{cfg: cfg, log: cfg.Logger.With("component", "k8sbridge"), tracer: cfg.TracerProvider.Tracer("github.com/csibroker/csibroker/k8sbridge")}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	b.metrics = m
	b.factory = informers.NewSharedInformerFactoryWithOptions(cfg.InformerClient, cfg.ResyncPeriod, informers.WithTransform(kube.StripBulk)) // trim.go
	claims := b.factory.Core().V1().PersistentVolumeClaims()
	volumes := b.factory.Core().V1().PersistentVolumes()
	classes := b.factory.Storage().V1().StorageClasses()
	nodes := b.factory.Core().V1().Nodes()
	csiNodes := b.factory.Storage().V1().CSINodes()
	attachments := b.factory.Storage().V1().VolumeAttachments()
	namespaces := b.factory.Core().V1().Namespaces()
	b.claims, b.volumes, b.classes = claims.Lister(), volumes.Lister(), classes.Lister()
	b.nodes, b.csiNodes, b.attachments, b.namespaces = nodes.Lister(), csiNodes.Lister(), attachments.Lister(), namespaces.Lister()
	b.synced = []cache.InformerSynced{claims.Informer().HasSynced, volumes.Informer().HasSynced, classes.Informer().HasSynced,
		nodes.Informer().HasSynced, csiNodes.Informer().HasSynced, attachments.Informer().HasSynced, namespaces.Informer().HasSynced}

	b.broadcaster = record.NewBroadcaster(record.WithContext(context.Background()))
	b.recorder = b.broadcaster.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "csibroker", Host: cfg.Identity})
	b.caps = &capsCache{drivers: cfg.Drivers}
	b.intents = intent.NewStore(cfg.Client, cfg.Namespace, "csibroker-intents", b.log)
	if cfg.IntentClient != nil && cfg.IntentBudget != nil {
		b.intents.UseBudget(cfg.IntentClient, cfg.IntentBudget.Wait)
	}
	b.intents.UseReader(cfg.InformerClient)

	b.prov = newProvisioner(b)
	b.del = newDeleter(b)
	b.on(claims.Informer(), b.prov.claimHandler())
	b.on(volumes.Informer(), b.del.volumeHandler())
	for _, mk := range extraControllers {
		c, err := mk(b)
		if err != nil {
			return nil, err
		}
		if c != nil {
			b.extra = append(b.extra, c)
		}
	}
	for _, f := range b.fans {
		if _, err := f.inf.AddEventHandler(f); err != nil {
			return nil, err
		}
	}
	b.fans = nil
	return b, nil
}

// on adds a controller's handler of inf's events. The handlers of one
// informer are registered as one (fanout): client-go runs each registered
// handler on goroutines of its own, so every event would wake two more
// goroutines per extra handler, on the path of every volume.
func (b *Bridge) on(inf cache.SharedIndexInformer, h cache.ResourceEventHandler) {
	for _, f := range b.fans {
		if f.inf == inf {
			f.hs = append(f.hs, h)
			return
		}
	}
	b.fans = append(b.fans, &fanout{inf: inf, hs: []cache.ResourceEventHandler{h}})
}

// fanout passes each event of one informer to several handlers, in the
// order they were added. Every handler only queues work.
type fanout struct {
	inf cache.SharedIndexInformer
	hs  []cache.ResourceEventHandler
}

func (f *fanout) OnAdd(obj any, isInInitialList bool) {
	for _, h := range f.hs {
		h.OnAdd(obj, isInInitialList)
	}
}

func (f *fanout) OnUpdate(oldObj, newObj any) {
	for _, h := range f.hs {
		h.OnUpdate(oldObj, newObj)
	}
}

func (f *fanout) OnDelete(obj any) {
	for _, h := range f.hs {
		h.OnDelete(obj)
	}
}

// Leader reports whether this replica leads and who does.
func (b *Bridge) Leader() (bool, string) {
	b.leaderMu.Lock()
	defer b.leaderMu.Unlock()
	return b.leading, b.leader
}

// Recorder records Events through the bridge's broadcaster, on the Events'
// own client budget; they are sent while Run runs.
func (b *Bridge) Recorder() record.EventRecorder { return b.recorder }

// Client is the bridge's rate-limited Kubernetes client.
func (b *Bridge) Client() kubernetes.Interface { return b.cfg.Client }

// InformerClient is the client of the bridge's informers, whose lists and
// watches have a budget of their own (another informer, such as proxy
// discovery's, should use it too).
func (b *Bridge) InformerClient() kubernetes.Interface { return b.cfg.InformerClient }

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
func (b *Bridge) Intents() *intent.Store { return b.intents }

// Run starts the informers (standby replicas keep warm caches too), waits for
// them, then runs the controllers while this replica holds the lease.
func (b *Bridge) Run(ctx context.Context) error {
	b.broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: b.cfg.EventClient.CoreV1().Events("")})
	defer b.broadcaster.Shutdown()
	b.factory.Start(ctx.Done())
	defer b.factory.Shutdown()
	start := time.Now()
	if !cache.WaitForCacheSync(ctx.Done(), b.synced...) {
		return fmt.Errorf("informer caches did not sync: %w", ctx.Err())
	}
	b.log.Info("informer caches synced", "took", time.Since(start).Round(time.Millisecond))
	for _, w := range b.waitFor {
		if w.ready() {
			continue
		}
		b.log.Info("waiting before running the controllers", "for", w.what)
		if err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(context.Context) (bool, error) { return w.ready(), nil }); err != nil {
			return nil // stopped while waiting
		}
	}
	if !b.cfg.LeaderElection {
		b.setLeader(true, b.cfg.Identity)
		b.lead(ctx)
		return nil
	}
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Name: b.cfg.LeaderElectionLockName, Namespace: b.cfg.LeaderElectionNamespace},
		Client:     b.cfg.LeaseClient.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: b.cfg.Identity, EventRecorder: b.recorder},
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
			LeaseDuration:   b.cfg.LeaderElectionLease,
			RenewDeadline:   b.cfg.LeaderElectionRenew,
			RetryPeriod:     b.cfg.LeaderElectionRetry,
			ReleaseOnCancel: false,
			Name:            b.cfg.LeaderElectionLockName,
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
					b.log.Info("became leader", "identity", b.cfg.Identity)
					b.setLeader(true, b.cfg.Identity)
					// Also here: OnStoppedLeading may have run between the
					// check above and the line before.
					defer b.setLeader(false, "")
					b.lead(termCtx)
				},
				OnStoppedLeading: func() {
					b.log.Info("stopped leading", "identity", b.cfg.Identity)
					b.setLeader(false, "")
				},
				OnNewLeader: func(id string) {
					b.leaderMu.Lock()
					b.leader = id
					b.leaderMu.Unlock()
					if id != b.cfg.Identity {
						b.log.Info("leader is another replica", "leader", id)
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
	ctx, cancel := context.WithTimeout(context.Background(), b.cfg.LeaderElectionRenew)
	defer cancel()
	rec, _, err := lock.Get(ctx)
	if err != nil || rec.HolderIdentity != b.cfg.Identity {
		return
	}
	now := metav1.NewTime(time.Now())
	free := resourcelock.LeaderElectionRecord{LeaderTransitions: rec.LeaderTransitions, LeaseDurationSeconds: 1, RenewTime: now, AcquireTime: now}
	if err := lock.Update(ctx, free); err != nil {
		b.log.Warn("releasing the leader lease failed; it expires by itself", "err", err)
		return
	}
	b.log.Info("leader lease released", "identity", b.cfg.Identity)
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
	b.metrics.leader.Set(v)
}

// lead runs every controller until ctx ends (the lease is lost or the
// process stops), then waits for them.
func (b *Bridge) lead(ctx context.Context) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// What was reported is of a term: another leader may have reported
	// other things since, and an Event dropped as the last term ended may
	// be remembered as sent.
	b.sent.reset()
	// Before any worker may record an intent: Run, started below with
	// them, may come later.
	b.intents.StartTerm()
	// The drivers known before the controllers list their objects: one
	// registered from here on is seen as new, and its objects listed again.
	known := map[string]bool{}
	for _, n := range b.cfg.Drivers.DriverNames() {
		known[n] = true
	}
	var wg sync.WaitGroup
	run := func(f func(context.Context)) {
		wg.Add(1)
		go func() { defer wg.Done(); f(ctx) }()
	}
	run(b.intents.Run)
	run(b.prov.run)
	run(b.del.run)
	run(b.prov.recoveryLoop)
	for _, c := range b.extra {
		run(c.run)
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
		}
		added := false
		now := map[string]bool{}
		for _, n := range b.cfg.Drivers.DriverNames() {
			now[n] = true
			if !known[n] {
				added = true
				b.log.Info("driver registered: looking at its objects again", "driver", n)
			}
		}
		known = now
		if !added {
			continue
		}
		b.prov.enqueueAll()
		b.del.enqueueAll()
		for _, c := range b.extra {
			if r, ok := c.(interface{ enqueueAll() }); ok {
				r.enqueueAll()
			}
		}
	}
}

// eventRepeat is how long an Event that eventOnce recorded stands for the
// failure it reports: a failure that lasts is recorded again after it, so
// that its Event outlives the API server's Event lifetime (--event-ttl,
// one hour by default) instead of vanishing while the failure goes on.
const eventRepeat = 10 * time.Minute

// eventOnce records an Event as event does, unless the last Event with
// this reason that eventOnce recorded on obj (this term, since forgetEvents)
// was about the same thing, what, and less than eventRepeat ago. A failure
// retried with backoff is reported once instead of on every attempt (every
// Event carries its attempt's trace ID, so the recorder would write each
// one anew, on the Events' budget); the caller logs every attempt.
func (b *Bridge) eventOnce(ctx context.Context, obj corev1.ObjectReference, eventType, reason, what, format string, args ...any) {
	if ctx.Err() != nil {
		return // event records nothing either: nothing to remember
	}
	if !b.sent.first(obj.UID, reason, what, time.Now()) {
		b.log.Debug("reported on the object already; no Event", "object", obj.Kind+" "+obj.Namespace+"/"+obj.Name, "reason", reason)
		return
	}
	b.event(ctx, obj, eventType, reason, format, args...)
}

// failureOf names err for eventOnce: a gRPC status (a driver's answer) by
// method and code, since drivers put what changes on every call (a request
// ID, an attempt counter) into their messages; anything else by its
// message.
func failureOf(method string, err error) string {
	if errors.As(err, new(unreachable)) {
		method = "unreachable" // the capabilities lookup's answer, not the method's
	}
	if st, ok := status.FromError(err); ok {
		return method + " " + st.Code().String()
	}
	return err.Error()
}

// unreachable marks the failure of a driver's capabilities lookup, so that
// failureOf tells it apart from the answers of the method it came before.
type unreachable struct{ error }

func (u unreachable) Unwrap() error { return u.error }

// forgetEvents drops what eventOnce remembers of obj (it succeeded, or is
// gone): whatever comes next is news.
func (b *Bridge) forgetEvents(obj types.UID) { b.sent.forget(obj) }

// eventMemory is, per object and reason, what the last Event recorded was
// about and when: one entry per object and reason, dropped with the object
// (forget) and at each term's start (reset).
type eventMemory struct {
	mu   sync.Mutex
	last map[types.UID]map[string]sentEvent // object → reason → the last one
}

type sentEvent struct {
	what string
	at   time.Time
}

// first reports whether an Event about what, with reason, is to be
// recorded on obj at now: the last one was about something else, or
// eventRepeat ago or more. If so, it is remembered as the last.
func (m *eventMemory) first(obj types.UID, reason, what string, now time.Time) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	byReason := m.last[obj]
	if prev, ok := byReason[reason]; ok && prev.what == what && now.Sub(prev.at) < eventRepeat {
		return false
	}
	if byReason == nil {
		if m.last == nil {
			m.last = map[types.UID]map[string]sentEvent{}
		}
		byReason = map[string]sentEvent{}
		m.last[obj] = byReason
	}
	byReason[reason] = sentEvent{what, now}
	return true
}

func (m *eventMemory) forget(obj types.UID) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.last, obj)
}

func (m *eventMemory) reset() {
	m.mu.Lock()
	defer m.mu.Unlock()
	clear(m.last)
}

// event records an Event on obj with the trace ID of ctx's span, if any.
func (b *Bridge) event(ctx context.Context, obj corev1.ObjectReference, eventType, reason, format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	if ctx.Err() != nil {
		// The leadership term (or the process) ended under the operation:
		// what failed is the cancellation, not the object, and the next
		// leader takes the object up again.
		b.log.Debug("event not recorded: the term ended", "object", obj.Kind+" "+obj.Namespace+"/"+obj.Name, "reason", reason, "message", msg)
		return
	}
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		msg += " (trace " + sc.TraceID().String() + ")"
	}
	b.recorder.Event(&obj, eventType, reason, msg)
}

// sleepCtx waits d, or less if ctx ends first; it reports whether ctx is
// still live.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
