package k8sbridge

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
	"github.com/csibroker/csibroker/policy"
)

// TestNodeLocalDriver: two nodes, each with its own instance of one
// node-local driver behind a node proxy. A WaitForFirstConsumer claim lands
// on the selected node's driver; an Immediate claim is placed on the node
// with room for it; a PV whose node is gone is left for the admin with an
// Event.
func TestNodeLocalDriver(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "local.csi.test")
	small, big := kubetest.ClusterName(ns, "small"), kubetest.ClusterName(ns, "big")
	drivers := &testDrivers{}
	inst := addLocalNodes(t, env, drivers, drv, map[string]int64{small: 10 << 30, big: 100 << 30}, sampledriver.Faults{})
	imm, wffc, del := storagev1.VolumeBindingImmediate, storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete
	immClass := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "imm"), drv, imm, del, nil)
	wffcClass := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "wffc"), drv, wffc, del, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})

	kubetest.MakeClaim(t, c, ns, "pinned", wffcClass.Name, "1Gi")
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "pod", Namespace: ns}, Spec: corev1.PodSpec{
		NodeSelector: map[string]string{corev1.LabelHostname: small},
		Containers:   []corev1.Container{{Name: "c", Image: "busybox", Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("10m")}}}},
		Volumes:      []corev1.Volume{{Name: "v", VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "pinned"}}}}}}
	if _, err := c.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pinned := kubetest.WaitBound(t, c, ns, "pinned", 60*time.Second)
	if got := pinned.Annotations[kube.AnnSelectedNode]; got != small {
		t.Fatalf("selected node %q", got)
	}
	if len(inst[small].Volumes()) != 1 || len(inst[big].Volumes()) != 0 {
		t.Fatalf("volumes: small %d big %d; want the pinned volume on the selected node", len(inst[small].Volumes()), len(inst[big].Volumes()))
	}

	kubetest.MakeClaim(t, c, ns, "large", immClass.Name, "50Gi")
	large := kubetest.WaitBound(t, c, ns, "large", 60*time.Second)
	if len(inst[big].Volumes()) != 1 {
		t.Fatalf("the 50Gi volume is not on the only node with room: big has %d volumes", len(inst[big].Volumes()))
	}
	pv, err := c.CoreV1().PersistentVolumes().Get(ctx, large.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if e := pv.Spec.NodeAffinity.Required.NodeSelectorTerms[0].MatchExpressions[0]; e.Key != corev1.LabelHostname || e.Values[0] != big {
		t.Fatalf("PV affinity %+v", e)
	}
	kubetest.MakeClaim(t, c, ns, "toolarge", immClass.Name, "500Gi")
	kubetest.WaitEvent(t, c, ns, "toolarge", "ProvisioningFailed", "has 536870912000 bytes free")

	// The small node disappears; its volume's PV is left for the admin.
	if err := c.CoreV1().Pods(ns).Delete(ctx, "pod", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	if err := c.CoreV1().Nodes().Delete(ctx, small, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "pinned", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitEvent(t, c, "default", pinned.Spec.VolumeName, "VolumeFailedDelete", "node "+small+" of node-local volume")
	if _, err := c.CoreV1().PersistentVolumes().Get(ctx, pinned.Spec.VolumeName, metav1.GetOptions{}); err != nil {
		t.Fatalf("the PV of a vanished node was removed: %v", err)
	}
}

// TestNodeLocalEarlierAttemptsVolumeIsNeverLeft: a node-local volume an
// earlier attempt may have made on a node is never left there when the
// claim is provisioned again. An Immediate claim whose first CreateVolume
// made the volume on the roomier node but answered Aborted is finished on
// that node, even though the other node now has more room. A
// WaitForFirstConsumer claim whose selected node changes after an attempt
// on the old node has the volume deleted on the old node before it is made
// on the new one; while the old node is unreachable it waits, saying why.
func TestNodeLocalEarlierAttemptsVolumeIsNeverLeft(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "local.csi.test")
	a, b := kubetest.ClusterName(ns, "a"), kubetest.ClusterName(ns, "b")
	drivers := &testDrivers{}
	// The first CreateVolume on each node makes the volume, then answers
	// Aborted ("may still be in progress").
	lost := sampledriver.Faults{Methods: map[string]sampledriver.Fault{"CreateVolume": {First: 1, Code: codes.Aborted, After: true}}}
	inst := addLocalNodes(t, env, drivers, drv, map[string]int64{a: 10 << 30, b: 8 << 30}, lost)
	imm, wffc, del := storagev1.VolumeBindingImmediate, storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete
	immClass := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "imm"), drv, imm, del, nil)
	wffcClass := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "wffc"), drv, wffc, del, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})

	// Immediate: placed on a (10Gi free against 8Gi); after the lost
	// answer a has 5Gi free, but the retry stays on a.
	kubetest.MakeClaim(t, c, ns, "imm", immClass.Name, "5Gi")
	kubetest.WaitEvent(t, c, ns, "imm", "ProvisioningFailed", "may still be in progress")
	bound := kubetest.WaitBound(t, c, ns, "imm", 60*time.Second)
	if na, nb := len(inst[a].Volumes()), len(inst[b].Volumes()); na != 1 || nb != 0 {
		t.Fatalf("Immediate claim: volumes on a %d, on b %d; want the one volume on a, where the first attempt made it", na, nb)
	}
	pv, err := c.CoreV1().PersistentVolumes().Get(ctx, bound.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := pv.Annotations[kube.AnnVolumeNode]; got != a {
		t.Fatalf("PV node %q, want %s", got, a)
	}

	// WaitForFirstConsumer: an attempt on b while b's proxy is unreachable
	// (the broker cannot know whether it made the volume), then the
	// scheduler moves the claim to a.
	drivers.setNodeDown(drv, b, true)
	kubetest.MakeClaim(t, c, ns, "moved", wffcClass.Name, "1Gi")
	setSelectedNode(t, c, ns, "moved", b)
	kubetest.WaitEvent(t, c, ns, "moved", "ProvisioningFailed", "unreachable")
	setSelectedNode(t, c, ns, "moved", a)
	kubetest.WaitEvent(t, c, ns, "moved", "ProvisioningFailed", "may have made volume")
	if n := len(inst[a].Volumes()); n != 1 {
		t.Fatalf("a volume was made on a (%d volumes) before the one b may hold was dealt with", n)
	}
	drivers.setNodeDown(drv, b, false)
	moved := kubetest.WaitBound(t, c, ns, "moved", 60*time.Second)
	if na, nb := len(inst[a].Volumes()), len(inst[b].Volumes()); na != 2 || nb != 0 {
		t.Fatalf("moved claim: volumes on a %d, on b %d; want 2 on a and none left on b", na, nb)
	}
	pv, err = c.CoreV1().PersistentVolumes().Get(ctx, moved.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := pv.Annotations[kube.AnnVolumeNode]; got != a {
		t.Fatalf("moved claim's PV node %q, want %s", got, a)
	}
}

// waitSelectedNodeRemoved waits until the claim's selected-node annotation
// is gone (the broker handed it back to the scheduler).
func waitSelectedNodeRemoved(t *testing.T, c kubernetes.Interface, ns, claim string) {
	t.Helper()
	err := testenv.WaitFor(context.Background(), 30*time.Second, "selected-node annotation removed", func(ctx context.Context) (bool, string, error) {
		pvc, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, claim, metav1.GetOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		_, has := pvc.Annotations[kube.AnnSelectedNode]
		return !has, fmt.Sprint(pvc.Annotations), nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func setSelectedNode(t *testing.T, c kubernetes.Interface, ns, claim, node string) {
	t.Helper()
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%q}}}`, kube.AnnSelectedNode, node)
	if _, err := c.CoreV1().PersistentVolumeClaims(ns).Patch(context.Background(), claim, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
}

// TestNodeLocalGrantByNode: a node-local driver's CreateVolume goes to the
// selected node's proxy, so a grant's requesters.nodes decides which nodes'
// proxies may receive the provisioner secret.
func TestNodeLocalGrantByNode(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "local.csi.test")
	a, b := kubetest.ClusterName(ns, "a"), kubetest.ClusterName(ns, "b")
	drivers := &testDrivers{}
	inst := addLocalNodes(t, env, drivers, drv, map[string]int64{a: 10 << 30, b: 10 << 30}, sampledriver.Faults{})
	if _, err := c.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "creds", Namespace: ns}, StringData: map[string]string{"k": "v"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	rs, errs := policy.Compile([]policy.Grant{{Namespace: ns, Name: "only-a", Spec: policy.GrantSpec{
		Drivers: []string{drv}, SecretNames: []string{"creds"}, Operations: []policy.Operation{policy.OpCreateVolume},
		Requesters: policy.Requesters{Namespaces: []string{ns}, Nodes: []string{a}}}}})
	if len(errs) != 0 {
		t.Fatal(errs)
	}
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "wffc"), drv, storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete,
		map[string]string{"csi.storage.k8s.io/provisioner-secret-name": "creds", "csi.storage.k8s.io/provisioner-secret-namespace": ns})
	startBridge(t, env, ns, drivers, bridgeOpts{policy: &policy.Authorizer{Rules: policy.NewStore(rs)}})
	kubetest.MakeClaim(t, c, ns, "on-a", class.Name, "1Gi")
	setSelectedNode(t, c, ns, "on-a", a)
	kubetest.MakeClaim(t, c, ns, "on-b", class.Name, "1Gi")
	setSelectedNode(t, c, ns, "on-b", b)
	kubetest.WaitBound(t, c, ns, "on-a", 60*time.Second)
	kubetest.WaitEvent(t, c, ns, "on-b", "ProvisioningFailed", "denied by policy")
	if na, nb := len(inst[a].Volumes()), len(inst[b].Volumes()); na != 1 || nb != 0 {
		t.Fatalf("volumes on a %d, on b %d; want only a's proxy to have received the secret", na, nb)
	}
}

// addLocalNodes adds each node of sizes (a Node, its CSINode for drv, and an
// instance of drv on it behind a node proxy with that capacity and faults)
// and returns the instances by node.
func addLocalNodes(t *testing.T, env *testenv.Env, drivers *testDrivers, drv string, sizes map[string]int64, faults sampledriver.Faults) map[string]*sampledriver.Driver {
	t.Helper()
	inst := map[string]*sampledriver.Driver{}
	for node, size := range sizes {
		addHostnameNodes(t, env, drv, node)
		inst[node] = drivers.addNodeDriver(t, sampledriver.Config{Name: drv, CapacityBytes: size, Topology: map[string]string{corev1.LabelHostname: node}, Faults: faults}, node)
	}
	return inst
}

// TestNodeLocalAttachOnTheVolumesNode: a node-local driver with a publish
// step is asked to publish and unpublish by the plugin of the node the
// volume lives on (and is attached to), not by another node's.
func TestNodeLocalAttachOnTheVolumesNode(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "la.csi.test")
	// The volume's node sorts after the other, so it is not the first
	// node proxy of the driver either.
	first, second := kubetest.ClusterName(ns, "a"), kubetest.ClusterName(ns, "z")
	drivers := &testDrivers{}
	inst := addLocalNodes(t, env, drivers, drv, map[string]int64{first: 10 << 30, second: 100 << 30}, sampledriver.Faults{})
	makeCSIDriver(t, c, drv, true)
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "imm"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "big", class.Name, "50Gi").Name, 60*time.Second).Spec.VolumeName
	if len(inst[second].Volumes()) != 1 {
		t.Fatalf("the 50Gi volume is not on %s, the only node with room", second)
	}
	va := createVA(t, c, ns, drv, second, pvName)
	vaFor(t, c, pvName, func(va *storagev1.VolumeAttachment) bool { return va.Status.Attached }, "attached")
	if err := c.StorageV1().VolumeAttachments().Delete(ctx, va.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitVAGone(t, c, va.Name, 30*time.Second)
	for node, want := range map[string]int64{first: 0, second: 1} {
		for _, m := range []string{"ControllerPublishVolume", "ControllerUnpublishVolume"} {
			if n := inst[node].CallCount(m); n != want {
				t.Errorf("node %s's plugin: %d %s calls, want %d", node, n, m, want)
			}
		}
	}
}

// TestNodeLocalResizeOfVolumeWithoutNode: a node-local driver's volume whose
// PV names no node (a static PV without the node annotation or a hostname
// affinity) is not sent to some node's proxy for expansion: the claim gets
// an Event saying why, and no driver is called.
func TestNodeLocalResizeOfVolumeWithoutNode(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "local.csi.test")
	node := kubetest.ClusterName(ns, "n1")
	drivers := &testDrivers{}
	inst := addLocalNodes(t, env, drivers, drv, map[string]int64{node: 10 << 30}, sampledriver.Faults{})
	class := makeResizeClass(t, c, kubetest.ClusterName(ns, "expand"), drv, "", "")
	r := startBridge(t, env, ns, drivers, bridgeOpts{})

	// The volume exists on the node's driver; only its PV does not say where.
	conn, err := drivers.NodeConn(drv, node)
	if err != nil {
		t.Fatal(err)
	}
	vol, err := csi.NewControllerClient(conn).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "static", CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30},
		VolumeCapabilities: mountCaps()})
	if err != nil {
		t.Fatal(err)
	}
	pvName := kubetest.ClusterName(ns, "static")
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: pvName},
		Spec: corev1.PersistentVolumeSpec{
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			PersistentVolumeSource:        corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: drv, VolumeHandle: vol.GetVolume().GetVolumeId()}},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			StorageClassName:              class,
		},
	}
	if _, err := c.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.CoreV1().PersistentVolumes().Delete(context.Background(), pvName, metav1.DeleteOptions{}) })
	claim := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "static", Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			StorageClassName: &class,
			VolumeName:       pvName,
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}
	if _, err := c.CoreV1().PersistentVolumeClaims(ns).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitBound(t, c, ns, "static", 60*time.Second)

	raiseRequest(t, c, ns, "static", "2Gi")
	kubetest.WaitEvent(t, c, ns, "static", "VolumeResizeFailed", "names no node")
	if got := r.metricValue(t, "csibroker_resize_operations_total", map[string]string{"driver": drv, "result": "not_called"}); got < 1 {
		t.Errorf("resize results: not_called %v, want at least 1", got)
	}
	for _, v := range inst[node].Volumes() {
		if v.CapacityBytes != 1<<30 {
			t.Errorf("volume %s expanded to %d bytes on node %s's driver, whose PV names no node", v.ID, v.CapacityBytes, node)
		}
	}
	if n := inst[node].CallCount("ControllerExpandVolume"); n != 0 {
		t.Errorf("node %s's driver got %d ControllerExpandVolume calls for a volume whose PV names no node", node, n)
	}
}

// TestNodeLocalResizeWhileItsNodeIsDown: a node-local volume whose node's
// proxy is unreachable is not expanded, and its claim is not marked as
// expanding (no allocatedResources raised, no ControllerResizeInProgress),
// only told why; once the proxy is back the expansion goes through.
func TestNodeLocalResizeWhileItsNodeIsDown(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "ld.csi.test")
	node := kubetest.ClusterName(ns, "n1")
	drivers := &testDrivers{}
	inst := addLocalNodes(t, env, drivers, drv, map[string]int64{node: 10 << 30}, sampledriver.Faults{})
	class := makeResizeClass(t, c, kubetest.ClusterName(ns, "expand"), drv, "", "")
	startBridge(t, env, ns, drivers, bridgeOpts{})
	kubetest.MakeClaim(t, c, ns, "data", class, "1Gi")
	kubetest.WaitBound(t, c, ns, "data", 60*time.Second)

	drivers.setNodeDown(drv, node, true)
	raiseRequest(t, c, ns, "data", "2Gi")
	kubetest.WaitEvent(t, c, ns, "data", "VolumeResizeFailed", "unreachable")
	cur, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "data", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(cur.Status.AllocatedResources) != 0 || len(cur.Status.AllocatedResourceStatuses) != 0 {
		t.Fatalf("claim marked expanding while no driver could be asked: allocated %v, statuses %v", cur.Status.AllocatedResources, cur.Status.AllocatedResourceStatuses)
	}
	if n := inst[node].CallCount("ControllerExpandVolume"); n != 0 {
		t.Fatalf("%d ControllerExpandVolume calls while the node's proxy was down", n)
	}
	drivers.setNodeDown(drv, node, false)
	err = testenv.WaitFor(ctx, 60*time.Second, "the volume expanded", func(context.Context) (bool, string, error) {
		for _, v := range inst[node].Volumes() {
			return v.CapacityBytes >= 2<<30, fmt.Sprint(v.CapacityBytes, " bytes"), nil
		}
		return false, "no volume", nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
