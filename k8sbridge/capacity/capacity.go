package capacity

// Storage capacity (external-provisioner's --enable-capacity, done once for
// every driver): one CSIStorageCapacity object per (driver, StorageClass,
// topology segment), kept equal to what the driver's GetCapacity reports, so
// that the scheduler only picks nodes whose segment has room for a
// WaitForFirstConsumer volume.
//
// What exists is decided from the informer caches (pure, cheap):
//
//   - drivers: the registered ones (Drivers.DriverNames) whose capabilities
//     include GET_CAPACITY;
//   - classes: every WaitForFirstConsumer StorageClass whose provisioner is
//     the driver (Immediate ones too with CapacityForImmediateBinding);
//   - segments: the distinct values of the driver's topology keys over the
//     nodes whose CSINode lists the driver (a driver that runs on nodes
//     without topology keys gets, as upstream does, the empty segment: one
//     object per class whose nodeTopology selects every node). A node-local
//     driver gets one segment per node that runs it, keyed by
//     kubernetes.io/hostname, and its GetCapacity goes to that node's proxy.
//
// Each (driver, class, segment) is a key of one rate-limited workqueue; a
// worker asks the driver (class parameters without csi.storage.k8s.io/ keys,
// a generic mount capability, the segment as accessible topology) and
// creates, updates (only when capacity, maximum volume size, labels or owner
// differ) or deletes the object. Keys are queued when the caches change
// (classes, CSINodes, node labels), when the set of registered drivers
// changes, when the broker makes or deletes a volume in their segment (or
// a CreateVolume is refused for want of room), and every
// PollInterval. An object whose key is no longer
// wanted (class deleted, segment gone, driver unregistered or without
// GET_CAPACITY) is deleted; an object is never deleted because GetCapacity
// failed: it keeps its last value and the key is retried with backoff, as
// upstream does (a missing object makes the scheduler refuse every node of
// the segment, a stale one at worst costs one rescheduling).
//
// Objects live in the broker's namespace, labelled csibroker.io/driver and
// app.kubernetes.io/managed-by=csibroker, and are owned by the intent
// ConfigMap (csibroker-intents) of the same namespace: a namespaced object can
// only be owned by an object of its own namespace; the ConfigMap is the one
// object every broker installation has there, it outlives any one replica
// (a Pod owner would take the objects with it on every leader change) and it
// is found or created by the broker itself (no RBAC on Deployments or
// ReplicaSets, no downward API). Deleting the namespace, or the ConfigMap
// once the broker is uninstalled, lets the garbage collector remove the
// objects. (A running broker recreates a deleted ConfigMap, as the intent
// record does, and then its objects under the new one.)

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/time/rate"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"

	"github.com/csibroker/csibroker/internal/budget"
	"github.com/csibroker/csibroker/k8sbridge/csiparams"
	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/secrets"
	"github.com/csibroker/csibroker/k8sbridge/topology"
)

// PollInterval is how often every capacity object is refreshed from
// its driver (external-provisioner's --capacity-poll-interval, same
// default). Capacity changes the broker cannot see (volumes made by others,
// a pool grown) show after at most this long. Tests lower it.
var PollInterval = time.Minute

// RegistryInterval is how often the set of registered drivers is
// compared with the last one seen (an in-memory check, no API call), so a
// driver registered or removed by proxy discovery gets or loses its objects
// without waiting for a poll.
var RegistryInterval = 5 * time.Second

// UnregisteredGrace is how long a driver's objects outlive its
// registration: proxy discovery unregisters a driver whose proxy pods are
// all not Ready, which a restart or a drain does for a moment, and deleting
// the objects would make the scheduler refuse every node for the driver's
// claims until they are made again. Meanwhile they keep their last value
// (as when GetCapacity fails); after it they are deleted.
var UnregisteredGrace = 10 * time.Minute

// capacityWorkers is how many keys are refreshed at once (one key is never
// refreshed twice at the same time).
const capacityWorkers = 4

// Labels of the capacity objects; the managed-by label selects what the
// controller watches and may delete.
const (
	LabelDriver    = "csibroker.io/driver"
	LabelManagedBy = "app.kubernetes.io/managed-by"
	ManagedBy      = "csibroker"
	GenerateName   = "csisc-"
	capacityIndex  = "capacityKey"
	// capacityBadSegment is the segment of an object whose nodeTopology this
	// controller would not have written; such objects are never wanted.
	capacityBadSegment = "!unrecognised"
)

// capacityKey names one CSIStorageCapacity object.
type capacityKey struct {
	driver, class string
	// segment is the canonical form of the topology segment (topology.Term.String).
	segment string
}

func (k capacityKey) String() string { return k.driver + "\x00" + k.class + "\x00" + k.segment }

func parseCapacityKey(s string) (capacityKey, bool) {
	parts := strings.Split(s, "\x00")
	if len(parts) != 3 {
		return capacityKey{}, false
	}
	return capacityKey{driver: parts[0], class: parts[1], segment: parts[2]}, true
}

// capacitySegment is one topology segment of a driver.
type capacitySegment struct {
	// term is the segment: the object's nodeTopology matches exactly its
	// labels.
	term topology.Term
	// request is the accessible topology sent with GetCapacity (to a driver
	// with VOLUME_ACCESSIBILITY_CONSTRAINTS; to others none): term, or for
	// a node-local driver the node's values of the driver's own topology keys
	// when its CSINode lists some (the keys the driver understands).
	request topology.Term
	// node is the node whose proxy answers GetCapacity (node-local drivers).
	node string
}

