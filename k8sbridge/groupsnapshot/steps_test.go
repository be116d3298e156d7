package groupsnapshot

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	groupv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/csibroker/csibroker/internal/sampledriver"
)

// TestCreateBadInput: each bad input is the content's status error, a
// GroupSnapshotCreationFailed Event and a log line, and no group snapshot
// is left at the driver.
func TestCreateBadInput(t *testing.T) {
	secret := map[string]string{"csi.storage.k8s.io/group-snapshotter-secret-name": "creds", "csi.storage.k8s.io/group-snapshotter-secret-namespace": "app"}
	for _, tc := range []struct {
		name, class, classDriver, driver string
		params                           map[string]string
		allow, missingVolume, called     bool
		want                             string
	}{
		{name: "class of another driver", class: "other", classDriver: "other.csi.test", allow: true, want: "VolumeGroupSnapshotClass other is of driver other.csi.test, not " + drv},
		{name: "class missing", class: "nosuch", allow: true, want: "VolumeGroupSnapshotClass nosuch not found"},
		{name: "secret denied", class: "sec", params: secret, want: "secret access denied by policy"},
		{name: "secret missing", class: "missing", params: map[string]string{"csi.storage.k8s.io/group-snapshotter-secret-name": "nosuch", "csi.storage.k8s.io/group-snapshotter-secret-namespace": "app"}, allow: true, want: "secret app/nosuch"},
		{name: "unknown reserved parameter", class: "typo", params: map[string]string{"csi.storage.k8s.io/group-snapshoter-secret-name": "x"}, allow: true, want: `unknown parameter "csi.storage.k8s.io/group-snapshoter-secret-name"`},
		{name: "driver error", class: "fast", allow: true, missingVolume: true, want: "code = NotFound", called: true},
		{name: "driver without group snapshots", class: "plain", driver: plainDrv, allow: true, want: "driver " + plainDrv + " does not make group snapshots"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			driver, cd := tc.driver, tc.classDriver
			if driver == "" {
				driver = drv
			}
			if cd == "" {
				cd = driver
			}
			var objs []runtime.Object
			if tc.class != "nosuch" {
				objs = append(objs, class(tc.class, cd, tc.params))
			}
			f := newFixture(t, tc.allow, objs...)
			vols := []string{f.volume(driver, "a"), f.volume(driver, "b")}
			if tc.missingVolume {
				vols = append(vols, "no-such-volume")
			}
			f.create(dynamicContent("bad", driver, tc.class, vols))
			g, err := f.step("bad")
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("sync: %v; want an error saying %q", err, tc.want)
			}
			if st := g.Status; st == nil || st.Error == nil || !strings.Contains(*st.Error.Message, tc.want) || st.ReadyToUse == nil || *st.ReadyToUse {
				t.Fatalf("status %+v; want readyToUse false and an error saying %q", st, tc.want)
			}
			if strings.Contains(*g.Status.Error.Message, "hunter2") {
				t.Fatal("the status error holds the secret's value")
			}
			f.event("GroupSnapshotCreationFailed", tc.want)
			if n := len(f.drivers.Requests("CreateVolumeGroupSnapshot")); (n > 0) != tc.called {
				t.Errorf("%d CreateVolumeGroupSnapshot calls; want them made: %t", n, tc.called)
			}
			if _, ok := g.Annotations[AnnBeingCreated]; ok {
				t.Errorf("annotation %s left after a final error", AnnBeingCreated)
			}
			if n := len(f.d.GroupSnapshots()); n != 0 {
				t.Errorf("%d group snapshots at the driver", n)
			}
			if f.c.intents.Has("groupsnapshot-" + groupUID) {
				t.Error("intent entry left after a final error")
			}
		})
	}
}

