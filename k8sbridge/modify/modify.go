package modify

import (
	"context"
	"fmt"
	"maps"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
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

// Volume modification, as external-resizer's modify controller: a bound
// claim whose spec.volumeAttributesClassName differs from its
// status.currentVolumeAttributesClassName has its volume changed with
// ControllerModifyVolume, the class's parameters as the mutable
// parameters, and the controller-modify secret the PV records
// (volume.kubernetes.io/controller-modify-secret-*), decided by the policy
// as ControllerModifyVolume. The claim's status says where it stands:
// modifyVolumeStatus Pending (the class does not exist yet), InProgress
// (with a ModifyingVolume condition, and a ModifyVolumeError condition after
// a failure, retried with backoff) or Infeasible (the driver answered
// InvalidArgument, or the class is another driver's: tried again only
// after --retry-interval-max, or at once when the claim names another
// class). Done, the PV names the class, the claim's status says it is
// current, and the modify conditions go. A claim set back to its current
// class has its modify status cleared, after the current class's
// parameters are applied again if the driver may have begun the other; a
// claim without a class set back to none has it cleared (there are no
// parameters to apply again). A failed API request of a modification
// (reading its class, writing the claim's status or the PV) is a
// VolumeModifyFailed Event too, as the driver's failures are, but for a
// conflict (a newer object is on its way: retried with it, quietly).
//
// API writes: three per modification (claim status, PV, claim status),
// as upstream; a failure costs one more (its condition), and a retry of
// the same failure none.

type Controller struct {
	b     *kube.Env
	queue *kube.TermQueue
	// slots counts each driver's modifications in progress, against
	// PerDriverWorkers: one slow driver cannot take every worker.
	slots *kube.DriverSlots
	ops   *prometheus.CounterVec

	mu sync.Mutex
	// infeasible holds claims whose modification to a class was found
	// infeasible, and when: not tried again before RetryIntervalMax.
	infeasible map[types.UID]infeasibleTarget
}

type infeasibleTarget struct {
	class string
	at    time.Time
}

func New(b *kube.Env) (*Controller, error) {
	m := &Controller{b: b, queue: b.NewTermQueue("modify"), infeasible: map[types.UID]infeasibleTarget{}}
	m.slots = m.queue.WithSlots(b.Cfg.PerDriverWorkers)
	m.queue.ReportOn(b.ClaimOfKey)
	ops, err := kube.OperationsCounter(b.Cfg.Registerer, "modify_operations_total",
		"Volume modification attempts (ControllerModifyVolume) by driver and result (success, infeasible, failed, pending, not_called).")
	if err != nil {
		return nil, err
	}
	m.ops = ops
	b.Metrics.QueueDepth("modify", m.queue.Len)
	b.On(b.Factory.Core().V1().PersistentVolumeClaims().Informer(), cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			if c, ok := obj.(*corev1.PersistentVolumeClaim); ok && claimNeedsModify(c) {
				m.enqueue(c)
			}
		},
		UpdateFunc: func(oldObj, obj any) {
			old, ok1 := oldObj.(*corev1.PersistentVolumeClaim)
			c, ok2 := obj.(*corev1.PersistentVolumeClaim)
			if ok1 && ok2 && claimNeedsModify(c) && modifyTriggered(old, c) {
				m.enqueue(c)
			}
		},
		DeleteFunc: func(obj any) {
			if c, ok := kube.Deleted[*corev1.PersistentVolumeClaim](obj); ok {
				m.mu.Lock()
				delete(m.infeasible, c.UID)
				m.mu.Unlock()
			}
		},
	})
	return m, nil
}

// claimNeedsModify: a bound claim names a class its volume does not have
// yet, or names its current class again with a modification still on
// record (a rollback), or names no class, as its volume has none, with a
// modification still on record (a rollback to no class: the API server
// lets a class that was never applied be unset). Left on record, the
// modification's target counts as a use of its class, whose deletion then
// waits for ever.
func claimNeedsModify(c *corev1.PersistentVolumeClaim) bool {
	if c.Status.Phase != corev1.ClaimBound || c.Spec.VolumeName == "" || c.DeletionTimestamp != nil {
		return false
	}
	want, cur := c.Spec.VolumeAttributesClassName, c.Status.CurrentVolumeAttributesClassName
	if want == nil || *want == "" {
		return cur == nil && modifyOnRecord(c)
	}
	return cur == nil || *cur != *want || c.Status.ModifyVolumeStatus != nil
}

