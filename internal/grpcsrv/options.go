package grpcsrv

import (
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"

	"github.com/csibroker/csibroker/internal/rawgrpc"
)

// Limits are a server's resource limits. Zero fields take the defaults
// (see the package documentation for why each is what it is).
type Limits struct {
	// MaxConcurrentStreams bounds the calls in flight on one connection.
	MaxConcurrentStreams uint32
	// MaxRecvMsgSize and MaxSendMsgSize bound one message, in bytes.
	MaxRecvMsgSize int
	MaxSendMsgSize int
	// MaxHeaderListSize bounds a call's header block (its metadata).
	MaxHeaderListSize uint32
	// KeepaliveMinTime is the shortest interval between a client's pings
	// that the server tolerates; a client pinging more often is sent
	// GOAWAY (too_many_pings) and disconnected.
	KeepaliveMinTime time.Duration
	// KeepaliveTime is how long a connection is quiet before the server
	// pings it; KeepaliveTimeout how long it then waits for the ack before
	// closing the connection.
	KeepaliveTime    time.Duration
	KeepaliveTimeout time.Duration
	// ConnectionTimeout bounds a new connection's handshake (TLS and the
	// HTTP/2 preface).
	ConnectionTimeout time.Duration
	// MaxConnectionIdle is how long a connection may go without calls
	// before the server asks it to go away (GOAWAY; a client reconnects
	// when it next calls).
	MaxConnectionIdle time.Duration
}

// Defaults, documented in doc.go.
const (
	DefaultMaxConcurrentStreams = 256
	DefaultMaxMsgSize           = 64 << 20
	DefaultMaxHeaderListSize    = 1 << 20
	DefaultKeepaliveMinTime     = 10 * time.Second
	DefaultKeepaliveTime        = time.Minute
	DefaultKeepaliveTimeout     = 20 * time.Second
	DefaultConnectionTimeout    = 10 * time.Second
	DefaultMaxConnectionIdle    = time.Hour
)

// WithDefaults returns l with its zero fields set to the defaults.
func (l Limits) WithDefaults() Limits {
	set := func(v *time.Duration, d time.Duration) {
		if *v <= 0 {
			*v = d
		}
	}
	if l.MaxConcurrentStreams == 0 {
		l.MaxConcurrentStreams = DefaultMaxConcurrentStreams
	}
	if l.MaxRecvMsgSize <= 0 {
		l.MaxRecvMsgSize = DefaultMaxMsgSize
	}
	if l.MaxSendMsgSize <= 0 {
		l.MaxSendMsgSize = DefaultMaxMsgSize
	}
	if l.MaxHeaderListSize == 0 {
		l.MaxHeaderListSize = DefaultMaxHeaderListSize
	}
	set(&l.KeepaliveMinTime, DefaultKeepaliveMinTime)
	set(&l.KeepaliveTime, DefaultKeepaliveTime)
	set(&l.KeepaliveTimeout, DefaultKeepaliveTimeout)
	set(&l.ConnectionTimeout, DefaultConnectionTimeout)
	set(&l.MaxConnectionIdle, DefaultMaxConnectionIdle)
	return l
}

// ServerOptions are the hardened options of every csibroker gRPC server:
// l's limits (defaults for its zero fields), keepalive enforcement, and
// the flow-control windows of rawgrpc (set explicitly, so that grpc-go's
// bandwidth estimator's pings are off). Credentials, stats handlers,
// interceptors and codecs are the caller's.
func ServerOptions(l Limits) []grpc.ServerOption {
	l = l.WithDefaults()
	return append(rawgrpc.ServerTransportOptions(),
		grpc.MaxConcurrentStreams(l.MaxConcurrentStreams),
		grpc.MaxRecvMsgSize(l.MaxRecvMsgSize),
		grpc.MaxSendMsgSize(l.MaxSendMsgSize),
		grpc.MaxHeaderListSize(l.MaxHeaderListSize),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{
			MinTime:             l.KeepaliveMinTime,
			PermitWithoutStream: true,
		}),
		grpc.KeepaliveParams(keepalive.ServerParameters{
			Time:              l.KeepaliveTime,
			Timeout:           l.KeepaliveTimeout,
			MaxConnectionIdle: l.MaxConnectionIdle,
		}),
		grpc.ConnectionTimeout(l.ConnectionTimeout),
	)
}
