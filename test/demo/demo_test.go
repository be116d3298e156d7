// Package demo runs the README's demo end to end, non-interactively, as CI
// does: it must exit 0, which it does only when every claim it made is Bound
// and the forbidden secret was refused.
package demo

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
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
	cmd := exec.CommandContext(ctx, bin, "demo", "--deploy-dir", "../../deploy", "--timeout", "3m")
	cmd.Env = os.Environ()
	out, err := cmd.CombinedOutput()
	t.Logf("demo output:\n%s", out)
	if err != nil {
		t.Fatalf("demo: %v", err)
	}
	for _, want := range []string{
		"control plane ready",
		"denied by policy",
		"alpha-1      Bound",
		"beta-1       Bound",
		"provision demo/alpha-1",         // the trace tree's root
		"csi.v1.Controller/CreateVolume", // and the CSI hops under it
		"csibroker_provision_operations_total",
		"appears in none of the",
		"done: every claim is Bound",
	} {
		if !strings.Contains(string(out), want) {
			t.Errorf("demo output lacks %q", want)
		}
	}
}
