package provision

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
)

// TestNeedsDelete: Released PVs reclaimed by Delete (not Failed ones, as
// external-provisioner), except one
// being deleted whose volume-deletion finalizer is gone already (its
// volume was deleted, by this leader or an earlier one).
func TestNeedsDelete(t *testing.T) {
	now := metav1.Now()
	pv := func(phase corev1.PersistentVolumePhase, reclaim corev1.PersistentVolumeReclaimPolicy, deleting bool, finalizers ...string) *corev1.PersistentVolume {
		p := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pv", Finalizers: finalizers}, Spec: corev1.PersistentVolumeSpec{PersistentVolumeReclaimPolicy: reclaim}, Status: corev1.PersistentVolumeStatus{Phase: phase}}
		if deleting {
			p.DeletionTimestamp = &now
		}
		return p
	}
	del, ret := corev1.PersistentVolumeReclaimDelete, corev1.PersistentVolumeReclaimRetain
	for _, c := range []struct {
		name string
		pv   *corev1.PersistentVolume
		want bool
	}{
		{"released", pv(corev1.VolumeReleased, del, false, kube.FinalizerVolume), true},
		{"failed", pv(corev1.VolumeFailed, del, false, kube.FinalizerVolume), false},
		{"bound", pv(corev1.VolumeBound, del, false, kube.FinalizerVolume), false},
		{"retained", pv(corev1.VolumeReleased, ret, false), false},
		{"released, deleted first, finalizer on", pv(corev1.VolumeReleased, del, true, kube.FinalizerVolume, "kubernetes.io/pv-protection"), true},
		{"released, being deleted, finalizer gone", pv(corev1.VolumeReleased, del, true, "kubernetes.io/pv-protection"), false},
		{"released, no finalizer, not being deleted", pv(corev1.VolumeReleased, del, false), true},
	} {
		if got := needsDelete(c.pv); got != c.want {
			t.Errorf("%s: needsDelete %v, want %v", c.name, got, c.want)
		}
	}
}
