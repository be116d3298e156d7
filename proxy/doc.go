// Package proxy exposes one CSI driver's unix socket to the broker over mutual
// TLS and nothing else.
//
// It forwards every gRPC method of every service opaquely (frames are copied
// without being decoded), so status codes, messages, details, headers and
// trailers reach the broker unchanged, and services added to the CSI spec later
// pass through without a code change. It authorizes only the broker's SPIFFE
// identity, reconnects by itself when the driver restarts, and serves
// /healthz and /readyz plus a small info API of its own (proto/proxyinfo).
//
// It must never call Kubernetes or the broker, and never log message bodies.
package proxy
