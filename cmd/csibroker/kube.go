package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strings"
	"time"

	snapshotclient "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/transport"
	"k8s.io/client-go/util/flowcontrol"
	"k8s.io/klog/v2"

	"github.com/csibroker/csibroker/internal/budget"
	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/telemetry"
	"github.com/csibroker/csibroker/k8sbridge"
	"github.com/csibroker/csibroker/policy"
)

// kubeFlags are the broker's Kubernetes flags, named as in the CSI sidecars
// where the meaning is the same.
type kubeFlags struct {
	Mode                 string
	Kubeconfig           string
	QPS                  float64
	Burst                int
	Budget               string // per-driver or fixed
	budget               *budget.Limiter
	EventsQPS            float64
	EventsBurst          int
	ContentType          string
	Namespace            string
	Identity             string
	LeaderElection       bool
	LeaderElectionMode   string
	LeaderNamespace      string
	LeaseDuration        time.Duration
	RenewDeadline        time.Duration
	RetryPeriod          time.Duration
	VolumeNamePrefix     string
	VolumeNameUUIDLength int
	SnapshotNamePrefix   string
	SnapshotUUIDLength   int
	GroupSnapshotPrefix  string
	GroupSnapshotUUIDLen int
	ExtraCreateMetadata  bool
	ExtraModifyMetadata  bool
	DefaultFSType        string
	PublishReadOnly      bool
	CapacityImmediate    bool
	StrictTopology       bool
	ImmediateTopology    bool
	WorkerThreads        int
	PerDriverWorkers     int
	RetryIntervalStart   time.Duration
	RetryIntervalMax     time.Duration
	MonitorInterval      time.Duration

	DiscoverProxies   string
	DiscoverNamespace string

	PolicyMode     string
	PolicyFile     string
	PolicyCRDs     bool
	PolicyURL      string
	PolicyPath     string
	PolicyCAFile   string
	PolicyToken    string
	PolicyInterval time.Duration
	// policyCA is the --policy-opa-ca-file bundle, re-read while the broker
	// runs (authorizer sets it).
	policyCA *mtls.CAFile
	// policyFile loads and re-reads --policy-file (authorizer sets it).
	policyFile *policy.FileWatcher

	// names are the flags register added; given those of them set on the
	// command line (noteGiven), which validate refuses with Kubernetes off.
	names map[string]bool
	given []string
}