// TestNotReadyAskedUntilReady: a group the driver says is not ready yet
// is asked for with GetVolumeGroupSnapshot (no second create) until it is;
// the error the first answer cleared nothing, and the members' list stays
// as first written, as csi-snapshotter's.
func TestNotReadyAskedUntilReady(t *testing.T) {
	f := newFixtureWith(t, sampledriver.Config{SnapshotReadyAfter: 300 * time.Millisecond}, true, class("slow", drv, nil))
	vols := []string{f.volume(drv, "a"), f.volume(drv, "b")}
	f.create(dynamicContent("g", drv, "slow", vols))
	g, err := f.step("g")
	if !errors.Is(err, errNotReady) {
		t.Fatalf("first sync: %v; want not ready", err)
	}
	if st := g.Status; st == nil || st.VolumeGroupSnapshotHandle == nil || st.ReadyToUse == nil || *st.ReadyToUse || len(st.VolumeSnapshotInfoList) != 2 {
		t.Fatalf("status %+v; want the handle, not ready, two members", st)
	}
	deadline := time.Now().Add(10 * time.Second)
	for errors.Is(err, errNotReady) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		g, err = f.step("g")
	}
	if err != nil || !isReady(g) {
		t.Fatalf("sync: %v, status %+v; want ready", err, g.Status)
	}
	if n := len(f.drivers.Requests("CreateVolumeGroupSnapshot")); n != 1 {
		t.Errorf("%d CreateVolumeGroupSnapshot calls; want 1", n)
	}
	gets := f.drivers.Requests("GetVolumeGroupSnapshot")
	if len(gets) == 0 {
		t.Fatal("no GetVolumeGroupSnapshot while the group was not ready")
	}
	if r := gets[0].(*csi.GetVolumeGroupSnapshotRequest); r.GetGroupSnapshotId() != *g.Status.VolumeGroupSnapshotHandle || len(r.GetSnapshotIds()) != 2 {
		t.Errorf("GetVolumeGroupSnapshot %+v; want the group's handle and its two snapshot IDs", r)
	}
}

// TestPreProvisioned: a content naming a driver's group snapshot gets its
// status from GetVolumeGroupSnapshot (no member list, as csi-snapshotter);
// one naming a group the driver does not know is a status error and an
// Event.
func TestPreProvisioned(t *testing.T) {
	f := newFixture(t, true)
	conn, _ := f.drivers.ControllerConn(drv)
	made, err := csi.NewGroupControllerClient(conn).CreateVolumeGroupSnapshot(f.ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "outside",
		SourceVolumeIds: []string{f.volume(drv, "a"), f.volume(drv, "b")}})
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, s := range made.GetGroupSnapshot().GetSnapshots() {
		ids = append(ids, s.GetSnapshotId())
	}
	pre := func(name, handle string) *groupv1.VolumeGroupSnapshotContent {
		return &groupv1.VolumeGroupSnapshotContent{ObjectMeta: metav1.ObjectMeta{Name: name, ResourceVersion: "1"},
			Spec: groupv1.VolumeGroupSnapshotContentSpec{Driver: drv, DeletionPolicy: snapshotv1.VolumeSnapshotContentRetain,
				Source: groupv1.VolumeGroupSnapshotContentSource{GroupSnapshotHandles: &groupv1.GroupSnapshotHandles{VolumeGroupSnapshotHandle: handle, VolumeSnapshotHandles: ids}}}}
	}
	f.create(pre("imported", made.GetGroupSnapshot().GetGroupSnapshotId()))
	g, err := f.step("imported")
	if err != nil {
		t.Fatal(err)
	}
	if st := g.Status; st == nil || st.VolumeGroupSnapshotHandle == nil || *st.VolumeGroupSnapshotHandle != made.GetGroupSnapshot().GetGroupSnapshotId() ||
		!isReady(g) || st.CreationTime == nil || len(st.VolumeSnapshotInfoList) != 0 {
		t.Fatalf("status %+v; want the handle, ready, a creation time and no member list", st)
	}
	f.create(pre("unknown", "gs-nosuch"))
	if g, err = f.step("unknown"); err == nil || g.Status == nil || g.Status.Error == nil || !strings.Contains(*g.Status.Error.Message, "gs-nosuch") {
		t.Fatalf("sync %v, status %+v; want an error naming gs-nosuch", err, g.Status)
	}
	f.event("GroupSnapshotContentCheckandUpdateFailed", "gs-nosuch")
}

