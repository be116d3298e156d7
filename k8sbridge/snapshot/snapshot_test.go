package snapshot

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapfake "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned/fake"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/record"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/snapshots/snapshottest"
)

// fixture is one controller over fake clientsets and a real sample
// driver.
type fixture struct {
	t       *testing.T
	c       *Controller
	kube    *fake.Clientset
	snaps   *snapfake.Clientset
	drivers *snapshottest.Drivers
	events  *record.FakeRecorder
	ctx     context.Context
}

const drv = "snap.csi.test"

func newFixture(t *testing.T, policyAllows bool, objs ...runtime.Object) *fixture {
	t.Helper()
	f := &fixture{t: t, drivers: &snapshottest.Drivers{}}
	f.drivers.Add(t, sampledriver.Config{Name: drv})
	f.kube, f.snaps = snapshottest.Clients(Group+"/v1", []string{"volumesnapshotcontents", "volumesnapshotclasses", "volumesnapshots"}, objs...)
	env, synced, events := snapshottest.Env(t, kube.Config{Client: f.kube, SnapshotClient: f.snaps, Drivers: f.drivers}, policyAllows)
	f.events = events
	var err error
	if f.c, err = New(env); err != nil || f.c == nil {
		t.Fatalf("New: %v, %v", f.c, err)
	}
	f.ctx = snapshottest.Start(t, env, synced, f.c.intents)
	return f
}

// volume makes a volume at the driver and returns its ID.
func (f *fixture) volume(name string) string { return f.drivers.Volume(f.t, f.ctx, drv, name) }

// snapshotAtDriver makes a volume and a snapshot of it at the driver.
func (f *fixture) snapshotAtDriver() (string, *csi.CreateSnapshotResponse) {
	f.t.Helper()
	vol := f.volume("src")
	conn, _ := f.drivers.ControllerConn(drv)
	made, err := csi.NewControllerClient(conn).CreateSnapshot(f.ctx, &csi.CreateSnapshotRequest{Name: "s", SourceVolumeId: vol})
	if err != nil {
		f.t.Fatal(err)
	}
	return vol, made
}

// step syncs content name once the cache has rv-newer state, and returns
// the stored content and sync's error.
func (f *fixture) step(name string) (*snapshotv1.VolumeSnapshotContent, error) {
	f.t.Helper()
	f.waitCache(name)
	_, err := f.c.sync(f.ctx, name)
	vsc, gerr := f.snaps.SnapshotV1().VolumeSnapshotContents().Get(f.ctx, name, metav1.GetOptions{})
	if gerr != nil {
		return nil, err
	}
	return vsc, err
}

// waitCache waits until the lister holds what the API (fake) holds.
func (f *fixture) waitCache(name string) {
	f.t.Helper()
	snapshottest.WaitCache(f.t, name, func(name string) (*snapshotv1.VolumeSnapshotContent, error) {
		return f.snaps.SnapshotV1().VolumeSnapshotContents().Get(f.ctx, name, metav1.GetOptions{})
	}, f.c.contents.Get, func(vsc *snapshotv1.VolumeSnapshotContent) any { return vsc.Status })
}

func (f *fixture) event(reason, want string) {
	f.t.Helper()
	snapshottest.Event(f.t, f.events, reason, want)
}

func class(name, driver string, params map[string]string) *snapshotv1.VolumeSnapshotClass {
	return &snapshotv1.VolumeSnapshotClass{ObjectMeta: metav1.ObjectMeta{Name: name, ResourceVersion: "1"}, Driver: driver, DeletionPolicy: snapshotv1.VolumeSnapshotContentDelete, Parameters: params}
}

func dynamicContent(name, className, volID string, mut ...func(*snapshotv1.VolumeSnapshotContent)) *snapshotv1.VolumeSnapshotContent {
	vsc := &snapshotv1.VolumeSnapshotContent{ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID("uid-" + name), ResourceVersion: "1",
		Finalizers: []string{ContentFinalizer}},
		Spec: snapshotv1.VolumeSnapshotContentSpec{Driver: drv, DeletionPolicy: snapshotv1.VolumeSnapshotContentDelete, VolumeSnapshotClassName: &className,
			Source:            snapshotv1.VolumeSnapshotContentSource{VolumeHandle: &volID},
			VolumeSnapshotRef: corev1.ObjectReference{Namespace: "app", Name: "daily", UID: types.UID("0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0")}}}
	for _, m := range mut {
		m(vsc)
	}
	return vsc
}

