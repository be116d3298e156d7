package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"path"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"golang.org/x/sync/errgroup"

	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/telemetry"
	"github.com/csibroker/csibroker/proxy"
)

// ProxySummary is the proxy command's one-line description.
const ProxySummary = "expose one CSI driver socket to the broker over mTLS"

// ProxyCommandConfig holds the proxy subcommand's flags.
type ProxyCommandConfig struct {
	DriverEndpoint string
	Listen         string
	Node           string
	HTTPEndpoint   string
	MetricsPath    string
	// MaxConcurrentCalls bounds the calls the driver has at once.
	MaxConcurrentCalls int
	// ProbeTimeout bounds the proxy's own calls to the driver (the Probe
	// behind /healthz and /readyz, GetPluginInfo).
	ProbeTimeout time.Duration
	// KubeletRegistrationPath, set on a node proxy, registers the driver
	// with the kubelet; PluginRegistrationPath is the kubelet's plugin
	// registry as the proxy's container sees it.
	KubeletRegistrationPath string
	PluginRegistrationPath  string
	TLS                     TLSFlags
	Log                     LogFlags
}

// Validate checks the flags.
func (c *ProxyCommandConfig) Validate() error {
	var errs []error
	if c.DriverEndpoint == "" {
		errs = append(errs, errors.New("--driver-endpoint is required"))
	} else if _, _, err := telemetry.UnixTarget(c.DriverEndpoint); err != nil {
		errs = append(errs, fmt.Errorf("--driver-endpoint: %w", err))
	}
	if c.Listen == "" {
		errs = append(errs, errors.New("--listen is required"))
	}
	if c.ProbeTimeout <= 0 {
		errs = append(errs, fmt.Errorf("--probe-timeout must be positive, got %v", c.ProbeTimeout))
	}
	if c.KubeletRegistrationPath != "" {
		if c.Node == "" {
			errs = append(errs, errors.New("--kubelet-registration-path needs --node: only a node plugin registers with the kubelet"))
		}
		if !path.IsAbs(c.KubeletRegistrationPath) {
			errs = append(errs, fmt.Errorf("--kubelet-registration-path %q: want the driver socket's absolute path on the host", c.KubeletRegistrationPath))
		}
		if !path.IsAbs(c.PluginRegistrationPath) {
			errs = append(errs, fmt.Errorf("--plugin-registration-path %q: want an absolute path", c.PluginRegistrationPath))
		}
	}
	if c.MetricsPath == "/livez" || c.MetricsPath == "/healthz/driver" {
		errs = append(errs, fmt.Errorf("--metrics-path %q: taken by the proxy's health endpoint", c.MetricsPath))
	}
	if c.MaxConcurrentCalls < 1 {
		errs = append(errs, fmt.Errorf("--max-concurrent-calls must be at least 1, got %d", c.MaxConcurrentCalls))
	}
	errs = append(errs, ValidateMetricsPath(c.MetricsPath), c.TLS.Validate(), c.Log.Validate())
	return errors.Join(errs...)
}

