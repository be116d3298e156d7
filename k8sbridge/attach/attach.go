package attach

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/accessmodes"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
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

// ReconcileInterval is how often attached volumes are checked against
// the driver's ListVolumes published nodes (drivers that report them).
var ReconcileInterval = 5 * time.Minute

// Controller is external-attacher for every registered driver: it publishes
// volumes to nodes for VolumeAttachments and unpublishes them on deletion.
type Controller struct {
	b     *kube.Env
	queue *kube.TermQueue
	slots *kube.DriverSlots // attachments and detachments in progress per driver (PerDriverWorkers)

	// force holds the attachments the reconcile found not published:
	// their next sync publishes again although their status says attached.
	mu    sync.Mutex
	force map[string]bool
	// marked holds, per attachment this term marked attached, the
	// versions it had before (see staleUnattached).
	marked map[string][2]string
}

// noteMarked remembers that this term marked attachment name attached,
// over versions before (as the cache had it) and written (after the
// finalizer write, if there was one).
func (a *Controller) noteMarked(name, before, written string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.marked == nil {
		a.marked = map[string][2]string{}
	}
	a.marked[name] = [2]string{before, written}
}

// staleUnattached reports whether va, as the cache has it, is a version
// from before this term marked it attached: the watch event of the status
// write has not arrived yet, and publishing again would only repeat the
// call (the event queues the attachment again anyway). Any other version
// drops what was remembered.
func (a *Controller) staleUnattached(va *storagev1.VolumeAttachment) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	m, ok := a.marked[va.Name]
	if !ok {
		return false
	}
	if !va.Status.Attached && va.DeletionTimestamp == nil && (va.ResourceVersion == m[0] || va.ResourceVersion == m[1]) {
		return true
	}
	delete(a.marked, va.Name)
	return false
}

// writeFailed handles a failed write of va (or of its PV) during an attach
// or detach: a conflict or a deletion is news on its way (retried quietly);
// anything else (an admission webhook's refusal, missing permissions) is
// reported like a failed driver call, what naming the write.
func (a *Controller) writeFailed(ctx context.Context, va *storagev1.VolumeAttachment, detach bool, what string, err error) error {
	if apierrors.IsConflict(err) || apierrors.IsNotFound(err) {
		return err
	}
	return a.attachFailed(ctx, va, detach, fmt.Errorf("%s: %w", what, err))
}

func (a *Controller) setForce(name string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.force == nil {
		a.force = map[string]bool{}
	}
	a.force[name] = true
}

// takeForce reports (once) whether name is to be published again.
func (a *Controller) takeForce(name string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	f := a.force[name]
	delete(a.force, name)
	return f
}

func New(b *kube.Env) (*Controller, error) {
	a := &Controller{b: b, queue: b.NewTermQueue("attach")}
	a.slots = a.queue.WithSlots(b.Cfg.PerDriverWorkers)
	a.queue.ReportOn(func(key string) (corev1.ObjectReference, bool) {
		if name, ok := strings.CutPrefix(key, "va/"); ok {
			return b.VAOfKey(name)
		}
		return b.PVOfKey(strings.TrimPrefix(key, "pv/"))
	})
	b.Metrics.QueueDepth("attach", a.queue.Len)
	b.On(b.Factory.Storage().V1().VolumeAttachments().Informer(), cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) { a.enqueueVA(obj) },
		UpdateFunc: func(old, obj any) {
			// Our own error status writes change nothing to act on; acting
			// on them would bypass the backoff and loop on API writes.
			if o, ok := old.(*storagev1.VolumeAttachment); ok {
				if n, ok := obj.(*storagev1.VolumeAttachment); ok && !vaChanged(o, n) {
					return
				}
			}
			a.enqueueVA(obj)
		},
		DeleteFunc: func(obj any) {
			// A detached attachment may free its PV's finalizer.
			va, ok := kube.Deleted[*storagev1.VolumeAttachment](obj)
			if !ok {
				return
			}
			b.ForgetEvents(va.UID)
			if va.Spec.Source.PersistentVolumeName != nil {
				a.queue.Add("pv/" + *va.Spec.Source.PersistentVolumeName)
			}
		},
	})
	b.On(b.Factory.Core().V1().PersistentVolumes().Informer(), cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { a.enqueuePV(obj) },
		UpdateFunc: func(_, obj any) { a.enqueuePV(obj) },
	})
	return a, nil
}

