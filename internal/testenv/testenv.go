package testenv

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// Versions of the control plane hack/control-plane.sh builds.
const (
	KubernetesVersion = "v1.36.3"
	EtcdVersion       = "v3.6.8"
)

// BinDirEnv names the environment variable that overrides where the
// control-plane binaries are found.
const BinDirEnv = "CSIBROKER_CONTROL_PLANE_BIN"

// KeepEnv, when set to a non-empty value, keeps each control plane's
// temporary directory (logs, data, kubeconfig) after Stop, for debugging.
const KeepEnv = "CSIBROKER_TESTENV_KEEP"

// Options says which components to run and how.
type Options struct {
	// ControllerManager runs kube-controller-manager with every controller
	// but the node lifecycle controller (there is no kubelet to keep nodes
	// alive): among others the PV binder, attach/detach, expansion, garbage
	// collector and namespace controllers.
	ControllerManager bool
	// Scheduler runs kube-scheduler.
	Scheduler bool

	// KubeAPIQPS and KubeAPIBurst are the controller-manager's and the
	// scheduler's client rate limits (default 500 and 1000, so they never
	// slow a test down).
	KubeAPIQPS   float32
	KubeAPIBurst int

	// Extra flags appended to each component's command line (a later flag
	// overrides an earlier one).
	EtcdFlags              []string
	APIServerFlags         []string
	ControllerManagerFlags []string
	SchedulerFlags         []string

	// BinDir holds etcd, kube-apiserver, kube-controller-manager and
	// kube-scheduler. Default: $CSIBROKER_CONTROL_PLANE_BIN, else DefaultBinDir().
	BinDir string
	// StartTimeout bounds the whole start (default 90s).
	StartTimeout time.Duration
	// Logf receives progress lines (default: standard error).
	Logf func(format string, args ...any)
}

func (o Options) withDefaults() Options {
	if o.KubeAPIQPS == 0 {
		o.KubeAPIQPS = 500
	}
	if o.KubeAPIBurst == 0 {
		o.KubeAPIBurst = 1000
	}
	if o.BinDir == "" {
		o.BinDir = os.Getenv(BinDirEnv)
	}
	if o.BinDir == "" {
		o.BinDir = DefaultBinDir()
	}
	if o.StartTimeout == 0 {
		o.StartTimeout = 90 * time.Second
	}
	if o.Logf == nil {
		o.Logf = func(format string, args ...any) { fmt.Fprintf(os.Stderr, format+"\n", args...) }
	}
	return o
}

// DefaultBinDir is where hack/control-plane.sh puts the binaries:
// ${CSIBROKER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/csibroker}/control-plane/k8s-<v>-etcd-<v>/bin.
func DefaultBinDir() string {
	return filepath.Join(cacheRoot(), "control-plane", "k8s-"+KubernetesVersion+"-etcd-"+EtcdVersion, "bin")
}

// cacheRoot is where the hack/ scripts cache what they build:
// ${CSIBROKER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/csibroker}.
func cacheRoot() string {
	root := os.Getenv("CSIBROKER_CACHE")
	if root == "" {
		cache := os.Getenv("XDG_CACHE_HOME")
		if cache == "" {
			home, _ := os.UserHomeDir()
			cache = filepath.Join(home, ".cache")
		}
		root = filepath.Join(cache, "csibroker")
	}
	if !filepath.IsAbs(root) {
		// As the script resolves it: from the repository's root, where make
		// runs it (a test runs in its package's directory).
		root = filepath.Join(moduleRoot(), root)
	}
	return root
}

// moduleRoot is the nearest directory up from the working directory that
// holds go.mod (the working directory if none does).
func moduleRoot() string {
	wd, err := os.Getwd()
	if err != nil {
		return "."
	}
	for d := wd; ; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
			return d
		}
		if filepath.Dir(d) == d {
			return wd
		}
	}
}

