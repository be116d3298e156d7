package proxy

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/net/http2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/rawgrpc"
	"github.com/csibroker/csibroker/internal/telemetry"
	proxyinfov1 "github.com/csibroker/csibroker/proto/proxyinfo/v1"
)

// Config is everything a proxy needs; cmd/ fills it from flags.
type Config struct {
	// DriverEndpoint is the driver's CSI socket, unix:///path.
	DriverEndpoint string
	// Node is the node this proxy runs on, empty for a controller proxy.
	Node string
	// Version is the proxy's own version, reported by GetInfo.
	Version string
	// TLS is the server configuration; it must authorize only the broker.
	TLS *tls.Config
	// Identity is our own SPIFFE ID, reported by GetInfo.
	Identity string
	// ProbeTimeout bounds the Probe behind /readyz and GetInfo.
	ProbeTimeout time.Duration
	// MaxMsgSize bounds the messages of the proxy's own calls to the driver
	// (Probe, GetPluginInfo). Relayed calls are not decoded: what the proxy
	// holds of them is bounded by the HTTP/2 flow-control windows.
	MaxMsgSize int

	Logger         *slog.Logger
	TracerProvider trace.TracerProvider
	Propagator     propagation.TextMapPropagator
	Registerer     prometheus.Registerer
	Gatherer       prometheus.Gatherer
}

// Validate checks the configuration and fills defaults.
func (c *Config) Validate() error {
	if c.DriverEndpoint == "" {
		return errors.New("driver endpoint is required")
	}
	if _, _, err := telemetry.UnixTarget(c.DriverEndpoint); err != nil {
		return err
	}
	if c.TLS == nil {
		return errors.New("TLS configuration is required: the proxy never listens in plain text")
	}
	if c.ProbeTimeout <= 0 {
		c.ProbeTimeout = 3 * time.Second
	}
	if c.MaxMsgSize <= 0 {
		c.MaxMsgSize = 64 << 20
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Propagator == nil {
		c.Propagator = telemetry.Propagator()
	}
	return nil
}

// Proxy forwards CSI calls arriving over mTLS to one driver socket.
type Proxy struct {
	cfg     Config
	target  string
	tls     *tls.Config
	driver  *grpc.ClientConn // the proxy's own calls: Probe (readiness) and GetPluginInfo
	metrics *serverMetrics
	tracer  trace.Tracer
	log     *slog.Logger

	dmu     sync.Mutex // guards every broker connection's dconn and dconns, and dclosed
	dclosed bool       // Close ran: no driver connection is made any more

	bmu    sync.Mutex
	bconns map[*conn]struct{}
	bgone  chan struct{} // signalled when a broker connection goes away

	methods   sync.Map // method -> *methodInfo
	otherOnce sync.Once
	other     *methodInfo // the series of unknown methods

	// driverDown: the last dial of the driver's socket failed (logged when
	// it starts failing and when it answers again, not at every call).
	driverMu   sync.Mutex
	driverDown bool
}

// noteDial logs a change of whether the driver's socket can be dialled.
func (p *Proxy) noteDial(err error) {
	p.driverMu.Lock()
	defer p.driverMu.Unlock()
	switch {
	case err != nil && !p.driverDown:
		p.driverDown = true
		p.log.Warn("cannot reach the driver's socket; calls fail with Unavailable until it answers", "err", err)
	case err == nil && p.driverDown:
		p.driverDown = false
		p.log.Info("the driver's socket answers again")
	}
}

// New prepares the proxy; the driver is dialled when the first call comes.
func New(cfg Config) (*Proxy, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("proxy config: %w", err)
	}
	path, target, _ := telemetry.UnixTarget(cfg.DriverEndpoint)
	p := &Proxy{cfg: cfg, target: path, log: cfg.Logger.With("component", "proxy", "driver_endpoint", path),
		bconns: map[*conn]struct{}{}, bgone: make(chan struct{}, 1)}
	tp := cfg.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	p.tracer = tp.Tracer("github.com/csibroker/csibroker/proxy")

	conn, err := grpc.NewClient(target, append(rawgrpc.ClientTransportOptions(),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
			MinConnectTimeout: time.Second,
		}),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(cfg.MaxMsgSize), grpc.MaxCallSendMsgSize(cfg.MaxMsgSize)),
	)...)
	if err != nil {
		return nil, fmt.Errorf("proxy: driver endpoint %s: %w", cfg.DriverEndpoint, err)
	}
	p.driver = conn

	p.metrics = newServerMetrics()
	if cfg.Registerer != nil {
		if err := cfg.Registerer.Register(p.metrics); err != nil {
			return nil, fmt.Errorf("proxy: register metrics: %w", err)
		}
	}
	p.tls = p.logRefusals(cfg.TLS)
	if len(p.tls.NextProtos) == 0 {
		p.tls.NextProtos = []string{"h2"}
	}
	return p, nil
}

