package grpcsrv

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"

	"github.com/csibroker/csibroker/internal/mtls"
)

// closeLinger is how long a refused connection stays open after its last
// call ended, so that the call's status (written by grpc-go's writer after
// the call's end is reported) reaches the peer before the connection
// closes.
const closeLinger = 200 * time.Millisecond

// AuthInfo is what the credentials of Credentials record about a
// connection: the TLS state grpc-go's own credentials record, and the
// check of the peer's certificate that CheckPeer runs for each call.
type AuthInfo struct {
	credentials.TLSInfo
	// Peer verifies the peer's certificate again, as the handshake did.
	Peer *mtls.PeerCheck
	conn *connState
}

// connState is one connection's call count and refusal.
type connState struct {
	nc       net.Conn
	log      *slog.Logger
	desc     string
	inflight atomic.Int64
	refused  atomic.Bool // CheckPeer failed: close once no call is in flight
	once     sync.Once   // the refusal is logged and the close armed once
}

// release ends a call; the last call of a refused connection closes it.
func (c *connState) release() {
	if c.inflight.Add(-1) == 0 && c.refused.Load() {
		c.closeSoon()
	}
}

func (c *connState) closeSoon() {
	time.AfterFunc(closeLinger, func() { c.nc.Close() })
}

// creds wraps grpc-go's TLS credentials to record a PeerCheck per
// connection.
type creds struct {
	credentials.TransportCredentials
	cfg *tls.Config // what PeerChecks verify with: the caller's, unwrapped
	log *slog.Logger
}

// CredentialsOption adjusts Credentials.
type CredentialsOption func(hs *tls.Config, log *slog.Logger)

// LogHandshakeRefusals logs, at WARN with msg, every peer certificate a
// TLS handshake refuses (the handshake itself only fails). The checks of
// CheckPeer are not logged so: they log their own refusal once per
// connection, at INFO for an expiry.
func LogHandshakeRefusals(msg string) CredentialsOption {
	return func(hs *tls.Config, log *slog.Logger) {
		verify := hs.VerifyPeerCertificate
		hs.VerifyPeerCertificate = func(raw [][]byte, chains [][]*x509.Certificate) error {
			var err error
			if verify != nil {
				err = verify(raw, chains)
			} else if len(raw) == 0 {
				err = errors.New("peer presented no certificate")
			}
			if err != nil {
				log.Warn(msg, "err", err)
			}
			return err
		}
	}
}

// Credentials are grpc-go's TLS server credentials over cfg (a server
// configuration of internal/mtls, whose callbacks read the current
// certificate and authorize the peer), recording each connection's
// *mtls.PeerCheck in its AuthInfo so that CheckPeer can verify the peer
// again at every call. Use them with CallTracker; log receives the
// refusals of CheckPeer (and of the handshakes, with LogHandshakeRefusals).
func Credentials(cfg *tls.Config, log *slog.Logger, opts ...CredentialsOption) credentials.TransportCredentials {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	hs := cfg.Clone()
	for _, o := range opts {
		o(hs, log)
	}
	return &creds{TransportCredentials: credentials.NewTLS(hs), cfg: cfg, log: log}
}

func (c *creds) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	own := mtls.OwnCert(c.cfg) // before the handshake: see mtls.NewPeerCheck
	nc, ai, err := c.TransportCredentials.ServerHandshake(raw)
	if err != nil {
		return nil, nil, err
	}
	info, ok := ai.(credentials.TLSInfo)
	if !ok {
		nc.Close()
		return nil, nil, status.Errorf(codes.Internal, "grpcsrv: TLS credentials returned %T", ai)
	}
	return nc, AuthInfo{
		TLSInfo: info,
		Peer:    mtls.NewPeerCheck(c.cfg, info.State, own),
		conn:    &connState{nc: nc, log: c.log, desc: raw.RemoteAddr().String()},
	}, nil
}

func (c *creds) Clone() credentials.TransportCredentials {
	return &creds{TransportCredentials: c.TransportCredentials.Clone(), cfg: c.cfg, log: c.log}
}

// connOf is the state of the connection ctx's call came on, if its
// credentials were Credentials.
func connOf(ctx context.Context) (AuthInfo, bool) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return AuthInfo{}, false
	}
	ai, ok := p.AuthInfo.(AuthInfo)
	return ai, ok && ai.conn != nil
}

// CheckPeer verifies again the peer certificate of the connection ctx's
// call came on (a no-op for a connection not made with Credentials). When
// the peer no longer verifies (its certificate has expired since the
// handshake, or its CA left the bundle) the call is refused with
// Unavailable, as is every later call on the connection, and the
// connection is closed once it has no call in flight (with CallTracker
// installed): grpc-go cannot send one connection GOAWAY, and closing it
// makes the client reconnect, with its current certificate, or fail the
// new handshake, which the server logs with LogHandshakeRefusals.
// An expired peer is logged at INFO (a routine renewal looks so), any
// other failure at WARN.
func CheckPeer(ctx context.Context) error {
	ai, ok := connOf(ctx)
	if !ok {
		return nil
	}
	err := ai.Peer.Verify()
	if err == nil {
		return nil
	}
	c := ai.conn
	expired := ai.Peer.PeerExpired(time.Now())
	c.once.Do(func() {
		if expired {
			c.log.Info("refusing new calls from a peer whose certificate has expired since the handshake; closing its connection (it reconnects with its current certificate)", "peer", c.desc)
		} else {
			c.log.Warn("refusing new calls from a peer whose certificate no longer verifies; closing its connection", "peer", c.desc, "err", err)
		}
		c.refused.Store(true)
		if c.inflight.Load() == 0 {
			// No CallTracker counts this call: close after the linger.
			c.closeSoon()
		}
	})
	if expired {
		return status.Error(codes.Unavailable, "csibroker: the peer's certificate has expired since the connection's handshake; reconnect")
	}
	return status.Errorf(codes.Unavailable, "csibroker: the peer's certificate no longer verifies: %v", err)
}

// UnaryCheckPeer and StreamCheckPeer run CheckPeer before every call.
func UnaryCheckPeer() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		if err := CheckPeer(ctx); err != nil {
			return nil, err
		}
		return h(ctx, req)
	}
}

// StreamCheckPeer: see UnaryCheckPeer.
func StreamCheckPeer() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		if err := CheckPeer(ss.Context()); err != nil {
			return err
		}
		return h(srv, ss)
	}
}

// CallTracker is the stats handler that counts the calls in flight on each
// connection made with Credentials, so that a connection CheckPeer refused
// is closed when its last call ends. It costs two atomic adds per call.
func CallTracker() stats.Handler { return tracker{} }

type tracker struct{}

type trackedKey struct{}

func (tracker) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context {
	ai, ok := connOf(ctx)
	if !ok {
		return ctx
	}
	ai.conn.inflight.Add(1)
	return context.WithValue(ctx, trackedKey{}, ai.conn)
}

func (tracker) HandleRPC(ctx context.Context, s stats.RPCStats) {
	if _, ok := s.(*stats.End); !ok {
		return
	}
	if c, ok := ctx.Value(trackedKey{}).(*connState); ok {
		c.release()
	}
}

func (tracker) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }

func (tracker) HandleConn(context.Context, stats.ConnStats) {}