func (f *kubeFlags) register(fs *flag.FlagSet) {
	before := map[string]bool{}
	fs.VisitAll(func(fl *flag.Flag) { before[fl.Name] = true })
	defer func() {
		f.names = map[string]bool{}
		fs.VisitAll(func(fl *flag.Flag) {
			if !before[fl.Name] {
				f.names[fl.Name] = true
			}
		})
	}()
	fs.StringVar(&f.Mode, "kubernetes", "auto", "run the Kubernetes controllers: on, off, or auto (on when --kubeconfig is set or running in a pod)")
	fs.StringVar(&f.Kubeconfig, "kubeconfig", "", "kubeconfig file (empty: in-cluster configuration)")
	fs.Float64Var(&f.QPS, "kube-api-qps", 5, "QPS of the client for Kubernetes objects, per registered driver (see --kube-api-budget)")
	fs.IntVar(&f.Burst, "kube-api-burst", 10, "burst of the client for Kubernetes objects, per registered driver (see --kube-api-budget)")
	fs.StringVar(&f.Budget, "kube-api-budget", budgetPerDriver, "the objects' client budget: per-driver (--kube-api-qps/-burst times the registered drivers, as many sidecars as drivers would have) or fixed (--kube-api-qps/-burst in all); either way each driver has an equal share and borrows what the others leave")
	fs.Float64Var(&f.EventsQPS, "events-qps", 20, "QPS of the separate client for Events, so they are never starved by object writes")
	fs.IntVar(&f.EventsBurst, "events-burst", 50, "burst of the Events client")
	fs.StringVar(&f.ContentType, "kube-api-content-type", runtime.ContentTypeProtobuf, "encoding of built-in objects on the wire: "+runtime.ContentTypeProtobuf+" (cheaper to decode, as kube-controller-manager and the CSI sidecars use) or "+runtime.ContentTypeJSON+"; custom resources are always JSON")
	fs.StringVar(&f.Namespace, "namespace", envOr("POD_NAMESPACE", "csibroker"), "namespace of the broker's intent record (and default for leader election)")
	fs.StringVar(&f.Identity, "identity", envOr("POD_NAME", hostname()), "identity of this replica for leader election and Events")
	fs.BoolVar(&f.LeaderElection, "leader-election", false, "elect one leader among replicas (one Lease for all drivers and controllers)")
	fs.StringVar(&f.LeaderElectionMode, "leader-election-mode", k8sbridge.LeaderElectionSingle, "with --leader-election: single (one Lease; the leader runs every controller for every driver) or per-driver (the drivers are shared out among the replicas, a Lease per driver, each driver led by one replica; see docs/operations.md)")
	fs.StringVar(&f.LeaderNamespace, "leader-election-namespace", "", "namespace of the leader Lease (default --namespace)")
	fs.DurationVar(&f.LeaseDuration, "leader-election-lease-duration", 3*time.Second, "how long a standby waits before taking over a leader that stopped renewing (the defaults, 3s/2.5s/0.5s, fail over within about 5 s for two Lease requests a second; the sidecars use 15s/10s/5s, deploy/ 8s/6s/1s)")
	fs.DurationVar(&f.RenewDeadline, "leader-election-renew-deadline", 2500*time.Millisecond, "how long the leader tries to renew before it gives up leading")
	fs.DurationVar(&f.RetryPeriod, "leader-election-retry-period", 500*time.Millisecond, "how often to try to acquire or renew the Lease")
	fs.StringVar(&f.VolumeNamePrefix, "volume-name-prefix", "pvc", "prefix of volume (and PV) names: <prefix>-<claim UID>")
	fs.IntVar(&f.VolumeNameUUIDLength, "volume-name-uuid-length", -1, "truncate the claim UID in volume names to this many characters (-1: whole)")
	fs.StringVar(&f.SnapshotNamePrefix, "snapshot-name-prefix", "snapshot", "prefix of snapshot names: <prefix>-<VolumeSnapshot UID> (csi-snapshotter's flag)")
	fs.IntVar(&f.SnapshotUUIDLength, "snapshot-name-uuid-length", -1, "truncate the VolumeSnapshot UID in snapshot names to this many characters (-1: whole)")
	fs.StringVar(&f.GroupSnapshotPrefix, "groupsnapshot-name-prefix", "groupsnapshot", "prefix of group snapshot names: <prefix>-<VolumeGroupSnapshot UID> (csi-snapshotter's flag)")
	fs.IntVar(&f.GroupSnapshotUUIDLen, "groupsnapshot-name-uuid-length", -1, "truncate the VolumeGroupSnapshot UID in group snapshot names to this many characters (-1: whole)")
	fs.BoolVar(&f.ExtraCreateMetadata, "extra-create-metadata", false, "pass csi.storage.k8s.io/pvc/name, /pvc/namespace and /pv/name to CreateVolume, and csi.storage.k8s.io/volumesnapshot/name, /volumesnapshot/namespace and /volumesnapshotcontent/name to CreateSnapshot")
	fs.BoolVar(&f.ExtraModifyMetadata, "extra-modify-metadata", false, "pass csi.storage.k8s.io/pvc/name, /pvc/namespace and /pv/name in ControllerModifyVolume's mutable parameters")
	fs.BoolVar(&f.PublishReadOnly, "controller-publish-readonly", false, "mark the PVs of claims whose only access mode is ReadOnlyMany read-only, so their volumes are attached read-only (drivers with PUBLISH_READONLY)")
	fs.BoolVar(&f.CapacityImmediate, "capacity-for-immediate-binding", false, "publish CSIStorageCapacity objects for Immediate StorageClasses too (the scheduler reads them for WaitForFirstConsumer claims only)")
	fs.StringVar(&f.DefaultFSType, "default-fstype", "", "filesystem of mount volumes whose StorageClass sets no csi.storage.k8s.io/fstype (empty: none, the driver's choice)")
	fs.BoolVar(&f.StrictTopology, "strict-topology", false, "send only the selected node's topology (late binding)")
	fs.BoolVar(&f.ImmediateTopology, "immediate-topology", true, "send cluster topology for Immediate claims without allowedTopologies")
	fs.IntVar(&f.WorkerThreads, "worker-threads", 100, "concurrent operations per controller")
	fs.IntVar(&f.PerDriverWorkers, "per-driver-workers", 0, "concurrent operations per driver in each controller (0: --worker-threads), so one slow driver cannot take every worker; the others wait in line in arrival order")
	fs.DurationVar(&f.RetryIntervalStart, "retry-interval-start", time.Second, "first backoff of a failed claim or volume (doubles per failure)")
	fs.DurationVar(&f.RetryIntervalMax, "retry-interval-max", 5*time.Minute, "largest backoff of a failed claim or volume")
	fs.DurationVar(&f.MonitorInterval, "monitor-interval", time.Minute, "how often the volumes of drivers that report volume health are swept, as external-health-monitor-controller's flag (0 or less: volume health is not monitored)")
	fs.StringVar(&f.DiscoverProxies, "discover-proxies", "", "label selector of proxy pods to register as drivers' proxies (annotations csibroker.io/driver, csibroker.io/proxy-port, csibroker.io/node-proxy, csibroker.io/node-local); empty: off")
	fs.StringVar(&f.DiscoverNamespace, "discover-proxies-namespace", "", "comma-separated namespaces whose pods may be proxies (empty: every namespace, which lets anyone who can create a pod take a driver's route)")
	fs.StringVar(&f.PolicyMode, "policy-mode", "enforce", "secret policy mode: enforce (deny by default), audit (log and count would-be denials, allow), off")
	fs.StringVar(&f.PolicyFile, "policy-file", "", "YAML/JSON file of SecretGrant objects (re-read every --policy-reload-interval)")
	fs.BoolVar(&f.PolicyCRDs, "policy-crds", true, "read SecretGrant objects (policy.csibroker.io) from the cluster")
	fs.StringVar(&f.PolicyURL, "policy-opa-url", "", "external decision point with OPA's data API, asked after the local grants allow (e.g. http://127.0.0.1:8181)")
	fs.StringVar(&f.PolicyPath, "policy-opa-path", "csibroker/allow", "data document path of the external decision point")
	fs.StringVar(&f.PolicyCAFile, "policy-opa-ca-file", "", "PEM CA bundle the https --policy-opa-url's certificate must chain to, instead of the system's roots (re-read every --tls-reload-interval)")
	fs.StringVar(&f.PolicyToken, "policy-opa-token-file", "", "file holding a bearer token sent to --policy-opa-url as Authorization: Bearer (OPA's --authentication=token; re-read every minute, so a projected service account token may rotate)")
	fs.DurationVar(&f.PolicyInterval, "policy-reload-interval", 10*time.Second, "how often --policy-file is re-read")
}

