// Package snapshot is the VolumeSnapshotContent controller, as
// csi-snapshotter v8.7.0's sidecar controller, for every registered driver
// at once (the snapshot-controller, which binds VolumeSnapshots to
// contents, stays as it is):
//
//   - a dynamic content (spec.source.volumeHandle) is snapshotted with
//     CreateSnapshot named <--snapshot-name-prefix>-<VolumeSnapshot UID>
//     (--snapshot-name-uuid-length), the VolumeSnapshotClass's parameters
//     less its csi.storage.k8s.io/ secret keys (another key of that prefix
//     is refused, as upstream refuses it), and with --extra-create-metadata
//     the snapshot's name and namespace and the content's name; the status
//     gets snapshotHandle, creationTime, restoreSize and readyToUse, and
//     CreateSnapshot is asked again, with the key's backoff, until the
//     driver says ready;
//   - a pre-provisioned content (spec.source.snapshotHandle) gets its
//     status from ListSnapshots by the snapshot's ID, with the class's
//     snapshotter-list secret (a driver without LIST_SNAPSHOTS: ready as
//     named, as upstream);
//   - deletion follows csi-snapshotter's rules exactly: a content being
//     deleted is acted on once it is a never-bound pre-provisioned one, or
//     the snapshot-controller marked it volumesnapshot-being-deleted and
//     it is not volumesnapshot-being-created; with deletionPolicy Delete
//     its snapshot is deleted (DeleteSnapshot, then the status's snapshot
//     fields cleared), with Retain kept; then the snapshot-controller's
//     volumesnapshotcontent-bound-protection finalizer is removed;
//   - the snapshotter secret is the one remembered on the content
//     (snapshot.storage.kubernetes.io/deletion-secret-name/-namespace,
//     which the snapshot-controller writes) or else the class's
//     csi.storage.k8s.io/snapshotter-secret-name/-namespace resolved with
//     csi-snapshotter's templates (k8sbridge/secrets.SnapshotRef), then
//     remembered on the content in the same write as the being-created
//     mark, so DeleteSnapshot finds it after the class is gone. Every use
//     (CreateSnapshot, DeleteSnapshot, ListSnapshots) is decided by the
//     policy first, the VolumeSnapshot as requester;
//   - node-local drivers: the snapshot is made by the proxy on the node of
//     the source volume's PersistentVolume, and that node is recorded on
//     the content (csibroker.io/node) for its ListSnapshots and deletion.
//
// No leaked snapshots. Before the first CreateSnapshot of a content the
// call's intent (its request without secrets, the secret's reference, the
// node, the content's UID) is made durable in a record of its own
// (ConfigMap csibroker-snapshot-intents, an intent.Record, batched like
// the volumes'), and the content marked being-created (which holds the
// snapshot-controller's deletion back). The entry goes once the status
// records the snapshot. A content that vanishes while its CreateSnapshot
// runs (the status write finds it gone), a content deleted before its
// status recorded one, and every entry whose content is gone at a term's
// start or each --recovery-interval, are undone: the recorded request is
// asked again (idempotent by name) to learn the snapshot's ID, and the
// snapshot deleted, whatever the deletionPolicy (nothing else records
// it). A final error from the driver (anything but Canceled,
// DeadlineExceeded, Unavailable, ResourceExhausted, Aborted) means no
// snapshot is being made: the mark and the entry go.
//
// Bad input and failures (a class of another driver or none, a secret the
// policy denies or that is missing, a driver error, a driver without
// CREATE_DELETE_SNAPSHOT, a driver that cannot be reached) are each the
// content's status.error (written only when it changes), a Warning Event
// (SnapshotCreationFailed, SnapshotContentCheckandUpdateFailed,
// SnapshotDeleteError; once per failure), a log line and a retry with
// backoff. Updates are filtered as upstream filters them (status,
// finalizer and being-created changes, the controller's own writes, do not
// bypass the backoff).
//
// Deviations, each to save API writes: CreateSnapshot asked again for a
// content whose status already records the snapshot (waiting for ready)
// does not set and remove the being-created mark around the call (the
// handle is recorded: a deletion meanwhile finds it). Metadata and status
// writes are merge patches carrying the resourceVersion read, not GETs
// followed by writes; only the status write after a successful
// CreateSnapshot that meets a newer content reads it and writes again
// (rather than asking the driver again). A retried CreateSnapshot whose
// entry is recorded already, with the same request, writes no new entry.
//
// The controller exists only when the API server serves the snapshot API
// (discovery at start; install the CRDs, then restart the broker). Its
// informers are on the broker's one factory. It reaches Kubernetes and the
// drivers through k8sbridge/internal/kube and internal/drivers, and
// imports no other controller; the content steps, recovery and secret
// rules it shares with the group controller are in
// k8sbridge/internal/snapshots. Group snapshots are not handled here.
package snapshot
