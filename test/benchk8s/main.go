// Command benchk8s runs csibroker side by side with the Kubernetes CSI sidecars
// (external-provisioner v6.3.0, external-attacher v4.13.0) on one real, local
// control plane and the project's sample CSI driver, and prints the figures
// (medians, min–max, and the csibroker/sidecar ratio of each run) as Markdown.
//
//	go run ./test/benchk8s                       # the default mode (make bench-k8s)
//	go run ./test/benchk8s -n 300,1000           # also N = 1,000 (slow at QPS 5)
//	go run ./test/benchk8s -scenarios provision -reps 1 -qps 200/400
//
// Scenarios (issue 8): provision (throughput, CPU, RSS and API requests per
// volume at the sidecars' default client QPS and at a high one), drivers (five
// drivers: one broker against five provisioners, plus five attachers with
// -attach), memory (RSS with 0, 1,000 and 10,000 pre-bound PV/PVC pairs) and
// failover (SIGKILL the leader while claims are pending). Issue 35's, all at
// the sidecars' default client QPS 5/10: manydrivers (5 and 20 drivers, 200
// claims each with kube-controller-manager at 200/400 and 20 at its default
// 20/30: time to all Bound and to all PVs gone), neighbour (one driver's
// claims while another has 1,000 pending, hangs or answers garbage) and
// latency (50 claims one at a time: p50 and p99 creation → Bound).
//
//	go run ./test/benchk8s -scenarios manydrivers,neighbour,latency -reps 1 \
//	    -many-drivers 2 -many-claims 5@200/400 -neighbour-claims 20 -neighbour-probes 1 -latency-claims 5
//
// It builds what is missing first (hack/control-plane.sh, hack/sidecars.sh,
// go build of the csibroker binary). Every process it starts listens on
// 127.0.0.1 or a unix socket, runs in its own process group, dies with the
// harness (Pdeathsig) and is stopped by its PID at the end, on error and on
// interrupt.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(2)
		}
		fmt.Fprintln(os.Stderr, "benchk8s:", err)
		os.Exit(1)
	}
}

// run parses the flags, builds what is missing, runs the scenarios and writes
// the report to stdout; progress goes to stderr.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	h, err := newHarness(cfg, stdout, stderr)
	if err != nil {
		return err
	}
	h.args = args
	defer h.close()
	// An interrupt cancels ctx; children are killed at once here, before
	// testenv's own handler re-raises the signal and ends the process.
	stopKill := context.AfterFunc(ctx, h.killAll)
	defer stopKill()
	if err := h.build(ctx); err != nil {
		return err
	}
	return h.runScenarios(ctx)
}
