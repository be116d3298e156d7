package grpcsrv_test

import (
	"crypto/tls"
	"log/slog"
	"net"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/csibroker/csibroker/internal/grpcsrv"
)

// A hardened mTLS server whose every call is refused once the peer's
// certificate no longer verifies, and a unix-socket client with large
// socket buffers.
func ExampleServerOptions() {
	var cfg *tls.Config // from mtls.ServerConfig
	log := slog.Default()
	opts := append(grpcsrv.ServerOptions(grpcsrv.Limits{MaxConcurrentStreams: 128}),
		grpc.Creds(grpcsrv.Credentials(cfg, log, grpcsrv.LogHandshakeRefusals("refused a peer"))),
		grpc.StatsHandler(grpcsrv.CallTracker()),
		grpc.ChainUnaryInterceptor(grpcsrv.UnaryCheckPeer()),
		grpc.ChainStreamInterceptor(grpcsrv.StreamCheckPeer()))
	srv := grpc.NewServer(opts...)
	_ = srv // srv.Serve(listener)

	// A unix socket's server and client ends.
	if lis, err := net.Listen("unix", "/run/csibroker/front.sock"); err == nil {
		go grpc.NewServer(grpcsrv.ServerOptions(grpcsrv.Limits{})...).Serve(grpcsrv.UnixListener(lis))
	}
	const path = "/run/csi/csi.sock" // DialUnix is given the path
	_, _ = grpc.NewClient("passthrough:///"+path, grpc.WithContextDialer(grpcsrv.DialUnix),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
}
