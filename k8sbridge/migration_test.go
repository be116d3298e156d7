package k8sbridge

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
)

// TestProvisionsAndDeletesWithAMigratedInTreeClass: a claim of an in-tree
// StorageClass (kubernetes.io/cinder, kubernetes.io/portworx-volume) whose plugin CSI migration moves to
// a registered driver is named for that driver by the PV controller; the
// broker makes the volume through the class's CSI translation and an
// in-tree PV for it, which the PV controller binds, as external-provisioner
// does. Once the claim is gone, the volume is deleted through the PV's
// translation, and so is the PV.
func TestProvisionsAndDeletesWithAMigratedInTreeClass(t *testing.T) {
	// Drivers CSI migration moves in-tree plugins to (names the
	// translation fixes, shared with the other migration tests; they run
	// one after the other, each with its own bridge). Portworx's class
	// translation names the CSI driver as the class's provisioner, which
	// must not change what the PV records.
	for _, tc := range []struct {
		drv, plugin string
		volumeID    func(*corev1.PersistentVolume) string
	}{
		{"cinder.csi.openstack.org", "kubernetes.io/cinder", func(pv *corev1.PersistentVolume) string {
			if pv.Spec.Cinder == nil {
				return ""
			}
			return pv.Spec.Cinder.VolumeID
		}},
		{"pxd.portworx.com", "kubernetes.io/portworx-volume", func(pv *corev1.PersistentVolume) string {
			if pv.Spec.PortworxVolume == nil {
				return ""
			}
			return pv.Spec.PortworxVolume.VolumeID
		}},
	} {
		t.Run(tc.plugin, func(t *testing.T) { provisionWithMigratedClass(t, tc.drv, tc.plugin, tc.volumeID) })
	}
}

func provisionWithMigratedClass(t *testing.T, drv, plugin string, volumeID func(*corev1.PersistentVolume) string) {
	env := kubetest.ControlPlane(t)
	ctx, c, ns := context.Background(), env.Client(), env.NewNamespace(t)
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "in-tree"), plugin, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})

	claim := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second)
	if got := claim.Annotations[kube.AnnStorageProvisioner]; got != drv {
		t.Errorf("claim annotation %s = %q, want the PV controller's %q", kube.AnnStorageProvisioner, got, drv)
	}
	pv, err := c.CoreV1().PersistentVolumes().Get(ctx, claim.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	volID := volumeID(pv)
	if volID == "" || pv.Spec.CSI != nil {
		t.Fatalf("PV source %+v: want the in-tree source of %s", pv.Spec.PersistentVolumeSource, plugin)
	}
	if got := pv.Annotations[kube.AnnProvisionedBy]; got != plugin {
		t.Errorf("PV annotation %s = %q, want the in-tree plugin %q", kube.AnnProvisionedBy, got, plugin)
	}
	found := false
	for _, v := range d.Volumes() {
		found = found || v.ID == volID
	}
	if !found {
		t.Fatalf("the driver has no volume %s (the PV's in-tree volume ID)", volID)
	}

	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "data", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitPVGone(t, c, pv.Name, 60*time.Second)
	for _, v := range d.Volumes() {
		if v.ID == volID {
			t.Fatalf("volume %s still at the driver after its PV went", volID)
		}
	}
}
