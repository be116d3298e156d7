package proxy

import (
	"context"
	"crypto/tls"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/csibroker/csibroker/internal/fakekubelet"
	"github.com/csibroker/csibroker/internal/testutil"
)

// identityDriver is a CSI driver of Identity and NodeGetInfo only, whose
// Probe can be made to hang or to answer not ready, and which can be
// restarted (its socket re-created) under another name.
type identityDriver struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedNodeServer
	sock     string
	hang     atomic.Bool // Probe
	hangInfo atomic.Bool // GetPluginInfo
	notReady atomic.Bool
	name     atomic.Value // string

	mu  sync.Mutex
	srv *grpc.Server
}

func (d *identityDriver) GetPluginInfo(ctx context.Context, _ *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	if d.hangInfo.Load() {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return &csi.GetPluginInfoResponse{Name: d.name.Load().(string), VendorVersion: "1"}, nil
}

func (d *identityDriver) Probe(ctx context.Context, _ *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	if d.hang.Load() {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(!d.notReady.Load())}, nil
}

func (d *identityDriver) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{NodeId: "node-1", AccessibleTopology: &csi.Topology{
		Segments: map[string]string{"topology.test/node": "node-1"}}}, nil
}

// start serves the driver on its socket, removing an old one (a restart).
func (d *identityDriver) start(t testing.TB) {
	t.Helper()
	d.stop()
	os.Remove(d.sock)
	lis, err := net.Listen("unix", d.sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	csi.RegisterIdentityServer(srv, d)
	csi.RegisterNodeServer(srv, d)
	go srv.Serve(lis)
	d.mu.Lock()
	d.srv = srv
	d.mu.Unlock()
}

func (d *identityDriver) stop() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.srv != nil {
		d.srv.Stop()
		d.srv = nil
	}
}

func startIdentityDriver(t testing.TB, name string) *identityDriver {
	t.Helper()
	d := &identityDriver{sock: filepath.Join(testutil.ShortTempDir(t), "csi.sock")}
	d.name.Store(name)
	d.start(t)
	t.Cleanup(d.stop)
	return d
}

func get(h http.Handler, path string) (int, string) {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	return rec.Code, rec.Body.String()
}

// TestHealthzFollowsProbe: /healthz and /healthz/driver are the driver's
// liveness (it answers Probe within ProbeTimeout; "not ready" is still
// alive), /readyz its readiness, /livez the proxy's own health. A driver
// whose Probe hangs turns /healthz red within ProbeTimeout, and green
// again when it answers.
func TestHealthzFollowsProbe(t *testing.T) {
	d := startIdentityDriver(t, "x.csi.test")
	const probeTimeout = 300 * time.Millisecond
	tp := startProxy(t, "unix://"+d.sock, Config{ProbeTimeout: probeTimeout})
	h := tp.p.HTTPHandler("/metrics")
	want := func(path string, code int, body string) {
		t.Helper()
		start := time.Now()
		got, b := get(h, path)
		if took := time.Since(start); took > probeTimeout+200*time.Millisecond {
			t.Errorf("%s took %v, more than the probe timeout %v", path, took, probeTimeout)
		}
		if got != code || !strings.Contains(b, body) {
			t.Errorf("%s = %d %q, want %d with %q", path, got, b, code, body)
		}
	}
	want("/healthz", 200, "driver: ok\nproxy: ok\n")
	want("/healthz/driver", 200, "driver: ok\n")
	want("/readyz", 200, "driver: ok\n")
	want("/livez", 200, "proxy: ok\n")

	d.notReady.Store(true)
	want("/healthz", 200, "driver: ok")
	want("/readyz", 503, "not ready")

	d.notReady.Store(false)
	d.hang.Store(true)
	want("/healthz", 503, "driver: failed: ")
	want("/healthz/driver", 503, "DeadlineExceeded")
	want("/livez", 200, "proxy: ok") // the proxy itself is fine
	want("/readyz", 503, "DeadlineExceeded")

	d.hang.Store(false)
	want("/healthz", 200, "driver: ok")

	// A driver that is gone is not alive either.
	d.stop()
	want("/healthz/driver", 503, "driver: failed: ")
}

