package provision

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	"github.com/csibroker/csibroker/internal/budget"
	"github.com/csibroker/csibroker/internal/telemetry"
	"github.com/csibroker/csibroker/k8sbridge/csiparams"
	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/secrets"
	"github.com/csibroker/csibroker/k8sbridge/topology"
	"github.com/csibroker/csibroker/policy"
)

// Provisioner turns pending claims of registered drivers into volumes and PVs.
type Provisioner struct {
	b     *kube.Env
	queue *kube.TermQueue

	slots *kube.DriverSlots // operations in flight per driver (PerDriverWorkers)

	mu       sync.Mutex
	inflight map[string]bool          // volume names being provisioned here
	started  map[string]time.Time     // first pick-up of a claim, for the duration metric
	recover  chan struct{}            // nudges the recovery loop
	recFails map[string]recoveryState // failed recovery attempts per volume
	// asked is the accessibility requirement of a claim's CreateVolume
	// whose volume may exist (its answer may still come, or it came and
	// the PV is not saved yet), by claim UID: the next attempt asks the
	// same, not a topology computed anew (a node gone, one added, the
	// selected node rescheduled), which the driver would refuse
	// (AlreadyExists) or answer with a second volume. Dropped once the
	// claim is provisioned or the driver gave a final answer, as
	// external-provisioner keeps its per-claim topology cache.
	asked map[types.UID]*csi.TopologyRequirement
	// noRoom: the nodes that answered a claim's CreateVolume
	// ResourceExhausted where the broker placed it (an Immediate claim of
	// a node-local driver), by claim UID: placement tries them last.
	noRoom map[types.UID][]string

	// afterCreate, when set (tests), runs after CreateVolume succeeded and
	// before anything else: a broker dying there must leak nothing.
	AfterCreate func(ctx context.Context, volumeName string)
	// recoveryPasses counts the recovery passes that read the record
	// (tests wait for passes instead of time).
	recoveryPasses atomic.Int64
}

func NewProvisioner(b *kube.Env) *Provisioner {
	p := &Provisioner{
		b:        b,
		queue:    b.NewTermQueue("provision"),
		inflight: map[string]bool{},
		started:  map[string]time.Time{},
		asked:    map[types.UID]*csi.TopologyRequirement{},
		noRoom:   map[types.UID][]string{},
		recover:  make(chan struct{}, 1),
	}
	p.slots = p.queue.WithSlots(b.Cfg.PerDriverWorkers)
	p.queue.ReportOn(b.ClaimOfKey)
	b.Metrics.QueueDepth("provision", p.queue.Len)
	return p
}

func (p *Provisioner) ClaimHandler() cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { p.enqueueClaim(obj) },
		UpdateFunc: func(_, obj any) { p.enqueueClaim(obj) },
		DeleteFunc: func(obj any) {
			// A claim deleted while its volume is being made: recovery
			// deletes the volume if it exists. Other deletions (bound
			// claims, a namespace teardown) cost no recovery pass.
			c, ok := kube.Deleted[*corev1.PersistentVolumeClaim](obj)
			if ok {
				p.b.ForgetEvents(c.UID)
				p.setAsked(c.UID, nil)
				p.forgetNoRoom(c.UID)
			}
			if ok && p.b.Intents.Has(csiparams.VolumeName(p.b.Cfg.VolumeNamePrefix, c.UID, p.b.Cfg.VolumeNameUUIDLength)) {
				p.nudgeRecovery()
			}
			if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
				p.queue.Forget(key)
				p.mu.Lock()
				delete(p.started, key)
				p.mu.Unlock()
			}
		},
	}
}

func (p *Provisioner) enqueueClaim(obj any) {
	claim, ok := obj.(*corev1.PersistentVolumeClaim)
	if !ok || claim.Spec.VolumeName != "" || p.claimDriver(claim) == "" {
		return
	}
	if key, err := cache.MetaNamespaceKeyFunc(claim); err == nil {
		p.queue.Add(key)
	}
}

func (p *Provisioner) nudgeRecovery() {
	select {
	case p.recover <- struct{}{}:
	default:
	}
}

// claimDriver is the registered driver the PV controller asked to provision
// the claim, or "".
func (p *Provisioner) claimDriver(claim *corev1.PersistentVolumeClaim) string {
	d := claim.Annotations[kube.AnnStorageProvisioner]
	if d == "" {
		d = claim.Annotations[kube.AnnBetaStorageProvisioner]
	}
	if d == "" || !p.b.Registered(d) {
		return ""
	}
	return d
}

func (p *Provisioner) Run(ctx context.Context) {
	// Claims that arrived while another replica led are in the cache already.
	p.queue.Work(ctx, p.b.Cfg.WorkerThreads, p.EnqueueAll, p.sync)
}

// enqueueAll adds every claim that may need provisioning (start of a term,
// a driver newly registered).
func (p *Provisioner) EnqueueAll() {
	if claims, err := p.b.Claims.List(labels.Everything()); err == nil {
		for _, c := range claims {
			p.enqueueClaim(c)
		}
	}
}

