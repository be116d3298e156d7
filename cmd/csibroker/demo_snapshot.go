package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapshotclient "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/csibroker/csibroker/internal/testenv"
)

// snapshotControllerBin is where hack/sidecars.sh (make run) leaves the
// cluster's snapshot-controller, or "" when it is not built.
func snapshotControllerBin() string {
	bin := filepath.Join(testenv.SidecarDir("snapshot-controller", testenv.SnapshotterVersion), "snapshot-controller")
	if st, err := os.Stat(bin); err != nil || st.Mode()&0o111 == 0 {
		return ""
	}
	return bin
}

// snapshotSide installs the VolumeSnapshot CRDs and starts the real
// snapshot-controller, as a cluster runs them beside csi-snapshotter: the
// broker, started after, takes csi-snapshotter's part. It reports false
// when the snapshot-controller is not built (the demo goes on without
// snapshots).
func (d *demo) snapshotSide(ctx context.Context) (bool, error) {
	bin := snapshotControllerBin()
	if bin == "" {
		d.step("snapshot-controller is not built (make run builds it: hack/sidecars.sh build snapshot-controller): no snapshot step")
		return false, nil
	}
	d.step("installing the VolumeSnapshot CRDs and starting the cluster's snapshot-controller %s (no csi-snapshotter: the broker does its part)", testenv.SnapshotterVersion)
	if err := d.env.InstallSnapshotCRDs(ctx); err != nil {
		return false, err
	}
	p, err := d.env.RunSnapshotController(ctx, testenv.SnapshotControllerOptions{Bin: bin})
	if err != nil {
		return false, err
	}
	fmt.Fprintf(d.out, "    started snapshot-controller (pid %d)\n", p.Pid())
	return true, nil
}

// snapshotAndRestore snapshots claim alpha-1 and restores the snapshot into
// a new claim, which must become Bound.
func (d *demo) snapshotAndRestore(ctx context.Context, c kubernetes.Interface) error {
	sc, err := snapshotclient.NewForConfig(d.env.RESTConfig())
	if err != nil {
		return err
	}
	d.step("snapshotting claim alpha-1 (VolumeSnapshotClass alpha-snaps) and restoring it into claim alpha-restored")
	class := &snapshotv1.VolumeSnapshotClass{ObjectMeta: metav1.ObjectMeta{Name: "alpha-snaps"}, Driver: demoAlpha, DeletionPolicy: snapshotv1.VolumeSnapshotContentDelete}
	if _, err := sc.SnapshotV1().VolumeSnapshotClasses().Create(ctx, class, metav1.CreateOptions{}); err != nil {
		return err
	}
	src, className := "alpha-1", class.Name
	snap := &snapshotv1.VolumeSnapshot{ObjectMeta: metav1.ObjectMeta{Name: "alpha-1-snap", Namespace: demoNS},
		Spec: snapshotv1.VolumeSnapshotSpec{Source: snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: &src}, VolumeSnapshotClassName: &className}}
	if _, err := sc.SnapshotV1().VolumeSnapshots(demoNS).Create(ctx, snap, metav1.CreateOptions{}); err != nil {
		return err
	}
	t0 := time.Now()
	var ready *snapshotv1.VolumeSnapshot
	err = d.waitFor(ctx, "VolumeSnapshot alpha-1-snap ready to use", func() bool {
		s, err := sc.SnapshotV1().VolumeSnapshots(demoNS).Get(ctx, snap.Name, metav1.GetOptions{})
		if err != nil || s.Status == nil || s.Status.ReadyToUse == nil || !*s.Status.ReadyToUse {
			return false
		}
		ready = s
		return true
	})
	if err != nil {
		return err
	}
	content := ""
	if ready.Status.BoundVolumeSnapshotContentName != nil {
		content = *ready.Status.BoundVolumeSnapshotContentName
	}
	fmt.Fprintf(d.out, "    VolumeSnapshot alpha-1-snap ready in %s (content %s, restore size %s)\n", time.Since(t0).Round(time.Millisecond), content, ready.Status.RestoreSize)

	storageClass, apiGroup := "alpha-fast", snapshotv1.GroupName
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "alpha-restored", Namespace: demoNS}, Spec: corev1.PersistentVolumeClaimSpec{
		AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}, StorageClassName: &storageClass,
		DataSource: &corev1.TypedLocalObjectReference{APIGroup: &apiGroup, Kind: "VolumeSnapshot", Name: snap.Name},
		Resources:  corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}}}}
	if _, err := c.CoreV1().PersistentVolumeClaims(demoNS).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
		return err
	}
	t0 = time.Now()
	var volume string
	err = d.waitFor(ctx, "claim alpha-restored Bound", func() bool {
		p, err := c.CoreV1().PersistentVolumeClaims(demoNS).Get(ctx, pvc.Name, metav1.GetOptions{})
		if err != nil || p.Status.Phase != corev1.ClaimBound {
			return false
		}
		volume = p.Spec.VolumeName
		return true
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(d.out, "    claim alpha-restored Bound to %s in %s, made from snapshot alpha-1-snap\n", volume, time.Since(t0).Round(time.Millisecond))
	return nil
}