// TestDeletion: Delete deletes the group at the driver (with the members'
// IDs and the remembered secret), clears the status's group fields and
// removes the finalizer; Retain keeps the group and removes the
// finalizer; a content still being created is not touched.
func TestDeletion(t *testing.T) {
	f := newFixture(t, true, class("c", drv, map[string]string{
		"csi.storage.k8s.io/group-snapshotter-secret-name": "creds", "csi.storage.k8s.io/group-snapshotter-secret-namespace": "app"}))
	vols := []string{f.volume(drv, "a"), f.volume(drv, "b")}
	f.create(dynamicContent("g", drv, "c", vols))
	made, err := f.step("g")
	if err != nil {
		t.Fatal(err)
	}
	markDeleted := func(g *groupv1.VolumeGroupSnapshotContent, policy snapshotv1.DeletionPolicy, ann ...string) {
		t.Helper()
		g = g.DeepCopy()
		now := metav1.Now()
		g.DeletionTimestamp, g.Spec.DeletionPolicy = &now, policy
		for _, a := range ann {
			g.Annotations[a] = "yes"
		}
		// The fake keeps a content with a deletion timestamp as it is
		// written (no finalizer handling): what the API server shows a
		// controller while the content is being deleted.
		if err := f.snaps.Tracker().Update(groupv1.SchemeGroupVersion.WithResource("volumegroupsnapshotcontents"), g, ""); err != nil {
			t.Fatal(err)
		}
	}

	// Being created: left alone.
	markDeleted(made, snapshotv1.VolumeSnapshotContentDelete, AnnBeingDeleted, AnnBeingCreated)
	g, err := f.step("g")
	if err != nil || len(f.drivers.Requests("DeleteVolumeGroupSnapshot")) != 0 || len(g.Finalizers) != 1 {
		t.Fatalf("a content being created: sync %v, %d deletions, finalizers %v; want it untouched", err, len(f.drivers.Requests("DeleteVolumeGroupSnapshot")), g.Finalizers)
	}
	// Marked being deleted, Delete.
	delete(g.Annotations, AnnBeingCreated)
	markDeleted(g, snapshotv1.VolumeSnapshotContentDelete, AnnBeingDeleted)
	if g, err = f.step("g"); err != nil {
		t.Fatal(err)
	}
	dels := f.drivers.Requests("DeleteVolumeGroupSnapshot")
	if len(dels) != 1 {
		t.Fatalf("%d DeleteVolumeGroupSnapshot calls, want 1", len(dels))
	}
	r := dels[0].(*csi.DeleteVolumeGroupSnapshotRequest)
	if r.GetGroupSnapshotId() != *made.Status.VolumeGroupSnapshotHandle || len(r.GetSnapshotIds()) != 2 || r.GetSecrets()["password"] != "hunter2" {
		t.Errorf("DeleteVolumeGroupSnapshot of %q with %d snapshot IDs (secret given: %t); want the group, its two members and the remembered secret",
			r.GetGroupSnapshotId(), len(r.GetSnapshotIds()), r.GetSecrets()["password"] == "hunter2")
	}
	if n := len(f.d.GroupSnapshots()); n != 0 {
		t.Errorf("%d group snapshots left at the driver", n)
	}
	if len(g.Finalizers) != 0 || g.Status.VolumeGroupSnapshotHandle != nil || g.Status.ReadyToUse != nil {
		t.Errorf("finalizers %v, status %+v; want the finalizer gone and the group fields cleared", g.Finalizers, g.Status)
	}

	// Retain: the group stays.
	f.create(dynamicContent("kept", drv, "c", vols, func(g *groupv1.VolumeGroupSnapshotContent) {
		g.UID, g.Spec.VolumeGroupSnapshotRef.UID = "uid-kept", "11111111-2222-3333-4444-555555555555"
	}))
	kept, err := f.step("kept")
	if err != nil {
		t.Fatal(err)
	}
	markDeleted(kept, snapshotv1.VolumeSnapshotContentRetain, AnnBeingDeleted)
	if kept, err = f.step("kept"); err != nil {
		t.Fatal(err)
	}
	if len(kept.Finalizers) != 0 || len(f.d.GroupSnapshots()) != 1 || len(f.drivers.Requests("DeleteVolumeGroupSnapshot")) != 1 {
		t.Errorf("Retain: finalizers %v, %d groups at the driver, %d deletions; want the finalizer gone and the group kept", kept.Finalizers, len(f.d.GroupSnapshots()), len(f.drivers.Requests("DeleteVolumeGroupSnapshot")))
	}
}

