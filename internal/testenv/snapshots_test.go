package testenv

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	groupv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapshotclient "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/internal/sampledriver"
)

// snapshotCluster is a shared control plane with the snapshot CRDs, a
// sample driver and its clients.
type snapshotCluster struct {
	env    *Env
	ns     string
	driver string
	ep     string
	d      *sampledriver.Driver
	csi    csi.ControllerClient
	snaps  snapshotclient.Interface
}

func newSnapshotCluster(t *testing.T, cfg sampledriver.Config) *snapshotCluster {
	t.Helper()
	env := Shared(t)
	if err := env.InstallSnapshotCRDs(t.Context()); err != nil {
		t.Fatal(err)
	}
	ns := env.NewNamespace(t)
	cfg.Name = ns + ".csi.test"
	ep, d := sampledriver.StartTest(t, cfg)
	conn, err := grpc.NewClient(ep, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &snapshotCluster{env: env, ns: ns, driver: cfg.Name, ep: ep, d: d,
		csi: csi.NewControllerClient(conn), snaps: snapshotclient.NewForConfigOrDie(env.RESTConfig())}
}

// boundClaim makes a driver volume and a claim bound to its PV, with the
// statuses the PV controller would write (no controller-manager runs).
func (sc *snapshotCluster) boundClaim(t *testing.T, name string, labels map[string]string) {
	t.Helper()
	ctx := t.Context()
	vol, err := sc.csi.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: sc.ns + "-" + name,
		VolumeCapabilities: []*csi.VolumeCapability{{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		}}})
	if err != nil {
		t.Fatal(err)
	}
	c := sc.env.Client()
	size := resource.MustParse("1Gi")
	pv := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: sc.ns + "-" + name},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: size},
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: sc.driver, VolumeHandle: vol.GetVolume().GetVolumeId()}},
			ClaimRef: &corev1.ObjectReference{Namespace: sc.ns, Name: name},
		}}
	if pv, err = c.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.CoreV1().PersistentVolumes().Delete(context.Background(), pv.Name, metav1.DeleteOptions{}) })
	empty := ""
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: sc.ns, Labels: labels},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: size}},
			VolumeName:       pv.Name,
			StorageClassName: &empty,
		}}
	if pvc, err = c.CoreV1().PersistentVolumeClaims(sc.ns).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pv.Spec.ClaimRef.UID = pvc.UID
	if pv, err = c.CoreV1().PersistentVolumes().Update(ctx, pv, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	pv.Status.Phase = corev1.VolumeBound
	if _, err := c.CoreV1().PersistentVolumes().UpdateStatus(ctx, pv, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	pvc.Status = corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound, Capacity: corev1.ResourceList{corev1.ResourceStorage: size},
		AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}}
	if _, err := c.CoreV1().PersistentVolumeClaims(sc.ns).UpdateStatus(ctx, pvc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func (sc *snapshotCluster) snapshotClass(t *testing.T) string {
	t.Helper()
	class := &snapshotv1.VolumeSnapshotClass{ObjectMeta: metav1.ObjectMeta{Name: sc.ns + "-class"},
		Driver: sc.driver, DeletionPolicy: snapshotv1.VolumeSnapshotContentDelete}
	if _, err := sc.snaps.SnapshotV1().VolumeSnapshotClasses().Create(t.Context(), class, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		sc.snaps.SnapshotV1().VolumeSnapshotClasses().Delete(context.Background(), class.Name, metav1.DeleteOptions{})
	})
	return class.Name
}

