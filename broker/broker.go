package broker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc"

	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/telemetry"
)

// Sentinel errors; callers test them with errors.Is.
var (
	ErrUnknownDriver = errors.New("unknown driver")
	ErrNoProxy       = errors.New("no proxy for this call")
)

// Options configure a Broker.
type Options struct {
	// TrustDomain of the SPIFFE IDs proxies must present.
	TrustDomain string
	// TLS is the broker's own certificate and CA pool.
	TLS mtls.Source
	// MaxMsgSize bounds a message in either direction.
	MaxMsgSize int

	Logger         *slog.Logger
	TracerProvider trace.TracerProvider
	Propagator     propagation.TextMapPropagator
	Registerer     prometheus.Registerer
}

// Broker holds the registered drivers and their proxy connections.
type Broker struct {
	opts    Options
	log     *slog.Logger
	tracer  trace.Tracer
	metrics *Metrics
	stats   brokerStats // every proxy connection's
	feSlots sync.Map    // driver → chan struct{}: front-end call slots (frontEndSlot)

	mu      sync.RWMutex
	drivers map[string]*Driver
	// draining are connections of earlier registrations whose calls are
	// finishing (proxyConn.drain); Close closes them too.
	draining map[*proxyConn]struct{}
	// closed is set by Close: later registrations are refused and a
	// connection retired after it is closed, not drained.
	closed bool
	// changed is closed (and replaced) when a driver is registered,
	// re-registered or removed: ServeSocketDir follows the registry.
	changed chan struct{}
	// sockets are the front-end sockets serving, by driver.
	sockets map[string]string
}

// New makes an empty broker; add drivers with SetDriver.
func New(opts Options) (*Broker, error) {
	if opts.TrustDomain == "" {
		return nil, errors.New("broker: trust domain is required")
	}
	if opts.TLS == nil {
		return nil, errors.New("broker: TLS source is required: proxies are reached over mTLS only")
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.TracerProvider == nil {
		opts.TracerProvider = noop.NewTracerProvider()
	}
	if opts.Propagator == nil {
		opts.Propagator = telemetry.Propagator()
	}
	if opts.MaxMsgSize <= 0 {
		opts.MaxMsgSize = 64 << 20
	}
	b := &Broker{
		opts:     opts,
		log:      opts.Logger.With("component", "broker"),
		tracer:   opts.TracerProvider.Tracer("github.com/csibroker/csibroker/broker"),
		drivers:  map[string]*Driver{},
		draining: map[*proxyConn]struct{}{},
		changed:  make(chan struct{}),
		sockets:  map[string]string{},
	}
	b.stats = brokerStats{telemetry.CodeOnly(otelgrpc.NewClientHandler(otelgrpc.WithTracerProvider(opts.TracerProvider), otelgrpc.WithPropagators(opts.Propagator)))}
	b.metrics = newMetrics()
	b.metrics.b = b
	if opts.Registerer != nil {
		if err := opts.Registerer.Register(b.metrics); err != nil {
			return nil, fmt.Errorf("broker: register metrics: %w", err)
		}
		if err := opts.Registerer.Register(mtls.NewCollector(opts.TLS)); err != nil {
			return nil, fmt.Errorf("broker: register certificate metrics: %w", err)
		}
	}
	return b, nil
}

// SetDriver adds a driver or replaces its configuration. Connections to
// proxies whose address and node did not change are kept.
func (b *Broker) SetDriver(cfg DriverConfig) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	cfg = cfg.withDefaults()
	var retired []*proxyConn
	// Drained once the registry lock is released (a drain may wait on a
	// connection's socket).
	defer func() {
		for _, pc := range retired {
			pc.drain()
		}
	}()
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return errBrokerClosed
	}
	old := b.drivers[cfg.Name]
	d := &Driver{name: cfg.Name, cfg: cfg, b: b, nodes: map[string]*proxyConn{}}
	if old != nil {
		d.stats = old.stats
	} else {
		d.stats = &driverStats{}
	}
	var made, dialed, reused []*proxyConn
	reuse := func(pc ProxyConfig) (*proxyConn, error) {
		if old != nil {
			var prev *proxyConn
			if pc.Node == "" {
				prev = old.controller
			} else {
				prev = old.nodes[pc.Node]
			}
			if prev != nil && prev.cfg == pc && prev.retry == cfg.Retry {
				// Given the new configuration (timeouts) only once the
				// whole registration succeeds.
				reused = append(reused, prev)
				return prev, nil
			}
		}
		c, err := b.dial(d, pc)
		if err == nil {
			dialed = append(dialed, c)
		}
		return c, err
	}
	// On failure only the connections dialled here are closed: reused ones
	// still serve the driver's current registration.
	fail := func(err error) error {
		for _, pc := range dialed {
			pc.close()
		}
		return err
	}
	if cfg.Controller != nil {
		pc, err := reuse(ProxyConfig{Address: cfg.Controller.Address})
		if err != nil {
			return fail(err)
		}
		d.controller = pc
		made = append(made, pc)
	}
	for _, n := range cfg.Nodes {
		pc, err := reuse(n)
		if err != nil {
			return fail(err)
		}
		d.nodes[n.Node] = pc
		made = append(made, pc)
	}
	d.nodesSet()
	for _, pc := range reused {
		pc.driverCfg.Store(&d.cfg)
	}
	if old != nil {
		keep := map[*proxyConn]bool{}
		for _, pc := range made {
			keep[pc] = true
		}
		for _, pc := range old.all() {
			if !keep[pc] {
				// Its calls in flight finish on the old proxy; new calls
				// and retries take the new registration's.
				retired = append(retired, pc)
			}
		}
	}
	b.drivers[cfg.Name] = d
	b.changedLocked()
	b.log.Info("driver registered", "driver", cfg.Name, "controller", cfg.Controller != nil, "node_proxies", len(cfg.Nodes), "node_local", cfg.NodeLocal)
	return nil
}

