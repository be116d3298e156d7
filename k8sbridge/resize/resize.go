package resize

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/accessmodes"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"

	"github.com/csibroker/csibroker/internal/budget"
	"github.com/csibroker/csibroker/k8sbridge/csiparams"
	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/policy"
)

// Volume expansion, as external-resizer does it with the
// RecoverVolumeExpansionFailure semantics that are GA since Kubernetes 1.34:
//
//   - a bound claim whose request is above its status capacity, bound to a CSI
//     PV of a registered driver, is expanded: the claim is marked (condition
//     Resizing, allocatedResources = the size being expanded to,
//     allocatedResourceStatuses[storage] = ControllerResizeInProgress), then
//     ControllerExpandVolume is called with the PV's controller-expand secret
//     (through policy) and its volume capability, then the PV's capacity is
//     set to what the driver reports, then the claim is marked
//     NodeResizePending with condition FileSystemResizePending (the kubelet
//     finishes) or, when the driver needs no node step, finished (status
//     capacity set, resize conditions and status cleared);
//   - a final error (anything but Canceled, DeadlineExceeded, Unavailable,
//     ResourceExhausted, Aborted) is recorded as a ControllerResizeError
//     condition, and InvalidArgument, OutOfRange and NotFound mark the
//     expansion ControllerResizeInfeasible, so the user may lower the request
//     again; other errors leave it ControllerResizeInProgress (the driver may
//     still be working on it) and the same size is retried. Every failure is
//     logged and retried with the claim's backoff, and is a VolumeResizeFailed
//     Event with the driver's code and message, once per request: the same
//     failure again gets no new Event until the request changes, the
//     expansion succeeds or another term of leadership starts;
//   - a driver without the EXPAND_VOLUME controller capability whose plugin
//     answers NodeGetCapabilities with EXPAND_VOLUME is expanded on the node
//     only (external-resizer's trivial resizer): no CSI call, PV capacity set,
//     node expansion pending.
//
// API writes: three per expansion (claim status, PV capacity, claim status),
// as upstream, all claim writes through the status subresource; a failed
// expansion costs one (transient error) or two (final error). A status write
// that would change nothing is not sent, so retrying a failure of the same
// size costs no write at all (upstream sends its status patches on every
// retry, changed or not). Secrets, capabilities and the volume capability
// are settled before the claim is marked: a denied secret writes nothing.
//
// kube-controller-manager v1.36 does not expand CSI volumes: its expand
// controller only emits ExternalExpanding ("waiting for an external
// controller to expand this PVC"). For in-tree volumes migrated to CSI it
// writes the CSI driver's name into volume.kubernetes.io/storage-resizer;
// the broker enqueues a claim when that annotation changes and, when it
// names a registered driver that CSI migration moves the PV's in-tree
// source to, expands the volume through its CSI translation
// (k8s.io/csi-translation-lib, as external-resizer and attach do).

const (
	fsResizePendingMessage = "Waiting for user to (re-)start a pod to finish file system resize of volume on node."
)

// Controller expands the volumes of claims whose request grew.
type Controller struct {
	b   *kube.Env
	ops *prometheus.CounterVec
	// queue exists while this replica leads; claims seen before are found
	// again by run's initial listing.
	queue *kube.TermQueue
	// slots counts each driver's expansions in progress, against
	// PerDriverWorkers: one slow driver cannot take every worker.
	slots *kube.DriverSlots

	mu sync.Mutex
	// finalErr holds claims whose last ControllerExpandVolume ended with a
	// final error: nothing is in progress, so a changed request may be used.
	finalErr map[types.UID]bool
	// inUse holds claims whose driver refused ControllerExpandVolume with
	// FailedPrecondition while their volume was attached (a driver that
	// expands offline only): the driver is not asked again until the
	// volume's attachments are gone, which enqueues the claim.
	inUse    map[types.UID]inUseClaim
	nodeCaps map[string]resizeNodeCaps
}

// inUseClaim is a claim waiting for its volume to be detached.
type inUseClaim struct{ key, pv string }

// resizeNodeCaps caches whether a driver without controller expansion can
// expand on the node.
type resizeNodeCaps struct {
	expand  bool
	fetched time.Time
}