// noteGiven records which of the Kubernetes flags fs's command line set.
func (f *kubeFlags) noteGiven(fs *flag.FlagSet) {
	f.given = nil
	fs.Visit(func(fl *flag.Flag) {
		if f.names[fl.Name] && fl.Name != "kubernetes" {
			f.given = append(f.given, "--"+fl.Name)
		}
	})
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func hostname() string {
	h, err := os.Hostname()
	if err != nil {
		return "csibroker"
	}
	return h
}

func (f *kubeFlags) enabled() (bool, error) {
	switch f.Mode {
	case "on":
		return true, nil
	case "off":
		return false, nil
	case "auto":
		return f.Kubeconfig != "" || os.Getenv("KUBERNETES_SERVICE_HOST") != "", nil
	}
	return false, fmt.Errorf("--kubernetes %q: want on, off or auto", f.Mode)
}

// minUUIDLength is the shortest --volume-name-uuid-length taken: 8 hex
// digits of a random UID keep a collision among thousands of claims
// unlikely; fewer make it likely.
const minUUIDLength = 8

func (f *kubeFlags) validate() error {
	var errs []error
	if on, err := f.enabled(); err != nil {
		errs = append(errs, err)
	} else if !on {
		why := "--kubernetes off"
		if f.Mode == "auto" {
			why = "--kubernetes auto, no --kubeconfig, not in a pod"
		}
		if f.DiscoverProxies != "" {
			errs = append(errs, fmt.Errorf("--discover-proxies finds proxies in Kubernetes, which is off here (%s)", why))
		}
		var ignored []string
		for _, g := range f.given {
			if g != "--discover-proxies" {
				ignored = append(ignored, g)
			}
		}
		if len(ignored) > 0 {
			errs = append(errs, fmt.Errorf("%s: Kubernetes flags, but Kubernetes is off here (%s); drop them or turn it on", strings.Join(ignored, ", "), why))
		}
	}
	if f.PolicyFile != "" && f.PolicyInterval <= 0 {
		errs = append(errs, errors.New("--policy-reload-interval must be positive"))
	}
	if f.PolicyURL == "" {
		for flag, v := range map[string]string{"--policy-opa-ca-file": f.PolicyCAFile, "--policy-opa-token-file": f.PolicyToken} {
			if v != "" {
				errs = append(errs, fmt.Errorf("%s is for the external decision point, but --policy-opa-url is not set", flag))
			}
		}
	} else if err := checkPolicyURL(f.PolicyURL, f.PolicyPath); err != nil {
		errs = append(errs, err)
	} else if u, _ := url.Parse(f.PolicyURL); f.PolicyCAFile != "" && u.Scheme != "https" {
		errs = append(errs, fmt.Errorf("--policy-opa-ca-file is for an https:// --policy-opa-url, not %s", redactURL(f.PolicyURL)))
	}
	if f.VolumeNameUUIDLength != -1 && f.VolumeNameUUIDLength < minUUIDLength {
		errs = append(errs, fmt.Errorf("--volume-name-uuid-length %d: -1 (the whole UID) or at least %d, else claims may share a volume name", f.VolumeNameUUIDLength, minUUIDLength))
	}
	if f.SnapshotUUIDLength != -1 && f.SnapshotUUIDLength < minUUIDLength {
		errs = append(errs, fmt.Errorf("--snapshot-name-uuid-length %d: -1 (the whole UID) or at least %d, else snapshots may share a name", f.SnapshotUUIDLength, minUUIDLength))
	}
	if f.SnapshotNamePrefix == "" {
		errs = append(errs, errors.New("--snapshot-name-prefix must not be empty"))
	}
	if f.GroupSnapshotUUIDLen != -1 && f.GroupSnapshotUUIDLen < minUUIDLength {
		errs = append(errs, fmt.Errorf("--groupsnapshot-name-uuid-length %d: -1 (the whole UID) or at least %d, else group snapshots may share a name", f.GroupSnapshotUUIDLen, minUUIDLength))
	}
	if f.GroupSnapshotPrefix == "" {
		errs = append(errs, errors.New("--groupsnapshot-name-prefix must not be empty"))
	}
	if _, err := policy.ParseMode(f.PolicyMode); err != nil {
		errs = append(errs, fmt.Errorf("--policy-mode: %w", err))
	}
	if f.QPS <= 0 || f.Burst <= 0 || f.EventsQPS <= 0 || f.EventsBurst <= 0 {
		errs = append(errs, errors.New("--kube-api-qps/-burst and --events-qps/-burst must be positive"))
	}
	if f.Budget != budgetPerDriver && f.Budget != budgetFixed {
		errs = append(errs, fmt.Errorf("--kube-api-budget %q: want %s or %s", f.Budget, budgetPerDriver, budgetFixed))
	}
	if f.ContentType != runtime.ContentTypeProtobuf && f.ContentType != runtime.ContentTypeJSON {
		errs = append(errs, fmt.Errorf("--kube-api-content-type %q: want %s or %s", f.ContentType, runtime.ContentTypeProtobuf, runtime.ContentTypeJSON))
	}
	if f.LeaseDuration < time.Second || f.LeaseDuration%time.Second != 0 {
		// client-go writes leaseDurationSeconds, truncated: a standby
		// would take over before the leader's own term ends.
		errs = append(errs, fmt.Errorf("--leader-election-lease-duration %v: must be whole seconds, at least 1s (the Lease records it in seconds)", f.LeaseDuration))
	}
	switch f.LeaderElectionMode {
	case "", k8sbridge.LeaderElectionSingle:
	case k8sbridge.LeaderElectionPerDriver:
		if !f.LeaderElection {
			errs = append(errs, errors.New("--leader-election-mode per-driver needs --leader-election"))
		}
	default:
		errs = append(errs, fmt.Errorf("--leader-election-mode %q: want %s or %s", f.LeaderElectionMode, k8sbridge.LeaderElectionSingle, k8sbridge.LeaderElectionPerDriver))
	}
	if f.RenewDeadline >= f.LeaseDuration {
		errs = append(errs, errors.New("--leader-election-renew-deadline must be shorter than --leader-election-lease-duration"))
	}
	if f.RetryPeriod <= 0 || float64(f.RenewDeadline) <= leaderelection.JitterFactor*float64(f.RetryPeriod) {
		// client-go's own rule, said here with the flags' names.
		errs = append(errs, fmt.Errorf("--leader-election-retry-period %v: must be positive, and --leader-election-renew-deadline (%v) more than %.1f times it",
			f.RetryPeriod, f.RenewDeadline, leaderelection.JitterFactor))
	}
	if f.WorkerThreads <= 0 {
		errs = append(errs, fmt.Errorf("--worker-threads %d: must be positive", f.WorkerThreads))
	}
	if f.PerDriverWorkers < 0 {
		errs = append(errs, fmt.Errorf("--per-driver-workers %d: 0 (as many as --worker-threads) or positive", f.PerDriverWorkers))
	}
	if f.RetryIntervalStart <= 0 || f.RetryIntervalMax < f.RetryIntervalStart {
		errs = append(errs, fmt.Errorf("--retry-interval-start %v and --retry-interval-max %v: the start must be positive and not above the max", f.RetryIntervalStart, f.RetryIntervalMax))
	}
	if f.DiscoverProxies != "" {
		if _, err := labels.Parse(f.DiscoverProxies); err != nil {
			errs = append(errs, fmt.Errorf("--discover-proxies %q: not a label selector: %w", f.DiscoverProxies, err))
		}
	}
	return errors.Join(errs...)
}

func (f *kubeFlags) restConfig(qps float64, burst int, agent string) (*rest.Config, error) {
	var cfg *rest.Config
	var err error
	if f.Kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", f.Kubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, fmt.Errorf("kubernetes client configuration: %w", err)
	}
	cfg.QPS, cfg.Burst = float32(qps), burst
	cfg.UserAgent = "csibroker/" + version + " (" + agent + ")"
	return cfg, nil
}

