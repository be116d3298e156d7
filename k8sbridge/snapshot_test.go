package k8sbridge

import (
	"context"
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
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
	"github.com/csibroker/csibroker/k8sbridge/provision"
)

// installSnapshotCRDs installs external-snapshotter's six CRDs (from the
// client module of the go.mod version, see testenv.InstallSnapshotCRDs) on
// the shared control plane (once; they stay). No snapshot-controller
// runs: the tests write the objects' status themselves.
func installSnapshotCRDs(t *testing.T, env *testenv.Env) {
	t.Helper()
	if err := env.InstallSnapshotCRDs(t.Context()); err != nil {
		t.Fatal(err)
	}
}

// readySnapshot makes what a snapshot-controller would leave for a
// pre-provisioned snapshot of driver's snapshot handle: a
// VolumeSnapshotContent bound to VolumeSnapshot ns/name and back, both
// ready, with the restore size. mut changes the statuses before they are
// written.
func readySnapshot(t *testing.T, sc snapshotclient.Interface, ns, name, driver, handle string, size resource.Quantity, mut func(*snapshotv1.VolumeSnapshot, *snapshotv1.VolumeSnapshotContent)) {
	t.Helper()
	ctx := context.Background()
	retain := snapshotv1.VolumeSnapshotContentRetain
	mode := corev1.PersistentVolumeFilesystem
	content := &snapshotv1.VolumeSnapshotContent{ObjectMeta: metav1.ObjectMeta{Name: kubetest.ClusterName(ns, name)},
		Spec: snapshotv1.VolumeSnapshotContentSpec{DeletionPolicy: retain, Driver: driver, SourceVolumeMode: &mode,
			Source:            snapshotv1.VolumeSnapshotContentSource{SnapshotHandle: &handle},
			VolumeSnapshotRef: corev1.ObjectReference{Namespace: ns, Name: name}}}
	content, err := sc.SnapshotV1().VolumeSnapshotContents().Create(ctx, content, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		sc.SnapshotV1().VolumeSnapshotContents().Delete(context.Background(), content.Name, metav1.DeleteOptions{})
	})
	snap := &snapshotv1.VolumeSnapshot{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: snapshotv1.VolumeSnapshotSpec{Source: snapshotv1.VolumeSnapshotSource{VolumeSnapshotContentName: &content.Name}}}
	if snap, err = sc.SnapshotV1().VolumeSnapshots(ns).Create(ctx, snap, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The broker, the csi-snapshotter here, may write the content's
	// status meanwhile (from ListSnapshots): each write is made over what
	// is there, again on a conflict.
	write := func(status bool, change func(*snapshotv1.VolumeSnapshotContent)) *snapshotv1.VolumeSnapshotContent {
		var out *snapshotv1.VolumeSnapshotContent
		err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			cur, err := sc.SnapshotV1().VolumeSnapshotContents().Get(ctx, content.Name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			change(cur)
			if status {
				out, err = sc.SnapshotV1().VolumeSnapshotContents().UpdateStatus(ctx, cur, metav1.UpdateOptions{})
			} else {
				out, err = sc.SnapshotV1().VolumeSnapshotContents().Update(ctx, cur, metav1.UpdateOptions{})
			}
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	content = write(false, func(c *snapshotv1.VolumeSnapshotContent) { c.Spec.VolumeSnapshotRef.UID = snap.UID })
	ready, bytes := true, size.Value()
	snap.Status = &snapshotv1.VolumeSnapshotStatus{BoundVolumeSnapshotContentName: &content.Name, ReadyToUse: &ready, RestoreSize: &size}
	if mut != nil {
		mut(snap, &snapshotv1.VolumeSnapshotContent{})
	}
	write(true, func(c *snapshotv1.VolumeSnapshotContent) {
		c.Status = &snapshotv1.VolumeSnapshotContentStatus{SnapshotHandle: &handle, ReadyToUse: &ready, RestoreSize: &bytes}
		if mut != nil {
			mut(&snapshotv1.VolumeSnapshot{Status: &snapshotv1.VolumeSnapshotStatus{}}, c)
		}
	})
	if _, err := sc.SnapshotV1().VolumeSnapshots(ns).UpdateStatus(ctx, snap, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// TestRestoreFromVolumeSnapshot: a claim whose data source is a ready
// VolumeSnapshot of its driver gets a volume made from the snapshot's
// handle; the snapshot carries the restore finalizer while the driver
// works and loses it once the claim is bound. A snapshot that is not
// ready, one whose content is bound to another snapshot, one of another
// driver, one larger than the claim and one that does not exist are each
// refused with an Event saying so, and the driver is not asked.
func TestRestoreFromVolumeSnapshot(t *testing.T) {
	env := kubetest.ControlPlane(t)
	installSnapshotCRDs(t, env)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	sc := snapshotclient.NewForConfigOrDie(env.RESTConfig())
	drv := kubetest.ClusterName(ns, "snap.csi.test")
	drivers := newCountingDrivers()
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "snap"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)

	// A snapshot the driver really has.
	conn, err := drivers.ControllerConn(drv)
	if err != nil {
		t.Fatal(err)
	}
	srcVol := createDriverVolume(t, drivers.testDrivers, drv, kubetest.ClusterName(ns, "src"))
	resp, err := csi.NewControllerClient(conn).CreateSnapshot(ctx, &csi.CreateSnapshotRequest{SourceVolumeId: srcVol, Name: kubetest.ClusterName(ns, "snap")})
	if err != nil {
		t.Fatal(err)
	}
	handle, size := resp.GetSnapshot().GetSnapshotId(), resource.MustParse("1Gi")
	readySnapshot(t, sc, ns, "snap", drv, handle, size, nil)
	readySnapshot(t, sc, ns, "unready", drv, handle, size, func(s *snapshotv1.VolumeSnapshot, _ *snapshotv1.VolumeSnapshotContent) {
		no := false
		s.Status.ReadyToUse = &no
	})
	readySnapshot(t, sc, ns, "other-driver", "other.csi.test", handle, size, nil)
	// A VolumeSnapshot that says it is bound to "snap"'s content.
	readySnapshot(t, sc, ns, "thief", drv, handle, size, func(s *snapshotv1.VolumeSnapshot, _ *snapshotv1.VolumeSnapshotContent) {
		stolen := kubetest.ClusterName(ns, "snap")
		s.Status.BoundVolumeSnapshotContentName = &stolen
	})
	// A snapshot left marked in use with no claim restoring it (its claim
	// went while no broker led): the sweep at the start of a term frees it.
	readySnapshot(t, sc, ns, "leftover", drv, handle, size, nil)
	left, err := sc.SnapshotV1().VolumeSnapshots(ns).Get(ctx, "leftover", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	left.Finalizers = append(left.Finalizers, provision.SnapshotFinalizer)
	if _, err := sc.SnapshotV1().VolumeSnapshots(ns).Update(ctx, left, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	run := startBridge(t, env, ns, drivers, bridgeOpts{})
	waitSnapshotReleased(t, sc, ns, "leftover")
	// Claims restoring one snapshot at once each add the finalizer to what
	// they read: one patch carries a resourceVersion the other changed.
	// That conflict is no failure.
	stale, err := sc.SnapshotV1().VolumeSnapshots(ns).Get(ctx, "leftover", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	changed := stale.DeepCopy()
	changed.Labels = map[string]string{"changed": "meanwhile"}
	if _, err := sc.SnapshotV1().VolumeSnapshots(ns).Update(ctx, changed, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := provision.ProtectSnapshot(run.b.Env, ctx, stale); err != nil {
		t.Fatalf("protecting a snapshot changed since it was read: %v", err)
	}
	if s, err := sc.SnapshotV1().VolumeSnapshots(ns).Get(ctx, "leftover", metav1.GetOptions{}); err != nil || !slices.Contains(s.Finalizers, provision.SnapshotFinalizer) || s.Labels["changed"] != "meanwhile" {
		t.Fatalf("snapshot protected after a conflict: finalizers %v labels %v, err %v; want the finalizer added and the change kept", s.Finalizers, s.Labels, err)
	} else if err := provision.PatchSnapshotFinalizer(run.b.Env, ctx, s, false); err != nil {
		t.Fatal(err)
	}

	fromSnapshot := func(snap, size string) func(*corev1.PersistentVolumeClaim) {
		return func(p *corev1.PersistentVolumeClaim) {
			group := provision.SnapshotGroup
			p.Spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: &group, Kind: provision.SnapshotKind, Name: snap}
			p.Spec.Resources.Requests[corev1.ResourceStorage] = resource.MustParse(size)
		}
	}
	letGo := drivers.hold("CreateVolume")
	defer letGo()
	kubetest.MakeClaimWith(t, c, ns, "restored", class.Name, fromSnapshot("snap", "1Gi"))
	err = testenv.WaitFor(ctx, 60*time.Second, "the restore's CreateVolume held", func(context.Context) (bool, string, error) {
		n := len(drivers.names("CreateVolume"))
		return n == 1, fmt.Sprintf("%d CreateVolume calls", n), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if s, err := sc.SnapshotV1().VolumeSnapshots(ns).Get(ctx, "snap", metav1.GetOptions{}); err != nil || !slices.Contains(s.Finalizers, provision.SnapshotFinalizer) {
		t.Fatalf("VolumeSnapshot while it is restored: %v, err %v; want finalizer %s", s.Finalizers, err, provision.SnapshotFinalizer)
	}
	letGo()
	pvName := kubetest.WaitBound(t, c, ns, "restored", 60*time.Second).Spec.VolumeName
	id := volumeHandle(t, c, pvName)
	for _, v := range d.Volumes() {
		if v.ID == id && v.SourceSnapshotID != handle {
			t.Errorf("restored volume %s made from snapshot %q, want %q", id, v.SourceSnapshotID, handle)
		}
	}
	waitSnapshotReleased(t, sc, ns, "snap")

	for _, tc := range []struct{ claim, snap, size, want string }{
		{"unready", "unready", "1Gi", "is not ready to use yet"},
		{"other-driver", "other-driver", "1Gi", "is a snapshot of driver other.csi.test"},
		{"thief", "thief", "1Gi", "is bound to VolumeSnapshot " + ns + "/snap"},
		{"small", "snap", "512Mi", "less than the restore size 1Gi"},
		{"missing", "missing", "1Gi", "VolumeSnapshot " + ns + "/missing not found"},
	} {
		kubetest.MakeClaimWith(t, c, ns, tc.claim, class.Name, fromSnapshot(tc.snap, tc.size))
		kubetest.WaitEvent(t, c, ns, tc.claim, "ProvisioningFailed", tc.want)
	}
	if n := len(drivers.names("CreateVolume")); n != 1 {
		t.Errorf("%d CreateVolume calls; want only the good restore's", n)
	}
}

// waitSnapshotReleased waits until VolumeSnapshot ns/name no longer holds
// the restore finalizer.
func waitSnapshotReleased(t *testing.T, sc snapshotclient.Interface, ns, name string) {
	t.Helper()
	err := testenv.WaitFor(context.Background(), 60*time.Second, "the restore finalizer off VolumeSnapshot "+name, func(ctx context.Context) (bool, string, error) {
		s, err := sc.SnapshotV1().VolumeSnapshots(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		return !slices.Contains(s.Finalizers, provision.SnapshotFinalizer), fmt.Sprint(s.Finalizers), nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestSnapshotGetErrorTellsAMissingAPIFromAMissingObject: the real API
// server's 404 for a VolumeSnapshot that does not exist says "not found";
// its 404 for an API group it does not serve (what a cluster without the
// VolumeSnapshot CRDs answers) says the API is not served, not that the
// snapshot is missing.
func TestSnapshotGetErrorTellsAMissingAPIFromAMissingObject(t *testing.T) {
	env := kubetest.ControlPlane(t)
	installSnapshotCRDs(t, env)
	ns := env.NewNamespace(t)
	sc := snapshotclient.NewForConfigOrDie(env.RESTConfig())
	ctx := context.Background()
	_, err := sc.SnapshotV1().VolumeSnapshots(ns).Get(ctx, "absent", metav1.GetOptions{})
	if got := provision.SnapshotGetError(err, ns, "absent").Error(); got != "VolumeSnapshot "+ns+"/absent not found" {
		t.Errorf("missing snapshot (%v): %q", err, got)
	}
	err = sc.SnapshotV1().RESTClient().Get().AbsPath("/apis/nosuch.csibroker.test/v1/namespaces", ns, "volumesnapshots", "absent").Do(ctx).Error()
	if got := provision.SnapshotGetError(err, ns, "absent").Error(); !strings.Contains(got, "does not serve the snapshot.storage.k8s.io/v1 API") || strings.Contains(got, "not found") {
		t.Errorf("API not served (%v): %q", err, got)
	}
	err = sc.SnapshotV1().RESTClient().Get().AbsPath("/apis/snapshot.storage.k8s.io/v1/namespaces", ns, "volumesnapshots", "absent").Timeout(time.Nanosecond).Do(ctx).Error()
	if err == nil {
		t.Fatal("a GET with a timeout of 1ns succeeded")
	}
	if got := provision.SnapshotGetError(err, ns, "absent").Error(); !strings.HasPrefix(got, "VolumeSnapshot "+ns+"/absent: ") || strings.Contains(got, "not found") || strings.Contains(got, "does not serve") {
		t.Errorf("other failure (%v): %q", err, got)
	}
}
