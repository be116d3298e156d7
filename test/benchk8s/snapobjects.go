package main

import (
	"context"
	"fmt"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// snapClassName is the VolumeSnapshotClass of the snapshots scenario.
const snapClassName = "bench-snapshots"

// dialDriver connects to a sample driver's socket (the harness's own CSI
// calls: volumes to snapshot, the leak check).
func dialDriver(drv *driverInst) (*grpc.ClientConn, error) {
	return grpc.NewClient("unix://"+drv.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
}

// snapshotSources makes n volumes in the driver over CSI and, for each, a
// PV naming it and a claim bound to it (the PV binder binds the pairs), so
// that the snapshot clock measures snapshots only.
func (h *Harness) snapshotSources(ctx context.Context, drv *driverInst, ns string, n int) error {
	conn, err := dialDriver(drv)
	if err != nil {
		return err
	}
	defer conn.Close()
	cc := csi.NewControllerClient(conn)
	err = parallel(ctx, 0, n, 16, func(ctx context.Context, i int) error {
		name := fmt.Sprintf("%s-v%06d", ns, i)
		resp, err := cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		}}})
		if err != nil {
			return fmt.Errorf("CreateVolume %s: %w", name, err)
		}
		return h.boundPair(ctx, ns, fmt.Sprintf("c-%06d", i), name, drv.name, resp.GetVolume().GetVolumeId())
	})
	if err != nil {
		return err
	}
	return pollUntil(ctx, 2*time.Minute, fmt.Sprintf("%d claims of %s Bound", n, ns), func() (bool, error) {
		bound, _, err := h.countBound(ctx, ns)
		return bound >= n, err
	})
}

// boundPair creates PV pvName for the driver's volume handle and claim
// ns/claimName pre-bound to it.
func (h *Harness) boundPair(ctx context.Context, ns, claimName, pvName, driver, handle string) error {
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: pvName},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			ClaimRef:                      &corev1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: ns, Name: claimName},
			PersistentVolumeSource:        corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: driver, VolumeHandle: handle}},
		},
	}
	if _, err := h.client.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create PV %s: %w", pvName, err)
	}
	c := claim(ns, claimName, "", pvName)
	if _, err := h.client.CoreV1().PersistentVolumeClaims(ns).Create(ctx, c, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create claim %s: %w", claimName, err)
	}
	return nil
}

// ensureSnapshotClass creates the scenario's VolumeSnapshotClass (Delete).
func (h *Harness) ensureSnapshotClass(ctx context.Context, driver string) error {
	class := &snapshotv1.VolumeSnapshotClass{ObjectMeta: metav1.ObjectMeta{Name: snapClassName},
		Driver: driver, DeletionPolicy: snapshotv1.VolumeSnapshotContentDelete}
	_, err := h.snaps.SnapshotV1().VolumeSnapshotClasses().Create(ctx, class, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create VolumeSnapshotClass: %w", err)
	}
	return nil
}

// createSnapshots creates VolumeSnapshot s-<i> of claim c-<i> for i < n.
func (h *Harness) createSnapshots(ctx context.Context, ns string, n int) error {
	class := snapClassName
	return parallel(ctx, 0, n, 16, func(ctx context.Context, i int) error {
		src := fmt.Sprintf("c-%06d", i)
		vs := &snapshotv1.VolumeSnapshot{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("s-%06d", i), Namespace: ns},
			Spec: snapshotv1.VolumeSnapshotSpec{Source: snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: &src}, VolumeSnapshotClassName: &class}}
		if _, err := h.snaps.SnapshotV1().VolumeSnapshots(ns).Create(ctx, vs, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create VolumeSnapshot %s: %w", vs.Name, err)
		}
		return nil
	})
}

// deleteSnapshots deletes every VolumeSnapshot of ns.
func (h *Harness) deleteSnapshots(ctx context.Context, ns string) error {
	return h.snaps.SnapshotV1().VolumeSnapshots(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
}

// driverSnapshots counts the snapshots the driver holds.
func driverSnapshots(ctx context.Context, drv *driverInst) (int, error) {
	conn, err := dialDriver(drv)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	resp, err := csi.NewControllerClient(conn).ListSnapshots(ctx, &csi.ListSnapshotsRequest{})
	if err != nil {
		return 0, err
	}
	return len(resp.GetEntries()), nil
}