func (a *Controller) enqueueVA(obj any) {
	if va, ok := obj.(*storagev1.VolumeAttachment); ok && a.b.Registered(va.Spec.Attacher) {
		a.queue.Add("va/" + va.Name)
	}
}

func (a *Controller) Run(ctx context.Context) {
	// Forced re-publishes are of a term: the term's reconcile finds the
	// attachments not published again (an entry whose VA went while
	// another replica led would otherwise stay).
	a.mu.Lock()
	clear(a.force)
	clear(a.marked)
	a.mu.Unlock()
	a.queue.Work(ctx, a.b.Cfg.WorkerThreads, a.EnqueueAll, a.sync, a.reconcileLoop)
}

// enqueuePV queues a PV being deleted that still holds an attacher
// finalizer, to drop it once no attachment uses the PV.
func (a *Controller) enqueuePV(obj any) {
	if pv, ok := obj.(*corev1.PersistentVolume); ok && pv.DeletionTimestamp != nil {
		if drv := kube.PVDriver(pv); drv != "" && kube.HasAttacherFinalizer(pv.Finalizers, drv) {
			a.queue.Add("pv/" + pv.Name)
		}
	}
}

func (a *Controller) EnqueueAll() {
	if vas, err := a.b.Attachments.List(labels.Everything()); err == nil {
		for _, va := range vas {
			a.enqueueVA(va)
		}
	}
	// PVs whose last attachment went while no broker led.
	if pvs, err := a.b.Volumes.List(labels.Everything()); err == nil {
		for _, pv := range pvs {
			a.enqueuePV(pv)
		}
	}
}

// vaChanged reports whether an update asks for work: anything but a change
// of the attach or detach error (which only this controller writes).
func vaChanged(o, n *storagev1.VolumeAttachment) bool {
	if o.Generation != n.Generation || !o.DeletionTimestamp.Equal(n.DeletionTimestamp) ||
		o.Status.Attached != n.Status.Attached || len(o.Finalizers) != len(n.Finalizers) {
		return true
	}
	for i := range o.Finalizers {
		if o.Finalizers[i] != n.Finalizers[i] {
			return true
		}
	}
	return o.Annotations[kube.AnnVANodeID] != n.Annotations[kube.AnnVANodeID]
}

func (a *Controller) sync(ctx context.Context, key string) (time.Duration, error) {
	switch {
	case strings.HasPrefix(key, "va/"):
		return a.syncVA(ctx, strings.TrimPrefix(key, "va/"))
	case strings.HasPrefix(key, "pv/"):
		return 0, a.syncPV(ctx, strings.TrimPrefix(key, "pv/"))
	}
	return 0, nil
}

// patchVA writes cur's changes to old (through the status subresource
// when asked), on condition that old is still the stored version, as an
// Update of the whole object would be; the fields it does not change stay
// as stored (those a newer API server has and these types lack included).
// With nothing to change it writes nothing and returns old.
func (a *Controller) patchVA(ctx context.Context, old, cur *storagev1.VolumeAttachment, subresources ...string) (*storagev1.VolumeAttachment, error) {
	// A JSON merge patch: the status's attachmentMetadata is the driver's
	// publish context, whose keys are the driver's to choose.
	patch, err := kube.MergePatch(old, cur, old.ResourceVersion)
	if err != nil {
		return nil, fmt.Errorf("volumeattachment %s: making the patch: %w", old.Name, err)
	}
	if patch == nil {
		return old, nil
	}
	return a.b.Cfg.Client.StorageV1().VolumeAttachments().Patch(ctx, old.Name, types.MergePatchType, patch, metav1.PatchOptions{}, subresources...)
}

// attachSource is what a VolumeAttachment attaches.
type attachSource struct {
	pv  *corev1.PersistentVolume // nil for an inline volume
	csi *corev1.CSIPersistentVolumeSource
	// migrated: pv is an in-tree volume and csi its CSI translation.
	migrated bool
	// For the capability: access modes, volume mode and mount options.
	accessModes  []corev1.PersistentVolumeAccessMode
	volumeMode   *corev1.PersistentVolumeMode
	mountOptions []string
}