// builtinClient is a clientset of built-in kinds with the wire encoding of
// --kube-api-content-type. Only built-in kinds have a protobuf encoding,
// which is why the configuration the SecretGrant (custom resource) client
// is made from keeps JSON.
func (f *kubeFlags) builtinClient(cfg *rest.Config) (*kubernetes.Clientset, error) {
	cfg = rest.CopyConfig(cfg)
	cfg.ContentType = f.ContentType
	if f.ContentType == runtime.ContentTypeProtobuf {
		cfg.AcceptContentTypes = runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON
	}
	return kubernetes.NewForConfig(cfg)
}

// policyStore builds the secret policy from the flags (file and/or CRDs,
// optional external decision point).
func (f *kubeFlags) authorizer(log *slog.Logger) (*policy.Authorizer, *policy.Store, error) {
	mode, _ := policy.ParseMode(f.PolicyMode)
	store := policy.NewStore(nil)
	store.SetMode(mode)
	if f.PolicyFile != "" {
		f.policyFile = &policy.FileWatcher{Path: f.PolicyFile, Interval: f.PolicyInterval, Log: log}
		if err := f.policyFile.Load(store); err != nil {
			return nil, nil, err
		}
	}
	a := &policy.Authorizer{Rules: store}
	if f.PolicyURL != "" {
		hc, err := f.policyHTTPClient(log)
		if err != nil {
			return nil, nil, err
		}
		ext, err := policy.NewExternal(policy.ExternalConfig{URL: f.PolicyURL, Path: f.PolicyPath, HTTPClient: hc, Logger: log})
		if err != nil {
			return nil, nil, fmt.Errorf("--policy-opa-url: %w", err)
		}
		a.External = ext
	}
	log.Info("secret policy", "mode", string(mode), "file", f.PolicyFile, "crds", f.PolicyCRDs, "external", redactURL(f.PolicyURL))
	return a, store, nil
}

