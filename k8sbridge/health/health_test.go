package health

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/record"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/k8sbridge/csiparams"
	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/policy"
)

// fakeDrivers routes to real CSI servers: conns[driver] is a driver's
// controller; nodes[driver][node] a node-local driver's node plugins.
type fakeDrivers struct {
	conns map[string]grpc.ClientConnInterface
	nodes map[string]map[string]grpc.ClientConnInterface
}

var _ drivers.Drivers = (*fakeDrivers)(nil)

func (f *fakeDrivers) ControllerConn(d string) (grpc.ClientConnInterface, error) {
	if c, ok := f.conns[d]; ok {
		return c, nil
	}
	for _, n := range sortedKeys(f.nodes[d]) {
		return f.nodes[d][n], nil
	}
	return nil, fmt.Errorf("unknown driver %s", d)
}

func (f *fakeDrivers) NodeConn(d, node string) (grpc.ClientConnInterface, error) {
	if c, ok := f.nodes[d][node]; ok {
		return c, nil
	}
	return nil, fmt.Errorf("driver %s has no proxy on node %s", d, node)
}
func (f *fakeDrivers) NodeLocal(d string) bool                  { return f.nodes[d] != nil }
func (f *fakeDrivers) DriverNodes(d string) []string            { return sortedKeys(f.nodes[d]) }
func (f *fakeDrivers) HasDriver(d string) bool                  { return f.conns[d] != nil || f.nodes[d] != nil }
func (f *fakeDrivers) CallTimeout(string, string) time.Duration { return 0 }
func (f *fakeDrivers) DriverNames() []string {
	names := sortedKeys(f.conns)
	names = append(names, sortedKeys(f.nodes)...)
	sort.Strings(names)
	return names
}

// value is a gauge's or counter's current value.
func value(t *testing.T, m prometheus.Metric) float64 {
	t.Helper()
	var out dto.Metric
	if err := m.Write(&out); err != nil {
		t.Fatal(err)
	}
	if g := out.GetGauge(); g != nil {
		return g.GetValue()
	}
	return out.GetCounter().GetValue()
}

func sortedKeys[V any](m map[string]V) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// harness is a controller over a fake clientset, its Events and PVs.
type harness struct {
	t   *testing.T
	c   *Controller
	env *kube.Env
	rec *record.FakeRecorder
}

func newHarness(t *testing.T, d *fakeDrivers) *harness {
	t.Helper()
	st := policy.NewStore(nil)
	st.SetMode(policy.ModeOff)
	cfg := kube.Config{Client: fake.NewClientset(), Drivers: d, Policy: &policy.Authorizer{Rules: st}, Namespace: "csibroker",
		MonitorInterval: time.Second, Registerer: prometheus.NewRegistry(), Timeout: 10 * time.Second,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	env, _, err := kube.NewEnv(cfg)
	if err != nil {
		t.Fatal(err)
	}
	rec := record.NewFakeRecorder(10000)
	env.Recorder = rec
	c, err := New(env)
	if err != nil {
		t.Fatal(err)
	}
	return &harness{t: t, c: c, env: env, rec: rec}
}

// addPV adds a bound PV of driver for volume handle to the cache (the
// claim default/claim-<name>), on node if set.
func (h *harness) addPV(name, driver, handle, node string) *corev1.PersistentVolume {
	h.t.Helper()
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID("uid-" + name)},
		Spec: corev1.PersistentVolumeSpec{
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: driver, VolumeHandle: handle}},
			ClaimRef:               &corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: "default", Name: "claim-" + name, UID: types.UID("claim-uid-" + name)},
		},
		Status: corev1.PersistentVolumeStatus{Phase: corev1.VolumeBound},
	}
	if node != "" {
		pv.Annotations = map[string]string{kube.AnnVolumeNode: node}
	}
	if err := h.env.Factory.Core().V1().PersistentVolumes().Informer().GetIndexer().Add(pv); err != nil {
		h.t.Fatal(err)
	}
	return pv
}

func (h *harness) removePV(pv *corev1.PersistentVolume) {
	if err := h.env.Factory.Core().V1().PersistentVolumes().Informer().GetIndexer().Delete(pv); err != nil {
		h.t.Fatal(err)
	}
}