// TestSnapshotWithTheRealSnapshotter is the reference behaviour csibroker's
// snapshot controller is compared against: the real snapshot-controller
// and csi-snapshotter take a VolumeSnapshot of a sample-driver volume to
// readyToUse, csi-snapshotter asking CreateSnapshot again while the driver
// says it is not ready yet; deleting the VolumeSnapshot deletes the
// content and the driver's snapshot.
func TestSnapshotWithTheRealSnapshotter(t *testing.T) {
	const readyAfter = 1500 * time.Millisecond
	sc := newSnapshotCluster(t, sampledriver.Config{SnapshotReadyAfter: readyAfter})
	sc.boundClaim(t, "data", nil)
	class := sc.snapshotClass(t)
	sc.env.StartSnapshotController(t, SnapshotControllerOptions{})
	sc.env.StartSnapshotter(t, SnapshotterOptions{CSIAddress: sc.ep, ExtraCreateMetadata: true})

	ctx := t.Context()
	pvc := "data"
	vs := &snapshotv1.VolumeSnapshot{ObjectMeta: metav1.ObjectMeta{Name: "snap", Namespace: sc.ns},
		Spec: snapshotv1.VolumeSnapshotSpec{Source: snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: &pvc}, VolumeSnapshotClassName: &class}}
	if _, err := sc.snaps.SnapshotV1().VolumeSnapshots(sc.ns).Create(ctx, vs, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var content *snapshotv1.VolumeSnapshotContent
	err := WaitFor(ctx, 60*time.Second, "VolumeSnapshot ready to use", func(ctx context.Context) (bool, string, error) {
		got, err := sc.snaps.SnapshotV1().VolumeSnapshots(sc.ns).Get(ctx, "snap", metav1.GetOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		st := got.Status
		if st == nil || st.ReadyToUse == nil || !*st.ReadyToUse || st.BoundVolumeSnapshotContentName == nil {
			return false, fmt.Sprintf("status %+v", st), nil
		}
		content, err = sc.snaps.SnapshotV1().VolumeSnapshotContents().Get(ctx, *st.BoundVolumeSnapshotContentName, metav1.GetOptions{})
		return err == nil, fmt.Sprint(err), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	snaps := sc.d.Snapshots()
	if len(snaps) != 1 || content.Status == nil || content.Status.SnapshotHandle == nil || *content.Status.SnapshotHandle != snaps[0].ID {
		t.Fatalf("driver snapshots %+v, content status %+v", snaps, content.Status)
	}
	if n := sc.d.CallCount("CreateSnapshot"); n < 2 {
		t.Errorf("CreateSnapshot called %d times: want it asked again until ready", n)
	}
	if !strings.HasPrefix(snaps[0].Name, "snapshot-") {
		t.Errorf("driver snapshot named %q, want csi-snapshotter's snapshot-<uid>", snaps[0].Name)
	}
	st, _ := json.Marshal(content.Status)
	t.Logf("reference content: finalizers %v, annotations %v, status %s", content.Finalizers, content.Annotations, st)

	if err := sc.snaps.SnapshotV1().VolumeSnapshots(sc.ns).Delete(ctx, "snap", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	err = WaitFor(ctx, 60*time.Second, "the content and the driver's snapshot deleted", func(ctx context.Context) (bool, string, error) {
		_, err := sc.snaps.SnapshotV1().VolumeSnapshotContents().Get(ctx, content.Name, metav1.GetOptions{})
		left := sc.d.Snapshots()
		return err != nil && len(left) == 0, fmt.Sprintf("content: %v; driver snapshots %+v", err, left), nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestMissingSnapshotterSaysHowToBuildIt: no binary in the cache is an
// error naming hack/sidecars.sh, for either program.
func TestMissingSnapshotterSaysHowToBuildIt(t *testing.T) {
	t.Setenv("CSIBROKER_CACHE", t.TempDir())
	e := &Env{}
	_, err1 := e.RunSnapshotController(t.Context(), SnapshotControllerOptions{})
	_, err2 := e.RunSnapshotter(t.Context(), SnapshotterOptions{CSIAddress: "unix:///nowhere"})
	for name, err := range map[string]error{"snapshot-controller": err1, "csi-snapshotter": err2} {
		if err == nil || !strings.Contains(err.Error(), "hack/sidecars.sh") || !strings.Contains(err.Error(), name+" "+SnapshotterVersion) {
			t.Errorf("%s: error %v, want one naming it and hack/sidecars.sh", name, err)
		}
	}
}

// TestGroupSnapshotWithTheRealSnapshotter: with the group snapshot feature
// asked for, the real pair takes a VolumeGroupSnapshot (the v1 API the
// v8.7.0 binaries use) of two labelled claims to readyToUse through the
// sample driver's GroupController, one member VolumeSnapshot per claim.
func TestGroupSnapshotWithTheRealSnapshotter(t *testing.T) {
	sc := newSnapshotCluster(t, sampledriver.Config{})
	labels := map[string]string{"app": "grouped"}
	sc.boundClaim(t, "a", labels)
	sc.boundClaim(t, "b", labels)
	class := &groupv1.VolumeGroupSnapshotClass{ObjectMeta: metav1.ObjectMeta{Name: sc.ns + "-group"},
		Driver: sc.driver, DeletionPolicy: snapshotv1.VolumeSnapshotContentDelete}
	ctx := t.Context()
	if _, err := sc.snaps.GroupsnapshotV1().VolumeGroupSnapshotClasses().Create(ctx, class, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		sc.snaps.GroupsnapshotV1().VolumeGroupSnapshotClasses().Delete(context.Background(), class.Name, metav1.DeleteOptions{})
	})
	sc.env.StartSnapshotController(t, SnapshotControllerOptions{GroupSnapshots: true})
	sc.env.StartSnapshotter(t, SnapshotterOptions{CSIAddress: sc.ep, GroupSnapshots: true})

	vgs := &groupv1.VolumeGroupSnapshot{ObjectMeta: metav1.ObjectMeta{Name: "group", Namespace: sc.ns},
		Spec: groupv1.VolumeGroupSnapshotSpec{VolumeGroupSnapshotClassName: &class.Name,
			Source: groupv1.VolumeGroupSnapshotSource{Selector: &metav1.LabelSelector{MatchLabels: labels}}}}
	if _, err := sc.snaps.GroupsnapshotV1().VolumeGroupSnapshots(sc.ns).Create(ctx, vgs, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	err := WaitFor(ctx, 60*time.Second, "VolumeGroupSnapshot and its members ready to use", func(ctx context.Context) (bool, string, error) {
		got, err := sc.snaps.GroupsnapshotV1().VolumeGroupSnapshots(sc.ns).Get(ctx, "group", metav1.GetOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		if st := got.Status; st == nil || st.ReadyToUse == nil || !*st.ReadyToUse {
			return false, fmt.Sprintf("status %+v", st), nil
		}
		return membersReady(ctx, sc, "group", 2)
	})
	if err != nil {
		t.Fatal(err)
	}
	groups, snaps := sc.d.GroupSnapshots(), sc.d.Snapshots()
	if len(groups) != 1 || len(snaps) != 2 || snaps[0].GroupID != groups[0].ID || snaps[1].GroupID != groups[0].ID {
		t.Fatalf("driver groups %+v, snapshots %+v: want one group of two", groups, snaps)
	}

	if err := sc.snaps.GroupsnapshotV1().VolumeGroupSnapshots(sc.ns).Delete(ctx, "group", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	err = WaitFor(ctx, 60*time.Second, "the group snapshot deleted in the driver", func(ctx context.Context) (bool, string, error) {
		groups, snaps := sc.d.GroupSnapshots(), sc.d.Snapshots()
		return len(groups) == 0 && len(snaps) == 0, fmt.Sprintf("driver groups %+v, snapshots %+v", groups, snaps), nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// membersReady reports whether n VolumeSnapshots of sc's namespace are
// ready members of group snapshot group.
func membersReady(ctx context.Context, sc *snapshotCluster, group string, n int) (bool, string, error) {
	list, err := sc.snaps.SnapshotV1().VolumeSnapshots(sc.ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return false, err.Error(), nil
	}
	ready := 0
	var states []string
	for _, m := range list.Items {
		st := m.Status
		if st != nil && st.ReadyToUse != nil && *st.ReadyToUse && st.VolumeGroupSnapshotName != nil && *st.VolumeGroupSnapshotName == group {
			ready++
		}
		states = append(states, fmt.Sprintf("%s: %+v", m.Name, st))
	}
	return ready == n && len(list.Items) == n, fmt.Sprintf("members %v", states), nil
}