// capacitySegments returns the topology segments a driver's capacity is
// tracked for, sorted, from its view of every node (topology.NewNode).
//
// A node that does not run the driver (nil DriverKeys) gives nothing. For a
// central driver each node that lists topology keys and carries a label for
// each of them gives the segment of those labels; equal segments are merged;
// a node that runs it with no keys gives the empty segment (every node, as
// external-provisioner has it). For a node-local driver
// every node that runs it and has a kubernetes.io/hostname label is a segment
// of its own.
func capacitySegments(nodes []topology.Node, nodeLocal bool) []capacitySegment {
	seen := map[string]bool{}
	var out []capacitySegment
	for _, n := range nodes {
		if n.DriverKeys == nil {
			continue
		}
		var seg capacitySegment
		if nodeLocal {
			host := n.Labels[corev1.LabelHostname]
			if host == "" || n.Name == "" {
				continue
			}
			seg = capacitySegment{term: topology.Term{{Key: corev1.LabelHostname, Value: host}}, node: n.Name}
			seg.request = seg.term
			if len(n.DriverKeys) > 0 {
				if own, missing := topology.TermFromLabels(n.Labels, n.DriverKeys); len(missing) == 0 {
					seg.request = own
				}
			}
		} else {
			term, missing := topology.TermFromLabels(n.Labels, n.DriverKeys)
			if len(missing) > 0 {
				continue
			}
			seg = capacitySegment{term: term, request: term}
		}
		if s := seg.term.String(); !seen[s] {
			seen[s] = true
			out = append(out, seg)
		}
	}
	slices.SortFunc(out, func(a, b capacitySegment) int { return cmp.Compare(a.term.String(), b.term.String()) })
	return out
}

// CapacityRequest is what the driver is asked for one class and segment:
// the class's parameters without the csi.storage.k8s.io/ keys (they are the
// provisioner's, not the driver's) and the segment as accessible topology.
// No volume capability, as external-provisioner asks: the field is
// optional, capacity is assumed not to depend on it, and a capability made
// up here (a mount, say) would have a block-only driver, or one strict
// about filesystems, answer 0 or refuse, and no pod of the class would be
// scheduled.
func CapacityRequest(class *storagev1.StorageClass, segment map[string]string) *csi.GetCapacityRequest {
	params := map[string]string{}
	for k, v := range class.Parameters {
		if !strings.HasPrefix(k, secrets.ParameterPrefix) {
			params[k] = v
		}
	}
	req := &csi.GetCapacityRequest{Parameters: params}
	if len(segment) > 0 {
		req.AccessibleTopology = &csi.Topology{Segments: maps.Clone(segment)}
	}
	return req
}

// capacityKeyOf is the key an existing object stands for.
func capacityKeyOf(csc *storagev1.CSIStorageCapacity) capacityKey {
	k := capacityKey{driver: csc.Labels[LabelDriver], class: csc.StorageClassName, segment: capacityBadSegment}
	if t, ok := capacityTermOf(csc); ok {
		k.segment = t.String()
	}
	return k
}

// capacityTermOf is the segment of an object's nodeTopology, if it is one
// this controller writes (match labels only; none: the empty segment).
func capacityTermOf(csc *storagev1.CSIStorageCapacity) (topology.Term, bool) {
	sel := csc.NodeTopology
	if sel == nil || len(sel.MatchExpressions) > 0 {
		return nil, false
	}
	t := make(topology.Term, 0, len(sel.MatchLabels))
	for key, v := range sel.MatchLabels {
		t = append(t, topology.Segment{Key: key, Value: v})
	}
	t.Sort()
	return t, true
}

// capacityItem is a wanted object and how to ask for its value.
type capacityItem struct {
	segment  capacitySegment
	nodeLoc  bool
	selector map[string]string
	// classUID tells a class deleted and created again under the same name
	// (maybe with other parameters) from the one the object was made for.
	classUID types.UID
	// kept marks the item of a driver not registered now, kept through the
	// grace period: its object stays as it is and the driver is not asked.
	kept bool
}

// sameRequest reports whether a and b ask the driver the same question.
func (a capacityItem) sameRequest(b capacityItem) bool {
	return a.classUID == b.classUID && a.nodeLoc == b.nodeLoc && a.kept == b.kept && a.segment.node == b.segment.node &&
		a.segment.request.Compare(b.segment.request) == 0
}

// Controller keeps the CSIStorageCapacity objects. Its informer,
// queue and bookkeeping exist only while this replica leads.
type Controller struct {
	b   *kube.Env
	log *slog.Logger
	// changed is nudged by informer handlers (while standing by too).
	changed chan struct{}

	refreshes *prometheus.CounterVec
	writes    *prometheus.CounterVec

	mu      sync.Mutex
	queue   workqueue.TypedRateLimitingInterface[capacityKey]
	indexer cache.Indexer
	desired map[capacityKey]capacityItem
	// written holds objects as this controller last wrote them until the
	// informer shows that version, so a refresh never acts on a cache that
	// has not seen the last write (no duplicate creates).
	written map[capacityKey]*storagev1.CSIStorageCapacity
	// deleting holds the UIDs this controller deleted and the informer has
	// not yet reported gone.
	deleting map[types.UID]bool
	owner    *metav1.OwnerReference

	// Drivers' last desired items, and since when a driver has not been
	// registered (capacityUnregisteredGrace); read and written by the run
	// loop only.
	lastItems map[string]map[capacityKey]capacityItem
	goneSince map[string]time.Time
}

