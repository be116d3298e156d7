package broker

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc/credentials"

	"github.com/csibroker/csibroker/internal/mtls"
)

// checkedCreds are the TLS credentials of one generation of a proxy's
// connection: they keep what the proxy showed at each handshake, so that
// before each call the broker verifies the proxy's certificate again and
// learns whether its own was reloaded since (proxyConn.acquire). No call,
// and no secret in one, goes to a proxy the broker no longer trusts.
type checkedCreds struct {
	credentials.TransportCredentials
	cfg  *tls.Config
	log  *slog.Logger
	addr string

	mu    sync.Mutex
	conns map[*checkedConn]struct{}
	// failed is the last failure's message ("" once a connection was
	// made): a failure is a warning once per reason, then debug lines.
	failed string
	dialed bool
}

// dial is the generation's dialer: it logs what fails, as the handshake does.
func (c *checkedCreds) dial(ctx context.Context, addr string) (net.Conn, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		c.noteFailure(err)
	}
	return nc, err
}

// noteFailure logs a failed connection: a warning for a new reason, a
// debug line for the same again.
func (c *checkedCreds) noteFailure(err error) {
	c.mu.Lock()
	same := c.failed == err.Error()
	c.failed = err.Error()
	c.mu.Unlock()
	if same {
		c.log.Debug("proxy connection failed again", "error", err.Error())
	} else {
		c.log.Warn("proxy connection failed", "error", err.Error())
	}
}

// noteConnected logs a connection made (the first, and each after a failure).
func (c *checkedCreds) noteConnected() {
	c.mu.Lock()
	say := c.failed != "" || !c.dialed
	c.failed, c.dialed = "", true
	c.mu.Unlock()
	if say {
		c.log.Info("proxy connected")
	}
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
		c.noteFailure(fmt.Errorf("authentication handshake failed: %w", err))
		return conn, info, err
	}
	c.noteConnected()
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

// verdict is what check found of a generation's connections.
type verdict struct {
	// noLonger: a proxy's certificate no longer verifies (expired, or its
	// CA left the bundle).
	noLonger bool
	// renewed: the broker's certificate was reloaded since a handshake;
	// ownExpired: and the one that handshake used has expired.
	renewed, ownExpired bool
}

// check verifies every open connection's proxy again. Cheap while nothing
// changed (PeerCheck checks again only after a reload or an expiry).
func (c *checkedCreds) check() verdict {
	var v verdict
	now := time.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	for cc := range c.conns {
		renewed, err := cc.pc.Check()
		switch {
		case err != nil:
			v.noLonger = true
			if cc.pc.PeerExpired(now) {
				// A proxy's renewed certificate reaches the broker only
				// with a new handshake: routine, and the new handshake
				// says it if the proxy has no valid one.
				c.log.Info("proxy connection: the certificate the proxy showed at the handshake has expired; new calls open a new connection", "proxy", c.addr)
			} else {
				c.log.Warn("proxy connection: the proxy's certificate no longer verifies; new calls open a new connection", "proxy", c.addr, "err", err)
			}
		case renewed:
			v.renewed = true
			v.ownExpired = v.ownExpired || cc.pc.OwnExpired(now)
		}
	}
	return v
}

// Clone returns c itself: a clone gRPC handshakes with must record its
// connections where check finds them (the TLS config is cloned per
// handshake by the credentials underneath).
func (c *checkedCreds) Clone() credentials.TransportCredentials { return c }
