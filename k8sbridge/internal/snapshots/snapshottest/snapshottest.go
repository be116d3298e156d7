// Package snapshottest is the fast-test harness of the snapshot
// controllers: sample drivers behind their real chains with every call
// recorded, and a kube.Env over fake clientsets. It imports no
// controller; tests only.
package snapshottest

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapfake "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned/fake"
	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"

	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/k8sbridge/intent"
	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/policy"
)

// Drivers reaches sample drivers through their real chains (broker
// client chain, proxy over mTLS, driver socket); Hook sees each
// controller call before it is sent and may answer it instead.
type Drivers struct {
	chains map[string]*chaintest.Chain
	mu     sync.Mutex
	calls  map[string][]any // method → requests, in order
	Hook   func(method string, args any) error
}

var _ drivers.Drivers = (*Drivers)(nil)

// Add starts a sample driver of cfg (its log discarded) and its chain.
func (d *Drivers) Add(t *testing.T, cfg sampledriver.Config) *sampledriver.Driver {
	t.Helper()
	cfg.Logger = slog.New(slog.DiscardHandler)
	ep, drv := sampledriver.StartTest(t, cfg)
	if d.chains == nil {
		d.chains, d.calls = map[string]*chaintest.Chain{}, map[string][]any{}
	}
	d.chains[cfg.Name] = chaintest.Start(t, chaintest.Options{Driver: cfg.Name, DriverEndpoint: ep, LogLevel: slog.LevelWarn, Timeout: 30 * time.Second})
	return drv
}

func (d *Drivers) ControllerConn(drv string) (grpc.ClientConnInterface, error) {
	c, ok := d.chains[drv]
	if !ok {
		return nil, fmt.Errorf("unknown driver %q", drv)
	}
	conn, err := c.Broker.ControllerConn(drv)
	return recordingConn{conn, d}, err
}
func (d *Drivers) NodeConn(drv, node string) (grpc.ClientConnInterface, error) {
	return nil, fmt.Errorf("driver %q has no node proxies here", drv)
}
func (d *Drivers) NodeLocal(string) bool       { return false }
func (d *Drivers) DriverNodes(string) []string { return nil }
func (d *Drivers) HasDriver(drv string) bool   { _, ok := d.chains[drv]; return ok }
func (d *Drivers) DriverNames() []string       { return slices.Sorted(maps.Keys(d.chains)) }
func (d *Drivers) CallTimeout(string, string) time.Duration {
	return 0
}

// Requests are the requests of method sent so far, in order.
func (d *Drivers) Requests(method string) []any {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.calls[method])
}

// Reset forgets the requests sent so far.
func (d *Drivers) Reset() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.calls = map[string][]any{}
}

// Volume makes a 1Mi volume at driver and returns its ID.
func (d *Drivers) Volume(t *testing.T, ctx context.Context, driver, name string) string {
	t.Helper()
	conn, _ := d.ControllerConn(driver)
	resp, err := csi.NewControllerClient(conn).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}}})
	if err != nil {
		t.Fatal(err)
	}
	return resp.GetVolume().GetVolumeId()
}

type recordingConn struct {
	grpc.ClientConnInterface
	d *Drivers
}

func (c recordingConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	short := method[strings.LastIndex(method, "/")+1:]
	c.d.mu.Lock()
	c.d.calls[short] = append(c.d.calls[short], args)
	hook := c.d.Hook
	c.d.mu.Unlock()
	if hook != nil {
		if err := hook(short, args); err != nil {
			return err
		}
	}
	return c.ClientConnInterface.Invoke(ctx, method, args, reply, opts...)
}

// Clients are fake clientsets: Kubernetes with namespace app and its
// secret creds (password hunter2), serving resources of groupVersion,
// and the snapshot API's holding objs.
func Clients(groupVersion string, resources []string, objs ...runtime.Object) (*fake.Clientset, *snapfake.Clientset) {
	k := fake.NewClientset(&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "app"}},
		&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "creds", Namespace: "app"}, Data: map[string][]byte{"password": []byte("hunter2")}})
	list := &metav1.APIResourceList{GroupVersion: groupVersion}
	for _, r := range resources {
		list.APIResources = append(list.APIResources, metav1.APIResource{Name: r})
	}
	k.Resources = []*metav1.APIResourceList{list}
	//lint:ignore SA1019 the snapshot client module generates no NewClientset (no apply configurations)
	return k, snapfake.NewSimpleClientset(objs...)
}

// Env is an Env of cfg (its clients and drivers set) with fast retries,
// extra create metadata and a policy that allows everything (off) or
// nothing (enforced); its Events go to the recorder returned.
func Env(t *testing.T, cfg kube.Config, policyAllows bool) (*kube.Env, []cache.InformerSynced, *record.FakeRecorder) {
	t.Helper()
	st := policy.NewStore(nil)
	if policyAllows {
		st.SetMode(policy.ModeOff)
	} else {
		st.SetMode(policy.ModeEnforce)
	}
	cfg.Policy, cfg.Namespace = &policy.Authorizer{Rules: st}, "csibroker"
	cfg.RetryIntervalStart, cfg.RetryIntervalMax, cfg.ExtraCreateMetadata = 10*time.Millisecond, time.Second, true
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	env, synced, err := kube.NewEnv(cfg)
	if err != nil {
		t.Fatal(err)
	}
	events := record.NewFakeRecorder(100)
	env.Recorder = events
	return env, synced, events
}

// Start starts env's handlers and informers, waits for their caches and
// runs record r's writer for a term; all of it ends with the test, as
// does the context returned.
func Start[T intent.Entry](t *testing.T, env *kube.Env, synced []cache.InformerSynced, r *intent.Record[T]) context.Context {
	t.Helper()
	if err := env.StartHandlers(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	env.Factory.Start(ctx.Done())
	t.Cleanup(env.Factory.Shutdown)
	if !cache.WaitForCacheSync(ctx.Done(), append(synced, env.TakeSynced()...)...) {
		t.Fatal("caches did not sync")
	}
	r.StartTerm()
	done := make(chan struct{})
	go func() { defer close(done); r.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return ctx
}

// Object is a content: its metadata and a status.
type Object interface {
	metav1.Object
	metav1.ObjectMetaAccessor
}

// WaitCache waits until cached holds what api holds of object name (the
// same metadata and status, or neither holds it).
func WaitCache[C Object](t *testing.T, name string, api, cached func(string) (C, error), status func(C) any) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		want, err := api(name)
		got, lerr := cached(name)
		if err != nil && lerr != nil {
			return
		}
		if err == nil && lerr == nil && equality.Semantic.DeepEqual(want.GetObjectMeta(), got.GetObjectMeta()) && equality.Semantic.DeepEqual(status(want), status(got)) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("content %s: the cache did not catch up", name)
}

// Event waits for an Event of reason saying want.
func Event(t *testing.T, events *record.FakeRecorder, reason, want string) {
	t.Helper()
	for {
		select {
		case e := <-events.Events:
			if strings.Contains(e, reason) && strings.Contains(e, want) {
				return
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("no %s Event saying %q", reason, want)
		}
	}
}