// Env is a running control plane. Its methods are safe for concurrent use.
type Env struct {
	// Kubeconfig is the path of a kubeconfig file for the cluster admin
	// (token authentication, the apiserver's self-signed CA).
	Kubeconfig string
	// Dir is the private temporary directory: data, keys, kubeconfig and one
	// <component>.log per component. Removed by Stop unless $CSIBROKER_TESTENV_KEEP is set.
	Dir string
	// Host is the apiserver URL, https://127.0.0.1:<port>.
	Host string

	opts       Options
	token      string
	caData     []byte
	components []*component // in start order

	extraMu    sync.Mutex
	extra      []*component // started later against the cluster (snapshot side), stopped first
	extraCount map[string]int

	clientOnce sync.Once
	client     kubernetes.Interface

	stopOnce sync.Once
}

// Start starts a control plane and returns when every component is ready.
// On failure nothing is left running and the error carries the tail of each
// component's log.
func Start(ctx context.Context, opts Options) (*Env, error) {
	opts = opts.withDefaults()
	if err := checkBinaries(opts); err != nil {
		return nil, err
	}
	sweepStaleDirs()
	ctx, cancel := context.WithTimeout(ctx, opts.StartTimeout)
	defer cancel()
	const attempts = 3
	for attempt := 1; ; attempt++ {
		env, err := start(ctx, opts)
		if err == nil {
			return env, nil
		}
		// A free port can be taken between choosing it and binding it.
		if attempt < attempts && errors.Is(err, errPortTaken) && ctx.Err() == nil {
			opts.Logf("testenv: %v; retrying with other ports", errPortTaken)
			continue
		}
		return nil, err
	}
}

var errPortTaken = errors.New("a chosen port was taken by another process")

