package testenv

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
)

// Well-known keys a kubelet and node-driver-registrar set.
const (
	// AnnotationControllerManagedAttach makes the attach/detach controller
	// manage a node's volumes.
	AnnotationControllerManagedAttach = "volumes.kubernetes.io/controller-managed-attach-detach"
	// AnnotationCSINodeIDs maps driver names to their node IDs on a Node.
	AnnotationCSINodeIDs = "csi.volume.kubernetes.io/nodeid"
	LabelZone            = corev1.LabelTopologyZone   // topology.kubernetes.io/zone
	LabelRegion          = corev1.LabelTopologyRegion // topology.kubernetes.io/region
)

// NodeSpec describes a fake node. Zero values get defaults.
type NodeSpec struct {
	Name   string            // required
	Zone   string            // topology.kubernetes.io/zone, if set
	Region string            // topology.kubernetes.io/region, if set
	Labels map[string]string // more labels (e.g. a driver's topology keys)

	CPU    string // allocatable cpu, default "8"
	Memory string // allocatable memory, default "32Gi"
	Pods   int    // allocatable pods, default 110
}

// AddNodes creates Node objects as a kubelet would register them: Ready,
// schedulable and untainted, with allocatable cpu/memory/pods, the
// controller-managed attach/detach annotation, the hostname/os/arch labels,
// the zone/region labels and spec.Labels. Nodes stay Ready because the node
// lifecycle controller does not run. The caller deletes them (a node's CSINode
// goes with it through its owner reference when the controller-manager runs).
func (e *Env) AddNodes(ctx context.Context, specs ...NodeSpec) ([]*corev1.Node, error) {
	nodes := make([]*corev1.Node, 0, len(specs))
	for _, s := range specs {
		n, err := e.addNode(ctx, s)
		if err != nil {
			return nodes, err
		}
		nodes = append(nodes, n)
	}
	return nodes, nil
}

func (e *Env) addNode(ctx context.Context, s NodeSpec) (*corev1.Node, error) {
	if s.Name == "" {
		return nil, fmt.Errorf("testenv: add node: empty name")
	}
	cpu, mem, pods := s.CPU, s.Memory, s.Pods
	if cpu == "" {
		cpu = "8"
	}
	if mem == "" {
		mem = "32Gi"
	}
	if pods == 0 {
		pods = 110
	}
	alloc := corev1.ResourceList{}
	for name, v := range map[corev1.ResourceName]string{corev1.ResourceCPU: cpu, corev1.ResourceMemory: mem, corev1.ResourcePods: fmt.Sprint(pods)} {
		q, err := resource.ParseQuantity(v)
		if err != nil {
			return nil, fmt.Errorf("testenv: add node %s: %s %q: %w", s.Name, name, v, err)
		}
		alloc[name] = q
	}
	labels := map[string]string{
		corev1.LabelHostname:   s.Name,
		corev1.LabelOSStable:   "linux",
		corev1.LabelArchStable: "amd64",
	}
	if s.Zone != "" {
		labels[LabelZone] = s.Zone
	}
	if s.Region != "" {
		labels[LabelRegion] = s.Region
	}
	maps.Copy(labels, s.Labels)

	now := metav1.Now()
	cond := func(t corev1.NodeConditionType, st corev1.ConditionStatus, reason string) corev1.NodeCondition {
		return corev1.NodeCondition{Type: t, Status: st, Reason: reason, LastHeartbeatTime: now, LastTransitionTime: now}
	}
	status := corev1.NodeStatus{
		Capacity:    alloc.DeepCopy(),
		Allocatable: alloc,
		Phase:       corev1.NodeRunning,
		Conditions: []corev1.NodeCondition{
			cond(corev1.NodeReady, corev1.ConditionTrue, "KubeletReady"),
			cond(corev1.NodeMemoryPressure, corev1.ConditionFalse, "KubeletHasSufficientMemory"),
			cond(corev1.NodeDiskPressure, corev1.ConditionFalse, "KubeletHasNoDiskPressure"),
			cond(corev1.NodePIDPressure, corev1.ConditionFalse, "KubeletHasSufficientPID"),
		},
		Addresses: []corev1.NodeAddress{{Type: corev1.NodeHostName, Address: s.Name}},
		NodeInfo: corev1.NodeSystemInfo{
			KubeletVersion:  KubernetesVersion,
			OperatingSystem: "linux",
			Architecture:    "amd64",
		},
	}
	c := e.Client().CoreV1().Nodes()
	n, err := c.Create(ctx, &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{
			Name:        s.Name,
			Labels:      labels,
			Annotations: map[string]string{AnnotationControllerManagedAttach: "true"},
		},
		Status: status,
	}, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("testenv: create node %s: %w", s.Name, err)
	}
	// The TaintNodesByCondition admission plugin taints every new node
	// not-ready:NoSchedule; the node lifecycle controller would lift it once
	// the node reports Ready, but it does not run here.
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if len(n.Spec.Taints) == 0 {
			return nil
		}
		n.Spec.Taints = nil
		updated, err := c.Update(ctx, n, metav1.UpdateOptions{})
		if err == nil {
			n = updated
		} else if fresh, gerr := c.Get(ctx, s.Name, metav1.GetOptions{}); gerr == nil {
			n = fresh
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("testenv: untaint node %s: %w", s.Name, err)
	}
	if len(n.Status.Allocatable) == 0 || len(n.Status.Conditions) == 0 {
		n.Status = status
		if n, err = c.UpdateStatus(ctx, n, metav1.UpdateOptions{}); err != nil {
			return nil, fmt.Errorf("testenv: set status of node %s: %w", s.Name, err)
		}
	}
	return n, nil
}

