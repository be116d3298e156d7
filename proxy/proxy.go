package proxy

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	grpcprom "github.com/grpc-ecosystem/go-grpc-middleware/providers/prometheus"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/csibroker/csibroker/internal/grpcsrv"
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
	// ProbeTimeout bounds each of the proxy's own calls to the driver: the
	// Probe behind /healthz, /readyz and GetInfo, and GetPluginInfo.
	ProbeTimeout time.Duration
	// KubeletRegistrationPath is the driver's socket as the kubelet sees
	// it (the host path). Set, with Node, the proxy registers the driver
	// with the kubelet as node-driver-registrar does; empty, it does not.
	KubeletRegistrationPath string
	// PluginRegistrationDir is the kubelet's plugin registry as the proxy
	// sees it (default DefaultPluginRegistrationDir); the registration
	// socket is <dir>/<driver name>-reg.sock.
	PluginRegistrationDir string
	// RegistrationCheckInterval is how often the proxy looks at the
	// driver's socket and the registration socket (default 1s).
	RegistrationCheckInterval time.Duration
	// MaxMsgSize bounds a message in either direction, forwarded or the
	// proxy's own.
	MaxMsgSize int
	// MaxConcurrentCalls bounds the calls the driver has from the proxy at
	// once, over every broker connection and the proxy's own Probe and
	// GetPluginInfo; a call over the bound waits for a slot within its
	// deadline. It is each broker connection's stream limit too.
	MaxConcurrentCalls int

	Logger         *slog.Logger
	TracerProvider trace.TracerProvider
	Propagator     propagation.TextMapPropagator
	Registerer     prometheus.Registerer
	Gatherer       prometheus.Gatherer
}

// DefaultMaxConcurrentCalls is Config.MaxConcurrentCalls' default.
const DefaultMaxConcurrentCalls = 256

// DefaultProbeTimeout is Config.ProbeTimeout's default.
const DefaultProbeTimeout = 3 * time.Second

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
	if c.KubeletRegistrationPath != "" {
		if c.Node == "" {
			return errors.New("kubelet registration is for a node plugin's proxy: it needs the node")
		}
		if !filepath.IsAbs(c.KubeletRegistrationPath) {
			return fmt.Errorf("kubelet registration path %q is not an absolute path", c.KubeletRegistrationPath)
		}
		if c.PluginRegistrationDir == "" {
			c.PluginRegistrationDir = DefaultPluginRegistrationDir
		}
		if c.RegistrationCheckInterval <= 0 {
			c.RegistrationCheckInterval = time.Second
		}
	}
	if c.ProbeTimeout <= 0 {
		c.ProbeTimeout = DefaultProbeTimeout
	}
	if c.MaxMsgSize <= 0 {
		c.MaxMsgSize = 64 << 20
	}
	if c.MaxConcurrentCalls <= 0 {
		c.MaxConcurrentCalls = DefaultMaxConcurrentCalls
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Propagator == nil {
		c.Propagator = telemetry.Propagator()
	}
	if c.TracerProvider == nil {
		c.TracerProvider = otel.GetTracerProvider()
	}
	return nil
}