// policyHTTPClient is the external decision point's HTTP client: the
// --policy-opa-ca-file bundle as its roots and the --policy-opa-token-file
// token as its bearer credential, when given.
func (f *kubeFlags) policyHTTPClient(log *slog.Logger) (*http.Client, error) {
	var rt http.RoundTripper = http.DefaultTransport.(*http.Transport).Clone()
	if f.PolicyCAFile != "" {
		ca, err := mtls.NewCAFile(f.PolicyCAFile, log)
		if err != nil {
			return nil, fmt.Errorf("--policy-opa-ca-file: %w", err)
		}
		f.policyCA = ca
		rt = ca.Transport(nil)
	}
	if f.PolicyToken != "" {
		// client-go's refreshing bearer transport: the file is read now
		// (an empty or missing file is an error here) and again each
		// minute, keeping the last token read if a re-read fails.
		withToken, err := transport.NewBearerAuthWithRefreshRoundTripper("", f.PolicyToken, rt)
		if err != nil {
			return nil, fmt.Errorf("--policy-opa-token-file: %w", err)
		}
		rt = withToken
		if u, err := url.Parse(f.PolicyURL); err == nil && u.Scheme != "https" && !isLoopbackHost(u.Hostname()) {
			log.Warn("the external decision point's bearer token goes over plain http to a host that is not this machine's; use https", "url", redactURL(f.PolicyURL))
		}
	}
	return &http.Client{Transport: rt}, nil
}

