package testenv

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"
)

// Process is a program started against an Env's cluster besides its
// control plane (snapshot-controller, csi-snapshotter). Its output goes to
// <Env.Dir>/<Name>.log; Stop, the test's cleanup and the Env's Stop end it
// by its process group.
type Process struct {
	// Name is its log's name in the Env's directory, e.g. csi-snapshotter-2.
	Name string
	// MetricsURL is its Prometheus endpoint, http://127.0.0.1:<port>/metrics.
	MetricsURL string

	c        *component
	stopOnce sync.Once
}

// Pid is the process ID (the leader of its process group).
func (p *Process) Pid() int { return p.c.cmd.Process.Pid }

// LogPath is the file its standard output and error go to.
func (p *Process) LogPath() string { return p.c.logPath }

// LogTail returns the last n lines of its log.
func (p *Process) LogTail(n int) string { return p.c.tail(n) }

// Exited reports whether it has ended, and how.
func (p *Process) Exited() (bool, error) { return p.c.exited() }

// Stop sends SIGTERM to its process group, SIGKILL after 5s, and waits
// until it is reaped. It is idempotent.
func (p *Process) Stop() { p.stopOnce.Do(func() { p.c.stop(5 * time.Second) }) }

// SnapshotControllerOptions configures snapshot-controller.
type SnapshotControllerOptions struct {
	// GroupSnapshots turns on the CSIVolumeGroupSnapshot feature gate
	// (GA and on by default in v8.7.0; here off unless asked, so that a
	// run without group snapshots holds no watches on them).
	GroupSnapshots bool
	// KubeAPIQPS and KubeAPIBurst are its client rate limits (0: the
	// Env's, 500 and 1000 by default; the binary's own default is 5 and 10).
	KubeAPIQPS   float64
	KubeAPIBurst int
	// Flags are appended to its command line.
	Flags []string
	// Bin is the binary (default: hack/sidecars.sh's build of SnapshotterVersion).
	Bin string
	// StartTimeout bounds the wait for its metrics endpoint (default 30s).
	StartTimeout time.Duration
}

// SnapshotterOptions configures a csi-snapshotter sidecar for one driver.
type SnapshotterOptions struct {
	// CSIAddress is the driver's socket, unix:///path (required).
	CSIAddress string
	// GroupSnapshots turns on the CSIVolumeGroupSnapshot feature gate.
	GroupSnapshots bool
	// ExtraCreateMetadata passes --extra-create-metadata.
	ExtraCreateMetadata bool
	// Timeout is --timeout, the bound of each CSI call (0: the binary's 1m).
	Timeout time.Duration
	// KubeAPIQPS and KubeAPIBurst as for SnapshotControllerOptions.
	KubeAPIQPS   float64
	KubeAPIBurst int
	// Flags are appended to its command line.
	Flags []string
	// Bin is the binary (default: hack/sidecars.sh's build of SnapshotterVersion).
	Bin string
	// StartTimeout bounds the wait for its metrics endpoint (default 30s).
	StartTimeout time.Duration
}

// RunSnapshotController starts the real snapshot-controller against the
// cluster and returns once it serves its metrics endpoint (it has found
// the CRDs by then: install them first with InstallSnapshotCRDs). Only one
// may run on a cluster at a time: two would both handle every snapshot.
func (e *Env) RunSnapshotController(ctx context.Context, o SnapshotControllerOptions) (*Process, error) {
	if err := e.checkOneController(); err != nil {
		return nil, err
	}
	bin, err := binOr(o.Bin, "snapshot-controller")
	if err != nil {
		return nil, err
	}
	args := append(e.clientFlags(o.KubeAPIQPS, o.KubeAPIBurst), "--feature-gates=CSIVolumeGroupSnapshot="+strconv.FormatBool(o.GroupSnapshots))
	return e.runExtra(ctx, "snapshot-controller", bin, append(args, o.Flags...), o.StartTimeout)
}

// RunSnapshotter starts the real csi-snapshotter sidecar for the driver
// at o.CSIAddress and returns once it serves its metrics endpoint (it has
// reached the driver by then).
func (e *Env) RunSnapshotter(ctx context.Context, o SnapshotterOptions) (*Process, error) {
	if o.CSIAddress == "" {
		return nil, errors.New("testenv: csi-snapshotter needs the driver's CSIAddress")
	}
	bin, err := binOr(o.Bin, "csi-snapshotter")
	if err != nil {
		return nil, err
	}
	args := append(e.clientFlags(o.KubeAPIQPS, o.KubeAPIBurst),
		"--csi-address="+o.CSIAddress,
		"--feature-gates=CSIVolumeGroupSnapshot="+strconv.FormatBool(o.GroupSnapshots))
	if o.ExtraCreateMetadata {
		args = append(args, "--extra-create-metadata")
	}
	if o.Timeout > 0 {
		args = append(args, "--timeout="+o.Timeout.String())
	}
	return e.runExtra(ctx, "csi-snapshotter", bin, append(args, o.Flags...), o.StartTimeout)
}