// events drains the Events recorded so far.
func (h *harness) events() []string {
	var out []string
	for {
		select {
		case e := <-h.rec.Events:
			out = append(out, e)
		default:
			return out
		}
	}
}

func (h *harness) sweep(driver string) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	h.c.sweepDriver(ctx, driver)
}

// wantEvents fails unless the Events since the last look are exactly
// want, each given as "Type Reason" plus a part of the message.
func (h *harness) wantEvents(what string, want ...string) {
	h.t.Helper()
	got := h.events()
	if len(got) != len(want) {
		h.t.Fatalf("%s: Events %q, want %d like %q", what, got, len(want), want)
	}
	for i := range want {
		if !strings.Contains(got[i], want[i]) {
			h.t.Fatalf("%s: Event %q, want one containing %q (all: %q)", what, got[i], want[i], got)
		}
	}
}

func dialDriver(t *testing.T, cfg sampledriver.Config) (grpc.ClientConnInterface, *sampledriver.Driver) {
	t.Helper()
	cfg.Logger = slog.New(slog.DiscardHandler)
	ep, d := sampledriver.StartTest(t, cfg)
	conn, err := grpc.NewClient(ep, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn, d
}

func createVolume(t *testing.T, conn grpc.ClientConnInterface, name string) string {
	t.Helper()
	resp, err := csi.NewControllerClient(conn).CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: name,
		VolumeCapabilities: []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}}})
	if err != nil {
		t.Fatal(err)
	}
	return resp.GetVolume().GetVolumeId()
}

func deleteVolume(t *testing.T, conn grpc.ClientConnInterface, id string) {
	t.Helper()
	if _, err := csi.NewControllerClient(conn).DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
		t.Fatal(err)
	}
}

// healthCalls are the driver's calls that ask about volumes.
var healthCalls = []string{"ListVolumes", "ControllerGetVolume", "ControllerGetVolumeHealth", "ControllerListVolumeHealth"}

func callsOf(d *sampledriver.Driver) map[string]int64 {
	out := map[string]int64{}
	for _, m := range healthCalls {
		if n := d.CallCount(m); n > 0 {
			out[m] = n
		}
	}
	return out
}

func sameCalls(a, b map[string]int64) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// TestSweepEveryMode runs one story through each way of asking: a volume
// marked abnormal, the same condition again, another message, recovery,
// a volume deleted behind the broker's back; and counts the calls of a
// sweep of three volumes.
func TestSweepEveryMode(t *testing.T) {
	for _, tc := range []struct {
		name   string
		health sampledriver.HealthConfig
		mode   mode
		// perSweep are the calls one sweep of three present volumes makes.
		perSweep map[string]int64
	}{
		{name: "health list", mode: modeHealthList, perSweep: map[string]int64{"ControllerListVolumeHealth": 1, "ListVolumes": 1}},
		{name: "health get", health: sampledriver.HealthConfig{NoListVolumeHealth: true}, mode: modeHealthGet, perSweep: map[string]int64{"ControllerGetVolumeHealth": 3}},
		{name: "condition list", health: sampledriver.HealthConfig{NoVolumeHealth: true}, mode: modeConditionList, perSweep: map[string]int64{"ListVolumes": 1}},
		{name: "condition get", health: sampledriver.HealthConfig{NoVolumeHealth: true, NoListVolumes: true}, mode: modeConditionGet, perSweep: map[string]int64{"ControllerGetVolume": 3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const drv = "sample.csibroker.io"
			conn, d := dialDriver(t, sampledriver.Config{Health: tc.health})
			h := newHarness(t, &fakeDrivers{conns: map[string]grpc.ClientConnInterface{drv: conn}})
			caps, err := h.env.Caps.Get(context.Background(), drv)
			if err != nil {
				t.Fatal(err)
			}
			if got := modeOf(caps); got != tc.mode {
				t.Fatalf("mode %v, want %v (caps %+v)", got, tc.mode, caps)
			}
			ids := []string{createVolume(t, conn, "a"), createVolume(t, conn, "b"), createVolume(t, conn, "c")}
			for i, id := range ids {
				h.addPV(fmt.Sprintf("pv-%d", i), drv, id, "")
			}
			before := callsOf(d)
			h.sweep(drv)
			h.wantEvents("healthy volumes")
			got := callsOf(d)
			for m, n := range before {
				got[m] -= n
				if got[m] == 0 {
					delete(got, m)
				}
			}
			if !sameCalls(got, tc.perSweep) {
				t.Errorf("one sweep of 3 volumes called %v, want %v", got, tc.perSweep)
			}

			if err := d.SetVolumeCondition(ids[0], true, "disk\x1b[31m failing"); err != nil {
				t.Fatal(err)
			}
			h.sweep(drv)
			h.wantEvents("marked abnormal", "Warning VolumeConditionAbnormal")
			if g := value(t, h.c.abnormal.WithLabelValues(drv)); g != 1 {
				t.Errorf("csibroker_volumes_abnormal %v, want 1", g)
			}
			h.sweep(drv)
			h.sweep(drv)
			h.wantEvents("the same condition twice more")
			if err := d.SetVolumeCondition(ids[0], true, "disk gone"); err != nil {
				t.Fatal(err)
			}
			h.sweep(drv)
			h.wantEvents("another message", "Warning VolumeConditionAbnormal")
			if err := d.SetVolumeCondition(ids[0], false, ""); err != nil {
				t.Fatal(err)
			}
			h.sweep(drv)
			h.wantEvents("recovered", "Normal VolumeConditionNormal")
			h.sweep(drv)
			h.wantEvents("normal again, stays")
			if g := value(t, h.c.abnormal.WithLabelValues(drv)); g != 0 {
				t.Errorf("csibroker_volumes_abnormal %v, want 0", g)
			}

			deleteVolume(t, conn, ids[1])
			h.sweep(drv)
			h.wantEvents("deleted behind the broker's back", "Warning VolumeNotFound")
			h.sweep(drv)
			h.wantEvents("still gone")
			if g := value(t, h.c.notFound.WithLabelValues(drv)); g != 1 {
				t.Errorf("csibroker_volumes_not_found %v, want 1", g)
			}
		})
	}
}