// logRefusals makes every refused peer certificate a log line: the
// handshake itself only fails.
func (p *Proxy) logRefusals(cfg *tls.Config) *tls.Config {
	cfg = cfg.Clone()
	verify := cfg.VerifyPeerCertificate
	cfg.VerifyPeerCertificate = func(raw [][]byte, chains [][]*x509.Certificate) error {
		var err error
		if verify != nil {
			err = verify(raw, chains)
		} else if len(raw) == 0 {
			err = errors.New("peer presented no certificate")
		}
		if err != nil {
			p.log.Warn("proxy refused a peer", "err", err)
		}
		return err
	}
	return cfg
}

// Serve accepts the broker's connections on lis until ctx is done, then
// asks them to go away and waits up to 10s for their calls to finish.
func (p *Proxy) Serve(ctx context.Context, lis net.Listener) error {
	p.log.Info("proxy serving", "listen", lis.Addr().String(), "node", p.cfg.Node)
	if _, err := os.Stat(p.target); err != nil {
		// Not fatal: a driver container may start after its proxy.
		p.log.Warn("the driver's socket is not there yet; calls fail with Unavailable until it is", "err", err)
	}
	stop := context.AfterFunc(ctx, func() { lis.Close() })
	defer stop()
	var delay time.Duration
	for {
		nc, err := lis.Accept()
		if err != nil {
			if ctx.Err() != nil {
				p.drain()
				return nil
			}
			if ne, ok := err.(interface{ Temporary() bool }); ok && ne.Temporary() {
				delay = min(max(2*delay, 5*time.Millisecond), time.Second)
				time.Sleep(delay)
				continue
			}
			return err
		}
		delay = 0
		go p.serveConn(ctx, nc)
	}
}

// serveConn completes the TLS handshake and the HTTP/2 preface, then relays
// the connection's calls.
func (p *Proxy) serveConn(ctx context.Context, nc net.Conn) {
	hctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	own := mtls.OwnCert(p.tls) // before the handshake: see mtls.NewPeerCheck
	tc := tls.Server(nc, p.tls)
	if err := tc.HandshakeContext(hctx); err != nil {
		p.log.Debug("TLS handshake failed", "peer", nc.RemoteAddr().String(), "err", err)
		nc.Close()
		return
	}
	if proto := tc.ConnectionState().NegotiatedProtocol; proto != "h2" {
		p.log.Warn("proxy refused a peer", "peer", nc.RemoteAddr().String(), "err", fmt.Sprintf("ALPN protocol %q, want h2", proto))
		tc.Close()
		return
	}
	c := newConn(p, tc, false, nc.RemoteAddr().String())
	c.peerCheck = mtls.NewPeerCheck(p.tls, tc.ConnectionState(), own)
	tc.SetReadDeadline(time.Now().Add(10 * time.Second))
	preface := make([]byte, len(http2.ClientPreface))
	if _, err := io.ReadFull(c.br, preface); err != nil || string(preface) != http2.ClientPreface {
		p.log.Warn("not an HTTP/2 client", "peer", c.desc, "err", err)
		tc.Close()
		return
	}
	tc.SetReadDeadline(time.Time{})
	if err := c.start(); err != nil {
		tc.Close()
		return
	}
	p.bmu.Lock()
	if ctx.Err() != nil {
		p.bmu.Unlock()
		tc.Close()
		return
	}
	p.bconns[c] = struct{}{}
	p.bmu.Unlock()
	c.readLoop(func(fr *http2.MetaHeadersFrame, f *flusher) { p.onBrokerHeaders(c, fr, f) })
}