func New(b *kube.Env) (*Controller, error) {
	r := &Controller{b: b, queue: b.NewTermQueue("resize"),
		finalErr: map[types.UID]bool{}, inUse: map[types.UID]inUseClaim{}, nodeCaps: map[string]resizeNodeCaps{}}
	r.slots = r.queue.WithSlots(b.Cfg.PerDriverWorkers)
	r.queue.ReportOn(b.ClaimOfKey)
	ops, err := kube.OperationsCounter(b.Cfg.Registerer, "resize_operations_total",
		"Volume expansion attempts by driver and result (success, node_pending, infeasible, failed, in_progress, in_use, not_called).")
	if err != nil {
		return nil, err
	}
	r.ops = ops
	b.Metrics.QueueDepth("resize", r.queue.Len)
	// An attachment gone: a claim waiting for its volume's detach is
	// looked at again.
	b.On(b.Factory.Storage().V1().VolumeAttachments().Informer(), cache.ResourceEventHandlerFuncs{
		DeleteFunc: func(obj any) {
			if va, ok := kube.Deleted[*storagev1.VolumeAttachment](obj); ok {
				r.volumeDetached(va)
			}
		},
	})
	b.On(b.Factory.Core().V1().PersistentVolumeClaims().Informer(), cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			if c, ok := obj.(*corev1.PersistentVolumeClaim); ok && claimNeedsResize(c) {
				r.enqueue(c)
			}
		},
		UpdateFunc: func(oldObj, newObj any) {
			old, ok1 := oldObj.(*corev1.PersistentVolumeClaim)
			cur, ok2 := newObj.(*corev1.PersistentVolumeClaim)
			if ok1 && ok2 && resizeTriggered(old, cur) {
				r.enqueue(cur)
			}
		},
		DeleteFunc: func(obj any) {
			c, ok := kube.Deleted[*corev1.PersistentVolumeClaim](obj)
			if !ok {
				return
			}
			r.mu.Lock()
			delete(r.finalErr, c.UID)
			delete(r.inUse, c.UID)
			r.mu.Unlock()
			b.ForgetEvents(c.UID)
			if key, err := cache.MetaNamespaceKeyFunc(c); err == nil {
				r.queue.Forget(key)
			}
		},
	})
	return r, nil
}

// claimNeedsResize: a bound claim asks for more than it has.
func claimNeedsResize(c *corev1.PersistentVolumeClaim) bool {
	if c.Status.Phase != corev1.ClaimBound || c.Spec.VolumeName == "" {
		return false
	}
	req := c.Spec.Resources.Requests[corev1.ResourceStorage]
	capacity := c.Status.Capacity[corev1.ResourceStorage]
	return req.Cmp(capacity) > 0
}

// resizeTriggered says whether an update is worth a look: the request or
// the storage-resizer annotation changed, the claim got bound, its
// capacity changed (the kubelet finished a node expansion: a request raised
// meanwhile can go on now), or the informer resynced. The resizer's own
// status writes change none of these but the capacity an expansion ends
// with, after which only a request raised meanwhile brings the claim back.
func resizeTriggered(old, cur *corev1.PersistentVolumeClaim) bool {
	if !claimNeedsResize(cur) {
		return false
	}
	oldReq, curReq := old.Spec.Resources.Requests[corev1.ResourceStorage], cur.Spec.Resources.Requests[corev1.ResourceStorage]
	oldCap, curCap := old.Status.Capacity[corev1.ResourceStorage], cur.Status.Capacity[corev1.ResourceStorage]
	return old.ResourceVersion == cur.ResourceVersion ||
		oldReq.Cmp(curReq) != 0 ||
		oldCap.Cmp(curCap) != 0 ||
		old.Annotations[kube.AnnStorageResizer] != cur.Annotations[kube.AnnStorageResizer] ||
		old.Status.Phase != cur.Status.Phase ||
		old.Spec.VolumeName != cur.Spec.VolumeName
}

// volumeDetached enqueues the claims waiting for va's volume to be
// detached (va is gone).
func (r *Controller) volumeDetached(va *storagev1.VolumeAttachment) {
	pv := va.Spec.Source.PersistentVolumeName
	if pv == nil {
		return
	}
	r.mu.Lock()
	var keys []string
	for _, w := range r.inUse {
		if w.pv == *pv {
			keys = append(keys, w.key)
		}
	}
	r.mu.Unlock()
	for _, k := range keys {
		r.queue.Add(k)
	}
}

// attachedTo names the node of a VolumeAttachment of pv, "" when there is
// none (the rule deletion keeps to: attachmentOf).
func (r *Controller) attachedTo(pv string) string {
	if va, err := r.b.AttachmentOf(pv); err == nil && va != nil {
		return va.Spec.NodeName
	}
	return ""
}

func (r *Controller) enqueue(c *corev1.PersistentVolumeClaim) {
	if key, err := cache.MetaNamespaceKeyFunc(c); err == nil {
		r.queue.Add(key)
	}
}

// EnqueueAll adds every claim asking for more than it has (start of a
// term, a driver registered: its claims were dropped while it was unknown).
func (r *Controller) EnqueueAll() {
	if claims, err := r.b.Claims.List(labels.Everything()); err == nil {
		for _, c := range claims {
			if claimNeedsResize(c) {
				r.enqueue(c)
			}
		}
	}
}