// modifyOnRecord: the claim's status holds a modification, or one of its
// conditions.
func modifyOnRecord(c *corev1.PersistentVolumeClaim) bool {
	if c.Status.ModifyVolumeStatus != nil {
		return true
	}
	for _, cond := range c.Status.Conditions {
		if isModifyCondition(cond.Type) {
			return true
		}
	}
	return false
}

// modifyTriggered says whether an update is worth a look: the class asked
// for, the current class, the phase or the volume changed, or the informer
// resynced. The modifier's own status writes change none of these until
// the last (the current class), so a failure's retry keeps its backoff.
func modifyTriggered(old, cur *corev1.PersistentVolumeClaim) bool {
	return old.ResourceVersion == cur.ResourceVersion ||
		!equalStringPtr(old.Spec.VolumeAttributesClassName, cur.Spec.VolumeAttributesClassName) ||
		!equalStringPtr(old.Status.CurrentVolumeAttributesClassName, cur.Status.CurrentVolumeAttributesClassName) ||
		old.Status.Phase != cur.Status.Phase || old.Spec.VolumeName != cur.Spec.VolumeName
}

func equalStringPtr(a, b *string) bool {
	return (a == nil) == (b == nil) && (a == nil || *a == *b)
}

// EnqueueAll adds every claim that needs a modification (start of a term,
// a driver registered: its claims were dropped while it was unknown).
func (m *Controller) EnqueueAll() {
	if claims, err := m.b.Claims.List(labels.Everything()); err == nil {
		for _, c := range claims {
			if claimNeedsModify(c) {
				m.enqueue(c)
			}
		}
	}
}

func (m *Controller) enqueue(c *corev1.PersistentVolumeClaim) {
	m.queue.Add(c.Namespace + "/" + c.Name)
}

func (m *Controller) Run(ctx context.Context) {
	m.mu.Lock()
	clear(m.infeasible)
	m.mu.Unlock()
	m.queue.Work(ctx, m.b.Cfg.WorkerThreads, m.EnqueueAll, func(ctx context.Context, key string) (time.Duration, error) {
		requeue, err := m.sync(ctx, key)
		if err != nil {
			m.b.Log.Debug("volume modification will be retried", "claim", key, "err", err)
		}
		return requeue, err
	})
}

