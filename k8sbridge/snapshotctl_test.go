package k8sbridge

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapshotclient "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/intent"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
	"github.com/csibroker/csibroker/k8sbridge/provision"
	"github.com/csibroker/csibroker/k8sbridge/snapshot"
)

// makeSnapshotClass makes a VolumeSnapshotClass of driver.
func makeSnapshotClass(t *testing.T, sc snapshotclient.Interface, name, driver string, policy snapshotv1.DeletionPolicy, params map[string]string) {
	t.Helper()
	cl := &snapshotv1.VolumeSnapshotClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Driver: driver, DeletionPolicy: policy, Parameters: params}
	if _, err := sc.SnapshotV1().VolumeSnapshotClasses().Create(context.Background(), cl, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		sc.SnapshotV1().VolumeSnapshotClasses().Delete(context.Background(), name, metav1.DeleteOptions{})
	})
}

// makeVolumeSnapshot asks for a snapshot of claim with class.
func makeVolumeSnapshot(t *testing.T, sc snapshotclient.Interface, ns, name, claim, class string) {
	t.Helper()
	vs := &snapshotv1.VolumeSnapshot{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: snapshotv1.VolumeSnapshotSpec{Source: snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: &claim}, VolumeSnapshotClassName: &class}}
	if _, err := sc.SnapshotV1().VolumeSnapshots(ns).Create(context.Background(), vs, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// waitVolumeSnapshotReady waits until VolumeSnapshot ns/name is ready and
// returns it with its bound content.
func waitVolumeSnapshotReady(t *testing.T, sc snapshotclient.Interface, ns, name string) (*snapshotv1.VolumeSnapshot, *snapshotv1.VolumeSnapshotContent) {
	t.Helper()
	var vs *snapshotv1.VolumeSnapshot
	var vsc *snapshotv1.VolumeSnapshotContent
	err := testenv.WaitFor(context.Background(), 90*time.Second, "VolumeSnapshot "+name+" ready", func(ctx context.Context) (bool, string, error) {
		var err error
		if vs, err = sc.SnapshotV1().VolumeSnapshots(ns).Get(ctx, name, metav1.GetOptions{}); err != nil {
			return false, err.Error(), nil
		}
		if vs.Status == nil || vs.Status.BoundVolumeSnapshotContentName == nil {
			return false, fmt.Sprintf("status %s", js(vs.Status)), nil
		}
		if vsc, err = sc.SnapshotV1().VolumeSnapshotContents().Get(ctx, *vs.Status.BoundVolumeSnapshotContentName, metav1.GetOptions{}); err != nil {
			return false, err.Error(), nil
		}
		ready := vs.Status.ReadyToUse != nil && *vs.Status.ReadyToUse
		return ready, fmt.Sprintf("snapshot status %s; content status %s", js(vs.Status), js(vsc.Status)), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return vs, vsc
}

// waitContent waits until content name satisfies cond (nil: it is gone).
func waitContent(t *testing.T, sc snapshotclient.Interface, name, what string, cond func(*snapshotv1.VolumeSnapshotContent) bool) *snapshotv1.VolumeSnapshotContent {
	t.Helper()
	var got *snapshotv1.VolumeSnapshotContent
	err := testenv.WaitFor(context.Background(), 60*time.Second, "content "+name+" "+what, func(ctx context.Context) (bool, string, error) {
		vsc, err := sc.SnapshotV1().VolumeSnapshotContents().Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return cond == nil, "gone", nil
		}
		if err != nil {
			return false, err.Error(), nil
		}
		got = vsc
		return cond != nil && cond(vsc), fmt.Sprintf("annotations %v finalizers %v status %s", vsc.Annotations, vsc.Finalizers, js(vsc.Status)), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

func js(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// restoreClaim makes claim ns/name from VolumeSnapshot snap.
func restoreClaim(t *testing.T, c kubernetes.Interface, ns, name, class, snap string) {
	t.Helper()
	kubetest.MakeClaimWith(t, c, ns, name, class, func(p *corev1.PersistentVolumeClaim) {
		group := provision.SnapshotGroup
		p.Spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: &group, Kind: provision.SnapshotKind, Name: snap}
		p.Spec.Resources.Requests[corev1.ResourceStorage] = resource.MustParse("1Gi")
	})
}

// snapshotIntents lists the snapshot intent record of the broker of ns.
func snapshotIntents(t *testing.T, c kubernetes.Interface, ns string) []snapshot.Entry {
	t.Helper()
	es, err := intent.NewRecord[snapshot.Entry](c, ns, "csibroker-snapshot-intents", "", nil).List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return es
}

// waitNoUnrecordedSnapshots waits until every snapshot of the drivers is
// recorded by a content's status (want of them in all) and the snapshot
// intent record is empty.
func waitNoUnrecordedSnapshots(t *testing.T, c kubernetes.Interface, sc snapshotclient.Interface, ns string, want int, ds ...*sampledriver.Driver) {
	t.Helper()
	err := testenv.WaitFor(context.Background(), 60*time.Second, "no snapshot that no content records", func(ctx context.Context) (bool, string, error) {
		list, err := sc.SnapshotV1().VolumeSnapshotContents().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		recorded := map[string]bool{}
		for _, vsc := range list.Items {
			if vsc.Status != nil && vsc.Status.SnapshotHandle != nil {
				recorded[*vsc.Status.SnapshotHandle] = true
			}
		}
		var all, unrecorded []string
		for _, d := range ds {
			for _, s := range d.Snapshots() {
				all = append(all, s.ID)
				if !recorded[s.ID] {
					unrecorded = append(unrecorded, s.ID+" ("+s.Name+")")
				}
			}
		}
		es := snapshotIntents(t, c, ns)
		return len(unrecorded) == 0 && len(all) == want && len(es) == 0, fmt.Sprintf("snapshots %v, unrecorded %v, intent entries %d", all, unrecorded, len(es)), nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestSnapshotsWithTheRealSnapshotController: with external-snapshotter's
// own snapshot-controller binding VolumeSnapshots to contents and the
// broker as the only csi-snapshotter, claims of two drivers at once are
// snapshotted (one driver's snapshots become ready only after a while, so
// the broker asks again until they are), restored into claims that bind,
// deleted with their snapshot (Delete) or kept (Retain); a pre-provisioned
// snapshot is imported by its handle and restored too.
func TestSnapshotsWithTheRealSnapshotController(t *testing.T) {
	env := kubetest.ControlPlane(t)
	installSnapshotCRDs(t, env)
	env.StartSnapshotController(t, testenv.SnapshotControllerOptions{})
	ns := env.NewNamespace(t)
	c, ctx := env.Client(), context.Background()
	sc := snapshotclient.NewForConfigOrDie(env.RESTConfig())
	drivers := newCountingDrivers()
	drvA, drvB := kubetest.ClusterName(ns, "a.csi.test"), kubetest.ClusterName(ns, "b.csi.test")
	dA := drivers.addDriver(t, sampledriver.Config{Name: drvA})
	dB := drivers.addDriver(t, sampledriver.Config{Name: drvB, SnapshotReadyAfter: 2 * time.Second})
	imm, del := storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete
	classA := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "a"), drvA, imm, del, nil)
	classB := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "b"), drvB, imm, del, nil)
	kubetest.CreatePasswordSecrets(t, c, ns, "snapshot-password", "snap-creds")
	snapA, snapB := kubetest.ClusterName(ns, "snap-a"), kubetest.ClusterName(ns, "snap-b")
	makeSnapshotClass(t, sc, snapA, drvA, snapshotv1.VolumeSnapshotContentDelete, map[string]string{"kind": "full",
		"csi.storage.k8s.io/snapshotter-secret-name": "snap-creds", "csi.storage.k8s.io/snapshotter-secret-namespace": "${volumesnapshot.namespace}"})
	makeSnapshotClass(t, sc, snapB, drvB, snapshotv1.VolumeSnapshotContentRetain, nil)
	r := startBridge(t, env, ns, drivers, bridgeOpts{})

	kubetest.MakeClaim(t, c, ns, "src-a", classA.Name, "1Gi")
	kubetest.MakeClaim(t, c, ns, "src-b", classB.Name, "1Gi")
	kubetest.WaitBound(t, c, ns, "src-a", 60*time.Second)
	kubetest.WaitBound(t, c, ns, "src-b", 60*time.Second)
	makeVolumeSnapshot(t, sc, ns, "vs-a", "src-a", snapA)
	makeVolumeSnapshot(t, sc, ns, "vs-b", "src-b", snapB)
	_, contentA := waitVolumeSnapshotReady(t, sc, ns, "vs-a")
	vsB, contentB := waitVolumeSnapshotReady(t, sc, ns, "vs-b")
	for _, vsc := range []*snapshotv1.VolumeSnapshotContent{contentA, contentB} {
		if st := vsc.Status; st.SnapshotHandle == nil || st.RestoreSize == nil || *st.RestoreSize != 1<<30 || st.CreationTime == nil || st.Error != nil {
			t.Errorf("content %s status %s; want a handle, restore size 1Gi, creation time, no error", vsc.Name, js(st))
		}
		if _, ok := vsc.Annotations[snapshot.AnnBeingCreated]; ok {
			t.Errorf("content %s still marked %s", vsc.Name, snapshot.AnnBeingCreated)
		}
	}
	if contentA.Annotations[snapshot.AnnDeletionSecretName] != "snap-creds" || contentA.Annotations[snapshot.AnnDeletionSecretNS] != ns {
		t.Errorf("content %s annotations %v; want the deletion secret %s/snap-creds", contentA.Name, contentA.Annotations, ns)
	}
	wantName := "snapshot-" + string(vsB.UID)
	if names := drivers.names("CreateSnapshot"); len(slices.DeleteFunc(slices.Clone(names), func(n string) bool { return n != wantName })) < 2 {
		t.Errorf("CreateSnapshot calls %v; want %s asked again until driver %s said ready", names, wantName, drvB)
	}
	if n := len(dA.Snapshots()) + len(dB.Snapshots()); n != 2 {
		t.Errorf("%d snapshots at the drivers, want 2", n)
	}

	// Restored, each into a claim of its driver that binds.
	restoreClaim(t, c, ns, "restored-a", classA.Name, "vs-a")
	restoreClaim(t, c, ns, "restored-b", classB.Name, "vs-b")
	for claim, want := range map[string]struct {
		d      *sampledriver.Driver
		handle string
	}{"restored-a": {dA, *contentA.Status.SnapshotHandle}, "restored-b": {dB, *contentB.Status.SnapshotHandle}} {
		id := volumeHandle(t, c, kubetest.WaitBound(t, c, ns, claim, 60*time.Second).Spec.VolumeName)
		for _, v := range want.d.Volumes() {
			if v.ID == id && v.SourceSnapshotID != want.handle {
				t.Errorf("claim %s restored from %q, want %q", claim, v.SourceSnapshotID, want.handle)
			}
		}
	}

	// A pre-provisioned snapshot of driver A, imported by its handle.
	conn, err := drivers.ControllerConn(drvA)
	if err != nil {
		t.Fatal(err)
	}
	srcVol := createDriverVolume(t, drivers.testDrivers, drvA, kubetest.ClusterName(ns, "outside"))
	made, err := csi.NewControllerClient(conn).CreateSnapshot(ctx, &csi.CreateSnapshotRequest{SourceVolumeId: srcVol, Name: kubetest.ClusterName(ns, "outside")})
	if err != nil {
		t.Fatal(err)
	}
	handle, imported := made.GetSnapshot().GetSnapshotId(), kubetest.ClusterName(ns, "imported")
	pre := &snapshotv1.VolumeSnapshotContent{ObjectMeta: metav1.ObjectMeta{Name: imported},
		Spec: snapshotv1.VolumeSnapshotContentSpec{Driver: drvA, DeletionPolicy: snapshotv1.VolumeSnapshotContentDelete,
			Source: snapshotv1.VolumeSnapshotContentSource{SnapshotHandle: &handle}, VolumeSnapshotRef: corev1.ObjectReference{Namespace: ns, Name: "vs-imported"}}}
	if _, err := sc.SnapshotV1().VolumeSnapshotContents().Create(ctx, pre, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	vsImp := &snapshotv1.VolumeSnapshot{ObjectMeta: metav1.ObjectMeta{Name: "vs-imported", Namespace: ns},
		Spec: snapshotv1.VolumeSnapshotSpec{Source: snapshotv1.VolumeSnapshotSource{VolumeSnapshotContentName: &imported}}}
	if _, err := sc.SnapshotV1().VolumeSnapshots(ns).Create(ctx, vsImp, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, vsc := waitVolumeSnapshotReady(t, sc, ns, "vs-imported"); vsc.Status.SnapshotHandle == nil || *vsc.Status.SnapshotHandle != handle || vsc.Status.RestoreSize == nil {
		t.Errorf("imported content status %s; want handle %s and its restore size", js(vsc.Status), handle)
	}
	restoreClaim(t, c, ns, "restored-imported", classA.Name, "vs-imported")
	kubetest.WaitBound(t, c, ns, "restored-imported", 60*time.Second)

	// Delete: the VolumeSnapshot goes, and so do its content and snapshot.
	// Retain: the content stays, marked, with its snapshot.
	for _, vs := range []string{"vs-a", "vs-b", "vs-imported"} {
		if err := sc.SnapshotV1().VolumeSnapshots(ns).Delete(ctx, vs, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	waitContent(t, sc, contentA.Name, "gone", nil)
	waitContent(t, sc, imported, "gone", nil)
	waitContent(t, sc, contentB.Name, "marked being deleted", func(vsc *snapshotv1.VolumeSnapshotContent) bool {
		_, ok := vsc.Annotations[snapshot.AnnBeingDeleted]
		return ok
	})
	if n := len(dA.Snapshots()); n != 0 {
		t.Errorf("driver %s keeps %d snapshots after their Delete-policy VolumeSnapshots went", drvA, n)
	}
	if s := dB.Snapshots(); len(s) != 1 || s[0].ID != *contentB.Status.SnapshotHandle {
		t.Errorf("driver %s snapshots %v; want the retained one %s", drvB, s, *contentB.Status.SnapshotHandle)
	}
	// The retained content deleted by hand: its finalizer goes, its
	// snapshot stays.
	if err := sc.SnapshotV1().VolumeSnapshotContents().Delete(ctx, contentB.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitContent(t, sc, contentB.Name, "gone", nil)
	if n := len(dB.Snapshots()); n != 1 {
		t.Errorf("driver %s: %d snapshots after the retained content went; want 1 kept", drvB, n)
	}
	if n := dA.CallCount("DeleteSnapshot") + dB.CallCount("DeleteSnapshot"); n != 2 {
		t.Errorf("%d DeleteSnapshot calls, want 2 (the dynamic and the imported Delete-policy snapshots)", n)
	}
	if v := r.metricValue(t, "csibroker_snapshot_operations_total", map[string]string{"driver": drvA, "result": "deleted"}); v != 2 {
		t.Errorf("snapshot_operations_total{driver A, deleted} = %v, want 2", v)
	}
	if es := snapshotIntents(t, c, ns); len(es) != 0 {
		t.Errorf("snapshot intent record holds %v", es)
	}
}

// nodeName is a fake node for node-local tests.
func nodeName(ns, n string) string { return strings.ToLower(kubetest.ClusterName(ns, n)) }
