package k8sbridge

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapshotclient "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
	"github.com/csibroker/csibroker/k8sbridge/snapshot"
	"github.com/csibroker/csibroker/policy"
)

// makeContent makes a dynamic VolumeSnapshotContent of volume vol as the
// snapshot-controller would (bound to a VolumeSnapshot of ns by UID, with
// the content finalizer unless bare), without the snapshot-controller.
func makeContent(t *testing.T, sc snapshotclient.Interface, ns, name, driver, class, vol string, bare bool) *snapshotv1.VolumeSnapshotContent {
	t.Helper()
	vsc := &snapshotv1.VolumeSnapshotContent{ObjectMeta: metav1.ObjectMeta{Name: kubetest.ClusterName(ns, name)},
		Spec: snapshotv1.VolumeSnapshotContentSpec{Driver: driver, DeletionPolicy: snapshotv1.VolumeSnapshotContentDelete, VolumeSnapshotClassName: &class,
			Source:            snapshotv1.VolumeSnapshotContentSource{VolumeHandle: &vol},
			VolumeSnapshotRef: corev1.ObjectReference{Namespace: ns, Name: name, UID: types.UID(fmt.Sprintf("%08x-0000-4000-8000-%012x", len(name), time.Now().UnixNano()&0xffffffffffff))}}}
	if !bare {
		vsc.Finalizers = []string{snapshot.ContentFinalizer}
	}
	vsc, err := sc.SnapshotV1().VolumeSnapshotContents().Create(context.Background(), vsc, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { forceDeleteContent(sc, vsc.Name) })
	return vsc
}

// forceDeleteContent deletes a content, its finalizers dropped (as an
// administrator would).
func forceDeleteContent(sc snapshotclient.Interface, name string) error {
	ctx := context.Background()
	patch := []byte(`{"metadata":{"finalizers":null}}`)
	if _, err := sc.SnapshotV1().VolumeSnapshotContents().Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return err
	}
	return sc.SnapshotV1().VolumeSnapshotContents().Delete(ctx, name, metav1.DeleteOptions{})
}

// deleteAsSnapshotController deletes a content the way the snapshot-
// controller does when its VolumeSnapshot goes: marked being deleted, then
// deleted (its finalizer holds it for the broker).
func deleteAsSnapshotController(t *testing.T, sc snapshotclient.Interface, name string) {
	t.Helper()
	ctx := context.Background()
	patch := []byte(`{"metadata":{"annotations":{"` + snapshot.AnnBeingDeleted + `":"yes"}}}`)
	if _, err := sc.SnapshotV1().VolumeSnapshotContents().Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := sc.SnapshotV1().VolumeSnapshotContents().Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
}

// capsStripped is drivers with one driver's snapshot capabilities taken
// out of its ControllerGetCapabilities answers.
type capsStripped struct {
	*countingDrivers
	driver string
}

func (s capsStripped) ControllerConn(d string) (grpc.ClientConnInterface, error) {
	c, err := s.countingDrivers.ControllerConn(d)
	if err != nil || d != s.driver {
		return c, err
	}
	return stripSnapshotCaps{c}, nil
}

type stripSnapshotCaps struct{ grpc.ClientConnInterface }

func (s stripSnapshotCaps) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	err := s.ClientConnInterface.Invoke(ctx, method, args, reply, opts...)
	if r, ok := reply.(*csi.ControllerGetCapabilitiesResponse); ok && err == nil {
		r.Capabilities = slices.DeleteFunc(r.Capabilities, func(c *csi.ControllerServiceCapability) bool {
			t := c.GetRpc().GetType()
			return t == csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT || t == csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS
		})
	}
	return err
}

