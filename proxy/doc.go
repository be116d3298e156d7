// Package proxy exposes one CSI driver's unix socket to the broker over mutual
// TLS and nothing else.
//
// It relays the HTTP/2 frames of every CSI method (every /csi.* service)
// between the broker's connections and one connection to the driver socket,
// without decoding messages and without a gRPC server or client per call: a
// frame read from one side is written to the other by the goroutine that
// read it. Each side keeps its own stream IDs, header compression and
// flow-control windows, and the sender is credited only for bytes passed on,
// so what the proxy holds for a slow reader is bounded by its windows.
// Status codes, messages, details, headers and trailers reach the broker
// unchanged, and services added to the CSI spec later pass through without a
// code change. It makes one server span per call (its context is what the
// driver receives) and the grpc_server_* metrics. It authorizes only the broker's SPIFFE
// identity, reconnects by itself when the driver restarts, and serves
// /healthz and /readyz plus a small info API of its own (proto/proxyinfo).
//
// It must never call Kubernetes or the broker, and never log message bodies.
package proxy