func New(b *kube.Env) (*Controller, error) {
	c := &Controller{
		b:       b,
		log:     b.Log.With("controller", "capacity"),
		changed: make(chan struct{}, 1),
		refreshes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "csibroker", Name: "capacity_refreshes_total",
			Help: "CSIStorageCapacity refreshes by driver and result (unchanged, created, updated, removed, unsupported, failed, refused: the answer failed its check; kept: the driver or the segment's proxy is not registered, so the object stays as it was).",
		}, []string{"driver", "result"}),
		writes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "csibroker", Name: "capacity_api_writes_total",
			Help: "API writes made for CSIStorageCapacity objects, by operation (create, update, delete).",
		}, []string{"operation"}),
	}
	if reg := b.Cfg.Registerer; reg != nil {
		for _, col := range []prometheus.Collector{c.refreshes, c.writes} {
			if err := reg.Register(col); err != nil {
				return nil, fmt.Errorf("capacity metrics: %w", err)
			}
		}
	}
	b.Metrics.QueueDepth("capacity", c.queueLen)
	b.VolumeChanged = append(b.VolumeChanged, c.onVolumeChange)

	nudge := func(any) { c.nudge() }
	b.On(b.Factory.Storage().V1().StorageClasses().Informer(), cache.ResourceEventHandlerFuncs{
		// Provisioner and parameters are immutable: only adds and deletes
		// matter, and an update that is a class made again (a relist after
		// a watch gap shows a delete and re-create as one).
		AddFunc: nudge, DeleteFunc: nudge,
		UpdateFunc: func(oldObj, newObj any) {
			o, ok1 := oldObj.(*storagev1.StorageClass)
			n, ok2 := newObj.(*storagev1.StorageClass)
			if !ok1 || !ok2 || o.UID != n.UID {
				c.nudge()
			}
		},
	})
	b.On(b.Factory.Storage().V1().CSINodes().Informer(), cache.ResourceEventHandlerFuncs{
		AddFunc: nudge, DeleteFunc: nudge,
		UpdateFunc: func(oldObj, newObj any) {
			o, ok1 := oldObj.(*storagev1.CSINode)
			n, ok2 := newObj.(*storagev1.CSINode)
			if !ok1 || !ok2 || o.ResourceVersion != n.ResourceVersion {
				c.nudge()
			}
		},
	})
	b.On(b.Factory.Core().V1().Nodes().Informer(), cache.ResourceEventHandlerFuncs{
		AddFunc: nudge, DeleteFunc: nudge,
		// Nodes change all the time (heartbeats, conditions); only their
		// labels make segments.
		UpdateFunc: func(oldObj, newObj any) {
			o, ok1 := oldObj.(*corev1.Node)
			n, ok2 := newObj.(*corev1.Node)
			if !ok1 || !ok2 || !maps.Equal(o.Labels, n.Labels) {
				c.nudge()
			}
		},
	})
	return c, nil
}

// onVolumeChange refreshes, now rather than at the next poll, the objects
// whose storage a volume took or freed (as external-provisioner does after
// each CreateVolume and DeleteVolume): the driver's objects of the
// volume's node (node-local) or of the segments its topology falls in
// (every segment when that is not known), of v.class or of every class.
func (c *Controller) onVolumeChange(v kube.VolumeChange) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.queue == nil {
		return
	}
	for k, item := range c.desired {
		if k.driver == v.Driver && (v.Class == "" || k.class == v.Class) && !item.kept && item.segment.holds(item.nodeLoc, v) {
			c.queue.Add(k)
		}
	}
}

// holds reports whether a volume of v may have taken (or freed) storage
// counted in segment s.
func (s capacitySegment) holds(nodeLocal bool, v kube.VolumeChange) bool {
	if nodeLocal {
		return v.Node == "" || v.Node == s.node
	}
	if len(v.Topo) == 0 {
		return true
	}
	return slices.ContainsFunc(v.Topo, func(seg map[string]string) bool {
		for _, e := range s.term {
			if v, ok := seg[e.Key]; ok && v != e.Value {
				return false
			}
		}
		return true
	})
}

func (c *Controller) nudge() {
	select {
	case c.changed <- struct{}{}:
	default:
	}
}

func (c *Controller) queueLen() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.queue == nil {
		return 0
	}
	return c.queue.Len()
}

