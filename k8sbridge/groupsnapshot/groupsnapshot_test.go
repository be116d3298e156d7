package groupsnapshot

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
	groupv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapfake "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned/fake"
	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"

	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/policy"
)

// chainDrivers reaches sample drivers through their real chains (broker
// client chain, proxy over mTLS, driver socket); hook sees each call
// before it is sent and may answer it instead.
type chainDrivers struct {
	chains map[string]*chaintest.Chain
	mu     sync.Mutex
	calls  map[string][]any // method → requests, in order
	hook   func(method string, args any) error
}

var _ drivers.Drivers = (*chainDrivers)(nil)

func (d *chainDrivers) add(t *testing.T, cfg sampledriver.Config) *sampledriver.Driver {
	t.Helper()
	cfg.Logger = slog.New(slog.DiscardHandler)
	ep, drv := sampledriver.StartTest(t, cfg)
	if d.chains == nil {
		d.chains, d.calls = map[string]*chaintest.Chain{}, map[string][]any{}
	}
	d.chains[cfg.Name] = chaintest.Start(t, chaintest.Options{Driver: cfg.Name, DriverEndpoint: ep, LogLevel: slog.LevelWarn, Timeout: 30 * time.Second})
	return drv
}

func (d *chainDrivers) ControllerConn(drv string) (grpc.ClientConnInterface, error) {
	c, ok := d.chains[drv]
	if !ok {
		return nil, fmt.Errorf("unknown driver %q", drv)
	}
	conn, err := c.Broker.ControllerConn(drv)
	return recordingConn{conn, d}, err
}
func (d *chainDrivers) NodeConn(drv, node string) (grpc.ClientConnInterface, error) {
	return nil, fmt.Errorf("driver %q has no node proxies here", drv)
}
func (d *chainDrivers) NodeLocal(string) bool       { return false }
func (d *chainDrivers) DriverNodes(string) []string { return nil }
func (d *chainDrivers) HasDriver(drv string) bool   { _, ok := d.chains[drv]; return ok }
func (d *chainDrivers) DriverNames() []string       { return slices.Sorted(maps.Keys(d.chains)) }
func (d *chainDrivers) CallTimeout(string, string) time.Duration {
	return 0
}

func (d *chainDrivers) requests(method string) []any {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.calls[method])
}

type recordingConn struct {
	grpc.ClientConnInterface
	d *chainDrivers
}

func (c recordingConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	short := method[strings.LastIndex(method, "/")+1:]
	c.d.mu.Lock()
	c.d.calls[short] = append(c.d.calls[short], args)
	hook := c.d.hook
	c.d.mu.Unlock()
	if hook != nil {
		if err := hook(short, args); err != nil {
			return err
		}
	}
	return c.ClientConnInterface.Invoke(ctx, method, args, reply, opts...)
}

// fixture is one controller over fake clientsets and real sample drivers:
// drv with group snapshots, plainDrv without.
type fixture struct {
	t       *testing.T
	c       *Controller
	kube    *fake.Clientset
	snaps   *snapfake.Clientset
	drivers *chainDrivers
	d       *sampledriver.Driver
	events  *record.FakeRecorder
	ctx     context.Context
}

const (
	drv      = "group.csi.test"
	plainDrv = "plain.csi.test"
	groupUID = "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
)

func newFixture(t *testing.T, policyAllows bool, objs ...runtime.Object) *fixture {
	t.Helper()
	return newFixtureWith(t, sampledriver.Config{}, policyAllows, objs...)
}