// AddCSINode registers driverName on node the way kubelet does when
// node-driver-registrar reports it: the node's CSINode object (created if
// missing, owned by the Node) gets a driver entry with nodeID and
// topologyKeys, replacing an earlier, different entry of the same driver (a
// driver entry is immutable, so that takes two updates); and the Node's
// csi.volume.kubernetes.io/nodeid annotation maps the driver to nodeID. The
// topology values are the node's labels of those keys (set them with
// NodeSpec.Labels, Zone or Region).
func (e *Env) AddCSINode(ctx context.Context, node, driverName, nodeID string, topologyKeys []string) error {
	c := e.Client()
	n, err := c.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("testenv: add CSINode driver %s: get node %s: %w", driverName, node, err)
	}
	for _, k := range topologyKeys {
		if _, ok := n.Labels[k]; !ok {
			return fmt.Errorf("testenv: add CSINode driver %s: node %s has no label for topology key %q", driverName, node, k)
		}
	}
	entry := storagev1.CSINodeDriver{Name: driverName, NodeID: nodeID, TopologyKeys: slices.Clone(topologyKeys)}

	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := c.StorageV1().CSINodes().Get(ctx, node, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			_, err = c.StorageV1().CSINodes().Create(ctx, &storagev1.CSINode{
				ObjectMeta: metav1.ObjectMeta{
					Name: node,
					OwnerReferences: []metav1.OwnerReference{{
						APIVersion: "v1", Kind: "Node", Name: n.Name, UID: n.UID,
					}},
				},
				Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{entry}},
			}, metav1.CreateOptions{})
			if apierrors.IsAlreadyExists(err) {
				return apierrors.NewConflict(storagev1.Resource("csinodes"), node, err) // raced: retry as an update
			}
			return err
		}
		if err != nil {
			return err
		}
		i := slices.IndexFunc(cur.Spec.Drivers, func(d storagev1.CSINodeDriver) bool { return d.Name == driverName })
		if i >= 0 {
			if equality.Semantic.DeepEqual(cur.Spec.Drivers[i], entry) {
				return nil
			}
			// A driver entry is immutable: drop the old one first, as
			// kubelet does when a driver unregisters.
			cur.Spec.Drivers = slices.Delete(cur.Spec.Drivers, i, i+1)
			if cur, err = c.StorageV1().CSINodes().Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
				return err
			}
		}
		cur.Spec.Drivers = append(cur.Spec.Drivers, entry)
		_, err = c.StorageV1().CSINodes().Update(ctx, cur, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return fmt.Errorf("testenv: add CSINode driver %s on %s: %w", driverName, node, err)
	}

	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		n, err := c.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		ids := map[string]string{}
		if v := n.Annotations[AnnotationCSINodeIDs]; v != "" {
			if err := json.Unmarshal([]byte(v), &ids); err != nil {
				return fmt.Errorf("annotation %s: %w", AnnotationCSINodeIDs, err)
			}
		}
		ids[driverName] = nodeID
		b, err := json.Marshal(ids)
		if err != nil {
			return err
		}
		if n.Annotations == nil {
			n.Annotations = map[string]string{}
		}
		n.Annotations[AnnotationCSINodeIDs] = string(b)
		_, err = c.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return fmt.Errorf("testenv: annotate node %s with the node ID of %s: %w", node, driverName, err)
	}
	return nil
}

// WaitFor polls cond every 100ms until it returns true or an error, or until
// timeout passes; the error then says what was awaited and the last state
// cond reported.
func WaitFor(ctx context.Context, timeout time.Duration, what string, cond func(ctx context.Context) (done bool, state string, err error)) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	var state string
	for {
		done, s, err := cond(ctx)
		if err != nil && ctx.Err() == nil {
			return fmt.Errorf("waiting for %s: %w", what, err)
		}
		if done && err == nil {
			return nil
		}
		if s != "" {
			state = s
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("timed out after %s waiting for %s; last seen: %s", timeout, what, state)
		case <-tick.C:
		}
	}
}