// run keeps the objects while ctx lasts (this replica leads).
func (c *Controller) Run(ctx context.Context) {
	// Only the broker's own objects are watched: its namespace, its label.
	factory := informers.NewSharedInformerFactoryWithOptions(c.b.Cfg.InformerClient, c.b.Cfg.ResyncPeriod,
		informers.WithNamespace(c.b.Cfg.Namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.LabelSelector = LabelManagedBy + "=" + ManagedBy
		}),
		informers.WithTransform(kube.StripBulk))
	inf := factory.Storage().V1().CSIStorageCapacities().Informer()
	if err := inf.AddIndexers(cache.Indexers{capacityIndex: func(obj any) ([]string, error) {
		if csc, ok := obj.(*storagev1.CSIStorageCapacity); ok {
			return []string{capacityKeyOf(csc).String()}, nil
		}
		return nil, nil
	}}); err != nil {
		c.log.Error("capacity informer index", "err", err)
		return
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    c.onObjectSeen,
		UpdateFunc: func(_, obj any) { c.onObjectSeen(obj) },
		DeleteFunc: c.onObjectDeleted,
	}); err != nil {
		c.log.Error("capacity informer handler", "err", err)
		return
	}
	queue := workqueue.NewTypedRateLimitingQueueWithConfig(
		workqueue.NewTypedMaxOfRateLimiter(
			workqueue.NewTypedItemExponentialFailureRateLimiter[capacityKey](c.b.Cfg.RetryIntervalStart, c.b.Cfg.RetryIntervalMax),
			&workqueue.TypedBucketRateLimiter[capacityKey]{Limiter: rate.NewLimiter(rate.Limit(10), 100)}),
		workqueue.TypedRateLimitingQueueConfig[capacityKey]{Name: "capacity"})
	c.mu.Lock()
	c.queue, c.indexer = queue, inf.GetIndexer()
	c.desired, c.written, c.deleting, c.owner = map[capacityKey]capacityItem{}, map[capacityKey]*storagev1.CSIStorageCapacity{}, map[types.UID]bool{}, nil
	c.mu.Unlock()

	pool := kube.NewPool(capacityWorkers)
	defer func() {
		queue.ShutDown()
		pool.Stop()
		factory.Shutdown() // ctx is done: the informer stops
		c.mu.Lock()
		c.queue, c.indexer, c.desired, c.written, c.deleting, c.owner = nil, nil, nil, nil, nil, nil
		c.mu.Unlock()
	}()
	factory.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		return
	}
	registry := c.registryState()
	// The grace of an unregistered driver counts from this term's start:
	// what an earlier term saw may be long out of date.
	c.lastItems, c.goneSince = nil, nil
	c.adoptUnregistered(inf.GetIndexer().List())
	c.reconcile()
	c.startWorkers(ctx, queue, pool)
	poll := time.NewTicker(PollInterval)
	defer poll.Stop()
	regCheck := time.NewTicker(RegistryInterval)
	defer regCheck.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-c.changed:
			c.reconcile()
		case <-regCheck.C:
			if s := c.registryState(); s != registry {
				registry = s
				c.log.Info("registered drivers or node proxies changed", "drivers", c.b.Cfg.Drivers.DriverNames())
				c.log.Debug("registry", "state", s)
				c.reconcile()
			}
		case <-poll.C:
			c.reconcile()
			c.mu.Lock()
			for k := range c.desired {
				queue.Add(k)
			}
			c.mu.Unlock()
		}
	}
}

// registryState is the set of registered drivers, their routing mode and,
// for node-local ones, the nodes with a proxy.
func (c *Controller) registryState() string {
	var b strings.Builder
	for _, d := range c.b.Cfg.Drivers.DriverNames() {
		if c.b.Cfg.Drivers.NodeLocal(d) {
			nodes := slices.Clone(c.b.Cfg.Drivers.DriverNodes(d))
			slices.Sort(nodes)
			fmt.Fprintf(&b, "%s(node-local, nodes %s) ", d, strings.Join(nodes, ","))
			continue
		}
		fmt.Fprintf(&b, "%s ", d)
	}
	return strings.TrimSpace(b.String())
}

// desiredItems computes from the caches which objects should exist.
func (c *Controller) desiredItems() map[capacityKey]capacityItem {
	out := map[capacityKey]capacityItem{}
	classes, err := c.b.Classes.List(labels.Everything())
	if err != nil {
		return out
	}
	csiNodes, err := c.b.CSINodes.List(labels.Everything())
	if err != nil {
		return out
	}
	slices.SortFunc(csiNodes, func(a, b *storagev1.CSINode) int { return cmp.Compare(a.Name, b.Name) })
	if c.lastItems == nil {
		c.lastItems, c.goneSince = map[string]map[capacityKey]capacityItem{}, map[string]time.Time{}
	}
	registered := map[string]bool{}
	for _, driver := range c.b.Cfg.Drivers.DriverNames() {
		registered[driver] = true
		var driverClasses []*storagev1.StorageClass
		for _, sc := range classes {
			// As external-provisioner (--capacity-for-immediate-binding):
			// the scheduler reads capacity for WaitForFirstConsumer
			// claims only, so Immediate classes get no objects unless asked.
			immediate := sc.VolumeBindingMode == nil || *sc.VolumeBindingMode == storagev1.VolumeBindingImmediate
			if sc.Provisioner == driver && (!immediate || c.b.Cfg.CapacityForImmediateBinding) {
				driverClasses = append(driverClasses, sc)
			}
		}
		if len(driverClasses) == 0 {
			continue
		}
		if errs := validation.IsValidLabelValue(driver); len(errs) > 0 {
			c.log.Error("driver name cannot be a label value: no capacity objects", "driver", driver, "problem", strings.Join(errs, "; "))
			continue
		}
		var nodes []topology.Node
		for _, cn := range csiNodes {
			node, err := c.b.Nodes.Get(cn.Name)
			if err != nil {
				continue // no Node (yet): no labels to make a segment of
			}
			nodes = append(nodes, topology.NewNode(node, cn, driver))
		}
		nodeLocal := c.b.Cfg.Drivers.NodeLocal(driver)
		var proxies map[string]bool
		if nodeLocal {
			proxies = map[string]bool{}
			for _, n := range c.b.Cfg.Drivers.DriverNodes(driver) {
				proxies[n] = true
			}
		}
		for _, seg := range capacitySegments(nodes, nodeLocal) {
			// A node-local driver's node with no proxy registered (not
			// deployed there, or restarting) cannot be asked: its object,
			// if any, stays as it is, and none is made.
			kept := nodeLocal && !proxies[seg.node]
			for _, sc := range driverClasses {
				out[capacityKey{driver: driver, class: sc.Name, segment: seg.term.String()}] = capacityItem{segment: seg, nodeLoc: nodeLocal, selector: seg.term.Labels(), classUID: sc.UID, kept: kept}
			}
		}
	}
	c.keepUnregistered(out, registered)
	return out
}