// sync modifies one claim's volume if it needs it. An error retries with
// backoff; a positive duration looks at the claim again then.
func (m *Controller) sync(ctx context.Context, key string) (time.Duration, error) {
	claim, err := m.b.CachedClaim(key)
	if claim == nil || err != nil {
		return 0, err
	}
	ns, name := claim.Namespace, claim.Name
	if !claimNeedsModify(claim) {
		return 0, nil
	}
	pv, err := m.b.Volumes.Get(claim.Spec.VolumeName)
	if err != nil {
		return 0, fmt.Errorf("claim %s: volume %s: %w", key, claim.Spec.VolumeName, err)
	}
	if cr := pv.Spec.ClaimRef; cr == nil || cr.Namespace != claim.Namespace || cr.UID != claim.UID || pv.Spec.CSI == nil {
		return 0, nil
	}
	driver := pv.Spec.CSI.Driver
	if !m.b.Registered(driver) {
		return 0, nil
	}
	// --per-driver-workers: one slow driver cannot take every worker.
	if !m.slots.Acquire(driver, key) {
		return kube.WaitForSlot, nil
	}
	defer m.slots.Release(driver)
	ctx = budget.WithDriver(ctx, driver) // its writes wait in turn with other drivers'
	// The cache may not have this controller's own last writes yet (the
	// claim can come back while its modification runs): the claim is read
	// from the API server, so a modification just done is not done again.
	// One read per attempt of a claim of a registered driver.
	claim, err = m.b.Cfg.Client.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	if !claimNeedsModify(claim) || claim.Spec.VolumeName != pv.Name {
		return 0, nil
	}
	if want := claim.Spec.VolumeAttributesClassName; want == nil || *want == "" {
		// Whether the driver applied a class: if it may have been asked,
		// read from the API server, as the cache may not have this
		// controller's own PV write yet (a claim cleared as cancelled
		// would not be looked at again while its PV names the class).
		fresh := pv
		if modifyMayHaveStarted(claim) {
			if fresh, err = m.b.Cfg.Client.CoreV1().PersistentVolumes().Get(ctx, pv.Name, metav1.GetOptions{}); apierrors.IsNotFound(err) {
				return 0, nil
			} else if err != nil {
				return 0, err
			}
		}
		if applied := fresh.Spec.VolumeAttributesClassName; applied != nil && *applied != "" {
			// The driver applied a class and the PV names it; only the
			// claim's last status write was lost. The volume has that
			// class, whatever the claim asks now: it is recorded as the
			// claim's current one.
			done := claim.DeepCopy()
			done.Status.CurrentVolumeAttributesClassName = applied
			done.Status.ModifyVolumeStatus = nil
			done.Status.Conditions = clearModifyConditions(done.Status.Conditions)
			if _, err := m.b.PatchClaimStatus(ctx, claim, done, true); err != nil {
				if !retriedQuietly(ctx, err) {
					msg := m.warn(ctx, claim, *applied, "", "record VolumeAttributesClass %s, which volume %s has, as the claim's current class: %v", *applied, pv.Name, err)
					m.b.Log.Warn("volume modification: recording the applied class failed", "claim", key, "pv", pv.Name, "class", *applied, "err", msg)
				}
				return 0, err
			}
			m.warn(ctx, claim, *applied, "", "claim no longer names a VolumeAttributesClass, but volume %s was modified to VolumeAttributesClass %s already; that is its current class", pv.Name, *applied)
			return 0, nil
		}
		if s := claim.Status.ModifyVolumeStatus; s != nil && modifyMayHaveStarted(claim) {
			m.warn(ctx, claim, s.TargetVolumeAttributesClassName, "", "modification of volume %s to VolumeAttributesClass %s cancelled after the driver was asked for it: the volume may carry some of that class's parameters", pv.Name, s.TargetVolumeAttributesClassName)
		}
		// Set back to no class, the volume's (claimNeedsModify): no
		// class's parameters to apply again, so nothing pending any more.
		return 0, m.clearModify(ctx, claim)
	}
	target := *claim.Spec.VolumeAttributesClassName
	if cur := claim.Status.CurrentVolumeAttributesClassName; cur != nil && *cur == target && !modifyMayHaveStarted(claim) {
		// Set back to the class it has before the driver was asked for
		// another (Pending, or Infeasible: the driver refused it): nothing
		// to undo, so nothing is pending any more.
		return 0, m.clearModify(ctx, claim)
	}
	m.mu.Lock()
	inf, wasInfeasible := m.infeasible[claim.UID]
	m.mu.Unlock()
	if wasInfeasible && inf.class == target {
		if wait := m.b.Cfg.RetryIntervalMax - time.Since(inf.at); wait > 0 {
			return wait, nil
		}
	}
	result, requeue, err := m.modify(ctx, claim, pv, driver, target)
	m.ops.WithLabelValues(driver, result).Inc()
	return requeue, err
}

// clearModify drops the modification on record from claim's status (its
// modifyVolumeStatus and modify conditions): the claim was set back to
// the class its volume has. No driver call.
func (m *Controller) clearModify(ctx context.Context, claim *corev1.PersistentVolumeClaim) error {
	m.mu.Lock()
	delete(m.infeasible, claim.UID)
	m.mu.Unlock()
	c := claim.DeepCopy()
	c.Status.ModifyVolumeStatus = nil
	c.Status.Conditions = clearModifyConditions(c.Status.Conditions)
	if _, err := m.b.PatchClaimStatus(ctx, claim, c, true); err != nil {
		if !retriedQuietly(ctx, err) {
			class := ""
			if s := claim.Status.ModifyVolumeStatus; s != nil {
				class = s.TargetVolumeAttributesClassName
			}
			msg := m.warn(ctx, claim, class, "", "clear the cancelled modification of volume %s to VolumeAttributesClass %q: %v", claim.Spec.VolumeName, class, err)
			m.b.Log.Warn("volume modification: clearing a cancelled modification failed", "claim", claim.Namespace+"/"+claim.Name, "pv", claim.Spec.VolumeName, "class", class, "err", msg)
		}
		return err
	}
	return nil
}

