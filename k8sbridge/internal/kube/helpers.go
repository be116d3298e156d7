package kube

import (
	"context"
	"fmt"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
)

import ()

// PatchPV is patchVA for a PersistentVolume, as a strategic merge patch
// (its maps hold no keys from outside).
func (b *Env) PatchPV(ctx context.Context, old, cur *corev1.PersistentVolume) error {
	patch, err := TwoWayPatch(old, cur, &corev1.PersistentVolume{}, old.ResourceVersion)
	if err != nil || patch == nil {
		return err
	}
	_, err = b.Cfg.Client.CoreV1().PersistentVolumes().Patch(ctx, old.Name, types.StrategicMergePatchType, patch, metav1.PatchOptions{})
	return err
}

// AttachmentOf is a VolumeAttachment naming PV pv (the first found), nil if
// none does: while one does, the volume may be in use on its node.
func (b *Env) AttachmentOf(pv string) (*storagev1.VolumeAttachment, error) {
	vas, err := b.Attachments.List(labels.Everything())
	if err != nil {
		return nil, err
	}
	for _, va := range vas {
		if src := va.Spec.Source.PersistentVolumeName; src != nil && *src == pv {
			return va, nil
		}
	}
	return nil, nil
}

// PatchClaimStatus writes cur's changes to old through the status
// subresource and returns the claim as stored; no write when nothing
// changes.
func (b *Env) PatchClaimStatus(ctx context.Context, old, cur *corev1.PersistentVolumeClaim, checkRV bool) (*corev1.PersistentVolumeClaim, error) {
	patch, err := ClaimStatusPatch(old, cur, checkRV)
	if err != nil {
		return old, fmt.Errorf("claim %s/%s status patch: %w", old.Namespace, old.Name, err)
	}
	if patch == nil {
		return old, nil
	}
	updated, err := b.Cfg.Client.CoreV1().PersistentVolumeClaims(old.Namespace).Patch(ctx, old.Name, types.StrategicMergePatchType, patch, metav1.PatchOptions{}, "status")
	if err != nil {
		return old, fmt.Errorf("patch status of claim %s/%s: %w", old.Namespace, old.Name, err)
	}
	return updated, nil
}

// MergeConditions is mergeResizeConditions for the conditions a
// controller owns (owned): the resizer's, or the modifier's.
func MergeConditions(conds, want []corev1.PersistentVolumeClaimCondition, owned, keep func(corev1.PersistentVolumeClaimConditionType) bool) []corev1.PersistentVolumeClaimCondition {
	wanted := map[corev1.PersistentVolumeClaimConditionType]corev1.PersistentVolumeClaimCondition{}
	for _, c := range want {
		wanted[c.Type] = c
	}
	var out []corev1.PersistentVolumeClaimCondition
	for _, c := range conds {
		if w, ok := wanted[c.Type]; ok {
			if w.Status == c.Status {
				if w.Reason != c.Reason {
					c.Message, c.Reason = w.Message, w.Reason
				}
				out = append(out, c)
			} else {
				out = append(out, w)
			}
			delete(wanted, c.Type)
			continue
		}
		if !owned(c.Type) || (keep != nil && keep(c.Type)) {
			out = append(out, c)
		}
	}
	for _, w := range want {
		if _, ok := wanted[w.Type]; ok {
			out = append(out, w)
		}
	}
	return out
}

func KeepAll(corev1.PersistentVolumeClaimConditionType) bool { return true }

// ErrNodeUnknown: a node-local driver's volume whose PV says nothing of
// its node cannot be routed to a node's proxy.
func ErrNodeUnknown(pv *corev1.PersistentVolume, driver string) error {
	handle := pv.Name
	if pv.Spec.CSI != nil {
		handle = pv.Spec.CSI.VolumeHandle
	}
	return fmt.Errorf("volume %s of node-local driver %s names no node (no %s annotation, no single hostname in its node affinity); cannot tell which node's proxy holds it",
		handle, driver, AnnVolumeNode)
}

// NodeOfPV is the name of the node of a node-local PV: recorded at
// provisioning, else the node whose kubernetes.io/hostname label is the
// single hostname its affinity names (a node's name and hostname label may
// differ), else that hostname; "" when the PV says nothing of its node.
func (b *Env) NodeOfPV(pv *corev1.PersistentVolume) string {
	n := PVNode(pv)
	if n == "" || pv.Annotations[AnnVolumeNode] != "" {
		return n
	}
	if _, err := b.Nodes.Get(n); err == nil {
		return n
	}
	nodes, err := b.Nodes.List(labels.SelectorFromSet(labels.Set{corev1.LabelHostname: n}))
	if err == nil && len(nodes) == 1 {
		return nodes[0].Name
	}
	return n
}

