package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

// TestHarnessSmoke runs the provisioning scenario once, N=10 at QPS 200/400,
// for external-provisioner, csibroker and the floor (minprov), so that `make
// test` exercises the harness end to end: the builds (control plane,
// sidecars, csibroker, minprov; cached after the first time), the control
// plane with its audit log, every side, the tracker, the CPU/RSS readings
// and the per-client request counts.
func TestHarnessSmoke(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Scenarios = []string{"provision"}
	cfg.Reps = 1
	cfg.N = []int{10}
	cfg.QPS = []rate{{200, 400}}
	cfg.FromHead = false // test the code under test
	cfg.Floor = true
	h, report := runSmoke(t, cfg, 15*time.Minute)

	if len(h.provResults) != 3 {
		t.Fatalf("got %d provisioning results, want one per side", len(h.provResults))
	}
	for _, r := range h.provResults {
		if r.BoundSeconds <= 0 || r.DelSeconds <= 0 || r.PVSeconds > r.BoundSeconds {
			t.Errorf("%s: times: PVs %.3fs, Bound %.3fs, deleted %.3fs", r.Side, r.PVSeconds, r.BoundSeconds, r.DelSeconds)
		}
		if r.CPUProv <= 0 || r.PeakRSS <= 0 || r.SwitchesProv <= 0 {
			t.Errorf("%s: no CPU (%.3fs), peak RSS (%d) or context switches (%.0f) read from /proc", r.Side, r.CPUProv, r.PeakRSS, r.SwitchesProv)
		}
		// The audit log attributes the PV writes to the side's own clients.
		if got := r.APIProv.ByVerbResource["create persistentvolumes"]; got != r.N {
			t.Errorf("%s: %d PV creates counted for its user agent, want %d (all: %v)", r.Side, got, r.N, r.APIProv.ByVerbResource)
		}
		if got := r.APIDel.ByVerbResource["delete persistentvolumes"]; got < r.N {
			t.Errorf("%s: %d PV deletes counted for its user agent, want at least %d (all: %v)", r.Side, got, r.N, r.APIDel.ByVerbResource)
		}
	}
	for _, table := range []string{"### Provisioning: N=10", "### Floor against external-provisioner: N=10", "### Floor against csibroker: N=10"} {
		if !strings.Contains(report, table) {
			t.Errorf("report has no %q table:\n%s", table, report)
		}
	}
}

// testWriter sends the harness's progress lines to the test log.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func TestClientFromUserAgent(t *testing.T) {
	for ua, want := range map[string]string{
		"csi-provisioner/v0.0.0 (linux/amd64) kubernetes/$Format": "csi-provisioner",
		"csi-attacher/v0.0.0 (linux/amd64) kubernetes/$Format":    "csi-attacher",
		"csibroker/bench (objects)":                               "csibroker(objects)",
		"csibroker/v0.1.0-3-gabc (leader-election)":               "csibroker(leader-election)",
		"minprov/bench": "minprov",
		"csi-snapshotter/v0.0.0 (linux/amd64) kubernetes/$Format":     "csi-snapshotter",
		"snapshot-controller/v0.0.0 (linux/amd64) kubernetes/$Format": "snapshot-controller",
		"kube-controller-manager/v1.36.3 (linux/amd64)":               "",
		"benchk8s": "",
	} {
		if got := client(ua); got != want {
			t.Errorf("client(%q) = %q, want %q", ua, got, want)
		}
	}
}

func TestCountAPI(t *testing.T) {
	evs := []auditEvent{
		{Stage: "ResponseStarted", Verb: "watch", UserAgent: "csibroker/x (objects)"},
		{Stage: "ResponseStarted", Verb: "watch", UserAgent: "csibroker/x (objects)"},
		{Stage: "ResponseComplete", Verb: "watch", UserAgent: "csibroker/x (objects)"},
		{Stage: "ResponseComplete", Verb: "create", UserAgent: "csibroker/x (events)"},
		{Stage: "ResponseComplete", Verb: "create", UserAgent: "csi-provisioner/v (linux)"},
	}
	evs[3].ObjectRef = &struct {
		Resource    string `json:"resource"`
		Subresource string `json:"subresource"`
		Namespace   string `json:"namespace"`
		Name        string `json:"name"`
	}{Resource: "events"}
	c := countAPI(evs, "csibroker")
	if c.WatchesOpen != 1 || c.ByVerbResource["watch -"] != 2 || c.ByVerbResource["create events"] != 1 || c.total(writeVerbs, "events") != 0 {
		t.Errorf("countAPI = %+v", c)
	}
}

func TestParseProm(t *testing.T) {
	ss := parseProm(`# HELP x
apiserver_longrunning_requests{component="apiserver",group="",resource="pods",scope="cluster",subresource="",verb="WATCH",version="v1"} 3
apiserver_longrunning_requests_other 1
apiserver_request_total{code="200",verb="GET",resource="a\"b"} 7 1700000000
`, "apiserver_longrunning_requests", "apiserver_request_total")
	if len(ss) != 2 || ss[0].value != 3 || ss[0].labels["verb"] != "WATCH" || ss[1].labels["resource"] != `a"b` || ss[1].value != 7 {
		t.Errorf("parseProm = %+v", ss)
	}
}

// TestSnapshotsSmoke runs the snapshots scenario once, N=10 at QPS 200/400,
// for csi-snapshotter (with the real snapshot-controller): the CRDs, the
// contents made before the side starts, the watch on readiness, the
// deletions with the driver's leak check, the request counts by user agent
// and the field-by-field table. The csibroker side joins once the broker
// handles VolumeSnapshotContents (-snapshot-sides csibroker runs it).
func TestSnapshotsSmoke(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Scenarios = []string{"snapshots"}
	cfg.Reps = 1
	cfg.SnapshotN = 10
	cfg.QPS = []rate{{200, 400}}
	cfg.SnapshotSides = []string{sideSidecar}
	cfg.FromHead = false
	h, report := runSmoke(t, cfg, 10*time.Minute)
	if len(h.snapResults) != 1 {
		t.Fatalf("got %d snapshot results, want 1", len(h.snapResults))
	}
	r := h.snapResults[0]
	if r.ReadySeconds <= 0 || r.DelSeconds <= 0 || r.CPUReady <= 0 || r.PeakRSS <= 0 {
		t.Errorf("times or readings missing: %+v", r)
	}
	if got := r.APIReady.ByVerbResource["patch volumesnapshotcontents/status"]; got < r.N {
		t.Errorf("%d content status patches counted for csi-snapshotter, want at least %d (all: %v)", got, r.N, r.APIReady.ByVerbResource)
	}
	if len(r.contents) != r.N {
		t.Errorf("%d final contents kept, want %d", len(r.contents), r.N)
	}
	for _, want := range []string{"### Snapshots: N=10", "### Final VolumeSnapshotContents of csi-snapshotter", "| status.readyToUse | `true` |"} {
		if !strings.Contains(report, want) {
			t.Errorf("report has no %q:\n%s", want, report)
		}
	}
}

// runSmoke validates cfg, builds what the harness needs (the sidecars are
// built by make test before, so this is usually a cache check; cold, it
// takes minutes, under its own limit), runs the scenarios within runFor
// and returns the harness (closed when the test ends) and its report.
func runSmoke(t *testing.T, cfg Config, runFor time.Duration) (*Harness, string) {
	t.Helper()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	h, err := newHarness(cfg, &out, testWriter{t})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.close)
	bctx, bcancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer bcancel()
	if err := h.build(bctx); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), runFor)
	defer cancel()
	if err := h.runScenarios(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("report:\n%s", out.String())
	return h, out.String()
}
