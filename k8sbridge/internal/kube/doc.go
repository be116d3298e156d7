// Package kube is the Kubernetes plumbing k8sbridge's controllers share:
// the annotations and finalizers shared with the sidecars, the informer
// transform that keeps the caches small, and (as they move here) clients,
// listers, Events reported once per failure, the term queue and driver
// slots, patches and the claim/PV helpers more than one controller needs.
//
// It holds no controller and imports none.
package kube
