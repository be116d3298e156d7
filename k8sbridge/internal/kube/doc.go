// Package kube is the Kubernetes plumbing k8sbridge's controllers share:
// the Env each of them is given (configuration, informer factory and
// listers, Events reported once per failure, the intent record, the
// capabilities cache, handler fan-out), the term queue and driver slots,
// patches, CSI migration, the claim and PV helpers more than one
// controller needs, secret resolution through the policy, the
// annotations and finalizers shared with the sidecars, the controllers'
// metrics and the informer transform that keeps the caches small.
//
// Isolation: a term queue's work item that panics fails alone (log with
// the stack, metric, an Event on the object the controller names for its
// key, retry with backoff). Per-driver slots bound each driver's
// operations in progress, and each slot taken starts a worker of its own
// (stopped once the slot is given back), so a driver whose calls hang
// holds only its own slots' workers: the --worker-threads stay free for
// the other drivers. Config.PanicHook is a test-only hook, honoured only
// in a test binary, to prove it.
//
// It holds no controller and imports none.
package kube