func checkBinaries(opts Options) error {
	names := []string{"etcd", "kube-apiserver"}
	if opts.ControllerManager {
		names = append(names, "kube-controller-manager")
	}
	if opts.Scheduler {
		names = append(names, "kube-scheduler")
	}
	var missing []string
	for _, n := range names {
		st, err := os.Stat(filepath.Join(opts.BinDir, n))
		if err != nil || st.IsDir() || st.Mode()&0o111 == 0 {
			missing = append(missing, n)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("testenv: %s not found in %s: run hack/control-plane.sh to build the pinned control plane "+
			"(Kubernetes %s, etcd %s; about 15 minutes the first time on 2 cores, cached after), or set %s to a directory holding them",
			strings.Join(missing, ", "), opts.BinDir, KubernetesVersion, EtcdVersion, BinDirEnv)
	}
	return nil
}

func start(ctx context.Context, opts Options) (_ *Env, err error) {
	dir, err := os.MkdirTemp("", dirPrefix)
	if err != nil {
		return nil, fmt.Errorf("testenv: %w", err)
	}
	registerDir(dir)
	e := &Env{Dir: dir, opts: opts}
	defer func() {
		if err != nil {
			err = fmt.Errorf("testenv: %w%s", err, e.logTails(40))
			if e.stop() {
				err = fmt.Errorf("%w\n(logs kept in %s)", err, e.Dir)
			} else {
				err = fmt.Errorf("%w\n(%s removed; set %s=1 to keep it)", err, e.Dir, KeepEnv)
			}
		}
	}()
	if err := os.WriteFile(filepath.Join(dir, ownerPIDFile), []byte(strconv.Itoa(os.Getpid())), 0o600); err != nil {
		return nil, err
	}
	if err := e.writeCredentials(); err != nil {
		return nil, err
	}

	ports, err := freePorts(5)
	if err != nil {
		return nil, err
	}
	begin := time.Now()
	var timings []string
	t0 := time.Now()
	etcdURL, err := e.startEtcd(ctx, ports[0], ports[1])
	if err != nil {
		return nil, err
	}
	timings = append(timings, fmt.Sprintf("etcd %s", since(t0)))
	t0 = time.Now()
	if err := e.startAPIServer(ctx, etcdURL, ports[2]); err != nil {
		return nil, err
	}
	timings = append(timings, fmt.Sprintf("apiserver %s", since(t0)))
	// Controller-manager and scheduler start side by side.
	var more []*started
	if opts.ControllerManager {
		s, err := e.startControllerManager(ports[3])
		if err != nil {
			return nil, err
		}
		more = append(more, s)
	}
	if opts.Scheduler {
		s, err := e.startScheduler(ports[4])
		if err != nil {
			return nil, err
		}
		more = append(more, s)
	}
	for _, s := range more {
		if err := waitReady(ctx, s.c, s.url, nil); err != nil {
			return nil, err
		}
		timings = append(timings, fmt.Sprintf("%s %s", s.timing, since(s.t0)))
	}
	opts.Logf("testenv: control plane ready in %s (%s)", since(begin), strings.Join(timings, ", "))
	return e, nil
}

// started is a component started, not yet ready.
type started struct {
	c      *component
	url    string // its health endpoint
	t0     time.Time
	timing string
}

// startEtcd starts etcd on the given ports and returns its client URL
// once it is healthy.
func (e *Env) startEtcd(ctx context.Context, port, peerPort int) (string, error) {
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", port)
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", peerPort)
	etcd, err := e.run("etcd", append([]string{
		"--name=default",
		"--data-dir=" + filepath.Join(e.Dir, "etcd-data"),
		"--listen-client-urls=" + etcdURL,
		"--advertise-client-urls=" + etcdURL,
		"--listen-peer-urls=" + peerURL,
		"--initial-advertise-peer-urls=" + peerURL,
		"--initial-cluster=default=" + peerURL,
		"--unsafe-no-fsync", // a test cluster need not survive a power cut
		// One member on loopback: elect it at once instead of after ~0.6s.
		"--heartbeat-interval=10",
		"--election-timeout=100",
		"--log-level=warn",
	}, e.opts.EtcdFlags...))
	if err != nil {
		return "", err
	}
	if err := waitReady(ctx, etcd, etcdURL+"/health", nil); err != nil {
		return "", err
	}
	return etcdURL, nil
}

// startAPIServer starts kube-apiserver against etcdURL and waits until it
// is ready; the Env's kubeconfig then reaches it.
func (e *Env) startAPIServer(ctx context.Context, etcdURL string, port int) error {
	e.Host = fmt.Sprintf("https://127.0.0.1:%d", port)
	certDir := filepath.Join(e.Dir, "apiserver-certs")
	api, err := e.run("kube-apiserver", append([]string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(port),
		"--cert-dir=" + certDir,
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file=" + filepath.Join(e.Dir, "sa.pub"),
		"--service-account-signing-key-file=" + filepath.Join(e.Dir, "sa.key"),
		"--token-auth-file=" + filepath.Join(e.Dir, "tokens.csv"),
		"--authorization-mode=RBAC",
		"--service-cluster-ip-range=10.0.0.0/24",
		// The "kubernetes" Service cannot have a loopback endpoint.
		"--endpoint-reconciler-type=none",
		"--profiling=false",
	}, e.opts.APIServerFlags...))
	if err != nil {
		return err
	}
	if err := waitReady(ctx, api, e.Host+"/readyz", e.authorize); err != nil {
		return err
	}
	// The apiserver wrote its self-signed certificate and CA on start.
	caData, err := os.ReadFile(filepath.Join(certDir, "apiserver.crt"))
	if err != nil {
		return fmt.Errorf("read the apiserver's self-signed certificate: %w", err)
	}
	e.caData = caData
	if err := e.writeKubeconfig(); err != nil {
		return err
	}
	return e.checkTLS(ctx)
}