// TestSnapshotBadInput: a content whose class names another driver, whose
// secret the policy denies, whose secret is missing, whose volume the
// driver does not have, of a driver without CREATE_DELETE_SNAPSHOT, and of
// a driver that is down: each gets a status error saying so, a
// SnapshotCreationFailed Event and a log line; no snapshot is left that no
// content records. A good content with a granted secret is made, and the
// secret's value shows up nowhere.
func TestSnapshotBadInput(t *testing.T) {
	env := kubetest.ControlPlane(t)
	installSnapshotCRDs(t, env)
	ns := env.NewNamespace(t)
	c := env.Client()
	sc := snapshotclient.NewForConfigOrDie(env.RESTConfig())
	drv, other := kubetest.ClusterName(ns, "good.csi.test"), kubetest.ClusterName(ns, "other.csi.test")
	nocap, down := kubetest.ClusterName(ns, "nocap.csi.test"), kubetest.ClusterName(ns, "down.csi.test")
	counting := newCountingDrivers()
	d := counting.addDriver(t, sampledriver.Config{Name: drv}, verboseChain)
	dOther := counting.addDriver(t, sampledriver.Config{Name: other}, verboseChain)
	dNocap := counting.addDriver(t, sampledriver.Config{Name: nocap}, verboseChain)
	counting.addDeadDriver(t, down, verboseChain)
	drivers := capsStripped{counting, nocap}
	kubetest.CreatePasswordSecrets(t, c, ns, canarySecret, "allowed", "forbidden")
	authz := kubetest.GrantsAuthorizer(t, policy.Grant{Namespace: ns, Name: "snapshots", Spec: policy.GrantSpec{
		Drivers: []string{drv}, SecretNames: []string{"allowed", "missing"}, Operations: []policy.Operation{policy.OpCreateSnapshot, policy.OpDeleteSnapshot, policy.OpListSnapshots},
		Requesters: policy.Requesters{Namespaces: []string{ns}}}})
	r := startBridge(t, env, ns, drivers, bridgeOpts{policy: authz, allLogs: true})

	secret := func(name string) map[string]string {
		return map[string]string{"csi.storage.k8s.io/snapshotter-secret-name": name, "csi.storage.k8s.io/snapshotter-secret-namespace": "${volumesnapshot.namespace}"}
	}
	cl := func(n string) string { return kubetest.ClusterName(ns, n) }
	makeSnapshotClass(t, sc, cl("good"), drv, snapshotv1.VolumeSnapshotContentDelete, secret("allowed"))
	makeSnapshotClass(t, sc, cl("forbidden"), drv, snapshotv1.VolumeSnapshotContentDelete, secret("forbidden"))
	makeSnapshotClass(t, sc, cl("missing"), drv, snapshotv1.VolumeSnapshotContentDelete, secret("missing"))
	makeSnapshotClass(t, sc, cl("other"), other, snapshotv1.VolumeSnapshotContentDelete, nil)
	makeSnapshotClass(t, sc, cl("nocap"), nocap, snapshotv1.VolumeSnapshotContentDelete, nil)
	makeSnapshotClass(t, sc, cl("down"), down, snapshotv1.VolumeSnapshotContentDelete, nil)
	vol := createDriverVolume(t, counting.testDrivers, drv, cl("src"))
	nocapVol := createDriverVolume(t, counting.testDrivers, nocap, cl("src"))

	good := makeContent(t, sc, ns, "good", drv, cl("good"), vol, false)
	for _, tc := range []struct{ name, driver, class, vol, want string }{
		{"other-driver", drv, cl("other"), vol, "VolumeSnapshotClass " + cl("other") + " is of driver " + other + ", not " + drv},
		{"denied", drv, cl("forbidden"), vol, "secret access denied by policy"},
		{"missing", drv, cl("missing"), vol, "secret " + ns + "/missing (named by csi.storage.k8s.io/snapshotter-secret-name) for CreateSnapshot of driver " + drv + " not found"},
		{"driver-error", drv, cl("good"), "no-such-volume", "code = NotFound"},
		{"nocap", nocap, cl("nocap"), nocapVol, "driver " + nocap + " does not make snapshots (no CREATE_DELETE_SNAPSHOT controller capability)"},
		{"down", down, cl("down"), "v", "driver " + down + " is not reachable"},
	} {
		vsc := makeContent(t, sc, ns, tc.name, tc.driver, tc.class, tc.vol, false)
		waitContent(t, sc, vsc.Name, "with status error "+tc.want, func(v *snapshotv1.VolumeSnapshotContent) bool {
			return v.Status != nil && v.Status.Error != nil && strings.Contains(*v.Status.Error.Message, tc.want) && v.Status.ReadyToUse != nil && !*v.Status.ReadyToUse
		})
		kubetest.WaitEvent(t, c, "default", vsc.Name, "SnapshotCreationFailed", tc.want)
		if logs := r.logs.String(); !strings.Contains(logs, "content="+vsc.Name) || !strings.Contains(logs, "failed to create snapshot") {
			t.Errorf("%s: no log line for the failure", tc.name)
		}
	}
	waitContent(t, sc, good.Name, "ready", func(v *snapshotv1.VolumeSnapshotContent) bool {
		return v.Status != nil && v.Status.ReadyToUse != nil && *v.Status.ReadyToUse
	})
	// Only the good content's snapshot exists, and it is recorded.
	waitNoUnrecordedSnapshots(t, c, sc, ns, 1, d, dOther, dNocap)
	if n := len(counting.names("CreateSnapshot")); n < 2 {
		t.Errorf("%d CreateSnapshot calls; want the good one and the driver error's", n)
	}
	// Delete: the remembered secret (the granted one) goes to DeleteSnapshot.
	deleteAsSnapshotController(t, sc, good.Name)
	waitContent(t, sc, good.Name, "gone", nil)
	waitNoUnrecordedSnapshots(t, c, sc, ns, 0, d, dOther, dNocap)
	assertNoCanary(t, c, ns, r, counting.testDrivers, canarySecret)
	list, err := sc.SnapshotV1().VolumeSnapshotContents().List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := json.Marshal(list); strings.Contains(string(b), canarySecret) {
		t.Error("canary secret in a VolumeSnapshotContent")
	}
}