// RemoveDriver forgets a driver: new calls to it fail at once, and its
// connections close once the calls in flight have ended.
func (b *Broker) RemoveDriver(name string) {
	b.mu.Lock()
	d := b.drivers[name]
	delete(b.drivers, name)
	if d != nil {
		b.changedLocked()
	}
	b.mu.Unlock()
	if d != nil {
		for _, pc := range d.all() {
			pc.drain()
		}
		b.log.Info("driver removed", "driver", name)
	}
}

// changedLocked tells those following the registry that it changed.
func (b *Broker) changedLocked() {
	close(b.changed)
	b.changed = make(chan struct{})
}

// registryChanged is closed at the registry's next change.
func (b *Broker) registryChanged() <-chan struct{} {
	b.mu.RLock()
	defer b.mu.RUnlock()
	return b.changed
}

// current is the connection that now serves what p served (the same
// driver's controller proxy, or its proxy on p's node), or p itself when
// the driver has none now.
func (b *Broker) current(p *proxyConn) *proxyConn {
	b.mu.RLock()
	defer b.mu.RUnlock()
	d := b.drivers[p.driver]
	if d == nil {
		return p
	}
	n := d.controller
	if p.cfg.Node != "" {
		n = d.nodes[p.cfg.Node]
	}
	if n == nil {
		return p
	}
	return n
}

// Driver returns a registered driver.
func (b *Broker) Driver(name string) (*Driver, error) {
	b.mu.RLock()
	d := b.drivers[name]
	b.mu.RUnlock()
	if d == nil {
		return nil, fmt.Errorf("%w %q (registered: %v)", ErrUnknownDriver, name, b.DriverNames())
	}
	return d, nil
}

// HasDriver reports whether name is a registered driver (a map lookup, for
// callers asking on every event).
func (b *Broker) HasDriver(name string) bool {
	b.mu.RLock()
	defer b.mu.RUnlock()
	return b.drivers[name] != nil
}