// checkPolicyURL checks --policy-opa-url (and --policy-opa-path) without
// saying the URL: its user info may hold a password, its query a token.
// What is not said here is left to the policy package's own check, which
// never says either.
func checkPolicyURL(raw, dataPath string) error {
	if u, err := url.Parse(raw); err == nil {
		switch {
		case u.Scheme != "http" && u.Scheme != "https" || u.Host == "":
			// The policy package would quote the URL (all but a password)
			// here, and what is not a scheme and host may be a credential
			// read as a path ("http//user:password@host").
			return errors.New("--policy-opa-url: want http://host[:port][/path] or https://host[:port][/path]")
		case u.User != nil || u.RawQuery != "" || u.Fragment != "":
			return errors.New("--policy-opa-url: must carry no user info, query or fragment (give a bearer token with --policy-opa-token-file)")
		}
	}
	if err := (policy.ExternalConfig{URL: raw, Path: dataPath}).Validate(); err != nil {
		return fmt.Errorf("--policy-opa-url, --policy-opa-path: %w", err)
	}
	return nil
}

// redactURL is a URL as logs and messages may say it: scheme, host and
// path, without the user info (a password) and query (a token) it may
// carry. Empty stays empty.
func redactURL(raw string) string {
	if raw == "" {
		return ""
	}
	u, err := url.Parse(raw)
	switch {
	case err != nil:
		return "(a URL that does not parse)"
	case u.Host == "":
		return "(a URL without a host)"
	}
	return (&url.URL{Scheme: u.Scheme, Host: u.Host, Path: u.Path, RawPath: u.RawPath}).String()
}

