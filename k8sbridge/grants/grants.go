package grants

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	apiequality "k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"

	"github.com/csibroker/csibroker/policy"
)

// grantGVR is the SecretGrant resource (deploy/crds/).
var grantGVR = schema.GroupVersionResource{Group: policy.APIGroup, Version: "v1alpha1", Resource: policy.Resource}

const (
	// grantCompileKey is the one key of the compile queue: every change to
	// any grant recompiles them all, so a burst of changes coalesces into
	// one compile while the previous one runs.
	grantCompileKey = "all"
	// grantResync re-delivers every cached grant so statuses that drifted
	// (edited by hand, or a write lost with a leader) are put right.
	grantResync = 10 * time.Minute
	// grantLeaderPoll is how often the controller asks writeStatus whether
	// it has become the leader, to write the statuses a standby held back.
	grantLeaderPoll = 2 * time.Second
	// grantWatchLogEvery bounds how often a persisting list/watch failure
	// (the CRD not installed, RBAC) is logged; the reflector retries with
	// backoff in between.
	grantWatchLogEvery = time.Minute
	// grantFieldManager names the status writer in managedFields.
	grantFieldManager = "csibroker-secretgrants"
	// grantMaxMessage is the CRD's maxLength for a condition message.
	grantMaxMessage = 32768
)

// Controller watches SecretGrant objects in all namespaces with a
// dynamic informer and keeps a policy.Store equal to them: every change
// recompiles every grant (reusing compiled CEL conditions) and swaps the new
// rule set in at once. Until the first complete list has been compiled the
// store is left as it was (a new Store: no grants, enforce mode, so nothing
// is admitted); a partial list is never compiled, since a missing Deny grant
// would widen access.
//
// Each grant's outcome is reported in its status: conditions Valid and Ready
// with reason, message and observedGeneration, written only when they
// change and only while writeStatus returns true (the leader), so standby
// replicas keep their rules warm without writing.
type Controller struct {
	dyn         dynamic.Interface
	gvr         schema.GroupVersionResource
	store       *policy.Store
	log         *slog.Logger
	writeStatus func() bool

	informer cache.SharedIndexInformer
	handler  cache.ResourceEventHandlerRegistration

	// compileQ holds grantCompileKey; statusQ holds "namespace/name" keys of
	// grants whose status may need writing. Two queues, so that a backlog of
	// status writes behind a small client QPS never delays a policy change.
	compileQ workqueue.TypedRateLimitingInterface[string]
	statusQ  workqueue.TypedRateLimitingInterface[string]

	started atomic.Bool
	synced  atomic.Bool

	mu      sync.Mutex
	results map[string]grantResult // by namespace/name, from the last compile

	watchMu       sync.Mutex
	watchLastKind string
	watchLastLog  time.Time
	watchFailures int

	// For tests: list/watch failures seen, and status writes held back
	// because writeStatus returned false.
	watchErrors  atomic.Int64
	statusSkips  atomic.Int64
	statusWrites atomic.Int64
}

// grantResult is one grant's outcome in a compile.
type grantResult struct {
	namespace  string
	uid        types.UID // a grant deleted and made again under its name is another grant
	generation int64
	invalid    bool
	failClosed bool
	message    string
}

// NewController returns a controller that keeps store equal to the
// SecretGrant objects served through dyn. writeStatus is called before each
// status write (and every few seconds, to notice a new leadership); it must
// be safe for concurrent use. nil means always write. A nil log is
// slog.Default().
func NewController(dyn dynamic.Interface, store *policy.Store, log *slog.Logger, writeStatus func() bool) *Controller {
	return newController(dyn, grantGVR, store, log, writeStatus)
}