// run expands claims while this replica leads. Each term of leadership has
// its own queue, so a replica that leads again starts afresh.
func (r *Controller) Run(ctx context.Context) {
	r.mu.Lock()
	// Final errors are of this term: under another leader the driver may
	// have been asked again, and may still be working, since.
	clear(r.finalErr)
	clear(r.inUse)
	r.mu.Unlock()
	// Requests raised while another replica led are in the cache already.
	r.queue.Work(ctx, r.b.Cfg.WorkerThreads, r.EnqueueAll, func(ctx context.Context, key string) (time.Duration, error) {
		requeue, err := r.sync(ctx, key)
		if err != nil {
			r.b.Log.Debug("resize will be retried", "claim", key, "err", err)
		}
		return requeue, err
	})
}

// sync expands one claim if it needs it. An error retries with backoff; a
// positive duration looks at the claim again then (its driver is busy).
func (r *Controller) sync(ctx context.Context, key string) (time.Duration, error) {
	claim, err := r.b.CachedClaim(key)
	if claim == nil || err != nil {
		return 0, err
	}
	ns, name := claim.Namespace, claim.Name
	if !claimNeedsResize(claim) || claim.DeletionTimestamp != nil {
		return 0, nil
	}
	pv, err := r.b.Volumes.Get(claim.Spec.VolumeName)
	if err != nil {
		// Bound to a PV the cache has not seen (yet): look again later.
		return 0, fmt.Errorf("claim %s: volume %s: %w", key, claim.Spec.VolumeName, err)
	}
	if cr := pv.Spec.ClaimRef; cr == nil || cr.Namespace != claim.Namespace || cr.UID != claim.UID {
		return 0, nil
	}
	var driver string
	spec := &pv.Spec // with the CSI source the driver is asked about
	switch Controller := claim.Annotations[kube.AnnStorageResizer]; {
	case pv.Spec.CSI != nil:
		if !r.b.Registered(pv.Spec.CSI.Driver) {
			return 0, nil
		}
		driver = pv.Spec.CSI.Driver
	case r.b.Registered(Controller):
		// An in-tree volume CSI migration moved to a registered driver
		// (kube-controller-manager names it in kube.AnnStorageResizer): it is
		// expanded through its CSI translation, as external-resizer does,
		// and only by the driver the translation names.
		if to := kube.PVDriver(pv); to != Controller {
			r.warn(ctx, claim, "", "claim's %s annotation names driver %s, but volume %s is not an in-tree volume CSI migration moves to it (it moves to %q); not expanded",
				kube.AnnStorageResizer, Controller, pv.Name, to)
			return 0, nil
		}
		t, err := kube.CSISpec(pv)
		if err != nil {
			r.warn(ctx, claim, "", "resize volume %q by resizer %q failed: %v", pv.Name, Controller, err)
			return 0, nil
		}
		driver, spec = Controller, t
	default:
		return 0, nil
	}

	// Whether there is anything to do now does not depend on the
	// driver's capabilities (only the size to expand to may): a claim
	// waiting for the kubelet asks the driver nothing.
	r.mu.Lock()
	lastFinal := r.finalErr[claim.UID]
	w, waiting := r.inUse[claim.UID]
	r.mu.Unlock()
	if waiting {
		if node := r.attachedTo(w.pv); node != "" && w.pv == pv.Name {
			r.b.Log.Debug("volume expansion waits for the volume to be detached", "claim", key, "pv", pv.Name, "node", node)
			return 0, nil
		}
		r.mu.Lock()
		delete(r.inUse, claim.UID)
		r.mu.Unlock()
	}
	if _, ok := expansionTarget(expansionInputOf(claim, pv, lastFinal, true)); !ok {
		r.b.Log.Debug("volume expansion: nothing for the driver now; the kubelet has the next step", "claim", key, "driver", driver)
		return 0, nil
	}
	// --per-driver-workers: one slow or unreachable driver cannot take
	// every worker, its capability lookups included.
	if !r.slots.Acquire(driver, key) {
		return kube.WaitForSlot, nil
	}
	defer r.slots.Release(driver)
	ctx = budget.WithDriver(ctx, driver) // its writes wait in turn with other drivers'

	caps, err := r.b.Caps.Get(ctx, driver)
	if err != nil {
		r.b.Caps.Forget(driver)
		r.warn(ctx, claim, kube.FailureOf("ControllerExpandVolume", drivers.NewUnreachable(err)), "resize volume %q by resizer %q failed: driver is not reachable: %v", pv.Name, driver, err)
		r.b.Log.Warn("volume expansion: driver not reachable; will retry", "claim", key, "pv", pv.Name, "driver", driver, "err", err)
		return 0, err
	}
	controllerExpand := caps.Expand
	if !controllerExpand {
		nodeOnly, err := r.nodeExpansion(ctx, driver)
		if err != nil {
			r.warn(ctx, claim, "", "resize volume %q by resizer %q failed: %v", pv.Name, driver, err)
			r.b.Log.Warn("volume expansion: cannot learn whether the driver expands on the node; will retry", "claim", key, "pv", pv.Name, "driver", driver, "err", err)
			return 0, err
		}
		if !nodeOnly {
			r.warn(ctx, claim, "",
				"driver %s supports neither controller nor node volume expansion (no EXPAND_VOLUME capability); volume %s cannot be expanded", driver, pv.Name)
			return 0, nil
		}
	}

	target, ok := expansionTarget(expansionInputOf(claim, pv, lastFinal, controllerExpand))
	if !ok {
		return 0, nil
	}

	ctx, span := r.b.Tracer.Start(ctx, "resize "+key, trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(
		attribute.String("csi.driver", driver), attribute.String("k8s.pvc.namespace", ns), attribute.String("k8s.pvc.name", name),
		attribute.String("k8s.pv.name", pv.Name), attribute.String("k8s.pvc.expand_to", target.String())))
	defer span.End()
	result, err := r.expand(ctx, claim, pv, spec, driver, caps, controllerExpand, target)
	r.ops.WithLabelValues(driver, result).Inc()
	if err != nil {
		span.SetStatus(otelcodes.Error, result)
		return 0, err
	}
	// Done (or over to the kubelet): a failure or a new attempt after
	// this one is news.
	r.b.ForgetEvents(claim.UID)
	return 0, nil
}

