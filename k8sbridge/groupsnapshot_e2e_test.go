package k8sbridge

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
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
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/groupsnapshot"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
)

// makeGroupClass makes a VolumeGroupSnapshotClass of driver.
func makeGroupClass(t *testing.T, sc snapshotclient.Interface, name, driver string, policy snapshotv1.DeletionPolicy) {
	t.Helper()
	cl := &groupv1.VolumeGroupSnapshotClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Driver: driver, DeletionPolicy: policy}
	if _, err := sc.GroupsnapshotV1().VolumeGroupSnapshotClasses().Create(context.Background(), cl, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		sc.GroupsnapshotV1().VolumeGroupSnapshotClasses().Delete(context.Background(), name, metav1.DeleteOptions{})
	})
}

// makeGroupSnapshot asks for a group snapshot of the claims labelled sel.
func makeGroupSnapshot(t *testing.T, sc snapshotclient.Interface, ns, name, class string, sel map[string]string) {
	t.Helper()
	vgs := &groupv1.VolumeGroupSnapshot{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: groupv1.VolumeGroupSnapshotSpec{VolumeGroupSnapshotClassName: &class,
			Source: groupv1.VolumeGroupSnapshotSource{Selector: &metav1.LabelSelector{MatchLabels: sel}}}}
	if _, err := sc.GroupsnapshotV1().VolumeGroupSnapshots(ns).Create(context.Background(), vgs, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// waitGroupReady waits until VolumeGroupSnapshot ns/name and n member
// VolumeSnapshots are ready, and returns its content and the members.
func waitGroupReady(t *testing.T, sc snapshotclient.Interface, ns, name string, n int) (*groupv1.VolumeGroupSnapshotContent, []snapshotv1.VolumeSnapshot) {
	t.Helper()
	var content *groupv1.VolumeGroupSnapshotContent
	var members []snapshotv1.VolumeSnapshot
	seen := ""
	err := testenv.WaitFor(context.Background(), 90*time.Second, "VolumeGroupSnapshot "+name+" and its members ready", func(ctx context.Context) (bool, string, error) {
		vgs, err := sc.GroupsnapshotV1().VolumeGroupSnapshots(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error() + "; before: " + seen, nil
		}
		st := vgs.Status
		if st == nil || st.BoundVolumeGroupSnapshotContentName == nil || st.ReadyToUse == nil || !*st.ReadyToUse {
			return false, "group status " + js(st), nil
		}
		if content, err = sc.GroupsnapshotV1().VolumeGroupSnapshotContents().Get(ctx, *st.BoundVolumeGroupSnapshotContentName, metav1.GetOptions{}); err != nil {
			return false, err.Error(), nil
		}
		list, err := sc.SnapshotV1().VolumeSnapshots(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		members = members[:0]
		var states []string
		for _, vs := range list.Items {
			if s := vs.Status; s != nil && s.VolumeGroupSnapshotName != nil && *s.VolumeGroupSnapshotName == name {
				if s.ReadyToUse != nil && *s.ReadyToUse {
					members = append(members, vs)
				}
				states = append(states, vs.Name+": "+js(s))
			}
		}
		seen = fmt.Sprintf("content status %s; members %v", js(content.Status), states)
		return len(members) == n, seen, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return content, members
}

// staticClaim makes a claim bound to a PV of driver's volume volID (for a
// driver the broker does not provision); the PV controller binds them.
func staticClaim(t *testing.T, c kubernetes.Interface, ns, name, driver, volID string, labels map[string]string) {
	t.Helper()
	ctx := context.Background()
	size := resource.MustParse("1Gi")
	pv := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: kubetest.ClusterName(ns, name)},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: size},
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			PersistentVolumeSource:        corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: driver, VolumeHandle: volID}},
			ClaimRef:                      &corev1.ObjectReference{Namespace: ns, Name: name},
		}}
	if _, err := c.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.CoreV1().PersistentVolumes().Delete(context.Background(), pv.Name, metav1.DeleteOptions{}) })
	empty := ""
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: labels},
		Spec: corev1.PersistentVolumeClaimSpec{AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:  corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: size}},
			VolumeName: pv.Name, StorageClassName: &empty}}
	if _, err := c.CoreV1().PersistentVolumeClaims(ns).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitBound(t, c, ns, name, 60*time.Second)
}