func newController(dyn dynamic.Interface, gvr schema.GroupVersionResource, store *policy.Store, log *slog.Logger, writeStatus func() bool) *Controller {
	if log == nil {
		log = slog.Default()
	}
	if writeStatus == nil {
		writeStatus = func() bool { return true }
	}
	c := &Controller{
		dyn:         dyn,
		gvr:         gvr,
		store:       store,
		log:         log.With("controller", "secretgrants"),
		writeStatus: writeStatus,
		compileQ: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.DefaultTypedControllerRateLimiter[string](),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "secretgrants_compile"}),
		statusQ: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.DefaultTypedControllerRateLimiter[string](),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "secretgrants_status"}),
	}
	c.informer = dynamicinformer.NewFilteredDynamicInformer(dyn, gvr, metav1.NamespaceAll, grantResync, cache.Indexers{}, nil).Informer()
	// Neither can fail before the informer starts.
	_ = c.informer.SetTransform(stripManagedFields)
	_ = c.informer.SetWatchErrorHandlerWithContext(c.watchError)
	c.handler, _ = c.informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(any) { c.compileQ.Add(grantCompileKey) },
		UpdateFunc: func(oldObj, newObj any) {
			if !grantSpecMayDiffer(oldObj, newObj) {
				// Status or metadata only (our own writes, a resync): the
				// rules are the same; check the status alone.
				if key, err := cache.MetaNamespaceKeyFunc(newObj); err == nil {
					c.statusQ.Add(key)
				}
				return
			}
			c.compileQ.Add(grantCompileKey)
		},
		DeleteFunc: func(any) { c.compileQ.Add(grantCompileKey) },
	})
	return c
}

// grantSpecMayDiffer says whether an update may change a grant's rules: its
// generation moved, or it is another object (a relist reports a grant
// deleted and made again under its name as an update, with the same
// generation and another UID).
func grantSpecMayDiffer(oldObj, newObj any) bool {
	o, errOld := meta.Accessor(oldObj)
	n, errNew := meta.Accessor(newObj)
	return errOld != nil || errNew != nil || o.GetGeneration() != n.GetGeneration() || o.GetUID() != n.GetUID()
}

// stripManagedFields keeps managedFields out of the cache: the controller
// never reads them.
func stripManagedFields(obj any) (any, error) {
	if u, ok := obj.(*unstructured.Unstructured); ok {
		u.SetManagedFields(nil)
	}
	return obj, nil
}

// HasSynced reports whether every SecretGrant has been listed and the store
// holds their compiled rule set.
func (c *Controller) HasSynced() bool { return c.synced.Load() }

// Run watches SecretGrants until ctx is done, then returns nil. While the
// resource cannot be listed (the CRD is not installed, or RBAC forbids it),
// it logs the error and keeps retrying, and the store is left untouched. Run
// may be called once.
func (c *Controller) Run(ctx context.Context) error {
	if !c.started.CompareAndSwap(false, true) {
		return errors.New("secretgrant controller: Run called twice")
	}
	var wg sync.WaitGroup
	defer func() {
		c.compileQ.ShutDown()
		c.statusQ.ShutDown()
		wg.Wait()
	}()
	wg.Go(func() { c.informer.RunWithContext(ctx) })

	c.log.Info("watching SecretGrants", "resource", c.gvr.String())
	start := time.Now()
	err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(context.Context) (bool, error) {
		return c.handler.HasSynced(), nil
	})
	if err != nil {
		return nil // ctx done before the first list
	}
	c.log.Info("SecretGrants listed", "grants", len(c.informer.GetIndexer().ListKeys()), "took", time.Since(start).Round(time.Millisecond))
	c.compileQ.Add(grantCompileKey)

	wg.Go(func() {
		for grantWorker(ctx, c.compileQ, c.compile, c.log) {
		}
	})
	wg.Go(func() {
		for grantWorker(ctx, c.statusQ, c.syncStatus, c.log) {
		}
	})
	wg.Go(func() { c.watchLeadership(ctx) })
	<-ctx.Done()
	return nil
}