func (a *Controller) source(va *storagev1.VolumeAttachment) (*attachSource, error) {
	if n := va.Spec.Source.PersistentVolumeName; n != nil {
		pv, err := a.b.Volumes.Get(*n)
		if err != nil {
			return nil, fmt.Errorf("persistentvolume %s: %w", *n, err)
		}
		spec, err := kube.CSISpec(pv)
		if err != nil {
			return nil, err
		}
		return &attachSource{pv: pv, csi: spec.CSI, migrated: pv.Spec.CSI == nil, accessModes: spec.AccessModes, volumeMode: spec.VolumeMode, mountOptions: spec.MountOptions}, nil
	}
	if spec := va.Spec.Source.InlineVolumeSpec; spec != nil && spec.CSI != nil {
		return &attachSource{csi: spec.CSI, accessModes: spec.AccessModes, volumeMode: spec.VolumeMode, mountOptions: spec.MountOptions}, nil
	}
	return nil, fmt.Errorf("volumeattachment %s names no CSI volume", va.Name)
}

// nodeID is the driver's ID of a node: from the CSINode, else from the
// node annotation node-driver-registrar also writes.
func (a *Controller) nodeID(driver, node string) (string, error) {
	if cn, err := a.b.CSINodes.Get(node); err == nil {
		for _, d := range cn.Spec.Drivers {
			if d.Name == driver {
				return d.NodeID, nil
			}
		}
	}
	if n, err := a.b.Nodes.Get(node); err == nil {
		if id := jsonField(n.Annotations[kube.AnnNodeIDs], driver); id != "" {
			return id, nil
		}
	}
	return "", fmt.Errorf("node %s has no ID for driver %s: its CSINode does not list the driver (is the node plugin registered there?)", node, driver)
}

// jsonField reads {"driver":"id",...} without allocating a map.
func jsonField(s, key string) string {
	i := strings.Index(s, `"`+key+`":"`)
	if i < 0 {
		return ""
	}
	rest := s[i+len(key)+4:]
	if j := strings.IndexByte(rest, '"'); j >= 0 {
		return rest[:j]
	}
	return ""
}

// capability builds the CSI capability of an attached volume, its access
// mode from all of the volume's access modes as external-attacher (and the
// resizer here) map them; a volume without any is SINGLE_NODE_WRITER.
func capability(src *attachSource, singleNodeMultiWriter bool) (*csi.VolumeCapability, error) {
	mode := csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
	if len(src.accessModes) > 0 {
		var err error
		if mode, err = accessmodes.ToCSIAccessMode(src.accessModes, singleNodeMultiWriter); err != nil {
			return nil, fmt.Errorf("access modes %v: %w", src.accessModes, err)
		}
	}
	c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
	if csiparams.VolumeMode(src.volumeMode) == corev1.PersistentVolumeBlock {
		c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	} else {
		c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: src.csi.FSType, MountFlags: src.mountOptions}}
	}
	return c, nil
}

