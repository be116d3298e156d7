package k8sbridge

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
)

// TestNodeLocalDriver: two nodes, each with its own instance of one
// node-local driver behind a node proxy. A WaitForFirstConsumer claim lands
// on the selected node's driver; an Immediate claim is placed on the node
// with room for it; a PV whose node is gone is left for the admin with an
// Event.
func TestNodeLocalDriver(t *testing.T) {
	env := testenv.Shared(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := clusterName(ns, "local.csi.test")
	small, big := clusterName(ns, "small"), clusterName(ns, "big")
	drivers := &testDrivers{}
	inst := map[string]*sampledriver.Driver{}
	for node, size := range map[string]int64{small: 10 << 30, big: 100 << 30} {
		if _, err := env.AddNodes(ctx, testenv.NodeSpec{Name: node}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.CoreV1().Nodes().Delete(context.Background(), node, metav1.DeleteOptions{}) })
		if err := env.AddCSINode(ctx, node, drv, node, []string{corev1.LabelHostname}); err != nil {
			t.Fatal(err)
		}
		inst[node] = drivers.addNodeDriver(t, sampledriver.Config{Name: drv, CapacityBytes: size, Topology: map[string]string{corev1.LabelHostname: node}}, node)
	}
	imm, wffc, del := storagev1.VolumeBindingImmediate, storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete
	immClass := makeClass(t, c, clusterName(ns, "imm"), drv, imm, del, nil)
	wffcClass := makeClass(t, c, clusterName(ns, "wffc"), drv, wffc, del, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})

	makeClaim(t, c, ns, "pinned", wffcClass.Name, "1Gi")
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "pod", Namespace: ns}, Spec: corev1.PodSpec{
		NodeSelector: map[string]string{corev1.LabelHostname: small},
		Containers:   []corev1.Container{{Name: "c", Image: "busybox", Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("10m")}}}},
		Volumes:      []corev1.Volume{{Name: "v", VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "pinned"}}}}}}
	if _, err := c.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pinned := waitBound(t, c, ns, "pinned", 60*time.Second)
	if got := pinned.Annotations[annSelectedNode]; got != small {
		t.Fatalf("selected node %q", got)
	}
	if len(inst[small].Volumes()) != 1 || len(inst[big].Volumes()) != 0 {
		t.Fatalf("volumes: small %d big %d; want the pinned volume on the selected node", len(inst[small].Volumes()), len(inst[big].Volumes()))
	}

	makeClaim(t, c, ns, "large", immClass.Name, "50Gi")
	large := waitBound(t, c, ns, "large", 60*time.Second)
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
	makeClaim(t, c, ns, "toolarge", immClass.Name, "500Gi")
	waitEvent(t, c, ns, "toolarge", "ProvisioningFailed", "has 536870912000 bytes free")

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
	waitEvent(t, c, "default", pinned.Spec.VolumeName, "VolumeFailedDelete", "node "+small+" of node-local volume")
	if _, err := c.CoreV1().PersistentVolumes().Get(ctx, pinned.Spec.VolumeName, metav1.GetOptions{}); err != nil {
		t.Fatalf("the PV of a vanished node was removed: %v", err)
	}
}
