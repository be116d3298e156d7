package shard

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	coordinationlisters "k8s.io/client-go/listers/coordination/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
)

// Labels of the Leases the manager writes.
const (
	// LabelElection names the election (the lock name) a Lease belongs to.
	LabelElection = "csibroker.io/leader-election"
	// LabelKind is "member" or "driver".
	LabelKind = "csibroker.io/lease"
	// LabelDriver is a driver Lease's driver, as a label (when the name
	// is a valid label value, as CSI driver names are) and an annotation.
	LabelDriver = "csibroker.io/driver"
)

// Config is what a Manager needs.
type Config struct {
	// Client writes and watches the Leases (the bridge's Lease client,
	// with a budget of its own).
	Client    kubernetes.Interface
	Namespace string
	// Name is the election's name (the leader Lease's), the prefix of
	// every Lease here.
	Name     string
	Identity string
	// LeaseDuration, RenewDeadline and RetryPeriod mean what they mean to
	// client-go's leader election, for the member Lease.
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
	// Drivers is this replica's whole registry.
	Drivers drivers.Drivers
	// Handover is told of each driver this replica starts or stops leading
	// (the bridge re-reads the intent record and drops what was queued).
	Handover func(driver string, leading bool)
	// Started is told of each driver this replica leads now (after
	// Handover, once Leads says so).
	Started func(driver string)
	// Drain bounds how long a driver given up keeps its calls in flight
	// before they are cancelled (default RenewDeadline).
	Drain      time.Duration
	Log        *slog.Logger
	Registerer prometheus.Registerer
}

// Manager holds this replica's member Lease and its share of the driver
// Leases (see the package documentation).
type Manager struct {
	cfg     Config
	log     *slog.Logger
	leases  coordinationlisters.LeaseNamespaceLister
	factory informers.SharedInformerFactory
	synced  cache.InformerSynced
	gauge   *prometheus.GaugeVec

	member *resourcelock.LeaseLock

	mu sync.Mutex
	// renewed is when the member Lease was last renewed; zero: not yet.
	renewed time.Time
	// memberAcquired: when this replica first held its member Lease;
	// memberLoaded: the lock has the Lease object (Get or Create done).
	memberAcquired metav1.Time
	memberLoaded   bool
	held           map[string]*term
	// seen: when each Lease's record was last seen to change (by this
	// replica's clock, as client-go's elector judges expiry).
	seen map[string]observed
}

// term is this replica's leadership of one driver.
type term struct {
	lease     *coordinationv1.Lease // as this replica last wrote it
	ctx       context.Context       // cancelled when the term ends
	cancel    context.CancelFunc
	releasing bool // being given up: no new work
	inflight  int
	// transitions is the Lease's LeaderTransitions as this term took it.
	transitions int
	idle        chan struct{} // closed when inflight drops to 0 while releasing
}

type observed struct {
	rv  string
	at  time.Time
	rec resourcelock.LeaderElectionRecord
}

// New makes a Manager (nothing runs until Run).
func New(cfg Config) (*Manager, error) {
	if cfg.Client == nil || cfg.Namespace == "" || cfg.Name == "" || cfg.Identity == "" || cfg.Drivers == nil {
		return nil, errors.New("shard: client, namespace, name, identity and the registered drivers are required")
	}
	if cfg.Drain <= 0 {
		cfg.Drain = cfg.RenewDeadline
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	m := &Manager{cfg: cfg, log: cfg.Log.With("component", "shard", "identity", cfg.Identity), held: map[string]*term{}, seen: map[string]observed{}}
	m.factory = informers.NewSharedInformerFactoryWithOptions(cfg.Client, 0, informers.WithNamespace(cfg.Namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = LabelElection + "=" + cfg.Name }))
	inf := m.factory.Coordination().V1().Leases()
	m.leases, m.synced = inf.Lister().Leases(cfg.Namespace), inf.Informer().HasSynced
	// A member Lease's change is noted as it arrives, not at the next
	// round: a dead member's drivers are then taken within the lease
	// duration and one retry period of its last renewal.
	if _, err := inf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { m.note(obj, time.Now()) },
		UpdateFunc: func(_, obj any) { m.note(obj, time.Now()) },
	}); err != nil {
		return nil, fmt.Errorf("shard: lease informer: %w", err)
	}
	m.member = m.lock(MemberLease(cfg.Name, cfg.Identity), map[string]string{LabelKind: "member"})
	m.gauge = prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "csibroker_driver_leader",
		Help: "1 for each driver this replica leads (per-driver leader election); replica is its identity"}, []string{"driver", "replica"})
	if cfg.Registerer != nil {
		if err := cfg.Registerer.Register(m.gauge); err != nil {
			return nil, fmt.Errorf("shard metrics: %w", err)
		}
	}
	return m, nil
}

