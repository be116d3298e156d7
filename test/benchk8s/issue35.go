package main

// The scenarios of issue 35 ("Many drivers, one broker"): manydrivers
// (manydrivers.go), neighbour (neighbour.go) and latency (latency.go), all
// at the sidecars' default client QPS/burst 5/10 and the broker's defaults
// (--kube-api-budget per-driver: N drivers get N times 5/10). This file
// holds their flags and what they share.

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// sidecarDefaults is external-provisioner's default client QPS/burst, also
// the broker's default per registered driver.
var sidecarDefaults = rate{5, 10}

// manySetting is one size of the manydrivers scenario: claims per driver,
// with kube-controller-manager's client rate (its PV binder paces binding).
type manySetting struct {
	PerDriver int
	KCM       rate
}

func (s manySetting) String() string { return strconv.Itoa(s.PerDriver) + "@" + s.KCM.String() }

func parseManySetting(s string) (manySetting, error) {
	n, r, ok := strings.Cut(strings.TrimSpace(s), "@")
	if !ok {
		return manySetting{}, fmt.Errorf("%q: want CLAIMS@QPS/BURST, e.g. 200@200/400", s)
	}
	per, err := strconv.Atoi(n)
	if err != nil || per < 1 {
		return manySetting{}, fmt.Errorf("%q: claims per driver must be a positive integer", s)
	}
	kcm, err := parseRate(r)
	if err != nil {
		return manySetting{}, fmt.Errorf("%q: %w", s, err)
	}
	return manySetting{per, kcm}, nil
}

// What driver A does in the neighbour scenario while B is measured.
const (
	modeBusy    = "busy"    // answers normally; its claims wait for its budget
	modeHang    = "hang"    // every CreateVolume hangs (until the caller's timeout)
	modeGarbage = "garbage" // every CreateVolume answer has a topology that is no label (csiparams.CheckCreatedVolume refuses it)
)

var neighbourModes = []string{modeBusy, modeHang, modeGarbage}

func registerIssue35Flags(fs *flag.FlagSet, cfg *Config) {
	fs.Func("many-drivers", "manydrivers: driver counts, comma-separated (default 5,20)", func(s string) error {
		v, err := parseInts(s)
		cfg.ManyDrivers = v
		return err
	})
	fs.Func("many-claims", "manydrivers: claims per driver @ kube-controller-manager client QPS/burst, comma-separated (default 200@200/400,20@20/30)", func(s string) error {
		cfg.ManySettings = nil
		for _, p := range splitList(s) {
			m, err := parseManySetting(p)
			if err != nil {
				return err
			}
			cfg.ManySettings = append(cfg.ManySettings, m)
		}
		return nil
	})
	fs.IntVar(&cfg.NeighbourClaims, "neighbour-claims", cfg.NeighbourClaims, "neighbour: claims of driver A pending while B's are measured")
	fs.IntVar(&cfg.NeighbourProbes, "neighbour-probes", cfg.NeighbourProbes, "neighbour: claims of driver B, one after another, alone and beside A")
	fs.Func("neighbour-modes", "neighbour: what driver A does, comma-separated: "+strings.Join(neighbourModes, ",")+" (default all)", func(s string) error {
		cfg.NeighbourModes = splitList(s)
		return nil
	})
	fs.IntVar(&cfg.LatencyClaims, "latency-claims", cfg.LatencyClaims, "latency: claims created one after another, each once the previous is Bound")
}

func (c Config) validateIssue35() []error {
	var errs []error
	if c.has("manydrivers") && (len(c.ManyDrivers) == 0 || len(c.ManySettings) == 0 || slices.Min(c.ManyDrivers) < 1) {
		errs = append(errs, errors.New("-many-drivers must list positive driver counts and -many-claims at least one setting"))
	}
	if c.NeighbourClaims < 1 || c.NeighbourProbes < 1 {
		errs = append(errs, errors.New("-neighbour-claims and -neighbour-probes must be positive"))
	}
	for _, m := range c.NeighbourModes {
		if !slices.Contains(neighbourModes, m) {
			errs = append(errs, fmt.Errorf("-neighbour-modes: unknown %q (want some of %s)", m, strings.Join(neighbourModes, ",")))
		}
	}
	if c.has("neighbour") && len(c.NeighbourModes) == 0 {
		errs = append(errs, errors.New("-neighbour-modes: none given"))
	}
	if c.LatencyClaims < 1 {
		errs = append(errs, errors.New("-latency-claims must be positive"))
	}
	return errs
}