// grantWorker processes one key of q: Forget on success, AddRateLimited on
// error. It returns false when q is shut down.
func grantWorker(ctx context.Context, q workqueue.TypedRateLimitingInterface[string], sync func(context.Context, string) error, log *slog.Logger) bool {
	key, shutdown := q.Get()
	if shutdown {
		return false
	}
	defer q.Done(key)
	if ctx.Err() != nil {
		return true // stopping
	}
	if err := sync(ctx, key); err != nil {
		if ctx.Err() == nil {
			level := slog.LevelWarn
			if apierrors.IsConflict(err) {
				level = slog.LevelDebug // a newer version is on its way
			}
			log.Log(ctx, level, "secretgrant sync failed; will retry", "key", key, "retries", q.NumRequeues(key), "err", err)
		}
		q.AddRateLimited(key)
		return true
	}
	q.Forget(key)
	return true
}

// compile compiles every cached grant into the store and queues the grants
// whose status no longer says what happened to them.
func (c *Controller) compile(ctx context.Context, _ string) error {
	start := time.Now()
	objs := c.informer.GetIndexer().List()
	grants := make([]policy.Grant, 0, len(objs))
	unreadable := make(map[string]string)
	live := make([]*unstructured.Unstructured, 0, len(objs))
	for _, o := range objs {
		u, ok := o.(*unstructured.Unstructured)
		if !ok {
			continue
		}
		live = append(live, u)
		g, err := grantFromObject(u)
		if err != nil {
			unreadable[g.Key()] = err.Error()
		}
		grants = append(grants, g)
	}

	errs := c.store.UpdateSource(policy.SourceSecretGrants, grants)

	results := make(map[string]grantResult, len(grants))
	for i, g := range grants {
		results[g.Key()] = grantResult{namespace: g.Namespace, uid: live[i].GetUID(), generation: g.Generation}
	}
	for _, e := range errs {
		r := results[e.Key()]
		r.invalid, r.failClosed, r.message = true, e.FailClosed, e.Message
		if msg, ok := unreadable[e.Key()]; ok {
			r.message = msg
		}
		results[e.Key()] = r
	}

	c.mu.Lock()
	prev := c.results
	c.results = results
	c.mu.Unlock()
	c.synced.Store(true)

	rs := c.store.Load()
	c.log.Info("SecretGrants compiled", "grants", len(grants), "valid", rs.Len(), "invalid", len(errs),
		"mode", string(rs.Mode()), "took", time.Since(start).Round(time.Microsecond))
	for key, r := range results {
		if !r.invalid {
			continue
		}
		if p, ok := prev[key]; ok && p.invalid && p.message == r.message && p.generation == r.generation {
			continue // logged already
		}
		c.log.Warn("invalid SecretGrant", "grant", key, "generation", r.generation, "fail_closed", r.failClosed, "problem", r.message)
	}

	for _, u := range live {
		key := u.GetNamespace() + "/" + u.GetName()
		if _, changed := statusUpdate(u, results[key]); changed {
			c.statusQ.Add(key)
		}
	}
	return nil
}

// grantFromObject converts a SecretGrant object. When its spec cannot be
// read, the Grant it returns has an empty spec, so that Compile rejects it,
// and keeps the action when it can be read: an unreadable grant that may be
// a Deny grant fails closed, as Compile does for invalid Deny grants.
func grantFromObject(u *unstructured.Unstructured) (policy.Grant, error) {
	g := policy.Grant{Namespace: u.GetNamespace(), Name: u.GetName(), Generation: u.GetGeneration()}
	spec, ok := u.Object["spec"].(map[string]any)
	if !ok {
		g.Spec.Action = grantActionOf(u)
		return g, errors.New("spec: missing or not an object")
	}
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(spec, &g.Spec); err != nil {
		g.Spec = policy.GrantSpec{Action: grantActionOf(u)}
		return g, fmt.Errorf("spec: cannot be read: %w", err)
	}
	return g, nil
}

