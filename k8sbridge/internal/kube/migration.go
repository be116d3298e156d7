package kube

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	csitrans "k8s.io/csi-translation-lib"
	"k8s.io/klog/v2"
)

// CSI migration: in-tree volume plugins (EBS, GCE PD, Azure Disk, Cinder,
// vSphere, ...) whose volumes a CSI driver serves now. Their StorageClasses,
// PVs and VolumeAttachments keep the in-tree forms; the broker translates
// them with k8s.io/csi-translation-lib, as the sidecars do.

// Migration translates the in-tree volumes that CSI migration moved to a
// CSI driver: the attach/detach controller makes their VolumeAttachments
// naming the driver, their PVs keep the in-tree source, and the PV
// controller names the driver in the claims of their classes.
var Migration = csitrans.New()

// CSISpec is pv's spec with a CSI source: pv's own, or for an in-tree
// volume that CSI migration moved to a driver, its translation (as
// external-attacher translates it).
func CSISpec(pv *corev1.PersistentVolume) (*corev1.PersistentVolumeSpec, error) {
	if pv.Spec.CSI != nil {
		return &pv.Spec, nil
	}
	if !Migration.IsPVMigratable(pv) {
		return nil, fmt.Errorf("persistentvolume %s is not a CSI volume, nor an in-tree volume that CSI migration moves to a CSI driver", pv.Name)
	}
	t, err := Migration.TranslateInTreePVToCSI(klog.Background(), pv)
	if err != nil {
		return nil, fmt.Errorf("persistentvolume %s: translating its in-tree source to CSI (CSI migration): %w", pv.Name, err)
	}
	if t.Spec.CSI == nil {
		return nil, fmt.Errorf("persistentvolume %s: CSI migration gave no CSI source for its in-tree source", pv.Name)
	}
	return &t.Spec, nil
}

// PVDriver is the CSI driver of pv, for an in-tree volume the one CSI
// migration moved it to; "" for neither.
func PVDriver(pv *corev1.PersistentVolume) string {
	if pv.Spec.CSI != nil {
		return pv.Spec.CSI.Driver
	}
	if Migration.IsPVMigratable(pv) {
		if plugin, err := Migration.GetInTreePluginNameFromSpec(pv, nil); err == nil {
			if drv, err := Migration.GetCSINameFromInTreeName(plugin); err == nil {
				return drv
			}
		}
	}
	return ""
}

// MigratedDriver is the CSI driver CSI migration moves in-tree plugin (a
// StorageClass's provisioner) to; "" for none.
func MigratedDriver(plugin string) string {
	if !Migration.IsMigratableIntreePluginByName(plugin) {
		return ""
	}
	d, err := Migration.GetCSINameFromInTreeName(plugin)
	if err != nil {
		return ""
	}
	return d
}