// TestCreateStep: one sync makes the snapshot as csi-snapshotter does:
// named snapshot-<VolumeSnapshot UID>, the class's parameters less its
// csi.storage.k8s.io/ secret keys plus the extra metadata, the templated
// secret given to the driver and remembered on the content, the status
// filled, the being-created mark gone and the intent entry removed.
func TestCreateStep(t *testing.T) {
	cl := class("fast", drv, map[string]string{"type": "fast",
		"csi.storage.k8s.io/snapshotter-secret-name": "creds", "csi.storage.k8s.io/snapshotter-secret-namespace": "${volumesnapshot.namespace}"})
	f := newFixture(t, true, cl)
	vol := f.volume("src")
	if _, err := f.snaps.SnapshotV1().VolumeSnapshotContents().Create(f.ctx, dynamicContent("c1", "fast", vol), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	vsc, err := f.step("c1")
	if err != nil {
		t.Fatal(err)
	}
	reqs := f.drivers.Requests("CreateSnapshot")
	if len(reqs) != 1 {
		t.Fatalf("%d CreateSnapshot calls", len(reqs))
	}
	req := reqs[0].(*csi.CreateSnapshotRequest)
	wantParams := map[string]string{"type": "fast", ParamSnapshotName: "daily", ParamSnapshotNamespace: "app", ParamContentName: "c1"}
	if req.GetName() != "snapshot-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0" || req.GetSourceVolumeId() != vol || !maps.Equal(req.GetParameters(), wantParams) {
		t.Errorf("CreateSnapshot %q of %q with %v; want snapshot-<UID> of %s with %v", req.GetName(), req.GetSourceVolumeId(), req.GetParameters(), vol, wantParams)
	}
	if req.GetSecrets()["password"] != "hunter2" {
		t.Errorf("CreateSnapshot got secrets with keys %v; want the templated secret app/creds", slices.Collect(maps.Keys(req.GetSecrets())))
	}
	st := vsc.Status
	if st == nil || st.SnapshotHandle == nil || st.ReadyToUse == nil || !*st.ReadyToUse || st.RestoreSize == nil || *st.RestoreSize != 1<<20 || st.CreationTime == nil || st.Error != nil {
		t.Fatalf("status %+v; want handle, ready, restore size 1Mi, creation time, no error", st)
	}
	if _, ok := vsc.Annotations[AnnBeingCreated]; ok {
		t.Errorf("annotation %s left on a made snapshot's content", AnnBeingCreated)
	}
	if vsc.Annotations[AnnDeletionSecretName] != "creds" || vsc.Annotations[AnnDeletionSecretNS] != "app" {
		t.Errorf("annotations %v; want the deletion secret app/creds remembered", vsc.Annotations)
	}
	if f.c.intents.Has(req.GetName()) {
		t.Error("intent entry left after the status recorded the snapshot")
	}
	// Ready: a sync again asks the driver nothing.
	if _, err := f.step("c1"); err != nil {
		t.Fatal(err)
	}
	if n := len(f.drivers.Requests("CreateSnapshot")); n != 1 {
		t.Errorf("%d CreateSnapshot calls after a ready content's sync; want 1", n)
	}
}

// TestCreateBadInput: each bad input is the content's status error, a
// SnapshotCreationFailed Event and no CreateSnapshot (or, for the driver's
// own error, one that left nothing behind).
func TestCreateBadInput(t *testing.T) {
	for _, tc := range []struct {
		name, class string
		params      map[string]string
		classDriver string
		allow       bool
		volume      string // "": a real volume
		strip       bool   // the driver loses its snapshot capability
		want        string
		called      bool
	}{
		{name: "class of another driver", class: "other", classDriver: "other.csi.test", allow: true, want: "VolumeSnapshotClass other is of driver other.csi.test, not " + drv},
		{name: "class missing", class: "nosuch", allow: true, want: "VolumeSnapshotClass nosuch not found"},
		{name: "secret denied", class: "sec", params: map[string]string{"csi.storage.k8s.io/snapshotter-secret-name": "creds", "csi.storage.k8s.io/snapshotter-secret-namespace": "app"}, want: "secret access denied by policy"},
		{name: "secret missing", class: "missing", params: map[string]string{"csi.storage.k8s.io/snapshotter-secret-name": "nosuch", "csi.storage.k8s.io/snapshotter-secret-namespace": "app"}, allow: true, want: "secret app/nosuch"},
		{name: "unknown reserved parameter", class: "typo", params: map[string]string{"csi.storage.k8s.io/snapshoter-secret-name": "x"}, allow: true, want: `unknown parameter "csi.storage.k8s.io/snapshoter-secret-name"`},
		{name: "driver error", class: "fast", allow: true, volume: "no-such-volume", want: "code = NotFound", called: true},
		{name: "no snapshot capability", class: "fast", allow: true, strip: true, want: "no CREATE_DELETE_SNAPSHOT"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cd := tc.classDriver
			if cd == "" {
				cd = drv
			}
			var objs []runtime.Object
			if tc.class != "nosuch" {
				objs = append(objs, class(tc.class, cd, tc.params))
			}
			f := newFixture(t, tc.allow, objs...)
			if tc.strip {
				f.c.b.Caps = drivers.NewCache(noSnapshotCaps{f.drivers})
			}
			vol := tc.volume
			if vol == "" {
				vol = f.volume("src")
			}
			if _, err := f.snaps.SnapshotV1().VolumeSnapshotContents().Create(f.ctx, dynamicContent("c1", tc.class, vol), metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			vsc, err := f.step("c1")
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("sync: %v; want an error saying %q", err, tc.want)
			}
			if vsc.Status == nil || vsc.Status.Error == nil || !strings.Contains(*vsc.Status.Error.Message, tc.want) || vsc.Status.ReadyToUse == nil || *vsc.Status.ReadyToUse {
				t.Errorf("status %+v; want readyToUse false and an error saying %q", vsc.Status, tc.want)
			}
			f.event("SnapshotCreationFailed", tc.want)
			if n := len(f.drivers.Requests("CreateSnapshot")); (n > 0) != tc.called {
				t.Errorf("%d CreateSnapshot calls; want called %v", n, tc.called)
			}
			if _, ok := vsc.Annotations[AnnBeingCreated]; ok {
				t.Errorf("annotation %s left after a final error", AnnBeingCreated)
			}
			if f.c.intents.Has(snapshotName(f.c.b.Cfg, vsc)) {
				t.Error("intent entry left after a final error")
			}
			if strings.Contains(*vsc.Status.Error.Message, "hunter2") {
				t.Error("the secret's value is in the status error")
			}
		})
	}
}

