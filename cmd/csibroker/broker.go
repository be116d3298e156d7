package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/grpcsrv"
	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/telemetry"
	"github.com/csibroker/csibroker/k8sbridge/discovery"
	"github.com/csibroker/csibroker/policy"
	brokerstatusv1 "github.com/csibroker/csibroker/proto/brokerstatus/v1"
)

func init() {
	register("broker", "run the broker: driver registry, proxy connections, CSI front ends", runBroker)
}

// BrokerCommandConfig holds the broker subcommand's flags.
type BrokerCommandConfig struct {
	RegistryFile  string
	SocketDir     string
	Listen        string
	StatusSocket  string
	HTTPEndpoint  string
	MetricsPath   string
	Timeout       time.Duration
	RetryAttempts int
	RetryStart    time.Duration
	RetryMax      time.Duration
	TLS           tlsFlags
	Log           logFlags
	Kube          kubeFlags
}

// Validate checks the flags.
func (c *BrokerCommandConfig) Validate() error {
	var errs []error
	if c.RegistryFile == "" && c.Kube.DiscoverProxies == "" {
		errs = append(errs, errors.New("--driver-registry or --discover-proxies is required: the broker must know where drivers' proxies are"))
	}
	if c.Timeout <= 0 {
		errs = append(errs, errors.New("--timeout must be positive"))
	}
	if c.RetryAttempts < 1 {
		errs = append(errs, errors.New("--csi-retry-attempts must be at least 1"))
	}
	if c.RetryStart <= 0 || c.RetryMax < c.RetryStart {
		errs = append(errs, errors.New("--csi-retry-interval-start must be positive and at most --csi-retry-interval-max"))
	}
	errs = append(errs, validateMetricsPath(c.MetricsPath), c.TLS.Validate(), c.Log.Validate(), c.Kube.validate())
	return errors.Join(errs...)
}

// fillRetry fills each field a driver's registry entry leaves unset from
// the --csi-retry-* flags (not only an entry that sets none of them).
func (c *BrokerCommandConfig) fillRetry(r broker.RetryConfig) broker.RetryConfig {
	if r.MaxAttempts <= 0 {
		r.MaxAttempts = c.RetryAttempts
	}
	return r.Fill(broker.RetryConfig{IntervalStart: c.RetryStart, IntervalMax: c.RetryMax})
}

func runBroker(ctx context.Context, args []string, _, stderr io.Writer) error {
	cfg, err := parseBrokerFlags(args, stderr)
	if err != nil {
		return err
	}
	r := &brokerRun{cfg: cfg, log: cfg.Log.Logger(stderr), ready: func() error { return nil }}
	if err := r.loadRegistry(); err != nil {
		return err
	}
	if r.src, err = cfg.TLS.Source(r.log); err != nil {
		return err
	}
	if id, err := mtls.ParseID(r.src.Current().ID); err != nil || id.Role != mtls.RoleBroker || id.TrustDomain != cfg.TLS.TrustDomain {
		return fmt.Errorf("--tls-cert: identity %s is not %s (the broker's identity in --trust-domain %s): proxies would refuse it", r.src.Current().ID, mtls.BrokerID(cfg.TLS.TrustDomain), cfg.TLS.TrustDomain)
	}
	if r.tp, err = telemetry.NewTracerProvider(ctx, "csibroker-broker"); err != nil {
		return fmt.Errorf("tracing: %w", err)
	}
	defer telemetry.ShutdownTracing(ctx, r.tp, r.log)
	r.promReg = prometheus.NewRegistry()
	r.promReg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if err := r.startBroker(); err != nil {
		return err
	}
	defer r.b.Close()

	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { r.src.Run(ctx, cfg.TLS.ReloadInterval); return nil })
	if kubeOn, _ := cfg.Kube.enabled(); kubeOn {
		if err := r.startKube(ctx, g); err != nil {
			return err
		}
	}
	if err := r.serveFrontEnds(ctx, g); err != nil {
		return err
	}
	return g.Wait()
}

