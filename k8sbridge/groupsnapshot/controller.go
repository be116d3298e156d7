package groupsnapshot

import (
	"context"
	"errors"
	"sync"
	"time"

	groupv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotclient "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	groupinformers "github.com/kubernetes-csi/external-snapshotter/client/v8/informers/externalversions/volumegroupsnapshot/v1"
	grouplisters "github.com/kubernetes-csi/external-snapshotter/client/v8/listers/volumegroupsnapshot/v1"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

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
	// frame is the content steps shared with the snapshot controller.
	frame *snapshots.Contents[*groupv1.VolumeGroupSnapshotContent]

	ops, recovered *prometheus.CounterVec
	recoverNow     chan struct{}
	// inflight holds the names of the group snapshots workers are making
	// now: recovery leaves their entries to them.
	inflight sync.Map
}

// Served reports whether the API server serves VolumeGroupSnapshotContents
// and VolumeGroupSnapshotClasses at groupsnapshot.storage.k8s.io/v1.
func Served(d discovery.DiscoveryInterface) (bool, error) {
	return snapshots.Served(d, Group+"/"+Version, "volumegroupsnapshotcontents", "volumegroupsnapshotclasses")
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
	c.intents = snapshots.NewRecord[Entry](b, recordName,
		"group snapshots being created; entries are removed when their VolumeGroupSnapshotContent records the group snapshot or it is deleted")

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
	c.frame = kind()
	c.frame.Env, c.frame.Queue, c.frame.Slots, c.frame.Lister, c.frame.Fetch, c.frame.Ours = b, c.queue, c.slots, c.contents, c.fetch, c.ours
	b.On(contentInf, c.frame.Handler(func(g *groupv1.VolumeGroupSnapshotContent) {
		if g.Spec.VolumeGroupSnapshotRef.UID != "" && c.intents.Has(groupSnapshotName(c.b.Cfg, g)) {
			c.wakeRecovery()
		}
	}))
	b.On(classInf, snapshots.ClassHandler[*groupv1.VolumeGroupSnapshotClass](c.frame))
	return c, nil
}

// ours: a group content of a registered driver with a source to work from.
func (c *Controller) ours(g *groupv1.VolumeGroupSnapshotContent) bool {
	src := g.Spec.Source
	return (len(src.VolumeHandles) > 0 || src.GroupSnapshotHandles != nil) && c.b.Registered(g.Spec.Driver)
}

// kind is what the shared content steps know of
// VolumeGroupSnapshotContents; the controller adds its own (Env, Queue,
// Slots, Lister, Fetch, Ours).
func kind() *snapshots.Contents[*groupv1.VolumeGroupSnapshotContent] {
	return &snapshots.Contents[*groupv1.VolumeGroupSnapshotContent]{What: "group snapshot", Kind: "VolumeGroupSnapshotContent",
		Driver: func(g *groupv1.VolumeGroupSnapshotContent) string { return g.Spec.Driver },
		Ref: func(g *groupv1.VolumeGroupSnapshotContent) corev1.ObjectReference {
			return g.Spec.VolumeGroupSnapshotRef
		},
		Class:      func(g *groupv1.VolumeGroupSnapshotContent) *string { return g.Spec.VolumeGroupSnapshotClassName },
		Ready:      isReady,
		Recorded:   func(g *groupv1.VolumeGroupSnapshotContent) bool { return groupHandle(g) != "" },
		KeepStatus: func(cur, old *groupv1.VolumeGroupSnapshotContent) { cur.Status = old.Status },
		NotReady:   errNotReady, Mark: AnnBeingCreated}
}

func (c *Controller) fetch(ctx context.Context, name string) (*groupv1.VolumeGroupSnapshotContent, error) {
	return c.client.GroupsnapshotV1().VolumeGroupSnapshotContents().Get(ctx, name, metav1.GetOptions{})
}

// EnqueueAll queues every group content of a registered driver.
func (c *Controller) EnqueueAll() { c.frame.EnqueueAll() }

// Run works while this replica leads: the contents, the term's intent
// record writer and the recovery of group snapshots left behind.
func (c *Controller) Run(ctx context.Context) {
	c.intents.StartTerm()
	c.frame.Work(ctx, c.sync, c.intents.Run, c.recoveryLoop)
}

// sync does the next step of one group content.
func (c *Controller) sync(ctx context.Context, key string) (time.Duration, error) {
	return c.frame.Sync(ctx, key, c.step)
}

// step is the next step of group content g, in csi-snapshotter's order:
// a deletion to carry out, a ready content to settle, a dynamic one to
// snapshot, else its status to refresh.
func (c *Controller) step(ctx context.Context, g *groupv1.VolumeGroupSnapshotContent) error {
	dynamic := len(g.Spec.Source.VolumeHandles) > 0
	switch {
	case shouldDelete(g):
		return c.deleteContent(ctx, g)
	case isReady(g):
		return c.settled(ctx, g)
	case dynamic && groupHandle(g) == "":
		return c.create(ctx, g)
	}
	return c.refresh(ctx, g)
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