// volumeBusyRetry is how soon a claim whose volume recovery is working on
// is looked at again.
const volumeBusyRetry = 200 * time.Millisecond

// acquire takes the volume and a per-driver slot for key. 0 means both
// are taken; otherwise the volume is being worked on already, by a worker
// or by recovery (volumeBusyRetry), or key waits in the driver's line
// (waitForSlot).
func (p *Provisioner) acquire(driver, volume, key string) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.inflight[volume] {
		return volumeBusyRetry
	}
	if !p.slots.Acquire(driver, key) {
		return kube.WaitForSlot
	}
	p.inflight[volume] = true
	return 0
}

func (p *Provisioner) release(driver, volume string) {
	p.dropVolume(volume)
	p.slots.Release(driver)
}

// takeVolume takes the volume alone (recovery); false means a worker or
// recovery is working on it already.
func (p *Provisioner) takeVolume(volume string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.inflight[volume] {
		return false
	}
	p.inflight[volume] = true
	return true
}

func (p *Provisioner) dropVolume(volume string) {
	p.mu.Lock()
	delete(p.inflight, volume)
	p.mu.Unlock()
}

func (p *Provisioner) isInflight(volume string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.inflight[volume]
}

// sync provisions one claim. A returned duration asks for a plain requeue
// (waiting, not failing); an error requeues with the claim's backoff.
func (p *Provisioner) sync(ctx context.Context, key string) (time.Duration, error) {
	claim, err := p.b.CachedClaim(key)
	if claim == nil || err != nil {
		return 0, err
	}
	ns, name := claim.Namespace, claim.Name
	if claim.Spec.VolumeName != "" || claim.DeletionTimestamp != nil {
		return 0, nil
	}
	driver := p.claimDriver(claim)
	if driver == "" {
		return 0, nil
	}
	className := claimClass(claim)
	pvName := csiparams.VolumeName(p.b.Cfg.VolumeNamePrefix, claim.UID, p.b.Cfg.VolumeNameUUIDLength)
	if _, err := p.b.Volumes.Get(pvName); err == nil {
		return 0, nil // provisioned; the PV controller binds it
	}
	class, err := p.b.Classes.Get(className)
	if err != nil {
		msg := fmt.Sprintf("storageclass %q not found", className)
		p.b.Log.Warn("provisioning failed", "claim", key, "driver", driver, "err", msg)
		p.b.EventOnce(ctx, kube.ClaimRef(claim), corev1.EventTypeWarning, "ProvisioningFailed", msg, "%s", msg)
		return 0, fmt.Errorf("claim %s: storageclass %q: %w", key, className, err)
	}
	inTree := "" // the in-tree plugin of a migrated class
	if class.Provisioner != driver {
		// An in-tree class whose plugin CSI migration moves to driver (the
		// PV controller named driver in the claim's annotation): made
		// through the class's CSI translation, the PV in-tree again
		// (buildPV), as external-provisioner does.
		if kube.MigratedDriver(class.Provisioner) != driver {
			return 0, nil
		}
		inTree = class.Provisioner
		t, err := kube.Migration.TranslateInTreeStorageClassToCSI(klog.Background(), class.Provisioner, class)
		if err != nil {
			msg := fmt.Sprintf("storageclass %q of in-tree plugin %s: translating it for CSI driver %s (CSI migration): %v", class.Name, class.Provisioner, driver, err)
			p.b.Log.Warn("provisioning failed", "claim", key, "driver", driver, "err", msg)
			p.b.EventOnce(ctx, kube.ClaimRef(claim), corev1.EventTypeWarning, "ProvisioningFailed", msg, "%s", msg)
			return 0, errors.New(msg)
		}
		class = t
	}
	if populated(claim) {
		// As external-provisioner: a data source of another kind is a
		// volume populator's to fill; it provisions the volume itself.
		p.b.EventOnce(ctx, kube.ClaimRef(claim), corev1.EventTypeNormal, "Provisioning", "populator", "Assuming an external populator will provision the volume")
		return 0, nil
	}
	selectedNode := claim.Annotations[kube.AnnSelectedNode]
	if class.VolumeBindingMode != nil && *class.VolumeBindingMode == storagev1.VolumeBindingWaitForFirstConsumer && selectedNode == "" {
		return 0, nil // the scheduler has not picked a node yet
	}
	if wait := p.acquire(driver, pvName, key); wait != 0 {
		return wait, nil
	}
	defer p.release(driver, pvName)
	p.b.TestHook("provision", driver, key)
	ctx = budget.WithDriver(ctx, driver) // its writes wait in turn with other drivers'
	p.mu.Lock()
	if _, ok := p.started[key]; !ok {
		p.started[key] = time.Now()
	}
	p.mu.Unlock()

	ctx, span := p.b.Tracer.Start(ctx, "provision "+key, trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(
		attribute.String("csi.driver", driver), attribute.String("k8s.pvc.namespace", ns), attribute.String("k8s.pvc.name", name),
		attribute.String("k8s.storageclass", className), attribute.String("k8s.pv.name", pvName), attribute.String("k8s.node", selectedNode)))
	defer span.End()
	result, err := p.provision(ctx, claim, class, inTree, driver, pvName, selectedNode)
	p.b.Metrics.Provisions.WithLabelValues(driver, className, result).Inc()
	if err != nil {
		span.SetStatus(otelcodes.Error, result)
		return 0, err
	}
	if result == "success" || result == "claim_deleted" {
		p.setAsked(claim.UID, nil)
		p.forgetNoRoom(claim.UID)
	}
	if result == "success" {
		p.mu.Lock()
		if t, ok := p.started[key]; ok {
			// The provisioning's trace ID as an exemplar.
			telemetry.ObserveTraced(p.b.Metrics.ProvisionTime.WithLabelValues(driver, className), time.Since(t).Seconds(), span.SpanContext())
			delete(p.started, key)
		}
		p.mu.Unlock()
	}
	return 0, nil
}