// keepUnregistered remembers each registered driver's items and adds those
// of a driver unregistered less than capacityUnregisteredGrace ago.
func (c *Controller) keepUnregistered(out map[capacityKey]capacityItem, registered map[string]bool) {
	// Remember each registered driver's items; keep an unregistered
	// one's for the grace period.
	mine := map[string]map[capacityKey]capacityItem{}
	for k, item := range out {
		if mine[k.driver] == nil {
			mine[k.driver] = map[capacityKey]capacityItem{}
		}
		mine[k.driver][k] = item
	}
	for d := range registered {
		c.lastItems[d] = mine[d]
		delete(c.goneSince, d)
	}
	now := time.Now()
	for d, items := range c.lastItems {
		if registered[d] {
			continue
		}
		if c.b.Foreign(d) {
			// Led by another replica now: its objects are that
			// replica's to keep, refresh or remove.
			delete(c.lastItems, d)
			delete(c.goneSince, d)
			continue
		}
		since, ok := c.goneSince[d]
		if !ok {
			since = now
			c.goneSince[d] = now
			if len(items) > 0 {
				c.log.Info("driver unregistered; its capacity objects keep their last value until it is back or the grace period ends", "driver", d, "objects", len(items), "grace", UnregisteredGrace)
			}
		}
		if now.Sub(since) >= UnregisteredGrace {
			delete(c.lastItems, d)
			delete(c.goneSince, d)
			continue
		}
		for k, item := range items {
			item.kept = true
			out[k] = item
		}
	}
}

// adoptUnregistered starts the grace period, at the start of a leadership
// term, for the objects of drivers not registered yet: a new leader, or a
// restarted broker, whose discovery has not found a driver yet must not
// take that driver's objects for unwanted ones (the scheduler would see no
// capacity until they are made again).
func (c *Controller) adoptUnregistered(objs []any) {
	if c.lastItems == nil {
		c.lastItems, c.goneSince = map[string]map[capacityKey]capacityItem{}, map[string]time.Time{}
	}
	registered := map[string]bool{}
	for _, d := range c.b.Cfg.Drivers.DriverNames() {
		registered[d] = true
	}
	now := time.Now()
	adopted := map[string]int{}
	for _, obj := range objs {
		csc, ok := obj.(*storagev1.CSIStorageCapacity)
		if !ok {
			continue
		}
		key := capacityKeyOf(csc)
		term, ok := capacityTermOf(csc)
		if !ok || key.driver == "" || registered[key.driver] || c.b.Foreign(key.driver) {
			continue
		}
		if _, ok := c.lastItems[key.driver][key]; ok {
			continue
		}
		item := capacityItem{segment: capacitySegment{term: term, request: term}, selector: term.Labels()}
		if class, err := c.b.Classes.Get(key.class); err == nil {
			item.classUID = class.UID
		}
		if c.lastItems[key.driver] == nil {
			c.lastItems[key.driver] = map[capacityKey]capacityItem{}
		}
		c.lastItems[key.driver][key] = item
		if _, ok := c.goneSince[key.driver]; !ok {
			c.goneSince[key.driver] = now
		}
		adopted[key.driver]++
	}
	for d, n := range adopted {
		c.log.Info("capacity objects of a driver not registered yet are kept until it registers or the grace period ends", "driver", d, "objects", n, "grace", UnregisteredGrace)
	}
}

// reconcile recomputes the wanted keys and queues every key that appeared or
// went away, and the keys of objects nobody wants (left by a previous leader,
// or by a driver since unregistered).
func (c *Controller) reconcile() {
	desired := c.desiredItems()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.queue == nil {
		return
	}
	old := c.desired
	c.desired = desired
	for k, item := range desired {
		if prev, ok := old[k]; !ok || !prev.sameRequest(item) {
			c.queue.Add(k)
		}
	}
	for k := range old {
		if _, ok := desired[k]; !ok {
			c.queue.Add(k)
		}
	}
	for _, s := range c.indexer.ListIndexFuncValues(capacityIndex) {
		if k, ok := parseCapacityKey(s); ok && !c.b.Foreign(k.driver) {
			if _, want := desired[k]; !want {
				c.queue.Add(k)
			}
		}
	}
}

func (c *Controller) onObjectSeen(obj any) {
	csc, ok := obj.(*storagev1.CSIStorageCapacity)
	if !ok {
		return
	}
	key := capacityKeyOf(csc)
	c.mu.Lock()
	defer c.mu.Unlock()
	if w := c.written[key]; w != nil && w.UID == csc.UID && w.ResourceVersion == csc.ResourceVersion {
		delete(c.written, key) // the cache has caught up
	}
}

func (c *Controller) onObjectDeleted(obj any) {
	csc, ok := kube.Deleted[*storagev1.CSIStorageCapacity](obj)
	if !ok {
		return
	}
	key := capacityKeyOf(csc)
	c.mu.Lock()
	defer c.mu.Unlock()
	if w := c.written[key]; w != nil && w.UID == csc.UID {
		delete(c.written, key)
	}
	if c.deleting[csc.UID] {
		delete(c.deleting, csc.UID)
		return
	}
	// Someone else deleted it: an admin, or the garbage collector because
	// the owner went away. Look the owner up again and recreate the object
	// if it is still wanted.
	c.owner = nil
	if _, want := c.desired[key]; want && c.queue != nil {
		c.log.Info("capacity object deleted by someone else; recreating it", "name", csc.Name, "driver", key.driver, "storage_class", key.class, "segment", key.segment)
		c.queue.Add(key)
	}
}

