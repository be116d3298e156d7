package kube

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	snapshotclient "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/clock"

	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
	"github.com/csibroker/csibroker/policy"
)

import ()

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
	// is the intent records' rate limiter (the broker's own, or Client's).
	// The record then takes each request's token before it cuts its
	// batch, so a write that waited for its token carries every claim
	// that arrived meanwhile (intent.Store.UseBudget). Unset: the record
	// writes through Client.
	IntentClient kubernetes.Interface
	IntentBudget interface{ Wait(context.Context) error }
	// SnapshotClient reads VolumeSnapshots and their contents for claims
	// restored from one (and marks a snapshot in use); nil refuses such
	// claims with an Event.
	SnapshotClient snapshotclient.Interface
	// SnapshotInformerClient lists and watches VolumeSnapshotContents and
	// VolumeSnapshotClasses for the snapshot controller, on the informers'
	// budget (InformerClient's). Defaults to SnapshotClient.
	SnapshotInformerClient snapshotclient.Interface

	Drivers drivers.Drivers
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
	// LeaderElectionMode is "" (or "single"): one Lease, the leader runs
	// every controller; or LeaderElectionPerDriver: the drivers are shared
	// out among the replicas, a Lease per driver (k8sbridge/shard).
	LeaderElectionMode string
	// LeaderElectionNamespace holds the Lease (default Namespace).
	LeaderElectionNamespace string

	VolumeNamePrefix     string
	VolumeNameUUIDLength int
	// ExtraCreateMetadata also adds csi.storage.k8s.io/volumesnapshot/name,
	// /volumesnapshot/namespace and /volumesnapshotcontent/name to
	// CreateSnapshot's parameters (csi-snapshotter's flag of that name).
	ExtraCreateMetadata bool
	// SnapshotNamePrefix and SnapshotNameUUIDLength name snapshots
	// <prefix>-<VolumeSnapshot UID> (csi-snapshotter's
	// --snapshot-name-prefix, default "snapshot", and
	// --snapshot-name-uuid-length, default -1: the whole UID; 0 counts as
	// -1 here).
	SnapshotNamePrefix     string
	SnapshotNameUUIDLength int
	// GroupSnapshotNamePrefix and GroupSnapshotNameUUIDLength name group
	// snapshots <prefix>-<VolumeGroupSnapshot UID> (csi-snapshotter's
	// --groupsnapshot-name-prefix, default "groupsnapshot", and
	// --groupsnapshot-name-uuid-length, default -1; 0 counts as -1 here).
	GroupSnapshotNamePrefix     string
	GroupSnapshotNameUUIDLength int
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
	// Clock times the work queues' retries and delays (nil: the real
	// clock; a test steps a fake one).
	Clock clock.WithTicker
	// Timeout bounds one CreateVolume/DeleteVolume call (the broker's client
	// chain retries inside it).
	Timeout time.Duration
	// RecoveryInterval is how often leaked-volume recovery runs (it also
	// runs when a claim being provisioned is deleted).
	RecoveryInterval time.Duration
	ResyncPeriod     time.Duration
	// MonitorInterval is how often volume health is swept (the health
	// monitor's --monitor-interval); 0: a minute; negative: not at all.
	MonitorInterval time.Duration

	Logger         *slog.Logger
	TracerProvider trace.TracerProvider
	Registerer     prometheus.Registerer

	// PanicHook is for tests only: cmd/ never sets it, and outside a test
	// binary it is never called (Env.TestHook). The provision, delete,
	// attach and capacity controllers call it with their name, the driver
	// and the key (capacity: the class) while the key holds its driver's
	// slot, just before the work; a
	// hook that panics there stands for a bug one driver's handling hits.
	PanicHook func(controller, driver, key string)
}

// Leader election modes (Config.LeaderElectionMode).
const (
	LeaderElectionSingle    = "single"
	LeaderElectionPerDriver = "per-driver"
)

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
	if c.SnapshotNamePrefix == "" {
		c.SnapshotNamePrefix = "snapshot"
	}
	if c.GroupSnapshotNamePrefix == "" {
		c.GroupSnapshotNamePrefix = "groupsnapshot"
	}
	if c.SnapshotInformerClient == nil {
		c.SnapshotInformerClient = c.SnapshotClient
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
	switch c.LeaderElectionMode {
	case "", LeaderElectionSingle:
	case LeaderElectionPerDriver:
		if !c.LeaderElection {
			errs = append(errs, errors.New("per-driver leader election needs leader election on"))
		}
	default:
		errs = append(errs, fmt.Errorf("leader election mode %q: want %s or %s", c.LeaderElectionMode, LeaderElectionSingle, LeaderElectionPerDriver))
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
	if c.MonitorInterval == 0 {
		c.MonitorInterval = time.Minute
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.TracerProvider == nil {
		c.TracerProvider = noop.NewTracerProvider()
	}
	return errors.Join(errs...)
}