// TestSnapshotNotLeakedWhenContentGoesDuringCreate: while CreateSnapshot
// is slow at the driver, one content is deleted as the snapshot-controller
// deletes it (marked, held by its finalizer) and another vanishes outright
// (no finalizer). Once the calls return, neither snapshot is left at the
// driver and the intent record is empty.
func TestSnapshotNotLeakedWhenContentGoesDuringCreate(t *testing.T) {
	env := kubetest.ControlPlane(t)
	installSnapshotCRDs(t, env)
	ns := env.NewNamespace(t)
	c := env.Client()
	sc := snapshotclient.NewForConfigOrDie(env.RESTConfig())
	drv := kubetest.ClusterName(ns, "slow.csi.test")
	drivers := newCountingDrivers()
	// Slow: the sample driver's own latency fault, besides the hold that
	// lets the test act while both calls are in flight.
	d := drivers.addDriver(t, sampledriver.Config{Name: drv, Faults: sampledriver.Faults{Methods: map[string]sampledriver.Fault{"CreateSnapshot": {Latency: 500 * time.Millisecond}}}})
	class := kubetest.ClusterName(ns, "slow")
	makeSnapshotClass(t, sc, class, drv, snapshotv1.VolumeSnapshotContentDelete, nil)
	vol := createDriverVolume(t, drivers.testDrivers, drv, kubetest.ClusterName(ns, "src"))
	letGo := drivers.hold("CreateSnapshot")
	defer letGo()
	r := startBridge(t, env, ns, drivers, bridgeOpts{})
	held := makeContent(t, sc, ns, "held", drv, class, vol, false)
	bare := makeContent(t, sc, ns, "bare", drv, class, vol, true)
	err := testenv.WaitFor(context.Background(), 60*time.Second, "both CreateSnapshot calls in flight", func(context.Context) (bool, string, error) {
		n := len(drivers.names("CreateSnapshot"))
		return n == 2, fmt.Sprintf("%d calls", n), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	waitContent(t, sc, held.Name, "marked being created", func(v *snapshotv1.VolumeSnapshotContent) bool {
		return v.Annotations[snapshot.AnnBeingCreated] == "yes"
	})
	if es := snapshotIntents(t, c, ns); len(es) != 2 {
		t.Fatalf("intent record holds %d entries while both calls run, want 2", len(es))
	}
	deleteAsSnapshotController(t, sc, held.Name)
	if err := sc.SnapshotV1().VolumeSnapshotContents().Delete(context.Background(), bare.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitContent(t, sc, bare.Name, "gone", nil)
	letGo()
	waitContent(t, sc, held.Name, "gone", nil)
	waitNoUnrecordedSnapshots(t, c, sc, ns, 0, d)
	if n := d.CallCount("DeleteSnapshot"); n < 2 {
		t.Errorf("%d DeleteSnapshot calls; want both made snapshots deleted", n)
	}
	if !strings.Contains(r.logs.String(), "deleted a snapshot no content records") {
		t.Errorf("no log line for the vanished content's snapshot:\n%s", tail(r.logs.String(), 30))
	}
}

// TestSnapshotNotLeakedWhenBrokerKilledAfterCreateSnapshot: the broker is
// killed right after two CreateSnapshot calls return, before it records
// either snapshot. While it is down, one content is force-deleted (its
// finalizer dropped); the other stays. The next broker records the
// snapshot of the one that stayed (asked again, the driver names the same
// snapshot) and deletes the other's: every snapshot left at the driver is
// recorded by a content, and the intent record is empty.
func TestSnapshotNotLeakedWhenBrokerKilledAfterCreateSnapshot(t *testing.T) {
	env := kubetest.ControlPlane(t)
	installSnapshotCRDs(t, env)
	ns := env.NewNamespace(t)
	c := env.Client()
	sc := snapshotclient.NewForConfigOrDie(env.RESTConfig())
	drv := kubetest.ClusterName(ns, "killed.csi.test")
	drivers := newCountingDrivers()
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.ClusterName(ns, "k")
	makeSnapshotClass(t, sc, class, drv, snapshotv1.VolumeSnapshotContentDelete, nil)
	vol := createDriverVolume(t, drivers.testDrivers, drv, kubetest.ClusterName(ns, "src"))
	made, killed := make(chan int, 2), make(chan struct{})
	drivers.script("CreateSnapshot", func(n int, call func() error) error {
		if n > 2 {
			return call()
		}
		if err := call(); err != nil {
			return err
		}
		made <- n
		<-killed
		return status.Error(codes.Unavailable, "test: the broker was killed before this answer arrived")
	})
	r1 := startBridge(t, env, ns, drivers, bridgeOpts{identity: "broker-killed"})
	kept := makeContent(t, sc, ns, "kept", drv, class, vol, false)
	gone := makeContent(t, sc, ns, "gone", drv, class, vol, false)
	<-made
	<-made
	cancel := r1.cancel
	r1.cancel = nil
	cancel()
	close(killed)
	select {
	case <-r1.exited:
	case <-time.After(30 * time.Second):
		t.Fatal("the killed broker did not stop")
	}
	if n := len(d.Snapshots()); n != 2 {
		t.Fatalf("%d snapshots at the driver after both calls, want 2", n)
	}
	if es := snapshotIntents(t, c, ns); len(es) != 2 {
		t.Fatalf("intent record holds %d entries after the kill, want 2", len(es))
	}
	for _, name := range []string{kept.Name, gone.Name} {
		if v := waitContent(t, sc, name, "still unrecorded", func(*snapshotv1.VolumeSnapshotContent) bool { return true }); v.Status != nil && v.Status.SnapshotHandle != nil {
			t.Fatalf("content %s records %s: the kill came too late", name, *v.Status.SnapshotHandle)
		}
	}
	if err := forceDeleteContent(sc, gone.Name); err != nil {
		t.Fatal(err)
	}
	waitContent(t, sc, gone.Name, "gone", nil)

	r2 := startBridge(t, env, ns, drivers, bridgeOpts{identity: "broker-next"})
	v := waitContent(t, sc, kept.Name, "ready", func(v *snapshotv1.VolumeSnapshotContent) bool {
		return v.Status != nil && v.Status.ReadyToUse != nil && *v.Status.ReadyToUse
	})
	waitNoUnrecordedSnapshots(t, c, sc, ns, 1, d)
	if s := d.Snapshots(); len(s) != 1 || s[0].ID != *v.Status.SnapshotHandle {
		t.Errorf("driver snapshots %v; want only %s, the kept content's", s, *v.Status.SnapshotHandle)
	}
	if got := r2.metricValue(t, "csibroker_recovered_snapshots_total", map[string]string{"driver": drv, "result": "deleted"}); got != 1 {
		t.Errorf("recovered_snapshots_total{deleted} = %v, want 1", got)
	}
}

// TestSnapshotOfNodeLocalVolume: a node-local driver's volume is
// snapshotted by the proxy of its node (the one its PV names), the node
// recorded on the content, and the snapshot deleted there too.
func TestSnapshotOfNodeLocalVolume(t *testing.T) {
	env := kubetest.ControlPlane(t)
	installSnapshotCRDs(t, env)
	ns := env.NewNamespace(t)
	c, ctx := env.Client(), context.Background()
	sc := snapshotclient.NewForConfigOrDie(env.RESTConfig())
	drv := kubetest.ClusterName(ns, "local.csi.test")
	n1, n2 := nodeName(ns, "n1"), nodeName(ns, "n2")
	drivers := newCountingDrivers()
	d1 := drivers.addNodeDriver(t, sampledriver.Config{Name: drv}, n1)
	d2 := drivers.addNodeDriver(t, sampledriver.Config{Name: drv}, n2)
	class := kubetest.ClusterName(ns, "local")
	makeSnapshotClass(t, sc, class, drv, snapshotv1.VolumeSnapshotContentDelete, nil)
	conn, err := drivers.NodeConn(drv, n2)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := csi.NewControllerClient(conn).CreateVolume(ctx, createRequest(kubetest.ClusterName(ns, "vol")))
	if err != nil {
		t.Fatal(err)
	}
	vol := resp.GetVolume().GetVolumeId()
	pv := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: kubetest.ClusterName(ns, "pv"), Annotations: map[string]string{kube.AnnVolumeNode: n2}},
		Spec: corev1.PersistentVolumeSpec{Capacity: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Mi")},
			AccessModes:            []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: drv, VolumeHandle: vol}}}}
	if _, err := c.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.CoreV1().PersistentVolumes().Delete(context.Background(), pv.Name, metav1.DeleteOptions{}) })
	startBridge(t, env, ns, drivers, bridgeOpts{})
	vsc := makeContent(t, sc, ns, "local", drv, class, vol, false)
	got := waitContent(t, sc, vsc.Name, "ready", func(v *snapshotv1.VolumeSnapshotContent) bool {
		return v.Status != nil && v.Status.ReadyToUse != nil && *v.Status.ReadyToUse
	})
	if got.Annotations[snapshot.AnnNode] != n2 {
		t.Errorf("content annotations %v; want %s=%s", got.Annotations, snapshot.AnnNode, n2)
	}
	if len(d2.Snapshots()) != 1 || len(d1.Snapshots()) != 0 {
		t.Fatalf("snapshots on %s: %d, on %s: %d; want the one on the volume's node %s", n1, len(d1.Snapshots()), n2, len(d2.Snapshots()), n2)
	}
	deleteAsSnapshotController(t, sc, vsc.Name)
	waitContent(t, sc, vsc.Name, "gone", nil)
	if n := len(d2.Snapshots()); n != 0 {
		t.Errorf("%d snapshots left on %s after the content's deletion", n, n2)
	}
}
