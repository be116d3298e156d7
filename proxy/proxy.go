package proxy

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	grpcprom "github.com/grpc-ecosystem/go-grpc-middleware/providers/prometheus"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"

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
	// MaxMsgSize bounds a message in either direction.
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
	driver  *grpc.ClientConn
	server  *grpc.Server
	metrics *grpcprom.ServerMetrics
	log     *slog.Logger

	infoMu sync.Mutex
	info   *proxyinfov1.GetInfoResponse // driver name/version, cached once known
}

// New connects (lazily) to the driver and builds the gRPC server.
func New(cfg Config) (*Proxy, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("proxy config: %w", err)
	}
	path, target, _ := telemetry.UnixTarget(cfg.DriverEndpoint)
	p := &Proxy{cfg: cfg, target: path, log: cfg.Logger.With("component", "proxy", "driver_endpoint", path)}

	otelOpts := []otelgrpc.Option{otelgrpc.WithPropagators(cfg.Propagator)}
	if cfg.TracerProvider != nil {
		otelOpts = append(otelOpts, otelgrpc.WithTracerProvider(cfg.TracerProvider))
	}
	conn, err := grpc.NewClient(target, append(rawgrpc.ClientTransportOptions(),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		// A restarted driver is found again within a second.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
			MinConnectTimeout: time.Second,
		}),
		grpc.WithStatsHandler(otelgrpc.NewClientHandler(otelOpts...)),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(cfg.MaxMsgSize), grpc.MaxCallSendMsgSize(cfg.MaxMsgSize)),
	)...)
	if err != nil {
		return nil, fmt.Errorf("proxy: driver endpoint %s: %w", cfg.DriverEndpoint, err)
	}
	p.driver = conn

	p.metrics = grpcprom.NewServerMetrics(grpcprom.WithServerHandlingTimeHistogram(
		grpcprom.WithHistogramBuckets(prometheus.ExponentialBucketsRange(10e-6, 120, 24)),
	))
	if cfg.Registerer != nil {
		if err := cfg.Registerer.Register(p.metrics); err != nil {
			return nil, fmt.Errorf("proxy: register metrics: %w", err)
		}
	}
	p.server = grpc.NewServer(append(rawgrpc.ServerTransportOptions(),
		grpc.Creds(credentials.NewTLS(p.logRefusals(cfg.TLS))),
		rawgrpc.ServerOption(),
		grpc.UnknownServiceHandler(p.forward),
		grpc.StatsHandler(otelgrpc.NewServerHandler(otelOpts...)),
		grpc.ChainUnaryInterceptor(p.metrics.UnaryServerInterceptor()),
		grpc.ChainStreamInterceptor(p.metrics.StreamServerInterceptor()),
		grpc.MaxRecvMsgSize(cfg.MaxMsgSize),
		grpc.MaxSendMsgSize(cfg.MaxMsgSize),
		// Reused workers keep their grown stacks: a forwarded call then costs
		// no stack copying.
		grpc.NumStreamWorkers(uint32(32*runtime.GOMAXPROCS(0))),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 5 * time.Second, PermitWithoutStream: true}),
	)...)
	proxyinfov1.RegisterProxyInfoServer(p.server, infoServer{p: p})
	return p, nil
}

// logRefusals makes every refused peer certificate a log line: gRPC itself
// only drops the connection.
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

// forward copies one CSI call to the driver without decoding it.
func (p *Proxy) forward(_ any, srv grpc.ServerStream) error {
	method, ok := grpc.MethodFromServerStream(srv)
	if !ok {
		return status.Error(codes.Internal, "csibroker proxy: no method in stream")
	}
	if !strings.HasPrefix(method, "/csi.") {
		return status.Errorf(codes.Unimplemented, "csibroker proxy: %s is not a CSI method; this proxy forwards CSI services only", method)
	}
	ctx, cancel := context.WithCancel(rawgrpc.OutgoingContext(srv.Context()))
	defer cancel()
	if known, cstream, sstream := rawgrpc.MethodKind(method); known && !cstream && !sstream {
		// Unary (every CSI method but the SnapshotMetadata streams): one
		// frame each way, without a second goroutine.
		err := rawgrpc.ForwardUnary(ctx, srv, p.driver, method)
		if st, ok := status.FromError(err); ok && isTransport(st) {
			return status.Errorf(st.Code(), "csibroker proxy: driver at %s: %s", p.target, st.Message())
		}
		return err
	}
	cs, err := p.driver.NewStream(ctx, rawgrpc.StreamDesc, method, rawgrpc.CallOption())
	if err != nil {
		st := status.Convert(err)
		return status.Errorf(st.Code(), "csibroker proxy: driver at %s: %s", p.target, st.Message())
	}
	return rawgrpc.ForwardStream(srv, cs)
}

// isTransport tells the proxy's own failure to reach the driver from a
// status the driver returned: gRPC reports a dial failure with this prefix.
func isTransport(st *status.Status) bool {
	return st.Code() == codes.Unavailable && strings.HasPrefix(st.Message(), "connection error")
}

// Serve serves gRPC on lis until ctx is done, then drains for up to 10s.
func (p *Proxy) Serve(ctx context.Context, lis net.Listener) error {
	errc := make(chan error, 1)
	go func() { errc <- p.server.Serve(lis) }()
	p.log.Info("proxy serving", "listen", lis.Addr().String(), "node", p.cfg.Node)
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	stopped := make(chan struct{})
	go func() { p.server.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		p.server.Stop()
	}
	return nil
}

// Close releases the driver connection.
func (p *Proxy) Close() error { return p.driver.Close() }

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

type infoServer struct {
	proxyinfov1.UnimplementedProxyInfoServer
	p *Proxy
}

func (s infoServer) GetInfo(ctx context.Context, _ *proxyinfov1.GetInfoRequest) (*proxyinfov1.GetInfoResponse, error) {
	p := s.p
	out := &proxyinfov1.GetInfoResponse{Node: p.cfg.Node, ProxyVersion: p.cfg.Version, Identity: p.cfg.Identity}
	pctx, cancel := context.WithTimeout(ctx, p.cfg.ProbeTimeout)
	defer cancel()
	p.infoMu.Lock()
	cached := p.info
	p.infoMu.Unlock()
	if cached == nil {
		pi, err := csi.NewIdentityClient(p.driver).GetPluginInfo(pctx, &csi.GetPluginInfoRequest{})
		if err == nil {
			cached = &proxyinfov1.GetInfoResponse{DriverName: pi.GetName(), DriverVersion: pi.GetVendorVersion()}
			p.infoMu.Lock()
			p.info = cached
			p.infoMu.Unlock()
		} else {
			out.DriverError = err.Error()
		}
	}
	if cached != nil {
		out.DriverName, out.DriverVersion = cached.DriverName, cached.DriverVersion
	}
	if err := p.Ready(ctx); err != nil {
		out.DriverError = err.Error()
	} else {
		out.DriverReady = true
	}
	return out, nil
}
