package groupsnapshot

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	groupv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotclient "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	groupinformers "github.com/kubernetes-csi/external-snapshotter/client/v8/informers/externalversions/volumegroupsnapshot/v1"
	grouplisters "github.com/kubernetes-csi/external-snapshotter/client/v8/listers/volumegroupsnapshot/v1"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/csibroker/csibroker/internal/budget"
	"github.com/csibroker/csibroker/k8sbridge/intent"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/snapshots"
)

// Names shared with external-snapshotter's snapshot-controller and
// csi-snapshotter, so that group contents move between the sidecar and
// the broker without changes.
const (
	Group = "groupsnapshot.storage.k8s.io"
	// Version is the API version csi-snapshotter v8.7.0 reads and writes.
	Version = "v1"
	// AnnBeingCreated is set before CreateVolumeGroupSnapshot is sent and
	// removed once the driver answered with a group snapshot or a final
	// error: while it is set, the content's deletion waits.
	AnnBeingCreated = "groupsnapshot.storage.kubernetes.io/volumegroupsnapshot-being-created"
	// AnnBeingDeleted is the snapshot-controller's: the VolumeGroupSnapshot
	// is being deleted, so the content's deletion is to be carried out.
	AnnBeingDeleted = "groupsnapshot.storage.kubernetes.io/volumegroupsnapshot-being-deleted"
	// AnnDeletionSecretName/-Namespace remember the group snapshotter
	// secret on the content (the snapshot-controller writes them).
	AnnDeletionSecretName = "groupsnapshot.storage.kubernetes.io/deletion-secret-name"
	AnnDeletionSecretNS   = "groupsnapshot.storage.kubernetes.io/deletion-secret-namespace"
	// ContentFinalizer is the snapshot-controller's; it is removed here
	// once the group snapshot is deleted (or retained).
	ContentFinalizer = "groupsnapshot.storage.kubernetes.io/volumegroupsnapshotcontent-bound-protection"

	// Parameters --extra-create-metadata adds.
	ParamGroupSnapshotName      = "csi.storage.k8s.io/volumegroupsnapshot/name"
	ParamGroupSnapshotNamespace = "csi.storage.k8s.io/volumegroupsnapshot/namespace"
	ParamGroupContentName       = "csi.storage.k8s.io/volumegroupsnapshotcontent/name"

	// recordName is the ConfigMap of the group snapshots being created.
	recordName = "csibroker-group-snapshot-intents"
)

// errNotReady requeues a content whose group snapshot is not ready yet
// with the key's backoff, as csi-snapshotter does; it is no failure.
var errNotReady = errors.New("group snapshot not ready yet")

// Controller makes, checks and deletes the group snapshots of the
// VolumeGroupSnapshotContents of registered drivers.
type Controller struct {
	b        *kube.Env
	client   snapshotclient.Interface
	contents grouplisters.VolumeGroupSnapshotContentLister
	classes  grouplisters.VolumeGroupSnapshotClassLister
	queue    *kube.TermQueue
	slots    *kube.DriverSlots
	intents  *intent.Record[Entry]

	ops, recovered *prometheus.CounterVec
	recoverNow     chan struct{}
	// inflight holds the names of the group snapshots workers are making
	// now: recovery leaves their entries to them.
	inflight sync.Map
}

// Served reports whether the API server serves VolumeGroupSnapshotContents
// and VolumeGroupSnapshotClasses at groupsnapshot.storage.k8s.io/v1.
func Served(d discovery.DiscoveryInterface) (bool, error) {
	list, err := d.ServerResourcesForGroupVersion(Group + "/" + Version)
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("discover the %s/%s API: %w", Group, Version, err)
	}
	have := map[string]bool{}
	for _, r := range list.APIResources {
		have[r.Name] = true
	}
	return have["volumegroupsnapshotcontents"] && have["volumegroupsnapshotclasses"], nil
}

