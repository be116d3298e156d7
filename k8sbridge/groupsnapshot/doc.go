// Package groupsnapshot is the VolumeGroupSnapshotContent controller
// (groupsnapshot.storage.k8s.io/v1, the version csi-snapshotter v8.7.0
// uses), as csi-snapshotter's group snapshot side, for every registered
// driver with the group controller's CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT
// capability (the snapshot-controller, which binds VolumeGroupSnapshots to
// contents and makes the member VolumeSnapshots and their contents, stays
// as it is; the members' contents are the snapshot controller's):
//
//   - a dynamic content (spec.source.volumeHandles) is snapshotted with
//     CreateVolumeGroupSnapshot named <--groupsnapshot-name-prefix>-<UID of
//     the VolumeGroupSnapshot> (--groupsnapshot-name-uuid-length), the
//     VolumeGroupSnapshotClass's parameters less its csi.storage.k8s.io/
//     secret keys (another key of that prefix is refused), and with
//     --extra-create-metadata the group snapshot's name and namespace and
//     the content's name; the status gets volumeGroupSnapshotHandle,
//     creationTime, readyToUse and, once, volumeSnapshotInfoList (each
//     member's volume and snapshot handles, creation time, readiness and
//     restore size), from which the snapshot-controller makes the members;
//   - until it is ready, GetVolumeGroupSnapshot is asked with the key's
//     backoff (csi-snapshotter asks CreateVolumeGroupSnapshot again: Get is
//     the read-only call made for this, and needs no being-created mark);
//   - a pre-provisioned content (spec.source.groupSnapshotHandles) gets its
//     status from GetVolumeGroupSnapshot, with the class's
//     group-snapshotter-get secret; as in csi-snapshotter, no member list;
//   - deletion follows csi-snapshotter's rules: a content being deleted is
//     acted on once it is a never-bound pre-provisioned one, or the
//     snapshot-controller marked it volumegroupsnapshot-being-deleted and
//     it is not volumegroupsnapshot-being-created; with deletionPolicy
//     Delete its group snapshot is deleted (DeleteVolumeGroupSnapshot with
//     the members' snapshot IDs, then the status's group fields cleared),
//     with Retain kept; then the volumegroupsnapshotcontent-bound-protection
//     finalizer is removed;
//   - the group snapshotter secret is the one remembered on the content
//     (groupsnapshot.storage.kubernetes.io/deletion-secret-name/-namespace,
//     which the snapshot-controller writes) or else the class's
//     csi.storage.k8s.io/group-snapshotter-secret-name/-namespace resolved
//     with csi-snapshotter's templates, then remembered on the content with
//     the being-created mark. Every use (CreateVolumeGroupSnapshot,
//     DeleteVolumeGroupSnapshot, GetVolumeGroupSnapshot) is decided by the
//     policy first, the VolumeGroupSnapshot as requester.
//
// No leaked group snapshots. Before CreateVolumeGroupSnapshot the call's
// intent (its request without secrets, the secret's reference, the
// content's UID) is made durable in a record of its own (ConfigMap
// csibroker-group-snapshot-intents, an intent.Record) and the content is
// marked being-created. The entry goes once the status records the group.
// A content that vanishes while the call runs, one deleted before its
// status recorded a group, and every entry whose content is gone at a
// term's start or each --recovery-interval, are undone: the recorded
// request is asked again (idempotent by name) to learn the group's ID and
// members, and the group deleted, whatever the deletionPolicy. A final
// error means nothing is being made: the mark and the entry go.
//
// Bad input and failures (a class of another driver or none, a secret the
// policy denies or that is missing, a driver error, a driver without the
// group capability, a driver that cannot be reached, a node-local driver,
// whose groups are not made) are each the content's status.error, a
// Warning Event (GroupSnapshotCreationFailed,
// GroupSnapshotContentCheckandUpdateFailed, GroupSnapshotDeleteError; once
// per failure), a log line and a retry with backoff.
//
// The controller exists only when the API server serves the v1 group
// snapshot API at the broker's start. Its informers are on the broker's
// one factory. It imports no other controller; what it shares with the
// snapshot controller (the content steps, recovery, the secret rules) is
// in k8sbridge/internal/snapshots.
package groupsnapshot