func TestSanitizedMessageInEvent(t *testing.T) {
	const drv = "sample.csibroker.io"
	conn, d := dialDriver(t, sampledriver.Config{Health: sampledriver.HealthConfig{NoVolumeHealth: true}})
	h := newHarness(t, &fakeDrivers{conns: map[string]grpc.ClientConnInterface{drv: conn}})
	id := createVolume(t, conn, "a")
	h.addPV("pv-a", drv, id, "")
	if err := d.SetVolumeCondition(id, true, "line one\nline\x00two "+strings.Repeat("x", 2000)); err != nil {
		t.Fatal(err)
	}
	h.sweep(drv)
	evs := h.events()
	if len(evs) != 1 {
		t.Fatalf("Events %q", evs)
	}
	msg := strings.TrimPrefix(evs[0], "Warning VolumeConditionAbnormal ")
	if !strings.HasPrefix(msg, "line one line two xxx") || len(msg) > 512 || strings.ContainsAny(msg, "\n\x00") {
		t.Fatalf("Event message not sanitized (%d bytes): %q", len(msg), msg)
	}
}

func TestDriverWithoutHealthIsNeverAsked(t *testing.T) {
	const drv = "sample.csibroker.io"
	conn, d := dialDriver(t, sampledriver.Config{Health: sampledriver.HealthConfig{NoVolumeHealth: true, NoVolumeCondition: true}})
	h := newHarness(t, &fakeDrivers{conns: map[string]grpc.ClientConnInterface{drv: conn}})
	h.addPV("pv-a", drv, createVolume(t, conn, "a"), "")
	for range 3 {
		h.sweep(drv)
	}
	if got := callsOf(d); len(got) != 0 {
		t.Fatalf("a driver without volume health was asked: %v", got)
	}
	if n := value(t, h.c.sweeps.WithLabelValues(drv, "none", "skipped")); n != 3 {
		t.Fatalf("%v skipped sweeps counted, want 3", n)
	}
	h.wantEvents("no health")
}

func TestDriverWithoutVolumesIsNotAsked(t *testing.T) {
	const drv = "sample.csibroker.io"
	conn, d := dialDriver(t, sampledriver.Config{})
	h := newHarness(t, &fakeDrivers{conns: map[string]grpc.ClientConnInterface{drv: conn}})
	createVolume(t, conn, "no-pv") // the driver's, not a PV's
	h.sweep(drv)
	if got := callsOf(d); len(got) != 0 || d.CallCount("GetPluginCapabilities") != 0 {
		t.Fatalf("a driver with no bound PVs was asked: %v", d.Calls())
	}
}