// expand runs one expansion attempt and returns its result label. spec is
// pv's spec with its CSI source (for a migrated in-tree volume, the
// translation's); the PV itself is what gets the new capacity.
func (r *Controller) expand(ctx context.Context, claim *corev1.PersistentVolumeClaim, pv *corev1.PersistentVolume, spec *corev1.PersistentVolumeSpec, driver string, caps drivers.Caps, controllerExpand bool, target resource.Quantity) (string, error) {
	key := claim.Namespace + "/" + claim.Name
	failed := func(result string, err error) (string, error) {
		if ctx.Err() != nil {
			return result, err // the term ended: the next leader takes the claim up
		}
		if apierrors.IsConflict(err) {
			// A newer claim is on its way (its owner raised the request
			// again, say): retried with it, quietly. After a successful
			// ControllerExpandVolume the retry asks the driver again,
			// which expansion's idempotence allows.
			return result, err
		}
		r.warn(ctx, claim, "", "resize volume %q by resizer %q failed: %v", pv.Name, driver, err)
		r.b.Log.Warn("volume expansion failed", "claim", key, "pv", pv.Name, "driver", driver, "err", err)
		return result, err
	}

	// Everything that can fail before the driver is asked fails before the
	// claim is marked: nothing is in progress, so nothing is written.
	if err := csiparams.FitsCSISize(target); err != nil {
		return failed("not_called", err)
	}
	var req *csi.ControllerExpandVolumeRequest
	var conn grpc.ClientConnInterface
	node := r.expandNode(driver, pv) // the node-local volume's node; "" otherwise
	if controllerExpand {
		if r.b.Cfg.Drivers.NodeLocal(driver) && node == "" {
			return failed("not_called", kube.ErrNodeUnknown(pv, driver))
		}
		// A proxy that is not known (a node's gone) fails here, before
		// the claim says an expansion is in progress.
		var err error
		if node != "" {
			conn, err = r.b.Cfg.Drivers.NodeConn(driver, node)
		} else {
			conn, err = r.b.Cfg.Drivers.ControllerConn(driver)
		}
		if err != nil {
			return failed("not_called", err)
		}
		volCap, err := resizeVolumeCapability(*spec, caps.SingleNodeMultiWriter)
		if err != nil {
			return failed("not_called", err)
		}
		secrets, err := r.b.FetchSecret(ctx, kube.SecretUse{
			Driver: driver, Op: policy.OpControllerExpandVolume, Ref: spec.CSI.ControllerExpandSecretRef,
			Source: policy.Source{Kind: policy.SourcePVField, Key: "spec.csi.controllerExpandSecretRef"},
			Requester: policy.Requester{Kind: policy.KindPersistentVolumeClaim, Namespace: claim.Namespace, Name: claim.Name,
				Labels: claim.Labels, StorageClass: pv.Spec.StorageClassName, Node: node},
		})
		if err != nil {
			return failed("not_called", err)
		}
		req = &csi.ControllerExpandVolumeRequest{VolumeId: spec.CSI.VolumeHandle, CapacityRange: &csi.CapacityRange{RequiredBytes: target.Value()},
			Secrets: secrets, VolumeCapability: volCap}
	}

	claim, err := r.b.PatchClaimStatus(ctx, claim, resizeInProgress(claim, target), true)
	if err != nil {
		return failed("not_called", fmt.Errorf("mark claim %s resizing: %w", key, err)) // RBAC, a webhook: said on the claim
	}
	// Once per request, as its failure: a retried attempt is no news.
	r.b.EventOnce(ctx, kube.ClaimRef(claim), corev1.EventTypeNormal, "Resizing", requestOf(claim), "External resizer is resizing volume %s", pv.Name)

	newSize, nodeRequired := target, true
	if req != nil {
		callCtx, cancel := r.b.CallContext(ctx, driver, "ControllerExpandVolume")
		resp, err := csi.NewControllerClient(conn).ControllerExpandVolume(callCtx, req)
		cancel()
		if err != nil {
			return r.driverFailed(ctx, claim, pv, driver, err)
		}
		if n := resp.GetCapacityBytes(); n > 0 {
			newSize = *resource.NewQuantity(n, resource.BinarySI)
		}
		nodeRequired = resp.GetNodeExpansionRequired()
	}
	r.mu.Lock()
	delete(r.finalErr, claim.UID)
	r.mu.Unlock()

	if cur := pv.Spec.Capacity[corev1.ResourceStorage]; cur.Cmp(newSize) != 0 {
		patch, err := json.Marshal(map[string]any{"spec": map[string]any{"capacity": map[string]string{string(corev1.ResourceStorage): newSize.String()}}})
		if err != nil {
			return failed("failed", err)
		}
		if _, err := r.b.Cfg.Client.CoreV1().PersistentVolumes().Patch(ctx, pv.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			return failed("failed", fmt.Errorf("update capacity of pv %s to %s: %w", pv.Name, newSize.String(), err))
		}
	}
	if nodeRequired {
		if _, err := r.b.PatchClaimStatus(ctx, claim, resizeNodePending(claim), true); err != nil {
			return failed("failed", fmt.Errorf("mark claim %s as waiting for node expansion: %w", key, err))
		}
		r.b.Event(ctx, kube.ClaimRef(claim), corev1.EventTypeNormal, "FileSystemResizeRequired", "Require file system resize of volume on node")
		r.b.Log.Info("volume expanded; node expansion pending", "claim", key, "pv", pv.Name, "driver", driver, "size", newSize.String())
		return "node_pending", nil
	}
	if _, err := r.b.PatchClaimStatus(ctx, claim, resizeFinished(claim, newSize), true); err != nil {
		return failed("failed", fmt.Errorf("mark claim %s resized: %w", key, err))
	}
	r.b.Event(ctx, kube.ClaimRef(claim), corev1.EventTypeNormal, "VolumeResizeSuccessful", "Resize volume succeeded")
	r.b.Log.Info("volume expanded", "claim", key, "pv", pv.Name, "driver", driver, "size", newSize.String())
	return "success", nil
}

