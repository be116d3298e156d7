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
// method and code labels are bounded (rawgrpc.OtherMethod). It serves a
// small info API of its own (proto/proxyinfo) on the same server.
//
// # Health
//
// On its HTTP endpoint, as livenessprobe and node-driver-registrar's
// health port do for a driver without csibroker:
//
//   - /healthz/driver is the driver's liveness: the driver answers Probe
//     within Config.ProbeTimeout (--probe-timeout). An answer of ready:
//     false is still alive (a driver that is starting is not restarted for
//     it; /readyz says it is not ready; livenessprobe differs here); an
//     error, a socket nobody answers, or no answer in time is not. The driver container's
//     livenessProbe points here.
//   - /livez is the proxy's own health: with kubelet registration on, it
//     fails while the registration socket is missing or cannot be created;
//     otherwise it passes. The proxy container's livenessProbe points
//     here: restarting the driver would not bring a registration back.
//   - /healthz is both, one line per check.
//   - /readyz: the driver answers Probe and does not say it is not ready.
//
// # Kubelet registration
//
// A node plugin's proxy (Config.Node) given Config.KubeletRegistrationPath
// registers the driver with the kubelet as node-driver-registrar does: it
// serves the kubelet's plugin-registration API
// (k8s.io/kubelet/pkg/apis/pluginregistration/v1, on grpcsrv's hardened
// options) on <Config.PluginRegistrationDir>/<driver>-reg.sock, advertising
// type CSIPlugin, the driver's name from GetPluginInfo, its socket as the
// kubelet sees it, and CSI version 1.0.0; it logs the kubelet's
// NotifyRegistrationStatus. Every Config.RegistrationCheckInterval it
// looks at the driver's socket and at the registration socket: a new
// driver socket (the driver restarted) means GetPluginInfo again and a
// new registration socket, under the name the driver now gives; a
// registration socket someone removed is created again. The kubelet
// registers a driver again whenever its socket is created anew. When the
// proxy stops the socket is removed, and the kubelet deregisters the
// driver.
//
// It must never call Kubernetes or the broker, and never log message bodies.
package proxy
