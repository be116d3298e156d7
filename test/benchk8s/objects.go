package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"sigs.k8s.io/yaml"
)

// brokerNamespace holds csibroker's intent record and leader Lease.
const brokerNamespace = "csibroker-bench"

// setupCluster creates what every scenario needs: the broker's namespace and,
// with --policy-mode enforce, the SecretGrant CRD the broker watches.
func (h *Harness) setupCluster(ctx context.Context) error {
	if err := h.createNamespace(ctx, brokerNamespace); err != nil {
		return err
	}
	if h.cfg.PolicyMode == "enforce" || h.cfg.PolicyMode == "audit" {
		if err := h.installCRD(ctx, filepath.Join(h.cfg.Root, "deploy/crds/policy.csibroker.io_secretgrants.yaml")); err != nil {
			return err
		}
	}
	return nil
}

func (h *Harness) installCRD(ctx context.Context, path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var obj map[string]any
	if err := yaml.Unmarshal(b, &obj); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	dc, err := dynamic.NewForConfig(h.env.RESTConfig())
	if err != nil {
		return err
	}
	gvr := schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
	u := &unstructured.Unstructured{Object: obj}
	if _, err := dc.Resource(gvr).Create(ctx, u, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("install CRD %s: %w", u.GetName(), err)
	}
	// Wait until it is established, so the broker's informer finds it.
	return pollUntil(ctx, 30*time.Second, "CRD "+u.GetName()+" established", func() (bool, error) {
		cur, err := dc.Resource(gvr).Get(ctx, u.GetName(), metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		conds, _, _ := unstructured.NestedSlice(cur.Object, "status", "conditions")
		for _, c := range conds {
			m, _ := c.(map[string]any)
			if m["type"] == "Established" && m["status"] == "True" {
				return true, nil
			}
		}
		return false, nil
	})
}

func (h *Harness) createNamespace(ctx context.Context, name string) error {
	_, err := h.client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create namespace %s: %w", name, err)
	}
	return nil
}

// deleteNamespace deletes a namespace without waiting.
func (h *Harness) deleteNamespace(ctx context.Context, name string) {
	_ = h.client.CoreV1().Namespaces().Delete(ctx, name, metav1.DeleteOptions{})
}

func (h *Harness) ensureStorageClass(ctx context.Context, name, driver string, reclaim corev1.PersistentVolumeReclaimPolicy) error {
	mode := storagev1.VolumeBindingImmediate
	_, err := h.client.StorageV1().StorageClasses().Create(ctx, &storagev1.StorageClass{
		ObjectMeta:        metav1.ObjectMeta{Name: name},
		Provisioner:       driver,
		ReclaimPolicy:     &reclaim,
		VolumeBindingMode: &mode,
	}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create StorageClass %s: %w", name, err)
	}
	return nil
}

func claim(ns, name, sc, volumeName string) *corev1.PersistentVolumeClaim {
	return &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			StorageClassName: &sc,
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
			VolumeName:       volumeName,
		},
	}
}

// parallel runs fn(i) for i in [from, to) on workers goroutines and returns
// the first error.
func parallel(ctx context.Context, from, to, workers int, fn func(ctx context.Context, i int) error) error {
	var next atomic.Int64
	next.Store(int64(from))
	var wg sync.WaitGroup
	var once sync.Once
	var first error
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for range workers {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= to || ctx.Err() != nil {
					return
				}
				if err := fn(ctx, i); err != nil {
					once.Do(func() { first = err; cancel() })
					return
				}
			}
		})
	}
	wg.Wait()
	return first
}

// createClaims creates n Immediate claims <prefix>-<i> of StorageClass sc.
func (h *Harness) createClaims(ctx context.Context, ns, prefix, sc string, n int) error {
	return parallel(ctx, 0, n, 16, func(ctx context.Context, i int) error {
		_, err := h.client.CoreV1().PersistentVolumeClaims(ns).Create(ctx, claim(ns, fmt.Sprintf("%s-%05d", prefix, i), sc, ""), metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create claim: %w", err)
		}
		return nil
	})
}