// newFixtureWith is newFixture with drv's configuration (its name is set).
func newFixtureWith(t *testing.T, cfg sampledriver.Config, policyAllows bool, objs ...runtime.Object) *fixture {
	t.Helper()
	f := &fixture{t: t, drivers: &chainDrivers{}}
	cfg.Name = drv
	f.d = f.drivers.add(t, cfg)
	f.drivers.add(t, sampledriver.Config{Name: plainDrv, DisableGroupSnapshots: true})
	f.kube = fake.NewClientset(&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "app"}},
		&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "creds", Namespace: "app"}, Data: map[string][]byte{"password": []byte("hunter2")}})
	f.kube.Resources = []*metav1.APIResourceList{{GroupVersion: Group + "/" + Version, APIResources: []metav1.APIResource{
		{Name: "volumegroupsnapshotcontents"}, {Name: "volumegroupsnapshotclasses"}, {Name: "volumegroupsnapshots"}}}}
	//lint:ignore SA1019 the snapshot client module generates no NewClientset (no apply configurations)
	f.snaps = snapfake.NewSimpleClientset(objs...)
	st := policy.NewStore(nil)
	if policyAllows {
		st.SetMode(policy.ModeOff)
	} else {
		st.SetMode(policy.ModeEnforce)
	}
	kcfg := kube.Config{Client: f.kube, SnapshotClient: f.snaps, Drivers: f.drivers, Policy: &policy.Authorizer{Rules: st}, Namespace: "csibroker",
		RetryIntervalStart: 10 * time.Millisecond, RetryIntervalMax: time.Second, ExtraCreateMetadata: true}
	if err := kcfg.Validate(); err != nil {
		t.Fatal(err)
	}
	env, synced, err := kube.NewEnv(kcfg)
	if err != nil {
		t.Fatal(err)
	}
	f.events = record.NewFakeRecorder(100)
	env.Recorder = f.events
	if f.c, err = New(env); err != nil || f.c == nil {
		t.Fatalf("New: %v, %v", f.c, err)
	}
	if err := env.StartHandlers(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	f.ctx = ctx
	env.Factory.Start(ctx.Done())
	t.Cleanup(env.Factory.Shutdown)
	if !cache.WaitForCacheSync(ctx.Done(), append(synced, env.TakeSynced()...)...) {
		t.Fatal("caches did not sync")
	}
	f.c.intents.StartTerm()
	done := make(chan struct{})
	go func() { defer close(done); f.c.intents.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return f
}

// volume makes a volume at driver and returns its ID.
func (f *fixture) volume(driver, name string) string {
	f.t.Helper()
	conn, _ := f.drivers.ControllerConn(driver)
	resp, err := csi.NewControllerClient(conn).CreateVolume(f.ctx, &csi.CreateVolumeRequest{Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}}})
	if err != nil {
		f.t.Fatal(err)
	}
	return resp.GetVolume().GetVolumeId()
}

// step syncs content name once the cache has caught up with the API
// (fake), and returns the stored content and sync's error.
func (f *fixture) step(name string) (*groupv1.VolumeGroupSnapshotContent, error) {
	f.t.Helper()
	f.waitCache(name)
	_, err := f.c.sync(f.ctx, name)
	g, gerr := f.snaps.GroupsnapshotV1().VolumeGroupSnapshotContents().Get(f.ctx, name, metav1.GetOptions{})
	if gerr != nil {
		return nil, err
	}
	return g, err
}

func (f *fixture) waitCache(name string) {
	f.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		want, err := f.snaps.GroupsnapshotV1().VolumeGroupSnapshotContents().Get(f.ctx, name, metav1.GetOptions{})
		got, lerr := f.c.contents.Get(name)
		if err != nil && lerr != nil {
			return
		}
		if err == nil && lerr == nil && equality.Semantic.DeepEqual(want.ObjectMeta, got.ObjectMeta) && equality.Semantic.DeepEqual(want.Status, got.Status) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	f.t.Fatalf("content %s: the cache did not catch up", name)
}

func (f *fixture) event(reason, want string) {
	f.t.Helper()
	for {
		select {
		case e := <-f.events.Events:
			if strings.Contains(e, reason) && strings.Contains(e, want) {
				return
			}
		case <-time.After(5 * time.Second):
			f.t.Fatalf("no %s Event saying %q", reason, want)
		}
	}
}

func (f *fixture) create(g *groupv1.VolumeGroupSnapshotContent) {
	f.t.Helper()
	if _, err := f.snaps.GroupsnapshotV1().VolumeGroupSnapshotContents().Create(f.ctx, g, metav1.CreateOptions{}); err != nil {
		f.t.Fatal(err)
	}
}

func class(name, driver string, params map[string]string) *groupv1.VolumeGroupSnapshotClass {
	return &groupv1.VolumeGroupSnapshotClass{ObjectMeta: metav1.ObjectMeta{Name: name, ResourceVersion: "1"}, Driver: driver, DeletionPolicy: snapshotv1.VolumeSnapshotContentDelete, Parameters: params}
}

func dynamicContent(name, driver, className string, vols []string, mut ...func(*groupv1.VolumeGroupSnapshotContent)) *groupv1.VolumeGroupSnapshotContent {
	g := &groupv1.VolumeGroupSnapshotContent{ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID("uid-" + name), ResourceVersion: "1",
		Finalizers: []string{ContentFinalizer}},
		Spec: groupv1.VolumeGroupSnapshotContentSpec{Driver: driver, DeletionPolicy: snapshotv1.VolumeSnapshotContentDelete, VolumeGroupSnapshotClassName: &className,
			Source:                 groupv1.VolumeGroupSnapshotContentSource{VolumeHandles: vols},
			VolumeGroupSnapshotRef: corev1.ObjectReference{Namespace: "app", Name: "nightly", UID: groupUID}}}
	for _, m := range mut {
		m(g)
	}
	return g
}

