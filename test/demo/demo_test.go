// Package demo runs the README's demo end to end, non-interactively, as CI
// does: it must exit 0, which it does only when every claim it made is Bound
// and the forbidden secret was refused.
package demo

import (
	"bufio"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/csibroker/csibroker/internal/testenv"
)

func TestDemoEndToEnd(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "csibroker")
	build := exec.Command("go", "build", "-o", bin, "./cmd/csibroker")
	build.Dir = "../.."
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	// --wait keeps everything running after the demo until Ctrl-C: the test
	// presses it once, as a user would, and the demo must stop everything
	// it started and remove its work directory.
	cmd := exec.CommandContext(ctx, bin, "demo", "--deploy-dir", "../../deploy", "--timeout", "3m", "--wait")
	cmd.Env = os.Environ()
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	running := make(chan struct{})
	scanned := make(chan struct{})
	go func() {
		defer close(scanned)
		sc := bufio.NewScanner(pr)
		once := false
		for sc.Scan() {
			out.WriteString(sc.Text() + "\n")
			if !once && strings.Contains(sc.Text(), "Ctrl-C stops everything") {
				once = true
				close(running)
			}
		}
	}()
	waited := make(chan error, 1)
	go func() { err := cmd.Wait(); pw.Close(); waited <- err }()
	var err error
	select {
	case <-running:
		if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
			t.Fatal(err)
		}
		stopped := time.Now()
		err = <-waited
		t.Logf("the demo stopped %v after Ctrl-C", time.Since(stopped).Round(time.Millisecond))
	case err = <-waited:
	}
	<-scanned
	t.Logf("demo output:\n%s", out.String())
	if err != nil {
		t.Fatalf("demo: %v", err)
	}
	select {
	case <-running:
	default:
		// --wait was asked for: the Ctrl-C shutdown above was never tried.
		t.Fatal("the demo exited without saying it keeps running until Ctrl-C")
	}
	// Everything it started is gone: its work directory and every process
	// whose pid it printed.
	if m := regexp.MustCompile(`work directory (\S+)`).FindStringSubmatch(out.String()); m == nil {
		t.Error("the demo did not name its work directory")
	} else if _, err := os.Stat(m[1]); !os.IsNotExist(err) {
		t.Errorf("work directory %s left behind (%v)", m[1], err)
	}
	started := regexp.MustCompile(`started (\S+) \(pid (\d+)\)`).FindAllStringSubmatch(out.String(), -1)
	var names []string
	for _, m := range started {
		names = append(names, m[1])
	}
	// The check below proves nothing unless the demo named its processes.
	if !slices.Contains(names, "broker") || !slices.ContainsFunc(names, func(n string) bool { return strings.HasSuffix(n, "-driver") }) ||
		!slices.ContainsFunc(names, func(n string) bool { return strings.HasSuffix(n, "-proxy") }) {
		t.Errorf("the demo named the processes %v; want the broker, a driver and a proxy with their pids", names)
	}
	for _, m := range started {
		pid, _ := strconv.Atoi(m[2])
		if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
			t.Errorf("%s (pid %d) still running after the demo exited", m[1], pid)
		}
	}
	for _, want := range []string{
		"control plane ready",
		"running; kubeconfig",
		"denied by policy",
		"alpha-1      Bound",
		"beta-1       Bound",
		"provision demo/alpha-1",         // the trace tree's root
		"csi.v1.Controller/CreateVolume", // and the CSI hops under it
		"csibroker_provision_operations_total",
		"appears in none of the",
		"done: every claim is Bound",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("demo output lacks %q", want)
		}
	}
	// With the snapshot-controller built (make run and make test build
	// it), a claim is snapshotted and restored, the broker in
	// csi-snapshotter's place.
	if _, err := os.Stat(filepath.Join(testenv.SidecarDir("snapshot-controller", testenv.SnapshotterVersion), "snapshot-controller")); err == nil {
		for _, want := range []string{"started snapshot-controller (pid", "VolumeSnapshot alpha-1-snap ready in", "claim alpha-restored Bound to"} {
			if !strings.Contains(out.String(), want) {
				t.Errorf("snapshot-controller is built, but the demo output lacks %q", want)
			}
		}
	}
	// With Jaeger built (make test builds it), the trace comes from its
	// query API, and the demo says where to point a UI.
	if testenv.JaegerBuilt() {
		for _, want := range []string{"started jaeger (pid", "spans from Jaeger's query API", "Grafana Jaeger data source (URL http://127.0.0.1:", "spans in Jaeger"} {
			if !strings.Contains(out.String(), want) {
				t.Errorf("Jaeger is built, but the demo output lacks %q", want)
			}
		}
	}
}