func (m *Manager) lock(name string, extra map[string]string) *resourcelock.LeaseLock {
	l := map[string]string{LabelElection: m.cfg.Name}
	for k, v := range extra {
		l[k] = v
	}
	return &resourcelock.LeaseLock{LeaseMeta: metav1.ObjectMeta{Name: name, Namespace: m.cfg.Namespace}, Client: m.cfg.Client.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: m.cfg.Identity}, Labels: l}
}

// MemberLease is the name of identity's member Lease in election name.
func MemberLease(name, identity string) string { return leaseName(name+"-member-", identity) }

// DriverLease is the name of driver's Lease in election name.
func DriverLease(name, driver string) string { return leaseName(name+"-driver-", driver) }

var notInName = regexp.MustCompile(`[^a-z0-9.-]+`)

// leaseName is prefix+s as a valid object name: lower case, other
// characters dashed, and a hash of s appended when that changed it (two
// names that differ only there stay apart) or the name is too long.
func leaseName(prefix, s string) string {
	n := strings.Trim(notInName.ReplaceAllString(strings.ToLower(s), "-"), "-.")
	if n == s && len(validation.IsDNS1123Subdomain(prefix+n)) == 0 {
		return prefix + n
	}
	sum := sha256.Sum256([]byte(s))
	h := hex.EncodeToString(sum[:5])
	if len(prefix)+len(n)+1+len(h) > 253 {
		n = strings.Trim(n[:253-len(prefix)-1-len(h)], "-.")
	}
	if out := prefix + n + "-" + h; n != "" && len(validation.IsDNS1123Subdomain(out)) == 0 {
		return out
	}
	return prefix + h // what is left of s is no name (dots in a row, say)
}

// OnHandover sets Config.Handover and Config.Started (before Run).
func (m *Manager) OnHandover(handover func(driver string, leading bool), started func(driver string)) {
	m.cfg.Handover, m.cfg.Started = handover, started
}

// HasSynced reports whether the Lease cache is filled.
func (m *Manager) HasSynced() bool { return m.synced() }

// Leads reports whether this replica leads driver now: it holds its Lease,
// is not giving it up, and its member Lease was renewed within the renew
// deadline.
func (m *Manager) Leads(driver string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	t := m.held[driver]
	return t != nil && !t.releasing && m.memberValidLocked(time.Now())
}

func (m *Manager) memberValidLocked(now time.Time) bool {
	return !m.renewed.IsZero() && now.Sub(m.renewed) < m.cfg.RenewDeadline
}

// Foreign reports whether driver is not this replica's to work on: it is
// registered here but not led here, or another live member holds it. A
// driver registered nowhere and held by no one is not foreign (what is
// left of it, such as intent entries, anyone may settle).
func (m *Manager) Foreign(driver string) bool {
	if m.Leads(driver) {
		return false
	}
	if m.cfg.Drivers.HasDriver(driver) {
		return true
	}
	h, _ := m.holder(driver, time.Now())
	return h != "" && h != m.cfg.Identity
}