// isLoopbackHost says whether host (a name or an address) is this machine.
func isLoopbackHost(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// clientGoMaxVerbosity caps client-go's logging: from V(8) it logs the
// bodies of API responses, Secrets included (V(7) logs request headers,
// with credentials masked by client-go).
const clientGoMaxVerbosity = 7

// clientGoLogger is the logger client-go writes to: the broker's, capped
// at clientGoMaxVerbosity whatever --v says.
func clientGoLogger(log *slog.Logger) *slog.Logger {
	return telemetry.CapVerbosity(log, clientGoMaxVerbosity).With("component", "client-go")
}

// bridge builds the Kubernetes side.
func (f *kubeFlags) bridge(drivers k8sbridge.Drivers, authz *policy.Authorizer, timeout time.Duration, log *slog.Logger, tp trace.TracerProvider, reg prometheus.Registerer) (*k8sbridge.Bridge, *rest.Config, error) {
	klog.SetSlogLogger(clientGoLogger(log))
	objCfg, err := f.restConfig(f.QPS, f.Burst, "objects")
	if err != nil {
		return nil, nil, err
	}
	evCfg, _ := f.restConfig(f.EventsQPS, f.EventsBurst, "events")
	leaseQPS, leaseBurst := 5.0, 10
	if f.LeaderElectionMode == k8sbridge.LeaderElectionPerDriver {
		// Per driver, each replica renews its member Lease besides the
		// leader Lease's election, and takes a share of the driver
		// Leases at once when a replica dies.
		leaseQPS, leaseBurst = 10, 30
	}
	leaseCfg, _ := f.restConfig(leaseQPS, leaseBurst, "leader-election")
	// The informers' LISTs have a budget of their own, as leader election
	// has: at --kube-api-qps 5 the nine LISTs of a start would otherwise
	// take the burst that the first PV writes need. (WATCH requests are
	// not rate limited by client-go.)
	informerCfg, _ := f.restConfig(20, 50, "informers")
	// The objects' budget is one limiter of per-driver shares that lend
	// to each other; it follows the drivers this replica leads
	// (followDrivers). The intent records (the broker's own bookkeeping,
	// which no sidecar writes) have a budget of their own, as the Events
	// and leader election have: sharing the objects' took tokens from
	// the PV writes and put a quiet driver's record write behind a busy
	// driver's tokens (BENCHMARKS.md). Their client takes its tokens
	// before it cuts a batch (k8sbridge.Config.IntentBudget), so a short
	// budget makes larger batches, not more writes.
	names := drivers.DriverNames()
	f.budget = budget.New(f.budgetSize(len(names)), names)
	intentBudget := flowcontrol.NewTokenBucketRateLimiter(intentQPS, intentBurst)
	clientCfg := rest.CopyConfig(objCfg)
	clientCfg.RateLimiter = f.budget
	intentCfg := rest.CopyConfig(objCfg)
	intentCfg.RateLimiter = flowcontrol.NewFakeAlwaysRateLimiter()
	client, err := f.builtinClient(clientCfg)
	if err != nil {
		return nil, nil, err
	}
	intentClient, err := f.builtinClient(intentCfg)
	if err != nil {
		return nil, nil, err
	}
	evClient, err := f.builtinClient(evCfg)
	if err != nil {
		return nil, nil, err
	}
	leaseClient, err := f.builtinClient(leaseCfg)
	if err != nil {
		return nil, nil, err
	}
	informerClient, err := f.builtinClient(informerCfg)
	if err != nil {
		return nil, nil, err
	}
	// VolumeSnapshots (a CRD: JSON) on the objects' budget; the snapshot
	// controller's informers on the informers'.
	snapClient, err := snapshotclient.NewForConfig(clientCfg)
	if err != nil {
		return nil, nil, err
	}
	snapInformerClient, err := snapshotclient.NewForConfig(informerCfg)
	if err != nil {
		return nil, nil, err
	}
	ns := f.Namespace
	b, err := k8sbridge.New(k8sbridge.Config{
		Client: client, EventClient: evClient, LeaseClient: leaseClient, InformerClient: informerClient,
		IntentClient: intentClient, IntentBudget: intentBudget, SnapshotClient: snapClient, SnapshotInformerClient: snapInformerClient,
		Drivers: drivers, Policy: authz, Namespace: ns, Identity: f.Identity,
		LeaderElection: f.LeaderElection, LeaderElectionLease: f.LeaseDuration, LeaderElectionRenew: f.RenewDeadline, LeaderElectionRetry: f.RetryPeriod,
		LeaderElectionNamespace: f.LeaderNamespace, LeaderElectionMode: f.LeaderElectionMode,
		VolumeNamePrefix: f.VolumeNamePrefix, VolumeNameUUIDLength: f.VolumeNameUUIDLength, SnapshotNamePrefix: f.SnapshotNamePrefix, SnapshotNameUUIDLength: f.SnapshotUUIDLength, GroupSnapshotNamePrefix: f.GroupSnapshotPrefix, GroupSnapshotNameUUIDLength: f.GroupSnapshotUUIDLen, ExtraCreateMetadata: f.ExtraCreateMetadata, ExtraModifyMetadata: f.ExtraModifyMetadata, DefaultFSType: f.DefaultFSType, ControllerPublishReadOnly: f.PublishReadOnly, CapacityForImmediateBinding: f.CapacityImmediate,
		StrictTopology: f.StrictTopology, ImmediateTopology: f.ImmediateTopology,
		Timeout: timeout, MonitorInterval: monitorInterval(f.MonitorInterval),
		WorkerThreads: f.WorkerThreads, PerDriverWorkers: f.PerDriverWorkers, RetryIntervalStart: f.RetryIntervalStart, RetryIntervalMax: f.RetryIntervalMax,
		Logger: log, TracerProvider: tp, Registerer: reg,
	})
	if err != nil {
		return nil, nil, err
	}
	return b, objCfg, nil
}

// monitorInterval is --monitor-interval as k8sbridge.Config has it: 0 or
// less turns monitoring off (negative there; 0 means the default).
func monitorInterval(d time.Duration) time.Duration {
	if d <= 0 {
		return -1
	}
	return d
}

// The intent records' budget: their writes are batched (a write per
// 20 claims under load, at most five a second per record from claims
// arriving together), so this leaves room; short of it, batches grow.
const (
	intentQPS   = 10
	intentBurst = 20
)

// The objects' client budget (--kube-api-budget).
const (
	budgetPerDriver = "per-driver"
	budgetFixed     = "fixed"
)

// budgetSize is the objects' budget for n registered drivers.
func (f *kubeFlags) budgetSize(n int) budget.Size {
	s := budget.Size{QPS: f.QPS, Burst: f.Burst}
	if f.Budget == budgetFixed {
		return s
	}
	return s.Times(n)
}

// followDrivers resizes the budget (per-driver: its total; either way its
// shares) as the drivers this replica leads change: registered or removed
// (discovery), or, with per-driver leader election, taken over or handed
// on. It checks every second, until ctx is done.
func (f *kubeFlags) followDrivers(ctx context.Context, led func() []string, log *slog.Logger) {
	if f.budget == nil {
		return
	}
	defer f.budget.Stop()
	var names []string
	first := true // the budget was made for every registered driver
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if now := led(); first || !slices.Equal(now, names) {
			names, first = now, false
			s := f.budgetSize(len(names))
			f.budget.Resize(s, names)
			log.Info("object writes budget resized", "drivers", len(names), "qps", s.QPS, "burst", s.Burst)
		}
	}
}

// discoverNamespaces is --discover-proxies-namespace as a list.
func (f *kubeFlags) discoverNamespaces() []string {
	var out []string
	for _, n := range strings.Split(f.DiscoverNamespace, ",") {
		if n = strings.TrimSpace(n); n != "" {
			out = append(out, n)
		}
	}
	return out
}
