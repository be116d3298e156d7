package k8sbridge

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	snapshotclient "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	"github.com/prometheus/client_golang/prometheus"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"google.golang.org/grpc"

	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/policy"
)

// testDrivers reaches each sample driver through its own real chain (broker
// client chain → proxy over mTLS → driver socket).
type testDrivers struct {
	mu        sync.Mutex
	chains    map[string]*chaintest.Chain
	drivers   map[string]*sampledriver.Driver
	nodeLocal map[string]bool
	// nodeChains[driver][node] for node-local drivers.
	nodeChains map[string]map[string]*chaintest.Chain
	// down["driver/node"]: that node's proxy is unreachable (setNodeDown).
	down map[string]bool
}

// setNodeDown makes a node-local driver's proxy on node unreachable, or
// reachable again.
func (t *testDrivers) setNodeDown(d, node string, down bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.down == nil {
		t.down = map[string]bool{}
	}
	t.down[d+"/"+node] = down
}

func (t *testDrivers) ControllerConn(d string) (grpc.ClientConnInterface, error) {
	t.mu.Lock()
	c := t.chains[d]
	t.mu.Unlock()
	if c == nil {
		return nil, fmt.Errorf("unknown driver %q", d)
	}
	return c.Broker.ControllerConn(d)
}

func (t *testDrivers) NodeConn(d, node string) (grpc.ClientConnInterface, error) {
	t.mu.Lock()
	c := t.nodeChains[d][node]
	down := t.down[d+"/"+node]
	t.mu.Unlock()
	if down {
		return nil, fmt.Errorf("driver %s: node %s's proxy is unreachable (test)", d, node)
	}
	if c == nil {
		return t.ControllerConn(d)
	}
	return c.Broker.NodeConn(d, node)
}

// addNodeDriver starts one node-local driver instance on node behind a node
// proxy (whose identity names the node).
func (t *testDrivers) addNodeDriver(tb testing.TB, cfg sampledriver.Config, node string) *sampledriver.Driver {
	tb.Helper()
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	cfg.NodeID = node
	ep, d := sampledriver.StartTest(tb, cfg)
	c := chaintest.Start(tb, chaintest.Options{Driver: cfg.Name, DriverEndpoint: ep, LogLevel: slog.LevelWarn, Timeout: 30 * time.Second, Node: node})
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.chains == nil {
		t.chains, t.drivers, t.nodeLocal = map[string]*chaintest.Chain{}, map[string]*sampledriver.Driver{}, map[string]bool{}
	}
	if t.nodeChains == nil {
		t.nodeChains = map[string]map[string]*chaintest.Chain{}
	}
	if t.nodeChains[cfg.Name] == nil {
		t.nodeChains[cfg.Name] = map[string]*chaintest.Chain{}
	}
	t.nodeChains[cfg.Name][node] = c
	t.nodeLocal[cfg.Name] = true
	if _, ok := t.chains[cfg.Name]; !ok {
		t.chains[cfg.Name] = c // controller-level calls (capabilities) go to any node
	}
	return d
}

func (t *testDrivers) NodeLocal(d string) bool { return t.nodeLocal[d] }

