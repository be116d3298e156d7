package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Scenario names, in the order they run.
var allScenarios = []string{"provision", "drivers", "memory", "failover", "snapshots", "manydrivers", "neighbour", "latency", "replicas"}

// Config holds the harness's flags.
type Config struct {
	Scenarios []string
	Reps      int
	// SlowReps replaces Reps for provisioning settings below 50 QPS: a run
	// of 300 claims there takes about 3 minutes (paced by the client rate
	// limiter on both sides, so runs hardly vary).
	SlowReps int

	// provision
	N   []int  // claims per run
	QPS []rate // client rate limits of the provisioners

	// drivers
	Drivers         int
	ClaimsPerDriver int
	Attach          bool     // also one external-attacher per driver, and a VolumeAttachment on each volume
	BrokerFlags     []string // extra broker flags (e.g. the one that turns on attach/detach)

	// memory
	MemLevels []int

	// failover
	FailoverClaims int
	FailoverQPS    rate

	// snapshots (at each of QPS)
	SnapshotN     int
	SnapshotSides []string // sideSidecar and/or sideBroker
	// manydrivers, neighbour and latency (issue 35): see issue35.go.
	ManyDrivers     []int         // driver counts
	ManySettings    []manySetting // claims per driver, each with kube-controller-manager's client rate
	NeighbourClaims int           // driver A's pending claims
	NeighbourProbes int           // driver B's claims, one after another, in each condition
	NeighbourModes  []string      // what driver A does: busy, hang, garbage
	LatencyClaims   int           // claims created one after another, each once the previous is Bound
	// ReplicasCfg sizes the replicas scenario (issue 35): see replicas.go.
	ReplicasCfg ReplicasConfig

	WorkerThreads int
	PolicyMode    string // csibroker --policy-mode
	Tracing       bool   // export csibroker's spans over OTLP/HTTP to a sink in the harness

	Root         string // repository root (default: found from the working directory)
	CSIBrokerBin string // a prebuilt csibroker binary (default: go build into the work directory)
	FromHead     bool   // build csibroker from the committed HEAD, not the working tree
	SkipBuild    bool   // do not run hack/control-plane.sh and hack/sidecars.sh
	KeepLogs     bool   // keep the work directory (process logs, audit log)
	JSON         string // also write every run's figures to this file
	Verbose      bool
	Perf         bool // after each provisioning setting, one more csibroker run under perf (not counted)
	// Floor adds a third side to each provisioning repetition: minprov,
	// the least a client-go provisioner making external-provisioner's API
	// calls spends.
	Floor bool
}

// rate is a client-go QPS/burst pair written "5/10".
type rate struct {
	QPS   float64
	Burst int
}

func (r rate) String() string {
	return strconv.FormatFloat(r.QPS, 'f', -1, 64) + "/" + strconv.Itoa(r.Burst)
}

func parseRate(s string) (rate, error) {
	q, b, ok := strings.Cut(strings.TrimSpace(s), "/")
	if !ok {
		return rate{}, fmt.Errorf("rate %q: want QPS/BURST, e.g. 5/10", s)
	}
	qps, err := strconv.ParseFloat(q, 64)
	if err != nil || qps <= 0 {
		return rate{}, fmt.Errorf("rate %q: bad QPS", s)
	}
	burst, err := strconv.Atoi(b)
	if err != nil || burst <= 0 {
		return rate{}, fmt.Errorf("rate %q: bad burst", s)
	}
	return rate{qps, burst}, nil
}

// DefaultConfig is the default mode of make bench-k8s: every scenario, three
// repetitions each (issue 8), N = 300, about 30 minutes on a 2-core machine
// (-slow-reps 1 runs the QPS 5/10 setting once: about 17).
func DefaultConfig() Config {
	return Config{
		Scenarios:       slices.Clone(allScenarios),
		Reps:            3,
		SlowReps:        0,
		N:               []int{300},
		QPS:             []rate{{5, 10}, {200, 400}},
		Drivers:         5,
		ClaimsPerDriver: 20,
		MemLevels:       []int{0, 1000, 10000},
		FailoverClaims:  100,
		FailoverQPS:     rate{5, 10},
		SnapshotN:       300,
		SnapshotSides:   []string{sideSidecar, sideBroker},
		ManyDrivers:     []int{5, 20},
		ManySettings:    []manySetting{{200, rate{200, 400}}, {20, rate{20, 30}}},
		NeighbourClaims: 1000,
		NeighbourProbes: 5,
		NeighbourModes:  slices.Clone(neighbourModes),
		LatencyClaims:   50,
		ReplicasCfg:     defaultReplicasConfig(),
		WorkerThreads:   100,
		PolicyMode:      "enforce",
		Tracing:         true,
		FromHead:        true,
		Attach:          true,
	}
}