// Track marks a call to driver in flight until done; its context ends when
// this replica's term of driver ends (already ended, for a foreign driver).
// Calls to a driver led by no one pass untouched.
func (m *Manager) Track(ctx context.Context, driver string) (context.Context, func()) {
	m.mu.Lock()
	t := m.held[driver]
	if t != nil {
		t.inflight++
		m.mu.Unlock()
		ctx, cancel := context.WithCancel(ctx)
		stop := context.AfterFunc(t.ctx, cancel)
		return ctx, func() {
			stop()
			cancel()
			m.mu.Lock()
			t.inflight--
			if t.inflight == 0 && t.releasing && t.idle != nil {
				close(t.idle)
				t.idle = nil
			}
			m.mu.Unlock()
		}
	}
	m.mu.Unlock()
	if m.Foreign(driver) {
		ctx, cancel := context.WithCancelCause(ctx)
		cancel(fmt.Errorf("driver %s is led by another replica", driver))
		return ctx, func() {}
	}
	return ctx, func() {}
}

// Led is the drivers this replica leads, sorted.
func (m *Manager) Led() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	if !m.memberValidLocked(time.Now()) {
		return nil
	}
	for d, t := range m.held {
		if !t.releasing {
			out = append(out, d)
		}
	}
	slices.Sort(out)
	return out
}

// Leaders maps each driver whose Lease a live member holds to that member,
// as this replica sees the Leases (status).
func (m *Manager) Leaders() map[string]string {
	out := map[string]string{}
	leases, err := m.leases.List(labels.SelectorFromSet(labels.Set{LabelKind: "driver"}))
	if err != nil {
		return out
	}
	now := time.Now()
	for _, l := range leases {
		d := l.Annotations[LabelDriver]
		if h, _ := m.holder(d, now); h != "" {
			out[d] = h
		}
	}
	return out
}

// holder is the live member holding driver's Lease ("" for none), and
// the Lease (nil if there is none).
func (m *Manager) holder(driver string, now time.Time) (string, *coordinationv1.Lease) {
	l, err := m.leases.Get(DriverLease(m.cfg.Name, driver))
	if err != nil {
		return "", nil
	}
	rec := resourcelock.LeaseSpecToLeaderElectionRecord(&l.Spec)
	if rec.HolderIdentity == "" || !m.live(rec.HolderIdentity, now) {
		return "", l
	}
	return rec.HolderIdentity, l
}

// live reports whether identity's member Lease is held and was seen to
// change within its duration.
func (m *Manager) live(identity string, now time.Time) bool {
	if identity == m.cfg.Identity {
		m.mu.Lock()
		defer m.mu.Unlock()
		return m.memberValidLocked(now)
	}
	name := MemberLease(m.cfg.Name, identity)
	m.mu.Lock()
	o, ok := m.seen[name]
	m.mu.Unlock()
	return ok && o.rec.HolderIdentity == identity && now.Sub(o.at) < time.Duration(o.rec.LeaseDurationSeconds)*time.Second
}

// note records when a member Lease was seen to change.
func (m *Manager) note(obj any, now time.Time) {
	l, ok := obj.(*coordinationv1.Lease)
	if !ok || l.Labels[LabelKind] != "member" {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if o, ok := m.seen[l.Name]; !ok || o.rv != l.ResourceVersion {
		m.seen[l.Name] = observed{rv: l.ResourceVersion, at: now, rec: *resourcelock.LeaseSpecToLeaderElectionRecord(&l.Spec)}
	}
}

// observe notes when each member Lease's record last changed (note has
// seen most of it already) and lists the live members.
func (m *Manager) observe(now time.Time) []string {
	leases, err := m.leases.List(labels.SelectorFromSet(labels.Set{LabelKind: "member"}))
	if err != nil {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	present := map[string]bool{}
	for _, l := range leases {
		present[l.Name] = true
		if o, ok := m.seen[l.Name]; !ok || o.rv != l.ResourceVersion {
			m.seen[l.Name] = observed{rv: l.ResourceVersion, at: now, rec: *resourcelock.LeaseSpecToLeaderElectionRecord(&l.Spec)}
		}
	}
	for name := range m.seen {
		if !present[name] {
			delete(m.seen, name)
		}
	}
	var members []string
	for _, o := range m.seen {
		id := o.rec.HolderIdentity
		if id != "" && id != m.cfg.Identity && now.Sub(o.at) < time.Duration(o.rec.LeaseDurationSeconds)*time.Second {
			members = append(members, id)
		}
	}
	if m.memberValidLocked(now) {
		members = append(members, m.cfg.Identity)
	}
	return members
}
