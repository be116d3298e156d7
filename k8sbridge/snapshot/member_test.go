package snapshot

import (
	"errors"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestGroupMemberWaitsForItsStatus: a group member's content made by the
// snapshot-controller before it writes the member's status is not
// snapshotted on its own, but looked at again (not ready) until the status
// names its snapshot, which is then checked with ListSnapshots.
func TestGroupMemberWaitsForItsStatus(t *testing.T) {
	f := newFixture(t, true)
	vol := f.volume("src")
	conn, _ := f.drivers.ControllerConn(drv)
	group, err := csi.NewGroupControllerClient(conn).CreateVolumeGroupSnapshot(f.ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "g", SourceVolumeIds: []string{vol}})
	if err != nil {
		t.Fatal(err)
	}
	gid, sid := group.GetGroupSnapshot().GetGroupSnapshotId(), group.GetGroupSnapshot().GetSnapshots()[0].GetSnapshotId()
	member := dynamicContent("m", "", vol, func(v *snapshotv1.VolumeSnapshotContent) {
		v.Spec.VolumeSnapshotClassName = nil
		v.Annotations = map[string]string{annGroupMember: gid}
	})
	if _, err := f.snaps.SnapshotV1().VolumeSnapshotContents().Create(f.ctx, member, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := f.step("m"); !errors.Is(err, errNotReady) {
		t.Fatalf("sync of a member without status: %v; want it looked at again (not ready)", err)
	}
	if n := len(f.drivers.Requests("CreateSnapshot")); n != 0 {
		t.Fatalf("%d CreateSnapshot calls for a group member", n)
	}
	no := false
	cur, err := f.snaps.SnapshotV1().VolumeSnapshotContents().Get(f.ctx, "m", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cur.Status = &snapshotv1.VolumeSnapshotContentStatus{SnapshotHandle: &sid, VolumeGroupSnapshotHandle: &gid, ReadyToUse: &no}
	if _, err := f.snaps.SnapshotV1().VolumeSnapshotContents().UpdateStatus(f.ctx, cur, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	vsc, err := f.step("m")
	if err != nil || !isReady(vsc) {
		t.Fatalf("sync of a member with its status: %v, status %+v; want ready from ListSnapshots", err, vsc.Status)
	}
}