// parseBrokerFlags is the broker subcommand's configuration from its
// flags, validated.
func parseBrokerFlags(args []string, stderr io.Writer) (BrokerCommandConfig, error) {
	cfg := BrokerCommandConfig{}
	fs := flag.NewFlagSet("broker", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&cfg.RegistryFile, "driver-registry", "", "YAML file listing drivers and their proxies (see deploy/examples/registry.yaml)")
	fs.StringVar(&cfg.SocketDir, "socket-dir", "/run/csibroker", "directory for the CSI front-end sockets <dir>/<driver>.sock, one for every driver, from the registry file or found by discovery, made and removed as drivers come and go (empty: none)")
	fs.StringVar(&cfg.Listen, "listen", "", "address of the shared mTLS CSI front end, where x-csibroker-driver metadata names the driver and callers present a client certificate (spiffe://<trust-domain>/csibroker/client/<name>, see csibroker certs --client) (empty: off)")
	fs.StringVar(&cfg.StatusSocket, "status-socket", "", "unix socket for the status API read by 'csibroker status' (default <socket-dir>/csibroker-status.sock)")
	fs.StringVar(&cfg.HTTPEndpoint, "http-endpoint", "", "address for /healthz, /readyz and metrics (empty: off)")
	fs.StringVar(&cfg.MetricsPath, "metrics-path", "/metrics", "path of the Prometheus metrics on --http-endpoint")
	fs.DurationVar(&cfg.Timeout, "timeout", broker.DefaultTimeout, "default timeout of one CSI call, retries included (a driver's registry entry may override it per method)")
	fs.IntVar(&cfg.RetryAttempts, "csi-retry-attempts", broker.DefaultMaxAttempts, "attempts per CSI call on transport failures and Unavailable (1: no retry)")
	fs.DurationVar(&cfg.RetryStart, "csi-retry-interval-start", broker.DefaultIntervalStart, "first backoff between attempts of one CSI call (jittered, doubling)")
	fs.DurationVar(&cfg.RetryMax, "csi-retry-interval-max", broker.DefaultIntervalMax, "largest backoff between attempts of one CSI call")
	cfg.TLS.Register(fs)
	cfg.Log.Register(fs)
	cfg.Kube.register(fs)
	if err := parseFlags(fs, args); err != nil {
		return cfg, err
	}
	cfg.Kube.noteGiven(fs)
	err := cfg.Validate() // before cfg is copied out: it may set fields
	return cfg, err
}

// brokerRun is one run of the broker subcommand: what its steps set up and
// hand on.
type brokerRun struct {
	cfg        BrokerCommandConfig
	log        *slog.Logger
	reg        *broker.RegistryConfig
	statusPath string // "": no status socket
	src        *mtls.FileSource
	tp         *sdktrace.TracerProvider
	promReg    *prometheus.Registry
	b          *broker.Broker
	// leader, driverLeaders and ready are the bridge's, with Kubernetes on.
	leader        func() (bool, string)
	driverLeaders func() map[string]string
	ready         func() error
}

// loadRegistry reads the driver registry and checks the front-end sockets
// before anything is set up.
func (r *brokerRun) loadRegistry() error {
	cfg := r.cfg
	r.reg = &broker.RegistryConfig{}
	if cfg.RegistryFile != "" {
		reg, err := broker.LoadRegistryConfig(cfg.RegistryFile)
		if err != nil {
			return err
		}
		r.reg = reg
	}
	sockets := map[string]string{}
	if cfg.SocketDir != "" {
		for _, d := range r.reg.Drivers {
			sockets[d.Name] = filepath.Join(cfg.SocketDir, d.Name+".sock")
		}
	}
	r.statusPath = cfg.StatusSocket
	if r.statusPath == "" && cfg.SocketDir != "" {
		r.statusPath = filepath.Join(cfg.SocketDir, "csibroker-status.sock")
	}
	absPath := func(p string) string {
		if a, err := filepath.Abs(p); err == nil {
			return a
		}
		return filepath.Clean(p)
	}
	for name, path := range sockets {
		if r.statusPath != "" && absPath(path) == absPath(r.statusPath) {
			// Each server would remove the other's socket file.
			return fmt.Errorf("driver %s's front-end socket %s is the status socket: set --status-socket to another path", name, path)
		}
	}
	return nil
}

// startBroker makes the broker with the registry's drivers.
func (r *brokerRun) startBroker() error {
	b, err := broker.New(broker.Options{TrustDomain: r.cfg.TLS.TrustDomain, TLS: r.src, Logger: r.log, TracerProvider: r.tp, Registerer: r.promReg})
	if err != nil {
		return err
	}
	for _, d := range r.reg.Drivers {
		if d.Timeout == 0 {
			d.Timeout = r.cfg.Timeout
		}
		d.Retry = r.cfg.fillRetry(d.Retry)
		if err := b.SetDriver(d); err != nil {
			b.Close()
			return err
		}
	}
	r.b = b
	return nil
}

