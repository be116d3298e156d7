package csiparams

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// FuzzCreateParameters feeds StorageClass parameters to CreateParameters:
// nothing may panic; accepted, the driver's parameters are never nil and
// hold no csi.storage.k8s.io/ key but the extra metadata the broker adds.
func FuzzCreateParameters(f *testing.F) {
	for _, s := range [][4]string{
		{"csi.storage.k8s.io/fstype", "ext4", "type", "ssd"},
		{"fstype", "XFS", "csi.storage.k8s.io/fstype", "ext4"},
		{"csi.storage.k8s.io/provisioner-secret-name", "${pvc.name}", "csi.storage.k8s.io/provisioner-secret-namespace", "ns"},
		{"csi.storage.k8s.io/unknown", "x", "", ""},
		{"CSI.storage.k8s.io/fstype", "", "csiProvisionerSecretName", "s"},
	} {
		f.Add(s[0], s[1], s[2], s[3], true)
	}
	f.Fuzz(func(t *testing.T, k1, v1, k2, v2 string, extra bool) {
		params := map[string]string{k1: v1, k2: v2}
		claim := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "c", Namespace: "ns"}}
		out, _, err := CreateParameters(params, extra, "pvc-1", claim, "")
		if err != nil {
			return
		}
		if out == nil {
			t.Fatal("accepted parameters gave nil driver parameters")
		}
		for k := range out {
			if strings.HasPrefix(k, "csi.storage.k8s.io/") && !(extra && strings.HasPrefix(k, "csi.storage.k8s.io/pv")) {
				t.Fatalf("driver parameters keep %q from %v", k, params)
			}
		}
	})
}
