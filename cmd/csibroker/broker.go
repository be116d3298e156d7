package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"

	"github.com/csibroker/csibroker/broker"
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
		return err
	}
	cfg.Kube.noteGiven(fs)
	if err := cfg.Validate(); err != nil {
		return err
	}
	log := cfg.Log.Logger(stderr)
	kubeOn, _ := cfg.Kube.enabled()
	var err error
	reg := &broker.RegistryConfig{}
	if cfg.RegistryFile != "" {
		if reg, err = broker.LoadRegistryConfig(cfg.RegistryFile); err != nil {
			return err
		}
	}
	// The sockets, checked before anything is set up.
	sockets := map[string]string{}
	if cfg.SocketDir != "" {
		for _, d := range reg.Drivers {
			sockets[d.Name] = filepath.Join(cfg.SocketDir, d.Name+".sock")
		}
	}
	statusPath := cfg.StatusSocket
	if statusPath == "" && cfg.SocketDir != "" {
		statusPath = filepath.Join(cfg.SocketDir, "csibroker-status.sock")
	}
	absPath := func(p string) string {
		if a, err := filepath.Abs(p); err == nil {
			return a
		}
		return filepath.Clean(p)
	}
	for name, path := range sockets {
		if statusPath != "" && absPath(path) == absPath(statusPath) {
			// Each server would remove the other's socket file.
			return fmt.Errorf("driver %s's front-end socket %s is the status socket: set --status-socket to another path", name, path)
		}
	}
	src, err := cfg.TLS.Source(log)
	if err != nil {
		return err
	}
	if id, err := mtls.ParseID(src.Current().ID); err != nil || id.Role != mtls.RoleBroker || id.TrustDomain != cfg.TLS.TrustDomain {
		return fmt.Errorf("--tls-cert: identity %s is not %s (the broker's identity in --trust-domain %s): proxies would refuse it", src.Current().ID, mtls.BrokerID(cfg.TLS.TrustDomain), cfg.TLS.TrustDomain)
	}
	tp, err := telemetry.NewTracerProvider(ctx, "csibroker-broker")
	if err != nil {
		return fmt.Errorf("tracing: %w", err)
	}
	defer telemetry.ShutdownTracing(ctx, tp, log)
	promReg := prometheus.NewRegistry()
	promReg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	b, err := broker.New(broker.Options{TrustDomain: cfg.TLS.TrustDomain, TLS: src, Logger: log, TracerProvider: tp, Registerer: promReg})
	if err != nil {
		return err
	}
	defer b.Close()
	for _, d := range reg.Drivers {
		if d.Timeout == 0 {
			d.Timeout = cfg.Timeout
		}
		d.Retry = cfg.fillRetry(d.Retry)
		if err := b.SetDriver(d); err != nil {
			return err
		}
	}

	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { src.Run(ctx, cfg.TLS.ReloadInterval); return nil })
	var leader func() (bool, string)
	ready := func() error { return nil }
	if kubeOn {
		authz, store, err := cfg.Kube.authorizer(log)
		if err != nil {
			return err
		}
		if ca := cfg.Kube.policyCA; ca != nil {
			g.Go(func() error { ca.Run(ctx, cfg.TLS.ReloadInterval); return nil })
		}
		bridge, restCfg, err := cfg.Kube.bridge(b, authz, cfg.Timeout, log, tp, promReg)
		if err != nil {
			return err
		}
		leader, ready = bridge.Leader, bridge.Ready
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
		if cfg.Kube.DiscoverProxies != "" {
			var static []string
			for _, d := range reg.Drivers {
				static = append(static, d.Name)
			}
			template := broker.DriverConfig{Timeout: cfg.Timeout, Retry: cfg.fillRetry(broker.RetryConfig{})}
			disc, err := discovery.New(bridge.InformerClient(), cfg.Kube.DiscoverProxies, cfg.Kube.discoverNamespaces(), b, template, static, log)
			if err != nil {
				return err
			}
			disc.ReportTo(bridge.Recorder(), func() bool { leading, _ := bridge.Leader(); return leading })
			g.Go(func() error { return disc.Run(ctx) })
		}
		if w := cfg.Kube.policyFile; w != nil {
			g.Go(func() error { w.Run(ctx, store); return nil })
		}
	}
	if cfg.SocketDir != "" {
		// Every driver's, those discovery finds included, as they come
		// and go.
		g.Go(func() error {
			if err := b.ServeSocketDir(ctx, cfg.SocketDir, statusPath); err != nil {
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
			return b.ServeTCP(ctx, lis, mtls.ServerConfig(src, mtls.AuthorizeFrontEndCaller(cfg.TLS.TrustDomain)))
		})
	}
	if statusPath != "" {
		g.Go(func() error {
			return serveStatus(ctx, statusPath, &broker.StatusServer{B: b, Version: version, Leader: leader})
		})
	}
	if cfg.HTTPEndpoint != "" {
		mux := http.NewServeMux()
		mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
		mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
			if err := ready(); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
			fmt.Fprintln(w, "ok")
		})
		mux.Handle(cfg.MetricsPath, promhttp.HandlerFor(promReg, promhttp.HandlerOpts{}))
		g.Go(func() error { return serveHTTP(ctx, cfg.HTTPEndpoint, mux, log) })
	}
	return g.Wait()
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
	srv := grpc.NewServer()
	brokerstatusv1.RegisterBrokerStatusServer(srv, s)
	go func() { <-ctx.Done(); srv.GracefulStop() }()
	return srv.Serve(lis)
}
