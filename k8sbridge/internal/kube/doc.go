// Package kube is the Kubernetes plumbing k8sbridge's controllers share:
// the Env each of them is given (configuration, informer factory and
// listers, Events reported once per failure, the intent record, the
// capabilities cache, handler fan-out), the term queue and driver slots,
// patches, CSI migration, the claim and PV helpers more than one
// controller needs, secret resolution through the policy, the
// annotations and finalizers shared with the sidecars, the controllers'
// metrics and the informer transform that keeps the caches small.
//
// It holds no controller and imports none.
package kube