// TestContentGoneDuringCreate: a content deleted while its
// CreateVolumeGroupSnapshot runs leaves no group at the driver: the status
// write finds it gone, and the recorded call is undone.
func TestContentGoneDuringCreate(t *testing.T) {
	f := newFixture(t, true, class("c", drv, nil))
	vols := []string{f.volume(drv, "a"), f.volume(drv, "b")}
	f.create(dynamicContent("g", drv, "c", vols))
	f.waitCache("g")
	f.drivers.Hook = func(method string, _ any) error {
		if method == "CreateVolumeGroupSnapshot" && len(f.drivers.Requests(method)) == 1 {
			if err := f.snaps.GroupsnapshotV1().VolumeGroupSnapshotContents().Delete(f.ctx, "g", metav1.DeleteOptions{}); err != nil {
				t.Error(err)
			}
		}
		return nil
	}
	if _, err := f.c.sync(f.ctx, "g"); err != nil {
		t.Fatal(err)
	}
	if n := len(f.drivers.Requests("CreateVolumeGroupSnapshot")); n != 2 {
		t.Errorf("%d CreateVolumeGroupSnapshot calls; want the call and recovery's ask again", n)
	}
	if n := len(f.drivers.Requests("DeleteVolumeGroupSnapshot")); n != 1 {
		t.Errorf("%d DeleteVolumeGroupSnapshot calls; want the group deleted", n)
	}
	if n := len(f.d.GroupSnapshots()); n != 0 || len(f.d.Snapshots()) != 0 {
		t.Errorf("%d groups and %d snapshots left at the driver", n, len(f.d.Snapshots()))
	}
	if f.c.intents.Has("groupsnapshot-" + groupUID) {
		t.Error("intent entry left after the group was deleted")
	}
}

// TestRecoveryUndoesAnEntryWithoutContent: an entry left by a broker that
// died after CreateVolumeGroupSnapshot, whose content is gone, is undone by
// a recovery pass; one whose content is there is left to its sync.
func TestRecoveryUndoesAnEntryWithoutContent(t *testing.T) {
	f := newFixture(t, true, class("c", drv, nil))
	vols := []string{f.volume(drv, "a"), f.volume(drv, "b")}
	g := dynamicContent("g", drv, "c", vols)
	p, err := f.c.prepare(f.ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	e, err := f.c.recordEntry(f.ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.c.intents.Add(f.ctx, e); err != nil {
		t.Fatal(err)
	}
	conn, _ := f.drivers.ControllerConn(drv)
	if _, err := csi.NewGroupControllerClient(conn).CreateVolumeGroupSnapshot(f.ctx, p.req); err != nil {
		t.Fatal(err)
	}
	// Another entry whose content exists.
	other := dynamicContent("there", drv, "c", vols, func(g *groupv1.VolumeGroupSnapshotContent) {
		g.UID, g.Spec.VolumeGroupSnapshotRef.UID = "uid-there", "99999999-2222-3333-4444-555555555555"
	})
	f.create(other)
	po, err := f.c.prepare(f.ctx, other)
	if err != nil {
		t.Fatal(err)
	}
	eo, _ := f.c.recordEntry(f.ctx, po)
	if err := f.c.intents.Add(f.ctx, eo); err != nil {
		t.Fatal(err)
	}
	f.c.recoverAll(f.ctx)
	if n := len(f.d.GroupSnapshots()); n != 0 {
		t.Errorf("%d groups left at the driver after recovery", n)
	}
	if f.c.intents.Has(e.Key()) {
		t.Error("the undone entry is still recorded")
	}
	if !f.c.intents.Has(eo.Key()) {
		t.Error("the entry of a content that is there was dropped")
	}
}