// warn records a VolumeResizeFailed Event on claim once per request and
// failure (eventOnce). failure names the failure: for a driver's answer its
// method and code, since drivers put what changes on every call (a request
// ID, an attempt counter) into their messages; "" for the message itself.
func (r *Controller) warn(ctx context.Context, claim *corev1.PersistentVolumeClaim, failure, format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	if failure == "" {
		failure = msg
	}
	r.b.EventOnce(ctx, kube.ClaimRef(claim), corev1.EventTypeWarning, "VolumeResizeFailed", requestOf(claim)+" "+failure, "%s", msg)
}

// requestOf is the claim's storage request in bytes, the same however it
// is written (2Gi, 2048Mi).
func requestOf(claim *corev1.PersistentVolumeClaim) string {
	q := claim.Spec.Resources.Requests[corev1.ResourceStorage]
	return strconv.FormatInt(q.Value(), 10)
}

// driverFailed records a ControllerExpandVolume error on the claim.
func (r *Controller) driverFailed(ctx context.Context, claim *corev1.PersistentVolumeClaim, pv *corev1.PersistentVolume, driver string, err error) (string, error) {
	if ctx.Err() != nil {
		// The term ended during the call: nothing is recorded here; the
		// next leader looks at the claim again.
		return "in_progress", fmt.Errorf("resize volume %s: %w", pv.Name, err)
	}
	code := status.Code(err)
	_, isStatus := status.FromError(err)
	final := isStatus && resizeFinalError(code)
	r.mu.Lock()
	if final {
		r.finalErr[claim.UID] = true
	} else {
		delete(r.finalErr, claim.UID)
	}
	r.mu.Unlock()
	msg := kube.StatusText(err)
	if code == codes.FailedPrecondition && isStatus {
		if node := r.attachedTo(pv.Name); node != "" {
			// external-resizer's --handle-volume-inuse-error: a driver that
			// expands offline only is not asked again while the volume is
			// in use; its detach brings the claim back.
			r.mu.Lock()
			r.inUse[claim.UID] = inUseClaim{key: claim.Namespace + "/" + claim.Name, pv: pv.Name}
			r.mu.Unlock()
			if r.attachedTo(pv.Name) == "" {
				// Detached between the check and the record: its
				// deletion found no claim waiting.
				r.queue.Add(claim.Namespace + "/" + claim.Name)
			}
			if _, perr := r.b.PatchClaimStatus(ctx, claim, resizeControllerFailed(claim, code, "failed to expand pvc with "+msg, false), false); perr != nil {
				r.b.Log.Warn("recording an expansion failure on the claim failed", "claim", claim.Namespace+"/"+claim.Name, "err", perr)
			}
			r.warn(ctx, claim, "ControllerExpandVolume in use",
				"Unable to expand volume %s: CSI driver %s refused while the volume is attached to node %s (%s); it will be expanded once the volume is detached", pv.Name, driver, node, msg)
			r.b.Log.Warn("ControllerExpandVolume refused while the volume is in use; waiting for it to be detached", "claim", claim.Namespace+"/"+claim.Name, "pv", pv.Name, "driver", driver, "node", node, "err", msg)
			return "in_use", nil
		}
	}
	result := "in_progress"
	if final {
		result = "failed"
		infeasible := resizeInfeasible(code)
		if infeasible {
			result = "infeasible"
		}
		// No resourceVersion precondition: the failure must be recorded
		// even if our copy of the claim is a little old.
		if _, perr := r.b.PatchClaimStatus(ctx, claim, resizeControllerFailed(claim, code, "failed to expand pvc with "+msg, infeasible), false); perr != nil {
			r.b.Log.Warn("recording an expansion failure on the claim failed", "claim", claim.Namespace+"/"+claim.Name, "err", perr)
		}
	}
	failure := "" // not the driver's answer: the message names it
	if isStatus {
		failure = "ControllerExpandVolume " + code.String()
	}
	r.warn(ctx, claim, failure, "resize volume %q by resizer %q failed: %s", pv.Name, driver, msg)
	// The Event may not be recorded again: the log has every answer.
	r.b.Log.Warn("ControllerExpandVolume failed", "claim", claim.Namespace+"/"+claim.Name, "pv", pv.Name, "driver", driver, "code", code.String(), "final", final, "err", msg)
	return result, fmt.Errorf("resize volume %s: %w", pv.Name, err)
}