func (p *Proxy) forgetBrokerConn(c *conn) {
	p.bmu.Lock()
	delete(p.bconns, c)
	p.bmu.Unlock()
	select {
	case p.bgone <- struct{}{}:
	default:
	}
}

// drain sends GOAWAY on every broker connection, lets their calls finish
// for up to 10s, then closes what is left.
func (p *Proxy) drain() {
	p.bmu.Lock()
	conns := make([]*conn, 0, len(p.bconns))
	for c := range p.bconns {
		conns = append(conns, c)
	}
	p.bmu.Unlock()
	for _, c := range conns {
		c.mu.Lock()
		if !c.draining {
			// (A connection refused by the peer check has had its GOAWAY,
			// with a lower last stream: a second may not raise it.)
			c.goAwayLocked(c.lastID, 0, errors.New("proxy stopping"))
		}
		c.mu.Unlock()
	}
	deadline := time.After(10 * time.Second)
	for {
		p.bmu.Lock()
		n := len(p.bconns)
		p.bmu.Unlock()
		if n == 0 {
			return
		}
		select {
		case <-p.bgone:
		case <-deadline:
			p.bmu.Lock()
			for c := range p.bconns {
				c.mu.Lock()
				c.closeLocked(errors.New("proxy stopped"))
				c.mu.Unlock()
			}
			p.bmu.Unlock()
			return
		}
	}
}

// driverConn returns the driver connection of broker connection bc,
// dialling a new one when there is none or the last one is gone or going
// away: a restarted driver is found again by the next call. Each broker
// connection has a driver connection of its own, so a broker connection
// that stops reading stalls only its own calls, never another's; and the
// dial is made without the proxy-wide lock, so a driver slow to accept
// holds up only the broker connection that needs it. Called by bc's
// reader only.
func (p *Proxy) driverConn(bc *conn) (*conn, error) {
	p.dmu.Lock()
	if c := bc.dconn; c != nil {
		c.mu.Lock()
		if c.nextID > rawgrpc.LastStreamID-rawgrpc.StreamIDMargin && !c.retiring {
			// Stream IDs nearly used up: new calls go to a new
			// connection, this one closes when its calls, queued ones
			// included, are done.
			c.retiring = true
			if len(c.streams) == 0 && len(c.waiting) == 0 {
				c.closeLocked(errors.New("stream IDs used up"))
			}
		}
		ok := !c.closed && !c.goingAway && !c.retiring
		c.mu.Unlock()
		if ok {
			p.dmu.Unlock()
			return c, nil
		}
	}
	p.dmu.Unlock()
	bc.mu.Lock()
	gone := bc.closed
	bc.mu.Unlock()
	if gone {
		return nil, errors.New("the broker's connection is closed")
	}
	nc, err := net.DialTimeout("unix", p.target, time.Second)
	p.noteDial(err)
	if err != nil {
		return nil, err
	}
	c := newConn(p, nc, true, p.target)
	c.owner = bc
	if err := c.start(); err != nil {
		nc.Close()
		return nil, err
	}
	p.dmu.Lock()
	defer p.dmu.Unlock()
	if p.dclosed {
		// Close ran during the dial and released what it found.
		c.mu.Lock()
		c.closeLocked(errors.New("proxy closed"))
		c.mu.Unlock()
		return nil, errors.New("the proxy is closed")
	}
	bc.dconn = c
	bc.dconns = append(bc.dconns, c)
	go c.readLoop(func(fr *http2.MetaHeadersFrame, f *flusher) { p.onDriverHeaders(c, fr, f) })
	return c, nil
}