// askedBefore is the accessibility requirement an earlier attempt of the
// claim asked for a volume that may exist (see provisioner.asked), nil if
// none: a node-local driver's attempts are settled by node instead, and a
// driver without topology is asked none.
func (p *Provisioner) askedBefore(uid types.UID, driver string, caps drivers.Caps) *csi.TopologyRequirement {
	if !caps.Accessibility || p.b.Cfg.Drivers.NodeLocal(driver) {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.asked[uid]
}

// setAsked records tr as what the claim's volume was asked with (nil:
// forgets it).
func (p *Provisioner) setAsked(uid types.UID, tr *csi.TopologyRequirement) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if tr == nil {
		delete(p.asked, uid)
		return
	}
	p.asked[uid] = tr
}

// settleExistingPV is called when PV pvName turned out to exist already
// after this attempt's CreateVolume returned volumeID (on node, for a
// node-local driver). If the PV holds that volume, nothing is left to do.
// If it names another node, the volume made here is a second one: it is
// deleted (an error keeps the intent entry, whose volume recovery then
// deletes). A PV that holds another volume of a driver that is not
// node-local is reported and left alone: the driver answered one name
// with two IDs, and deleting either could delete the PV's data.
func (p *Provisioner) settleExistingPV(ctx context.Context, claim *corev1.PersistentVolumeClaim, driver, node, pvName, volumeID string, secretRef *corev1.SecretReference, requester policy.Requester) error {
	pv, err := p.b.Cfg.Client.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{})
	if err != nil {
		// Gone again (or unreadable): the next attempt saves it anew.
		return fmt.Errorf("read it: %w", err)
	}
	log := p.b.Log.With("claim", claim.Namespace+"/"+claim.Name, "driver", driver, "pv", pvName, "volume_id", volumeID)
	if other := recordedNode(pv); !holdsNodeVolume(other, node) {
		if err := p.deleteVolume(ctx, driver, node, volumeID, secretRef, requester); err != nil {
			p.b.Metrics.Leaked.WithLabelValues(driver, "failed").Inc()
			return fmt.Errorf("it holds the volume of node %s, and deleting the second volume this attempt made on node %s failed: %w", other, node, err)
		}
		p.b.Metrics.Leaked.WithLabelValues(driver, "deleted").Inc()
		log.Info("an earlier attempt saved this PersistentVolume with its volume on another node; deleted the second volume this attempt made", "pv_node", other, "node", node)
		return nil
	}
	var src *corev1.CSIPersistentVolumeSource
	if spec, err := kube.CSISpec(pv); err == nil { // a migrated in-tree PV's translation
		src = spec.CSI
	}
	if src == nil || src.Driver != driver || src.VolumeHandle != volumeID {
		handle := ""
		if src != nil {
			handle = src.Driver + " " + src.VolumeHandle
		}
		log.Error("PersistentVolume exists with another volume; the volume the driver returned is left for an administrator", "pv_volume", handle)
		p.b.Event(ctx, kube.ClaimRef(claim), corev1.EventTypeWarning, "ProvisioningOrphan",
			"PersistentVolume %s exists already and holds volume %q, but driver %s answered CreateVolume %s with volume %s; that volume is left to an administrator", pvName, handle, driver, pvName, volumeID)
	}
	return nil
}

// recordedTopologyMax is how many topology segments a recorded request
// keeps as they were sent.
const recordedTopologyMax = 16

// recordedTopology is the accessibility requirement kept in the intent
// record. A requirement of many segments (a driver whose topology key is
// the node: one segment per node) would make one entry grow with the
// cluster until the record holds a handful of them; such a requirement is
// recorded as its first preferred segment only. The recorded request is
// re-issued only to learn the ID of a volume made already, and with no
// requisite list the volume is accessible wherever the driver made it.
func recordedTopology(tr *csi.TopologyRequirement) *csi.TopologyRequirement {
	if tr == nil || len(tr.GetRequisite())+len(tr.GetPreferred()) <= recordedTopologyMax {
		return tr
	}
	if len(tr.GetPreferred()) == 0 {
		return nil
	}
	return &csi.TopologyRequirement{Preferred: tr.GetPreferred()[:1]}
}