// Proxy forwards CSI calls arriving over mTLS to one driver socket.
type Proxy struct {
	cfg    Config
	target string           // the driver socket's path
	driver *grpc.ClientConn // every call to the driver, forwarded or the proxy's own
	srv    *grpc.Server
	slots  *grpcsrv.Slots // one per call the driver may have at once
	log    *slog.Logger
	reg    *registration // nil unless the proxy registers the driver with the kubelet

	// driverDown: the last dial of the driver's socket failed (logged when
	// it starts failing and when it answers again, not at every dial).
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

// New prepares the proxy. The driver is dialled when the first call comes,
// and again, with backoff, whenever its connection is lost (the
// connection never goes idle).
func New(cfg Config) (*Proxy, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("proxy config: %w", err)
	}
	path, _, _ := telemetry.UnixTarget(cfg.DriverEndpoint)
	p := &Proxy{cfg: cfg, target: path, slots: grpcsrv.NewSlots(cfg.MaxConcurrentCalls, "csibroker proxy: driver "+path+" (--max-concurrent-calls)"),
		log: cfg.Logger.With("component", "proxy", "driver_endpoint", path)}

	conn, err := grpc.NewClient("passthrough:///"+path, append(rawgrpc.ClientTransportOptions(),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithAuthority("localhost"),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			c, err := grpcsrv.DialUnix(ctx, addr)
			p.noteDial(err)
			return c, err
		}),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
			MinConnectTimeout: time.Second,
		}),
		grpc.WithIdleTimeout(0),
		grpc.WithChainUnaryInterceptor(p.boundOwnCall),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(cfg.MaxMsgSize), grpc.MaxCallSendMsgSize(cfg.MaxMsgSize)),
	)...)
	if err != nil {
		return nil, fmt.Errorf("proxy: driver endpoint %s: %w", cfg.DriverEndpoint, err)
	}
	p.driver = conn
	if cfg.KubeletRegistrationPath != "" {
		p.reg = &registration{driver: conn, target: path, dir: cfg.PluginRegistrationDir,
			kubeletPath: cfg.KubeletRegistrationPath, interval: cfg.RegistrationCheckInterval,
			timeout: cfg.ProbeTimeout, log: p.log.With("component", "registration")}
	}

	metrics := grpcprom.NewServerMetrics(grpcprom.WithServerHandlingTimeHistogram(
		grpcprom.WithHistogramBuckets(prometheus.ExponentialBucketsRange(10e-6, 120, 24))))
	if cfg.Registerer != nil {
		if err := cfg.Registerer.Register(metrics); err != nil {
			conn.Close()
			return nil, fmt.Errorf("proxy: register metrics: %w", err)
		}
	}
	opts := append(grpcsrv.ServerOptions(grpcsrv.Limits{
		MaxConcurrentStreams: uint32(cfg.MaxConcurrentCalls),
		MaxRecvMsgSize:       cfg.MaxMsgSize,
		MaxSendMsgSize:       cfg.MaxMsgSize,
	}),
		grpc.Creds(grpcsrv.Credentials(cfg.TLS, p.log, grpcsrv.LogHandshakeRefusals("proxy refused a peer"))),
		grpc.StatsHandler(grpcsrv.CallTracker()),
		// Spans keep a failed call's code, never the driver's message (it
		// may quote the request's secrets).
		grpc.StatsHandler(telemetry.CodeOnly(otelgrpc.NewServerHandler(
			otelgrpc.WithTracerProvider(cfg.TracerProvider),
			otelgrpc.WithPropagators(cfg.Propagator),
			otelgrpc.WithMeterProvider(noop.NewMeterProvider())))), // metrics are Prometheus' below
		grpc.ChainUnaryInterceptor(grpcsrv.UnaryCheckPeer(), metrics.UnaryServerInterceptor()),
		grpc.ChainStreamInterceptor(grpcsrv.StreamCheckPeer(), boundedLabels(metrics)),
		grpc.ForceServerCodecV2(rawgrpc.Codec{}),
		grpc.UnknownServiceHandler(p.forward),
	)
	p.srv = grpc.NewServer(opts...)
	proxyinfov1.RegisterProxyInfoServer(p.srv, infoServer{p})
	return p, nil
}

