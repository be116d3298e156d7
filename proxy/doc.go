// Package proxy exposes one CSI driver's unix socket to the broker over mutual
// TLS and nothing else.
//
// It is a grpc-go server (internal/grpcsrv's hardened options and
// peer-checking credentials) whose unknown-service handler forwards every
// CSI method (every /csi.* service), unary or streaming, without decoding
// it: messages are copied both ways as frames (rawgrpc.Forward) over one
// grpc-go client connection to the driver's socket, which grpc-go
// re-dials with backoff when the driver restarts. Status codes, messages,
// details, headers, trailers and binary metadata reach the broker
// unchanged; the caller's deadline and cancellation reach the driver; only
// the proxy's own failures (the driver cannot be reached, a call waited
// for a slot until its deadline) are errors of its own, naming the proxy.
// Services added to the CSI spec later pass through without a code change;
// every other path is Unimplemented.
//
// The driver never has more than Config.MaxConcurrentCalls calls (default
// 256) from the proxy at once, over every broker connection and the
// proxy's own Probe and GetPluginInfo: a call over the bound waits for a
// slot within its deadline. The same number is each broker connection's
// stream limit.
//
// It authorizes only the broker's SPIFFE identity (Config.TLS), and checks
// it again at every call: a broker connection whose certificate has
// expired or no longer verifies is refused and closed. It makes one server
// span per call (otelgrpc; its context is what the driver receives, as W3C
// trace context) and go-grpc-middleware's grpc_server_* metrics, whose
// method and code labels are bounded (rawgrpc.OtherMethod). It serves
// /healthz and /readyz, and a small info API of its own (proto/proxyinfo)
// on the same server.
//
// It must never call Kubernetes or the broker, and never log message bodies.
package proxy
