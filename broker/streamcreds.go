package broker

import (
	"context"
	"crypto/tls"
	"log/slog"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials"

	"github.com/csibroker/csibroker/internal/mtls"
)

// checkedCreds are the TLS credentials of a proxy's streaming connection
// (gRPC's client): unary calls verify the proxy's certificate again before
// each call (upstream.admitLocked), and streams do the same through check,
// before each new stream. A connection whose proxy no longer verifies (its
// certificate expired, or its CA left the broker's bundle) is closed, so
// gRPC dials again and the new handshake says what is wrong: no stream, and
// no secret in one, goes to a proxy the broker no longer trusts. Streams in
// flight on such a connection end with it: the check runs only as a new
// stream starts, and a stream outliving its proxy's certificate is rare.
type checkedCreds struct {
	credentials.TransportCredentials
	cfg  *tls.Config
	log  *slog.Logger
	addr string

	mu    sync.Mutex
	conns map[*checkedConn]struct{}
}

func newCheckedCreds(cfg *tls.Config, log *slog.Logger, addr string) *checkedCreds {
	return &checkedCreds{TransportCredentials: credentials.NewTLS(cfg), cfg: cfg, log: log, addr: addr, conns: map[*checkedConn]struct{}{}}
}

// checkedConn is a handshaken connection with what its proxy showed.
type checkedConn struct {
	net.Conn
	pc   *mtls.PeerCheck
	c    *checkedCreds
	once sync.Once
}

func (cc *checkedConn) Close() error {
	cc.once.Do(func() {
		cc.c.mu.Lock()
		delete(cc.c.conns, cc)
		cc.c.mu.Unlock()
	})
	return cc.Conn.Close()
}

func (c *checkedCreds) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	own := mtls.OwnCert(c.cfg) // before the handshake: see NewPeerCheck
	conn, info, err := c.TransportCredentials.ClientHandshake(ctx, authority, raw)
	if err != nil {
		return conn, info, err
	}
	ti, ok := info.(credentials.TLSInfo)
	if !ok {
		return conn, info, nil
	}
	cc := &checkedConn{Conn: conn, pc: mtls.NewPeerCheck(c.cfg, ti.State, own), c: c}
	c.mu.Lock()
	c.conns[cc] = struct{}{}
	c.mu.Unlock()
	return cc, info, nil
}

// check closes every connection whose proxy's certificate no longer
// verifies, and reports whether it closed one. Cheap while nothing changed
// (PeerCheck checks again only after a reload or an expiry).
func (c *checkedCreds) check() bool {
	c.mu.Lock()
	var stale []*checkedConn
	for cc := range c.conns {
		if err := cc.pc.Verify(); err != nil {
			stale = append(stale, cc)
			if cc.pc.PeerExpired(time.Now()) {
				c.log.Info("proxy stream connection: the certificate the proxy showed at the handshake has expired; new streams open a new connection", "proxy", c.addr)
			} else {
				c.log.Warn("proxy stream connection: the proxy's certificate no longer verifies; new streams open a new connection", "proxy", c.addr, "err", err)
			}
		}
	}
	c.mu.Unlock()
	for _, cc := range stale {
		cc.Close()
	}
	return len(stale) > 0
}

// awaitClosed waits (a second at most) until gRPC has seen that the
// connection check closed is gone: a stream started before that would be
// written to the closed connection and fail, where one started after
// waits for the new connection, as a stream does while gRPC connects.
func awaitClosed(ctx context.Context, cc *grpc.ClientConn) {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if cc.GetState() == connectivity.Ready {
		cc.WaitForStateChange(ctx, connectivity.Ready)
	}
}

// Clone returns c itself: a clone gRPC handshakes with must record its
// connections where check finds them (the TLS config is cloned per
// handshake by the credentials underneath).
func (c *checkedCreds) Clone() credentials.TransportCredentials { return c }
