package groupsnapshot

import (
	"context"
	"maps"
	"slices"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	groupv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapfake "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned/fake"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/record"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/snapshots/snapshottest"
)

// fixture is one controller over fake clientsets and real sample drivers:
// drv with group snapshots, plainDrv without.
type fixture struct {
	t       *testing.T
	c       *Controller
	kube    *fake.Clientset
	snaps   *snapfake.Clientset
	drivers *snapshottest.Drivers
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
	f := &fixture{t: t, drivers: &snapshottest.Drivers{}}
	cfg.Name = drv
	f.d = f.drivers.Add(t, cfg)
	f.drivers.Add(t, sampledriver.Config{Name: plainDrv, DisableGroupSnapshots: true})
	f.kube, f.snaps = snapshottest.Clients(Group+"/"+Version, []string{"volumegroupsnapshotcontents", "volumegroupsnapshotclasses", "volumegroupsnapshots"}, objs...)
	env, synced, events := snapshottest.Env(t, kube.Config{Client: f.kube, SnapshotClient: f.snaps, Drivers: f.drivers}, policyAllows)
	f.events = events
	var err error
	if f.c, err = New(env); err != nil || f.c == nil {
		t.Fatalf("New: %v, %v", f.c, err)
	}
	f.ctx = snapshottest.Start(t, env, synced, f.c.intents)
	return f
}

// volume makes a volume at driver and returns its ID.
func (f *fixture) volume(driver, name string) string {
	return f.drivers.Volume(f.t, f.ctx, driver, name)
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
	snapshottest.WaitCache(f.t, name, func(name string) (*groupv1.VolumeGroupSnapshotContent, error) {
		return f.snaps.GroupsnapshotV1().VolumeGroupSnapshotContents().Get(f.ctx, name, metav1.GetOptions{})
	}, f.c.contents.Get, func(g *groupv1.VolumeGroupSnapshotContent) any { return g.Status })
}

func (f *fixture) event(reason, want string) {
	f.t.Helper()
	snapshottest.Event(f.t, f.events, reason, want)
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
	reqs := f.drivers.Requests("CreateVolumeGroupSnapshot")
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
	if n := len(f.drivers.Requests("CreateVolumeGroupSnapshot")) + len(f.drivers.Requests("GetVolumeGroupSnapshot")); n != 1 {
		t.Errorf("%d group calls after a ready content's sync; want only the first", n)
	}
}