func (t *testDrivers) DriverNodes(d string) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []string
	for k := range t.nodeChains[d] {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func (t *testDrivers) DriverNames() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []string
	for n := range t.chains {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// HasDriver says whether d was added (as the broker's registry does).
func (t *testDrivers) HasDriver(d string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	_, ok := t.chains[d]
	return ok
}

// CallTimeout is the driver's broker's (as the real broker gives it).
func (t *testDrivers) CallTimeout(d, method string) time.Duration {
	t.mu.Lock()
	c := t.chains[d]
	t.mu.Unlock()
	if c == nil {
		return 0
	}
	return c.Broker.CallTimeout(d, method)
}

// addDriver starts a sample driver behind a proxy and a broker; opts change
// the chain's options (timeouts, say).
func (t *testDrivers) addDriver(tb testing.TB, cfg sampledriver.Config, opts ...func(*chaintest.Options)) *sampledriver.Driver {
	tb.Helper()
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	ep, d := sampledriver.StartTest(tb, cfg)
	co := chaintest.Options{Driver: cfg.Name, DriverEndpoint: ep, LogLevel: slog.LevelWarn, Timeout: 30 * time.Second}
	for _, o := range opts {
		o(&co)
	}
	c := chaintest.Start(tb, co)
	t.mu.Lock()
	if t.chains == nil {
		t.chains, t.drivers, t.nodeLocal = map[string]*chaintest.Chain{}, map[string]*sampledriver.Driver{}, map[string]bool{}
	}
	t.chains[cfg.Name], t.drivers[cfg.Name] = c, d
	t.mu.Unlock()
	return d
}

// addDeadDriver registers a driver whose proxy fronts a socket nobody
// serves; opts change the chain's options.
func (t *testDrivers) addDeadDriver(tb testing.TB, name string, opts ...func(*chaintest.Options)) {
	tb.Helper()
	dir := chaintest.ShortTempDir(tb)
	co := chaintest.Options{Driver: name, DriverEndpoint: "unix://" + dir + "/gone.sock", LogLevel: slog.LevelWarn, Timeout: 5 * time.Second}
	for _, o := range opts {
		o(&co)
	}
	c := chaintest.Start(tb, co)
	t.mu.Lock()
	if t.chains == nil {
		t.chains, t.drivers, t.nodeLocal = map[string]*chaintest.Chain{}, map[string]*sampledriver.Driver{}, map[string]bool{}
	}
	t.chains[name] = c
	t.mu.Unlock()
}

// bridgeRun is a running Bridge for one test.
type bridgeRun struct {
	t        *testing.T
	identity string
	b        *Bridge
	spans    *tracetest.SpanRecorder
	reg      *prometheus.Registry
	logs     *chaintest.SyncBuffer
	cancel   context.CancelFunc
	// exited is closed once Run has returned; runErr is then what it
	// returned.
	exited chan struct{}
	runErr error
}

// exitedEarly reports whether Run has returned, and with what, although
// the test has not stopped the bridge.
func (r *bridgeRun) exitedEarly() (bool, error) {
	select {
	case <-r.exited:
		return true, r.runErr
	default:
		return false, nil
	}
}

type bridgeOpts struct {
	policy       SecretPolicy
	identity     string
	leader       bool
	timeout      time.Duration
	strict       bool
	configureCfg func(*Config)
	configure    func(*Bridge)
	// allLogs makes the bridge log at every level, below debug too
	// (tests that secrets appear at no verbosity).
	allLogs bool
}

func startBridge(t *testing.T, env *testenv.Env, ns string, drivers Drivers, o bridgeOpts) *bridgeRun {
	t.Helper()
	if o.policy == nil {
		st := policy.NewStore(nil)
		st.SetMode(policy.ModeOff)
		o.policy = &policy.Authorizer{Rules: st}
	}
	if o.identity == "" {
		o.identity = "broker-0"
	}
	logLevel := slog.LevelDebug
	if o.allLogs {
		logLevel = mostVerbose
	}
	r := &bridgeRun{t: t, identity: o.identity, spans: tracetest.NewSpanRecorder(), reg: prometheus.NewRegistry(), logs: &chaintest.SyncBuffer{}, exited: make(chan struct{})}
	cfg := Config{
		Client: env.Client(), SnapshotClient: snapshotclient.NewForConfigOrDie(env.RESTConfig()),
		Drivers: drivers, Policy: o.policy, Namespace: ns, Identity: o.identity,
		LeaderElection: o.leader, WorkerThreads: 8, RetryIntervalStart: 100 * time.Millisecond, RetryIntervalMax: 2 * time.Second,
		Timeout: o.timeout, StrictTopology: o.strict, ImmediateTopology: true, RecoveryInterval: 2 * time.Second,
		Logger:         slog.New(slog.NewTextHandler(r.logs, &slog.HandlerOptions{Level: logLevel})),
		TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(r.spans)),
		Registerer:     r.reg,
	}
	if o.configureCfg != nil {
		o.configureCfg(&cfg)
	}
	b, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	r.b = b
	if o.configure != nil {
		o.configure(b)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	go func() {
		defer close(r.exited)
		r.runErr = b.Run(ctx)
	}()
	t.Cleanup(func() {
		r.stop()
		if t.Failed() {
			t.Logf("bridge %s log:\n%s", o.identity, tail(r.logs.String(), 60))
		}
	})
	return r
}

// stop stops the bridge and waits for Run to return. The test fails if
// Run had returned before (the controllers stopped on their own), returned
// an error other than its context's end, or did not return within 20s.
func (r *bridgeRun) stop() {
	r.t.Helper()
	if r.cancel == nil {
		return
	}
	early, err := r.exitedEarly()
	r.cancel()
	r.cancel = nil
	if early {
		r.t.Errorf("bridge %s: Run returned before the test stopped it: %v", r.identity, err)
		return
	}
	select {
	case <-r.exited:
		// Stopped before its caches synced: Run says so with ctx's error.
		if r.runErr != nil && !errors.Is(r.runErr, context.Canceled) {
			r.t.Errorf("bridge %s: Run: %v", r.identity, r.runErr)
		}
	case <-time.After(20 * time.Second):
		r.t.Errorf("bridge %s: Run did not return within 20s of its context's end", r.identity)
	}
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// metricValue sums the samples of a counter or gauge whose labels include want.
func (r *bridgeRun) metricValue(t *testing.T, name string, want map[string]string) float64 {
	t.Helper()
	mfs, err := r.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for k, v := range want {
				found := false
				for _, lp := range m.GetLabel() {
					if lp.GetName() == k && lp.GetValue() == v {
						found = true
					}
				}
				if !found {
					continue next
				}
			}
			switch {
			case m.GetCounter() != nil:
				sum += m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				sum += m.GetGauge().GetValue()
			}
		}
	}
	return sum
}

// countingDrivers counts, per CSI method, the controller calls in flight
// and the most seen at once, keeps the names the calls that name something
// (CreateVolume) were made for, in the order they started, and can hold a
// method's calls or answer them by script.
type countingDrivers struct {
	*testDrivers
	mu       sync.Mutex
	counts   map[string]*inflightCount
	named    map[string][]string
	held     map[string]chan struct{}          // method → closed when its calls may go on
	scripts  map[string]*script                // method → how its calls are answered
	rewrite  map[string]func(n int, reply any) // method → changes the nth answer
	rewrites map[string]int                    // method → calls seen by its rewrite
}

// rewriteReply makes f change the answers of method's successful calls
// (the nth, counted from 1) before the caller sees them.
func (d *countingDrivers) rewriteReply(method string, f func(n int, reply any)) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.rewrite == nil {
		d.rewrite, d.rewrites = map[string]func(int, any){}, map[string]int{}
	}
	d.rewrite[method] = f
}

