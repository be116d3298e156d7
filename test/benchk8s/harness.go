package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"

	snapshotclient "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	"k8s.io/client-go/kubernetes"

	"github.com/csibroker/csibroker/internal/testenv"
)

// Harness owns the work directory, the binaries, the children and the
// control plane of the current scenario.
type Harness struct {
	cfg    Config
	out    io.Writer // the report (Markdown)
	errw   io.Writer // progress
	work   string
	procs  procs
	bins   binaries
	report *report

	// Set while a scenario's control plane runs.
	env    *testenv.Env
	client kubernetes.Interface // the harness's own fast client (user agent "benchk8s")
	audit  *auditLog
	sink   *otlpSink
	rev    string // the csibroker commit built
	args   []string

	// snaps is the harness's snapshot client (the snapshots scenario).
	snaps snapshotclient.Interface

	// Results, for the smoke test.
	provResults []*provResult
	snapResults []*snapResult
}

type binaries struct {
	csibroker, provisioner, attacher string
	// snapshotter and snapshotController are external-snapshotter's
	// csi-snapshotter and snapshot-controller (the snapshots scenario).
	snapshotter, snapshotController string
	// proxy is csibroker-proxy, the proxy built alone (what deploy/ runs
	// beside each driver); empty: `csibroker proxy` (a prebuilt csibroker
	// with no csibroker-proxy beside it).
	proxy string
	// csibrokerSyms keeps its symbol table, for perf (-perf only).
	csibrokerSyms string
	// minprov is test/benchk8s/minprov (-floor only).
	minprov string
}

func newHarness(cfg Config, out, errw io.Writer) (*Harness, error) {
	if cfg.Root == "" {
		root, err := findRoot()
		if err != nil {
			return nil, err
		}
		cfg.Root = root
	}
	work, err := os.MkdirTemp("", "csibroker-benchk8s-")
	if err != nil {
		return nil, err
	}
	h := &Harness{cfg: cfg, out: out, errw: errw, work: work, report: newReport()}
	h.procs.dir = work
	return h, nil
}

// findRoot walks up from the working directory to the csibroker module root.
func findRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		b, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && strings.Contains(string(b), "module github.com/csibroker/csibroker\n") {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("cannot find the csibroker repository root above the working directory (use -root)")
		}
		dir = parent
	}
}

func (h *Harness) logf(format string, args ...any) {
	fmt.Fprintf(h.errw, "benchk8s %s  "+format+"\n", append([]any{time.Now().Format("15:04:05")}, args...)...)
}

func (h *Harness) vlogf(format string, args ...any) {
	if h.cfg.Verbose {
		h.logf(format, args...)
	}
}

// killAll kills every child and the control plane (interrupt).
func (h *Harness) killAll() {
	h.procs.killAll()
}

// close stops everything still running and removes the work directory.
func (h *Harness) close() {
	h.procs.stopAll()
	h.stopCluster()
	if h.cfg.KeepLogs {
		h.logf("kept %s (process logs, audit logs)", h.work)
		return
	}
	_ = os.RemoveAll(h.work)
}