// Validate checks the configuration.
func (c Config) Validate() error {
	var errs []error
	for _, s := range c.Scenarios {
		if !slices.Contains(allScenarios, s) {
			errs = append(errs, fmt.Errorf("-scenarios: unknown %q (want some of %s)", s, strings.Join(allScenarios, ",")))
		}
	}
	if c.Reps < 1 || c.SlowReps < 0 {
		errs = append(errs, errors.New("-reps must be at least 1 and -slow-reps not negative"))
	}
	for _, n := range c.N {
		if n < 1 {
			errs = append(errs, errors.New("-n: every N must be positive"))
		}
	}
	if c.Drivers < 1 || c.ClaimsPerDriver < 1 {
		errs = append(errs, errors.New("-drivers and -claims-per-driver must be positive"))
	}
	if len(c.MemLevels) == 0 || c.MemLevels[0] != 0 || !slices.IsSorted(c.MemLevels) {
		errs = append(errs, errors.New("-mem-levels must start at 0 and increase"))
	}
	if c.FailoverClaims < 10 {
		errs = append(errs, errors.New("-failover-claims must be at least 10"))
	}
	if c.SnapshotN < 1 {
		errs = append(errs, errors.New("-snapshot-n must be positive"))
	}
	for _, s := range c.SnapshotSides {
		if s != sideSidecar && s != sideBroker {
			errs = append(errs, fmt.Errorf("-snapshot-sides: unknown %q (want csi-snapshotter and/or csibroker)", s))
		}
	}
	if len(c.SnapshotSides) == 0 {
		errs = append(errs, errors.New("-snapshot-sides: name at least one side"))
	}
	if c.WorkerThreads < 1 {
		errs = append(errs, errors.New("-worker-threads must be positive"))
	}
	errs = append(errs, c.validateIssue35()...)
	if c.has("replicas") {
		errs = append(errs, c.ReplicasCfg.validate()...)
	}
	return errors.Join(errs...)
}

func (c Config) has(scenario string) bool { return slices.Contains(c.Scenarios, scenario) }

// snapshotSide says whether the snapshots scenario runs side.
func (c Config) snapshotSide(side string) bool { return slices.Contains(c.SnapshotSides, side) }

// repsFor returns the repetitions of a provisioning setting.
func (c Config) repsFor(q rate) int {
	if q.QPS < 50 && c.SlowReps > 0 {
		return c.SlowReps
	}
	return c.Reps
}