// noSnapshotCaps answers ControllerGetCapabilities without the snapshot
// capabilities.
type noSnapshotCaps struct{ *snapshottest.Drivers }

func (n noSnapshotCaps) ControllerConn(d string) (grpc.ClientConnInterface, error) {
	c, err := n.Drivers.ControllerConn(d)
	return stripConn{c}, err
}

type stripConn struct{ grpc.ClientConnInterface }

func (s stripConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	err := s.ClientConnInterface.Invoke(ctx, method, args, reply, opts...)
	if r, ok := reply.(*csi.ControllerGetCapabilitiesResponse); ok && err == nil {
		r.Capabilities = slices.DeleteFunc(r.Capabilities, func(c *csi.ControllerServiceCapability) bool {
			t := c.GetRpc().GetType()
			return t == csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT || t == csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS
		})
	}
	return err
}

// TestContentGoneDuringCreate: a content deleted while its CreateSnapshot
// runs (no finalizer holds it) leaves no snapshot at the driver: the
// status write finds it gone and the snapshot is deleted from the intent.
func TestContentGoneDuringCreate(t *testing.T) {
	f := newFixture(t, true, class("fast", drv, nil))
	d := f.drivers
	vol := f.volume("src")
	if _, err := f.snaps.SnapshotV1().VolumeSnapshotContents().Create(f.ctx, dynamicContent("c1", "fast", vol, func(v *snapshotv1.VolumeSnapshotContent) { v.Finalizers = nil }), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	d.Hook = func(method string, _ any) error {
		if method == "CreateSnapshot" {
			once.Do(func() {
				if err := f.snaps.SnapshotV1().VolumeSnapshotContents().Delete(f.ctx, "c1", metav1.DeleteOptions{}); err != nil {
					t.Error(err)
				}
			})
		}
		return nil
	}
	if _, err := f.step("c1"); err != nil {
		t.Fatalf("sync: %v", err)
	}
	if n := len(d.Requests("DeleteSnapshot")); n != 1 {
		t.Fatalf("%d DeleteSnapshot calls; want the made snapshot deleted", n)
	}
	conn, _ := d.ControllerConn(drv)
	resp, err := csi.NewControllerClient(conn).ListSnapshots(f.ctx, &csi.ListSnapshotsRequest{})
	if err != nil || len(resp.GetEntries()) != 0 {
		t.Fatalf("snapshots at the driver: %v, %v; want none", resp.GetEntries(), err)
	}
	if f.c.intents.Has("snapshot-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0") {
		t.Error("intent entry left")
	}
}

// TestDeleteStep: a content the snapshot-controller marked being deleted
// gets DeleteSnapshot with the remembered secret (Delete) or keeps its
// snapshot (Retain), and loses the content finalizer either way; one still
// being created is left alone.
func TestDeleteStep(t *testing.T) {
	for _, tc := range []struct {
		name        string
		policy      snapshotv1.DeletionPolicy
		beingMade   bool
		wantDeleted bool
		wantFinal   bool // the finalizer is removed
	}{
		{"delete", snapshotv1.VolumeSnapshotContentDelete, false, true, true},
		{"retain", snapshotv1.VolumeSnapshotContentRetain, false, false, true},
		{"being created", snapshotv1.VolumeSnapshotContentDelete, true, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, true, class("fast", drv, nil))
			vol, made := f.snapshotAtDriver()
			id, yes, now := made.GetSnapshot().GetSnapshotId(), true, metav1.Now()
			vsc := dynamicContent("c1", "fast", vol, func(v *snapshotv1.VolumeSnapshotContent) {
				v.Spec.DeletionPolicy = tc.policy
				v.DeletionTimestamp = &now
				v.Annotations = map[string]string{AnnBeingDeleted: "yes", AnnDeletionSecretName: "creds", AnnDeletionSecretNS: "app"}
				if tc.beingMade {
					v.Annotations[AnnBeingCreated] = "yes"
				}
				v.Status = &snapshotv1.VolumeSnapshotContentStatus{SnapshotHandle: &id, ReadyToUse: &yes}
			})
			if _, err := f.snaps.SnapshotV1().VolumeSnapshotContents().Create(f.ctx, vsc, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			f.drivers.Reset()
			got, err := f.step("c1")
			if err != nil && !tc.beingMade {
				t.Fatal(err)
			}
			dels := f.drivers.Requests("DeleteSnapshot")
			if (len(dels) == 1) != tc.wantDeleted {
				t.Fatalf("%d DeleteSnapshot calls; want deleted %v", len(dels), tc.wantDeleted)
			}
			if tc.wantDeleted {
				if r := dels[0].(*csi.DeleteSnapshotRequest); r.GetSnapshotId() != id || r.GetSecrets()["password"] != "hunter2" {
					t.Errorf("DeleteSnapshot of %q with the remembered secret %v; want %q with it", r.GetSnapshotId(), r.GetSecrets() != nil, id)
				}
				if got.Status.SnapshotHandle != nil || got.Status.ReadyToUse != nil {
					t.Errorf("status %+v; want the snapshot's fields cleared", got.Status)
				}
			}
			if has := slices.Contains(got.Finalizers, ContentFinalizer); has == tc.wantFinal {
				t.Errorf("finalizers %v; want %s removed: %v", got.Finalizers, ContentFinalizer, tc.wantFinal)
			}
		})
	}
}