// DriverNames lists the registered drivers, sorted.
func (b *Broker) DriverNames() []string {
	b.mu.RLock()
	defer b.mu.RUnlock()
	names := make([]string, 0, len(b.drivers))
	for n := range b.drivers {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// CallTimeout is how long the chain gives one call of method (short name,
// e.g. "CreateVolume") to driver: its per-method timeout, else its
// timeout; 0 for an unknown driver. A caller wrapping calls in a deadline
// of its own should not make it shorter.
func (b *Broker) CallTimeout(driver, method string) time.Duration {
	d, err := b.Driver(driver)
	if err != nil {
		return 0
	}
	if t, ok := d.cfg.MethodTimeouts[method]; ok {
		return t
	}
	return d.cfg.Timeout
}

// ControllerConn returns the connection to driver's controller proxy (for
// a node-local driver without one, a node proxy); k8sbridge uses the broker
// through this and NodeConn.
func (b *Broker) ControllerConn(driver string) (grpc.ClientConnInterface, error) {
	d, err := b.Driver(driver)
	if err != nil {
		return nil, err
	}
	pc, err := d.route("/csi.v1.Controller/ControllerGetCapabilities", "")
	if err != nil {
		return nil, err
	}
	return chainConn{pc}, nil
}

// NodeConn returns the connection to driver's proxy on node.
func (b *Broker) NodeConn(driver, node string) (grpc.ClientConnInterface, error) {
	d, err := b.Driver(driver)
	if err != nil {
		return nil, err
	}
	return d.Node(node)
}

// DriverNodes lists the nodes that have a proxy of driver.
func (b *Broker) DriverNodes(driver string) []string {
	d, err := b.Driver(driver)
	if err != nil {
		return nil
	}
	return d.Nodes()
}

// NodeLocal reports whether driver is registered as node-local.
func (b *Broker) NodeLocal(driver string) bool {
	d, err := b.Driver(driver)
	return err == nil && d.cfg.NodeLocal
}

// Close closes every connection, draining ones included; calls in flight
// fail.
func (b *Broker) Close() {
	b.mu.Lock()
	b.closed = true
	drivers := b.drivers
	b.drivers = map[string]*Driver{}
	b.changedLocked() // ServeSocketDir stops serving the drivers' sockets
	draining := b.draining
	b.draining = map[*proxyConn]struct{}{}
	b.mu.Unlock()
	for _, d := range drivers {
		for _, pc := range d.all() {
			pc.close()
		}
	}
	for pc := range draining {
		pc.close()
	}
}

// dial opens the connection to one proxy with the client chain.
func (b *Broker) dial(d *Driver, pc ProxyConfig) (*proxyConn, error) {
	want := mtls.DriverID(b.opts.TrustDomain, d.name)
	if pc.Node != "" {
		want = mtls.NodeDriverID(b.opts.TrustDomain, d.name, pc.Node)
	}
	p := &proxyConn{b: b, cfg: pc, driver: d.name, want: want, retry: d.cfg.Retry,
		tls: mtls.ClientConfig(b.opts.TLS, mtls.AuthorizeOneOf(want)), log: b.log.With("driver", d.name, "node", pc.Node, "proxy", pc.Address)}
	p.driverCfg.Store(&d.cfg)
	p.buildChain()
	g, err := p.dialGen()
	if err != nil {
		return nil, err
	}
	p.cur.Store(g)
	return p, nil
}

// Driver is one registered driver and its proxies.
type Driver struct {
	name       string
	cfg        DriverConfig
	b          *Broker
	controller *proxyConn
	nodes      map[string]*proxyConn
	// firstNode is the node proxy of the first node by name: a node-local
	// driver's controller calls go there when it has no controller proxy.
	firstNode *proxyConn
	stats     *driverStats
}

type driverStats struct {
	total, failed, inflight atomic.Int64
}

// Name is the driver's CSI name.
func (d *Driver) Name() string { return d.name }

// Config is the driver's effective configuration.
func (d *Driver) Config() DriverConfig { return d.cfg }

// Controller returns the connection to the driver's controller proxy.
func (d *Driver) Controller() (grpc.ClientConnInterface, error) {
	if d.controller == nil {
		return nil, fmt.Errorf("driver %q: %w: no controller proxy registered", d.name, ErrNoProxy)
	}
	return chainConn{d.controller}, nil
}

// Node returns the connection to the driver's proxy on node.
func (d *Driver) Node(node string) (grpc.ClientConnInterface, error) {
	pc := d.nodes[node]
	if pc == nil {
		return nil, fmt.Errorf("driver %q: %w: no node proxy registered for node %q", d.name, ErrNoProxy, node)
	}
	return chainConn{pc}, nil
}

// Nodes lists the nodes that have a proxy of this driver, sorted.
func (d *Driver) Nodes() []string {
	out := make([]string, 0, len(d.nodes))
	for n := range d.nodes {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// nodesSet is called once d.nodes is filled: it picks firstNode.
func (d *Driver) nodesSet() {
	if len(d.nodes) > 0 {
		d.firstNode = d.nodes[d.Nodes()[0]]
	}
}

func (d *Driver) all() []*proxyConn {
	var out []*proxyConn
	if d.controller != nil {
		out = append(out, d.controller)
	}
	for _, n := range d.Nodes() {
		out = append(out, d.nodes[n])
	}
	return out
}

type proxyState struct{ driver, node, address, state, want string }

// proxyStates flattens Status (which reads the states with the registry's
// lock released) for the connection-state metric.
func (b *Broker) proxyStates() []proxyState {
	var out []proxyState
	for _, d := range b.Status() {
		for _, p := range d.Proxies {
			out = append(out, proxyState{driver: d.Name, node: p.Node, address: p.Address, state: p.State, want: p.ExpectedIdentity})
		}
	}
	return out
}

// DriverStatus is a snapshot for the status API.
type DriverStatus struct {
	Name string
	// Socket is the driver's front-end socket ("" when none serves).
	Socket                  string
	Proxies                 []ProxyStatus
	Inflight, Total, Failed int64
}

// ProxyStatus is one proxy connection's state.
type ProxyStatus struct{ Address, Node, State, ExpectedIdentity string }

// Status snapshots every driver.
//
// A proxy connection's state is read with the registry's lock released,
// so that no snapshot (nor a Prometheus scrape, through proxyStates) waits
// on a proxy connection while holding a lock every call needs.
func (b *Broker) Status() []DriverStatus {
	b.mu.RLock()
	var out []DriverStatus
	var pcs [][]*proxyConn
	for _, name := range sortedKeys(b.drivers) {
		d := b.drivers[name]
		ds := DriverStatus{Name: name, Socket: b.sockets[name], Inflight: d.stats.inflight.Load(), Total: d.stats.total.Load(), Failed: d.stats.failed.Load()}
		all := d.all()
		for _, pc := range all {
			ds.Proxies = append(ds.Proxies, ProxyStatus{Address: pc.cfg.Address, Node: pc.cfg.Node, ExpectedIdentity: pc.want})
		}
		out = append(out, ds)
		pcs = append(pcs, all)
	}
	b.mu.RUnlock()
	for i := range out {
		for j, pc := range pcs[i] {
			out[i].Proxies[j].State = pc.state()
		}
	}
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// WaitReady blocks until every proxy connection of every driver is READY or
// ctx is done (tests, start-up logging).
func (b *Broker) WaitReady(ctx context.Context) error {
	for {
		notReady := ""
		for _, ps := range b.proxyStates() {
			if ps.state != "READY" {
				notReady = fmt.Sprintf("driver %s proxy %s is %s", ps.driver, ps.address, ps.state)
				break
			}
		}
		if notReady == "" {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: %w", notReady, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}
