package main

import (
	"io"
	"strings"
	"testing"
	"time"
)

func TestReplicasFlags(t *testing.T) {
	cfg, err := parseFlags([]string{"-scenarios", "replicas", "-replicas-drivers", "6", "-replicas-claims", "4@50/100", "-replicas-count", "2",
		"-replicas-kill-rate", "2.5", "-replicas-kill-for", "12s", "-replicas-lease", "4s/3s/1s"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	rc := cfg.ReplicasCfg
	if rc.Drivers != 6 || rc.Claims != (manySetting{4, rate{50, 100}}) || rc.Replicas != 2 || rc.KillRate != 2.5 || rc.KillFor != 12*time.Second ||
		rc.Lease != (leaseTimings{4 * time.Second, 3 * time.Second, time.Second}) {
		t.Errorf("parsed %+v", rc)
	}
	if got := strings.Join(rc.Lease.flags(), " "); got != "--leader-election-lease-duration 4s --leader-election-renew-deadline 3s --leader-election-retry-period 1s" {
		t.Errorf("broker flags %q", got)
	}
	def := DefaultConfig().ReplicasCfg
	if def.Drivers != 20 || def.Claims.String() != "20@200/400" || def.Replicas != 3 || def.Lease.String() != "3s/2.5s/500ms" {
		t.Errorf("defaults %+v", def)
	}
	for _, bad := range [][]string{
		{"-scenarios", "replicas", "-replicas-count", "1"},
		{"-scenarios", "replicas", "-replicas-drivers", "2"},
		{"-scenarios", "replicas", "-replicas-kill-for", "5s"},
		{"-scenarios", "replicas", "-replicas-kill-rate", "0"},
		{"-replicas-lease", "3s/2.5s"},
		{"-replicas-lease", "2.5s/2s/1s"},
		{"-replicas-lease", "3s/3s/1s"},
		{"-replicas-claims", "20"},
	} {
		if _, err := parseFlags(bad, io.Discard); err == nil {
			t.Errorf("parseFlags(%q) accepted", strings.Join(bad, " "))
		}
	}
}

func TestBalanced(t *testing.T) {
	ids := []string{"x-a", "x-b", "x-c"}
	for _, c := range []struct {
		led  map[string]int
		want bool
	}{
		{map[string]int{"x-a": 7, "x-b": 7, "x-c": 6}, true},
		{map[string]int{"x-a": 6, "x-b": 7, "x-c": 7}, true},
		{map[string]int{"x-a": 8, "x-b": 6, "x-c": 6}, false},
		{map[string]int{"x-a": 7, "x-b": 7, "x-c": 5}, false}, // one driver led by nobody
		{map[string]int{"x-a": 20}, false},
	} {
		if got := balanced(c.led, 20, ids); got != c.want {
			t.Errorf("balanced(%v) = %v, want %v", c.led, got, c.want)
		}
	}
	s := state{leaseHolders: map[string]string{"csibroker-leader": "x-b", "csibroker-leader-driver-d1": "x-a", "csibroker-leader-driver-d2": "x-c",
		"csibroker-leader-driver-d3": "gone"}}
	if got := fmtLed(ledBy(s, []string{"d1", "d2", "d3"}, ids)); got != "a 1, b 0, c 1" {
		t.Errorf("ledBy per driver: %s", got)
	}
	if got := fmtLed(ledBy(s, []string{"d1", "d2", "d3"}, []string{"x-b"})); got != "b 3" {
		t.Errorf("ledBy single: %s", got)
	}
}

// TestReplicasSmoke runs the replicas scenario once at a small size (four
// drivers × three claims, one replica against three; the kill test at 3
// claims a second for 9 s) and checks what each run recorded and that both
// tables are in the report.
func TestReplicasSmoke(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Scenarios = []string{"replicas"}
	cfg.Reps = 1
	cfg.ReplicasCfg.Drivers = 4
	cfg.ReplicasCfg.Claims = manySetting{3, rate{200, 400}}
	cfg.ReplicasCfg.KillRate = 3
	cfg.ReplicasCfg.KillFor = 9 * time.Second
	cfg.FromHead = false
	h, report := runSmoke(t, cfg, 15*time.Minute)

	var throughput, kills int
	for _, run := range h.report.runs {
		switch r := run["result"].(type) {
		case *replicasResult:
			throughput++
			if r.BoundSeconds <= 0 || r.DelSeconds <= 0 || r.CPUProv <= 0 || len(r.Led) != r.Replicas {
				t.Errorf("replicas %d: %+v", r.Replicas, r)
			}
			if r.Replicas == 1 && (r.Mode != "single" || maxLed(r.Led) != 4) {
				t.Errorf("one replica: mode %s, led %v, want single, all 4", r.Mode, r.Led)
			}
			if r.Replicas == 3 && (r.Mode != "per-driver" || maxLed(r.Led) != 2 || minLed(r.Led) != 1) {
				t.Errorf("three replicas: mode %s, led %v, want per-driver, 1 or 2 each", r.Mode, r.Led)
			}
		case *killResult:
			kills++
			if r.Claims != 27 || len(r.KilledDrivers) < 1 || r.TakeoverSeconds <= 0 || r.KilledMax <= 0 || r.OthersMax <= 0 || r.LeaseRetry != 3.5 {
				t.Errorf("kill test: %+v", r)
			}
			if len(r.LedAfter) != 3 || r.LedAfter[r.Killed] != 0 || maxLed(r.LedAfter) != 2 {
				t.Errorf("kill test: led afterwards %v (killed %s), want the 4 drivers on the 2 survivors", r.LedAfter, r.Killed)
			}
			// The takeover itself (no provisioning in it) has a bound a
			// loaded machine still keeps: twice lease + retry.
			if r.TakeoverSeconds > 2*r.LeaseRetry {
				t.Errorf("kill test: survivors took over after %.2fs, lease + retry is %.1fs", r.TakeoverSeconds, r.LeaseRetry)
			}
		default:
			t.Errorf("unexpected result %T", r)
		}
	}
	if throughput != 2 || kills != 1 {
		t.Errorf("%d throughput runs and %d kill tests, want 2 and 1", throughput, kills)
	}
	for _, table := range []string{"### Replicas (issue 35): 4 drivers × 3", "### Replicas, kill test (issue 35): 3 replicas"} {
		if !strings.Contains(report, table) {
			t.Errorf("report has no %q table", table)
		}
	}
}