// startControllerManager starts kube-controller-manager (not waiting for it).
func (e *Env) startControllerManager(port int) (*started, error) {
	t0 := time.Now()
	c, err := e.run("kube-controller-manager", append([]string{
		"--kubeconfig=" + e.Kubeconfig,
		"--bind-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(port),
		"--cert-dir=" + filepath.Join(e.Dir, "controller-manager-certs"),
		"--leader-elect=false",
		// No kubelet renews Leases or heartbeats: without this the
		// controller would taint every node NotReady after 50s.
		"--controllers=*,-node-lifecycle-controller",
		"--kube-api-qps=" + strconv.FormatFloat(float64(e.opts.KubeAPIQPS), 'f', -1, 32),
		"--kube-api-burst=" + strconv.Itoa(e.opts.KubeAPIBurst),
		"--use-service-account-credentials=false",
		"--service-account-private-key-file=" + filepath.Join(e.Dir, "sa.key"),
		"--root-ca-file=" + filepath.Join(e.Dir, "apiserver-certs", "apiserver.crt"),
		"--cluster-name=csibroker-testenv",
		// Re-examine unbound claims often: a claim created before its
		// PV otherwise waits for the default 15s resync.
		"--pvclaimbinder-sync-period=2s",
		"--profiling=false",
		"--v=2",
	}, e.opts.ControllerManagerFlags...))
	if err != nil {
		return nil, err
	}
	return &started{c: c, url: fmt.Sprintf("https://127.0.0.1:%d/healthz", port), t0: t0, timing: "controller-manager"}, nil
}

// startScheduler starts kube-scheduler (not waiting for it).
func (e *Env) startScheduler(port int) (*started, error) {
	cfg := filepath.Join(e.Dir, "scheduler-config.yaml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf(`apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: %q
  qps: %v
  burst: %d
leaderElection:
  leaderElect: false
`, e.Kubeconfig, e.opts.KubeAPIQPS, e.opts.KubeAPIBurst)), 0o600); err != nil {
		return nil, err
	}
	t0 := time.Now()
	c, err := e.run("kube-scheduler", append([]string{
		"--config=" + cfg,
		"--bind-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(port),
		"--cert-dir=" + filepath.Join(e.Dir, "scheduler-certs"),
		"--v=2",
	}, e.opts.SchedulerFlags...))
	if err != nil {
		return nil, err
	}
	return &started{c: c, url: fmt.Sprintf("https://127.0.0.1:%d/readyz", port), t0: t0, timing: "scheduler"}, nil
}

func since(t time.Time) time.Duration { return time.Since(t).Round(10 * time.Millisecond) }

// run starts one component from the bin dir and records it for Stop.
func (e *Env) run(name string, args []string) (*component, error) {
	c, err := startComponent(e.Dir, name, filepath.Join(e.opts.BinDir, name), args)
	if err != nil {
		return nil, err
	}
	e.components = append(e.components, c)
	return c, nil
}

// insecureHTTP is for readiness probes only: it runs before the CA is known,
// and the controller-manager and scheduler serve certificates of their own.
var insecureHTTP = &http.Client{
	Timeout:   5 * time.Second,
	Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, DisableKeepAlives: true},
}

// waitReady polls url until it answers 200, failing early when the component
// exits.
func waitReady(ctx context.Context, c *component, url string, prepare func(*http.Request)) error {
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	var last error
	for {
		if done, werr := c.exited(); done {
			if portTaken(c) {
				return fmt.Errorf("%s: %w", c.name, errPortTaken)
			}
			return fmt.Errorf("%s exited before it was ready: %w", c.name, werr)
		}
		last = probe(ctx, url, prepare)
		if last == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			if portTaken(c) {
				return fmt.Errorf("%s: %w", c.name, errPortTaken)
			}
			return fmt.Errorf("%s not ready (%s): %w", c.name, url, last)
		case <-tick.C:
		}
	}
}

func portTaken(c *component) bool {
	return strings.Contains(c.tail(200), "address already in use")
}

func probe(ctx context.Context, url string, prepare func(*http.Request)) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	if prepare != nil {
		prepare(req)
	}
	resp, err := insecureHTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", resp.Status, strings.TrimSpace(string(body)))
	}
	return nil
}

func (e *Env) authorize(req *http.Request) { req.Header.Set("Authorization", "Bearer "+e.token) }

// checkTLS makes sure the kubeconfig's CA really verifies the apiserver, so a
// client error later is never a certificate problem.
func (e *Env) checkTLS(ctx context.Context) error {
	tr, err := rest.TransportFor(e.RESTConfig())
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.Host+"/readyz", nil)
	if err != nil {
		return err
	}
	resp, err := (&http.Client{Transport: tr, Timeout: 5 * time.Second}).Do(req)
	if err != nil {
		return fmt.Errorf("verify the apiserver with its self-signed CA: %w", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("apiserver /readyz with the kubeconfig's credentials: %s", resp.Status)
	}
	return nil
}

// writeCredentials writes the service-account signing key pair and the token
// file with one cluster-admin token.
func (e *Env) writeCredentials() error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(e.Dir, "sa.key"), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}), 0o600); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(e.Dir, "sa.pub"), pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}), 0o600); err != nil {
		return err
	}
	tok := make([]byte, 24)
	if _, err := rand.Read(tok); err != nil {
		return err
	}
	e.token = hex.EncodeToString(tok)
	return os.WriteFile(filepath.Join(e.Dir, "tokens.csv"), []byte(e.token+`,admin,admin,"system:masters"`+"\n"), 0o600)
}

func (e *Env) writeKubeconfig() error {
	e.Kubeconfig = filepath.Join(e.Dir, "kubeconfig")
	cfg := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: testenv
  cluster:
    server: %s
    certificate-authority-data: %s
users:
- name: admin
  user:
    token: %s
contexts:
- name: testenv
  context:
    cluster: testenv
    user: admin
    namespace: default
current-context: testenv
`, e.Host, base64.StdEncoding.EncodeToString(e.caData), e.token)
	return os.WriteFile(e.Kubeconfig, []byte(cfg), 0o600)
}