// modify runs one attempt and returns its result label: a sequence of
// phases (attempt below), each of which lets the next go on or ends the
// attempt.
func (m *Controller) modify(ctx context.Context, claim *corev1.PersistentVolumeClaim, pv *corev1.PersistentVolume, driver, target string) (string, time.Duration, error) {
	a := &attempt{m: m, ctx: ctx, claim: claim, pv: pv, driver: driver, target: target, key: claim.Namespace + "/" + claim.Name}
	for _, phase := range []func() *outcome{
		a.checkClass, // the driver can modify volumes, the class exists and is the driver's
		a.prepare,    // the volume's node, its secret decided and read, the connection
		a.call,       // the claim marked in progress, ControllerModifyVolume
	} {
		if o := phase(); o != nil {
			return o.result, o.requeue, o.err
		}
	}
	o := a.record() // the PV and the claim say the class is current
	return o.result, o.requeue, o.err
}

// attempt is one modification of a claim's volume to class target: what
// its phases learn and hand on.
type attempt struct {
	m      *Controller
	ctx    context.Context
	claim  *corev1.PersistentVolumeClaim
	pv     *corev1.PersistentVolume
	driver string
	target string
	key    string // the claim's namespace/name

	vac   *storagev1.VolumeAttributesClass // checkClass
	node  string                           // prepare: a node-local volume's node
	creds map[string]string                // prepare
	conn  grpc.ClientConnInterface         // prepare
}

// outcome ends an attempt: the result label, when to look again (0: as
// the queue's backoff says), and the error the claim is retried for.
type outcome struct {
	result  string
	requeue time.Duration
	err     error
}

func ended(result string, err error) *outcome { return &outcome{result: result, err: err} }

// warn logs a failure and records it as the controller's warn does.
func (a *attempt) warn(failure, format string, args ...any) {
	msg := a.m.warn(a.ctx, a.claim, a.target, failure, format, args...)
	a.m.b.Log.Warn("volume modification failed", "claim", a.key, "pv", a.pv.Name, "driver", a.driver, "class", a.target, "err", msg)
}

// failed reports a failed API request, as warn does, unless it is retried
// quietly. After a ControllerModifyVolume that succeeded the retry asks the
// driver again, which the call's idempotence allows.
func (a *attempt) failed(result string, err error) *outcome {
	if !retriedQuietly(a.ctx, err) {
		a.warn("", "modify volume %s to VolumeAttributesClass %s: %v", a.pv.Name, a.target, err)
	}
	return ended(result, err)
}

// notCalled reports a failure before the driver was asked.
func (a *attempt) notCalled(err error, format string, args ...any) *outcome {
	a.warn("", format, args...)
	return ended("not_called", err)
}

// infeasible marks the claim Infeasible, with cond as its ModifyVolumeError
// condition's message, and reports msg as warn does (failure as warn's),
// or, the claim not marked, msg with the failure to mark it: one Event per
// attempt, so that a retry repeats none (EventOnce remembers the last of
// each reason).
func (a *attempt) infeasible(failure, msg, cond string) *outcome {
	m, claim := a.m, a.claim
	c := modifyStatus(claim, a.target, corev1.PersistentVolumeClaimModifyVolumeInfeasible)
	c.Status.Conditions = setModifyCondition(c.Status.Conditions, corev1.PersistentVolumeClaimVolumeModifyVolumeError, "Infeasible", cond)
	if _, err := m.b.PatchClaimStatus(a.ctx, claim, c, true); err != nil {
		if !retriedQuietly(a.ctx, err) {
			if failure == "" {
				failure = msg
			}
			a.warn(failure+"; "+err.Error(), "%s; marking claim %s Infeasible failed: %v", msg, a.key, err)
		}
		return ended("infeasible", err) // retried with backoff, and written then
	}
	a.warn(failure, "%s", msg)
	m.mu.Lock()
	m.infeasible[claim.UID] = infeasibleTarget{class: a.target, at: time.Now()}
	m.mu.Unlock()
	return &outcome{result: "infeasible", requeue: m.b.Cfg.RetryIntervalMax}
}