// resizeFinalError: the operation failed and is not going on in the driver
// (the codes external-resizer treats as "may still be in progress" are not).
func resizeFinalError(c codes.Code) bool {
	switch c {
	case codes.Canceled, codes.DeadlineExceeded, codes.Unavailable, codes.ResourceExhausted, codes.Aborted:
		return false
	}
	return true
}

// resizeInfeasible: the driver cannot expand to this size at all; the
// claim is marked ControllerResizeInfeasible and the user may lower the
// request.
func resizeInfeasible(c codes.Code) bool {
	return c == codes.InvalidArgument || c == codes.OutOfRange || c == codes.NotFound
}

// nodeExpansion asks a driver without controller expansion whether its
// plugin expands on the node (NodeGetCapabilities on the controller's
// socket, as external-resizer does).
func (r *Controller) nodeExpansion(ctx context.Context, driver string) (bool, error) {
	r.mu.Lock()
	c, ok := r.nodeCaps[driver]
	r.mu.Unlock()
	if ok && time.Since(c.fetched) < time.Minute {
		return c.expand, nil
	}
	conn, err := r.b.Cfg.Drivers.ControllerConn(driver)
	if err != nil {
		return false, err
	}
	ctx, cancel := r.b.CallContext(ctx, driver, "NodeGetCapabilities")
	defer cancel()
	resp, err := csi.NewNodeClient(conn).NodeGetCapabilities(ctx, &csi.NodeGetCapabilitiesRequest{})
	switch {
	case status.Code(err) == codes.Unimplemented:
	case err != nil:
		return false, fmt.Errorf("driver %s: NodeGetCapabilities: %s", driver, kube.StatusText(err))
	}
	c = resizeNodeCaps{fetched: time.Now()}
	for _, cp := range resp.GetCapabilities() {
		if cp.GetRpc().GetType() == csi.NodeServiceCapability_RPC_EXPAND_VOLUME {
			c.expand = true
		}
	}
	r.mu.Lock()
	r.nodeCaps[driver] = c
	r.mu.Unlock()
	return c.expand, nil
}

// resizeVolumeCapability is the one capability ControllerExpandVolume gets,
// from the PV: block or mount (fsType, mount options), and the access mode
// the PV's modes map to (csi-lib-utils' mapping, as external-resizer).
func resizeVolumeCapability(spec corev1.PersistentVolumeSpec, singleNodeMultiWriter bool) (*csi.VolumeCapability, error) {
	if spec.CSI == nil {
		return nil, errors.New("not a CSI volume")
	}
	mode, err := accessmodes.ToCSIAccessMode(spec.AccessModes, singleNodeMultiWriter)
	if err != nil {
		return nil, fmt.Errorf("volume capability: %w", err)
	}
	c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
	if csiparams.VolumeMode(spec.VolumeMode) == corev1.PersistentVolumeBlock {
		c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	} else {
		c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: spec.CSI.FSType, MountFlags: spec.MountOptions}}
	}
	return c, nil
}