// syncVA attaches or detaches VolumeAttachment name as it asks, or
// returns waitForSlot while its driver is busy.
func (a *Controller) syncVA(ctx context.Context, name string) (time.Duration, error) {
	force := a.takeForce(name) // consumed whatever happens: no entry outlives its VA
	va, err := a.b.Attachments.Get(name)
	if apierrors.IsNotFound(err) {
		a.mu.Lock()
		delete(a.marked, name)
		a.mu.Unlock()
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	driver := va.Spec.Attacher
	if !a.b.Registered(driver) {
		return 0, nil
	}
	if a.staleUnattached(va) && !force {
		return 0, nil
	}
	if va.DeletionTimestamp == nil && va.Status.Attached && !force {
		return 0, nil
	}
	if va.DeletionTimestamp != nil && !kube.HasAttacherFinalizer(va.Finalizers, driver) {
		return 0, nil // nothing of ours to undo: no slot needed
	}
	// --per-driver-workers: one slow driver cannot take every worker.
	if !a.slots.Acquire(driver, "va/"+name) {
		if force {
			a.setForce(name) // still to publish again
		}
		return kube.WaitForSlot, nil
	}
	defer a.slots.Release(driver)
	a.b.TestHook("attach", driver, "va/"+name)
	ctx = budget.WithDriver(ctx, driver) // its writes wait in turn with other drivers'
	ctx, span := a.b.Tracer.Start(ctx, "attach "+name, trace.WithAttributes(attribute.String("csi.driver", driver),
		attribute.String("k8s.node", va.Spec.NodeName), attribute.Bool("detach", va.DeletionTimestamp != nil)))
	defer span.End()
	if va.DeletionTimestamp != nil {
		return 0, a.detach(ctx, va)
	}
	err = a.attach(ctx, va)
	if err != nil && force {
		a.setForce(name) // the retry publishes again too
	}
	return 0, err
}

// attachFailed records the error in the attachment's status and the log on
// every attempt, and as an Event once per failure (eventOnce: a driver's
// answer named by its method and code).
func (a *Controller) attachFailed(ctx context.Context, va *storagev1.VolumeAttachment, detach bool, err error) error {
	if ctx.Err() != nil {
		// The term ended during the attempt: nothing can be recorded, and
		// the next leader takes the attachment up.
		return err
	}
	a.b.Metrics.Attach.WithLabelValues(va.Spec.Attacher, map[bool]string{false: "attach", true: "detach"}[detach], "failed").Inc()
	ve := &storagev1.VolumeError{Time: metav1.Now(), Message: VolumeErrorMessage(err.Error())}
	if st, ok := status.FromError(unwrapStatus(err)); ok && st.Code() != codes.OK {
		c := int32(st.Code())
		ve.ErrorCode = &c
	}
	cp := va.DeepCopy()
	reason := "AttachFailed"
	if detach {
		cp.Status.DetachError = ve
		reason = "DetachFailed"
	} else {
		cp.Status.AttachError = ve
	}
	if _, uerr := a.patchVA(ctx, va, cp, "status"); uerr != nil && !apierrors.IsNotFound(uerr) && !apierrors.IsConflict(uerr) {
		a.b.Log.Error("record attachment error", "volumeattachment", va.Name, "err", uerr)
	}
	op := map[bool]string{false: "ControllerPublishVolume", true: "ControllerUnpublishVolume"}[detach]
	a.b.Log.Warn("attachment failed", "volumeattachment", va.Name, "driver", va.Spec.Attacher, "node", va.Spec.NodeName, "detach", detach, "err", err)
	a.b.EventOnce(ctx, kube.VARef(va), corev1.EventTypeWarning, reason, kube.FailureOf(op, err), "%v", err)
	return err
}

// MaxVolumeErrorMessage is the longest VolumeError message the API server
// accepts in a VolumeAttachment's status.
const MaxVolumeErrorMessage = 1024

// VolumeErrorMessage cuts msg to what the API server accepts (a driver's
// long error would otherwise make the status write fail on every retry),
// on a UTF-8 boundary, saying that it was cut; the log line keeps the
// whole message.
func VolumeErrorMessage(msg string) string {
	if len(msg) <= MaxVolumeErrorMessage {
		return msg
	}
	const cut = " ... (cut; the broker's log line has the whole message)"
	n := MaxVolumeErrorMessage - len(cut)
	for n > 0 && !utf8.RuneStart(msg[n]) {
		n--
	}
	return msg[:n] + cut
}

// unwrapStatus finds a gRPC status in a wrapped error chain.
func unwrapStatus(err error) error {
	for e := err; e != nil; {
		if _, ok := status.FromError(e); ok {
			return e
		}
		u, ok := e.(interface{ Unwrap() error })
		if !ok {
			break
		}
		e = u.Unwrap()
	}
	return err
}

func (a *Controller) attach(ctx context.Context, va *storagev1.VolumeAttachment) error {
	driver, node := va.Spec.Attacher, va.Spec.NodeName
	caps, err := a.b.Caps.Get(ctx, driver)
	if err != nil {
		a.b.Caps.Forget(driver)
		return a.attachFailed(ctx, va, false, drivers.NewUnreachable(fmt.Errorf("driver %s is not reachable: %w", driver, err)))
	}
	if !caps.PublishUnpublish {
		// Trivial attach: the driver has no controller publish step.
		cp := va.DeepCopy()
		cp.Status.Attached, cp.Status.AttachError = true, nil
		if _, err := a.patchVA(ctx, va, cp, "status"); err != nil {
			return a.writeFailed(ctx, va, false, "mark the attachment attached", err)
		}
		a.noteMarked(va.Name, va.ResourceVersion, va.ResourceVersion)
		a.b.Metrics.Attach.WithLabelValues(driver, "attach", "success").Inc()
		return nil
	}
	src, err := a.source(va)
	if err != nil {
		return a.attachFailed(ctx, va, false, err)
	}
	if src.csi.Driver != driver {
		// Checked before any publish (a detach of what an earlier
		// release published anyway is not refused).
		what := "the attachment's inline volume"
		if src.pv != nil {
			what = "persistentvolume " + src.pv.Name
		}
		return a.attachFailed(ctx, va, false, fmt.Errorf("%s is a volume of driver %s, not of the attachment's attacher %s", what, src.csi.Driver, driver))
	}
	if src.pv != nil && src.pv.DeletionTimestamp != nil {
		// As external-attacher: a volume being deleted is not published
		// anywhere new (nor can its PV take the attacher's finalizer).
		return a.attachFailed(ctx, va, false, fmt.Errorf("PersistentVolume %q is marked for deletion", src.pv.Name))
	}
	nodeID, err := a.nodeID(driver, node)
	if err != nil {
		return a.attachFailed(ctx, va, false, err)
	}
	fin := kube.AttacherFinalizer(driver)
	if src.pv != nil && !kube.HasFinalizer(src.pv, fin) {
		cp := src.pv.DeepCopy()
		cp.Finalizers = append(cp.Finalizers, fin)
		if err := a.b.PatchPV(ctx, src.pv, cp); err != nil {
			return a.writeFailed(ctx, va, false, fmt.Sprintf("add finalizer %s to PersistentVolume %s", fin, src.pv.Name), err)
		}
	}
	requester := a.requester(va, src)
	recorded := kube.RecordedNamespaceLabels(src.pv)
	// The namespace labels the publish is decided with are recorded on the
	// attachment (in the write below) when the PV records none (a static
	// PV, or one another provisioner made): the unpublish is decided with
	// them if the namespace is gone by then.
	nsLabelsNote := ""
	if src.csi.ControllerPublishSecretRef != nil && recorded == nil && requester.Namespace != "" {
		if l := a.b.ReadNamespaceLabels(ctx, requester.Namespace); l != nil {
			requester.NamespaceLabels = l
			if b, err := json.Marshal(l); err == nil {
				nsLabelsNote = string(b)
			}
		}
	}
	secrets, err := a.b.FetchSecret(ctx, kube.SecretUse{Driver: driver, Op: policy.OpControllerPublishVolume, Ref: src.csi.ControllerPublishSecretRef,
		Source: policy.Source{Kind: policy.SourcePVField, Key: "spec.csi.controllerPublishSecretRef"}, Requester: requester, RecordedNSLabels: recorded})
	if err != nil {
		return a.attachFailed(ctx, va, false, err)
	}
	volCap, err := capability(src, caps.SingleNodeMultiWriter)
	if err != nil {
		return a.attachFailed(ctx, va, false, err)
	}
	// The VA's finalizer and node ID last, in one write, just before the
	// call (as external-attacher): a VA that was never published (its PV
	// being deleted, its secret missing or denied) has nothing to detach
	// and can go; a detach never lacks either.
	before := va.ResourceVersion
	if !containsString(va.Finalizers, fin) || va.Annotations[kube.AnnVANodeID] != nodeID || (nsLabelsNote != "" && va.Annotations[kube.AnnNamespaceLabels] != nsLabelsNote) {
		cp := va.DeepCopy()
		if !containsString(cp.Finalizers, fin) {
			cp.Finalizers = append(cp.Finalizers, fin)
		}
		if cp.Annotations == nil {
			cp.Annotations = map[string]string{}
		}
		cp.Annotations[kube.AnnVANodeID] = nodeID
		if nsLabelsNote != "" {
			cp.Annotations[kube.AnnNamespaceLabels] = nsLabelsNote
		}
		updated, err := a.patchVA(ctx, va, cp)
		if err != nil {
			return a.writeFailed(ctx, va, false, fmt.Sprintf("add finalizer %s and node ID to the attachment", fin), err)
		}
		va = updated
	}
	return a.publish(ctx, va, src, publishCall{caps: caps, nodeID: nodeID, volCap: volCap, secrets: secrets, before: before})
}

// publishCall is what attach prepared for the ControllerPublishVolume
// call: before is the attachment's version before attach wrote to it.
type publishCall struct {
	caps    drivers.Caps
	nodeID  string
	volCap  *csi.VolumeCapability
	secrets map[string]string
	before  string
}

// publish calls ControllerPublishVolume, checks the answer and marks the
// attachment attached with its publish context.
func (a *Controller) publish(ctx context.Context, va *storagev1.VolumeAttachment, src *attachSource, pc publishCall) error {
	driver, node := va.Spec.Attacher, va.Spec.NodeName
	caps, nodeID, volCap, secrets, before := pc.caps, pc.nodeID, pc.volCap, pc.secrets, pc.before
	conn, err := a.conn(driver, node)
	if err != nil {
		return a.attachFailed(ctx, va, false, err)
	}
	callCtx, cancel := a.b.CallContext(ctx, driver, "ControllerPublishVolume")
	resp, err := csi.NewControllerClient(conn).ControllerPublishVolume(callCtx, &csi.ControllerPublishVolumeRequest{
		VolumeId: src.csi.VolumeHandle, NodeId: nodeID, VolumeCapability: volCap,
		// Read-only only for a driver that may be asked (CSI: PUBLISH_READONLY), as external-attacher.
		Readonly: src.csi.ReadOnly && caps.PublishReadonly, VolumeContext: src.csi.VolumeAttributes, Secrets: secrets,
	})
	cancel()
	if err != nil {
		return a.attachFailed(ctx, va, false, fmt.Errorf("ControllerPublishVolume %s to node %s (ID %s): %w", src.csi.VolumeHandle, node, nodeID, err))
	}
	if err := csiparams.CheckPublished(resp.GetPublishContext()); err != nil {
		// Not written: the API server would refuse the status on every
		// retry. The retry publishes again (idempotent) and checks again;
		// the attachment's deletion unpublishes what was published.
		return a.attachFailed(ctx, va, false, fmt.Errorf("ControllerPublishVolume %s to node %s (ID %s): %w", src.csi.VolumeHandle, node, nodeID, err))
	}
	cp := va.DeepCopy()
	cp.Status.Attached, cp.Status.AttachmentMetadata, cp.Status.AttachError = true, resp.GetPublishContext(), nil
	if _, err := a.patchVA(ctx, va, cp, "status"); err != nil {
		// Published: the retry publishes again (idempotent) and writes
		// the status again.
		return a.writeFailed(ctx, va, false, "volume published, but marking the attachment attached failed", err)
	}
	a.noteMarked(va.Name, before, va.ResourceVersion)
	a.b.Metrics.Attach.WithLabelValues(driver, "attach", "success").Inc()
	a.b.Log.Info("volume attached", "volumeattachment", va.Name, "driver", driver, "node", node, "volume", src.csi.VolumeHandle)
	a.b.ForgetEvents(va.UID) // a failure after this one is news
	return nil
}

func (a *Controller) requester(va *storagev1.VolumeAttachment, src *attachSource) policy.Requester {
	r := policy.Requester{Kind: policy.KindVolumeAttachment, Name: va.Name, Labels: va.Labels, Node: va.Spec.NodeName}
	if src != nil && src.pv != nil {
		r.StorageClass = src.pv.Spec.StorageClassName
		if cr := src.pv.Spec.ClaimRef; cr != nil {
			r.Namespace = cr.Namespace
		}
	}
	return r
}

func (a *Controller) detach(ctx context.Context, va *storagev1.VolumeAttachment) error {
	driver, node := va.Spec.Attacher, va.Spec.NodeName
	if !kube.HasAttacherFinalizer(va.Finalizers, driver) {
		return nil
	}
	caps, err := a.b.Caps.Get(ctx, driver)
	if err != nil {
		a.b.Caps.Forget(driver)
		return a.attachFailed(ctx, va, true, drivers.NewUnreachable(fmt.Errorf("driver %s is not reachable: %w", driver, err)))
	}
	// Our finalizer is there, so a publish was made or attempted: it is
	// undone even if the driver's capabilities say today that it has no
	// publish step (a capability may come and go across its versions).
	src, err := a.source(va)
	if err != nil {
		return a.attachFailed(ctx, va, true, err)
	}
	nodeID := va.Annotations[kube.AnnVANodeID]
	if nodeID == "" {
		if nodeID, err = a.nodeID(driver, node); err != nil {
			return a.attachFailed(ctx, va, true, err)
		}
	}
	recorded := kube.RecordedNamespaceLabels(src.pv)
	if recorded == nil {
		// Those the publish was decided with (attach records them when
		// the PV does not).
		if v := va.Annotations[kube.AnnNamespaceLabels]; v != "" {
			_ = json.Unmarshal([]byte(v), &recorded)
		}
	}
	secrets, err := a.b.FetchSecret(ctx, kube.SecretUse{Driver: driver, Op: policy.OpControllerUnpublishVolume, Ref: src.csi.ControllerPublishSecretRef,
		Source: policy.Source{Kind: policy.SourcePVField, Key: "spec.csi.controllerPublishSecretRef"}, Requester: a.requester(va, src), RecordedNSLabels: recorded})
	if err != nil {
		return a.attachFailed(ctx, va, true, err)
	}
	conn, err := a.conn(driver, node)
	if err != nil {
		return a.attachFailed(ctx, va, true, err)
	}
	callCtx, cancel := a.b.CallContext(ctx, driver, "ControllerUnpublishVolume")
	_, err = csi.NewControllerClient(conn).ControllerUnpublishVolume(callCtx, &csi.ControllerUnpublishVolumeRequest{VolumeId: src.csi.VolumeHandle, NodeId: nodeID, Secrets: secrets})
	cancel()
	// NotFound is not "detached": the spec's answer for a volume or node
	// the driver cannot find but may regard as unpublished is OK, and
	// NotFound asks the caller to check and retry (as external-attacher
	// does); taking it as done could let the volume attach to a second
	// node while still attached to the first.
	switch code := status.Code(err); {
	case err == nil:
	case code == codes.Unimplemented && !caps.PublishUnpublish:
		// No publish step after all.
	default:
		return a.attachFailed(ctx, va, true, fmt.Errorf("ControllerUnpublishVolume %s from node %s (ID %s): %w", src.csi.VolumeHandle, node, nodeID, err))
	}
	base := va
	if len(kube.WithoutAttacherFinalizers(va.Finalizers, driver)) > 0 && (va.Status.Attached || va.Status.DetachError != nil || len(va.Status.AttachmentMetadata) > 0) {
		// Another finalizer keeps the attachment after ours goes: its
		// status says detached first (as external-attacher marks it), not
		// attached with an old detach error.
		st := va.DeepCopy()
		st.Status.Attached, st.Status.AttachmentMetadata, st.Status.DetachError = false, nil, nil
		updated, err := a.patchVA(ctx, va, st, "status")
		if err != nil && !apierrors.IsNotFound(err) {
			return a.writeFailed(ctx, va, true, "volume unpublished, but marking the attachment detached failed", err)
		}
		if err == nil {
			base = updated
		}
	}
	cp := base.DeepCopy()
	cp.Finalizers = kube.WithoutAttacherFinalizers(cp.Finalizers, driver)
	if _, err := a.patchVA(ctx, base, cp); err != nil && !apierrors.IsNotFound(err) {
		return a.writeFailed(ctx, va, true, "volume unpublished, but removing the attacher finalizer failed", err)
	}
	a.b.Metrics.Attach.WithLabelValues(driver, "detach", "success").Inc()
	a.b.Log.Info("volume detached", "volumeattachment", va.Name, "driver", driver, "node", node)
	if pv := va.Spec.Source.PersistentVolumeName; pv != nil {
		a.queue.Add("pv/" + *pv)
	}
	return nil
}

// syncPV drops the attacher finalizer from a PV being deleted once no
// attachment uses it.
func (a *Controller) syncPV(ctx context.Context, name string) error {
	pv, err := a.b.Volumes.Get(name)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil || pv.DeletionTimestamp == nil {
		return err
	}
	driver := kube.PVDriver(pv)
	if driver == "" || !kube.HasAttacherFinalizer(pv.Finalizers, driver) {
		return nil
	}
	if va, err := a.b.AttachmentOf(name); err != nil || va != nil {
		return err // still used; the attachment's deletion requeues us
	}
	cp := pv.DeepCopy()
	cp.Finalizers = kube.WithoutAttacherFinalizers(cp.Finalizers, driver)
	if err := a.b.PatchPV(ctx, pv, cp); err != nil && !apierrors.IsNotFound(err) {
		if !apierrors.IsConflict(err) {
			a.b.Log.Warn("remove the attacher finalizer of a PersistentVolume being deleted", "pv", name, "driver", driver, "err", err)
			a.b.EventOnce(ctx, kube.PVRef(pv), corev1.EventTypeWarning, "DetachFailed", "remove finalizer "+string(apierrors.ReasonForError(err)),
				"no attachment uses the volume any more, but removing finalizer %s failed: %v", kube.AttacherFinalizer(driver), err)
		}
		return err
	}
	return nil
}

// reconcileLoop checks attached volumes against what drivers report as
// published; an attachment the driver does not know is published again
// through the queue, its status staying attached.
func (a *Controller) reconcileLoop(ctx context.Context) {
	t := time.NewTicker(ReconcileInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			a.reconcile(ctx)
		}
	}
}

