package secrets

import (
	"errors"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// FuzzRef feeds StorageClass secret parameters (name and namespace
// templates) and a claim's name, namespace and annotation to Ref for every
// kind: nothing may panic, an error wraps ErrParameter, and a reference
// resolved is a valid Secret name in a valid namespace.
func FuzzRef(f *testing.F) {
	for _, s := range [][5]string{
		{"${pvc.name}-creds", "${pvc.namespace}", "claim", "ns", "v"},
		{"${pvc.annotations['team']}", "store", "c", "ns", "blue"},
		{"${pv.name}", "${pvc.namespace}", "c", "ns", ""},
		{"${pvc.annotations['", "ns", "c", "ns", "x"},
		{"${", "}", "", "", ""},
		{"a$b", "-", "c", "ns", "\x00"},
	} {
		f.Add(s[0], s[1], s[2], s[3], s[4])
	}
	f.Fuzz(func(t *testing.T, name, namespace, claimName, claimNS, annotation string) {
		claim := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: claimName, Namespace: claimNS,
			Annotations: map[string]string{"team": annotation}}}
		for _, kind := range Kinds() {
			nk, nsk := ParamKeys(kind)
			for _, c := range []*corev1.PersistentVolumeClaim{claim, nil} {
				ref, err := Ref(kind, map[string]string{nk: name, nsk: namespace}, "pvc-1", c)
				if err != nil {
					if !errors.Is(err, ErrParameter) {
						t.Fatalf("%s: error %v does not wrap ErrParameter", kind, err)
					}
					continue
				}
				if ref == nil {
					continue
				}
				if !validName(ref.Name) || !validName(ref.Namespace) {
					t.Fatalf("%s: resolved %q/%q from %q/%q, not a valid namespace and Secret name", kind, ref.Namespace, ref.Name, namespace, name)
				}
			}
		}
	})
}

// validName: a DNS subdomain (Secret names) or label (namespaces) is at
// least this: non-empty, lower-case alphanumerics, '-' and '.', at most
// 253 characters.
func validName(s string) bool {
	if s == "" || len(s) > 253 {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '-' || r == '.') {
			return false
		}
	}
	return true
}