// checkClass makes sure the driver can modify volumes and reads the class:
// Pending while it does not exist (as upstream; the claim is marked first,
// so that one Event says how things stand), Infeasible when it is another
// driver's.
func (a *attempt) checkClass() *outcome {
	m, pv, driver, target := a.m, a.pv, a.driver, a.target
	caps, err := m.b.Caps.Get(a.ctx, driver)
	if err != nil {
		m.b.Caps.Forget(driver)
		a.warn(kube.FailureOf("ControllerModifyVolume", drivers.NewUnreachable(err)), "modify volume %s to VolumeAttributesClass %s: driver %s is not reachable: %v", pv.Name, target, driver, err)
		return ended("not_called", err)
	}
	if !caps.Modify {
		msg := fmt.Sprintf("driver %s does not support volume modification (no MODIFY_VOLUME capability); volume %s cannot take VolumeAttributesClass %s", driver, pv.Name, target)
		return a.infeasible("", msg, msg)
	}
	vac, err := m.b.Cfg.Client.StorageV1().VolumeAttributesClasses().Get(a.ctx, target, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		if _, perr := m.b.PatchClaimStatus(a.ctx, a.claim, modifyStatus(a.claim, target, corev1.PersistentVolumeClaimModifyVolumePending), true); perr != nil {
			return a.failed("pending", fmt.Errorf("VolumeAttributesClass %s not found, and marking claim %s Pending failed: %w", target, a.key, perr))
		}
		m.b.EventOnce(a.ctx, kube.ClaimRef(a.claim), corev1.EventTypeWarning, "VolumeModifyFailed", target+" not found",
			"VolumeAttributesClass %s not found; the modification of volume %s waits for it", target, pv.Name)
		return ended("pending", fmt.Errorf("volumeattributesclass %s not found", target))
	}
	if err != nil {
		return a.failed("not_called", fmt.Errorf("read VolumeAttributesClass %s: %w", target, err))
	}
	if vac.DriverName != driver {
		msg := fmt.Sprintf("VolumeAttributesClass %s is for driver %s, but volume %s is of driver %s", target, vac.DriverName, pv.Name, driver)
		return a.infeasible("", msg, msg)
	}
	a.vac = vac
	return nil
}

// prepare finds a node-local volume's node, decides and reads the secret
// before anything is written (a denied secret leaves the claim as it was),
// and connects to the driver.
func (a *attempt) prepare() *outcome {
	m, pv, claim, driver := a.m, a.pv, a.claim, a.driver
	if m.b.Cfg.Drivers.NodeLocal(driver) {
		if a.node = m.b.NodeOfPV(pv); a.node == "" {
			err := kube.ErrNodeUnknown(pv, driver)
			return a.notCalled(err, "modify volume %s: %v", pv.Name, err)
		}
	}
	ref, err := modifySecretRef(pv)
	if err != nil {
		return a.notCalled(err, "modify volume %s: %v", pv.Name, err)
	}
	a.creds, err = m.b.FetchSecret(a.ctx, kube.SecretUse{
		Driver: driver, Op: policy.OpControllerModifyVolume, Ref: ref,
		Source: policy.Source{Kind: policy.SourcePVField, Key: "metadata.annotations[" + kube.AnnModifySecretName + "]"},
		Requester: policy.Requester{Kind: policy.KindPersistentVolumeClaim, Namespace: claim.Namespace, Name: claim.Name,
			Labels: claim.Labels, StorageClass: pv.Spec.StorageClassName, Node: a.node},
		RecordedNSLabels: kube.RecordedNamespaceLabels(pv),
	})
	if err != nil {
		return a.notCalled(err, "modify volume %s to VolumeAttributesClass %s: %v", pv.Name, a.target, err)
	}
	if a.conn, err = m.b.DriverConn(driver, a.node); err != nil {
		return a.notCalled(err, "modify volume %s: %v", pv.Name, err)
	}
	return nil
}