// boundedLabels makes the metrics interceptors name every method the
// protobuf registry does not know rawgrpc.OtherMethod (a caller may name
// any path, and each would be a new series), give known methods their own
// kind (to grpc-go every forwarded call is a bidirectional stream), and
// count a status code outside gRPC's range as Unknown (a driver may send
// any number). The call's own status is not changed.
func boundedLabels(m *grpcprom.ServerMetrics) grpc.StreamServerInterceptor {
	stream, unary := m.StreamServerInterceptor(), m.UnaryServerInterceptor()
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		var err error
		counted := func() error {
			err = h(srv, ss)
			if status.Code(err) > codes.Unauthenticated {
				return status.Error(codes.Unknown, "")
			}
			return err
		}
		known, cs, sst := rawgrpc.MethodKind(info.FullMethod)
		switch {
		case !known || !strings.HasPrefix(info.FullMethod, "/"):
			other := "/" + rawgrpc.OtherMethod + "/" + rawgrpc.OtherMethod
			stream(srv, ss, &grpc.StreamServerInfo{FullMethod: other, IsClientStream: true, IsServerStream: true},
				func(any, grpc.ServerStream) error { return counted() })
		case !cs && !sst:
			unary(ss.Context(), nil, &grpc.UnaryServerInfo{FullMethod: info.FullMethod},
				func(context.Context, any) (any, error) { return nil, counted() })
		default:
			stream(srv, ss, &grpc.StreamServerInfo{FullMethod: info.FullMethod, IsClientStream: cs, IsServerStream: sst},
				func(any, grpc.ServerStream) error { return counted() })
		}
		return err
	}
}

// forward passes one call to the driver: any /csi.* method, of any kind.
func (p *Proxy) forward(_ any, in grpc.ServerStream) error {
	method, _ := grpc.MethodFromServerStream(in)
	if !strings.HasPrefix(method, "/csi.") {
		return status.Errorf(codes.Unimplemented, "csibroker proxy: %s is not a CSI method; this proxy forwards CSI services only", method)
	}
	if known, clientStreams, _ := rawgrpc.MethodKind(method); known && !clientStreams {
		// Every CSI method today: the request comes before a driver
		// slot and stream are taken, so a call that never sends it, or
		// is reset first, costs the driver nothing.
		var err error
		if in, err = rawgrpc.Prefetch(in); err != nil {
			return err
		}
	}
	ctx, cancel := context.WithCancel(in.Context())
	defer cancel()
	release, err := p.acquire(ctx)
	if err != nil {
		return err
	}
	defer release()
	// The driver sees the proxy's span as the caller (otelgrpc's server
	// span, in ctx).
	ctx, md := rawgrpc.OutgoingContext(ctx)
	p.cfg.Propagator.Inject(ctx, rawgrpc.MDCarrier(md))
	out, err := p.driver.NewStream(ctx, rawgrpc.StreamDesc, method, grpc.ForceCodecV2(rawgrpc.Codec{}))
	if err != nil {
		st := status.Convert(err)
		return status.Errorf(st.Code(), "csibroker proxy: driver at %s: %s", p.target, st.Message())
	}
	return rawgrpc.Forward(in, out)
}

// acquire takes one of the driver's call slots (MaxConcurrentCalls),
// waiting within ctx.
func (p *Proxy) acquire(ctx context.Context) (release func(), err error) {
	return p.slots.Take(ctx)
}

// boundOwnCall makes the proxy's own calls to the driver (Probe,
// GetPluginInfo) take a call slot too.
func (p *Proxy) boundOwnCall(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	release, err := p.acquire(ctx)
	if err != nil {
		return err
	}
	defer release()
	return invoker(ctx, method, req, reply, cc, opts...)
}

// Serve accepts the broker's connections on lis until ctx is done, then
// stops gracefully: no new call, the calls in flight have 10s to finish,
// then every connection is closed.
func (p *Proxy) Serve(ctx context.Context, lis net.Listener) error {
	p.log.Info("proxy serving", "listen", lis.Addr().String(), "node", p.cfg.Node)
	if _, err := os.Stat(p.target); err != nil {
		// Not fatal: a driver container may start after its proxy.
		p.log.Warn("the driver's socket is not there yet; calls fail with Unavailable until it is", "err", err)
	}
	served := make(chan error, 1)
	go func() { served <- p.srv.Serve(lis) }()
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	stopped := make(chan struct{})
	go func() {
		p.srv.GracefulStop()
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		p.srv.Stop()
		<-stopped
	}
	<-served
	return nil
}

// Close stops serving and releases the driver connection.
func (p *Proxy) Close() error {
	p.srv.Stop()
	return p.driver.Close()
}

