package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strings"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/metric/noop"
	"google.golang.org/grpc"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/telemetry"
)

func init() {
	register("sample-driver", "run the sample CSI driver", runSampleDriver)
}

// sizeFlag is a byte count flag accepting Kubernetes quantity suffixes.
type sizeFlag struct{ v *int64 }

func (f sizeFlag) String() string {
	if f.v == nil {
		return ""
	}
	return fmt.Sprint(*f.v)
}

func (f sizeFlag) Set(s string) error {
	n, err := sampledriver.ParseSize(s)
	if err != nil {
		return err
	}
	*f.v = n
	return nil
}

// topologyFlag is a key=value,... flag.
type topologyFlag struct{ m *map[string]string }

func (f topologyFlag) String() string {
	if f.m == nil {
		return ""
	}
	return sampledriver.FormatTopology(*f.m)
}

func (f topologyFlag) Set(s string) error {
	m, err := sampledriver.ParseTopology(s)
	if err != nil {
		return err
	}
	*f.m = m
	return nil
}

// segmentsFlag is a repeatable key=value,... flag.
type segmentsFlag struct{ l *[]map[string]string }

func (f segmentsFlag) String() string {
	if f.l == nil {
		return ""
	}
	var out []string
	for _, m := range *f.l {
		out = append(out, sampledriver.FormatTopology(m))
	}
	return strings.Join(out, ";")
}

func (f segmentsFlag) Set(s string) error {
	m, err := sampledriver.ParseTopology(s)
	if err != nil {
		return err
	}
	*f.l = append(*f.l, m)
	return nil
}

// sampleDriverConfig parses the sample-driver flags into a Config.
func sampleDriverConfig(args []string, stderr io.Writer) (sampledriver.Config, error) {
	cfg := sampledriver.Config{
		Name:          sampledriver.DefaultName,
		CapacityBytes: sampledriver.DefaultCapacityBytes,
		Version:       version,
	}
	fs := flag.NewFlagSet("sample-driver", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&cfg.Endpoint, "endpoint", "unix:///var/lib/csibroker/sample/csi.sock", "CSI endpoint to listen on: unix:///path or unix:/path")
	fs.StringVar(&cfg.Name, "name", cfg.Name, "CSI driver name (GetPluginInfo)")
	fs.StringVar(&cfg.NodeID, "node-id", "", "this instance's node ID (required)")
	fs.StringVar(&cfg.StateDir, "state-dir", "", "directory for the state (state.json and its journal) and the volume directories (required)")
	fs.Var(segmentsFlag{&cfg.ControllerSegments}, "controller-segment", "a segment the controller can place volumes in, key=value[,...]; repeatable (a multi-zone storage system); default: --topology")
	fs.Var(topologyFlag{&cfg.Topology}, "topology", "accessible segment of this instance, key=value[,key=value...] (e.g. topology.kubernetes.io/zone=z1); empty: no topology")
	fs.Var(sizeFlag{&cfg.CapacityBytes}, "capacity", "total capacity of the pool, in bytes or with a suffix (Ki, Mi, Gi, Ti; k, M, G, T)")
	fs.Int64Var(&cfg.MaxVolumesPerNode, "max-volumes-per-node", 0, "volumes one node may have published (NodeGetInfo; 0: no limit)")
	nodes := fs.String("nodes", "", "other node IDs that ControllerPublishVolume accepts, comma-separated; * accepts any")
	fs.Var(&cfg.Faults, "fault", "inject a fault, Method=key:value,... with keys latency, rate, first, code, after, exit-after (e.g. CreateVolume=latency:50ms,rate:0.5,code:Unavailable); repeatable, Method * applies to all")
	fs.Int64Var(&cfg.Faults.ExitAfter, "exit-after", 0, fmt.Sprintf("exit with status %d once N calls (of any method) have been handled, before the Nth reply (0: never)", sampledriver.FaultExitCode))
	fs.Uint64Var(&cfg.Faults.Seed, "fault-seed", 0, "seed for fault rates (0: random)")
	fs.BoolVar(&cfg.DisablePublish, "disable-publish", false, "do not advertise PUBLISH_UNPUBLISH_VOLUME (no attach step)")
	fs.DurationVar(&cfg.SnapshotReadyAfter, "snapshot-ready-after", 0, "report a new snapshot not ready to use until this long after it was cut (0: ready at once)")
	fs.BoolVar(&cfg.DisableGroupSnapshots, "disable-group-snapshots", false, "do not serve the GroupController service (group snapshots)")
	verbosity := fs.Int("v", 0, "log verbosity: 0 lifecycle and failed calls, 1 also requests, 2 also responses")
	if err := parseFlags(fs, args); err != nil {
		return cfg, err
	}
	if *nodes != "" {
		for _, n := range strings.Split(*nodes, ",") {
			if n = strings.TrimSpace(n); n != "" {
				cfg.Nodes = append(cfg.Nodes, n)
			}
		}
	}
	level := slog.LevelInfo
	switch {
	case *verbosity >= 2:
		level = slog.LevelDebug - 4
	case *verbosity == 1:
		level = slog.LevelDebug
	}
	cfg.Logger = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	if err := cfg.Validate(); err != nil {
		return cfg, fmt.Errorf("sample-driver: %w: %w", err, errUsage)
	}
	return cfg, nil
}

func runSampleDriver(ctx context.Context, args []string, _, stderr io.Writer) error {
	cfg, err := sampleDriverConfig(args, stderr)
	if err != nil {
		return err
	}
	// Spans, configured by the standard OTEL_* variables as the broker's and
	// the proxy's are: a server span per call, child of the proxy's, with
	// a failed call's code but not its message.
	tp, err := telemetry.NewTracerProvider(ctx, "csibroker-sample-driver")
	if err != nil {
		return fmt.Errorf("tracing: %w", err)
	}
	defer telemetry.ShutdownTracing(ctx, tp, cfg.Logger)
	cfg.ServerOptions = append(cfg.ServerOptions, grpc.StatsHandler(telemetry.CodeOnly(otelgrpc.NewServerHandler(
		otelgrpc.WithTracerProvider(tp), otelgrpc.WithPropagators(telemetry.Propagator()),
		otelgrpc.WithMeterProvider(noop.NewMeterProvider())))))
	d, err := sampledriver.New(cfg)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}
