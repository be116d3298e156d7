package k8sbridge

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math"
	"net"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/rawgrpc"
)

// mostVerbose enables every log record, whatever its level: secrets must not
// appear at any verbosity.
const mostVerbose = slog.Level(math.MinInt)

// verboseChain makes a chain's broker and proxy log at every level.
func verboseChain(o *chaintest.Options) { o.LogLevel = mostVerbose }

// assertNoCanary fails the test for every place the canary secret value
// shows up: Events (all namespaces: those of cluster-scoped objects go to
// "default"), the claims of ns, PersistentVolumes and VolumeAttachments
// (their status holds errors), the bridge's log, each driver chain's broker
// and proxy log, every span of the bridge and the chains (names, attribute
// keys and values, events and their attributes, links, status
// descriptions) and every metric of the bridge's and the chains'
// registries.
func assertNoCanary(t *testing.T, c kubernetes.Interface, ns string, r *bridgeRun, drivers *testDrivers, canary string) {
	t.Helper()
	ctx := context.Background()
	leak := func(where, text string) {
		t.Helper()
		if i := strings.Index(text, canary); i >= 0 {
			from, to := max(0, i-120), min(len(text), i+len(canary)+40)
			t.Errorf("canary secret in %s: %q", where, "..."+text[from:to]+"...")
		}
	}
	apiObjects := func(what string, list func() (any, error)) {
		t.Helper()
		objs, err := list()
		if err != nil {
			t.Fatalf("list %s: %v", what, err)
		}
		b, err := json.Marshal(objs)
		if err != nil {
			t.Fatal(err)
		}
		leak(what, string(b))
	}
	apiObjects("Events", func() (any, error) { return c.CoreV1().Events("").List(ctx, metav1.ListOptions{}) })
	apiObjects("claims of "+ns, func() (any, error) { return c.CoreV1().PersistentVolumeClaims(ns).List(ctx, metav1.ListOptions{}) })
	apiObjects("PersistentVolumes", func() (any, error) { return c.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{}) })
	apiObjects("VolumeAttachments", func() (any, error) { return c.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{}) })

	leak("the bridge's log", r.logs.String())
	canaryInSpans(t, "the bridge's span", r.spans, leak)
	canaryInMetrics(t, "the bridge's metrics", r.reg, leak)
	chains := drivers.allChains()
	if len(chains) == 0 {
		t.Fatal("no driver chain to search for the canary")
	}
	for name, ch := range chains {
		leak("the broker and proxy log of "+name, ch.Logs.String())
		canaryInSpans(t, "a span of "+name+"'s chain", ch.Spans, leak)
		canaryInMetrics(t, "the metrics of "+name+"'s chain", ch.Registry, leak)
	}
}

// allChains returns every chain of the drivers by a readable name.
func (t *testDrivers) allChains() map[string]*chaintest.Chain {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[string]*chaintest.Chain{}
	for d, c := range t.chains {
		out["driver "+d] = c
	}
	for d, nodes := range t.nodeChains {
		for n, c := range nodes {
			out["driver "+d+" on node "+n] = c
		}
	}
	return out
}

func canaryInSpans(t *testing.T, what string, rec *tracetest.SpanRecorder, leak func(where, text string)) {
	t.Helper()
	if rec == nil {
		return
	}
	for _, s := range rec.Started() { // ended or not
		var b strings.Builder
		fmt.Fprintf(&b, "name=%s status=%s", s.Name(), s.Status().Description)
		for _, a := range s.Attributes() {
			fmt.Fprintf(&b, " attr %s=%s", a.Key, a.Value.String())
		}
		for _, e := range s.Events() {
			fmt.Fprintf(&b, " event %s", e.Name)
			for _, a := range e.Attributes {
				fmt.Fprintf(&b, " %s=%s", a.Key, a.Value.String())
			}
		}
		for _, l := range s.Links() {
			for _, a := range l.Attributes {
				fmt.Fprintf(&b, " link %s=%s", a.Key, a.Value.String())
			}
		}
		leak(what+" "+s.Name(), b.String())
	}
}

func canaryInMetrics(t *testing.T, what string, g prometheus.Gatherer, leak func(where, text string)) {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	for _, mf := range mfs {
		leak(what+" ("+mf.GetName()+")", mf.String()) // name, help, labels, values
	}
}

// driverTap sits between a proxy and the sample driver's socket and passes
// every call through as it came, undecoded; it decodes a copy of each
// CreateVolume request on the way, so a test can see what reached the
// driver, secrets included (the driver keeps its requests without them).
type driverTap struct {
	mu      sync.Mutex
	creates []*csi.CreateVolumeRequest
}

// insert returns a chain option that puts the tap in front of the chain's
// driver socket.
func (d *driverTap) insert(t *testing.T) func(*chaintest.Options) {
	return func(o *chaintest.Options) { o.DriverEndpoint = d.start(t, o.DriverEndpoint) }
}

func (d *driverTap) start(t *testing.T, driverEndpoint string) string {
	t.Helper()
	conn, err := grpc.NewClient(driverEndpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	srv := grpc.NewServer(grpc.ForceServerCodecV2(rawgrpc.Codec{}), grpc.UnknownServiceHandler(func(_ any, ss grpc.ServerStream) error {
		method, _ := grpc.MethodFromServerStream(ss)
		in := &rawgrpc.Frame{}
		if err := ss.RecvMsg(in); err != nil {
			return err
		}
		if method == csi.Controller_CreateVolume_FullMethodName {
			req := &csi.CreateVolumeRequest{}
			if err := proto.Unmarshal(in.Payload, req); err != nil {
				return err
			}
			d.mu.Lock()
			d.creates = append(d.creates, req)
			d.mu.Unlock()
		}
		out := &rawgrpc.Frame{}
		if err := conn.Invoke(ss.Context(), method, in, out, rawgrpc.CallOption()); err != nil {
			return err // the driver's status, as it was
		}
		return ss.SendMsg(out)
	}))
	path := filepath.Join(chaintest.ShortTempDir(t), "tap.sock")
	lis, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	return "unix://" + path
}

// createSecrets returns the secrets of every CreateVolume request for
// volume name that reached the driver.
func (d *driverTap) createSecrets(name string) []map[string]string {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []map[string]string
	for _, r := range d.creates {
		if r.GetName() == name {
			out = append(out, r.GetSecrets())
		}
	}
	return out
}

// createNames lists the volume names of the CreateVolume requests seen.
func (d *driverTap) createNames() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []string
	for _, r := range d.creates {
		out = append(out, r.GetName())
	}
	sort.Strings(out)
	return out
}
