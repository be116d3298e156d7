// Package discovery finds driver proxies from Kubernetes: pods with a label
// selector (in the namespaces given), their annotations (driver name, port,
// node proxy, node-local) and IPs, registered with the broker as drivers;
// what cannot be used (a bad annotation, a pod outside the namespaces, a
// name a static driver holds) is reported with an Event on the pod, by the
// leader only.
//
// A proxy never calls in: the broker finds it here or in static config.
package discovery