// grantActionOf is spec.action as far as it can be read; anything but a
// readable Allow (or no action, which means Allow) is returned as something
// Compile treats as a Deny.
func grantActionOf(u *unstructured.Unstructured) policy.Action {
	a, found, err := unstructured.NestedString(u.Object, "spec", "action")
	switch {
	case err == nil && (!found || a == "" || a == string(policy.ActionAllow)):
		return policy.ActionAllow
	case err == nil:
		return policy.Action(a)
	default:
		return policy.Action("(unreadable)")
	}
}

// grantStatus is the part of a SecretGrant's status this controller owns.
type grantStatus struct {
	ObservedGeneration int64              `json:"observedGeneration,omitempty"`
	Conditions         []metav1.Condition `json:"conditions,omitempty"`
}

func readGrantStatus(u *unstructured.Unstructured) grantStatus {
	var st grantStatus
	if m, ok := u.Object["status"].(map[string]any); ok {
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(m, &st); err != nil {
			return grantStatus{} // unreadable: rewrite it
		}
	}
	return st
}

// statusUpdate returns the status u should have after r, and whether it
// differs from the one it has. Conditions of other types are kept, and a
// condition's lastTransitionTime only moves when its status does.
func statusUpdate(u *unstructured.Unstructured, r grantResult) (grantStatus, bool) {
	cur := readGrantStatus(u)
	want := grantStatus{ObservedGeneration: r.generation}
	want.Conditions = make([]metav1.Condition, len(cur.Conditions))
	for i := range cur.Conditions {
		cur.Conditions[i].DeepCopyInto(&want.Conditions[i])
	}
	valid, ready := r.conditions()
	meta.SetStatusCondition(&want.Conditions, valid)
	meta.SetStatusCondition(&want.Conditions, ready)
	return want, !apiequality.Semantic.DeepEqual(cur, want)
}

// conditions are the Valid and Ready conditions for r.
func (r grantResult) conditions() (valid, ready metav1.Condition) {
	valid = metav1.Condition{Type: policy.ConditionValid, ObservedGeneration: r.generation}
	ready = metav1.Condition{Type: policy.ConditionReady, ObservedGeneration: r.generation}
	switch {
	case !r.invalid:
		valid.Status, valid.Reason, valid.Message = metav1.ConditionTrue, policy.ReasonCompiled, "the grant compiled"
		ready.Status, ready.Reason = metav1.ConditionTrue, policy.ReasonApplied
		ready.Message = "in force for secrets in namespace " + r.namespace
	case r.failClosed:
		valid.Status, valid.Reason, valid.Message = metav1.ConditionFalse, policy.ReasonInvalid, grantTruncate(r.message)
		ready.Status, ready.Reason = metav1.ConditionTrue, policy.ReasonFailClosed
		ready.Message = "invalid Deny grant: every secret in namespace " + r.namespace + " is denied until it is fixed"
	default:
		valid.Status, valid.Reason, valid.Message = metav1.ConditionFalse, policy.ReasonInvalid, grantTruncate(r.message)
		ready.Status, ready.Reason = metav1.ConditionFalse, policy.ReasonNotApplied
		ready.Message = "not applied: the grant admits nothing until it is fixed (see the Valid condition)"
	}
	return valid, ready
}

// grantTruncate bounds a condition message to the CRD's maxLength, cutting
// at a rune boundary.
func grantTruncate(s string) string {
	if len(s) <= grantMaxMessage {
		return s
	}
	const ell = "..."
	i := grantMaxMessage - len(ell)
	for i > 0 && !utf8.RuneStart(s[i]) {
		i--
	}
	return s[:i] + ell
}