// expansionInput is what decides the size to expand to.
type expansionInput struct {
	Request, PVCapacity resource.Quantity
	// Allocated is status.allocatedResources[storage], nil when unset.
	Allocated *resource.Quantity
	// ResizeStatus is status.allocatedResourceStatuses[storage].
	ResizeStatus    corev1.ClaimResourceStatus
	FSResizePending bool
	// LastErrorFinal: this replica's last ControllerExpandVolume for the
	// claim ended with a final error, so nothing is in progress.
	LastErrorFinal bool
	// ControllerExpansion: the driver expands on the controller.
	ControllerExpansion bool
}

func expansionInputOf(claim *corev1.PersistentVolumeClaim, pv *corev1.PersistentVolume, lastFinal, controllerExpansion bool) expansionInput {
	in := expansionInput{
		Request:             claim.Spec.Resources.Requests[corev1.ResourceStorage],
		PVCapacity:          pv.Spec.Capacity[corev1.ResourceStorage],
		ResizeStatus:        claim.Status.AllocatedResourceStatuses[corev1.ResourceStorage],
		LastErrorFinal:      lastFinal,
		ControllerExpansion: controllerExpansion,
	}
	if q, ok := claim.Status.AllocatedResources[corev1.ResourceStorage]; ok {
		in.Allocated = &q
	}
	for _, c := range claim.Status.Conditions {
		if c.Type == corev1.PersistentVolumeClaimFileSystemResizePending && c.Status == corev1.ConditionTrue {
			in.FSResizePending = true
		}
	}
	return in
}

// expansionTarget is the size to expand a claim's volume to, with the
// recovery rules of external-resizer (KEP-1790): an expansion that may still
// be going on (controller in progress after an uncertain error, node
// expansion pending) is finished at the size it started with; an
// infeasible one, or one that ended with a final error, takes the current
// request, which the user may have lowered. ok is false when there is
// nothing to do now (the kubelet has the next step).
func expansionTarget(in expansionInput) (size resource.Quantity, ok bool) {
	allocatedOr := func(q resource.Quantity) resource.Quantity {
		if in.Allocated != nil {
			return *in.Allocated
		}
		return q
	}
	if in.PVCapacity.Cmp(in.Request) < 0 {
		switch in.ResizeStatus {
		case corev1.PersistentVolumeClaimNodeResizeInfeasible:
			return allocatedOr(in.Request), true
		case corev1.PersistentVolumeClaimNodeResizePending, corev1.PersistentVolumeClaimNodeResizeInProgress:
			size = allocatedOr(in.Request)
			// The volume already has that size: let the node finish first.
			return size, in.PVCapacity.Cmp(size) < 0
		case corev1.PersistentVolumeClaimControllerResizeInProgress:
			if in.LastErrorFinal {
				return in.Request, true
			}
			return allocatedOr(in.Request), true
		default:
			return in.Request, true
		}
	}
	// The PV is as large as requested already: finish recording an
	// expansion that was done, or restart the node step.
	switch in.ResizeStatus {
	case corev1.PersistentVolumeClaimNodeResizePending, corev1.PersistentVolumeClaimNodeResizeInProgress:
		return resource.Quantity{}, false
	case corev1.PersistentVolumeClaimNodeResizeInfeasible:
		if in.ControllerExpansion {
			return allocatedOr(in.Request), true
		}
		return in.Request, true
	case corev1.PersistentVolumeClaimControllerResizeInProgress, corev1.PersistentVolumeClaimControllerResizeInfeasible:
		return allocatedOr(in.Request), true
	}
	if in.ResizeStatus == "" && in.Allocated != nil {
		return *in.Allocated, true
	}
	if in.FSResizePending {
		return resource.Quantity{}, false
	}
	return in.Request, true
}

// The claim status steps. Each returns a modified copy; none writes.

func IsCondition(t corev1.PersistentVolumeClaimConditionType) bool {
	switch t {
	case corev1.PersistentVolumeClaimResizing, corev1.PersistentVolumeClaimFileSystemResizePending,
		corev1.PersistentVolumeClaimControllerResizeError, corev1.PersistentVolumeClaimNodeResizeError:
		return true
	}
	return false
}

// mergeResizeConditions sets the resize conditions in want and keeps the
// other resize conditions for which keep says so (non-resize conditions are
// always kept). A condition already present with the same status and
// reason is kept as it is (transition time and message), so repeating a
// step changes nothing (a driver's message that differs only by a request
// number costs no write); with another reason (a failure's gRPC code) it
// takes the new message and reason and keeps its transition time, so the
// claim says what failed last.
func mergeResizeConditions(conds []corev1.PersistentVolumeClaimCondition, want []corev1.PersistentVolumeClaimCondition, keep func(corev1.PersistentVolumeClaimConditionType) bool) []corev1.PersistentVolumeClaimCondition {
	return kube.MergeConditions(conds, want, IsCondition, keep)
}

