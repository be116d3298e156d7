// Package broker owns the driver registry and routing, the connections to
// the drivers' proxies over mTLS, the client chain every CSI call goes
// through, and the CSI front ends.
//
// Connections. Each proxy has one grpc-go ClientConn (conn.go), kept
// connected, pinged when idle, and redialled with backoff by grpc-go. It
// is replaced by a new one, calls in flight finishing on the old, when the
// proxy's certificate no longer verifies (expired since the handshake, or
// its CA left the bundle), when the broker's own certificate was reloaded
// (once the new connection is READY, so a proxy that refuses the new
// certificate costs no call), and when the driver is reconfigured.
//
// The chain (chain.go), outermost first: observe (one span per logical
// call, in-flight gauge, latency histograms, sanitized logs, secrets
// redacted from errors) → go-grpc-middleware's timeout (per driver and
// method) → go-grpc-middleware's retry (Unavailable only, jittered
// exponential backoff, no attempt started that cannot finish before the
// deadline; unary calls only) → the attempt, on the connection that serves
// the driver now, where otelgrpc's stats handler makes the client span and
// carries its W3C trace context to the proxy. The Kubernetes controllers
// call through typed CSI clients on a chainConn; the front ends forward
// raw frames through the same chain, so the pass-through codec
// (internal/rawgrpc) is used only where calls are forwarded.
//
// Front ends (frontend.go) are grpc-go servers (a unix socket per driver,
// an optional mTLS TCP listener where request metadata names the driver)
// with internal/grpcsrv's hardened limits, whose UnknownServiceHandler
// hands every /csi.* call to the chain undecoded.
//
// It never imports Kubernetes packages: k8sbridge drives it through small
// interfaces declared on the k8sbridge side, and implements no HTTP/2.
package broker