// startDriverWith is startDriver with more sample-driver flags (faults,
// controller segments, verbosity).
func (h *Harness) startDriverWith(ctx context.Context, tag, name string, extra ...string) (*driverInst, error) {
	dir, err := os.MkdirTemp(h.work, "drv-")
	if err != nil {
		return nil, err
	}
	sock := filepath.Join(dir, "csi.sock")
	args := append([]string{
		"sample-driver", "--endpoint", "unix://" + sock, "--name", name, "--node-id", "node-1",
		"--state-dir", filepath.Join(dir, "state"), "--capacity", "100Ti", "--nodes", "*",
	}, extra...)
	p, err := h.procs.start(tag+"-driver-"+name, h.bins.csibroker, args, nil)
	if err != nil {
		return nil, err
	}
	if err := waitSocket(ctx, p, sock, 30*time.Second); err != nil {
		p.stop(5 * time.Second)
		return nil, err
	}
	return &driverInst{name: name, sock: sock, proc: p}, nil
}

// createVolumeCalls counts the CreateVolume requests a sample driver started
// with -v 1 has logged (on arrival, before any injected latency).
func createVolumeCalls(d *driverInst) (int, error) {
	b, err := os.ReadFile(d.proc.logPath)
	if err != nil {
		return 0, err
	}
	n := 0
	for line := range strings.Lines(string(b)) {
		if strings.Contains(line, ` msg="csi request" `) && strings.Contains(line, " method=CreateVolume ") {
			n++
		}
	}
	return n, nil
}

// turns is what boundInTurn measured, per claim, in seconds: from just
// before its create request to the tracker seeing it Bound and seeing its
// PV, and the provisioner's part (from kube-controller-manager's
// annotation to the PV).
type turns struct {
	bound, pv, prov []float64
}

// boundInTurn creates claims <prefix>-<i> of class sc in ns one after
// another, each once the previous one is Bound, and measures each. The
// tracker follows ns, where before claims are Bound already.
func (h *Harness) boundInTurn(ctx context.Context, tr *tracker, ns, prefix, sc string, n, before int, timeout time.Duration, check func() error) (turns, error) {
	var r turns
	for i := range n {
		name := fmt.Sprintf("%s-%05d", prefix, i)
		t0 := time.Now()
		if _, err := h.client.CoreV1().PersistentVolumeClaims(ns).Create(ctx, claim(ns, name, sc, ""), metav1.CreateOptions{}); err != nil {
			return r, fmt.Errorf("create claim: %w", err)
		}
		want := before + i + 1
		tPV, err := tr.wait(ctx, timeout, "the PV of claim "+name, func(s state) bool { return s.pvs >= want }, check)
		if err != nil {
			return r, err
		}
		tBound, err := tr.wait(ctx, timeout, "claim "+name+" Bound", func(s state) bool { return s.bound >= want }, check)
		if err != nil {
			return r, err
		}
		prov, ok := tr.provisionerPart(name)
		if !ok {
			return r, fmt.Errorf("claim %s: Bound, but the tracker saw no %s annotation or no PV of it", name, annStorageProvisioner)
		}
		r.bound = append(r.bound, tBound.Sub(t0).Seconds())
		r.pv = append(r.pv, tPV.Sub(t0).Seconds())
		r.prov = append(r.prov, prov.Seconds())
	}
	return r, nil
}

// percentile is the nearest-rank p-th percentile (0 < p <= 100) of v: with
// 50 values, p99 is the largest.
func percentile(v []float64, p float64) float64 {
	v = finite(v)
	if len(v) == 0 {
		return math.NaN()
	}
	s := slices.Clone(v)
	slices.Sort(s)
	rank := int(math.Ceil(p / 100 * float64(len(s))))
	return s[min(max(rank, 1), len(s))-1]
}

func mean(v []float64) float64 {
	v = finite(v)
	if len(v) == 0 {
		return math.NaN()
	}
	sum := 0.0
	for _, x := range v {
		sum += x
	}
	return sum / float64(len(v))
}

// forgetIntents deletes the broker's intent record once a broker has
// stopped and the harness has removed the volumes behind its back, so that
// the next run's broker does not start with recovering them (lookups on
// its budget that would be counted against that run).
func (h *Harness) forgetIntents(ctx context.Context) error {
	err := h.client.CoreV1().ConfigMaps(brokerNamespace).Delete(ctx, "csibroker-intents", metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete the intent record: %w", err)
	}
	return nil
}
