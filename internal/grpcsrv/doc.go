// Package grpcsrv is what every csibroker gRPC server shares: hardened
// server options (ServerOptions), TLS credentials that re-check the peer's
// certificate at every call (Credentials, CheckPeer, CallTracker), and unix
// socket helpers that give each connection large socket buffers
// (DialUnix, UnixListener). The proxy and the broker's front ends use it;
// it must not know about CSI, the broker or Kubernetes.
//
// # Limits
//
// The defaults (Limits' zero fields) and why:
//
//   - MaxConcurrentStreams 256 per connection: the broker's default worker
//     and retry settings keep far fewer calls in flight per proxy; the bound
//     keeps a misbehaving peer from opening streams without limit (grpc-go's
//     clients queue streams over the limit instead of failing them).
//   - MaxRecvMsgSize and MaxSendMsgSize 64 MiB: the broker's own limit, so
//     a message the broker accepts is never refused on the next hop. CSI
//     messages are small; the largest real ones (ListVolumes, ListSnapshots
//     pages) are a few MiB.
//   - MaxHeaderListSize 1 MiB: what the hand-written relay accepted before;
//     CSI calls carry a few hundred bytes of metadata, and grpc-go's own
//     default (16 MiB) is more than any caller needs.
//   - Keepalive enforcement MinTime 10 s, PermitWithoutStream: the broker
//     pings idle connections every 30 s (and must not be disconnected for
//     it); a peer pinging more often than every 10 s is sent GOAWAY
//     (too_many_pings), which ends a PING flood.
//   - Server keepalive Time 1 min, Timeout 20 s: a peer that vanished
//     without closing (a node gone) is noticed within 80 s, so its
//     connection's resources go.
//   - ConnectionTimeout 10 s: a connection that has not finished its TLS
//     handshake and HTTP/2 preface by then is closed (slowloris).
//   - MaxConnectionIdle 1 h: a connection without calls for an hour is sent
//     GOAWAY; its client reconnects when it next calls. Longer than the
//     broker's idle time between calls on any live proxy, short enough
//     that abandoned connections do not pile up.
//   - No MaxConnectionAge: what a forced reconnect would catch (a peer
//     whose certificate changed or expired) the per-call peer check
//     catches, without a handshake and a broken stream for every
//     connection on a timer.
//   - The flow-control windows of rawgrpc (1 MiB per stream, 4 MiB per
//     connection), set explicitly, which also turns off grpc-go's
//     bandwidth estimator and its PINGs.
//
// # Peer checks
//
// A TLS handshake verifies the peer once; a connection may then live for
// days. Credentials record an mtls.PeerCheck per connection, and CheckPeer
// (UnaryCheckPeer, StreamCheckPeer) verifies the peer again at every call:
// a lock and two comparisons unless the CA bundle or our certificate was
// reloaded, or a peer certificate expired. A peer that no longer verifies
// has its call refused with Unavailable, and its connection is closed once
// its calls in flight have ended (CallTracker counts them with two atomic
// adds per call): grpc-go has no GOAWAY for one connection, and a closed
// connection makes the client reconnect with its current certificate (or
// fail a new handshake, which LogHandshakeRefusals logs with the reason;
// the client hears only "bad certificate"). Expiry, what a routine renewal
// looks like, is logged at INFO; any other failure at WARN. The refused
// call's status is written before the close: the close waits 200 ms after
// the connection's last call ended.
//
// # Unix socket buffers (grpc-go issue 9330)
//
// From grpc-go v1.82.1 (the fix for HTTP/2 rapid reset, GHSA-hrxh-6v49-42gf)
// to v1.84, every queued stream registration and cleanup counted toward the
// control buffer's throttle (100 items): with many concurrent unary calls on
// one connection both peers could stop reading while their writers were
// blocked on a full socket, and neither ever recovered. Small socket
// buffers are what let the writers block. v1.85.0, which csibroker uses,
// counts per side only the frames a peer can make it queue (PING and
// SETTINGS acks, window updates, and on the server the resets of refused
// streams), raises the limit to 10,000, and makes a client close a
// connection whose reads stay throttled for 10 s. DialUnix and UnixListener
// still set SO_SNDBUF and SO_RCVBUF to 4 MiB (the upstream workaround;
// Linux caps them at net.core.wmem_max and rmem_max), so that our writer
// has room for a burst of frames whatever grpc-go version the peer links. (For a unix stream socket it is the
// sender's SO_SNDBUF that bounds what is in flight: the buffers set on our
// end cover what we write, the driver's end is the driver's.)
//
// Measured here (2 cores, Linux, net.core.wmem_max 4 MiB; a raw-codec echo
// server and one ClientConn on a unix socket, N goroutines each calling in
// a loop; "deadlock" is 5 s without a completed call):
//
//	grpc-go  callers  socket buffers        result
//	v1.82.1    512    default (208 KiB)     146,742 calls in 15 s
//	v1.82.1  2,048    default               127,172 in 15 s; 725,499 in 40 s
//	v1.82.1  2,048    8 KiB                 deadlock after 122 calls
//	v1.82.1  2,048    64 KiB                208,212 in 15 s
//	v1.82.1  2,048    4 MiB                 92,636 in 15 s
//	v1.85.0    512    default               144,712 in 20 s
//	v1.85.0  2,048    default               105,370 in 20 s
//	v1.85.0  2,048    default, 4 KiB calls  118,189 in 20 s
//	v1.85.0  2,048    default, limit 50     245,648 in 20 s
//	v1.85.0  2,048    8 KiB                 174,510 in 20 s
//	v1.85.0  2,048    4 KiB                 305,744 in 20 s
//	v1.85.0  2,048    4 MiB (these helpers) 151,569 in 20 s
//
// ("limit 50": GRPC_GO_EXPERIMENTAL_CONTROL_BUFFER_THROTTLE_LIMIT=50.) So
// plain grpc-go v1.85.0 with default buffers did not deadlock here with
// 2,048 callers, nor with buffers far smaller than the default; v1.82.1
// did, with small buffers. The proxy's test TestManyConcurrentCallers keeps
// 512 and 2,048 concurrent callers through the proxy to the sample driver
// bounded in time.
package grpcsrv
