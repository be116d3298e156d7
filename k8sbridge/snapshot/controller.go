package snapshot

import (
	"context"
	"errors"
	"sync"
	"time"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapshotclient "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	snapinformers "github.com/kubernetes-csi/external-snapshotter/client/v8/informers/externalversions/volumesnapshot/v1"
	snaplisters "github.com/kubernetes-csi/external-snapshotter/client/v8/listers/volumesnapshot/v1"
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
// csi-snapshotter, so that contents move between the sidecar and the
// broker without changes.
const (
	Group = "snapshot.storage.k8s.io"
	// AnnBeingCreated is set before CreateSnapshot is sent and removed
	// once the driver answered with a snapshot or a final error: while it
	// is set the content is not deleted (the snapshot-controller waits).
	AnnBeingCreated = "snapshot.storage.kubernetes.io/volumesnapshot-being-created"
	// AnnBeingDeleted is the snapshot-controller's: the VolumeSnapshot is
	// being deleted, so the content's deletion is to be carried out.
	AnnBeingDeleted = "snapshot.storage.kubernetes.io/volumesnapshot-being-deleted"
	// AnnDeletionSecretName/-Namespace remember the snapshotter secret on
	// the content, for DeleteSnapshot after the class is gone.
	AnnDeletionSecretName = "snapshot.storage.kubernetes.io/deletion-secret-name"
	AnnDeletionSecretNS   = "snapshot.storage.kubernetes.io/deletion-secret-namespace"
	// ContentFinalizer is the snapshot-controller's; it is removed here
	// once the snapshot is deleted (or retained).
	ContentFinalizer = "snapshot.storage.kubernetes.io/volumesnapshotcontent-bound-protection"
	// annGroupMember marks a content made as a member of a group snapshot:
	// its snapshot is made by the group's CreateVolumeGroupSnapshot.
	annGroupMember = "groupsnapshot.storage.k8s.io/volumeGroupSnapshotHandle"
	// AnnNode records, on the content of a node-local driver's snapshot,
	// the node whose proxy made it (csibroker's, as on PVs).
	AnnNode = kube.AnnVolumeNode

	// Parameters --extra-create-metadata adds.
	ParamSnapshotName      = "csi.storage.k8s.io/volumesnapshot/name"
	ParamSnapshotNamespace = "csi.storage.k8s.io/volumesnapshot/namespace"
	ParamContentName       = "csi.storage.k8s.io/volumesnapshotcontent/name"

	// recordName is the ConfigMap of the snapshots being created.
	recordName = "csibroker-snapshot-intents"
)

// errNotReady requeues a content whose snapshot is not ready yet with the
// key's backoff, as csi-snapshotter does; it is no failure.
var errNotReady = errors.New("snapshot not ready yet")

// Controller makes, checks and deletes the snapshots of the
// VolumeSnapshotContents of registered drivers.
type Controller struct {
	b        *kube.Env
	client   snapshotclient.Interface
	contents snaplisters.VolumeSnapshotContentLister
	classes  snaplisters.VolumeSnapshotClassLister
	queue    *kube.TermQueue
	slots    *kube.DriverSlots
	intents  *intent.Record[Entry]
	// frame is the content steps shared with the group controller.
	frame *snapshots.Contents[*snapshotv1.VolumeSnapshotContent]

	ops, recovered *prometheus.CounterVec
	// recoverNow wakes the recovery loop (a content went).
	recoverNow chan struct{}
	// inflight holds the names of the snapshots workers are making now:
	// recovery leaves their entries to them.
	inflight sync.Map
}

// Served reports whether the API server serves VolumeSnapshotContents and
// VolumeSnapshotClasses (the CRDs are installed).
func Served(d discovery.DiscoveryInterface) (bool, error) {
	return snapshots.Served(d, Group+"/v1", "volumesnapshotcontents", "volumesnapshotclasses")
}

// New is the snapshot controller, or nil when the broker has no snapshot
// client or the cluster does not serve the snapshot API (no CRDs: there
// is nothing to watch; install them and restart the broker).
func New(b *kube.Env) (*Controller, error) {
	if b.Cfg.SnapshotClient == nil {
		b.Log.Info("no snapshot API client: VolumeSnapshotContents are not handled")
		return nil, nil
	}
	served, err := Served(b.Cfg.Client.Discovery())
	if err != nil {
		return nil, err
	}
	if !served {
		b.Log.Info("the cluster does not serve " + Group + "/v1 VolumeSnapshotContents and VolumeSnapshotClasses (no snapshot CRDs): snapshots are not made; install the CRDs and restart the broker")
		return nil, nil
	}
	c := &Controller{b: b, client: b.Cfg.SnapshotClient, queue: b.NewTermQueue("snapshot"), recoverNow: make(chan struct{}, 1)}
	c.slots = c.queue.WithSlots(b.Cfg.PerDriverWorkers)
	if c.ops, err = kube.OperationsCounter(b.Cfg.Registerer, "snapshot_operations_total",
		"VolumeSnapshotContent operations by driver and result (created, not_ready, imported, deleted, retained, failed, not_called, delete_failed)."); err != nil {
		return nil, err
	}
	if c.recovered, err = kube.OperationsCounter(b.Cfg.Registerer, "recovered_snapshots_total",
		"Snapshots made for contents that vanished (or by a broker that died) and deleted by recovery, by driver and result (deleted, not_made, failed)."); err != nil {
		return nil, err
	}
	b.Metrics.QueueDepth("snapshot", c.queue.Len)
	c.intents = snapshots.NewRecord[Entry](b, recordName,
		"snapshots being created; entries are removed when their VolumeSnapshotContent records the snapshot or the snapshot is deleted")

	// The informers are the broker's one factory's, over the snapshot
	// client of the informers' budget.
	si := b.Cfg.SnapshotInformerClient
	contentInf := b.Factory.InformerFor(&snapshotv1.VolumeSnapshotContent{}, func(_ kubernetes.Interface, resync time.Duration) cache.SharedIndexInformer {
		return snapinformers.NewVolumeSnapshotContentInformer(si, resync, cache.Indexers{})
	})
	classInf := b.Factory.InformerFor(&snapshotv1.VolumeSnapshotClass{}, func(_ kubernetes.Interface, resync time.Duration) cache.SharedIndexInformer {
		return snapinformers.NewVolumeSnapshotClassInformer(si, resync, cache.Indexers{})
	})
	c.contents = snaplisters.NewVolumeSnapshotContentLister(contentInf.GetIndexer())
	c.classes = snaplisters.NewVolumeSnapshotClassLister(classInf.GetIndexer())
	b.AddSynced(contentInf.HasSynced)
	b.AddSynced(classInf.HasSynced)
	c.frame = kind()
	c.frame.Env, c.frame.Queue, c.frame.Slots, c.frame.Lister, c.frame.Fetch, c.frame.Ours = b, c.queue, c.slots, c.contents, c.fetch, c.ours
	b.On(contentInf, c.frame.Handler(func(vsc *snapshotv1.VolumeSnapshotContent) {
		// A snapshot recorded as being made for it may be left.
		if c.intents.Has(snapshotName(c.b.Cfg, vsc)) {
			c.wakeRecovery()
		}
	}))
	b.On(classInf, snapshots.ClassHandler[*snapshotv1.VolumeSnapshotClass](c.frame))
	return c, nil
}

// ours: a content of a registered driver with a source to work from.
func (c *Controller) ours(vsc *snapshotv1.VolumeSnapshotContent) bool {
	src := vsc.Spec.Source
	return (src.VolumeHandle != nil || src.SnapshotHandle != nil) && c.b.Registered(vsc.Spec.Driver)
}

// kind is what the shared content steps know of VolumeSnapshotContents;
// the controller adds its own (Env, Queue, Slots, Lister, Fetch, Ours).
func kind() *snapshots.Contents[*snapshotv1.VolumeSnapshotContent] {
	return &snapshots.Contents[*snapshotv1.VolumeSnapshotContent]{What: "snapshot", Kind: "VolumeSnapshotContent",
		Driver:     func(vsc *snapshotv1.VolumeSnapshotContent) string { return vsc.Spec.Driver },
		Ref:        func(vsc *snapshotv1.VolumeSnapshotContent) corev1.ObjectReference { return vsc.Spec.VolumeSnapshotRef },
		Class:      func(vsc *snapshotv1.VolumeSnapshotContent) *string { return vsc.Spec.VolumeSnapshotClassName },
		Ready:      isReady,
		Recorded:   hasHandle,
		KeepStatus: func(cur, old *snapshotv1.VolumeSnapshotContent) { cur.Status = old.Status },
		// Readiness that changes either way: ready, or made not ready by
		// another writer (the snapshot-controller fills a group member's
		// status from the group's first answer, which may follow the
		// broker's own check).
		AnyReadyChange: true, NotReady: errNotReady, Mark: AnnBeingCreated}
}

func (c *Controller) fetch(ctx context.Context, name string) (*snapshotv1.VolumeSnapshotContent, error) {
	return c.client.SnapshotV1().VolumeSnapshotContents().Get(ctx, name, metav1.GetOptions{})
}

// EnqueueAll queues every content of a registered driver (start of a
// term, a driver registered).
func (c *Controller) EnqueueAll() { c.frame.EnqueueAll() }

// Run works while this replica leads: the contents, the term's intent
// record writer and the recovery of snapshots left by vanished contents.
func (c *Controller) Run(ctx context.Context) {
	c.intents.StartTerm()
	c.frame.Work(ctx, c.sync, c.intents.Run, c.recoveryLoop)
}

// sync does the next step of one content.
func (c *Controller) sync(ctx context.Context, key string) (time.Duration, error) {
	return c.frame.Sync(ctx, key, c.step)
}

// step is the next step of content vsc.
func (c *Controller) step(ctx context.Context, vsc *snapshotv1.VolumeSnapshotContent) error {
	_, member := vsc.Annotations[annGroupMember]
	switch {
	case shouldDelete(vsc):
		return c.deleteContent(ctx, vsc)
	case vsc.Spec.Source.VolumeHandle != nil && vsc.Status == nil && !member:
		return c.create(ctx, vsc)
	case isReady(vsc):
		// Ready: nothing to ask the driver; an annotation left by a
		// failed write goes.
		return c.settled(ctx, vsc)
	case vsc.Spec.Source.SnapshotHandle != nil || (vsc.Status != nil && vsc.Status.VolumeGroupSnapshotHandle != nil && vsc.Status.SnapshotHandle != nil):
		return c.refresh(ctx, vsc)
	case !member:
		// Made but not ready: CreateSnapshot is asked again (it is
		// idempotent by name) until the driver says ready.
		return c.create(ctx, vsc)
	}
	// A group member whose status the snapshot-controller has not written
	// yet: looked at again with backoff, as csi-snapshotter requeues it
	// (that status write is an update the filter lets by).
	return errNotReady
}

// shouldDelete is csi-snapshotter's test: the content is being deleted,
// and either it is a pre-provisioned content never bound, or its
// snapshot is not being created and the snapshot-controller marked it
// being deleted.
func shouldDelete(vsc *snapshotv1.VolumeSnapshotContent) bool {
	if vsc.DeletionTimestamp == nil {
		return false
	}
	if vsc.Spec.Source.SnapshotHandle != nil && vsc.Spec.VolumeSnapshotRef.UID == "" {
		return true
	}
	if _, ok := vsc.Annotations[AnnBeingCreated]; ok {
		return false
	}
	_, ok := vsc.Annotations[AnnBeingDeleted]
	return ok
}

func isReady(vsc *snapshotv1.VolumeSnapshotContent) bool {
	return vsc.Status != nil && vsc.Status.ReadyToUse != nil && *vsc.Status.ReadyToUse
}

// hasHandle: the status records the snapshot.
func hasHandle(vsc *snapshotv1.VolumeSnapshotContent) bool {
	return vsc.Status != nil && vsc.Status.SnapshotHandle != nil && *vsc.Status.SnapshotHandle != ""
}

// wakeRecovery makes the recovery loop run now.
func (c *Controller) wakeRecovery() {
	select {
	case c.recoverNow <- struct{}{}:
	default:
	}
}