// build makes sure the control plane, the sidecars and csibroker are built.
func (h *Harness) build(ctx context.Context) error {
	t0 := time.Now()
	if !h.cfg.SkipBuild {
		for _, script := range []string{"hack/control-plane.sh", "hack/sidecars.sh"} {
			h.logf("%s build", script)
			cmd := exec.CommandContext(ctx, filepath.Join(h.cfg.Root, script), "build")
			cmd.Dir = h.cfg.Root
			cmd.Stdout, cmd.Stderr = h.errw, h.errw
			// On ctx's end the whole build goes (the script's go builds
			// too, which would otherwise keep the output pipe, and Wait,
			// open until they finish).
			cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
			cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
			cmd.WaitDelay = 10 * time.Second
			if err := cmd.Run(); err != nil {
				return fmt.Errorf("%s build: %w", script, err)
			}
		}
	}
	sidecars := map[string]*string{"csi-provisioner": &h.bins.provisioner, "csi-attacher": &h.bins.attacher}
	if h.cfg.has("snapshots") {
		sidecars["csi-snapshotter"], sidecars["snapshot-controller"] = &h.bins.snapshotter, &h.bins.snapshotController
	}
	for name, dst := range sidecars {
		out, err := exec.CommandContext(ctx, filepath.Join(h.cfg.Root, "hack/sidecars.sh"), "dir", name).Output()
		if err != nil {
			return fmt.Errorf("hack/sidecars.sh dir %s: %w", name, err)
		}
		*dst = filepath.Join(strings.TrimSpace(string(out)), name)
		if _, err := os.Stat(*dst); err != nil {
			return fmt.Errorf("%s not built (run hack/sidecars.sh): %w", name, err)
		}
	}
	h.bins.csibroker = h.cfg.CSIBrokerBin
	if h.bins.csibroker == "" {
		bin, err := h.buildCSIBroker(ctx, true)
		if err != nil {
			return err
		}
		h.bins.csibroker = bin
		if h.cfg.Perf {
			if h.bins.csibrokerSyms, err = h.buildCSIBroker(ctx, false); err != nil {
				return err
			}
		}
	} else {
		h.rev = "prebuilt " + h.bins.csibroker
		h.bins.csibrokerSyms = h.bins.csibroker
	}
	if p := filepath.Join(filepath.Dir(h.bins.csibroker), "csibroker-proxy"); fileExists(p) {
		h.bins.proxy = p
	}
	if h.cfg.Floor {
		h.bins.minprov = filepath.Join(h.work, "minprov")
		h.logf("go build ./test/benchk8s/minprov (working tree)")
		cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags", "-s -w", "-o", h.bins.minprov, "./test/benchk8s/minprov")
		cmd.Dir = h.cfg.Root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOWORK=off")
		cmd.Stdout, cmd.Stderr = h.errw, h.errw
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("go build ./test/benchk8s/minprov: %w", err)
		}
	}
	h.logf("binaries ready in %s", time.Since(t0).Round(time.Second))
	return nil
}

// buildCSIBroker builds the csibroker binary into the work directory (never
// into bin/, which other builds on the machine may replace mid-run): from the
// committed HEAD by default, so the figures belong to a commit, or from the
// working tree with -from-head=false. Stripped (-s -w) like the sidecars'
// builds, which matters a little for RSS (about 2 MiB of file-backed pages
// per process); -perf also builds a copy with its symbol table.
func (h *Harness) buildCSIBroker(ctx context.Context, strip bool) (string, error) {
	src := h.cfg.Root
	if h.cfg.FromHead {
		src = filepath.Join(h.work, "src")
	}
	if h.rev == "" { // first build of this run: pin the sources
		rev, _ := exec.CommandContext(ctx, "git", "-C", h.cfg.Root, "rev-parse", "--short", "HEAD").Output()
		h.rev = strings.TrimSpace(string(rev))
		if !h.cfg.FromHead {
			h.rev += " + working tree"
		} else {
			if err := os.MkdirAll(src, 0o755); err != nil {
				return "", err
			}
			tarball := filepath.Join(h.work, "src.tar")
			if out, err := exec.CommandContext(ctx, "git", "-C", h.cfg.Root, "archive", "--format=tar", "-o", tarball, "HEAD").CombinedOutput(); err != nil {
				return "", fmt.Errorf("git archive HEAD: %v: %s", err, out)
			}
			if out, err := exec.CommandContext(ctx, "tar", "-xf", tarball, "-C", src).CombinedOutput(); err != nil {
				return "", fmt.Errorf("untar HEAD: %v: %s", err, out)
			}
		}
	}
	bin, ldflags := filepath.Join(h.work, "csibroker"), "-s -w "
	if !strip {
		bin, ldflags = filepath.Join(h.work, "csibroker-symbols"), ""
	}
	ldflags += "-X main.version=bench-" + strings.Fields(h.rev + " x")[0]
	h.logf("go build ./cmd/csibroker (%s, %s)", h.rev, map[bool]string{true: "stripped", false: "with symbols"}[strip])
	builds := [][2]string{{bin, "./cmd/csibroker"}}
	if strip {
		builds = append(builds, [2]string{filepath.Join(h.work, "csibroker-proxy"), "./cmd/csibroker-proxy"})
	}
	for _, b := range builds {
		cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags", ldflags, "-o", b[0], b[1])
		cmd.Dir = src
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOWORK=off")
		cmd.Stdout, cmd.Stderr = h.errw, h.errw
		if err := cmd.Run(); err != nil {
			return "", fmt.Errorf("go build %s: %w", b[1], err)
		}
	}
	return bin, nil
}