// PVNode is the node of a node-local PV: recorded at provisioning, else the
// single hostname its affinity names, else "".
func PVNode(pv *corev1.PersistentVolume) string {
	if n := pv.Annotations[AnnVolumeNode]; n != "" {
		return n
	}
	if pv.Spec.NodeAffinity == nil || pv.Spec.NodeAffinity.Required == nil {
		return ""
	}
	for _, t := range pv.Spec.NodeAffinity.Required.NodeSelectorTerms {
		for _, e := range t.MatchExpressions {
			if e.Key == "kubernetes.io/hostname" && len(e.Values) == 1 {
				return e.Values[0]
			}
		}
	}
	return ""
}

func HasFinalizer(pv *corev1.PersistentVolume, f string) bool {
	for _, x := range pv.Finalizers {
		if x == f {
			return true
		}
	}
	return false
}

func RemoveString(in []string, s string) []string {
	out := in[:0:0]
	for _, x := range in {
		if x != s {
			out = append(out, x)
		}
	}
	return out
}

func PVRef(pv *corev1.PersistentVolume) corev1.ObjectReference {
	return corev1.ObjectReference{Kind: "PersistentVolume", APIVersion: "v1", Name: pv.Name, UID: pv.UID, ResourceVersion: pv.ResourceVersion}
}

// CachedClaim is the claim of queue key namespace/name from the cache; nil
// (and no error) when the key is not one or the claim is gone.
func (b *Env) CachedClaim(key string) (*corev1.PersistentVolumeClaim, error) {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return nil, nil
	}
	claim, err := b.Claims.PersistentVolumeClaims(ns).Get(name)
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	return claim, err
}

// DriverConn is the driver's controller proxy, or with node set (a
// node-local driver's volume) the proxy on that node.
func (b *Env) DriverConn(driver, node string) (grpc.ClientConnInterface, error) {
	if node != "" {
		return b.Cfg.Drivers.NodeConn(driver, node)
	}
	return b.Cfg.Drivers.ControllerConn(driver)
}

func ClaimRef(c *corev1.PersistentVolumeClaim) corev1.ObjectReference {
	return corev1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: c.Namespace, Name: c.Name, UID: c.UID, ResourceVersion: c.ResourceVersion}
}

func StatusText(err error) string {
	st := status.Convert(err)
	return fmt.Sprintf("rpc error: code = %s desc = %s", st.Code(), st.Message())
}

// ClaimStatusPatch is the strategic merge patch from old to cur, with
// old's resourceVersion as a precondition when checkRV is set; nil when
// cur changes nothing.
func ClaimStatusPatch(old, cur *corev1.PersistentVolumeClaim, checkRV bool) ([]byte, error) {
	rv := ""
	if checkRV {
		rv = old.ResourceVersion
	}
	return TwoWayPatch(old, cur, &corev1.PersistentVolumeClaim{}, rv)
}

// VARef is the object reference of an attachment, for Events.
func VARef(va *storagev1.VolumeAttachment) corev1.ObjectReference {
	return corev1.ObjectReference{Kind: "VolumeAttachment", APIVersion: "storage.k8s.io/v1", Name: va.Name, UID: va.UID, ResourceVersion: va.ResourceVersion}
}

// ClaimOfKey is the object of a claim's queue key (namespace/name), for
// TermQueue.ReportOn.
func (b *Env) ClaimOfKey(key string) (corev1.ObjectReference, bool) {
	c, err := b.CachedClaim(key)
	if c == nil || err != nil {
		return corev1.ObjectReference{}, false
	}
	return ClaimRef(c), true
}

// PVOfKey is the object of a PV's queue key (its name), for
// TermQueue.ReportOn.
func (b *Env) PVOfKey(name string) (corev1.ObjectReference, bool) {
	pv, err := b.Volumes.Get(name)
	if err != nil {
		return corev1.ObjectReference{}, false
	}
	return PVRef(pv), true
}

// VAOfKey is the object of an attachment's name, for TermQueue.ReportOn.
func (b *Env) VAOfKey(name string) (corev1.ObjectReference, bool) {
	va, err := b.Attachments.Get(name)
	if err != nil {
		return corev1.ObjectReference{}, false
	}
	return VARef(va), true
}

// TestHook calls Cfg.PanicHook, which only tests set, and only in a test
// binary (testing.Testing): a hook that panics there stands for a bug
// that one driver's handling hits.
func (b *Env) TestHook(controller, driver, key string) {
	if b.Cfg.PanicHook != nil && testing.Testing() {
		b.Cfg.PanicHook(controller, driver, key)
	}
}