// dropDriverConn takes a driver connection the driver is shutting down
// (GOAWAY) out of use for new calls; its calls in flight finish on it.
func (p *Proxy) dropDriverConn(c *conn) {
	p.dmu.Lock()
	if c.owner != nil && c.owner.dconn == c {
		c.owner.dconn = nil
	}
	p.dmu.Unlock()
}

// forgetDriverConn forgets a driver connection whose reader is done.
func (p *Proxy) forgetDriverConn(c *conn) {
	p.dmu.Lock()
	if bc := c.owner; bc != nil {
		if bc.dconn == c {
			bc.dconn = nil
		}
		bc.dconns = slices.DeleteFunc(bc.dconns, func(x *conn) bool { return x == c })
	}
	p.dmu.Unlock()
}

// closeDriverConn closes the driver connections of a broker connection that
// is gone (its calls were reset first) or of a proxy that is closing: not
// only the current one, but also older ones still finishing their calls (a
// retiring connection's calls may wait for a slot the driver never frees).
func (p *Proxy) closeDriverConn(bc *conn) {
	p.dmu.Lock()
	conns := bc.dconns
	bc.dconn, bc.dconns = nil, nil
	p.dmu.Unlock()
	for _, c := range conns {
		c.mu.Lock()
		c.closeLocked(errors.New("the broker's connection is gone"))
		c.mu.Unlock()
	}
}

// Close releases the driver connections.
func (p *Proxy) Close() error {
	p.dmu.Lock()
	p.dclosed = true
	p.dmu.Unlock()
	p.bmu.Lock()
	conns := make([]*conn, 0, len(p.bconns))
	for c := range p.bconns {
		conns = append(conns, c)
	}
	p.bmu.Unlock()
	for _, c := range conns {
		p.closeDriverConn(c)
	}
	return p.driver.Close()
}

// Ready probes the driver.
func (p *Proxy) Ready(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, p.cfg.ProbeTimeout)
	defer cancel()
	resp, err := csi.NewIdentityClient(p.driver).Probe(ctx, &csi.ProbeRequest{})
	if err != nil {
		return fmt.Errorf("driver at %s: probe: %w", p.target, err)
	}
	if r := resp.GetReady(); r != nil && !r.GetValue() {
		return fmt.Errorf("driver at %s: probe: not ready", p.target)
	}
	return nil
}

// HTTPHandler serves /healthz, /readyz and /metrics.
func (p *Proxy) HTTPHandler(metricsPath string) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		if err := p.Ready(r.Context()); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	if p.cfg.Gatherer != nil {
		if metricsPath == "" {
			metricsPath = "/metrics"
		}
		mux.Handle(metricsPath, promhttp.HandlerFor(p.cfg.Gatherer, promhttp.HandlerOpts{}))
	}
	return mux
}

// getInfo answers ProxyInfo.GetInfo.
func (p *Proxy) getInfo(ctx context.Context) *proxyinfov1.GetInfoResponse {
	out := &proxyinfov1.GetInfoResponse{Node: p.cfg.Node, ProxyVersion: p.cfg.Version, Identity: p.cfg.Identity}
	pctx, cancel := context.WithTimeout(ctx, p.cfg.ProbeTimeout)
	defer cancel()
	// Asked each time (GetInfo is rare): the driver may have been replaced
	// by another version since the last call.
	if pi, err := csi.NewIdentityClient(p.driver).GetPluginInfo(pctx, &csi.GetPluginInfoRequest{}); err == nil {
		out.DriverName, out.DriverVersion = pi.GetName(), pi.GetVendorVersion()
	} else {
		out.DriverError = err.Error()
	}
	if err := p.Ready(ctx); err != nil {
		out.DriverError = err.Error()
	} else {
		out.DriverReady = true
	}
	return out
}
