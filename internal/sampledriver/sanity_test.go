package sampledriver

import (
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/ginkgo/v2/types"
)

// specCounts tallies a ginkgo run's It specs by outcome.
type specCounts struct {
	Passed, Skipped, Failed, Pending, Other int
	SkippedNames                            []string
}

func countSpecs(r ginkgo.Report) specCounts {
	var c specCounts
	for _, sr := range r.SpecReports {
		if sr.LeafNodeType != types.NodeTypeIt {
			continue
		}
		switch {
		case sr.State == types.SpecStatePassed:
			c.Passed++
		case sr.State == types.SpecStateSkipped:
			c.Skipped++
			c.SkippedNames = append(c.SkippedNames, sr.FullText()+": "+sr.Failure.Message)
		case sr.State == types.SpecStatePending:
			c.Pending++
		case sr.State.Is(types.SpecStateFailureStates):
			c.Failed++
		default:
			c.Other++
		}
	}
	return c
}

// TestSanity runs csi-test v5.6.0's sanity suite against the driver served
// in-process with topology, an attach limit and mutable parameters enabled,
// so that every spec its capabilities allow runs. Ginkgo runs once per
// process, so this is the package's only sanity run.
func TestSanity(t *testing.T) {
	endpoint, d := StartTest(t, Config{
		NodeID:            "sanity-node",
		Topology:          map[string]string{"topology.kubernetes.io/zone": "z1"},
		MaxVolumesPerNode: 4,
		Logger:            testLogger(t),
	})
	base, err := os.MkdirTemp("", "sanity")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })

	cfg := sanity.NewTestConfig()
	cfg.Address = endpoint
	cfg.TargetPath = filepath.Join(base, "mount")
	cfg.StagingPath = filepath.Join(base, "staging")
	cfg.TestNodeVolumeAttachLimit = true
	cfg.TestVolumeMutableParameters = map[string]string{MutableIOPS: "3000"}

	var counts specCounts
	ginkgo.ReportAfterSuite("sample driver sanity counts", func(r ginkgo.Report) {
		counts = countSpecs(r)
	})
	sanity.Test(t, cfg)
	t.Logf("csi-sanity: %d passed, %d skipped, %d failed, %d pending, %d other",
		counts.Passed, counts.Skipped, counts.Failed, counts.Pending, counts.Other)
	for _, n := range counts.SkippedNames {
		t.Logf("skipped: %s", n)
		// The sample driver serves every CSI service: a spec skipped means
		// a capability it should advertise went missing, and its specs
		// stopped running unnoticed.
		t.Errorf("csi-sanity skipped a spec the driver's capabilities should run: %s", n)
	}
	if counts.Failed > 0 || counts.Passed == 0 {
		t.Errorf("csi-sanity: want 0 failed and some passed, got %+v", counts)
	}

	// The suite cleans up after itself; so must the driver.
	if v := d.Volumes(); len(v) != 0 {
		t.Errorf("volumes left after sanity: %+v", v)
	}
	if s := d.Snapshots(); len(s) != 0 {
		t.Errorf("snapshots left after sanity: %+v", s)
	}
	if g := d.GroupSnapshots(); len(g) != 0 {
		t.Errorf("group snapshots left after sanity: %+v", g)
	}
	if m := d.NodeMounts(); len(m) != 0 {
		t.Errorf("node mounts left after sanity: %+v", m)
	}
	calls := d.Calls()
	if calls["CreateVolume"] == 0 || calls["NodePublishVolume"] == 0 {
		t.Errorf("call counts look wrong: %v", calls)
	}
}

// testLogger logs through t at Debug when -v is given, else only warnings.
func testLogger(t testing.TB) *slog.Logger {
	level := slog.LevelWarn
	if testing.Verbose() && os.Getenv("SAMPLEDRIVER_DEBUG") != "" {
		level = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: level}))
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(string(p[:len(p)-1]))
	return len(p), nil
}