// TestImportStep: a pre-provisioned content's status comes from
// ListSnapshots by its ID; an ID the driver does not know is a status
// error and an Event.
func TestImportStep(t *testing.T) {
	f := newFixture(t, true)
	_, made := f.snapshotAtDriver()
	for name, handle := range map[string]string{"known": made.GetSnapshot().GetSnapshotId(), "unknown": "ss-nosuch"} {
		vsc := &snapshotv1.VolumeSnapshotContent{ObjectMeta: metav1.ObjectMeta{Name: name, ResourceVersion: "1"},
			Spec: snapshotv1.VolumeSnapshotContentSpec{Driver: drv, DeletionPolicy: snapshotv1.VolumeSnapshotContentRetain,
				Source: snapshotv1.VolumeSnapshotContentSource{SnapshotHandle: &handle}, VolumeSnapshotRef: corev1.ObjectReference{Namespace: "app", Name: name}}}
		if _, err := f.snaps.SnapshotV1().VolumeSnapshotContents().Create(f.ctx, vsc, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	got, err := f.step("known")
	if err != nil {
		t.Fatal(err)
	}
	if st := got.Status; st == nil || st.SnapshotHandle == nil || *st.SnapshotHandle != made.GetSnapshot().GetSnapshotId() || st.ReadyToUse == nil || !*st.ReadyToUse || st.RestoreSize == nil || *st.RestoreSize != 1<<20 {
		t.Errorf("imported status %+v", st)
	}
	got, err = f.step("unknown")
	if err == nil || got.Status == nil || got.Status.Error == nil || !strings.Contains(*got.Status.Error.Message, "does not know snapshot ss-nosuch") {
		t.Errorf("unknown snapshot: err %v, status %+v", err, got.Status)
	}
	f.event("SnapshotContentCheckandUpdateFailed", "ss-nosuch")
	if n := len(f.drivers.Requests("CreateSnapshot")); n != 1 {
		t.Errorf("%d CreateSnapshot calls; want only the test's own", n)
	}
}

// TestShouldDelete is csi-snapshotter's rule, case by case.
func TestShouldDelete(t *testing.T) {
	now := metav1.Now()
	h := "h"
	for _, tc := range []struct {
		name string
		vsc  snapshotv1.VolumeSnapshotContent
		want bool
	}{
		{"not deleted", snapshotv1.VolumeSnapshotContent{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{AnnBeingDeleted: "yes"}}}, false},
		{"deleted, not marked", snapshotv1.VolumeSnapshotContent{ObjectMeta: metav1.ObjectMeta{DeletionTimestamp: &now}}, false},
		{"deleted and marked", snapshotv1.VolumeSnapshotContent{ObjectMeta: metav1.ObjectMeta{DeletionTimestamp: &now, Annotations: map[string]string{AnnBeingDeleted: "yes"}}}, true},
		{"marked but being created", snapshotv1.VolumeSnapshotContent{ObjectMeta: metav1.ObjectMeta{DeletionTimestamp: &now, Annotations: map[string]string{AnnBeingDeleted: "yes", AnnBeingCreated: "yes"}}}, false},
		{"pre-provisioned, never bound", snapshotv1.VolumeSnapshotContent{ObjectMeta: metav1.ObjectMeta{DeletionTimestamp: &now}, Spec: snapshotv1.VolumeSnapshotContentSpec{Source: snapshotv1.VolumeSnapshotContentSource{SnapshotHandle: &h}}}, true},
	} {
		if got := shouldDelete(&tc.vsc); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestChangeNeedsSync: the controller's own writes (status, finalizers,
// the being-created mark) do not bypass the backoff; anything else, a
// resync and becoming ready do.
func TestChangeNeedsSync(t *testing.T) {
	yes := true
	base := &snapshotv1.VolumeSnapshotContent{ObjectMeta: metav1.ObjectMeta{Name: "c", ResourceVersion: "1", Annotations: map[string]string{"a": "b"}}}
	for _, tc := range []struct {
		name string
		mut  func(*snapshotv1.VolumeSnapshotContent)
		want bool
	}{
		{"resync", func(*snapshotv1.VolumeSnapshotContent) {}, true},
		{"status error", func(v *snapshotv1.VolumeSnapshotContent) {
			v.ResourceVersion = "2"
			m := "x"
			v.Status = &snapshotv1.VolumeSnapshotContentStatus{Error: &snapshotv1.VolumeSnapshotError{Message: &m}}
		}, false},
		{"became ready", func(v *snapshotv1.VolumeSnapshotContent) {
			v.ResourceVersion = "2"
			v.Status = &snapshotv1.VolumeSnapshotContentStatus{ReadyToUse: &yes}
		}, true},
		{"being-created mark", func(v *snapshotv1.VolumeSnapshotContent) {
			v.ResourceVersion = "2"
			v.Annotations[AnnBeingCreated] = "yes"
		}, false},
		{"finalizer", func(v *snapshotv1.VolumeSnapshotContent) {
			v.ResourceVersion = "2"
			v.Finalizers = []string{ContentFinalizer}
		}, false},
		{"being-deleted mark", func(v *snapshotv1.VolumeSnapshotContent) {
			v.ResourceVersion = "2"
			v.Annotations[AnnBeingDeleted] = "yes"
		}, true},
		{"deletion", func(v *snapshotv1.VolumeSnapshotContent) {
			v.ResourceVersion = "2"
			now := metav1.Now()
			v.DeletionTimestamp = &now
		}, true},
	} {
		cur := base.DeepCopy()
		tc.mut(cur)
		if got := kind().NeedsSync(base, cur); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
	// A ready content whose status another writer sets back to not ready
	// (a group member's, from the group's first answer) is looked at again.
	ready := base.DeepCopy()
	ready.Status = &snapshotv1.VolumeSnapshotContentStatus{ReadyToUse: &yes}
	unready := ready.DeepCopy()
	no := false
	unready.ResourceVersion, unready.Status.ReadyToUse = "3", &no
	if !kind().NeedsSync(ready, unready) {
		t.Error("ready, then set not ready: not synced, want synced")
	}
}

// TestSnapshotName is csi-snapshotter's naming.
func TestSnapshotName(t *testing.T) {
	vsc := &snapshotv1.VolumeSnapshotContent{Spec: snapshotv1.VolumeSnapshotContentSpec{VolumeSnapshotRef: corev1.ObjectReference{UID: "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"}}}
	for _, tc := range []struct {
		prefix string
		n      int
		want   string
	}{
		{"snapshot", -1, "snapshot-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"},
		{"snap", 8, "snap-0b1c2d3e"},
		{"snap", 100, "snap-0b1c2d3e4f5061728394a5b6c7d8e9f0"},
	} {
		if got := snapshotName(kube.Config{SnapshotNamePrefix: tc.prefix, SnapshotNameUUIDLength: tc.n}, vsc); got != tc.want {
			t.Errorf("%s/%d: %q, want %q", tc.prefix, tc.n, got, tc.want)
		}
	}
}

// TestIsFinal is csi-snapshotter's classification.
func TestIsFinal(t *testing.T) {
	for code, want := range map[codes.Code]bool{codes.InvalidArgument: true, codes.NotFound: true, codes.Internal: true, codes.AlreadyExists: true,
		codes.Canceled: false, codes.DeadlineExceeded: false, codes.Unavailable: false, codes.ResourceExhausted: false, codes.Aborted: false} {
		if got := isFinal(status.Error(code, "x")); got != want {
			t.Errorf("%s: %v, want %v", code, got, want)
		}
	}
	if isFinal(fmt.Errorf("not a status")) {
		t.Error("a non-gRPC error is final; want not (the call may not have been sent)")
	}
}

// TestRecoveryStep: an entry whose content is gone is undone (the
// recorded CreateSnapshot asked again names the snapshot, which is
// deleted, and the entry goes); an entry whose content records its
// snapshot just goes; one whose content is still being made stays.
func TestRecoveryStep(t *testing.T) {
	f := newFixture(t, true, class("fast", drv, nil))
	vol := f.volume("src")
	entry := func(content, uid, name string) Entry {
		req := &csi.CreateSnapshotRequest{Name: name, SourceVolumeId: vol}
		raw, err := proto.Marshal(req)
		if err != nil {
			t.Fatal(err)
		}
		e := Entry{SnapshotName: name, Driver: drv, ContentName: content, ContentUID: uid, SnapshotNamespace: "app", SnapshotRefName: "daily", Request: raw}
		if err := f.c.intents.Add(f.ctx, e); err != nil {
			t.Fatal(err)
		}
		return e
	}
	conn, _ := f.drivers.ControllerConn(drv)
	made, err := csi.NewControllerClient(conn).CreateSnapshot(f.ctx, &csi.CreateSnapshotRequest{Name: "snapshot-gone", SourceVolumeId: vol})
	if err != nil {
		t.Fatal(err)
	}
	entry("gone-content", "uid-gone", "snapshot-gone")
	id := "ss-recorded"
	rec := dynamicContent("recorded", "fast", vol, func(v *snapshotv1.VolumeSnapshotContent) {
		v.Status = &snapshotv1.VolumeSnapshotContentStatus{SnapshotHandle: &id}
	})
	busy := dynamicContent("busy", "fast", vol)
	for _, v := range []*snapshotv1.VolumeSnapshotContent{rec, busy} {
		if _, err := f.snaps.SnapshotV1().VolumeSnapshotContents().Create(f.ctx, v, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		f.waitCache(v.Name)
	}
	entry("recorded", string(rec.UID), "snapshot-recorded")
	entry("busy", string(busy.UID), "snapshot-busy")
	f.c.recoverAll(f.ctx)
	dels := f.drivers.Requests("DeleteSnapshot")
	if len(dels) != 1 || dels[0].(*csi.DeleteSnapshotRequest).GetSnapshotId() != made.GetSnapshot().GetSnapshotId() {
		t.Fatalf("DeleteSnapshot calls %v; want one, of %s", dels, made.GetSnapshot().GetSnapshotId())
	}
	for name, want := range map[string]bool{"snapshot-gone": false, "snapshot-recorded": false, "snapshot-busy": true} {
		if got := f.c.intents.Has(name); got != want {
			t.Errorf("entry %s kept: %v, want %v", name, got, want)
		}
	}
	if n := len(f.drivers.Requests("CreateSnapshot")); n != 2 {
		t.Errorf("%d CreateSnapshot calls; want the test's and recovery's for the gone content only", n)
	}
}

// TestDeletionCountedOnce: the deletion is counted when the driver's
// snapshot is gone, before the finalizer goes (so whoever sees the content
// gone sees the count), and a retry after a failed finalizer removal
// counts it neither again nor as retained.
func TestDeletionCountedOnce(t *testing.T) {
	f := newFixture(t, true, class("fast", drv, nil))
	vol, made := f.snapshotAtDriver()
	id, now := made.GetSnapshot().GetSnapshotId(), metav1.Now()
	vsc := dynamicContent("c1", "fast", vol, func(v *snapshotv1.VolumeSnapshotContent) {
		v.DeletionTimestamp = &now
		v.Annotations = map[string]string{AnnBeingDeleted: "yes", AnnDeletionSecretName: "creds", AnnDeletionSecretNS: "app"}
		v.Status = &snapshotv1.VolumeSnapshotContentStatus{SnapshotHandle: &id}
	})
	if _, err := f.snaps.SnapshotV1().VolumeSnapshotContents().Create(f.ctx, vsc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	refused := false
	f.snaps.PrependReactor("patch", "volumesnapshotcontents", func(a k8stesting.Action) (bool, runtime.Object, error) {
		p := a.(k8stesting.PatchAction)
		if refused || p.GetSubresource() != "" || !strings.Contains(string(p.GetPatch()), "finalizers") {
			return false, nil, nil
		}
		refused = true
		return true, nil, fmt.Errorf("test: finalizer patch refused")
	})
	if _, err := f.step("c1"); err == nil || !strings.Contains(err.Error(), "remove finalizer") {
		t.Fatalf("first step: %v; want the finalizer removal's error", err)
	}
	deleted, retained := f.c.ops.WithLabelValues(drv, "deleted"), f.c.ops.WithLabelValues(drv, "retained")
	if d := testutil.ToFloat64(deleted); d != 1 {
		t.Errorf("deleted counted %v times before the finalizer went; want 1", d)
	}
	got, err := f.step("c1")
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(got.Finalizers, ContentFinalizer) {
		t.Errorf("finalizers %v after the retry", got.Finalizers)
	}
	if d, r := testutil.ToFloat64(deleted), testutil.ToFloat64(retained); d != 1 || r != 0 {
		t.Errorf("after the retry: deleted %v, retained %v; want 1, 0", d, r)
	}
	if n := len(f.drivers.Requests("DeleteSnapshot")); n != 1 {
		t.Errorf("%d DeleteSnapshot calls; want 1", n)
	}
}