func (a *Controller) reconcile(ctx context.Context) {
	vas, err := a.b.Attachments.List(labels.Everything())
	if err != nil {
		return
	}
	// Asked per driver, and for a node-local driver per node: each
	// node's plugin lists its own volumes.
	type proxyKey struct{ driver, node string }
	byProxy := map[proxyKey][]*storagev1.VolumeAttachment{}
	for _, va := range vas {
		if va.Status.Attached && va.DeletionTimestamp == nil && a.b.Registered(va.Spec.Attacher) {
			k := proxyKey{driver: va.Spec.Attacher}
			if a.b.Cfg.Drivers.NodeLocal(k.driver) {
				k.node = va.Spec.NodeName
			}
			byProxy[k] = append(byProxy[k], va)
		}
	}
	// Each proxy is asked on its own: a driver whose ListVolumes hangs
	// holds up only its own attachments' check.
	var wg sync.WaitGroup
	for k, list := range byProxy {
		wg.Add(1)
		go func() {
			defer wg.Done()
			a.b.Safely("attach-reconcile", k.driver+" "+k.node, func() { a.reconcileProxy(ctx, k.driver, k.node, list) })
		}()
	}
	wg.Wait()
}

// reconcileProxy checks the attachments of one driver (one node's, for a
// node-local driver) against its ListVolumes.
func (a *Controller) reconcileProxy(ctx context.Context, driver, node string, list []*storagev1.VolumeAttachment) {
	caps, err := a.b.Caps.Get(ctx, driver)
	if err != nil {
		a.b.Caps.Forget(driver)
		a.b.Log.Warn("attach reconcile: driver not reachable; its attachments are checked next time", "driver", driver, "node", node, "err", err)
		return
	}
	if !caps.ListPublishedNodes || !caps.PublishUnpublish {
		return
	}
	published, err := a.listPublished(ctx, driver, node)
	if err != nil {
		a.b.Log.Warn("attach reconcile: ListVolumes failed", "driver", driver, "node", node, "err", err)
		return
	}
	for _, va := range list {
		src, err := a.source(va)
		if err != nil {
			a.b.Log.Debug("attach reconcile: attachment skipped", "volumeattachment", va.Name, "err", err)
			continue
		}
		handle := src.csi.VolumeHandle
		if src.migrated {
			// A translated handle may lack what the driver's own IDs
			// hold (GCE PD's project): completed from the node's ID,
			// as external-attacher compares them.
			if h, err := kube.Migration.RepairVolumeHandle(driver, handle, va.Annotations[kube.AnnVANodeID]); err == nil {
				handle = h
			}
		}
		if published[handle][va.Annotations[kube.AnnVANodeID]] {
			continue
		}
		// Published again through the queue, as external-attacher does;
		// the status stays attached (false would make the
		// attach-detach controller count the volume as detached from a
		// node that may be using it).
		a.b.Log.Warn("attach reconcile: driver does not report the volume as published; publishing it again", "volumeattachment", va.Name, "volume", src.csi.VolumeHandle, "node", va.Spec.NodeName)
		a.setForce(va.Name)
		a.queue.Add("va/" + va.Name)
	}
}