// discardVolume deletes the volume volumeID this attempt made for pvName
// (on node, for a node-local driver) unless a PersistentVolume holds it
// already (an earlier attempt's, which the cache may not show yet: its
// reclaim policy decides then). The intent entry is dropped once the
// volume is accounted for (held, or deleted) and kept on an error, for the
// retry or recovery: readErr, the PV could not be read; deleteErr, the
// volume could not be deleted. The secret goes to the same requester as
// the CreateVolume's (its node, its labels).
func (p *Provisioner) discardVolume(ctx context.Context, driver, node, pvName, volumeID string, secretRef *corev1.SecretReference, requester policy.Requester) (held bool, readErr, deleteErr error) {
	if held, readErr = p.pvHolds(ctx, pvName, node); readErr != nil {
		return false, readErr, nil
	}
	if !held {
		if deleteErr = p.deleteVolume(ctx, driver, node, volumeID, secretRef, requester); deleteErr != nil {
			return false, nil, deleteErr
		}
	}
	p.b.Intents.Remove(pvName)
	return held, nil, nil
}

// absent: an object the cache does not have (cached, the lister's error)
// that the API server does not have either (get): the cache may lag
// behind a new object.
func absent(cached error, get func() error) bool {
	return apierrors.IsNotFound(cached) && apierrors.IsNotFound(get())
}

// nodeGone reports whether node no longer exists.
func (p *Provisioner) nodeGone(ctx context.Context, node string) bool {
	_, err := p.b.Nodes.Get(node)
	return absent(err, func() error {
		_, err := p.b.Cfg.Client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		return err
	})
}

// csiNodeGone reports whether node has no CSINode object.
func (p *Provisioner) csiNodeGone(ctx context.Context, node string) bool {
	_, err := p.b.CSINodes.Get(node)
	return absent(err, func() error {
		_, err := p.b.Cfg.Client.StorageV1().CSINodes().Get(ctx, node, metav1.GetOptions{})
		return err
	})
}

// populated reports whether the claim's data source (dataSourceRef, or
// dataSource) is neither a claim to clone nor a VolumeSnapshot: a volume
// populator provisions such a claim.
func populated(claim *corev1.PersistentVolumeClaim) bool {
	group, kind := "", ""
	switch {
	case claim.Spec.DataSourceRef != nil:
		kind = claim.Spec.DataSourceRef.Kind
		if g := claim.Spec.DataSourceRef.APIGroup; g != nil {
			group = *g
		}
	case claim.Spec.DataSource != nil:
		kind = claim.Spec.DataSource.Kind
		if g := claim.Spec.DataSource.APIGroup; g != nil {
			group = *g
		}
	default:
		return false
	}
	switch {
	case group == "" && kind == "PersistentVolumeClaim", group == SnapshotGroup && kind == SnapshotKind:
		return false
	}
	return true
}

// vacName is the claim's VolumeAttributesClass for its PV: nil for none
// (an empty name on a claim is none; a PV may not carry one).
func vacName(claim *corev1.PersistentVolumeClaim) *string {
	if n := claim.Spec.VolumeAttributesClassName; n != nil && *n != "" {
		return n
	}
	return nil
}

// claimClass is the claim's StorageClass name: the beta annotation when set
// (as Kubernetes reads it), else spec.storageClassName.
func claimClass(claim *corev1.PersistentVolumeClaim) string {
	if c, ok := claim.Annotations[kube.AnnBetaStorageClass]; ok {
		return c
	}
	if claim.Spec.StorageClassName != nil {
		return *claim.Spec.StorageClassName
	}
	return ""
}

// provision runs one attempt and returns its result label. An attempt is a
// sequence of phases (attempt.go); each either lets the next go on or
// ends the attempt with its outcome.
func (p *Provisioner) provision(ctx context.Context, claim *corev1.PersistentVolumeClaim, class *storagev1.StorageClass, inTree, driver, pvName, selectedNode string) (string, error) {
	a := &attempt{p: p, ctx: ctx, claim: claim, class: class, inTree: inTree, driver: driver, pvName: pvName,
		selectedNode: selectedNode, scheduled: selectedNode != "", ref: kube.ClaimRef(claim)}
	for _, phase := range []func() *outcome{
		a.validate,       // the claim and the driver can be provisioned at all
		a.earlierAttempt, // what an earlier attempt recorded and asked; a gone node goes back to the scheduler
		a.placeNodeLocal, // a node-local driver's node: an earlier attempt's, or the broker's choice
		a.prepareRequest, // the request, its secrets decided, a clone's or restore's source protected
		a.recordIntent,   // the intent durable on the API server before the call
		a.call,           // CreateVolume, its failures classified
	} {
		if o := phase(); o != nil {
			return o.result, o.err
		}
	}
	o := a.recordResult() // the PV saved, or the volume discarded
	return o.result, o.err
}

// conn picks the driver's controller proxy, or for a node-local driver the
// proxy on the volume's node.
func (p *Provisioner) conn(driver, node string) (grpc.ClientConnInterface, error) {
	return p.b.DriverConn(driver, node)
}