// RunProxy parses the proxy's flags from args and serves until ctx is done.
// name is the flag set's name in usage messages; version is reported by the
// proxy's info API.
func RunProxy(ctx context.Context, name, version string, args []string, stderr io.Writer) error {
	cfg := ProxyCommandConfig{}
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&cfg.DriverEndpoint, "driver-endpoint", "", "the driver's CSI socket, unix:///path")
	fs.StringVar(&cfg.Listen, "listen", ":7443", "address of the mTLS listener the broker connects to")
	fs.StringVar(&cfg.Node, "node", "", "node name for a node plugin's proxy (its certificate must name it); empty for a controller proxy")
	fs.StringVar(&cfg.HTTPEndpoint, "http-endpoint", "", "address for /healthz, /healthz/driver, /livez, /readyz and metrics (empty: off)")
	fs.StringVar(&cfg.MetricsPath, "metrics-path", "/metrics", "path of the Prometheus metrics on --http-endpoint")
	fs.IntVar(&cfg.MaxConcurrentCalls, "max-concurrent-calls", proxy.DefaultMaxConcurrentCalls,
		"the most calls the driver is sent at once, over all broker connections (more wait for a slot within their deadline)")
	fs.DurationVar(&cfg.ProbeTimeout, "probe-timeout", proxy.DefaultProbeTimeout,
		"how long the driver has to answer the Probe behind /healthz and /readyz (and GetPluginInfo)")
	fs.StringVar(&cfg.KubeletRegistrationPath, "kubelet-registration-path", "",
		"the driver's socket path on the host, as the kubelet sees it: set on a node proxy, the proxy registers the driver with the kubelet (empty: off)")
	fs.StringVar(&cfg.PluginRegistrationPath, "plugin-registration-path", proxy.DefaultPluginRegistrationDir,
		"the kubelet's plugin registry directory, as the proxy sees it (with --kubelet-registration-path)")
	cfg.TLS.Register(fs)
	cfg.Log.Register(fs)
	if err := ParseFlags(fs, args); err != nil {
		return err
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	log := cfg.Log.Logger(stderr)
	src, err := cfg.TLS.Source(log)
	if err != nil {
		return err
	}
	tp, err := telemetry.NewTracerProvider(ctx, "csibroker-proxy")
	if err != nil {
		return fmt.Errorf("tracing: %w", err)
	}
	defer telemetry.ShutdownTracing(ctx, tp, log)
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), mtls.NewCollector(src))

	p, err := proxy.New(proxy.Config{
		DriverEndpoint:     cfg.DriverEndpoint,
		Node:               cfg.Node,
		Version:            version,
		MaxConcurrentCalls: cfg.MaxConcurrentCalls,
		ProbeTimeout:       cfg.ProbeTimeout,
		Identity:           src.Current().ID,

		KubeletRegistrationPath: cfg.KubeletRegistrationPath,
		PluginRegistrationDir:   cfg.PluginRegistrationPath,

		TLS:            mtls.ServerConfig(src, mtls.AuthorizeOneOf(mtls.BrokerID(cfg.TLS.TrustDomain))),
		Logger:         log,
		TracerProvider: tp,
		Registerer:     reg,
		Gatherer:       reg,
	})
	if err != nil {
		return err
	}
	defer p.Close()
	if err := checkOwnIdentity(src.Current().ID, cfg.TLS.TrustDomain, cfg.Node); err != nil {
		// Fatal, as the broker's own check is: the broker would refuse
		// this proxy at every handshake, and a reload keeps the identity
		// it started with, so only a restart (with corrected files) helps.
		return fmt.Errorf("proxy certificate (--tls-cert): %w", err)
	}
	lis, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("listen %s: %w", cfg.Listen, err)
	}
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { src.Run(ctx, cfg.TLS.ReloadInterval); return nil })
	g.Go(func() error { return p.Serve(ctx, lis) })
	g.Go(func() error { p.RunRegistration(ctx); return nil })
	if cfg.HTTPEndpoint != "" {
		g.Go(func() error { return ServeHTTP(ctx, cfg.HTTPEndpoint, p.HTTPHandler(cfg.MetricsPath), log) })
	}
	return g.Wait()
}

// checkOwnIdentity refuses a proxy certificate that is not a driver
// identity of this trust domain for this node: the broker would refuse it
// at every handshake.
func checkOwnIdentity(id, trustDomain, node string) error {
	parsed, err := mtls.ParseID(id)
	if err != nil {
		return err
	}
	if parsed.Role != mtls.RoleDriver {
		return fmt.Errorf("certificate identity %s is not a driver identity (spiffe://%s/csibroker/driver/<name>)", id, trustDomain)
	}
	if parsed.TrustDomain != trustDomain {
		return fmt.Errorf("certificate identity %s is not in trust domain %s", id, trustDomain)
	}
	if parsed.Node != node {
		return fmt.Errorf("certificate identity %s names node %q but --node is %q", id, parsed.Node, node)
	}
	return nil
}