// script answers a method's calls: the nth (counted from 1) as answer says,
// call making the real one.
type script struct {
	calls  int
	answer func(n int, call func() error) error
}

type inflightCount struct{ now, most atomic.Int32 }

func newCountingDrivers() *countingDrivers {
	return &countingDrivers{testDrivers: &testDrivers{}, counts: map[string]*inflightCount{}, named: map[string][]string{}}
}

// hold keeps method's calls from reaching the driver until the returned
// function is called.
func (d *countingDrivers) hold(method string) (letGo func()) {
	ch := make(chan struct{})
	d.mu.Lock()
	if d.held == nil {
		d.held = map[string]chan struct{}{}
	}
	d.held[method] = ch
	d.mu.Unlock()
	return sync.OnceFunc(func() { close(ch) })
}

// script makes answer say how method's calls are answered.
func (d *countingDrivers) script(method string, answer func(n int, call func() error) error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.scripts == nil {
		d.scripts = map[string]*script{}
	}
	d.scripts[method] = &script{answer: answer}
}

// names is the names method's calls were made for, in the order they
// started.
func (d *countingDrivers) names(method string) []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.named[method])
}

func (d *countingDrivers) count(method string) *inflightCount {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := d.counts[method]
	if n == nil {
		n = &inflightCount{}
		d.counts[method] = n
	}
	return n
}

// most is the most calls of method seen in flight at once.
func (d *countingDrivers) most(method string) int32 { return d.count(method).most.Load() }

func (d *countingDrivers) ControllerConn(driver string) (grpc.ClientConnInterface, error) {
	c, err := d.testDrivers.ControllerConn(driver)
	if err != nil {
		return nil, err
	}
	return countingConn{ClientConnInterface: c, d: d}, nil
}

// NodeConn is ControllerConn for a node-local driver's node proxy.
func (d *countingDrivers) NodeConn(driver, node string) (grpc.ClientConnInterface, error) {
	c, err := d.testDrivers.NodeConn(driver, node)
	if err != nil {
		return nil, err
	}
	return countingConn{ClientConnInterface: c, d: d}, nil
}

type countingConn struct {
	grpc.ClientConnInterface
	d *countingDrivers
}

func (c countingConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	short := method[strings.LastIndex(method, "/")+1:]
	c.d.mu.Lock()
	if named, ok := args.(interface{ GetName() string }); ok {
		c.d.named[short] = append(c.d.named[short], named.GetName())
	}
	held := c.d.held[short]
	rewrite := c.d.rewrite[short]
	answer, nth := func(int, func() error) error { return nil }, 0
	if s := c.d.scripts[short]; s != nil {
		s.calls++
		answer, nth = s.answer, s.calls
	}
	c.d.mu.Unlock()
	if held != nil {
		select {
		case <-held:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	cnt := c.d.count(short)
	n := cnt.now.Add(1)
	defer cnt.now.Add(-1)
	for m := cnt.most.Load(); n > m && !cnt.most.CompareAndSwap(m, n); m = cnt.most.Load() {
	}
	call := func() error { return c.ClientConnInterface.Invoke(ctx, method, args, reply, opts...) }
	if rewrite != nil {
		c.d.mu.Lock()
		c.d.rewrites[short]++
		rn := c.d.rewrites[short]
		c.d.mu.Unlock()
		real := call
		call = func() error {
			err := real()
			if err == nil {
				rewrite(rn, reply)
			}
			return err
		}
	}
	if nth == 0 {
		return call()
	}
	return answer(nth, call)
}

// extraOf is the bridge's controller of type T (the resizer, the
// attacher...).
func extraOf[T any](t *testing.T, b *Bridge) T {
	t.Helper()
	for _, c := range b.extra {
		if x, ok := c.(T); ok {
			return x
		}
	}
	var zero T
	t.Fatalf("the bridge has no controller of type %T", zero)
	return zero
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