// deleteClaims deletes every claim in ns with one request. A request the
// API server times out or resets (thousands of claims: its handler's
// timeout ends the stream) may have deleted only some: the claims not
// being deleted yet are then deleted one by one, 32 at a time. The
// callers wait for the PVs to go.
func (h *Harness) deleteClaims(ctx context.Context, ns string) error {
	err := h.client.CoreV1().PersistentVolumeClaims(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
	if err == nil || ctx.Err() != nil {
		return err
	}
	h.logf("  deleting the claims in %s in one request: %v; deleting the rest one by one", ns, err)
	return h.deleteClaimsEach(ctx, ns)
}

// deleteClaimsEach deletes the claims in ns not being deleted yet one by
// one, 32 at a time: thousands of claims go in seconds, where one
// DeleteCollection request deletes them in sequence on the server and
// outlasts its handler's timeout.
func (h *Harness) deleteClaimsEach(ctx context.Context, ns string) error {
	list, err := h.client.CoreV1().PersistentVolumeClaims(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list the claims in %s to delete them: %w", ns, err)
	}
	var left []string
	for _, c := range list.Items {
		if c.DeletionTimestamp == nil {
			left = append(left, c.Name)
		}
	}
	return parallel(ctx, 0, len(left), 32, func(ctx context.Context, i int) error {
		err := h.client.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, left[i], metav1.DeleteOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		return err
	})
}

// createPrebound creates PV/PVC pairs [from, to) bound to each other, as a
// provisioner would have left them (reclaim Retain, so nothing deletes them).
func (h *Harness) createPrebound(ctx context.Context, ns, sc, driver string, from, to int) error {
	return parallel(ctx, from, to, 32, func(ctx context.Context, i int) error {
		pvName := fmt.Sprintf("pre-%06d", i)
		pvcName := fmt.Sprintf("pre-%06d", i)
		pv := &corev1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: pvName, Annotations: map[string]string{"pv.kubernetes.io/provisioned-by": driver}},
			Spec: corev1.PersistentVolumeSpec{
				Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
				AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
				StorageClassName:              sc,
				ClaimRef:                      &corev1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: ns, Name: pvcName},
				PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
					Driver: driver, VolumeHandle: pvName, FSType: "ext4",
					VolumeAttributes: map[string]string{"storage.kubernetes.io/csiProvisionerIdentity": "bench"},
				}},
			},
		}
		if _, err := h.client.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create PV %s: %w", pvName, err)
		}
		if _, err := h.client.CoreV1().PersistentVolumeClaims(ns).Create(ctx, claim(ns, pvcName, sc, pvName), metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create claim %s: %w", pvcName, err)
		}
		return nil
	})
}

// countBound counts Bound claims in ns (from the watch cache).
func (h *Harness) countBound(ctx context.Context, ns string) (bound, total int, err error) {
	l, err := h.client.CoreV1().PersistentVolumeClaims(ns).List(ctx, metav1.ListOptions{ResourceVersion: "0"})
	if err != nil {
		return 0, 0, err
	}
	for _, c := range l.Items {
		if c.Status.Phase == corev1.ClaimBound {
			bound++
		}
	}
	return bound, len(l.Items), nil
}

// removeVolumes deletes the claims of ns and the PVs bound to them, lifting
// finalizers that would keep a PV whose provisioner is gone.
func (h *Harness) removeVolumes(ctx context.Context, ns string) error {
	if err := h.deleteClaims(ctx, ns); err != nil {
		return err
	}
	pvs, err := h.client.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	var names []string
	for _, pv := range pvs.Items {
		if pv.Spec.ClaimRef != nil && pv.Spec.ClaimRef.Namespace == ns {
			names = append(names, pv.Name)
		}
	}
	err = parallel(ctx, 0, len(names), 16, func(ctx context.Context, i int) error {
		err := h.client.CoreV1().PersistentVolumes().Delete(ctx, names[i], metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			return err
		}
		return nil
	})
	if err != nil {
		return err
	}
	return pollUntil(ctx, 60*time.Second, "PVs of "+ns+" gone", func() (bool, error) {
		pvs, err := h.client.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		left := 0
		for _, pv := range pvs.Items {
			if pv.Spec.ClaimRef == nil || pv.Spec.ClaimRef.Namespace != ns {
				continue
			}
			left++
			if pv.DeletionTimestamp == nil {
				_ = h.client.CoreV1().PersistentVolumes().Delete(ctx, pv.Name, metav1.DeleteOptions{})
			} else if len(pv.Finalizers) > 0 && time.Since(pv.DeletionTimestamp.Time) > 5*time.Second {
				pv.Finalizers = nil
				_, _ = h.client.CoreV1().PersistentVolumes().Update(ctx, &pv, metav1.UpdateOptions{})
			}
		}
		return left == 0, nil
	})
}

// pollUntil calls cond every 250ms until it is true, fails, or timeout.
func pollUntil(ctx context.Context, timeout time.Duration, what string, cond func() (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		ok, err := cond()
		if err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: not done after %s", what, timeout)
		case <-time.After(250 * time.Millisecond):
		}
	}
}
