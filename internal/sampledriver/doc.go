// Package sampledriver is csibroker's own small but real CSI driver, used by
// the project's tests and demo in place of the hostpath driver (which is not
// installable here). It passes csi-sanity on its own.
//
// What it owns:
//
//   - Identity, Controller and Node services of CSI spec v1.13 over a unix
//     socket (or any net.Listener handed to Serve).
//   - Volumes are directories under <StateDir>/volumes/<volume-id>; a clone
//     copies the source directory, a snapshot copies the volume into
//     <StateDir>/snapshots/<snapshot-id>. Capacity is accounted, not enforced
//     on disk: the pool is Config.CapacityBytes and GetCapacity reports what
//     volumes have not claimed.
//   - Controller capabilities: create/delete (idempotent by name), publish
//     (attachments per node, read-only, MaxVolumesPerNode, access-mode
//     rules), list with paging and published nodes, get volume, capacity,
//     clone, snapshots (create/delete/list/get), expansion (grow only, node
//     expansion required), modify (mutable parameters "iops" and "tier")
//     and volume health; DisablePublish drops the publish step. Node:
//     stage/unstage, publish/unpublish, stats, expansion, health,
//     SINGLE_NODE_MULTI_WRITER.
//   - Snapshots (snapshots.go): CreateSnapshot is idempotent by name and
//     source; Config.SnapshotReadyAfter keeps a new snapshot
//     ready_to_use=false for that long, the CO asking CreateSnapshot
//     again until it is ready, as for a driver that uploads snapshots.
//     ListSnapshots pages in ID order (a token is the ID to resume at;
//     one not handed out is Aborted) and filters by snapshot and source
//     volume.
//   - The GroupController service (groups.go; Config.DisableGroupSnapshots
//     leaves it out): CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT, a group
//     being one snapshot per source volume cut under the driver's lock,
//     idempotent by name, source set and parameters. Members carry the
//     group ID, list, get and restore like any snapshot, and are deleted
//     only with their group (DeleteSnapshot of one is InvalidArgument, as
//     the spec says).
//   - State (volumes, attachments, snapshots, group snapshots, this node's stage and publish
//     mounts) lives in <StateDir>/state.json and its journal: a call that
//     changes an entry appends the entry's new value to the journal and
//     fsyncs it before it returns, so a new Driver on the same StateDir sees
//     everything and a call's cost does not grow with the number of
//     volumes. Once the journal outgrows state.json (and 64 KiB), the whole state is
//     rewritten atomically (temp file, fsync, rename, fsync of the
//     directory) with a new, empty journal (see journal.go). A lock file
//     keeps two live drivers off one StateDir. On ext4, most of a
//     CreateVolume's time is the mkdir of its directory, whose metadata
//     the journal's fsync commits (BENCHMARKS.md measures the CSI path on
//     this driver).
//   - The node side uses real bind mounts: NodeStageVolume binds the volume
//     directory onto the staging path, NodePublishVolume binds the staging
//     path onto the target (created if missing, removed on unpublish,
//     remounted read-only when asked). Mount state is checked against
//     /proc/self/mountinfo and by comparing inodes, so calls are idempotent
//     and survive a driver restart.
//   - Fault injection (latency, error rate and code, fail the first N calls,
//     exit the process after N calls) is a gRPC unary server interceptor
//     configured by Config.Faults; see ParseFault for the flag syntax.
//
// What it must not do: log a request or response other than through
// protosanitizer.StripSecrets (secrets never reach a log), import anything
// from the rest of csibroker (it stands for an untrusted third-party driver),
// or touch paths other than its StateDir and the staging and target paths a
// CO hands it.
//
// Several instances can play one driver: a controller instance and node
// instances, each with its own StateDir and NodeID. A node instance finds the
// volume directory from the publish context ("devicePath") or the volume
// context ("path") that the controller returned, so they must share a
// filesystem (one machine, as in the project's tests).
package sampledriver