// RESTConfig returns a new client configuration for the cluster admin. Its
// rate limit is high (QPS 500, burst 1000) so tests are not throttled; set
// QPS and Burst on the copy to measure behaviour under a real budget.
func (e *Env) RESTConfig() *rest.Config {
	return &rest.Config{
		Host:            e.Host,
		BearerToken:     e.token,
		TLSClientConfig: rest.TLSClientConfig{CAData: append([]byte(nil), e.caData...)},
		QPS:             500,
		Burst:           1000,
		UserAgent:       "csibroker-testenv",
	}
}

// Client returns a clientset for the cluster admin (created once).
func (e *Env) Client() kubernetes.Interface {
	e.clientOnce.Do(func() {
		e.client = kubernetes.NewForConfigOrDie(e.RESTConfig())
	})
	return e.client
}

// Stop stops every component (SIGTERM to each process group, SIGKILL after
// a grace period) and removes the temporary directory. It is idempotent.
func (e *Env) Stop() {
	e.stopOnce.Do(func() {
		t0 := time.Now()
		kept := e.stop()
		e.opts.Logf("testenv: control plane stopped in %s", since(t0))
		if kept {
			e.opts.Logf("testenv: kept %s (%s is set)", e.Dir, KeepEnv)
		}
	})
}

// stop stops the components, clients before servers (the controller-manager
// and scheduler together, then the apiserver, then etcd: an apiserver that
// loses etcd first hangs in its graceful shutdown), and removes the directory
// unless KeepEnv is set; it reports whether the directory was kept.
func (e *Env) stop() (kept bool) {
	const grace = 5 * time.Second
	e.stopExtra(grace)
	if len(e.components) > 2 {
		var wg sync.WaitGroup
		for _, c := range e.components[2:] {
			wg.Go(func() { c.stop(grace) })
		}
		wg.Wait()
	}
	for i := min(len(e.components), 2) - 1; i >= 0; i-- {
		e.components[i].stop(grace)
	}
	defer unregisterDir(e.Dir)
	if os.Getenv(KeepEnv) != "" {
		return true
	}
	_ = os.RemoveAll(e.Dir)
	return false
}

// LogTails returns the last n lines of each component's log, for a failing
// test to print.
func (e *Env) LogTails(n int) string { return e.logTails(n) }

func (e *Env) logTails(n int) string {
	var b strings.Builder
	e.extraMu.Lock()
	all := append(slices.Clone(e.components), e.extra...)
	e.extraMu.Unlock()
	for _, c := range all {
		fmt.Fprintf(&b, "\n----- %s.log (last %d lines) -----\n%s", c.name, n, c.tail(n))
	}
	return b.String()
}