// startWorkers runs the term's workers. Each driver has capacityWorkers
// slots of its own, and each slot taken a worker of its own (kube.Pool): a
// driver whose GetCapacity hangs holds only its own, and the other
// drivers' objects are refreshed meanwhile.
func (c *Controller) startWorkers(ctx context.Context, queue workqueue.TypedRateLimitingInterface[capacityKey], pool *kube.Pool) {
	slots := kube.NewDriverSlots(capacityWorkers, func(s string) {
		if k, ok := parseCapacityKey(s); ok {
			queue.Add(k) // its slot is free: handed to it
		}
	})
	slots.Notify(pool.SlotTaken)
	pool.Start(func() {
		for !pool.Surplus() && c.processNext(ctx, queue, slots) {
		}
	})
}

func (c *Controller) processNext(ctx context.Context, queue workqueue.TypedRateLimitingInterface[capacityKey], slots *kube.DriverSlots) bool {
	key, quit := queue.Get()
	if quit {
		return false
	}
	defer queue.Done(key)
	if ctx.Err() != nil {
		return true // the term is over
	}
	if !slots.Acquire(key.driver, key.String()) {
		return true // in the driver's line: queued again with a slot
	}
	err := c.safeSync(ctx, key)
	slots.Release(key.driver)
	if err != nil {
		if ctx.Err() == nil {
			c.log.Warn("capacity refresh failed; retrying with backoff", "driver", key.driver, "storage_class", key.class, "segment", key.segment,
				"failures", queue.NumRequeues(key)+1, "err", err)
		}
		queue.AddRateLimited(key)
		return true
	}
	queue.Forget(key)
	return true
}

// safeSync is sync, a panic in which (a bug a driver's answer hits) fails
// the key, retried with backoff, with a WorkItemPanicked Event on its
// class, and never stops the process.
func (c *Controller) safeSync(ctx context.Context, key capacityKey) (err error) {
	if c.b.Safely("capacity", key.driver+" "+key.class+" "+key.segment, func() {
		c.b.TestHook("capacity", key.driver, key.class)
		err = c.sync(ctx, key)
	}) {
		err = fmt.Errorf("capacity refresh of driver %s, class %s, segment %s: panic (logged with its stack)", key.driver, key.class, key.segment)
		if class, cerr := c.b.Classes.Get(key.class); cerr == nil {
			ref := corev1.ObjectReference{APIVersion: "storage.k8s.io/v1", Kind: "StorageClass", Name: class.Name, UID: class.UID}
			c.b.EventOnce(ctx, ref, corev1.EventTypeWarning, kube.ReasonWorkItemPanicked, "panic",
				"csibroker's capacity controller failed on a CSIStorageCapacity of this class with an internal error (a panic; the broker's log has its stack); it is retried with backoff")
		}
	}
	return err
}

// sync brings the object of key in line with the driver (or removes it):
// the driver is asked (ask), then the object written (write).
func (c *Controller) sync(ctx context.Context, key capacityKey) error {
	ctx = budget.WithDriver(ctx, key.driver) // its writes wait in turn with other drivers'
	if c.b.Foreign(key.driver) {
		return nil // another replica's (per-driver leader election)
	}
	c.mu.Lock()
	item, want := c.desired[key]
	c.mu.Unlock()
	if !want {
		return c.remove(ctx, key)
	}
	if item.kept {
		return c.syncKept(ctx, key, item)
	}
	class, err := c.b.Classes.Get(key.class)
	if apierrors.IsNotFound(err) {
		return c.remove(ctx, key) // the class event will drop the key too
	}
	if err != nil {
		return err
	}
	if class.Provisioner != key.driver {
		// Deleted and made again for another driver while the watch was
		// down (a relist shows it as an update): this driver is not asked
		// with the other's parameters; the new class's keys are its own.
		return c.remove(ctx, key)
	}
	resp, err := c.ask(ctx, key, item, class)
	if err != nil || resp == nil {
		return err
	}
	return c.write(ctx, key, item, resp)
}

// syncKept leaves as it is the object of a driver (or, node-local, a node's
// proxy) that is not registered, unless its class went (or, for an
// unregistered driver, was made again). Seen at this key's next refresh
// (the poll).
func (c *Controller) syncKept(ctx context.Context, key capacityKey, item capacityItem) error {
	if class, err := c.b.Classes.Get(key.class); apierrors.IsNotFound(err) ||
		(err == nil && (class.Provisioner != key.driver || item.classUID != "" && class.UID != item.classUID)) {
		return c.remove(ctx, key)
	}
	c.refreshes.WithLabelValues(key.driver, "kept").Inc()
	return nil
}

// ask is the driver's GetCapacity answer for item; nil (with remove's
// error) when the object went instead: the driver has no GET_CAPACITY, or
// the key went away while the driver answered.
func (c *Controller) ask(ctx context.Context, key capacityKey, item capacityItem, class *storagev1.StorageClass) (*csi.GetCapacityResponse, error) {
	caps, err := c.capabilities(ctx, key.driver)
	if err != nil {
		c.refreshes.WithLabelValues(key.driver, "failed").Inc()
		return nil, err
	}
	if !caps.GetCapacity {
		c.refreshes.WithLabelValues(key.driver, "unsupported").Inc()
		c.log.Debug("driver has no GET_CAPACITY capability: no capacity objects", "driver", key.driver)
		return nil, c.remove(ctx, key)
	}
	// The spec lets a request carry a topology only to a driver with
	// VOLUME_ACCESSIBILITY_CONSTRAINTS; a node-local driver without it is
	// asked on its node's proxy, which says where.
	var segment map[string]string
	if caps.Accessibility {
		segment = item.segment.request.Labels()
	}
	req := CapacityRequest(class, segment)
	resp, err := c.getCapacity(ctx, key.driver, item, req)
	if err != nil {
		// Keep the object with its last value: stale beats missing.
		c.refreshes.WithLabelValues(key.driver, "failed").Inc()
		return nil, err
	}
	if err := csiparams.CheckCapacity(resp); err != nil {
		// Not written: the object keeps its last value, as when the call
		// fails, and the key is retried with backoff.
		c.refreshes.WithLabelValues(key.driver, "refused").Inc()
		return nil, c.refused(ctx, key, class, err)
	}
	c.mu.Lock()
	_, want := c.desired[key]
	c.mu.Unlock()
	if !want {
		return nil, c.remove(ctx, key) // went away while the driver answered
	}
	return resp, nil
}