func resizeCondition(t corev1.PersistentVolumeClaimConditionType, msg string) corev1.PersistentVolumeClaimCondition {
	return corev1.PersistentVolumeClaimCondition{Type: t, Status: corev1.ConditionTrue, LastTransitionTime: metav1.Now(), Message: msg}
}

func setResizeStatus(c *corev1.PersistentVolumeClaim, s corev1.ClaimResourceStatus) {
	if c.Status.AllocatedResourceStatuses == nil {
		c.Status.AllocatedResourceStatuses = map[corev1.ResourceName]corev1.ClaimResourceStatus{}
	}
	c.Status.AllocatedResourceStatuses[corev1.ResourceStorage] = s
}

// resizeInProgress marks an expansion to size as started. Retrying the same
// size keeps the recorded status and conditions (an infeasible expansion
// stays infeasible until the driver says otherwise).
func resizeInProgress(claim *corev1.PersistentVolumeClaim, size resource.Quantity) *corev1.PersistentVolumeClaim {
	c := claim.DeepCopy()
	same := false
	if q, ok := c.Status.AllocatedResources[corev1.ResourceStorage]; ok && q.Cmp(size) == 0 {
		same = true
	}
	want := []corev1.PersistentVolumeClaimCondition{resizeCondition(corev1.PersistentVolumeClaimResizing, "")}
	if same {
		c.Status.Conditions = mergeResizeConditions(c.Status.Conditions, want, kube.KeepAll)
	} else {
		c.Status.Conditions = mergeResizeConditions(c.Status.Conditions, want, nil)
		setResizeStatus(c, corev1.PersistentVolumeClaimControllerResizeInProgress)
		if c.Status.AllocatedResources == nil {
			c.Status.AllocatedResources = corev1.ResourceList{}
		}
		c.Status.AllocatedResources[corev1.ResourceStorage] = size
	}
	delete(c.Annotations, kube.AnnNodeExpansionNotRequired)
	return c
}

// resizeNodePending: the controller part is done, the kubelet expands the
// file system (Resizing stays, as upstream; a controller error is over).
func resizeNodePending(claim *corev1.PersistentVolumeClaim) *corev1.PersistentVolumeClaim {
	c := claim.DeepCopy()
	c.Status.Conditions = mergeResizeConditions(c.Status.Conditions,
		[]corev1.PersistentVolumeClaimCondition{resizeCondition(corev1.PersistentVolumeClaimFileSystemResizePending, fsResizePendingMessage)},
		func(t corev1.PersistentVolumeClaimConditionType) bool {
			return t != corev1.PersistentVolumeClaimControllerResizeError
		})
	setResizeStatus(c, corev1.PersistentVolumeClaimNodeResizePending)
	delete(c.Annotations, kube.AnnNodeExpansionNotRequired)
	return c
}

// resizeFinished: the expansion is complete without a node step.
func resizeFinished(claim *corev1.PersistentVolumeClaim, size resource.Quantity) *corev1.PersistentVolumeClaim {
	c := claim.DeepCopy()
	if c.Status.Capacity == nil {
		c.Status.Capacity = corev1.ResourceList{}
	}
	c.Status.Capacity[corev1.ResourceStorage] = size
	c.Status.Conditions = mergeResizeConditions(c.Status.Conditions, nil, nil)
	delete(c.Status.AllocatedResourceStatuses, corev1.ResourceStorage)
	if len(c.Status.AllocatedResourceStatuses) == 0 {
		c.Status.AllocatedResourceStatuses = nil
	}
	if c.Annotations == nil {
		c.Annotations = map[string]string{}
	}
	c.Annotations[kube.AnnNodeExpansionNotRequired] = "true"
	return c
}

// resizeControllerFailed records a final ControllerExpandVolume error.
func resizeControllerFailed(claim *corev1.PersistentVolumeClaim, code codes.Code, msg string, infeasible bool) *corev1.PersistentVolumeClaim {
	c := claim.DeepCopy()
	cond := resizeCondition(corev1.PersistentVolumeClaimControllerResizeError, msg)
	cond.Reason = code.String()
	c.Status.Conditions = mergeResizeConditions(c.Status.Conditions, []corev1.PersistentVolumeClaimCondition{cond}, kube.KeepAll)
	if infeasible {
		setResizeStatus(c, corev1.PersistentVolumeClaimControllerResizeInfeasible)
	}
	return c
}

// expandNode is the node whose proxy receives a volume's expansion: its
// own for a node-local driver's volume, none (the controller's) otherwise.
func (r *Controller) expandNode(driver string, pv *corev1.PersistentVolume) string {
	if !r.b.Cfg.Drivers.NodeLocal(driver) {
		return ""
	}
	return r.b.NodeOfPV(pv)
}

// QueueLen is how many claims wait in this term's queue, a driver's line
// included.
func (r *Controller) QueueLen() int { return r.queue.Len() }
