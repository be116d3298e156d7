// Package sanity runs csi-test's sanity suite against the sample driver
// twice: directly on its socket, and through the broker's front-end socket →
// broker → proxy (mTLS) → driver. Both runs must pass the same specs with 0
// failed. Ginkgo runs once per process, so each run happens in a child
// process of this test binary.
package sanity

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/ginkgo/v2/types"

	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testutil"
)

const (
	modeEnv   = "CSIBROKER_SANITY_MODE"
	resultEnv = "CSIBROKER_SANITY_RESULT"
)

// result is what a child run reports.
type result struct {
	Passed, Skipped, Failed int
	PassedSpecs             []string
}

func TestMain(m *testing.M) {
	if mode := os.Getenv(modeEnv); mode != "" {
		testing.Main(func(string, string) (bool, error) { return true, nil },
			[]testing.InternalTest{{Name: "Sanity_" + mode, F: func(t *testing.T) { runSanity(t, mode) }}}, nil, nil)
		return
	}
	testutil.SkipPackageIfShort("csi-sanity against the sample driver and through the chain")
	os.Exit(m.Run())
}

func runSanity(t *testing.T, mode string) {
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	endpoint, _ := sampledriver.StartTest(t, sampledriver.Config{
		NodeID:            "sanity-node",
		Topology:          map[string]string{"topology.kubernetes.io/zone": "z1"},
		MaxVolumesPerNode: 4,
		Logger:            log,
	})
	address := endpoint
	if mode == "chain" {
		c := chaintest.Start(t, chaintest.Options{Driver: sampledriver.DefaultName, DriverEndpoint: endpoint, LogLevel: slog.LevelWarn})
		address = "unix://" + c.Front
	}
	base, err := os.MkdirTemp("", "sanity")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	cfg := sanity.NewTestConfig()
	cfg.Address = address
	cfg.TargetPath = filepath.Join(base, "mount")
	cfg.StagingPath = filepath.Join(base, "staging")
	cfg.TestNodeVolumeAttachLimit = true
	cfg.TestVolumeMutableParameters = map[string]string{sampledriver.MutableIOPS: "3000"}

	var res result
	ginkgo.ReportAfterSuite("counts", func(r ginkgo.Report) {
		for _, sr := range r.SpecReports {
			if sr.LeafNodeType != types.NodeTypeIt {
				continue
			}
			switch {
			case sr.State == types.SpecStatePassed:
				res.Passed++
				res.PassedSpecs = append(res.PassedSpecs, sr.FullText())
			case sr.State == types.SpecStateSkipped:
				res.Skipped++
			case sr.State.Is(types.SpecStateFailureStates):
				res.Failed++
			}
		}
	})
	sanity.Test(t, cfg)
	b, _ := json.Marshal(res)
	if err := os.WriteFile(os.Getenv(resultEnv), b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func child(t *testing.T, mode string) result {
	t.Helper()
	out := filepath.Join(t.TempDir(), mode+".json")
	// Bounded, and killed with this process if it dies first.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.v", "-test.timeout=4m")
	cmd.Env = append(os.Environ(), modeEnv+"="+mode, resultEnv+"="+out)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	logs, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("sanity %s run failed: %v\n%s", mode, err, tail(string(logs), 80))
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatalf("sanity %s run wrote no result: %v\n%s", mode, err, tail(string(logs), 80))
	}
	var r result
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatal(err)
	}
	return r
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func TestSanityThroughBrokerMatchesDirect(t *testing.T) {
	direct := child(t, "direct")
	chain := child(t, "chain")
	t.Logf("csi-sanity directly on the driver:  %d passed, %d skipped, %d failed", direct.Passed, direct.Skipped, direct.Failed)
	t.Logf("csi-sanity through broker + proxy:  %d passed, %d skipped, %d failed", chain.Passed, chain.Skipped, chain.Failed)
	if direct.Failed != 0 || chain.Failed != 0 {
		t.Fatalf("failed specs: direct %d, chain %d", direct.Failed, chain.Failed)
	}
	if direct.Passed == 0 {
		t.Fatal("no spec passed directly: the comparison would prove nothing")
	}
	sort.Strings(direct.PassedSpecs)
	sort.Strings(chain.PassedSpecs)
	if fmt.Sprint(direct.PassedSpecs) != fmt.Sprint(chain.PassedSpecs) {
		t.Fatalf("different specs passed:\ndirect: %v\nchain:  %v", direct.PassedSpecs, chain.PassedSpecs)
	}
}
