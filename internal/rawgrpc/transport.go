package rawgrpc

import "google.golang.org/grpc"

// Window sizes of the gRPC connections csibroker dials and serves
// (internal/grpcsrv sets them on every server). Setting them explicitly
// turns off gRPC's bandwidth-delay estimator, which otherwise answers
// received DATA frames with PING frames: on a hop that carries small request/response pairs that is an
// extra write and an extra wake-up of the peer per call, for a window that
// never needs to grow past the CSI messages' size. 1 MiB per stream and 4 MiB
// per connection hold any ordinary CSI message in one window.
const (
	StreamWindow = 1 << 20
	ConnWindow   = 4 << 20
)

// ClientTransportOptions are the dial options of every hop csibroker dials.
func ClientTransportOptions() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithInitialWindowSize(StreamWindow),
		grpc.WithInitialConnWindowSize(ConnWindow),
	}
}

// ServerTransportOptions are the matching server options, for a gRPC server
// on such a hop.
func ServerTransportOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.InitialWindowSize(StreamWindow),
		grpc.InitialConnWindowSize(ConnWindow),
	}
}
