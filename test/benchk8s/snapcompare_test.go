package main

import (
	"strings"
	"testing"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

func readyContent(name, uid, handle string, annotations map[string]string) *snapshotv1.VolumeSnapshotContent {
	ready, size, vol := true, int64(1<<30), "vol-"+name
	return &snapshotv1.VolumeSnapshotContent{
		ObjectMeta: metav1.ObjectMeta{Name: "snapcontent-" + uid, Annotations: annotations,
			Finalizers: []string{"snapshot.storage.kubernetes.io/volumesnapshotcontent-bound-protection"}},
		Spec: snapshotv1.VolumeSnapshotContentSpec{DeletionPolicy: snapshotv1.VolumeSnapshotContentDelete, Driver: "d",
			Source:            snapshotv1.VolumeSnapshotContentSource{VolumeHandle: &vol},
			VolumeSnapshotRef: corev1.ObjectReference{Namespace: "ns", Name: name, UID: types.UID("uid-" + uid)}},
		Status: &snapshotv1.VolumeSnapshotContentStatus{SnapshotHandle: &handle, ReadyToUse: &ready, RestoreSize: &size},
	}
}

// TestCompareContents: run-specific names and handles do not count as
// differences; an annotation only one side writes, or another status,
// does.
func TestCompareContents(t *testing.T) {
	a := map[string]*snapshotv1.VolumeSnapshotContent{
		"1": readyContent("s-1", "a1", "ss-1", map[string]string{"x/by": "snapcontent-a1"}),
		"2": readyContent("s-2", "a2", "ss-2", map[string]string{"x/by": "snapcontent-a2"}),
	}
	same := map[string]*snapshotv1.VolumeSnapshotContent{
		"1": readyContent("s-1", "b1", "ss-9", map[string]string{"x/by": "snapcontent-b1"}),
		"2": readyContent("s-2", "b2", "ss-8", map[string]string{"x/by": "snapcontent-b2"}),
	}
	h := &Harness{report: newReport()}
	if d := h.compareTable("same", a, same); d != 0 {
		t.Errorf("%d fields differ between equivalent contents:\n%s", d, h.report.pending.String())
	}
	other := map[string]*snapshotv1.VolumeSnapshotContent{
		"1": readyContent("s-1", "b1", "ss-9", map[string]string{"x/by": "snapcontent-b1", "x/extra": "1"}),
		"2": readyContent("s-2", "b2", "ss-8", map[string]string{"x/by": "snapcontent-b2"}),
	}
	no := false
	other["2"].Status.ReadyToUse = &no
	h = &Harness{report: newReport()}
	if d := h.compareTable("other", a, other); d != 2 {
		t.Errorf("%d fields differ, want 2 (x/extra, readyToUse):\n%s", d, h.report.pending.String())
	}
	for _, want := range []string{"| annotation x/extra | (absent) | `1` (1), absent (1) | **no** |", "| status.readyToUse | `true` | `false` (1), `true` (1) | **no** |"} {
		if !strings.Contains(h.report.pending.String(), want) {
			t.Errorf("report has no row %q:\n%s", want, h.report.pending.String())
		}
	}
}