// placeOnNode picks the node with the most free capacity among the
// driver's node proxies for a node-local volume.
func (p *Provisioner) placeOnNode(ctx context.Context, claim *corev1.PersistentVolumeClaim, class *storagev1.StorageClass, driver string, caps drivers.Caps) (string, error) {
	nodes := p.b.Cfg.Drivers.DriverNodes(driver)
	if len(nodes) == 0 {
		return "", fmt.Errorf("node-local driver %s has no node proxy registered", driver)
	}
	if len(class.AllowedTopologies) > 0 {
		var allowed []string
		for _, n := range nodes {
			if node, err := p.b.Nodes.Get(n); err == nil && topology.InAllowed(class.AllowedTopologies, node.Labels) {
				allowed = append(allowed, n)
			}
		}
		if len(allowed) == 0 {
			return "", fmt.Errorf("no node of node-local driver %s (%s) is in StorageClass %q's allowedTopologies", driver, strings.Join(nodes, ", "), class.Name)
		}
		nodes = allowed
	}
	// Claims are spread as external-provisioner spreads segments (by the
	// claim's name, a StatefulSet's replicas on successive nodes), and the
	// nodes that answered this claim ResourceExhausted come last: taken
	// only if no other has room.
	h, i := topology.ClaimNameHashAndIndex(claim.Name)
	start := int((h + i) % uint32(len(nodes)))
	nodes = append(slices.Clone(nodes[start:]), nodes[:start]...)
	refused := p.noRoomNodes(claim.UID)
	fresh := slices.DeleteFunc(slices.Clone(nodes), func(n string) bool { return slices.Contains(refused, n) })
	last := slices.DeleteFunc(slices.Clone(nodes), func(n string) bool { return !slices.Contains(refused, n) })
	capRange, err := csiparams.CapacityRange(claim)
	if err != nil {
		return "", err
	}
	if !caps.GetCapacity {
		return slices.Concat(fresh, last)[0], nil
	}
	params, fsType, err := csiparams.CreateParameters(class.Parameters, false, "", claim, p.b.Cfg.DefaultFSType)
	if err != nil {
		return "", fmt.Errorf("storageclass %q: %w", class.Name, err)
	}
	volCaps, err := csiparams.VolumeCapabilities(claim, fsType, class.MountOptions, caps.SingleNodeMultiWriter)
	if err != nil {
		return "", err
	}
	var seen []string
	for _, group := range [][]string{fresh, last} {
		best, bestFree := "", int64(-1)
		for _, n := range group {
			conn, err := p.b.Cfg.Drivers.NodeConn(driver, n)
			if err != nil {
				seen = append(seen, fmt.Sprintf("%s: %v", n, err))
				continue
			}
			callCtx, cancel := p.b.CallContext(ctx, driver, "GetCapacity")
			resp, err := csi.NewControllerClient(conn).GetCapacity(callCtx, &csi.GetCapacityRequest{Parameters: params, VolumeCapabilities: volCaps})
			cancel()
			if err != nil {
				seen = append(seen, fmt.Sprintf("%s: %s", n, kube.StatusText(err)))
				continue
			}
			free := resp.GetAvailableCapacity()
			seen = append(seen, fmt.Sprintf("%s: %d bytes free", n, free))
			if free >= capRange.GetRequiredBytes() && free > bestFree {
				best, bestFree = n, free
			}
		}
		if best != "" {
			return best, nil
		}
	}
	return "", fmt.Errorf("no node of node-local driver %s has %d bytes free (%s)", driver, capRange.GetRequiredBytes(), strings.Join(seen, "; "))
}

// noteNoRoom records that node answered the claim's CreateVolume
// ResourceExhausted; noRoomNodes lists those nodes; forgetNoRoom forgets
// them.
func (p *Provisioner) noteNoRoom(uid types.UID, node string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !slices.Contains(p.noRoom[uid], node) {
		p.noRoom[uid] = append(p.noRoom[uid], node)
	}
}

func (p *Provisioner) noRoomNodes(uid types.UID) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.noRoom[uid])
}

func (p *Provisioner) forgetNoRoom(uid types.UID) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.noRoom, uid)
}