// call marks the claim in progress and asks the driver, the class's
// parameters as the mutable parameters (with the claim's and PV's names
// under --extra-modify-metadata). InvalidArgument is Infeasible; any other
// failure is recorded on the claim and retried.
func (a *attempt) call() *outcome {
	m, pv, target := a.m, a.pv, a.target
	claim, err := m.b.PatchClaimStatus(a.ctx, a.claim, modifyInProgress(a.claim, target), true)
	if err != nil {
		return a.failed("not_called", fmt.Errorf("mark claim %s modifying: %w", a.key, err))
	}
	a.claim = claim
	m.b.EventOnce(a.ctx, kube.ClaimRef(claim), corev1.EventTypeNormal, "VolumeModify", target,
		"csibroker is modifying volume %s to VolumeAttributesClass %s", pv.Name, target)

	params := maps.Clone(a.vac.Parameters)
	if m.b.Cfg.ExtraModifyMetadata {
		if params == nil {
			params = map[string]string{}
		}
		params[csiparams.ParamPVCName], params[csiparams.ParamPVCNamespace], params[csiparams.ParamPVName] = claim.Name, claim.Namespace, pv.Name
	}
	req := &csi.ControllerModifyVolumeRequest{VolumeId: pv.Spec.CSI.VolumeHandle, Secrets: a.creds, MutableParameters: params}
	callCtx, cancel := m.b.CallContext(a.ctx, a.driver, "ControllerModifyVolume")
	_, err = csi.NewControllerClient(a.conn).ControllerModifyVolume(callCtx, req)
	cancel()
	req.Secrets = nil
	if err == nil {
		return nil
	}
	if a.ctx.Err() != nil {
		return ended("failed", err) // the term ended; the next leader looks again
	}
	failure := kube.FailureOf("ControllerModifyVolume", err)
	msg := fmt.Sprintf("modify volume %s to VolumeAttributesClass %s failed: %s", pv.Name, target, kube.StatusText(err))
	if status.Code(err) == codes.InvalidArgument {
		return a.infeasible(failure, msg, "ControllerModifyVolume failed: "+kube.StatusText(err))
	}
	a.warn(failure, "%s", msg)
	c := claim.DeepCopy()
	c.Status.Conditions = setModifyCondition(c.Status.Conditions, corev1.PersistentVolumeClaimVolumeModifyVolumeError, status.Code(err).String(),
		"ControllerModifyVolume failed: "+kube.StatusText(err)+"; will retry")
	// Without a resourceVersion, as upstream: the condition merges by
	// type, and a concurrent write (the resizer's) does not lose it.
	if _, perr := m.b.PatchClaimStatus(a.ctx, claim, c, false); perr != nil {
		m.b.Log.Warn("volume modification: recording the failure on the claim failed", "claim", a.key, "err", perr)
	}
	return ended("failed", err)
}

// record writes what the driver did: the PV first, as upstream (a claim
// that says done has a PV that names the class), then the claim's status.
func (a *attempt) record() *outcome {
	m, pv, claim, target := a.m, a.pv, a.claim, a.target
	m.mu.Lock()
	delete(m.infeasible, claim.UID)
	m.mu.Unlock()
	if pv.Spec.VolumeAttributesClassName == nil || *pv.Spec.VolumeAttributesClassName != target {
		cur := pv.DeepCopy()
		cur.Spec.VolumeAttributesClassName = &target
		if err := m.b.PatchPV(a.ctx, pv, cur); err != nil {
			return a.failed("failed", fmt.Errorf("set VolumeAttributesClass %s on pv %s: %w", target, pv.Name, err))
		}
	}
	done := claim.DeepCopy()
	done.Status.CurrentVolumeAttributesClassName = &target
	done.Status.ModifyVolumeStatus = nil
	done.Status.Conditions = clearModifyConditions(done.Status.Conditions)
	// Without a resourceVersion: the driver did apply the class, which is
	// true whatever was written since (a newer class asked for is seen,
	// since the spec is not touched).
	if _, err := m.b.PatchClaimStatus(a.ctx, claim, done, false); err != nil {
		return a.failed("failed", fmt.Errorf("mark claim %s modified: %w", a.key, err))
	}
	m.b.Event(a.ctx, kube.ClaimRef(claim), corev1.EventTypeNormal, "VolumeModifySuccessful", "Modified volume %s to VolumeAttributesClass %s", pv.Name, target)
	m.b.ForgetEvents(claim.UID)
	m.b.Log.Info("volume modified", "claim", a.key, "pv", pv.Name, "driver", a.driver, "class", target)
	return ended("success", nil)
}

// warn records a VolumeModifyFailed Event on claim once per class and
// failure (eventOnce), as the resizer's warn does, and returns its
// message. failure names the failure: for a driver's answer its method and
// code (failureOf); "" for the message itself.
func (m *Controller) warn(ctx context.Context, claim *corev1.PersistentVolumeClaim, class, failure, format string, args ...any) string {
	msg := fmt.Sprintf(format, args...)
	if failure == "" {
		failure = msg
	}
	m.b.EventOnce(ctx, kube.ClaimRef(claim), corev1.EventTypeWarning, "VolumeModifyFailed", class+" "+failure, "%s", msg)
	return msg
}