// refused reports a GetCapacity answer the check refused as an Event on
// the class (once per message: every segment of the class and every poll
// asks again) and returns the error, which the caller logs.
func (c *Controller) refused(ctx context.Context, key capacityKey, class *storagev1.StorageClass, err error) error {
	where := "segment " + key.segment
	if key.segment == "" {
		where = "every node"
	}
	err = fmt.Errorf("driver %s, storage class %s, %s: %w; its CSIStorageCapacity keeps its last value", key.driver, key.class, where, err)
	ref := corev1.ObjectReference{APIVersion: "storage.k8s.io/v1", Kind: "StorageClass", Name: class.Name, UID: class.UID}
	c.b.EventOnce(ctx, ref, corev1.EventTypeWarning, "CapacityRefreshFailed", err.Error(), "%v", err)
	return err
}

// write creates or updates the object of key with the driver's answer
// (keeping the oldest of two objects a previous leader's race made).
func (c *Controller) write(ctx context.Context, key capacityKey, item capacityItem, resp *csi.GetCapacityResponse) error {
	current, extras := c.objects(key)
	for _, x := range extras {
		// Two objects for one key (a create raced by a previous leader):
		// keep the oldest.
		if err := c.delete(ctx, key, x); err != nil {
			return err
		}
	}
	owner, err := c.ownerRef(ctx)
	if err != nil {
		return err
	}
	capacity := resource.NewQuantity(resp.GetAvailableCapacity(), resource.BinarySI)
	var maxSize *resource.Quantity
	if resp.GetMaximumVolumeSize() != nil {
		maxSize = resource.NewQuantity(resp.GetMaximumVolumeSize().GetValue(), resource.BinarySI)
	}
	wantLabels := map[string]string{LabelDriver: key.driver, LabelManagedBy: ManagedBy}
	client := c.b.Cfg.Client.StorageV1().CSIStorageCapacities(c.b.Cfg.Namespace)

	if current == nil {
		obj := &storagev1.CSIStorageCapacity{
			ObjectMeta: metav1.ObjectMeta{
				GenerateName:    GenerateName,
				Namespace:       c.b.Cfg.Namespace,
				Labels:          wantLabels,
				OwnerReferences: []metav1.OwnerReference{owner},
			},
			StorageClassName:  key.class,
			NodeTopology:      &metav1.LabelSelector{MatchLabels: item.selector},
			Capacity:          capacity,
			MaximumVolumeSize: maxSize,
		}
		created, err := client.Create(ctx, obj, metav1.CreateOptions{})
		c.writes.WithLabelValues("create").Inc()
		if err != nil {
			c.refreshes.WithLabelValues(key.driver, "failed").Inc()
			return fmt.Errorf("create CSIStorageCapacity for driver %s, class %s, segment %s: %w", key.driver, key.class, key.segment, err)
		}
		c.remember(key, created)
		c.refreshes.WithLabelValues(key.driver, "created").Inc()
		c.log.Info("capacity object created", "name", created.Name, "driver", key.driver, "storage_class", key.class, "segment", key.segment, "capacity", capacity.String())
		return nil
	}

	same := quantityEqual(current.Capacity, capacity) && quantityEqual(current.MaximumVolumeSize, maxSize) &&
		hasLabels(current.Labels, wantLabels) && slices.ContainsFunc(current.OwnerReferences, func(r metav1.OwnerReference) bool { return r.UID == owner.UID })
	if same {
		c.refreshes.WithLabelValues(key.driver, "unchanged").Inc()
		return nil
	}
	obj := current.DeepCopy()
	obj.Capacity, obj.MaximumVolumeSize = capacity, maxSize
	if obj.Labels == nil {
		obj.Labels = map[string]string{}
	}
	maps.Copy(obj.Labels, wantLabels)
	// Replace a reference to an earlier intent ConfigMap (deleted and
	// recreated) so the garbage collector does not take the object.
	obj.OwnerReferences = slices.DeleteFunc(obj.OwnerReferences, func(r metav1.OwnerReference) bool {
		return r.APIVersion == "v1" && r.Kind == "ConfigMap" && r.Name == owner.Name
	})
	obj.OwnerReferences = append(obj.OwnerReferences, owner)
	updated, err := client.Update(ctx, obj, metav1.UpdateOptions{})
	c.writes.WithLabelValues("update").Inc()
	if err != nil {
		c.forget(key)
		c.refreshes.WithLabelValues(key.driver, "failed").Inc()
		return fmt.Errorf("update CSIStorageCapacity %s: %w", current.Name, err)
	}
	c.remember(key, updated)
	c.refreshes.WithLabelValues(key.driver, "updated").Inc()
	c.log.Debug("capacity object updated", "name", updated.Name, "driver", key.driver, "storage_class", key.class, "segment", key.segment, "capacity", capacity.String())
	return nil
}