// shape is v's JSON with every string and number replaced by its kind:
// what two contents made of different objects can be compared on, field by
// field (which fields are set, the booleans, the lists' lengths).
func shape(v any) any {
	raw, _ := json.Marshal(v)
	var x any
	_ = json.Unmarshal(raw, &x)
	var walk func(any) any
	walk = func(x any) any {
		switch y := x.(type) {
		case map[string]any:
			for k, e := range y {
				y[k] = walk(e)
			}
			return y
		case []any:
			for i, e := range y {
				y[i] = walk(e)
			}
			return y
		case string:
			return "<string>"
		case float64:
			return "<number>"
		}
		return x
	}
	return walk(x)
}

// TestGroupSnapshotsWithTheRealSnapshotController: with external-
// snapshotter's own snapshot-controller (group snapshots on) and the
// broker as the only csi-snapshotter of its drivers, a VolumeGroupSnapshot
// of three labelled claims becomes ready with three ready member
// VolumeSnapshots, each restored into a claim that binds; deleting it
// (Delete) deletes the group at the driver. A driver without the group
// capability gets a clear error on the content, as an Event too. The
// group content's final status, annotations and finalizers have the shape
// the real csi-snapshotter gives a group of another driver on the same
// cluster.
func TestGroupSnapshotsWithTheRealSnapshotController(t *testing.T) {
	env := kubetest.ControlPlane(t)
	installSnapshotCRDs(t, env)
	env.StartSnapshotController(t, testenv.SnapshotControllerOptions{GroupSnapshots: true})
	ns := env.NewNamespace(t)
	c, ctx := env.Client(), context.Background()
	sc := snapshotclient.NewForConfigOrDie(env.RESTConfig())
	drivers := newCountingDrivers()
	drv, plain := kubetest.ClusterName(ns, "group.csi.test"), kubetest.ClusterName(ns, "plain.csi.test")
	d := drivers.addDriver(t, sampledriver.Config{Name: drv, SnapshotReadyAfter: time.Second})
	drivers.addDriver(t, sampledriver.Config{Name: plain, DisableGroupSnapshots: true})
	imm, del := storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "group"), drv, imm, del, nil)
	plainClass := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "plain"), plain, imm, del, nil)
	groupClass, plainGroupClass := kubetest.ClusterName(ns, "vgs"), kubetest.ClusterName(ns, "vgs-plain")
	makeGroupClass(t, sc, groupClass, drv, snapshotv1.VolumeSnapshotContentDelete)
	makeGroupClass(t, sc, plainGroupClass, plain, snapshotv1.VolumeSnapshotContentDelete)

	// The reference: csi-snapshotter for a driver the broker does not
	// serve, on the same cluster and snapshot-controller.
	refDrv := kubetest.ClusterName(ns, "ref.csi.test")
	// Its snapshots are ready at once: csi-snapshotter v8.7.0 leaves a
	// group's member VolumeSnapshots not ready (seen here for 90s and
	// more) when its first CreateVolumeGroupSnapshot answer said they were
	// not, so a slow reference driver gives no reference at all.
	refEP, refD := sampledriver.StartTest(t, sampledriver.Config{Name: refDrv})
	env.StartSnapshotter(t, testenv.SnapshotterOptions{CSIAddress: refEP, GroupSnapshots: true})
	refConn, err := grpc.NewClient(refEP, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { refConn.Close() })
	refClass := kubetest.ClusterName(ns, "vgs-ref")
	makeGroupClass(t, sc, refClass, refDrv, snapshotv1.VolumeSnapshotContentDelete)

	r := startBridge(t, env, ns, drivers, bridgeOpts{})
	// Before the snapshot-controller, csi-snapshotter and the broker stop
	// (cleanups run last first): the groups go, with their members. A
	// member VolumeSnapshot left being deleted crashes the next test's
	// snapshot-controller, which runs without group snapshots (v8.7.0
	// dereferences its group lister, nil then).
	t.Cleanup(func() { deleteGroups(t, sc, ns) })
	grouped, refLabels := map[string]string{"app": "grouped"}, map[string]string{"app": "reference"}
	for _, n := range []string{"a", "b", "c"} {
		kubetest.MakeClaimWith(t, c, ns, "src-"+n, class.Name, func(p *corev1.PersistentVolumeClaim) { p.Labels = grouped })
		vol, err := csi.NewControllerClient(refConn).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "ref-" + n,
			CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30},
			VolumeCapabilities: []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
				AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}}})
		if err != nil {
			t.Fatal(err)
		}
		staticClaim(t, c, ns, "ref-"+n, refDrv, vol.GetVolume().GetVolumeId(), refLabels)
	}
	for _, n := range []string{"a", "b", "c"} {
		kubetest.WaitBound(t, c, ns, "src-"+n, 60*time.Second)
	}
	makeGroupSnapshot(t, sc, ns, "nightly", groupClass, grouped)
	makeGroupSnapshot(t, sc, ns, "reference", refClass, refLabels)
	content, members := waitGroupReady(t, sc, ns, "nightly", 3)
	refContent, _ := waitGroupReady(t, sc, ns, "reference", 3)

	groups := d.GroupSnapshots()
	if len(groups) != 1 || content.Status.VolumeGroupSnapshotHandle == nil || *content.Status.VolumeGroupSnapshotHandle != groups[0].ID || len(groups[0].SnapshotIDs) != 3 {
		t.Fatalf("driver groups %+v, content status %s; want one group of three, recorded", groups, js(content.Status))
	}
	vgs, err := sc.GroupsnapshotV1().VolumeGroupSnapshots(ns).Get(ctx, "nightly", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if want := "groupsnapshot-" + string(vgs.UID); groups[0].Name != want {
		t.Errorf("driver group named %q, want %q", groups[0].Name, want)
	}
	if n := len(drivers.names("CreateVolumeGroupSnapshot")); n != 1 {
		t.Errorf("%d CreateVolumeGroupSnapshot calls; want 1 (then GetVolumeGroupSnapshot until ready)", n)
	}
	if d.CallCount("GetVolumeGroupSnapshot") == 0 {
		t.Error("no GetVolumeGroupSnapshot while the group was not ready")
	}
	for _, m := range members {
		if !slices.Contains(groups[0].SnapshotIDs, memberHandle(t, sc, m)) {
			t.Errorf("member %s's snapshot is not one of the group's %v", m.Name, groups[0].SnapshotIDs)
		}
	}

	// Compared with csi-snapshotter's content, field by field. Both write
	// the member list once, from the first answer that names the members:
	// the broker's driver made them ready only a second later, the
	// reference's at once, so the members' readyToUse is compared as set,
	// not by value.
	if got, want := shape(memberReadiness(content.Status)), shape(memberReadiness(refContent.Status)); js(got) != js(want) {
		t.Errorf("group content status shape\n broker:          %s\n csi-snapshotter: %s", js(got), js(want))
	}
	if got, want := slices.Sorted(maps.Keys(content.Annotations)), slices.Sorted(maps.Keys(refContent.Annotations)); !slices.Equal(got, want) {
		t.Errorf("group content annotations: broker %v, csi-snapshotter %v", got, want)
	}
	if _, ok := content.Annotations[groupsnapshot.AnnBeingCreated]; ok {
		t.Errorf("group content still marked %s", groupsnapshot.AnnBeingCreated)
	}
	if !slices.Equal(content.Finalizers, refContent.Finalizers) || !slices.Contains(content.Finalizers, groupsnapshot.ContentFinalizer) {
		t.Errorf("group content finalizers: broker %v, csi-snapshotter %v", content.Finalizers, refContent.Finalizers)
	}
	t.Logf("broker's group content: annotations %v finalizers %v status %s", content.Annotations, content.Finalizers, js(content.Status))
	t.Logf("csi-snapshotter's:      annotations %v finalizers %v status %s", refContent.Annotations, refContent.Finalizers, js(refContent.Status))

	// Each member restored into a claim that binds.
	for i, m := range members {
		claim := fmt.Sprintf("restored-%d", i)
		restoreClaim(t, c, ns, claim, class.Name, m.Name)
		id := volumeHandle(t, c, kubetest.WaitBound(t, c, ns, claim, 60*time.Second).Spec.VolumeName)
		for _, v := range d.Volumes() {
			if v.ID == id && v.SourceSnapshotID != memberHandle(t, sc, m) {
				t.Errorf("claim %s restored from %q, want member %s's snapshot", claim, v.SourceSnapshotID, m.Name)
			}
		}
	}

	// A driver without the group capability: a clear error.
	kubetest.MakeClaimWith(t, c, ns, "plain-src", plainClass.Name, func(p *corev1.PersistentVolumeClaim) { p.Labels = map[string]string{"app": "plain"} })
	kubetest.WaitBound(t, c, ns, "plain-src", 60*time.Second)
	makeGroupSnapshot(t, sc, ns, "plain", plainGroupClass, map[string]string{"app": "plain"})
	var plainContent string
	err = testenv.WaitFor(ctx, 60*time.Second, "the plain driver's group content refused", func(ctx context.Context) (bool, string, error) {
		vgs, err := sc.GroupsnapshotV1().VolumeGroupSnapshots(ns).Get(ctx, "plain", metav1.GetOptions{})
		if err != nil || vgs.Status == nil || vgs.Status.BoundVolumeGroupSnapshotContentName == nil {
			return false, fmt.Sprint(err), nil
		}
		plainContent = *vgs.Status.BoundVolumeGroupSnapshotContentName
		g, err := sc.GroupsnapshotV1().VolumeGroupSnapshotContents().Get(ctx, plainContent, metav1.GetOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		st := g.Status
		return st != nil && st.Error != nil && strings.Contains(*st.Error.Message, "does not make group snapshots"), js(st), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	kubetest.WaitEvent(t, c, "default", plainContent, "GroupSnapshotCreationFailed", "driver "+plain+" does not make group snapshots")

	// Delete: the group goes at the driver, with its members.
	if err := sc.GroupsnapshotV1().VolumeGroupSnapshots(ns).Delete(ctx, "nightly", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	err = testenv.WaitFor(ctx, 90*time.Second, "the group snapshot deleted at the driver", func(ctx context.Context) (bool, string, error) {
		_, cerr := sc.GroupsnapshotV1().VolumeGroupSnapshotContents().Get(ctx, content.Name, metav1.GetOptions{})
		return cerr != nil && len(d.GroupSnapshots()) == 0 && len(d.Snapshots()) == 0,
			fmt.Sprintf("content: %v; driver groups %d, snapshots %d", cerr, len(d.GroupSnapshots()), len(d.Snapshots())), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := d.CallCount("DeleteVolumeGroupSnapshot"); n != 1 {
		t.Errorf("%d DeleteVolumeGroupSnapshot calls, want 1", n)
	}
	if n := d.CallCount("DeleteSnapshot"); n != 0 {
		t.Errorf("%d DeleteSnapshot calls for group members; want none (they go with their group)", n)
	}
	if v := r.metricValue(t, "csibroker_group_snapshot_operations_total", map[string]string{"driver": drv, "result": "deleted"}); v != 1 {
		t.Errorf("group_snapshot_operations_total{deleted} = %v, want 1", v)
	}
	if len(refD.GroupSnapshots()) != 1 {
		t.Errorf("the reference driver holds %d groups; want its one", len(refD.GroupSnapshots()))
	}
}

// deleteGroups deletes the VolumeGroupSnapshots of ns and waits until no
// VolumeSnapshot and no group content of theirs is left.
func deleteGroups(t *testing.T, sc snapshotclient.Interface, ns string) {
	ctx := context.Background()
	if err := sc.GroupsnapshotV1().VolumeGroupSnapshots(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
		t.Errorf("delete the group snapshots of %s: %v", ns, err)
		return
	}
	err := testenv.WaitFor(ctx, 60*time.Second, "the group snapshots of "+ns+" and their members gone", func(ctx context.Context) (bool, string, error) {
		vs, err := sc.SnapshotV1().VolumeSnapshots(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		vgs, err := sc.GroupsnapshotV1().VolumeGroupSnapshots(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		return len(vs.Items) == 0 && len(vgs.Items) == 0, fmt.Sprintf("%d VolumeSnapshots, %d VolumeGroupSnapshots", len(vs.Items), len(vgs.Items)), nil
	})
	if err != nil {
		t.Error(err)
	}
}

// memberReadiness is st with its members' readyToUse set to true where
// set (see the comparison above).
func memberReadiness(st *groupv1.VolumeGroupSnapshotContentStatus) *groupv1.VolumeGroupSnapshotContentStatus {
	st = st.DeepCopy()
	for i := range st.VolumeSnapshotInfoList {
		if st.VolumeSnapshotInfoList[i].ReadyToUse != nil {
			yes := true
			st.VolumeSnapshotInfoList[i].ReadyToUse = &yes
		}
	}
	return st
}

// memberHandle is the snapshot handle of member VolumeSnapshot vs.
func memberHandle(t *testing.T, sc snapshotclient.Interface, vs snapshotv1.VolumeSnapshot) string {
	t.Helper()
	vsc, err := sc.SnapshotV1().VolumeSnapshotContents().Get(context.Background(), *vs.Status.BoundVolumeSnapshotContentName, metav1.GetOptions{})
	if err != nil || vsc.Status == nil || vsc.Status.SnapshotHandle == nil {
		t.Fatalf("member %s's content: %v, %+v", vs.Name, err, vsc)
	}
	return *vsc.Status.SnapshotHandle
}
