// Package k8sbridge is the Kubernetes side of csibroker: Config, New and
// Run. New builds one set of informers for every driver and an explicit
// list of controllers; Run keeps the caches warm on every replica and runs
// the controllers while this replica holds the leader lease.
//
// The house, from the top down:
//
//   - k8sbridge: leader election, readiness, the list of controllers.
//   - provision, attach, resize, modify, capacity, snapshot: one controller
//     package each (provision holds provisioning, recovery of leaked
//     volumes, protection of clone and snapshot sources, and deletion;
//     snapshot is csi-snapshotter's VolumeSnapshotContent side, run only
//     when the cluster serves the snapshot API). A
//     controller package imports the plumbing below it and never another
//     controller (layout_test.go enforces it).
//   - internal/kube: the Env every controller is given (configuration,
//     listers, Events reported once per failure, the intent record, the
//     term queue and driver slots, patches, the claim and PV helpers more
//     than one controller needs, the annotations shared with the sidecars,
//     secret resolution through the policy).
//   - internal/drivers: the Drivers interface the broker satisfies, the
//     capabilities cache, call timeouts.
//   - topology, csiparams, secrets: pure functions with table tests;
//     intent: the durable records of in-flight CreateVolume (and, in a
//     sibling record, CreateSnapshot) calls.
//   - grants (SecretGrant objects into the policy) and discovery (proxy
//     pods into the broker's registry) stand beside the bridge; cmd wires
//     them.
//
// It reaches drivers only through the Drivers interface, which broker
// satisfies.
package k8sbridge