// TestForgetsRemovedPVs: a PV deleted from the cluster is forgotten, and
// a new PV of the same volume is news.
func TestForgetsRemovedPVs(t *testing.T) {
	const drv = "sample.csibroker.io"
	conn, d := dialDriver(t, sampledriver.Config{})
	h := newHarness(t, &fakeDrivers{conns: map[string]grpc.ClientConnInterface{drv: conn}})
	id := createVolume(t, conn, "a")
	pv := h.addPV("pv-a", drv, id, "")
	if err := d.SetVolumeCondition(id, true, "bad"); err != nil {
		t.Fatal(err)
	}
	h.sweep(drv)
	h.wantEvents("abnormal", "Warning VolumeConditionAbnormal")
	h.removePV(pv)
	h.sweep(drv)
	if n := len(h.c.states[drv]); n != 0 {
		t.Fatalf("%d states kept after the PV went", n)
	}
	h.addPV("pv-b", drv, id, "")
	h.sweep(drv)
	h.wantEvents("a new PV of the abnormal volume", "Warning VolumeConditionAbnormal")
}

// TestNodeLocalSweepsEachNode: each node plugin is asked about its own
// volumes only; one node's volumes are not "gone" from another's listing.
func TestNodeLocalSweepsEachNode(t *testing.T) {
	const drv = "sample.csibroker.io"
	connA, dA := dialDriver(t, sampledriver.Config{NodeID: "node-a", Health: sampledriver.HealthConfig{NoVolumeHealth: true}})
	connB, dB := dialDriver(t, sampledriver.Config{NodeID: "node-b", Health: sampledriver.HealthConfig{NoVolumeHealth: true}})
	h := newHarness(t, &fakeDrivers{nodes: map[string]map[string]grpc.ClientConnInterface{drv: {"node-a": connA, "node-b": connB}}})
	idA, idB := createVolume(t, connA, "a"), createVolume(t, connB, "b")
	h.addPV("pv-a", drv, idA, "node-a")
	h.addPV("pv-b", drv, idB, "node-b")
	h.addPV("pv-nowhere", drv, "lost", "") // names no node: skipped
	h.sweep(drv)
	h.sweep(drv)
	h.wantEvents("two healthy nodes")
	if dA.CallCount("ListVolumes") != 2 || dB.CallCount("ListVolumes") != 2 {
		t.Fatalf("ListVolumes calls: node a %d, node b %d; want 2 each", dA.CallCount("ListVolumes"), dB.CallCount("ListVolumes"))
	}
	if err := dB.SetVolumeCondition(idB, true, "node b's disk"); err != nil {
		t.Fatal(err)
	}
	h.sweep(drv)
	h.wantEvents("node b abnormal", "Warning VolumeConditionAbnormal node b's disk")
}

// fakeList is a driver with VOLUME_CONDITION and LIST_VOLUMES only (no
// per-volume method), whose ListVolumes answers list says.
type fakeList struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer
	list func(req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error)
}

func (f *fakeList) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{Capabilities: []*csi.PluginCapability{{Type: &csi.PluginCapability_Service_{
		Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_CONTROLLER_SERVICE}}}}}, nil
}

func (f *fakeList) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	var caps []*csi.ControllerServiceCapability
	for _, c := range []csi.ControllerServiceCapability_RPC_Type{csi.ControllerServiceCapability_RPC_LIST_VOLUMES, sampledriver.VolumeConditionCapability} {
		caps = append(caps, &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: c}}})
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: caps}, nil
}

func (f *fakeList) ListVolumes(_ context.Context, req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
	return f.list(req)
}

