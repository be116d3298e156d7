// Package broker owns the driver registry, the connection pool to the drivers'
// proxies over mTLS, the client middleware chain (timeout, retry, tracing,
// metrics, sanitized logging) and the CSI front ends (a unix socket per driver,
// and an optional mTLS TCP listener where request metadata names the driver;
// they speak HTTP/2 themselves and hand each call, undecoded, to the chain).
//
// It never imports Kubernetes packages: k8sbridge drives it through small
// interfaces declared on the k8sbridge side.
package broker