// New is the group snapshot controller, or nil when the broker has no
// snapshot client or the cluster does not serve the group snapshot API.
func New(b *kube.Env) (*Controller, error) {
	if b.Cfg.SnapshotClient == nil {
		b.Log.Info("no snapshot API client: VolumeGroupSnapshotContents are not handled")
		return nil, nil
	}
	served, err := Served(b.Cfg.Client.Discovery())
	if err != nil {
		return nil, err
	}
	if !served {
		b.Log.Info("the cluster does not serve " + Group + "/" + Version + " VolumeGroupSnapshotContents and VolumeGroupSnapshotClasses (no group snapshot CRDs): group snapshots are not made; install the CRDs and restart the broker")
		return nil, nil
	}
	c := &Controller{b: b, client: b.Cfg.SnapshotClient, queue: b.NewTermQueue("groupsnapshot"), recoverNow: make(chan struct{}, 1)}
	c.slots = c.queue.WithSlots(b.Cfg.PerDriverWorkers)
	if c.ops, err = kube.OperationsCounter(b.Cfg.Registerer, "group_snapshot_operations_total",
		"VolumeGroupSnapshotContent operations by driver and result (created, not_ready, imported, deleted, retained, failed, not_called, delete_failed)."); err != nil {
		return nil, err
	}
	if c.recovered, err = kube.OperationsCounter(b.Cfg.Registerer, "recovered_group_snapshots_total",
		"Group snapshots made for contents that vanished (or by a broker that died) and deleted by recovery, by driver and result (deleted, not_made, failed)."); err != nil {
		return nil, err
	}
	b.Metrics.QueueDepth("groupsnapshot", c.queue.Len)
	c.intents = intent.NewRecord[Entry](b.Cfg.Client, b.Cfg.Namespace, recordName,
		"group snapshots being created; entries are removed when their VolumeGroupSnapshotContent records the group snapshot or it is deleted", b.Log)
	if b.Cfg.IntentClient != nil && b.Cfg.IntentBudget != nil {
		c.intents.UseBudget(b.Cfg.IntentClient, b.Cfg.IntentBudget.Wait)
	}
	c.intents.UseReader(b.Cfg.InformerClient)
	c.intents.Share(func(d string) bool { return !b.Foreign(d) })

	si := b.Cfg.SnapshotInformerClient
	contentInf := b.Factory.InformerFor(&groupv1.VolumeGroupSnapshotContent{}, func(_ kubernetes.Interface, resync time.Duration) cache.SharedIndexInformer {
		return groupinformers.NewVolumeGroupSnapshotContentInformer(si, resync, cache.Indexers{})
	})
	classInf := b.Factory.InformerFor(&groupv1.VolumeGroupSnapshotClass{}, func(_ kubernetes.Interface, resync time.Duration) cache.SharedIndexInformer {
		return groupinformers.NewVolumeGroupSnapshotClassInformer(si, resync, cache.Indexers{})
	})
	c.contents = grouplisters.NewVolumeGroupSnapshotContentLister(contentInf.GetIndexer())
	c.classes = grouplisters.NewVolumeGroupSnapshotClassLister(classInf.GetIndexer())
	b.AddSynced(contentInf.HasSynced)
	b.AddSynced(classInf.HasSynced)
	b.On(contentInf, c.contentHandler())
	b.On(classInf, cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			if cl, ok := obj.(*groupv1.VolumeGroupSnapshotClass); ok {
				c.enqueueClass(cl.Name)
			}
		},
		UpdateFunc: func(_, newObj any) {
			if cl, ok := newObj.(*groupv1.VolumeGroupSnapshotClass); ok {
				c.enqueueClass(cl.Name)
			}
		},
	})
	return c, nil
}

func (c *Controller) contentHandler() cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			if g, ok := obj.(*groupv1.VolumeGroupSnapshotContent); ok && c.ours(g) {
				c.queue.Add(g.Name)
			}
		},
		UpdateFunc: func(oldObj, newObj any) {
			old, ok1 := oldObj.(*groupv1.VolumeGroupSnapshotContent)
			cur, ok2 := newObj.(*groupv1.VolumeGroupSnapshotContent)
			if ok1 && ok2 && c.ours(cur) && changeNeedsSync(old, cur) {
				c.queue.Add(cur.Name)
			}
		},
		DeleteFunc: func(obj any) {
			g, ok := kube.Deleted[*groupv1.VolumeGroupSnapshotContent](obj)
			if !ok {
				return
			}
			c.b.ForgetEvents(g.UID)
			c.queue.Forget(g.Name)
			if g.Spec.VolumeGroupSnapshotRef.UID != "" && c.intents.Has(groupSnapshotName(c.b.Cfg, g)) {
				c.wakeRecovery()
			}
		},
	}
}

// ours: a group content of a registered driver with a source to work from.
func (c *Controller) ours(g *groupv1.VolumeGroupSnapshotContent) bool {
	src := g.Spec.Source
	return (len(src.VolumeHandles) > 0 || src.GroupSnapshotHandles != nil) && c.b.Registered(g.Spec.Driver)
}

// enqueueClass queues the contents of class that are not ready.
func (c *Controller) enqueueClass(class string) {
	all, err := c.contents.List(labels.Everything())
	if err != nil {
		return
	}
	for _, g := range all {
		if n := g.Spec.VolumeGroupSnapshotClassName; n != nil && *n == class && !isReady(g) && c.ours(g) {
			c.queue.Add(g.Name)
		}
	}
}

