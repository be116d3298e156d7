package main

import (
	"io"
	"maps"
	"math"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestPercentile(t *testing.T) {
	v := make([]float64, 50)
	for i := range v {
		v[i] = float64(50 - i) // 50 … 1, unsorted
	}
	for _, c := range []struct {
		p    float64
		want float64
	}{{50, 25}, {99, 50}, {100, 50}, {0, 1}, {2, 1}, {3, 2}} {
		if got := percentile(v, c.p); got != c.want {
			t.Errorf("percentile(1…50, %v) = %v, want %v", c.p, got, c.want)
		}
	}
	if got := percentile([]float64{math.NaN(), 3}, 50); got != 3 {
		t.Errorf("percentile skips NaN: got %v, want 3", got)
	}
	if got := percentile(nil, 50); !math.IsNaN(got) {
		t.Errorf("percentile(nil) = %v, want NaN", got)
	}
	if v[0] != 50 {
		t.Error("percentile sorted its argument")
	}
	if got := mean([]float64{1, 2, 6}); got != 3 {
		t.Errorf("mean = %v, want 3", got)
	}
}

func TestIssue35Flags(t *testing.T) {
	cfg, err := parseFlags([]string{"-scenarios", "manydrivers,neighbour,latency", "-many-drivers", "2,3", "-many-claims", "4@50/100,2@20/30",
		"-neighbour-claims", "30", "-neighbour-probes", "2", "-neighbour-modes", "hang,garbage", "-latency-claims", "7"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(cfg.ManyDrivers, []int{2, 3}) || len(cfg.ManySettings) != 2 || cfg.ManySettings[0] != (manySetting{4, rate{50, 100}}) ||
		cfg.ManySettings[1].String() != "2@20/30" || cfg.NeighbourClaims != 30 || cfg.NeighbourProbes != 2 ||
		!slices.Equal(cfg.NeighbourModes, []string{modeHang, modeGarbage}) || cfg.LatencyClaims != 7 {
		t.Errorf("parsed %+v", cfg)
	}
	def := DefaultConfig()
	if !slices.Equal(def.ManyDrivers, []int{5, 20}) || def.ManySettings[0].String() != "200@200/400" || def.ManySettings[1].String() != "20@20/30" ||
		def.NeighbourClaims != 1000 || def.LatencyClaims != 50 || !slices.Equal(def.NeighbourModes, neighbourModes) {
		t.Errorf("defaults %+v", def)
	}
	for _, bad := range [][]string{
		{"-many-claims", "200"},
		{"-many-claims", "0@200/400"},
		{"-many-claims", "5@fast"},
		{"-many-drivers", "0"},
		{"-neighbour-modes", "flood"},
		{"-neighbour-claims", "0"},
		{"-latency-claims", "0"},
	} {
		if _, err := parseFlags(bad, io.Discard); err == nil {
			t.Errorf("parseFlags(%q) accepted", strings.Join(bad, " "))
		}
	}
}

func TestADriverFlags(t *testing.T) {
	if got := strings.Join(aDriverFlags(modeBusy), " "); got != "-v 1" {
		t.Errorf("busy: %q", got)
	}
	if got := strings.Join(aDriverFlags(modeHang), " "); !strings.Contains(got, "--fault CreateVolume=latency:") {
		t.Errorf("hang: %q", got)
	}
	if got := strings.Join(aDriverFlags(modeGarbage), " "); !strings.Contains(got, "--controller-segment "+neighbourZone+"=z1,bad!key=x") {
		t.Errorf("garbage: %q", got)
	}
}

// TestIssue35Smoke runs issue 35's scenarios once at small sizes (two
// drivers × three claims; A with 500 claims in each neighbour mode, one
// probe of B; three claims one at a time), both sides, and checks what each
// run recorded and that every table is in the report.
func TestIssue35Smoke(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Scenarios = []string{"manydrivers", "neighbour", "latency"}
	cfg.Reps = 1
	cfg.ManyDrivers = []int{2}
	cfg.ManySettings = []manySetting{{3, rate{200, 400}}}
	cfg.NeighbourClaims = 500 // busy: more than A provisions while B is measured (A borrows most of quiet B's share)
	cfg.NeighbourProbes = 1
	cfg.LatencyClaims = 3
	cfg.FromHead = false
	h, report := runSmoke(t, cfg, 15*time.Minute)

	count := map[string]int{}
	for _, run := range h.report.runs {
		count[run["scenario"].(string)]++
		switch r := run["result"].(type) {
		case *manyResult:
			if r.BoundSeconds <= 0 || r.DelSeconds <= 0 || r.CPUProv <= 0 {
				t.Errorf("manydrivers %s: %+v", r.Side, r)
			}
		case *neighbourResult:
			if len(r.Alone) != 1 || len(r.Beside) != 1 || r.Alone[0] <= 0 || r.Beside[0] <= 0 || r.ACalls < 20 || r.APending < 1 {
				t.Errorf("neighbour %s %s: %+v", r.Side, r.Mode, r)
			}
			if len(r.AloneProv) != 1 || len(r.BesideProv) != 1 || r.AloneProv[0] > r.Alone[0] || r.BesideProv[0] > r.Beside[0] { // two watches: no order between them to check a lower bound on
				t.Errorf("neighbour %s %s: provisioner's part %v / %v of %v / %v", r.Side, r.Mode, r.AloneProv, r.BesideProv, r.Alone, r.Beside)
			}
			if r.Mode != modeBusy && r.APending != cfg.NeighbourClaims {
				t.Errorf("neighbour %s %s: %d of A's claims pending, want all %d (A never gives a usable volume)", r.Side, r.Mode, r.APending, cfg.NeighbourClaims)
			}
		case *latencyResult:
			if len(r.Seconds) != 3 || len(r.PVSeconds) != 3 {
				t.Fatalf("latency %s: %+v", r.Side, r)
			}
			for i := range r.Seconds {
				if r.PVSeconds[i] <= 0 || r.PVSeconds[i] > r.Seconds[i] {
					t.Errorf("latency %s, claim %d: PV after %.3fs, Bound after %.3fs", r.Side, i, r.PVSeconds[i], r.Seconds[i])
				}
			}
			if r.Side == sideBroker && r.SpanExports == 0 {
				t.Errorf("latency: csibroker exported no spans with -tracing")
			}
		default:
			t.Errorf("unexpected result %T", r)
		}
	}
	if want := map[string]int{"manydrivers": 2, "neighbour": 6, "latency": 2}; !maps.Equal(count, want) {
		t.Errorf("runs by scenario %v, want %v", count, want)
	}
	for _, table := range []string{"### Many drivers (issue 35): 2 drivers × 3", "### Noisy neighbour (issue 35): driver A answers normally",
		"### Noisy neighbour (issue 35): driver A hangs", "### Noisy neighbour (issue 35): driver A answers every CreateVolume with",
		"### Noisy neighbour, A garbage: the two sides", "### One claim at a time (issue 35): 3"} {
		if !strings.Contains(report, table) {
			t.Errorf("report has no %q table", table)
		}
	}
}