func parseFlags(args []string, stderr io.Writer) (Config, error) {
	cfg := DefaultConfig()
	fs := flag.NewFlagSet("benchk8s", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Func("scenarios", "comma-separated scenarios to run: "+strings.Join(allScenarios, ",")+" (default all)", func(s string) error {
		cfg.Scenarios = splitList(s)
		return nil
	})
	fs.IntVar(&cfg.Reps, "reps", cfg.Reps, "repetitions of each measurement, sidecar and csibroker alternately")
	fs.IntVar(&cfg.SlowReps, "slow-reps", cfg.SlowReps, "provision: repetitions of settings below 50 QPS (about 3 min per run at N=300, QPS 5); 0: -reps")
	fs.Func("n", "provision: claims per run, comma-separated (default 300; 300,1000 adds the slow N=1,000)", func(s string) error {
		v, err := parseInts(s)
		cfg.N = v
		return err
	})
	fs.Func("qps", "provision: client QPS/burst settings, comma-separated (default 5/10,200/400)", func(s string) error {
		cfg.QPS = nil
		for _, p := range splitList(s) {
			r, err := parseRate(p)
			if err != nil {
				return err
			}
			cfg.QPS = append(cfg.QPS, r)
		}
		return nil
	})
	fs.IntVar(&cfg.Drivers, "drivers", cfg.Drivers, "drivers: how many drivers")
	fs.IntVar(&cfg.ClaimsPerDriver, "claims-per-driver", cfg.ClaimsPerDriver, "drivers: claims bound on each driver")
	fs.BoolVar(&cfg.Attach, "attach", cfg.Attach, "drivers: also run one external-attacher per driver and attach every volume to a node (VolumeAttachments); "+
		"-attach=false: provisioners only")
	fs.Func("broker-flags", "extra csibroker broker flags, space-separated (every scenario)", func(s string) error {
		cfg.BrokerFlags = strings.Fields(s)
		return nil
	})
	fs.Func("mem-levels", "memory: pre-bound PV/PVC pairs at each step, comma-separated (default 0,1000,10000)", func(s string) error {
		v, err := parseInts(s)
		cfg.MemLevels = v
		return err
	})
	fs.IntVar(&cfg.FailoverClaims, "failover-claims", cfg.FailoverClaims, "failover: claims pending when the leader is killed")
	fs.Func("failover-qps", "failover: client QPS/burst (default 5/10)", func(s string) error {
		r, err := parseRate(s)
		cfg.FailoverQPS = r
		return err
	})
	fs.IntVar(&cfg.SnapshotN, "snapshot-n", cfg.SnapshotN, "snapshots: VolumeSnapshots per run (at each -qps setting)")
	fs.Func("snapshot-sides", "snapshots: the sides to run, comma-separated: csi-snapshotter,csibroker (default both)", func(s string) error {
		cfg.SnapshotSides = nil
		for _, p := range splitList(s) {
			switch p {
			case "csi-snapshotter":
				cfg.SnapshotSides = append(cfg.SnapshotSides, sideSidecar)
			case "csibroker":
				cfg.SnapshotSides = append(cfg.SnapshotSides, sideBroker)
			default:
				return fmt.Errorf("unknown side %q (want csi-snapshotter, csibroker)", p)
			}
		}
		return nil
	})
	registerIssue35Flags(fs, &cfg)
	registerReplicasFlags(fs, &cfg.ReplicasCfg)
	fs.IntVar(&cfg.WorkerThreads, "worker-threads", cfg.WorkerThreads, "--worker-threads of both provisioners (and snapshotters)")
	fs.StringVar(&cfg.PolicyMode, "policy-mode", cfg.PolicyMode, "csibroker --policy-mode (enforce also installs the SecretGrant CRD)")
	fs.BoolVar(&cfg.Tracing, "tracing", cfg.Tracing, "csibroker exports its spans over OTLP/HTTP to a sink in the harness")
	fs.StringVar(&cfg.Root, "root", "", "repository root (default: found from the working directory)")
	fs.StringVar(&cfg.CSIBrokerBin, "csibroker-bin", "", "use this csibroker binary instead of building one")
	fs.BoolVar(&cfg.FromHead, "from-head", cfg.FromHead, "build csibroker from the committed HEAD (git archive), not the working tree")
	fs.BoolVar(&cfg.SkipBuild, "skip-build", false, "do not run hack/control-plane.sh and hack/sidecars.sh (the binaries must be in the cache)")
	fs.BoolVar(&cfg.KeepLogs, "keep", false, "keep the work directory (every process's log, the apiserver audit log)")
	fs.StringVar(&cfg.JSON, "json", "", "also write every run's figures to this JSON file")
	fs.BoolVar(&cfg.Verbose, "v", false, "more progress lines")
	fs.BoolVar(&cfg.Perf, "perf", false, "provision: after the measured runs of each setting, one more csibroker run (not counted) under perf record; the report gets its hottest functions")
	fs.BoolVar(&cfg.Floor, "floor", false, "provision: a third side in each repetition, test/benchk8s/minprov (the same watches, PV create and Events as external-provisioner through client-go, no CSI call): "+
		"the CPU per volume any client-go provisioner making those calls spends")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	return cfg, cfg.Validate()
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

func parseInts(s string) ([]int, error) {
	var out []int
	for _, p := range splitList(s) {
		v, err := strconv.Atoi(strings.ReplaceAll(p, "_", ""))
		if err != nil {
			return nil, fmt.Errorf("%q: not an integer", p)
		}
		out = append(out, v)
	}
	return out, nil
}

// timeoutFor bounds a wait for n operations at q QPS: generous (a loaded
// machine), never unbounded.
func timeoutFor(n int, qps float64, perOp float64) time.Duration {
	d := time.Duration(float64(n)*perOp/qps*float64(time.Second)) * 4
	return max(d, 90*time.Second)
}