// changeNeedsSync is csi-snapshotter's filter of group content updates: a
// resync, a content that became ready, or a change of anything but the
// status, the finalizers, managed fields and the being-created annotation
// (the controller's own writes, which would bypass the key's backoff).
func changeNeedsSync(old, cur *groupv1.VolumeGroupSnapshotContent) bool {
	if old.ResourceVersion == cur.ResourceVersion || (!isReady(old) && isReady(cur)) {
		return true
	}
	s := cur.DeepCopy()
	s.ResourceVersion, s.Status, s.ManagedFields, s.Finalizers = old.ResourceVersion, old.Status, old.ManagedFields, old.Finalizers
	s.Annotations = snapshots.AnnotationsOutside(old.Annotations, s.Annotations, AnnBeingCreated)
	return !equality.Semantic.DeepEqual(old, s)
}

// EnqueueAll queues every group content of a registered driver.
func (c *Controller) EnqueueAll() {
	all, err := c.contents.List(labels.Everything())
	if err != nil {
		return
	}
	for _, g := range all {
		if c.ours(g) {
			c.queue.Add(g.Name)
		}
	}
}

// Run works while this replica leads: the contents, the term's intent
// record writer and the recovery of group snapshots left behind.
func (c *Controller) Run(ctx context.Context) {
	c.intents.StartTerm()
	c.queue.Work(ctx, c.b.Cfg.WorkerThreads, c.EnqueueAll, func(ctx context.Context, key string) (time.Duration, error) {
		requeue, err := c.sync(ctx, key)
		switch {
		case errors.Is(err, errNotReady):
			c.b.Log.Debug("group snapshot not ready yet; asked again with backoff", "content", key)
		case err != nil:
			c.b.Log.Debug("group snapshot content will be retried", "content", key, "err", err)
		}
		return requeue, err
	}, c.intents.Run, c.recoveryLoop)
}

// sync does the next step of one group content, in csi-snapshotter's
// order: a deletion to carry out, a dynamic content to snapshot, a ready
// one to settle, else its status to refresh.
func (c *Controller) sync(ctx context.Context, key string) (time.Duration, error) {
	g, err := c.contents.Get(key)
	if apierrors.IsNotFound(err) {
		return 0, nil
	}
	if err != nil || !c.ours(g) {
		return 0, err
	}
	driver := g.Spec.Driver
	if !c.slots.Acquire(driver, key) {
		return kube.WaitForSlot, nil
	}
	defer c.slots.Release(driver)
	ctx = budget.WithDriver(ctx, driver)
	ctx, span := c.b.Tracer.Start(ctx, "group snapshot content "+key, trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(
		attribute.String("csi.driver", driver), attribute.String("k8s.volumegroupsnapshotcontent.name", key),
		attribute.String("k8s.volumegroupsnapshot.namespace", g.Spec.VolumeGroupSnapshotRef.Namespace),
		attribute.String("k8s.volumegroupsnapshot.name", g.Spec.VolumeGroupSnapshotRef.Name)))
	defer span.End()
	dynamic := len(g.Spec.Source.VolumeHandles) > 0
	switch {
	case shouldDelete(g):
		return 0, c.deleteContent(ctx, g)
	case isReady(g):
		return 0, c.settled(ctx, g)
	case dynamic && groupHandle(g) == "":
		return 0, c.create(ctx, g)
	}
	return 0, c.refresh(ctx, g)
}

// shouldDelete is csi-snapshotter's test: the content is being deleted,
// and either it is a pre-provisioned content never bound, or its group
// snapshot is not being created and the snapshot-controller marked it
// being deleted.
func shouldDelete(g *groupv1.VolumeGroupSnapshotContent) bool {
	if g.DeletionTimestamp == nil {
		return false
	}
	if g.Spec.Source.GroupSnapshotHandles != nil && g.Spec.VolumeGroupSnapshotRef.UID == "" {
		return true
	}
	if _, ok := g.Annotations[AnnBeingCreated]; ok {
		return false
	}
	_, ok := g.Annotations[AnnBeingDeleted]
	return ok
}

func isReady(g *groupv1.VolumeGroupSnapshotContent) bool {
	return g.Status != nil && g.Status.ReadyToUse != nil && *g.Status.ReadyToUse
}

// groupHandle is the group snapshot ID the status records ("" if none).
func groupHandle(g *groupv1.VolumeGroupSnapshotContent) string {
	if g.Status != nil && g.Status.VolumeGroupSnapshotHandle != nil {
		return *g.Status.VolumeGroupSnapshotHandle
	}
	return ""
}

func (c *Controller) wakeRecovery() {
	select {
	case c.recoverNow <- struct{}{}:
	default:
	}
}