// TestKubeletRegistration: a node proxy with a kubelet registration path
// registers its driver with a kubelet built on the kubelet's own
// plugin-registration API (internal/fakekubelet, which watches the
// registry directory as the kubelet does): the right name and endpoint,
// version 1.0.0 and type CSIPlugin; registered again after the driver
// restarts under another name, and after the registration socket is
// removed; /livez fails while the socket is gone; deregistered when the
// proxy stops.
func TestKubeletRegistration(t *testing.T) {
	d := startIdentityDriver(t, "x.csi.test")
	regDir := testutil.ShortTempDir(t)
	// The kubelet sees the driver's socket where the proxy does here.
	tp := startProxy(t, "unix://"+d.sock, Config{Node: "node-1", KubeletRegistrationPath: d.sock,
		PluginRegistrationDir: regDir, RegistrationCheckInterval: 20 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	kctx, stopKubelet := context.WithCancel(ctx)
	defer stopKubelet()
	k := &fakekubelet.Kubelet{Dir: regDir, Interval: 20 * time.Millisecond}
	go k.Run(kctx)
	proxyCtx, stopProxy := context.WithCancel(ctx)
	regDone := make(chan struct{})
	go func() { tp.p.RunRegistration(proxyCtx); close(regDone) }()
	defer func() { stopProxy(); <-regDone }()

	n := 0
	next := func(kind, name string) fakekubelet.Event {
		t.Helper()
		evs, err := k.WaitEvent(ctx, n)
		if err != nil {
			t.Fatal(err)
		}
		ev := evs[n]
		n++
		if ev.Kind != kind || ev.Name != name {
			t.Fatalf("event %d: %+v, want %s %s", n, ev, kind, name)
		}
		return ev
	}
	ev := next("registered", "x.csi.test")
	if ev.Socket != filepath.Join(regDir, "x.csi.test-reg.sock") || ev.Endpoint != d.sock || ev.NodeID != "node-1" ||
		ev.Topology["topology.test/node"] != "node-1" {
		t.Errorf("registration %+v: want socket %s/x.csi.test-reg.sock, endpoint %s, node node-1 with its topology", ev, regDir, d.sock)
	}
	waitLog := func(s string) {
		t.Helper()
		for !strings.Contains(tp.logs.String(), s) {
			if ctx.Err() != nil {
				t.Fatalf("no log %q:\n%s", s, tp.logs.String())
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	waitLog("the kubelet registered the driver")
	if code, body := get(tp.p.HTTPHandler(""), "/livez"); code != 200 || body != "registration: ok\n" {
		t.Errorf("/livez = %d %q", code, body)
	}

	// The driver restarts under another name: the old registration goes,
	// the new one comes.
	d.name.Store("y.csi.test")
	d.start(t)
	next("deregistered", "x.csi.test")
	ev = next("registered", "y.csi.test")
	if ev.Socket != filepath.Join(regDir, "y.csi.test-reg.sock") || ev.Endpoint != d.sock {
		t.Errorf("after the restart: %+v", ev)
	}

	// The same name, a new socket: registered again.
	d.start(t)
	next("deregistered", "y.csi.test")
	next("registered", "y.csi.test")

	// Someone removes the registration socket: the proxy re-creates it.
	if err := os.Remove(ev.Socket); err != nil {
		t.Fatal(err)
	}
	next("deregistered", "y.csi.test")
	next("registered", "y.csi.test")
	waitLog("the registration socket was removed or replaced; re-creating it")

	// The proxy stops: the socket goes, and the driver with it.
	stopProxy()
	<-regDone
	next("deregistered", "y.csi.test")
	if ents, _ := os.ReadDir(regDir); len(ents) != 0 {
		t.Errorf("registry directory after the proxy stopped: %v", ents)
	}
	if evs := k.Events(); len(evs) != n {
		t.Errorf("more events than expected: %+v", evs[n:])
	}
}

// TestRegistrationHealth: /livez and /healthz fail while the registration
// socket is gone, and pass again once it is back.
func TestRegistrationHealth(t *testing.T) {
	d := startIdentityDriver(t, "x.csi.test")
	regDir := testutil.ShortTempDir(t)
	tp := startProxy(t, "unix://"+d.sock, Config{Node: "node-1", KubeletRegistrationPath: "/var/lib/kubelet/plugins/x/csi.sock",
		PluginRegistrationDir: regDir, ProbeTimeout: time.Second})
	r := tp.p.reg
	ctx := context.Background()
	h := tp.p.HTTPHandler("")
	if code, body := get(h, "/livez"); code != 200 {
		t.Errorf("/livez before the driver told its name: %d %q, want ok (nothing to check yet)", code, body)
	}
	r.sync(ctx) // registered
	sock := filepath.Join(regDir, "x.csi.test-reg.sock")
	if _, err := os.Stat(sock); err != nil {
		t.Fatal(err)
	}
	if code, _ := get(h, "/healthz"); code != 200 {
		t.Errorf("/healthz = %d", code)
	}
	os.Remove(sock)
	for _, path := range []string{"/livez", "/healthz"} {
		if code, body := get(h, path); code != 503 || !strings.Contains(body, "registration: failed: registration socket "+sock+" is gone") {
			t.Errorf("%s with the socket gone = %d %q", path, code, body)
		}
	}
	if code, _ := get(h, "/healthz/driver"); code != 200 {
		t.Errorf("/healthz/driver = %d: the driver is fine", code)
	}
	r.sync(ctx) // re-created
	if code, body := get(h, "/livez"); code != 200 {
		t.Errorf("/livez after the socket was re-created: %d %q", code, body)
	}

	// The driver restarts and hangs in GetPluginInfo: /livez answers at
	// once meanwhile (the registration holds no lock while it asks).
	d.hangInfo.Store(true)
	d.start(t)
	for tp.p.Alive(ctx) != nil { // the proxy has reconnected
		time.Sleep(10 * time.Millisecond)
	}
	synced := make(chan struct{})
	go func() { r.sync(ctx); close(synced) }()
	time.Sleep(100 * time.Millisecond)
	start := time.Now()
	if code, _ := get(h, "/livez"); code != 200 || time.Since(start) > 100*time.Millisecond {
		t.Errorf("/livez while the driver hangs in GetPluginInfo: %d after %v", code, time.Since(start))
	}
	select {
	case <-synced:
		t.Error("sync returned before GetPluginInfo timed out: the hang was not exercised")
	default:
	}
	<-synced
	if !strings.Contains(tp.logs.String(), "cannot register the driver with the kubelet until it tells its name") {
		t.Errorf("the hung GetPluginInfo was not logged:\n%s", tp.logs)
	}
}

// TestRegistrationConfig: registration is for node proxies, with an
// absolute path.
func TestRegistrationConfig(t *testing.T) {
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{Config{KubeletRegistrationPath: "/k/csi.sock"}, "needs the node"},
		{Config{Node: "n", KubeletRegistrationPath: "k/csi.sock"}, "not an absolute path"},
	} {
		c.cfg.DriverEndpoint, c.cfg.TLS = "unix:///csi.sock", &tls.Config{}
		if err := c.cfg.Validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want %q", c.cfg, err, c.want)
		}
	}
	cfg := Config{DriverEndpoint: "unix:///csi.sock", TLS: &tls.Config{}, Node: "n", KubeletRegistrationPath: "/k/csi.sock"}
	if err := cfg.Validate(); err != nil || cfg.PluginRegistrationDir != DefaultPluginRegistrationDir {
		t.Errorf("defaults: %v, dir %q", err, cfg.PluginRegistrationDir)
	}
}
