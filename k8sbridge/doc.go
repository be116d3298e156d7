// Package k8sbridge is the Kubernetes side of csibroker: Config, New and
// Run. New builds one set of informers for every driver and an explicit
// list of controllers; Run keeps the caches warm on every replica and runs
// the controllers while this replica holds the leader lease.
//
// The house, from the top down:
//
//   - k8sbridge: leader election, readiness, the list of controllers.
//   - provision, attach, resize, modify, capacity, health, snapshot,
//     groupsnapshot: one controller package each (provision holds
//     provisioning, recovery of leaked volumes, protection of clone and
//     snapshot sources, and deletion; snapshot is csi-snapshotter's
//     VolumeSnapshotContent side, groupsnapshot its
//     VolumeGroupSnapshotContent side, each run only when the cluster
//     serves its API). A
//     controller package imports the plumbing below it and never another
//     controller (layout_test.go enforces it).
//   - internal/kube: the Env every controller is given (configuration,
//     listers, Events reported once per failure, the intent record, the
//     term queue and driver slots, patches, the claim and PV helpers more
//     than one controller needs, the annotations shared with the sidecars,
//     secret resolution through the policy).
//   - internal/drivers: the Drivers interface the broker satisfies, the
//     capabilities cache, call timeouts; internal/snapshots: what the two
//     snapshot controllers share (csi-snapshotter's final-error test and
//     class-parameter rules).
//   - topology, csiparams, secrets: pure functions with table tests;
//     intent: the durable records of in-flight CreateVolume (and, in
//     sibling records, CreateSnapshot and CreateVolumeGroupSnapshot) calls.
//   - grants (SecretGrant objects into the policy) and discovery (proxy
//     pods into the broker's registry) stand beside the bridge; cmd wires
//     them.
//
// It reaches drivers only through the Drivers interface, which broker
// satisfies.
//
// # Per-driver leader election
//
// With Config.LeaderElectionMode per-driver (--leader-election-mode), the
// drivers are shared out among the replicas, each led by one of them
// through a Lease of its own (package shard says how). The cut is the
// drivers registry: the controllers run on every replica for its whole
// life, over shard.View, in which only the drivers this replica leads are
// registered. Every controller already skips objects of unregistered
// drivers and looks at everything again when a driver registers, so a
// driver taken is enqueued again at once, and one given up gets no new
// work. CallContext (internal/drivers) ends the CSI calls of a driver
// given up (after a drain) or lost (at once): what the calls were for is
// then as after a leader's crash today, and the intent record has it.
//
// What stays one for all, and what became per driver:
//
//   - The intent record stays one ConfigMap, written by every replica:
//     writes carry its resource version and a conflict re-reads it, so no
//     replica's write replaces another's entries. Each replica adds and
//     removes entries of the drivers it leads only (intent.Store.Share; a
//     Remove of another's entry is dropped, so a late one cannot delete an
//     entry the new leader wrote again), drops what it had queued for a
//     driver on each handover and reads the record again before using it
//     (Store.Handover). Recovery settles the entries of the drivers this
//     replica leads, and those of drivers no replica leads or has
//     registered (Env.Foreign).
//   - Capacity: a driver's CSIStorageCapacity objects are its leader's to
//     write or remove; another replica leaves them alone (no grace period
//     of its own that would delete them). Their owner stays the intent
//     ConfigMap.
//   - Grants and discovery run on every replica, as before; their status
//     writes and Events, and csibroker_leader, follow Leader(), which in
//     this mode is the coordinator: the holder of the leader Lease, elected
//     as today but running no controller.
//   - Events remembered per term (EventOnce) are the replica's: an Event
//     of a driver's failure may be recorded again by its next leader.
//   - Work between CSI calls (a PV being created after CreateVolume) is
//     not drained: a new leader may do it again beside the old one, as in
//     today's lease overlap; PV creation and the intent record are
//     idempotent for it.
package k8sbridge
