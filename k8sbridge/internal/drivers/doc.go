// Package drivers is what k8sbridge's controllers know of the broker: the
// Drivers interface (connections to a driver's controller and node
// proxies, whether it is registered, node-local, and each call's timeout),
// the capabilities cache every controller asks before calling, and
// CallContext, which bounds one call.
//
// The broker satisfies Drivers; tests pass small fakes. It imports no
// Kubernetes package.
package drivers
