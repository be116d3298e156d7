package k8sbridge

import (
	"context"
	"log/slog"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapshotclient "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
)

// staticVolumeClaim makes a PV of driver's volume id and a claim bound to
// it (the PV controller binds them).
func staticVolumeClaim(t *testing.T, c kubernetes.Interface, ns, name, driver, id string) {
	t.Helper()
	pv := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: kubetest.ClusterName(ns, name)},
		Spec: corev1.PersistentVolumeSpec{Capacity: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Mi")},
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}, PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: driver, VolumeHandle: id}}}}
	if _, err := c.CoreV1().PersistentVolumes().Create(context.Background(), pv, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.CoreV1().PersistentVolumes().Delete(context.Background(), pv.Name, metav1.DeleteOptions{}) })
	makeStaticClaim(t, c, ns, name, pv.Name)
	kubetest.WaitBound(t, c, ns, name, 60*time.Second)
}

// TestSnapshotContentMatchesCSISnapshotter: one driver behind the broker,
// another behind the real csi-snapshotter v8.7.0, the same
// snapshot-controller, classes and secret: the VolumeSnapshotContents
// each leaves (annotations, finalizers, status fields) and the
// VolumeSnapshots' status agree field by field, and so does deletion
// (both contents and snapshots gone).
func TestSnapshotContentMatchesCSISnapshotter(t *testing.T) {
	env := kubetest.ControlPlane(t)
	installSnapshotCRDs(t, env)
	env.StartSnapshotController(t, testenv.SnapshotControllerOptions{})
	ns := env.NewNamespace(t)
	c, ctx := env.Client(), context.Background()
	sc := snapshotclient.NewForConfigOrDie(env.RESTConfig())
	brokered, sidecar := kubetest.ClusterName(ns, "broker.csi.test"), kubetest.ClusterName(ns, "sidecar.csi.test")
	drivers := newCountingDrivers()
	dBroker := drivers.addDriver(t, sampledriver.Config{Name: brokered})
	ep, dSidecar := sampledriver.StartTest(t, sampledriver.Config{Name: sidecar, Logger: slog.New(slog.DiscardHandler)})
	env.StartSnapshotter(t, testenv.SnapshotterOptions{CSIAddress: ep, ExtraCreateMetadata: true})
	startBridge(t, env, ns, drivers, bridgeOpts{configureCfg: func(cfg *Config) { cfg.ExtraCreateMetadata = true }})

	// A volume of each, as static PVs with bound claims.
	conn, err := grpc.NewClient(ep, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	resp, err := csi.NewControllerClient(conn).CreateVolume(ctx, createRequest(kubetest.ClusterName(ns, "sidecar-vol")))
	if err != nil {
		t.Fatal(err)
	}
	staticVolumeClaim(t, c, ns, "via-sidecar", sidecar, resp.GetVolume().GetVolumeId())
	staticVolumeClaim(t, c, ns, "via-broker", brokered, createDriverVolume(t, drivers.testDrivers, brokered, kubetest.ClusterName(ns, "broker-vol")))
	kubetest.CreatePasswordSecrets(t, c, ns, "snapshot-password", "snap-creds")
	params := map[string]string{"tier": "gold",
		"csi.storage.k8s.io/snapshotter-secret-name": "snap-creds", "csi.storage.k8s.io/snapshotter-secret-namespace": "${volumesnapshot.namespace}"}
	makeSnapshotClass(t, sc, kubetest.ClusterName(ns, "broker"), brokered, snapshotv1.VolumeSnapshotContentDelete, params)
	makeSnapshotClass(t, sc, kubetest.ClusterName(ns, "sidecar"), sidecar, snapshotv1.VolumeSnapshotContentDelete, params)
	makeVolumeSnapshot(t, sc, ns, "vs-broker", "via-broker", kubetest.ClusterName(ns, "broker"))
	makeVolumeSnapshot(t, sc, ns, "vs-sidecar", "via-sidecar", kubetest.ClusterName(ns, "sidecar"))
	vsB, vscB := waitVolumeSnapshotReady(t, sc, ns, "vs-broker")
	vsS, vscS := waitVolumeSnapshotReady(t, sc, ns, "vs-sidecar")

	if kb, ks := slices.Sorted(maps.Keys(vscB.Annotations)), slices.Sorted(maps.Keys(vscS.Annotations)); !slices.Equal(kb, ks) {
		t.Errorf("content annotations: broker %v, csi-snapshotter %v", kb, ks)
	}
	for _, k := range []string{"snapshot.storage.kubernetes.io/deletion-secret-name", "snapshot.storage.kubernetes.io/deletion-secret-namespace"} {
		if vscB.Annotations[k] != vscS.Annotations[k] {
			t.Errorf("annotation %s: broker %q, csi-snapshotter %q", k, vscB.Annotations[k], vscS.Annotations[k])
		}
	}
	if !slices.Equal(vscB.Finalizers, vscS.Finalizers) {
		t.Errorf("content finalizers: broker %v, csi-snapshotter %v", vscB.Finalizers, vscS.Finalizers)
	}
	set := func(st *snapshotv1.VolumeSnapshotContentStatus) map[string]bool {
		return map[string]bool{"snapshotHandle": st.SnapshotHandle != nil, "creationTime": st.CreationTime != nil, "restoreSize": st.RestoreSize != nil,
			"readyToUse": st.ReadyToUse != nil && *st.ReadyToUse, "error": st.Error != nil, "volumeGroupSnapshotHandle": st.VolumeGroupSnapshotHandle != nil}
	}
	if b, s := set(vscB.Status), set(vscS.Status); !maps.Equal(b, s) {
		t.Errorf("content status fields: broker %v, csi-snapshotter %v", b, s)
	}
	if *vscB.Status.RestoreSize != *vscS.Status.RestoreSize {
		t.Errorf("restore size: broker %d, csi-snapshotter %d", *vscB.Status.RestoreSize, *vscS.Status.RestoreSize)
	}
	if b, s := js(vsB.Status.RestoreSize), js(vsS.Status.RestoreSize); b != s || vsB.Status.Error != nil || vsS.Status.Error != nil {
		t.Errorf("VolumeSnapshot status: broker %s, csi-snapshotter %s", js(vsB.Status), js(vsS.Status))
	}
	if len(dBroker.Snapshots()) != 1 || len(dSidecar.Snapshots()) != 1 {
		t.Fatalf("snapshots: broker's driver %d, csi-snapshotter's %d; want 1 each", len(dBroker.Snapshots()), len(dSidecar.Snapshots()))
	}
	if nb, ns := dBroker.Snapshots()[0].Name, dSidecar.Snapshots()[0].Name; nb != "snapshot-"+string(vsB.UID) || ns != "snapshot-"+string(vsS.UID) {
		t.Errorf("snapshot names: broker %q, csi-snapshotter %q; want snapshot-<VolumeSnapshot UID> both", nb, ns)
	}

	for _, vs := range []string{"vs-broker", "vs-sidecar"} {
		if err := sc.SnapshotV1().VolumeSnapshots(ns).Delete(ctx, vs, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	waitContent(t, sc, vscB.Name, "gone", nil)
	waitContent(t, sc, vscS.Name, "gone", nil)
	if len(dBroker.Snapshots()) != 0 || len(dSidecar.Snapshots()) != 0 {
		t.Errorf("snapshots left: broker's driver %d, csi-snapshotter's %d", len(dBroker.Snapshots()), len(dSidecar.Snapshots()))
	}
}
