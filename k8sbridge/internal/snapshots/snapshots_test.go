package snapshots

import (
	"errors"
	"maps"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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