// buildRequest makes the CreateVolumeRequest (without secrets) and resolves
// the provisioner secret reference. Its errors are the claim's or class's
// fault and say which field is wrong.
func (p *Provisioner) buildRequest(ctx context.Context, claim *corev1.PersistentVolumeClaim, class *storagev1.StorageClass, driver, pvName, selectedNode string, caps drivers.Caps, asked *csi.TopologyRequirement) (*csi.CreateVolumeRequest, *corev1.SecretReference, *snapshotv1.VolumeSnapshot, error) {
	params, fsType, err := csiparams.CreateParameters(class.Parameters, p.b.Cfg.ExtraCreateMetadata, pvName, claim, p.b.Cfg.DefaultFSType)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("storageclass %q: %w", class.Name, err)
	}
	volCaps, err := csiparams.VolumeCapabilities(claim, fsType, class.MountOptions, caps.SingleNodeMultiWriter)
	if err != nil {
		return nil, nil, nil, err
	}
	capRange, err := csiparams.CapacityRange(claim)
	if err != nil {
		return nil, nil, nil, err
	}
	secretRef, err := secrets.Ref(secrets.Provisioner, class.Parameters, pvName, claim)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("storageclass %q: %w", class.Name, err)
	}
	// Every other secret named by the class must resolve now, so a typo is
	// reported at provisioning rather than at attach or mount time.
	for _, k := range secrets.Kinds() {
		if k == secrets.Provisioner {
			continue // resolved above
		}
		if _, err := secrets.Ref(k, class.Parameters, pvName, claim); err != nil {
			return nil, nil, nil, fmt.Errorf("storageclass %q: %w", class.Name, err)
		}
	}
	req := &csi.CreateVolumeRequest{Name: pvName, Parameters: params, VolumeCapabilities: volCaps, CapacityRange: capRange}
	if name := vacName(claim); name != nil {
		// As external-provisioner: the class's parameters are the
		// volume's mutable parameters; the PV names the class (buildPV),
		// which the PV controller requires to bind it.
		if !caps.Modify {
			return nil, nil, nil, fmt.Errorf("volumeattributesclass %q: driver %s does not support volume attributes classes (no MODIFY_VOLUME capability)", *name, driver)
		}
		vac, err := p.b.Cfg.Client.StorageV1().VolumeAttributesClasses().Get(ctx, *name, metav1.GetOptions{})
		if err != nil {
			return nil, nil, nil, fmt.Errorf("volumeattributesclass %q: %w", *name, err)
		}
		if vac.DriverName != driver {
			return nil, nil, nil, fmt.Errorf("volumeattributesclass %q is for driver %s, not %s", *name, vac.DriverName, driver)
		}
		req.MutableParameters = maps.Clone(vac.Parameters)
	}
	if caps.Accessibility && asked != nil {
		// An earlier attempt's, whose volume may exist (askedBefore).
		req.AccessibilityRequirements = proto.Clone(asked).(*csi.TopologyRequirement)
	} else if caps.Accessibility {
		in := topology.Input{Driver: driver, ClaimName: claim.Name, AllowedTopologies: class.AllowedTopologies,
			StrictTopology: p.b.Cfg.StrictTopology, ImmediateTopology: p.b.Cfg.ImmediateTopology}
		nodes, err := p.topologyNodes(driver)
		if err != nil {
			return nil, nil, nil, err
		}
		in.Nodes = nodes
		if selectedNode != "" {
			found := false
			for i := range nodes {
				if nodes[i].Name == selectedNode {
					n := nodes[i]
					in.SelectedNode = &n
					found = true
				}
			}
			if !found {
				return nil, nil, nil, fmt.Errorf("selected node %q not found", selectedNode)
			}
		}
		tr, err := topology.AccessibilityRequirements(in)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("topology: %w", err)
		}
		req.AccessibilityRequirements = tr
	}
	var snap *snapshotv1.VolumeSnapshot
	if ds := claim.Spec.DataSource; ds != nil {
		src, s, err := p.contentSource(ctx, claim, driver, capRange, caps)
		if err != nil {
			return nil, nil, nil, err
		}
		req.VolumeContentSource, snap = src, s
	}
	return req, secretRef, snap, nil
}

// topologyNodes is the cluster as topology decisions see it for driver
// (topology.NodesOf: a CSINode whose Node is missing is no node; of two
// entries for the driver in one CSINode, the first counts).
func (p *Provisioner) topologyNodes(driver string) ([]topology.Node, error) {
	nodes, err := p.b.Nodes.List(labels.Everything())
	if err != nil {
		return nil, err
	}
	csiNodes, err := p.b.CSINodes.List(labels.Everything())
	if err != nil {
		return nil, err
	}
	return topology.NodesOf(nodes, csiNodes, driver), nil
}

