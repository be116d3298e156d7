package snapshots

import (
	"errors"
	"maps"
	"strings"
	"testing"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/k8sbridge/secrets"
	"github.com/csibroker/csibroker/policy"
)

func TestIsFinal(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"invalid argument", status.Error(codes.InvalidArgument, "x"), true},
		{"not found", status.Error(codes.NotFound, "x"), true},
		{"internal", status.Error(codes.Internal, "x"), true},
		{"deadline", status.Error(codes.DeadlineExceeded, "x"), false},
		{"unavailable", status.Error(codes.Unavailable, "x"), false},
		{"aborted", status.Error(codes.Aborted, "x"), false},
		{"resource exhausted", status.Error(codes.ResourceExhausted, "x"), false},
		{"canceled", status.Error(codes.Canceled, "x"), false},
		{"not a status", errors.New("dial failed"), false},
	} {
		if got := IsFinal(tc.err); got != tc.want {
			t.Errorf("%s: IsFinal = %t, want %t", tc.name, got, tc.want)
		}
	}
}

func TestDriverParameters(t *testing.T) {
	got, err := DriverParameters(map[string]string{"kind": "full",
		"csi.storage.k8s.io/group-snapshotter-secret-name": "a", "csi.storage.k8s.io/group-snapshotter-secret-namespace": "b",
		"csi.storage.k8s.io/group-snapshotter-get-secret-name": "a", "csi.storage.k8s.io/group-snapshotter-get-secret-namespace": "b",
		"csi.storage.k8s.io/snapshotter-secret-name": "a", "csi.storage.k8s.io/snapshotter-secret-namespace": "b"})
	if err != nil || !maps.Equal(got, map[string]string{"kind": "full"}) {
		t.Fatalf("got %v, %v; want only kind=full", got, err)
	}
	if _, err := DriverParameters(map[string]string{"csi.storage.k8s.io/group-snapshoter-secret-name": "typo"}); err == nil || !strings.Contains(err.Error(), "group-snapshoter-secret-name") {
		t.Fatalf("a mistyped reserved key: err %v, want it named", err)
	}
}

// TestNeedsSyncReadiness: becoming ready always needs a sync; becoming
// not ready only with AnyReadyChange; a status write alone never.
func TestNeedsSyncReadiness(t *testing.T) {
	yes, no := true, false
	at := func(rv string, ready *bool) *snapshotv1.VolumeSnapshotContent {
		return &snapshotv1.VolumeSnapshotContent{ObjectMeta: metav1.ObjectMeta{Name: "c", ResourceVersion: rv},
			Status: &snapshotv1.VolumeSnapshotContentStatus{ReadyToUse: ready}}
	}
	for _, tc := range []struct {
		name     string
		old, cur *bool
		anyWay   bool
		want     bool
	}{
		{"became ready", &no, &yes, false, true},
		{"became not ready", &yes, &no, false, false},
		{"became not ready, either way", &yes, &no, true, true},
		{"stayed not ready", &no, &no, true, false},
	} {
		s := &Contents[*snapshotv1.VolumeSnapshotContent]{AnyReadyChange: tc.anyWay,
			Ready: func(c *snapshotv1.VolumeSnapshotContent) bool {
				return c.Status.ReadyToUse != nil && *c.Status.ReadyToUse
			},
			KeepStatus: func(cur, old *snapshotv1.VolumeSnapshotContent) { cur.Status = old.Status }}
		if got := s.NeedsSync(at("1", tc.old), at("2", tc.cur)); got != tc.want {
			t.Errorf("%s: NeedsSync = %t, want %t", tc.name, got, tc.want)
		}
	}
}

// TestSecretKeys: a secret remembered on the content wins over the
// class's; the class's is remembered; half a remembered pair is refused.
func TestSecretKeys(t *testing.T) {
	k := SecretKeys{Kind: secrets.Snapshotter, AnnName: "an", AnnNS: "ans", What: "snapshotter", ClassKind: "VolumeSnapshotClass"}
	params := map[string]string{"csi.storage.k8s.io/snapshotter-secret-name": "s", "csi.storage.k8s.io/snapshotter-secret-namespace": "${volumesnapshot.namespace}"}
	ref := corev1.ObjectReference{Namespace: "app", Name: "daily"}
	remember := map[string]string{}
	got, src, err := k.Of(&metav1.ObjectMeta{Name: "c"}, ref, "fast", params, remember)
	if err != nil || got == nil || *got != (corev1.SecretReference{Name: "s", Namespace: "app"}) || src.Kind == policy.SourcePVField ||
		!maps.Equal(remember, map[string]string{"an": "s", "ans": "app"}) {
		t.Fatalf("class's secret: %v, %+v, %v, remembered %v; want app/s from the class, remembered", got, src, err, remember)
	}
	remember = map[string]string{}
	got, src, err = k.Of(&metav1.ObjectMeta{Name: "c", Annotations: map[string]string{"an": "old", "ans": "ns"}}, ref, "fast", params, remember)
	if err != nil || got == nil || got.Name != "old" || src.Kind != policy.SourcePVField || len(remember) != 0 {
		t.Fatalf("remembered secret: %v, %+v, %v, remembered %v; want ns/old from the annotations", got, src, err, remember)
	}
	if _, _, err := k.Of(&metav1.ObjectMeta{Name: "c", Annotations: map[string]string{"an": "old"}}, ref, "fast", params, remember); err == nil {
		t.Fatal("half a remembered pair: no error")
	}
}