// startCluster starts a fresh control plane for one scenario:
// kube-controller-manager at a high client QPS (the PV binder must never be
// the limit), and an apiserver audit log (Metadata level) from which API
// requests are counted per client by user agent.
func (h *Harness) startCluster(ctx context.Context, scenario string) error {
	return h.startClusterKCM(ctx, scenario, rate{2000, 4000})
}

// startClusterKCM is startCluster with kube-controller-manager's client
// QPS/burst (the manydrivers scenario sets it; its audit log is named after
// scenario, so give each control plane of a run its own name).
func (h *Harness) startClusterKCM(ctx context.Context, scenario string, kcm rate) error {
	policy := filepath.Join(h.work, "audit-policy.yaml")
	if err := os.WriteFile(policy, []byte(auditPolicy), 0o600); err != nil {
		return err
	}
	auditPath := filepath.Join(h.work, "audit-"+scenario+".log")
	sink, err := startOTLPSink()
	if err != nil {
		return err
	}
	h.sink = sink
	env, err := testenv.Start(ctx, testenv.Options{
		ControllerManager: true,
		KubeAPIQPS:        float32(kcm.QPS),
		KubeAPIBurst:      kcm.Burst,
		APIServerFlags: []string{
			"--audit-policy-file=" + policy,
			"--audit-log-path=" + auditPath,
			"--audit-log-format=json",
			"--audit-log-mode=blocking",
			"--audit-log-maxsize=0",
		},
		Logf: func(format string, args ...any) { h.vlogf(format, args...) },
	})
	if err != nil {
		return err
	}
	h.env = env
	cfg := env.RESTConfig()
	cfg.QPS, cfg.Burst = 2000, 4000
	cfg.UserAgent = "benchk8s"
	h.client, err = kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	h.audit = &auditLog{path: auditPath}
	h.logf("control plane up for %q (kube-controller-manager QPS %s, audit log %s)", scenario, kcm, auditPath)
	return h.setupCluster(ctx)
}

func (h *Harness) stopCluster() {
	if h.env != nil {
		h.env.Stop()
		h.env = nil
	}
	if h.sink != nil {
		h.sink.close()
		h.sink = nil
	}
}

func (h *Harness) runScenarios(ctx context.Context) error {
	h.report.header(h)
	type scenario struct {
		name string
		run  func(context.Context) error
	}
	for _, s := range []scenario{
		{"provision", h.scenarioProvision},
		{"drivers", h.scenarioDrivers},
		{"memory", h.scenarioMemory},
		{"failover", h.scenarioFailover},
		{"snapshots", h.scenarioSnapshots},
		{"manydrivers", h.scenarioManyDrivers},
		{"neighbour", h.scenarioNeighbour},
		{"latency", h.scenarioLatency},
		{"replicas", h.scenarioReplicas},
	} {
		if !h.cfg.has(s.name) {
			continue
		}
		t0 := time.Now()
		h.logf("=== scenario %s", s.name)
		if err := h.startCluster(ctx, s.name); err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
		err := s.run(ctx)
		h.procs.stopAll()
		h.stopCluster()
		if err != nil {
			h.report.flush(h.out)
			return fmt.Errorf("scenario %s: %w", s.name, err)
		}
		h.logf("=== scenario %s done in %s", s.name, time.Since(t0).Round(time.Second))
		h.report.flush(h.out)
	}
	if h.cfg.JSON != "" {
		b, err := json.MarshalIndent(h.report.runs, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(h.cfg.JSON, b, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// machine describes the host for the report header.
func machine() string {
	model := ""
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "model name" {
				model = strings.TrimSpace(v)
				break
			}
		}
	}
	mem := ""
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		if l, _, ok := strings.Cut(string(b), "\n"); ok {
			mem = strings.Join(strings.Fields(l)[1:], " ")
		}
	}
	return fmt.Sprintf("%d CPUs (%s), MemTotal %s, %s/%s, %s", runtime.NumCPU(), model, mem, runtime.GOOS, runtime.GOARCH, runtime.Version())
}

func fileExists(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular()
}
