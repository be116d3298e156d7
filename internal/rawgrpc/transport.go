package rawgrpc

import (
	"net"
	"time"

	"google.golang.org/grpc"
)

// Window sizes of the gRPC connections csibroker dials (broker → proxy, the
// proxy's own Probe client); the front end (broker/h2front.go) and the
// proxy's relay speak HTTP/2 themselves and advertise the same or their own
// windows. Setting them explicitly turns off gRPC's
// bandwidth-delay estimator, which otherwise answers received DATA frames with
// PING frames: on a hop that carries small request/response pairs that is an
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

// DrainLinger bounds how long a drained connection waits for its peer to
// close after ShutdownWrite.
const DrainLinger = time.Second

// ShutdownWrite ends a connection whose last answer was written: its
// writes are shut (close_notify for TLS, FIN for a plain socket), so what
// was written reaches the peer, and the connection's reader is left to read
// what the peer still sends until the peer closes or DrainLinger passes,
// and then to close it. Closing at once could, with bytes of the peer's
// still unread (a WINDOW_UPDATE, a PING), reset the connection and lose the
// answer not yet sent. It reports false, having closed nc, for a
// connection whose writes cannot be shut alone.
func ShutdownWrite(nc net.Conn) bool {
	cw, ok := nc.(interface{ CloseWrite() error })
	if !ok || cw.CloseWrite() != nil {
		nc.Close()
		return false
	}
	nc.SetReadDeadline(time.Now().Add(DrainLinger))
	return true
}