// contentSource supports cloning from a bound claim of the same driver in
// the same namespace, and restoring a VolumeSnapshot of the driver
// (snapshotSource, whose snapshot as read it returns too).
func (p *Provisioner) contentSource(ctx context.Context, claim *corev1.PersistentVolumeClaim, driver string, capRange *csi.CapacityRange, caps drivers.Caps) (*csi.VolumeContentSource, *snapshotv1.VolumeSnapshot, error) {
	ds := claim.Spec.DataSource
	if ds.Kind == SnapshotKind && ds.APIGroup != nil && *ds.APIGroup == SnapshotGroup {
		return p.snapshotSource(ctx, claim, driver, caps)
	}
	if ds.Kind != "PersistentVolumeClaim" || (ds.APIGroup != nil && *ds.APIGroup != "") {
		// Populators are skipped before this.
		return nil, nil, fmt.Errorf("data source %s %q is not supported (only PersistentVolumeClaim clones and %s VolumeSnapshots)", ds.Kind, ds.Name, SnapshotGroup)
	}
	if !caps.Clone {
		return nil, nil, fmt.Errorf("driver %s does not support cloning (no CLONE_VOLUME capability)", driver)
	}
	src, err := p.b.Claims.PersistentVolumeClaims(claim.Namespace).Get(ds.Name)
	if err != nil {
		return nil, nil, fmt.Errorf("clone source claim %s/%s: %w", claim.Namespace, ds.Name, err)
	}
	if src.Status.Phase != corev1.ClaimBound || src.Spec.VolumeName == "" {
		return nil, nil, fmt.Errorf("clone source claim %s/%s is not bound", claim.Namespace, ds.Name)
	}
	// A source being deleted is refused, unless a clone of it began before
	// (it holds cloneFinalizer): that copy is retried, as a restore is.
	if src.DeletionTimestamp != nil && !slices.Contains(src.Finalizers, CloneFinalizer) {
		return nil, nil, fmt.Errorf("clone source claim %s/%s is being deleted", claim.Namespace, ds.Name)
	}
	pv, err := p.b.Volumes.Get(src.Spec.VolumeName)
	if err != nil {
		return nil, nil, fmt.Errorf("clone source volume %s: %w", src.Spec.VolumeName, err)
	}
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != driver {
		return nil, nil, fmt.Errorf("clone source claim %s/%s belongs to another driver", claim.Namespace, ds.Name)
	}
	// As external-provisioner: the source claim's request bounds the
	// clone (its volume may be larger: drivers round sizes up).
	if q, ok := src.Spec.Resources.Requests[corev1.ResourceStorage]; ok && capRange != nil && q.CmpInt64(capRange.RequiredBytes) > 0 {
		return nil, nil, fmt.Errorf("clone source claim %s/%s requests %s, more than this claim", claim.Namespace, ds.Name, q.String())
	}
	if from, to := csiparams.VolumeMode(src.Spec.VolumeMode), csiparams.VolumeMode(claim.Spec.VolumeMode); from != to {
		return nil, nil, fmt.Errorf("clone source claim %s/%s has volume mode %s, this claim %s", claim.Namespace, ds.Name, from, to)
	}
	return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: pv.Spec.CSI.VolumeHandle}}}, nil, nil
}

// buildPV makes the PersistentVolume for a created volume.
// inTree is the in-tree plugin of a migrated class ("" for a CSI class):
// the PV is then that plugin's, as upstream makes it.
func (p *Provisioner) buildPV(claim *corev1.PersistentVolumeClaim, class *storagev1.StorageClass, inTree, driver, pvName string, vol *csi.Volume, req *csi.CreateVolumeRequest, provSecret *corev1.SecretReference) (*corev1.PersistentVolume, error) {
	size := vol.GetCapacityBytes()
	if size == 0 {
		size = req.GetCapacityRange().GetRequiredBytes()
	}
	reclaim := corev1.PersistentVolumeReclaimDelete
	if class.ReclaimPolicy != nil {
		reclaim = *class.ReclaimPolicy
	}
	fsType := ""
	for _, c := range req.GetVolumeCapabilities() {
		if m := c.GetMount(); m != nil {
			fsType = m.GetFsType()
		}
	}
	src := &corev1.CSIPersistentVolumeSource{Driver: driver, VolumeHandle: vol.GetVolumeId(), FSType: fsType, VolumeAttributes: vol.GetVolumeContext()}
	if p.b.Cfg.ControllerPublishReadOnly && len(claim.Spec.AccessModes) == 1 && claim.Spec.AccessModes[0] == corev1.ReadOnlyMany {
		src.ReadOnly = true
	}
	for _, k := range []struct {
		kind secrets.Kind
		dst  **corev1.SecretReference
	}{
		{secrets.ControllerPublish, &src.ControllerPublishSecretRef},
		{secrets.NodeStage, &src.NodeStageSecretRef},
		{secrets.NodePublish, &src.NodePublishSecretRef},
		{secrets.ControllerExpand, &src.ControllerExpandSecretRef},
		{secrets.NodeExpand, &src.NodeExpandSecretRef},
	} {
		ref, err := secrets.Ref(k.kind, class.Parameters, pvName, claim)
		if err != nil {
			return nil, err
		}
		*k.dst = ref
	}
	provisionedBy := driver
	if inTree != "" {
		provisionedBy = inTree // as upstream records a migrated class's PV
	}
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: pvName, Annotations: map[string]string{kube.AnnProvisionedBy: provisionedBy}},
		Spec: corev1.PersistentVolumeSpec{
			AccessModes:                   claim.Spec.AccessModes,
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: *resource.NewQuantity(size, resource.BinarySI)},
			PersistentVolumeSource:        corev1.PersistentVolumeSource{CSI: src},
			PersistentVolumeReclaimPolicy: reclaim,
			StorageClassName:              class.Name,
			MountOptions:                  class.MountOptions,
			VolumeMode:                    claim.Spec.VolumeMode,
			VolumeAttributesClassName:     vacName(claim),
			ClaimRef:                      &corev1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: claim.Namespace, Name: claim.Name, UID: claim.UID},
			NodeAffinity:                  topology.NodeAffinity(vol.GetAccessibleTopology()),
		},
	}
	if reclaim == corev1.PersistentVolumeReclaimDelete {
		pv.Finalizers = []string{kube.FinalizerVolume}
	}
	// As external-provisioner: the secret for ControllerModifyVolume, for
	// whoever calls it.
	if ref, err := secrets.Ref(secrets.ControllerModify, class.Parameters, pvName, claim); err != nil {
		return nil, err
	} else if ref != nil {
		pv.Annotations[kube.AnnModifySecretName], pv.Annotations[kube.AnnModifySecretNS] = ref.Name, ref.Namespace
	}
	// As external-provisioner: the deletion secret, or that there is none
	// (both empty), so the PV's deletion does not depend on its class.
	pv.Annotations[kube.AnnDeletionSecretName], pv.Annotations[kube.AnnDeletionSecretNS] = "", ""
	if provSecret != nil {
		pv.Annotations[kube.AnnDeletionSecretName] = provSecret.Name
		pv.Annotations[kube.AnnDeletionSecretNS] = provSecret.Namespace
	}
	if inTree != "" {
		// A migrated in-tree class: the PV is the in-tree plugin's, as the
		// PV controller and the kubelet expect of such a class.
		t, err := kube.Migration.TranslateCSIPVToInTree(pv)
		if err != nil {
			return nil, fmt.Errorf("volume %s of in-tree class %q: translating its PV back to in-tree plugin %s (CSI migration): %w", vol.GetVolumeId(), class.Name, inTree, err)
		}
		pv = t
	}
	return pv, nil
}