// conn is the proxy that takes a driver's controller calls for an
// attachment to node: the driver's controller proxy, or for a node-local
// driver (whose volumes live on the node that uses them) the node's own.
func (a *Controller) conn(driver, node string) (grpc.ClientConnInterface, error) {
	if a.b.Cfg.Drivers.NodeLocal(driver) {
		return a.b.Cfg.Drivers.NodeConn(driver, node)
	}
	return a.b.Cfg.Drivers.ControllerConn(driver)
}

func (a *Controller) listPublished(ctx context.Context, driver, node string) (map[string]map[string]bool, error) {
	conn, err := a.conn(driver, node)
	if err != nil {
		return nil, err
	}
	out := map[string]map[string]bool{}
	token := ""
	seen := map[string]bool{}
	for {
		callCtx, cancel := a.b.CallContext(ctx, driver, "ListVolumes")
		resp, err := csi.NewControllerClient(conn).ListVolumes(callCtx, &csi.ListVolumesRequest{StartingToken: token, MaxEntries: 500})
		cancel()
		if err != nil {
			return nil, err
		}
		for _, e := range resp.GetEntries() {
			m := map[string]bool{}
			for _, n := range e.GetStatus().GetPublishedNodeIds() {
				m[n] = true
			}
			out[e.GetVolume().GetVolumeId()] = m
		}
		if token = resp.GetNextToken(); token == "" {
			return out, nil
		}
		if seen[token] {
			return nil, fmt.Errorf("ListVolumes answered page token %q twice: the driver's paging does not end", token)
		}
		seen[token] = true
	}
}

func containsString(l []string, s string) bool {
	for _, x := range l {
		if x == s {
			return true
		}
	}
	return false
}

// QueueLen is how many attachments wait in this term's queue, a driver's
// line included.
func (a *Controller) QueueLen() int { return a.queue.Len() }
