package secrets

import (
	"errors"
	"strings"
	"testing"

	"github.com/csibroker/csibroker/policy"
)

func TestSnapshotRef(t *testing.T) {
	const nameKey, nsKey = "csi.storage.k8s.io/snapshotter-secret-name", "csi.storage.k8s.io/snapshotter-secret-namespace"
	snap := &SnapshotObject{Namespace: "team-a", Name: "daily"}
	for _, tc := range []struct {
		name       string
		kind       SnapshotKind
		params     map[string]string
		snap       *SnapshotObject
		wantNS     string
		wantName   string
		wantErr    string // "" : no error
		wantNilRef bool
	}{
		{name: "none", kind: Snapshotter, params: map[string]string{"type": "fast"}, snap: snap, wantNilRef: true},
		{name: "literal", kind: Snapshotter, params: map[string]string{nameKey: "creds", nsKey: "kube-system"}, snap: snap, wantNS: "kube-system", wantName: "creds"},
		{name: "templates", kind: Snapshotter, params: map[string]string{nameKey: "${volumesnapshot.name}-${volumesnapshotcontent.name}", nsKey: "${volumesnapshot.namespace}"}, snap: snap, wantNS: "team-a", wantName: "daily-snapcontent-1"},
		{name: "content name in the namespace", kind: Snapshotter, params: map[string]string{nameKey: "x", nsKey: "${volumesnapshotcontent.name}"}, snap: snap, wantNS: "snapcontent-1", wantName: "x"},
		{name: "snapshot name may not pick the namespace", kind: Snapshotter, params: map[string]string{nameKey: "x", nsKey: "${volumesnapshot.name}"}, snap: snap, wantErr: "is not allowed here"},
		{name: "name without namespace", kind: Snapshotter, params: map[string]string{nameKey: "x"}, snap: snap, wantErr: "must be set together"},
		{name: "namespace without name", kind: Snapshotter, params: map[string]string{nsKey: "x"}, snap: snap, wantErr: "must be set together"},
		{name: "empty name", kind: Snapshotter, params: map[string]string{nameKey: "", nsKey: "x"}, snap: snap, wantErr: "is empty"},
		{name: "unknown token", kind: Snapshotter, params: map[string]string{nameKey: "${pvc.name}", nsKey: "x"}, snap: snap, wantErr: "unknown token ${pvc.name}"},
		{name: "stray dollar", kind: Snapshotter, params: map[string]string{nameKey: "a$b", nsKey: "x"}, snap: snap, wantErr: "must start a ${...} token"},
		{name: "no snapshot", kind: SnapshotterList, params: map[string]string{"csi.storage.k8s.io/snapshotter-list-secret-name": "${volumesnapshot.name}", "csi.storage.k8s.io/snapshotter-list-secret-namespace": "x"}, wantErr: "needs the VolumeSnapshot"},
		{name: "list secret by content name", kind: SnapshotterList, params: map[string]string{"csi.storage.k8s.io/snapshotter-list-secret-name": "${volumesnapshotcontent.name}", "csi.storage.k8s.io/snapshotter-list-secret-namespace": "ops"}, wantNS: "ops", wantName: "snapcontent-1"},
		{name: "invalid namespace", kind: Snapshotter, params: map[string]string{nameKey: "x", nsKey: "Not_A_Namespace"}, snap: snap, wantErr: "not a valid namespace name"},
		{name: "invalid name", kind: Snapshotter, params: map[string]string{nameKey: "${volumesnapshot.name}_", nsKey: "x"}, snap: snap, wantErr: "not a valid secret name"},
		{name: "the provisioner's keys are not the snapshotter's", kind: Snapshotter, params: map[string]string{"csi.storage.k8s.io/secret-name": "x", "csi.storage.k8s.io/secret-namespace": "y"}, snap: snap, wantNilRef: true},
		{name: "group templates", kind: GroupSnapshotter, params: map[string]string{"csi.storage.k8s.io/group-snapshotter-secret-name": "${volumegroupsnapshot.name}-${volumegroupsnapshotcontent.name}", "csi.storage.k8s.io/group-snapshotter-secret-namespace": "${volumegroupsnapshot.namespace}"}, snap: snap, wantNS: "team-a", wantName: "daily-snapcontent-1"},
		{name: "group name may not pick the namespace", kind: GroupSnapshotter, params: map[string]string{"csi.storage.k8s.io/group-snapshotter-secret-name": "x", "csi.storage.k8s.io/group-snapshotter-secret-namespace": "${volumegroupsnapshot.name}"}, snap: snap, wantErr: "is not allowed here"},
		{name: "a group secret takes no single-snapshot token", kind: GroupSnapshotter, params: map[string]string{"csi.storage.k8s.io/group-snapshotter-secret-name": "${volumesnapshot.name}", "csi.storage.k8s.io/group-snapshotter-secret-namespace": "x"}, snap: snap, wantErr: "unknown token ${volumesnapshot.name}"},
		{name: "group get secret without the group", kind: GroupSnapshotterGet, params: map[string]string{"csi.storage.k8s.io/group-snapshotter-get-secret-name": "${volumegroupsnapshot.name}", "csi.storage.k8s.io/group-snapshotter-get-secret-namespace": "x"}, wantErr: "needs the VolumeGroupSnapshot"},
		{name: "unknown kind", kind: "group", params: map[string]string{}, snap: snap, wantErr: "unknown snapshot secret kind"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ref, err := SnapshotRef(tc.kind, tc.params, "snapcontent-1", tc.snap)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) || !errors.Is(err, ErrParameter) {
					t.Fatalf("err %v; want one containing %q, wrapping ErrParameter", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if tc.wantNilRef {
				if ref != nil {
					t.Fatalf("ref %+v; want none", ref)
				}
				return
			}
			if ref == nil || ref.Namespace != tc.wantNS || ref.Name != tc.wantName {
				t.Fatalf("ref %+v; want %s/%s", ref, tc.wantNS, tc.wantName)
			}
		})
	}
}

func TestSnapshotPolicySource(t *testing.T) {
	lit := SnapshotPolicySource(Snapshotter, map[string]string{"csi.storage.k8s.io/snapshotter-secret-name": "a", "csi.storage.k8s.io/snapshotter-secret-namespace": "b"})
	if lit.Kind != policy.SourceStorageClassParameter || lit.Key != "csi.storage.k8s.io/snapshotter-secret-name" {
		t.Errorf("literal: %+v", lit)
	}
	tpl := SnapshotPolicySource(Snapshotter, map[string]string{"csi.storage.k8s.io/snapshotter-secret-name": "${volumesnapshot.name}", "csi.storage.k8s.io/snapshotter-secret-namespace": "b"})
	if tpl.Kind != policy.SourceTemplate || tpl.Template != "b/${volumesnapshot.name}" {
		t.Errorf("template: %+v", tpl)
	}
}