// reschedule removes the selected-node annotation so the scheduler picks
// another node (the driver said this one has no room).
func (p *Provisioner) reschedule(ctx context.Context, claim *corev1.PersistentVolumeClaim) error {
	// The UID makes it a precondition: a claim made again under the name
	// keeps its node.
	patch := []byte(`{"metadata":{"uid":"` + string(claim.UID) + `","annotations":{"` + kube.AnnSelectedNode + `":null}}}`)
	_, err := p.b.Cfg.Client.CoreV1().PersistentVolumeClaims(claim.Namespace).Patch(ctx, claim.Name, types.MergePatchType, patch, metav1.PatchOptions{})
	// A patch whose metadata.uid is not the claim's is refused as Invalid
	// (a UID cannot change): the claim was made again, and its own sync
	// decides for it.
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsInvalid(err) && !apierrors.IsConflict(err) {
		return fmt.Errorf("remove %s from claim %s/%s: %w", kube.AnnSelectedNode, claim.Namespace, claim.Name, err)
	}
	return nil
}

// deleteVolume deletes a volume with its provisioner secret (through policy).
func (p *Provisioner) deleteVolume(ctx context.Context, driver, node, volumeID string, secretRef *corev1.SecretReference, requester policy.Requester) error {
	return p.deleteVolumeWith(ctx, driver, node, volumeID, secretRef, requester, nil, nil)
}

// deleteVolumeWith is deleteVolume with the namespace labels recorded at
// provisioning, for when the claim's namespace is gone.
//
// A secret the policy allows but that is gone does not keep the volume:
// as external-provisioner, it is deleted without credentials (the secret
// may have gone with its namespace, with the claims), which is logged and,
// with on, recorded as an Event on that object.
func (p *Provisioner) deleteVolumeWith(ctx context.Context, driver, node, volumeID string, secretRef *corev1.SecretReference, requester policy.Requester, recordedNSLabels map[string]string, on *corev1.ObjectReference) error {
	creds, err := p.b.FetchSecret(ctx, kube.SecretUse{Driver: driver, Op: policy.OpDeleteVolume, Ref: secretRef, Source: policy.Source{Kind: policy.SourcePVField, Key: "provisioner secret"}, Requester: requester, RecordedNSLabels: recordedNSLabels})
	var gone kube.SecretNotFound
	switch {
	case errors.As(err, &gone):
		p.b.Log.Warn("the deletion secret is gone; deleting the volume without credentials", "driver", driver, "volume", volumeID, "err", err)
		if on != nil {
			p.b.EventOnce(ctx, *on, corev1.EventTypeWarning, "DeletionSecretNotFound", secretRef.Namespace+"/"+secretRef.Name,
				"%v; deleting volume %s without credentials", err, volumeID)
		}
		creds = nil
	case err != nil:
		return err
	}
	conn, err := p.conn(driver, node)
	if err != nil {
		return err
	}
	ctx, cancel := p.b.CallContext(ctx, driver, "DeleteVolume")
	defer cancel()
	_, err = csi.NewControllerClient(conn).DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: volumeID, Secrets: creds})
	if err != nil {
		// NotFound included: the CSI spec has a plugin answer OK for a
		// volume it does not have, so NotFound may be about something
		// else (a pool, a tenant); as external-provisioner, retried.
		// The status as text and wrapped: its code names the failure (failureOf).
		return fmt.Errorf("DeleteVolume %s on driver %s: %w", volumeID, driver, status.Convert(err).Err())
	}
	return nil
}

// QueueLen is how many claims wait in this term's queue, a driver's line
// included.
func (p *Provisioner) QueueLen() int { return p.queue.Len() }

// RecoveryPasses counts the recovery passes that read the intent record,
// so that a test waits for passes instead of time.
func (p *Provisioner) RecoveryPasses() int64 { return p.recoveryPasses.Load() }

// Reschedule lets the scheduler pick another node for claim (it drops the
// selected-node annotation), as a ResourceExhausted answer does.
func (p *Provisioner) Reschedule(ctx context.Context, claim *corev1.PersistentVolumeClaim) error {
	return p.reschedule(ctx, claim)
}