// StartSnapshotController is RunSnapshotController for a test: it fails
// the test when the controller cannot start and stops it at cleanup.
func (e *Env) StartSnapshotController(t testing.TB, o SnapshotControllerOptions) *Process {
	t.Helper()
	p, err := e.RunSnapshotController(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stopLogging(t, p) })
	return p
}

// StartSnapshotter is RunSnapshotter for a test, as StartSnapshotController.
func (e *Env) StartSnapshotter(t testing.TB, o SnapshotterOptions) *Process {
	t.Helper()
	p, err := e.RunSnapshotter(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stopLogging(t, p) })
	return p
}

// stopLogging stops p, first logging its log's tail if the test failed.
func stopLogging(t testing.TB, p *Process) {
	if t.Failed() {
		t.Logf("testenv: %s at the failure (last 30 lines):\n%s", p.Name, p.LogTail(30))
	}
	p.Stop()
}

func binOr(bin, name string) (string, error) {
	if bin != "" {
		return bin, nil
	}
	return sidecarBin(name, SnapshotterVersion)
}

// clientFlags are the kubeconfig and rate-limit flags both binaries share.
func (e *Env) clientFlags(qps float64, burst int) []string {
	if qps == 0 {
		qps = float64(e.opts.KubeAPIQPS)
	}
	if burst == 0 {
		burst = e.opts.KubeAPIBurst
	}
	return []string{
		"--kubeconfig=" + e.Kubeconfig,
		"--kube-api-qps=" + strconv.FormatFloat(qps, 'f', -1, 64),
		"--kube-api-burst=" + strconv.Itoa(burst),
		"--v=4",
	}
}

// checkOneController fails when a snapshot-controller is running already.
func (e *Env) checkOneController() error {
	e.extraMu.Lock()
	defer e.extraMu.Unlock()
	for _, c := range e.extra {
		if done, _ := c.exited(); !done && c.kind == "snapshot-controller" {
			return fmt.Errorf("testenv: a snapshot-controller (%s) runs on this cluster already; stop it first", c.name)
		}
	}
	return nil
}

// runExtra starts bin with an HTTP endpoint on a free port and waits until
// it serves /metrics; a port taken meanwhile is retried with another.
func (e *Env) runExtra(ctx context.Context, kind, bin string, args []string, timeout time.Duration) (*Process, error) {
	if timeout == 0 {
		timeout = 30 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for attempt := 1; ; attempt++ {
		p, err := e.startExtra(ctx, kind, bin, args)
		if err == nil {
			return p, nil
		}
		if attempt < 3 && errors.Is(err, errPortTaken) && ctx.Err() == nil {
			continue
		}
		return nil, err
	}
}

func (e *Env) startExtra(ctx context.Context, kind, bin string, args []string) (*Process, error) {
	ports, err := freePorts(1)
	if err != nil {
		return nil, err
	}
	endpoint := "127.0.0.1:" + strconv.Itoa(ports[0])
	e.extraMu.Lock()
	if e.extraCount == nil {
		e.extraCount = map[string]int{}
	}
	e.extraCount[kind]++
	name := kind
	if n := e.extraCount[kind]; n > 1 {
		name += "-" + strconv.Itoa(n)
	}
	c, err := startComponent(e.Dir, name, bin, append([]string{"--http-endpoint=" + endpoint}, args...))
	if err == nil {
		c.kind = kind
		e.extra = append(e.extra, c)
	}
	e.extraMu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("testenv: %w", err)
	}
	p := &Process{Name: name, MetricsURL: "http://" + endpoint + "/metrics", c: c}
	if err := waitReady(ctx, c, p.MetricsURL, nil); err != nil {
		p.Stop()
		return nil, fmt.Errorf("testenv: %s %w: %w; last lines of %s:\n%s", name, errNoEndpoint, err, c.logPath, c.tail(30))
	}
	return p, nil
}

// stopExtra stops what runExtra started, all at once.
func (e *Env) stopExtra(grace time.Duration) {
	e.extraMu.Lock()
	extra := e.extra
	e.extraMu.Unlock()
	var wg sync.WaitGroup
	for _, c := range extra {
		wg.Go(func() { c.stop(grace) })
	}
	wg.Wait()
}