// syncStatus writes the status of the grant key from the last compile, when
// it differs from the one the grant has and this replica writes statuses.
func (c *Controller) syncStatus(ctx context.Context, key string) error {
	obj, exists, err := c.informer.GetIndexer().GetByKey(key)
	if err != nil || !exists {
		return nil // deleted: nothing to report
	}
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return nil
	}
	c.mu.Lock()
	r, ok := c.results[key]
	c.mu.Unlock()
	if !ok || r.generation != u.GetGeneration() || r.uid != u.GetUID() {
		return nil // not compiled yet: the pending compile queues it again
	}
	want, changed := statusUpdate(u, r)
	if !changed {
		return nil
	}
	if !c.writeStatus() {
		c.statusSkips.Add(1) // a standby: the leader writes it
		return nil
	}
	// The resourceVersion makes the write conditional: a grant changed
	// since it was compiled gets a conflict, and the next compile's status.
	patch, err := json.Marshal(map[string]any{
		"metadata": map[string]any{"resourceVersion": u.GetResourceVersion()},
		"status":   want,
	})
	if err != nil {
		return fmt.Errorf("encode status of secretgrant %s: %w", key, err)
	}
	_, err = c.dyn.Resource(c.gvr).Namespace(u.GetNamespace()).Patch(ctx, u.GetName(), types.MergePatchType, patch,
		metav1.PatchOptions{FieldManager: grantFieldManager}, "status")
	switch {
	case apierrors.IsNotFound(err):
		return nil
	case err != nil:
		return fmt.Errorf("write status of secretgrant %s: %w", key, err)
	}
	c.statusWrites.Add(1)
	c.log.Debug("SecretGrant status written", "grant", key, "generation", r.generation, "valid", !r.invalid)
	return nil
}

// watchLeadership queues every grant's status check when writeStatus turns
// true, so a new leader writes what the standby held back.
func (c *Controller) watchLeadership(ctx context.Context) {
	tick := time.NewTicker(grantLeaderPoll)
	defer tick.Stop()
	leading := c.writeStatus()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		now := c.writeStatus()
		if now && !leading {
			keys := c.informer.GetIndexer().ListKeys()
			c.log.Info("writing SecretGrant statuses as the leader", "grants", len(keys))
			for _, k := range keys {
				c.statusQ.Add(k)
			}
		}
		leading = now
	}
}

// watchError replaces the reflector's default handler (which logs through
// klog) so failures to list or watch SecretGrants are logged here, clearly,
// and not more than once a minute while they persist; the reflector keeps
// retrying with backoff.
func (c *Controller) watchError(ctx context.Context, _ *cache.Reflector, err error) {
	if ctx.Err() != nil || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || apierrors.IsResourceExpired(err) || apierrors.IsGone(err) {
		return // normal watch turnover: relisted at once
	}
	c.watchErrors.Add(1)
	kind := "watch"
	switch {
	case apierrors.IsNotFound(err):
		kind = "crd"
	case apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err):
		kind = "rbac"
	}

	c.watchMu.Lock()
	c.watchFailures++
	failures := c.watchFailures
	now := time.Now()
	due := kind != c.watchLastKind || now.Sub(c.watchLastLog) >= grantWatchLogEvery
	if due {
		c.watchLastKind, c.watchLastLog = kind, now
	}
	c.watchMu.Unlock()
	if !due {
		return
	}

	rs := c.store.Load()
	attrs := []any{"resource", c.gvr.String(), "failures", failures, "mode", string(rs.Mode()), "grants_in_force", rs.Len(), "effect", grantStoreEffect(rs), "err", err}
	switch kind {
	case "crd":
		c.log.Error("the SecretGrant CRD is not installed (apply deploy/crds/); retrying", attrs...)
	case "rbac":
		c.log.Error("not allowed to list/watch SecretGrants (check the broker's RBAC); retrying", attrs...)
	default:
		c.log.Warn("listing/watching SecretGrants failed; retrying", attrs...)
	}
}

// grantStoreEffect says in words what the store does while grants cannot be
// read.
func grantStoreEffect(rs *policy.RuleSet) string {
	switch {
	case rs.Mode() == policy.ModeOff:
		return "policy mode is off: every secret is handed out unchecked"
	case rs.Len() > 0:
		return "the grants loaded last stay in force"
	case rs.Mode() == policy.ModeAudit:
		return "no grants loaded: audit mode allows every secret and logs it as would-deny"
	default:
		return "no grants loaded: default deny in enforce mode, no secret is handed to any driver"
	}
}