// startKube runs the Kubernetes side in g: the secret policy (file, CA,
// SecretGrants), the bridge and proxy discovery.
func (r *brokerRun) startKube(ctx context.Context, g *errgroup.Group) error {
	cfg, log := r.cfg, r.log
	authz, store, err := cfg.Kube.authorizer(log)
	if err != nil {
		return err
	}
	if ca := cfg.Kube.policyCA; ca != nil {
		g.Go(func() error { ca.Run(ctx, cfg.TLS.ReloadInterval); return nil })
	}
	bridge, restCfg, err := cfg.Kube.bridge(r.b, authz, cfg.Timeout, log, r.tp, r.promReg)
	if err != nil {
		return err
	}
	r.leader, r.driverLeaders, r.ready = bridge.Leader, bridge.DriverLeaders, bridge.Ready
	if cfg.Kube.PolicyCRDs {
		gc, err := newGrantController(restCfg, store, bridge, log)
		if err != nil {
			return err
		}
		if cfg.Kube.PolicyMode != string(policy.ModeOff) {
			// No claim is decided against a rule set without the
			// cluster's grants in it.
			bridge.WaitFor(gc.HasSynced, "SecretGrants not loaded yet (is the SecretGrant CRD installed, and may the broker list SecretGrants?)")
		}
		g.Go(func() error { return gc.Run(ctx) })
	}
	g.Go(func() error { return bridge.Run(ctx) })
	g.Go(func() error { cfg.Kube.followDrivers(ctx, bridge.LedDrivers, log); return nil })
	if cfg.Kube.DiscoverProxies != "" {
		var static []string
		for _, d := range r.reg.Drivers {
			static = append(static, d.Name)
		}
		template := broker.DriverConfig{Timeout: cfg.Timeout, Retry: cfg.fillRetry(broker.RetryConfig{})}
		disc, err := discovery.New(bridge.InformerClient(), cfg.Kube.DiscoverProxies, cfg.Kube.discoverNamespaces(), r.b, template, static, log)
		if err != nil {
			return err
		}
		disc.ReportTo(bridge.Recorder(), func() bool { leading, _ := bridge.Leader(); return leading })
		g.Go(func() error { return disc.Run(ctx) })
	}
	if w := cfg.Kube.policyFile; w != nil {
		g.Go(func() error { w.Run(ctx, store); return nil })
	}
	return nil
}

// serveFrontEnds serves, in g, the CSI front ends (a socket per driver, the
// shared mTLS listener), the status socket and the HTTP endpoint.
func (r *brokerRun) serveFrontEnds(ctx context.Context, g *errgroup.Group) error {
	cfg, b := r.cfg, r.b
	if cfg.SocketDir != "" {
		// Every driver's, those discovery finds included, as they come
		// and go.
		g.Go(func() error {
			if err := b.ServeSocketDir(ctx, cfg.SocketDir, r.statusPath); err != nil {
				return fmt.Errorf("--socket-dir %s: %w", cfg.SocketDir, err)
			}
			return nil
		})
	}
	if cfg.Listen != "" {
		lis, err := net.Listen("tcp", cfg.Listen)
		if err != nil {
			return fmt.Errorf("--listen: %w", err)
		}
		// Front-end callers are orchestrators and tools with a client
		// identity (or the broker's own); never a driver's proxy.
		g.Go(func() error {
			return b.ServeTCP(ctx, lis, mtls.ServerConfig(r.src, mtls.AuthorizeFrontEndCaller(cfg.TLS.TrustDomain)))
		})
	}
	if r.statusPath != "" {
		g.Go(func() error {
			return serveStatus(ctx, r.statusPath, &broker.StatusServer{B: b, Version: version, Leader: r.leader, DriverLeaders: r.driverLeaders})
		})
	}
	if cfg.HTTPEndpoint != "" {
		mux := http.NewServeMux()
		mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
		mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
			if err := r.ready(); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
			fmt.Fprintln(w, "ok")
		})
		mux.Handle(cfg.MetricsPath, promhttp.HandlerFor(r.promReg, promhttp.HandlerOpts{EnableOpenMetrics: true}))
		g.Go(func() error { return serveHTTP(ctx, cfg.HTTPEndpoint, mux, r.log) })
	}
	return nil
}

func serveStatus(ctx context.Context, path string, s *broker.StatusServer) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("status socket (--status-socket, or under --socket-dir): %w", err)
	}
	_ = os.Remove(path)
	lis, err := net.Listen("unix", path)
	if err != nil {
		return fmt.Errorf("status socket (--status-socket, or under --socket-dir): %w", err)
	}
	defer os.Remove(path)
	srv := grpc.NewServer(grpcsrv.ServerOptions(grpcsrv.Limits{})...)
	brokerstatusv1.RegisterBrokerStatusServer(srv, s)
	go func() { <-ctx.Done(); srv.GracefulStop() }()
	return srv.Serve(lis)
}