// Alive probes the driver: any answer within ProbeTimeout, ready or not,
// is alive (a driver still starting is not restarted for it); an error, a
// driver that cannot be reached, or no answer in time is not.
func (p *Proxy) Alive(ctx context.Context) error {
	_, err := p.probe(ctx)
	return err
}

// Ready probes the driver: it is ready if it answers and does not say it
// is not ready.
func (p *Proxy) Ready(ctx context.Context) error {
	resp, err := p.probe(ctx)
	if err != nil {
		return err
	}
	if r := resp.GetReady(); r != nil && !r.GetValue() {
		return fmt.Errorf("driver at %s: probe: not ready", p.target)
	}
	return nil
}

func (p *Proxy) probe(ctx context.Context) (*csi.ProbeResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, p.cfg.ProbeTimeout)
	defer cancel()
	resp, err := csi.NewIdentityClient(p.driver).Probe(ctx, &csi.ProbeRequest{})
	if err != nil {
		return nil, fmt.Errorf("driver at %s: probe: %w", p.target, err)
	}
	return resp, nil
}

// RunRegistration registers the driver with the kubelet until ctx is
// done, then removes the registration socket; it returns at once if the
// proxy does not register (no Config.KubeletRegistrationPath).
func (p *Proxy) RunRegistration(ctx context.Context) {
	if p.reg != nil {
		p.reg.run(ctx)
	}
}

// Live is the proxy's own health: with kubelet registration on, it fails
// while the registration socket is missing or could not be created;
// otherwise it always passes.
func (p *Proxy) Live() error {
	if p.reg == nil {
		return nil
	}
	return p.reg.check()
}

// healthCheck is one named check of /healthz.
type healthCheck struct {
	name  string
	check func(*http.Request) error
}

// serveChecks runs checks in order and answers 200 if all pass, 503 if
// any fails, with one line per check.
func serveChecks(w http.ResponseWriter, r *http.Request, checks ...healthCheck) {
	var body strings.Builder
	failed := false
	for _, c := range checks {
		if err := c.check(r); err != nil {
			failed = true
			fmt.Fprintf(&body, "%s: failed: %v\n", c.name, err)
		} else {
			fmt.Fprintf(&body, "%s: ok\n", c.name)
		}
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	if failed {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	fmt.Fprint(w, body.String())
}

// HTTPHandler serves the health endpoints and /metrics:
//
//   - /healthz/driver: the driver answers Probe within ProbeTimeout
//     (Alive), for the driver container's livenessProbe;
//   - /livez: the proxy's own health (Live: the registration socket, on a
//     node proxy that registers the driver), for the proxy container's
//     livenessProbe;
//   - /healthz: both;
//   - /readyz: the driver answers Probe and is ready (Ready).
func (p *Proxy) HTTPHandler(metricsPath string) http.Handler {
	driver := healthCheck{"driver", func(r *http.Request) error { return p.Alive(r.Context()) }}
	own := healthCheck{"proxy", func(*http.Request) error { return nil }}
	if p.reg != nil {
		own = healthCheck{"registration", func(*http.Request) error { return p.Live() }}
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) { serveChecks(w, r, driver, own) })
	mux.HandleFunc("/healthz/driver", func(w http.ResponseWriter, r *http.Request) { serveChecks(w, r, driver) })
	mux.HandleFunc("/livez", func(w http.ResponseWriter, r *http.Request) { serveChecks(w, r, own) })
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		serveChecks(w, r, healthCheck{"driver", func(r *http.Request) error { return p.Ready(r.Context()) }})
	})
	if p.cfg.Gatherer != nil {
		if metricsPath == "" {
			metricsPath = "/metrics"
		}
		mux.Handle(metricsPath, promhttp.HandlerFor(p.cfg.Gatherer, promhttp.HandlerOpts{}))
	}
	return mux
}

// infoServer is the proxy's own API (proto/proxyinfo).
type infoServer struct{ p *Proxy }

func (s infoServer) GetInfo(ctx context.Context, _ *proxyinfov1.GetInfoRequest) (*proxyinfov1.GetInfoResponse, error) {
	return s.p.getInfo(ctx), nil
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