// objects returns the object of key (as last written, else the oldest in
// the cache) and any other objects of the same key.
func (c *Controller) objects(key capacityKey) (*storagev1.CSIStorageCapacity, []*storagev1.CSIStorageCapacity) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var cached []*storagev1.CSIStorageCapacity
	if c.indexer != nil {
		objs, _ := c.indexer.ByIndex(capacityIndex, key.String())
		for _, o := range objs {
			if csc, ok := o.(*storagev1.CSIStorageCapacity); ok && !c.deleting[csc.UID] {
				cached = append(cached, csc)
			}
		}
	}
	slices.SortFunc(cached, func(a, b *storagev1.CSIStorageCapacity) int {
		return cmp.Or(a.CreationTimestamp.Compare(b.CreationTimestamp.Time), cmp.Compare(a.Name, b.Name))
	})
	current := c.written[key]
	if current == nil && len(cached) > 0 {
		current = cached[0]
	}
	var extras []*storagev1.CSIStorageCapacity
	for _, o := range cached {
		if current == nil || o.UID != current.UID {
			extras = append(extras, o)
		}
	}
	return current, extras
}

func (c *Controller) remember(key capacityKey, obj *storagev1.CSIStorageCapacity) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.written != nil {
		c.written[key] = obj
	}
}

func (c *Controller) forget(key capacityKey) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.written, key)
}

// remove deletes every object of key.
func (c *Controller) remove(ctx context.Context, key capacityKey) error {
	current, extras := c.objects(key)
	if current != nil {
		extras = append(extras, current)
	}
	for _, o := range extras {
		if err := c.delete(ctx, key, o); err != nil {
			return err
		}
	}
	if len(extras) > 0 {
		c.refreshes.WithLabelValues(key.driver, "removed").Inc()
	}
	return nil
}

func (c *Controller) delete(ctx context.Context, key capacityKey, obj *storagev1.CSIStorageCapacity) error {
	c.mu.Lock()
	if c.deleting != nil {
		c.deleting[obj.UID] = true
	}
	if w := c.written[key]; w != nil && w.UID == obj.UID {
		delete(c.written, key)
	}
	c.mu.Unlock()
	uid := obj.UID
	err := c.b.Cfg.Client.StorageV1().CSIStorageCapacities(obj.Namespace).Delete(ctx, obj.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}})
	c.writes.WithLabelValues("delete").Inc()
	switch {
	case err == nil:
		c.log.Info("obsolete capacity object deleted", "name", obj.Name, "driver", key.driver, "storage_class", key.class, "segment", key.segment)
		return nil
	case apierrors.IsNotFound(err) || apierrors.IsConflict(err):
		// Gone already, or replaced by an object of the same name.
		return nil
	default:
		c.mu.Lock()
		delete(c.deleting, uid)
		c.mu.Unlock()
		return fmt.Errorf("delete CSIStorageCapacity %s/%s: %w", obj.Namespace, obj.Name, err)
	}
}

// ownerRef is the reference to the intent ConfigMap, found (or created) once
// per term and again after an object was deleted by someone else.
func (c *Controller) ownerRef(ctx context.Context) (metav1.OwnerReference, error) {
	c.mu.Lock()
	if o := c.owner; o != nil {
		c.mu.Unlock()
		return *o, nil
	}
	c.mu.Unlock()
	cm, err := c.b.Intents.Record(ctx)
	if err != nil {
		return metav1.OwnerReference{}, fmt.Errorf("owner of capacity objects: %w", err)
	}
	o := metav1.OwnerReference{APIVersion: "v1", Kind: "ConfigMap", Name: cm.Name, UID: cm.UID}
	c.mu.Lock()
	c.owner = &o
	c.mu.Unlock()
	return o, nil
}

// capabilities are the driver's (for a node-local driver without a
// controller proxy, any of its node proxies answers: capsCache).
func (c *Controller) capabilities(ctx context.Context, driver string) (drivers.Caps, error) {
	return c.b.Caps.Get(ctx, driver)
}

func (c *Controller) getCapacity(ctx context.Context, driver string, item capacityItem, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	var (
		conn grpc.ClientConnInterface
		err  error
	)
	if item.nodeLoc {
		conn, err = c.b.Cfg.Drivers.NodeConn(driver, item.segment.node)
	} else {
		conn, err = c.b.Cfg.Drivers.ControllerConn(driver)
	}
	if err != nil {
		return nil, err
	}
	ctx, cancel := c.b.CallContext(ctx, driver, "GetCapacity")
	defer cancel()
	ctx, span := c.b.Tracer.Start(ctx, "capacity refresh", trace.WithAttributes(
		attribute.String("csi.driver", driver), attribute.String("csi.topology", item.segment.request.String())))
	defer span.End()
	resp, err := csi.NewControllerClient(conn).GetCapacity(ctx, req)
	if err != nil {
		// The code only, as every span of the broker: a driver's message
		// may quote what it was sent.
		span.SetStatus(otelcodes.Error, "GetCapacity failed: "+status.Code(err).String())
		where := "controller"
		if item.nodeLoc {
			where = "node " + item.segment.node
		}
		return nil, fmt.Errorf("driver %s (%s): GetCapacity: %w", driver, where, err)
	}
	return resp, nil
}

func quantityEqual(a, b *resource.Quantity) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Cmp(*b) == 0
}

func hasLabels(have, want map[string]string) bool {
	for k, v := range want {
		if have[k] != v {
			return false
		}
	}
	return true
}

// EnqueueAll does nothing: the controller follows the drivers' registry by
// itself (capacityRegistryInterval).
func (c *Controller) EnqueueAll() {}

// SegmentOf is the topology segment an object this controller wrote
// stands for, in the form its keys use ("{k=v,...}").
func SegmentOf(csc *storagev1.CSIStorageCapacity) string { return capacityKeyOf(csc).segment }