func serveFake(t *testing.T, srv *fakeList) grpc.ClientConnInterface {
	t.Helper()
	dir, err := os.MkdirTemp("", "hf")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "csi.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	csi.RegisterIdentityServer(s, srv)
	csi.RegisterControllerServer(s, srv)
	go s.Serve(lis)
	t.Cleanup(s.Stop)
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// TestBadListingConcludesNothing: a listing that loops, or names no
// volume, ends the sweep: no volume is reported gone from it.
func TestBadListingConcludesNothing(t *testing.T) {
	for _, tc := range []struct {
		name string
		list func(req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error)
	}{
		{name: "token loop", list: func(req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
			return &csi.ListVolumesResponse{Entries: []*csi.ListVolumesResponse_Entry{{Volume: &csi.Volume{VolumeId: "other"}}}, NextToken: "again"}, nil
		}},
		{name: "empty ID", list: func(req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
			return &csi.ListVolumesResponse{Entries: []*csi.ListVolumesResponse_Entry{{Volume: &csi.Volume{}}}}, nil
		}},
		{name: "more than asked", list: func(req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
			resp := &csi.ListVolumesResponse{}
			for i := range int(req.GetMaxEntries()) + 1 {
				resp.Entries = append(resp.Entries, &csi.ListVolumesResponse_Entry{Volume: &csi.Volume{VolumeId: fmt.Sprint("v", i)}})
			}
			return resp, nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const drv = "fake.csi.test"
			calls := 0
			conn := serveFake(t, &fakeList{list: func(req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
				calls++
				return tc.list(req)
			}})
			h := newHarness(t, &fakeDrivers{conns: map[string]grpc.ClientConnInterface{drv: conn}})
			h.addPV("pv-a", drv, "vol-a", "")
			for range 3 {
				h.sweep(drv)
			}
			h.wantEvents("bad listings")
			if calls > 3*2 {
				t.Fatalf("%d ListVolumes calls for 3 sweeps: the loop was followed", calls)
			}
			if n := value(t, h.c.sweeps.WithLabelValues(drv, "condition-list", "failed")); n != 3 {
				t.Fatalf("%v failed sweeps counted, want 3", n)
			}
		})
	}
}

// TestAbsentTwiceIsGone: without a per-volume method, one absence from a
// listing is not enough (a listing may miss a volume while it pages); the
// second in a row is.
func TestAbsentTwiceIsGone(t *testing.T) {
	const drv = "fake.csi.test"
	has := true
	conn := serveFake(t, &fakeList{list: func(req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
		resp := &csi.ListVolumesResponse{}
		if has {
			resp.Entries = append(resp.Entries, &csi.ListVolumesResponse_Entry{Volume: &csi.Volume{VolumeId: "vol-a"}})
		}
		return resp, nil
	}})
	h := newHarness(t, &fakeDrivers{conns: map[string]grpc.ClientConnInterface{drv: conn}})
	h.addPV("pv-a", drv, "vol-a", "")
	h.sweep(drv)
	has = false
	h.sweep(drv)
	h.wantEvents("absent once")
	has = true
	h.sweep(drv)
	has = false
	h.sweep(drv)
	h.wantEvents("absent once again, after a listing that held it")
	h.sweep(drv)
	h.wantEvents("absent twice in a row", "Warning VolumeNotFound")
	has = true
	h.sweep(drv)
	h.wantEvents("back", "Normal VolumeConditionNormal")
}

func TestTransition(t *testing.T) {
	v := volumeInfo{driver: "d", handle: "h", pv: "pv"}
	normal := seen{kind: seenPresent}
	bad := func(m string) seen {
		return seen{kind: seenPresent, cond: csiparams.Condition{Abnormal: true, Message: m}}
	}
	for _, tc := range []struct {
		name   string
		prev   *volState
		s      seen
		want   stateKind
		reason string
	}{
		{name: "first normal", s: normal, want: stateNormal},
		{name: "first abnormal", s: bad("x"), want: stateAbnormal, reason: ReasonAbnormal},
		{name: "first gone", s: seen{kind: seenGone}, want: stateGone, reason: ReasonNotFound},
		{name: "first absent", s: seen{kind: seenAbsent}, want: stateNormal},
		{name: "abnormal same", prev: &volState{kind: stateAbnormal, msg: "x"}, s: bad("x"), want: stateAbnormal},
		{name: "abnormal new message", prev: &volState{kind: stateAbnormal, msg: "x"}, s: bad("y"), want: stateAbnormal, reason: ReasonAbnormal},
		{name: "recovery", prev: &volState{kind: stateAbnormal, msg: "x"}, s: normal, want: stateNormal, reason: ReasonNormal},
		{name: "back from gone", prev: &volState{kind: stateGone}, s: normal, want: stateNormal, reason: ReasonNormal},
		{name: "back from gone abnormal", prev: &volState{kind: stateGone}, s: bad("x"), want: stateAbnormal, reason: ReasonAbnormal},
		{name: "gone again", prev: &volState{kind: stateGone}, s: seen{kind: seenGone}, want: stateGone},
		{name: "abnormal then absent once", prev: &volState{kind: stateAbnormal, msg: "x"}, s: seen{kind: seenAbsent}, want: stateAbnormal},
		{name: "absent twice", prev: &volState{kind: stateNormal, absent: 1}, s: seen{kind: seenAbsent}, want: stateGone, reason: ReasonNotFound},
		{name: "gone, absent", prev: &volState{kind: stateGone, absent: 3}, s: seen{kind: seenAbsent}, want: stateGone},
		{name: "abnormal, empty message", prev: nil, s: bad(""), want: stateAbnormal, reason: ReasonAbnormal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			next, ev := transition(tc.prev, tc.s, v)
			if next.kind != tc.want {
				t.Errorf("state %v, want %v", next.kind, tc.want)
			}
			switch {
			case tc.reason == "" && ev != nil:
				t.Errorf("Event %+v, want none", ev)
			case tc.reason != "" && (ev == nil || ev.reason != tc.reason):
				t.Errorf("Event %+v, want reason %s", ev, tc.reason)
			case ev != nil && ev.msg == "":
				t.Errorf("Event without a message")
			}
		})
	}
}