// TestCreateStep: one sync makes the group snapshot as csi-snapshotter
// does: named groupsnapshot-<VolumeGroupSnapshot UID>, the class's
// parameters less its csi.storage.k8s.io/ secret keys plus the extra
// metadata, the templated secret given to the driver and remembered on the
// content, the status with its three members, the being-created mark gone
// and the intent entry removed; a ready content's sync asks nothing more.
func TestCreateStep(t *testing.T) {
	cl := class("consistent", drv, map[string]string{"mode": "crash-consistent",
		"csi.storage.k8s.io/group-snapshotter-secret-name": "creds", "csi.storage.k8s.io/group-snapshotter-secret-namespace": "${volumegroupsnapshot.namespace}"})
	f := newFixture(t, true, cl)
	vols := []string{f.volume(drv, "a"), f.volume(drv, "b"), f.volume(drv, "c")}
	f.create(dynamicContent("g1", drv, "consistent", vols))
	g, err := f.step("g1")
	if err != nil {
		t.Fatal(err)
	}
	reqs := f.drivers.requests("CreateVolumeGroupSnapshot")
	if len(reqs) != 1 {
		t.Fatalf("%d CreateVolumeGroupSnapshot calls, want 1", len(reqs))
	}
	req := reqs[0].(*csi.CreateVolumeGroupSnapshotRequest)
	wantParams := map[string]string{"mode": "crash-consistent", ParamGroupSnapshotName: "nightly", ParamGroupSnapshotNamespace: "app", ParamGroupContentName: "g1"}
	if req.GetName() != "groupsnapshot-"+groupUID || !slices.Equal(req.GetSourceVolumeIds(), vols) || !maps.Equal(req.GetParameters(), wantParams) {
		t.Errorf("CreateVolumeGroupSnapshot %q of %v with %v; want groupsnapshot-<UID> of %v with %v", req.GetName(), req.GetSourceVolumeIds(), req.GetParameters(), vols, wantParams)
	}
	if req.GetSecrets()["password"] != "hunter2" {
		t.Errorf("CreateVolumeGroupSnapshot got secrets with keys %v; want the templated secret app/creds", slices.Collect(maps.Keys(req.GetSecrets())))
	}
	groups := f.d.GroupSnapshots()
	st := g.Status
	if len(groups) != 1 || st == nil || st.VolumeGroupSnapshotHandle == nil || *st.VolumeGroupSnapshotHandle != groups[0].ID ||
		st.ReadyToUse == nil || !*st.ReadyToUse || st.CreationTime == nil || st.Error != nil {
		t.Fatalf("driver groups %+v, status %+v; want the group's handle, ready, a creation time, no error", groups, st)
	}
	if len(st.VolumeSnapshotInfoList) != 3 {
		t.Fatalf("volumeSnapshotInfoList %+v; want three members", st.VolumeSnapshotInfoList)
	}
	for i, m := range st.VolumeSnapshotInfoList {
		if m.VolumeHandle != vols[i] || m.SnapshotHandle == "" || m.ReadyToUse == nil || !*m.ReadyToUse || m.CreationTime == nil || m.RestoreSize == nil || *m.RestoreSize != 1<<20 {
			t.Errorf("member %d: %+v; want volume %s's snapshot, ready, creation time, restore size 1Mi", i, m, vols[i])
		}
	}
	if _, ok := g.Annotations[AnnBeingCreated]; ok {
		t.Errorf("annotation %s left on a made group's content", AnnBeingCreated)
	}
	if g.Annotations[AnnDeletionSecretName] != "creds" || g.Annotations[AnnDeletionSecretNS] != "app" {
		t.Errorf("annotations %v; want the deletion secret app/creds remembered", g.Annotations)
	}
	if f.c.intents.Has(req.GetName()) {
		t.Error("intent entry left after the status recorded the group snapshot")
	}
	if _, err := f.step("g1"); err != nil {
		t.Fatal(err)
	}
	if n := len(f.drivers.requests("CreateVolumeGroupSnapshot")) + len(f.drivers.requests("GetVolumeGroupSnapshot")); n != 1 {
		t.Errorf("%d group calls after a ready content's sync; want only the first", n)
	}
}