// retriedQuietly: an API request's failure is retried without an Event: a
// conflict (a newer object is on its way, and the retry takes it), or a
// request the end of the term cut short (the next leader looks again).
func retriedQuietly(ctx context.Context, err error) bool {
	return ctx.Err() != nil || apierrors.IsConflict(err)
}

// modifyMayHaveStarted: a modification reached the driver since the claim
// last had its current class (the ModifyingVolume condition, set before
// each call, goes only when a modification is done or cleared), so the
// driver may have applied some of another class, whatever the status says
// now (a later class may be Pending or Infeasible). A claim set back to
// its current class then has that class's parameters applied again.
func modifyMayHaveStarted(claim *corev1.PersistentVolumeClaim) bool {
	for _, c := range claim.Status.Conditions {
		if c.Type == corev1.PersistentVolumeClaimVolumeModifyingVolume {
			return true
		}
	}
	s := claim.Status.ModifyVolumeStatus
	return s != nil && s.Status == corev1.PersistentVolumeClaimModifyVolumeInProgress
}

// modifySecretRef is the controller-modify secret the PV records (nil for
// none); a PV that names half of one is an error.
func modifySecretRef(pv *corev1.PersistentVolume) (*corev1.SecretReference, error) {
	name, ns := pv.Annotations[kube.AnnModifySecretName], pv.Annotations[kube.AnnModifySecretNS]
	switch {
	case name == "" && ns == "":
		return nil, nil
	case name == "" || ns == "":
		return nil, fmt.Errorf("annotations %s=%q and %s=%q name half a controller-modify secret", kube.AnnModifySecretName, name, kube.AnnModifySecretNS, ns)
	}
	return &corev1.SecretReference{Name: name, Namespace: ns}, nil
}

// modifyStatus is claim with its modifyVolumeStatus set.
func modifyStatus(claim *corev1.PersistentVolumeClaim, target string, s corev1.PersistentVolumeClaimModifyVolumeStatus) *corev1.PersistentVolumeClaim {
	c := claim.DeepCopy()
	c.Status.ModifyVolumeStatus = &corev1.ModifyVolumeStatus{TargetVolumeAttributesClassName: target, Status: s}
	return c
}

// modifyInProgress marks a modification to target as started, with the
// ModifyingVolume condition; a failure's condition stays until done.
func modifyInProgress(claim *corev1.PersistentVolumeClaim, target string) *corev1.PersistentVolumeClaim {
	c := modifyStatus(claim, target, corev1.PersistentVolumeClaimModifyVolumeInProgress)
	c.Status.Conditions = setModifyCondition(c.Status.Conditions, corev1.PersistentVolumeClaimVolumeModifyingVolume, "", "ModifyVolume operation in progress.")
	return c
}

// setModifyCondition sets condition t (status True), as the resizer sets
// its own (mergeConditions): one already there keeps its transition time,
// and takes the new message only with another reason, so a retry of the
// same failure writes nothing.
func setModifyCondition(conds []corev1.PersistentVolumeClaimCondition, t corev1.PersistentVolumeClaimConditionType, reason, msg string) []corev1.PersistentVolumeClaimCondition {
	want := corev1.PersistentVolumeClaimCondition{Type: t, Status: corev1.ConditionTrue, Reason: reason, Message: msg, LastTransitionTime: metav1.Now()}
	return kube.MergeConditions(conds, []corev1.PersistentVolumeClaimCondition{want}, isModifyCondition, kube.KeepAll)
}

// clearModifyConditions drops the ModifyingVolume and ModifyVolumeError
// conditions.
func clearModifyConditions(conds []corev1.PersistentVolumeClaimCondition) []corev1.PersistentVolumeClaimCondition {
	return kube.MergeConditions(conds, nil, isModifyCondition, nil)
}

func isModifyCondition(t corev1.PersistentVolumeClaimConditionType) bool {
	return t == corev1.PersistentVolumeClaimVolumeModifyingVolume || t == corev1.PersistentVolumeClaimVolumeModifyVolumeError
}