func TestModeOf(t *testing.T) {
	for _, tc := range []struct {
		caps drivers.Caps
		want mode
	}{
		{drivers.Caps{}, modeNone},
		{drivers.Caps{ListVolumes: true, GetVolume: true}, modeNone},
		{drivers.Caps{VolumeCondition: true}, modeNone},
		{drivers.Caps{VolumeCondition: true, GetVolume: true}, modeConditionGet},
		{drivers.Caps{VolumeCondition: true, GetVolume: true, ListVolumes: true}, modeConditionList},
		{drivers.Caps{GetVolumeHealth: true, VolumeCondition: true, ListVolumes: true}, modeHealthGet},
		{drivers.Caps{GetVolumeHealth: true, ListVolumeHealth: true}, modeHealthList},
	} {
		if got := modeOf(tc.caps); got != tc.want {
			t.Errorf("modeOf(%+v) = %v, want %v", tc.caps, got, tc.want)
		}
	}
}

// TestUnregisteredDriverForgotten: a driver no longer registered loses
// its states and its gauges; Run's end clears every gauge (a standby
// exports nothing of the last term).
func TestUnregisteredDriverForgotten(t *testing.T) {
	const drv = "sample.csibroker.io"
	conn, d := dialDriver(t, sampledriver.Config{})
	h := newHarness(t, &fakeDrivers{conns: map[string]grpc.ClientConnInterface{drv: conn}})
	id := createVolume(t, conn, "a")
	h.addPV("pv-a", drv, id, "")
	if err := d.SetVolumeCondition(id, true, "bad"); err != nil {
		t.Fatal(err)
	}
	h.sweep(drv)
	series := func() int { return promCount(h.c.abnormal) }
	if n := series(); n != 1 {
		t.Fatalf("%d abnormal series, want 1", n)
	}
	h.c.forgetUnregistered([]string{drv})
	if n := series(); n != 1 || len(h.c.states) != 1 {
		t.Fatalf("a registered driver was forgotten (%d series, %d states)", n, len(h.c.states))
	}
	h.c.forgetUnregistered(nil)
	if n := series(); n != 0 || len(h.c.states) != 0 {
		t.Fatalf("an unregistered driver kept %d series, %d states", n, len(h.c.states))
	}

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); h.c.Run(ctx) }()
	deadline := time.Now().Add(10 * time.Second)
	for len(h.events()) == 0 { // the first sweep of the term reports the volume again
		if time.Now().After(deadline) {
			t.Fatal("the term's first sweep recorded no Event in 10s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	<-done
	if n := series(); n != 0 {
		t.Fatalf("%d abnormal series left after the term", n)
	}
}

// promCount is how many series a collector holds.
func promCount(c prometheus.Collector) int {
	ch := make(chan prometheus.Metric, 100)
	c.Collect(ch)
	close(ch)
	return len(ch)
}
