package broker

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	otelcodes "go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/csibroker/csibroker/internal/hoptrace"
	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/rawgrpc"
)

// Every unary call (the front end's, and the controllers' through
// frameConn) reaches the proxy over the broker's own HTTP/2 connection to
// it (upConn) rather than through gRPC's client: the calling goroutine
// writes the request's frames itself and the connection's reader completes
// the answer, so a call costs one hand-off (reader to caller) where gRPC's
// client added its writer goroutine and its own per-call bookkeeping. The
// chain around it (Broker.invokeFrames) keeps the semantics the gRPC
// interceptors had: one span per logical call, metrics and sanitized logs,
// the per-method timeout, retry of Unavailable with jittered exponential
// backoff inside the caller's deadline, and a client span per attempt whose
// trace context goes to the proxy. Streaming calls use gRPC's client
// (proxyConn.conn), which connects on first use.
//
// Flow control: the request is sent within the proxy's windows (waiting
// for WINDOW_UPDATE if it is larger); an answer is bounded by MaxMsgSize and
// its windows are returned as it arrives.

const (
	upDialTimeout  = 10 * time.Second
	upWriteTimeout = 15 * time.Second
	// Keepalive: a connection silent for upKeepaliveTime is pinged, and
	// closed if nothing arrives within upKeepaliveTimeout.
	upKeepaliveTime    = 30 * time.Second
	upKeepaliveTimeout = 10 * time.Second
	upBufSize          = 32 << 10
	upRedialMin        = 100 * time.Millisecond
	upRedialMax        = 2 * time.Second
)

// Why a connection ended, when it was not lost: these are not logged as
// failures.
var (
	errBrokerClosed   = errors.New("the broker closed the connection")
	errDriverChanged  = errors.New("the broker closed the connection (driver removed or reconfigured)")
	errProxyGoingAway = errors.New("the proxy is going away")
	errStreamIDsUsed  = errors.New("the connection's stream IDs are used up")
	errOwnCertRenewed = errors.New("the broker's certificate files were reloaded; new calls go on a new connection")
	errPeerNoLonger   = errors.New("the proxy's certificate no longer verifies; new calls go on a new connection")
)

// errClosedUpstream is a call's error on a connection the broker closed
// because the driver was reconfigured or removed (Unavailable: a retry
// goes to the driver's current proxy, if any).
func errClosedUpstream(addr string) error {
	return status.Errorf(codes.Unavailable, "csibroker: proxy %s: the connection is closed (driver removed or reconfigured)", addr)
}

// upstream holds the current HTTP/2 connection to one proxy and dials a
// new one when it is gone; calls that arrive during a dial wait for it.
type upstream struct {
	b    *Broker
	p    *proxyConn
	tls  *tls.Config
	addr string
	// keepalive period and ping timeout (upKeepalive*; shorter in tests)
	kaTime, kaTimeout time.Duration

	mu      sync.Mutex
	conn    *upConn
	dial    *upDial
	lastErr error // the last dial's error; nil once one succeeded
	closed  bool
	closing chan struct{} // closed with closed: callers waiting on a dial stop waiting
	// old are connections that take no new calls but may still carry
	// calls in flight (drained by a move, or replaced after a certificate
	// change); close fails them too. Failed ones are pruned as others come.
	old map[*upConn]struct{}
	// renewing: a connection with the broker's reloaded certificate is
	// being dialled to replace conn; renewAfter: when to try again after
	// the proxy refused one.
	renewing   bool
	renewAfter time.Time
	stop       context.CancelFunc
	// gone is closed, readable without mu: the chain then asks the broker
	// for the driver's current proxy before the next attempt.
	gone atomic.Bool
}

type upDial struct {
	done chan struct{}
	c    *upConn
	err  error
}

func newUpstream(b *Broker, p *proxyConn, tlsCfg *tls.Config) *upstream {
	cfg := tlsCfg.Clone()
	cfg.NextProtos = []string{"h2"}
	return &upstream{b: b, p: p, tls: cfg, addr: p.cfg.Address, kaTime: upKeepaliveTime, kaTimeout: upKeepaliveTimeout, closing: make(chan struct{})}
}

// keepConnected dials now and again whenever the connection is lost (with
// jittered exponential backoff while dials fail, as gRPC's client does),
// so the connection state tells whether the proxy is reachable and the
// first call finds a connection. Calls dial by themselves as well.
func (u *upstream) keepConnected() {
	ctx, cancel := context.WithCancel(context.Background())
	u.mu.Lock()
	if u.closed || u.stop != nil {
		u.mu.Unlock()
		cancel()
		return
	}
	u.stop = cancel
	u.mu.Unlock()
	go func() {
		// The same backoff as the chain's retries (go-grpc-middleware's).
		backoff := retry.BackoffExponentialWithJitterBounded(upRedialMin, 0.2, upRedialMax)
		var failed uint // dials failed in a row
		for {
			c, err := u.get(ctx)
			if ctx.Err() != nil {
				return
			}
			if err != nil {
				failed++
				t := time.NewTimer(backoff(ctx, failed))
				select {
				case <-ctx.Done():
					t.Stop()
					return
				case <-t.C:
				}
				continue
			}
			failed = 0
			select {
			case <-ctx.Done():
				return
			case <-c.retiring:
			}
		}
	}()
}

// state names the connection's state as gRPC's connectivity states do.
//
// A connection whose proxy's certificate no longer verifies (expired while
// idle, say) is retired here as the next call would retire it (and, the
// broker's own certificate renewed, a renewal dial starts, as for a call),
// so the state does not stay READY for a connection no call will be
// given: reading the state (a scrape, the status API) has these effects.
func (u *upstream) state() string {
	u.mu.Lock()
	defer u.mu.Unlock()
	if c := u.conn; c != nil && !u.closed && c.takesCalls() {
		u.admitLocked(c)
	}
	switch {
	case u.closed:
		return "SHUTDOWN"
	case u.conn != nil && u.conn.takesCalls():
		return "READY"
	case u.dial != nil:
		return "CONNECTING"
	case u.lastErr != nil:
		return "TRANSIENT_FAILURE"
	}
	return "IDLE"
}

// close closes the connection; calls in flight fail with Unavailable.
func (u *upstream) close() {
	if c := u.shut(); c != nil {
		c.abort(errBrokerClosed)
	}
	u.failOld(errBrokerClosed)
}

// keepOldLocked remembers c, which takes no new calls, until it fails (the
// caller holds u.mu).
func (u *upstream) keepOldLocked(c *upConn) {
	if u.old == nil {
		u.old = map[*upConn]struct{}{}
	}
	for x := range u.old {
		if x.ended.Load() {
			delete(u.old, x)
		}
	}
	u.old[c] = struct{}{}
}

// drain takes no new calls and closes the connection once the calls in
// flight have ended (a driver reconfigured or removed: its calls in flight
// finish on the old proxy); failOld ends what is left when the grace
// period is over.
func (u *upstream) drain() {
	u.mu.Lock()
	// Kept in the same hold as the shut, so that a Close running now
	// finds the connection in u.old and ends it.
	c := u.shutLocked()
	if c != nil {
		u.keepOldLocked(c)
	}
	u.mu.Unlock()
	if c != nil {
		c.stopTakingSoon(errDriverChanged)
	}
}

// failOld ends the connections that took no new calls (drained, or
// replaced by one with a renewed certificate) and the calls still on them.
func (u *upstream) failOld(err error) {
	u.mu.Lock()
	old := u.old
	u.old = nil
	u.mu.Unlock()
	for c := range old {
		c.abort(err)
	}
}

// shut marks the upstream closed and returns its connection, if any.
func (u *upstream) shut() *upConn {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.shutLocked()
}

// shutLocked is shut with u.mu held.
func (u *upstream) shutLocked() *upConn {
	if u.stop != nil {
		u.stop()
	}
	if !u.closed {
		close(u.closing)
	}
	u.closed = true
	u.gone.Store(true)
	c := u.conn
	u.conn = nil
	return c
}

// get returns a connection that takes new calls.
func (u *upstream) get(ctx context.Context) (*upConn, error) {
	u.mu.Lock()
	if u.closed {
		u.mu.Unlock()
		return nil, errClosedUpstream(u.addr)
	}
	if c := u.conn; c != nil {
		if c.takesCalls() && u.admitLocked(c) {
			u.mu.Unlock()
			return c, nil
		}
		if u.conn == c {
			// Going away (the proxy's GOAWAY, or its stream IDs used
			// up): its calls in flight finish on it, and Close and a
			// drain's end still reach it.
			u.keepOldLocked(c)
			u.conn = nil
		}
	}
	d := u.dial
	if d == nil {
		d = &upDial{done: make(chan struct{})}
		u.dial = d
		go u.dialOnce(d)
	}
	u.mu.Unlock()
	select {
	case <-d.done:
		return d.c, d.err
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	case <-u.closing:
		return nil, errClosedUpstream(u.addr)
	}
}

func (u *upstream) dialOnce(d *upDial) {
	c, err := u.connect()
	u.mu.Lock()
	u.dial = nil
	prev, closed := u.lastErr, u.closed
	if err == nil && u.closed {
		c.fail(errBrokerClosed)
		c, err = nil, errClosedUpstream(u.addr)
	}
	if err == nil {
		if prev := u.conn; prev != nil {
			// Not to be dropped unseen (its reader and keepalive would run
			// on): it finishes its calls, and Close finds it.
			u.retireLocked(prev, errOwnCertRenewed)
		}
		u.conn = c
	}
	u.lastErr = err
	d.c, d.err = c, err
	u.mu.Unlock()
	log := u.b.log.With("driver", u.p.driver, "node", u.p.cfg.Node, "proxy", u.addr)
	switch {
	case closed:
	case err == nil:
		log.Info("proxy connected")
	case prev == nil || status.Convert(prev).Message() != status.Convert(err).Message():
		// Said once per reason; the redials that fail alike are debug lines.
		log.Warn("proxy connection failed", "error", status.Convert(err).Message())
	default:
		log.Debug("proxy connection failed again", "error", status.Convert(err).Message())
	}
	close(d.done)
}

// connect dials the proxy, checks its identity (u.tls), and exchanges
// SETTINGS. With TLS 1.3 a proxy that refuses the broker's certificate says
// so only after the handshake, so the proxy's SETTINGS are read here: a
// refusal is the dial's error, not the first call's.
func (u *upstream) connect() (*upConn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), upDialTimeout)
	defer cancel()
	var d net.Dialer
	raw, err := d.DialContext(ctx, "tcp", u.addr)
	if err != nil {
		return nil, status.Errorf(codes.Unavailable, "csibroker: proxy %s: connection error: %v", u.addr, err)
	}
	own := mtls.OwnCert(u.tls) // before the handshake: see NewPeerCheck
	tc := tls.Client(raw, u.tls)
	if err := tc.HandshakeContext(ctx); err != nil {
		raw.Close()
		return nil, status.Errorf(codes.Unavailable, "csibroker: proxy %s: connection error: authentication handshake failed: %v", u.addr, err)
	}
	if p := tc.ConnectionState().NegotiatedProtocol; p != "h2" {
		tc.Close()
		return nil, status.Errorf(codes.Unavailable, "csibroker: proxy %s: connection error: the proxy did not agree to HTTP/2 (ALPN %q)", u.addr, p)
	}
	c := newUpConn(u, tc)
	c.peerCheck = mtls.NewPeerCheck(u.tls, tc.ConnectionState(), own)
	tc.SetDeadline(time.Now().Add(upDialTimeout))
	if err := c.start(); err != nil {
		tc.Close()
		return nil, status.Errorf(codes.Unavailable, "csibroker: proxy %s: connection error: %v", u.addr, err)
	}
	f, err := c.rd.ReadFrame()
	if err != nil {
		tc.Close()
		return nil, status.Errorf(codes.Unavailable, "csibroker: proxy %s: connection error: the proxy closed the connection before its settings (a refused certificate is reported here): %v", u.addr, err)
	}
	sf, ok := f.(*http2.SettingsFrame)
	if !ok || sf.IsAck() {
		tc.Close()
		return nil, status.Errorf(codes.Unavailable, "csibroker: proxy %s: connection error: the proxy's first frame is %v, not its SETTINGS", u.addr, f.Header().Type)
	}
	c.mu.Lock()
	c.onSettingsLocked(sf)
	c.flushLocked()
	err = c.err
	c.mu.Unlock()
	if err != nil {
		tc.Close()
		return nil, status.Errorf(codes.Unavailable, "csibroker: proxy %s: connection error: %v", u.addr, err)
	}
	// Reads wait as long as calls do; writes keep the deadline flushLocked
	// keeps ahead of them (clearing it too would leave the next second of
	// writes without one).
	tc.SetReadDeadline(time.Time{})
	c.lastRead.Store(int64(time.Since(c.born)))
	go c.readLoop()
	go c.keepalive()
	return c, nil
}

// upConn is one HTTP/2 connection to a proxy; c.mu guards the state and
// every write.
type upConn struct {
	u    *upstream
	nc   net.Conn
	br   *bufio.Reader
	bw   *bufio.Writer
	fr   *http2.Framer
	rd   *rawgrpc.FrameReader // reads fr, header blocks decoded
	enc  *hpack.Encoder
	hbuf bytes.Buffer

	// lastRead is when the last frame was read, as time since born (a
	// monotonic reading: a step of the wall clock must not fail a live
	// connection's keepalive or put its ping off).
	lastRead atomic.Int64
	born     time.Time

	mu          sync.Mutex
	cond        *sync.Cond // windows opened, a stream slot freed, or the connection failed
	calls       map[uint32]*upCall
	nextID      uint32
	peer        rawgrpc.PeerSettings // the proxy's SETTINGS
	sendWin     int64
	recvPending uint32 // connection window consumed and not returned yet
	needFlush   bool
	goingAway   bool          // no new calls; closed once the last one ends
	drainErr    error         // why goingAway was set
	err         error         // why the connection ended; set once
	retiring    chan struct{} // closed once the connection takes no new calls
	retireOnce  sync.Once     // closes retiring and sets noNew
	// noNew and ended are read without mu by the upstream, under its own
	// lock (and so by state(): Status and the metrics' scrape): mu is held
	// across socket writes, so a proxy that stops reading must not hold up
	// anything but the calls on its own connection.
	noNew    atomic.Bool           // takes no new calls (retiring is closed)
	ended    atomic.Bool           // err is set
	aborted  atomic.Pointer[error] // why abort closed the socket
	deadline time.Time

	// peerCheck verifies the proxy's certificate again before a call is
	// given this connection, and tells when the broker's own was renewed.
	peerCheck *mtls.PeerCheck
}

// admitLocked reports whether c may take a new call as far as
// certificates go (the caller holds u.mu).
//   - The proxy's certificate no longer verifies (expired, its CA left the
//     bundle): c takes no new calls; the call makes a new handshake, which
//     says what is wrong.
//   - The broker's own certificate files were reloaded since c was made:
//     a connection with the new certificate is dialled in the background
//     and replaces c once the proxy has accepted it, so the proxy sees the
//     new certificate before the old one expires, and a proxy that does not
//     accept it yet costs no call. Only once the certificate c was made
//     with has expired (the proxy would refuse the call) does c stop
//     taking calls at once.
func (u *upstream) admitLocked(c *upConn) bool {
	pc := c.peerCheck
	if pc == nil {
		return true
	}
	renewed, err := pc.Check()
	if err != nil {
		if pc.PeerExpired(time.Now()) {
			// A proxy's renewed certificate reaches the broker only with
			// a new handshake: no alarm for what is routine, and the new
			// handshake says it if the proxy has no valid one.
			u.b.log.Info("proxy connection: the certificate the proxy showed at the handshake has expired; new calls open a new connection", "proxy", u.addr)
		} else {
			u.b.log.Warn("proxy connection: the proxy's certificate no longer verifies; new calls open a new connection", "proxy", u.addr, "err", err)
		}
		u.retireLocked(c, errPeerNoLonger)
		return false
	}
	if !renewed {
		return true
	}
	if pc.OwnExpired(time.Now()) {
		u.retireLocked(c, errOwnCertRenewed)
		return false
	}
	u.renewLocked(c)
	return true
}

// retireLocked makes c take no new calls; calls in flight finish on it.
// It does not wait for c.mu (stopTakingSoon).
func (u *upstream) retireLocked(c *upConn, why error) {
	u.keepOldLocked(c)
	c.stopTakingSoon(why)
	if u.conn == c {
		u.conn = nil
	}
}

// upRenewRetry is how long the broker keeps using a connection made with
// its previous certificate after the proxy refused one made with the new.
var upRenewRetry = 10 * time.Second

// renewLocked dials, in the background, a connection with the broker's
// current certificate to replace c (the caller holds u.mu).
func (u *upstream) renewLocked(c *upConn) {
	if u.renewing || u.closed || time.Now().Before(u.renewAfter) {
		return
	}
	u.renewing = true
	go func() {
		nc, err := u.connect()
		u.mu.Lock()
		defer u.mu.Unlock()
		u.renewing = false
		log := u.b.log.With("driver", u.p.driver, "node", u.p.cfg.Node, "proxy", u.addr)
		if err != nil {
			u.renewAfter = time.Now().Add(upRenewRetry)
			log.Warn("the proxy refused a connection with the broker's reloaded certificate; calls stay on the connection made with the previous one until it expires",
				"error", status.Convert(err).Message(), "retry_in", upRenewRetry)
			return
		}
		if u.closed || u.dial != nil || (u.conn != nil && u.conn != c) {
			// Closed, or another connection took c's place meanwhile (or is
			// being dialled to: it will be u.conn).
			nc.fail(errOwnCertRenewed)
			return
		}
		prev := u.conn
		u.conn, u.lastErr = nc, nil
		if prev == c {
			u.retireLocked(c, errOwnCertRenewed)
		}
		log.Info("proxy connection renewed with the broker's reloaded certificate")
	}()
}

// stopTaking makes c take no new calls and close after its last one (at
// once if it has none), for why. Calls waiting for a stream slot give up
// now: retried, they go to a new connection or the driver's current proxy.
func (c *upConn) stopTaking(why error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.stopTakingLocked(why)
}

// stopTakingSoon is stopTaking for callers that must not wait for c.mu
// (held by a write to a proxy that stopped reading): c takes no new call
// from now on, and the rest is done now if c.mu is free, else by a
// goroutine once the write is over (its deadline bounds it).
func (c *upConn) stopTakingSoon(why error) {
	c.retire()
	if c.mu.TryLock() {
		c.stopTakingLocked(why)
		c.mu.Unlock()
	} else {
		go c.stopTaking(why)
	}
}

func (c *upConn) stopTakingLocked(why error) {
	if c.err != nil || c.goingAway {
		return
	}
	c.goingAway, c.drainErr = true, why
	c.retire()
	if len(c.calls) == 0 {
		c.failLocked(why)
	}
	c.cond.Broadcast()
}

// upCall is one call's answer as it arrives.
type upCall struct {
	id          uint32
	deadline    time.Time // the call's deadline, zero if none
	sendWin     int64
	gotHdr      bool
	hdr, trl    []hpack.HeaderField
	data        []byte
	recvPending uint32
	ended       bool
	err         error // the call failed without an answer from the proxy
	done        chan struct{}
}

func newUpConn(u *upstream, nc net.Conn) *upConn {
	c := &upConn{u: u, nc: nc, br: bufio.NewReaderSize(nc, upBufSize), bw: bufio.NewWriterSize(nc, upBufSize),
		calls: map[uint32]*upCall{}, retiring: make(chan struct{}), nextID: 1, peer: rawgrpc.DefaultPeerSettings(100), sendWin: rawgrpc.DefaultWindow, born: time.Now()}
	c.cond = sync.NewCond(&c.mu)
	c.fr = http2.NewFramer(c.bw, c.br)
	// The HTTP/2 default, which the broker announces by announcing none: a
	// larger frame is the proxy's error, not 16 MiB to buffer.
	c.fr.SetMaxReadFrameSize(16 << 10)
	c.rd = rawgrpc.NewFrameReader(c.fr, 4096)
	c.fr.MaxHeaderListSize = rawgrpc.MaxHeaderList
	c.enc = hpack.NewEncoder(&c.hbuf)
	return c
}

func (c *upConn) start() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, err := c.bw.WriteString(http2.ClientPreface); err != nil {
		return err
	}
	if err := c.fr.WriteSettings(
		http2.Setting{ID: http2.SettingEnablePush, Val: 0},
		http2.Setting{ID: http2.SettingInitialWindowSize, Val: rawgrpc.StreamWindow},
		http2.Setting{ID: http2.SettingMaxHeaderListSize, Val: rawgrpc.MaxHeaderList}); err != nil {
		return err
	}
	if err := c.fr.WriteWindowUpdate(0, rawgrpc.ConnWindow-rawgrpc.DefaultWindow); err != nil {
		return err
	}
	return c.bw.Flush()
}

// takesCalls reports whether c takes new calls; it never waits for c.mu.
func (c *upConn) takesCalls() bool { return !c.noNew.Load() }

// writeLocked records a write's error: the connection is then done.
func (c *upConn) writeLocked(err error) {
	c.needFlush = true
	if err != nil {
		c.failLocked(err)
	}
}

func (c *upConn) flushLocked() {
	if !c.needFlush || c.err != nil {
		return
	}
	c.needFlush = false
	c.armWriteDeadlineLocked()
	if err := c.bw.Flush(); err != nil {
		c.failLocked(err)
	}
}

// framer returns the framer for a write, with the write deadline ahead of
// it: a frame larger than the buffer reaches the socket as it is written,
// before any flush.
func (c *upConn) framer() *http2.Framer {
	c.armWriteDeadlineLocked()
	return c.fr
}

// armWriteDeadlineLocked keeps the write deadline upWriteTimeout ahead,
// pushed forward at most once a second (each push is a timer update).
func (c *upConn) armWriteDeadlineLocked() {
	if now := time.Now(); now.Add(upWriteTimeout - time.Second).After(c.deadline) {
		c.deadline = now.Add(upWriteTimeout)
		c.nc.SetWriteDeadline(c.deadline)
	}
}

// failLocked ends the connection: every call in flight fails with
// Unavailable (the retry policy's code for a lost connection).
func (c *upConn) failLocked(err error) {
	if c.err != nil {
		return
	}
	if why := c.aborted.Load(); why != nil {
		err = *why
	}
	c.err = err
	c.ended.Store(true)
	c.retire()
	c.nc.Close()
	log := c.u.b.log.With("driver", c.u.p.driver, "node", c.u.p.cfg.Node, "proxy", c.u.addr)
	switch {
	case errors.Is(err, errBrokerClosed):
	case errors.Is(err, errDriverChanged):
		log.Info("proxy connection closed: the driver was reconfigured or removed", "calls_in_flight", len(c.calls))
	case errors.Is(err, errProxyGoingAway):
		log.Info("proxy connection drained after GOAWAY")
	case errors.Is(err, errStreamIDsUsed):
		log.Info("proxy connection drained: its stream IDs are used up; calls go to a new connection")
	case errors.Is(err, errOwnCertRenewed), errors.Is(err, errPeerNoLonger):
		log.Info("proxy connection drained", "why", err.Error())
	default:
		log.Warn("proxy connection lost", "error", describeUpErr(err), "calls_in_flight", len(c.calls))
	}
	for _, call := range c.calls {
		c.endLocked(call, status.Errorf(codes.Unavailable, "csibroker: proxy %s: connection lost: %v", c.u.addr, describeUpErr(err)))
	}
	c.cond.Broadcast()
}

// retire tells keepConnected that the connection takes no new calls (it
// failed, the proxy is going away, or its stream IDs run out), so a new
// one is dialled while the calls on this one finish. With or without c.mu.
func (c *upConn) retire() {
	c.retireOnce.Do(func() {
		c.noNew.Store(true)
		close(c.retiring)
	})
}

func (c *upConn) fail(err error) {
	c.mu.Lock()
	c.failLocked(err)
	c.mu.Unlock()
}

// abort is fail for a connection a write may be stuck on (its proxy stopped
// reading): the socket is closed first, which ends that write and frees
// c.mu, and the connection fails with why, not with the write's error.
func (c *upConn) abort(why error) {
	c.aborted.Store(&why)
	c.nc.Close()
	c.fail(why)
}

func describeUpErr(err error) string {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return "the proxy closed the connection"
	}
	return err.Error()
}

// endLocked completes a call (err nil: its answer is whole).
func (c *upConn) endLocked(call *upCall, err error) {
	if call.ended {
		return
	}
	call.ended, call.err = true, err
	hoptrace.Mark(hoptrace.AnswerEnded)
	delete(c.calls, call.id)
	close(call.done)
	c.cond.Broadcast()
	if c.goingAway && len(c.calls) == 0 && c.err == nil {
		c.flushLocked()
		c.failLocked(c.drainErr)
	}
}

// roundTrip sends one request (a whole gRPC message, prefix included) and
// waits for the whole answer.
func (c *upConn) roundTrip(ctx context.Context, fields []hpack.HeaderField, msg []byte) (*upCall, error) {
	call := &upCall{done: make(chan struct{})}
	call.deadline, _ = ctx.Deadline()
	// A wait on c.cond (a stream slot, a window) must end with ctx too;
	// registered only when a call has to wait.
	var stop func() bool
	defer func() {
		if stop != nil {
			stop()
		}
	}()
	wait := func() {
		if stop == nil {
			stop = context.AfterFunc(ctx, func() {
				c.mu.Lock()
				c.cond.Broadcast()
				c.mu.Unlock()
			})
		}
		c.cond.Wait()
	}
	c.mu.Lock()
	for c.err == nil && !c.goingAway && uint32(len(c.calls)) >= c.peer.MaxStreams && ctx.Err() == nil {
		wait()
	}
	if dl, ok := ctx.Deadline(); ok && ctx.Err() == nil {
		// What is left now, as gRPC computes it when it writes the
		// headers: the driver's deadline is not later than the caller's.
		left := time.Until(dl)
		if left <= 0 {
			c.mu.Unlock()
			return nil, status.Error(codes.DeadlineExceeded, context.DeadlineExceeded.Error())
		}
		fields = append(fields, hpack.HeaderField{Name: "grpc-timeout", Value: rawgrpc.EncodeTimeout(left)})
	}
	switch {
	case ctx.Err() != nil:
		c.mu.Unlock()
		return nil, status.FromContextError(ctx.Err()).Err()
	case c.err != nil || c.goingAway:
		// Nothing was sent: another connection may take the call.
		c.mu.Unlock()
		return nil, status.Errorf(codes.Unavailable, "csibroker: proxy %s: the connection closed before the call was sent", c.u.addr)
	case !c.peer.HeaderListFits(fields):
		// The proxy would refuse it: said here, with the sizes.
		c.mu.Unlock()
		return nil, status.Errorf(codes.Internal, "csibroker: the call's metadata is %d bytes, over the %d bytes proxy %s accepts (its SETTINGS_MAX_HEADER_LIST_SIZE)",
			rawgrpc.HeaderListSize(fields), c.peer.MaxHeaderList, c.u.addr)
	}
	call.id = c.nextID
	c.nextID += 2
	if c.nextID >= rawgrpc.LastStreamID-rawgrpc.StreamIDMargin {
		// This is the connection's last call: closed once it ends.
		c.goingAway, c.drainErr = true, errStreamIDsUsed
		c.retire()
	}
	call.sendWin = c.peer.InitialWindow
	c.calls[call.id] = call
	c.writeLocked(rawgrpc.WriteHeaderBlock(c.framer(), c.enc, &c.hbuf, call.id, fields, false, c.peer.MaxFrame))
	for rest := msg; c.err == nil && !call.ended && ctx.Err() == nil; {
		n := min(int64(len(rest)), c.sendWin, call.sendWin, int64(c.peer.MaxFrame))
		if n <= 0 && len(rest) > 0 {
			c.flushLocked()
			wait()
			continue
		}
		last := int(n) == len(rest)
		c.writeLocked(c.framer().WriteData(call.id, last, rest[:n]))
		c.sendWin -= n
		call.sendWin -= n
		rest = rest[n:]
		if last {
			break
		}
	}
	if len(c.calls) > 1 && c.needFlush {
		// Other calls are in flight on this connection: let those ready to
		// send write their requests before the flush, so that under load
		// several requests share one socket write (and one TLS record). A
		// lone call flushes at once.
		c.mu.Unlock()
		runtime.Gosched()
		c.mu.Lock()
	}
	hoptrace.Mark(hoptrace.RequestQueued)
	c.flushLocked()
	hoptrace.Mark(hoptrace.RequestWritten)
	c.mu.Unlock()
	select {
	case <-call.done:
		hoptrace.Mark(hoptrace.WorkerResumes)
		return call, nil
	case <-ctx.Done():
	}
	c.mu.Lock()
	if !call.ended {
		c.writeLocked(c.framer().WriteRSTStream(call.id, http2.ErrCodeCancel))
		c.flushLocked()
		c.endLocked(call, status.FromContextError(ctx.Err()).Err())
	}
	c.mu.Unlock()
	return call, nil
}

func (c *upConn) readLoop() {
	for {
		f, err := c.rd.ReadFrame()
		if err != nil {
			var se http2.StreamError
			if errors.As(err, &se) {
				c.mu.Lock()
				if call := c.calls[se.StreamID]; call != nil {
					c.writeLocked(c.framer().WriteRSTStream(se.StreamID, se.Code))
					c.endLocked(call, status.Errorf(codes.Internal, "csibroker: proxy %s: malformed answer: %v", c.u.addr, se))
				}
				c.flushLocked()
				c.mu.Unlock()
				continue
			}
			c.mu.Lock()
			var ce http2.ConnectionError
			code, goAway := http2.ErrCodeFrameSize, errors.Is(err, http2.ErrFrameTooLarge)
			if errors.As(err, &ce) {
				code, goAway = http2.ErrCode(ce), true
			}
			if goAway && c.err == nil {
				c.writeLocked(c.framer().WriteGoAway(0, code, nil))
				c.flushLocked()
			}
			c.failLocked(err)
			c.mu.Unlock()
			return
		}
		c.lastRead.Store(int64(time.Since(c.born)))
		c.mu.Lock()
		switch f := f.(type) {
		case *http2.MetaHeadersFrame:
			c.onHeadersLocked(f)
		case *http2.DataFrame:
			c.onDataLocked(f)
		case *http2.RSTStreamFrame:
			if call := c.calls[f.StreamID]; call != nil {
				code := rawgrpc.RSTCode(f.ErrCode)
				if code == codes.Canceled && !call.deadline.IsZero() && !call.deadline.After(time.Now()) {
					// The call's deadline passed: the next hop cancelled
					// because of it (as gRPC's client reports it).
					code = codes.DeadlineExceeded
				}
				c.endLocked(call, status.Errorf(code, "csibroker: proxy %s reset the call: %v", c.u.addr, f.ErrCode))
			}
		case *http2.SettingsFrame:
			c.onSettingsLocked(f)
		case *http2.WindowUpdateFrame:
			c.onWindowUpdateLocked(f)
		case *http2.PingFrame:
			if !f.IsAck() {
				c.writeLocked(c.framer().WritePing(true, f.Data))
			}
		case *http2.GoAwayFrame:
			c.onGoAwayLocked(f)
		case *http2.PushPromiseFrame:
			// Push is off (SETTINGS_ENABLE_PUSH 0): a protocol error
			// (RFC 9113, 8.4), and its header block would go undecoded.
			c.writeLocked(c.framer().WriteGoAway(0, http2.ErrCodeProtocol, nil))
			c.flushLocked()
			c.failLocked(fmt.Errorf("proxy %s sent PUSH_PROMISE, which the broker does not accept", c.u.addr))
		}
		if c.br.Buffered() == 0 {
			c.flushLocked()
		}
		done := c.err != nil
		c.mu.Unlock()
		if done {
			return
		}
	}
}

func (c *upConn) onHeadersLocked(f *http2.MetaHeadersFrame) {
	call := c.calls[f.StreamID]
	if call == nil {
		return
	}
	if f.StreamEnded() {
		// Trailers, or a trailers-only answer.
		call.trl = f.Fields
		c.endLocked(call, nil)
		return
	}
	if call.gotHdr {
		c.writeLocked(c.framer().WriteRSTStream(call.id, http2.ErrCodeProtocol))
		c.endLocked(call, status.Errorf(codes.Internal, "csibroker: proxy %s: a second header block before the trailers", c.u.addr))
		return
	}
	call.gotHdr, call.hdr = true, f.Fields
}

func (c *upConn) onDataLocked(f *http2.DataFrame) {
	n := f.Header().Length // padding included: flow control counts it
	c.recvPending += n
	if c.recvPending >= rawgrpc.ConnWindow/4 {
		c.writeLocked(c.framer().WriteWindowUpdate(0, c.recvPending))
		c.recvPending = 0
	}
	call := c.calls[f.StreamID]
	if call == nil {
		return
	}
	if limit := c.u.b.opts.MaxMsgSize; len(call.data)+len(f.Data()) > limit+5 {
		c.writeLocked(c.framer().WriteRSTStream(call.id, http2.ErrCodeCancel))
		c.endLocked(call, status.Errorf(codes.ResourceExhausted, "csibroker: received message larger than max (%d bytes)", limit))
		return
	}
	call.data = append(call.data, f.Data()...)
	if f.StreamEnded() {
		c.endLocked(call, nil)
		return
	}
	call.recvPending += n
	if call.recvPending >= rawgrpc.StreamWindow/2 {
		c.writeLocked(c.framer().WriteWindowUpdate(call.id, call.recvPending))
		call.recvPending = 0
	}
}

func (c *upConn) onSettingsLocked(f *http2.SettingsFrame) {
	if f.IsAck() {
		return
	}
	var maxWin int64
	for _, call := range c.calls {
		maxWin = max(maxWin, call.sendWin)
	}
	delta, code, err := c.peer.Apply(f, c.enc, maxWin)
	if err != nil {
		c.writeLocked(c.framer().WriteGoAway(0, code, nil))
		c.flushLocked()
		c.failLocked(fmt.Errorf("invalid SETTINGS from the proxy: %v", err))
		return
	}
	for _, call := range c.calls {
		call.sendWin += delta
	}
	c.writeLocked(c.framer().WriteSettingsAck())
	c.cond.Broadcast()
}

func (c *upConn) onWindowUpdateLocked(f *http2.WindowUpdateFrame) {
	if f.StreamID == 0 {
		if !rawgrpc.GrowWindow(&c.sendWin, f.Increment) {
			c.writeLocked(c.framer().WriteGoAway(0, http2.ErrCodeFlowControl, nil))
			c.flushLocked()
			c.failLocked(errors.New("the proxy overflowed the connection window"))
			return
		}
	} else if call := c.calls[f.StreamID]; call == nil {
		return // a call that ended: nothing waits on its window
	} else if !rawgrpc.GrowWindow(&call.sendWin, f.Increment) {
		c.writeLocked(c.framer().WriteRSTStream(f.StreamID, http2.ErrCodeFlowControl))
		c.flushLocked()
		c.endLocked(call, status.Errorf(codes.Internal, "csibroker: proxy %s overflowed the call's window", c.u.addr))
	}
	c.cond.Broadcast()
}

func (c *upConn) onGoAwayLocked(f *http2.GoAwayFrame) {
	c.goingAway, c.drainErr = true, errProxyGoingAway
	c.retire()
	for id, call := range c.calls {
		if id > f.LastStreamID {
			// Never processed: safe to retry on another connection.
			c.endLocked(call, status.Errorf(codes.Unavailable, "csibroker: proxy %s is going away; the call was not processed", c.u.addr))
		}
	}
	if len(c.calls) == 0 {
		c.failLocked(errProxyGoingAway)
	}
	c.cond.Broadcast()
}

// keepalive pings a connection that has been silent for upKeepaliveTime
// and closes it if nothing arrives within upKeepaliveTimeout, so a proxy
// that vanished without closing its connection is noticed.
func (c *upConn) keepalive() {
	every, wait := c.u.kaTime, c.u.kaTimeout
	// Woken when the connection has been silent for every (not on a fixed
	// tick, which a frame read just after it would put off by almost two
	// periods), as gRPC's client keepalive does.
	t := time.NewTimer(every)
	defer t.Stop()
	for range t.C {
		c.mu.Lock()
		if c.err != nil {
			c.mu.Unlock()
			return
		}
		if idle := time.Since(c.born) - time.Duration(c.lastRead.Load()); idle < every {
			c.mu.Unlock()
			t.Reset(every - idle)
			continue
		}
		sent := int64(time.Since(c.born))
		c.writeLocked(c.framer().WritePing(false, [8]byte{'c', 's', 'i', 'b', 'k'}))
		c.flushLocked()
		c.mu.Unlock()
		time.Sleep(wait)
		if c.lastRead.Load() < sent {
			c.fail(fmt.Errorf("no answer to a keepalive ping within %v", wait))
			return
		}
		t.Reset(every)
	}
}

// attempt is one try of a unary call: a client span (named and described
// as otelgrpc names its own), the request, and the answer decoded into a
// message, metadata and status.
func (u *upstream) attempt(ctx context.Context, d *callDesc, method string, md metadata.MD, req []byte) (resp []byte, hdr, trl metadata.MD, err error) {
	b := u.b
	hoptrace.Mark(hoptrace.AttemptStarts)
	ctx, span := b.tracer.Start(ctx, d.clientName, d.clientOpts...)
	defer func() {
		s := status.Convert(err)
		span.SetAttributes(semconv.RPCResponseStatusCode(s.Code().String()))
		if err != nil {
			// The code only: a driver's message may quote its request.
			span.SetStatus(otelcodes.Error, s.Code().String())
		}
		span.End()
	}()

	fields := make([]hpack.HeaderField, 0, 12+len(md))
	fields = append(fields,
		hpack.HeaderField{Name: ":method", Value: "POST"},
		hpack.HeaderField{Name: ":scheme", Value: "https"},
		hpack.HeaderField{Name: ":path", Value: method},
		hpack.HeaderField{Name: ":authority", Value: u.addr},
		hpack.HeaderField{Name: "content-type", Value: "application/grpc"},
		hpack.HeaderField{Name: "te", Value: "trailers"},
		hpack.HeaderField{Name: "user-agent", Value: "csibroker"})
	// grpc-timeout is added as the headers are written (roundTrip): a
	// dial or a wait for a stream slot before then uses up time.
	b.opts.Propagator.Inject(ctx, rawgrpc.FieldsCarrier{Fields: &fields})
	fields = appendMD(fields, md)

	c, err := u.get(ctx)
	if err != nil {
		return nil, nil, nil, err
	}
	call, err := c.roundTrip(ctx, fields, req)
	if err != nil {
		return nil, nil, nil, err
	}
	return call.result(u.addr)
}

// result decodes a finished call as gRPC's client would; the answer is
// the whole message, its prefix included.
func (call *upCall) result(addr string) (resp []byte, hdr, trl metadata.MD, err error) {
	hdr = fieldsMD(call.hdr)
	if call.err != nil {
		return nil, hdr, nil, call.err
	}
	head := call.hdr
	if !call.gotHdr {
		head = call.trl // a trailers-only answer
	}
	if v := rawgrpc.HeaderValue(head, ":status"); v != "200" {
		n, _ := strconv.Atoi(v)
		return nil, hdr, nil, status.Errorf(rawgrpc.HTTPStatusCode(n), "csibroker: proxy %s answered HTTP status %q, not a gRPC answer", addr, v)
	}
	if call.gotHdr {
		// As gRPC's client: a binary field that is not base64 fails the
		// call (it is not dropped).
		if err := binFieldsOK(call.hdr, addr); err != nil {
			return nil, hdr, nil, err
		}
	}
	if call.trl == nil {
		return nil, hdr, nil, status.Errorf(codes.Internal, "csibroker: proxy %s ended the call without trailers", addr)
	}
	trl = fieldsMD(call.trl)
	if err := trailerStatus(call.trl, addr); err != nil {
		return nil, hdr, trl, err
	}
	d := call.data
	switch {
	case len(d) < 5:
		return nil, hdr, trl, status.Errorf(codes.Internal, "csibroker: proxy %s: the answer holds no message", addr)
	case d[0] != 0:
		return nil, hdr, trl, status.Errorf(codes.Internal, "csibroker: proxy %s: compressed answers are not supported", addr)
	case int(binary.BigEndian.Uint32(d[1:5])) != len(d)-5:
		return nil, hdr, trl, status.Errorf(codes.Internal, "csibroker: proxy %s: a unary answer must hold exactly one message", addr)
	}
	return d, hdr, trl, nil
}

// trailerStatus is the call's status from its trailers (nil when OK), read
// as gRPC's own client reads it, so a caller sees through the broker what
// it would see calling the driver: no grpc-status is Unknown, a malformed
// one Unknown saying so, a binary field that is not base64 and details
// whose code is not grpc-status's Internal saying so; details that are no
// google.rpc.Status, or come more than once, are left out.
func trailerStatus(fields []hpack.HeaderField, addr string) error {
	if err := binFieldsOK(fields, addr); err != nil {
		return err
	}
	code := codes.Unknown
	if v, ok := rawgrpc.LookupHeader(fields, "grpc-status"); ok {
		n, err := strconv.ParseInt(v, 10, 32)
		if err != nil {
			return status.Errorf(codes.Unknown, "csibroker: proxy %s: malformed grpc-status %q", addr, v)
		}
		code = codes.Code(uint32(n))
	}
	msg := rawgrpc.DecodeStatusMessage(rawgrpc.HeaderValue(fields, "grpc-message"))
	var details []string
	for _, hf := range fields {
		if hf.Name == "grpc-status-details-bin" {
			details = append(details, hf.Value)
		}
	}
	if len(details) == 1 {
		if vs, err := rawgrpc.DecodeBinaryHeader(details[0]); err == nil && len(vs) == 1 {
			p := &spb.Status{}
			if proto.Unmarshal([]byte(vs[0]), p) == nil {
				if codes.Code(p.Code) != code {
					return status.Errorf(codes.Internal, "csibroker: proxy %s: grpc-status-details-bin has code %v, grpc-status %v (grpc-message %q)", addr, codes.Code(p.Code), code, msg)
				}
				if code == codes.OK {
					return nil
				}
				return &callError{st: status.FromProto(p), answered: true}
			}
		}
	}
	if code == codes.OK {
		return nil
	}
	return &callError{st: status.New(code, msg), answered: true}
}

// binFieldsOK is an Internal error naming the first "-bin" field of a
// header block that is not base64, or nil.
func binFieldsOK(fields []hpack.HeaderField, addr string) error {
	for _, hf := range fields {
		if strings.HasSuffix(hf.Name, "-bin") {
			if _, err := rawgrpc.DecodeBinaryHeader(hf.Value); err != nil {
				return status.Errorf(codes.Internal, "csibroker: proxy %s: malformed %s: %v", addr, hf.Name, err)
			}
		}
	}
	return nil
}

// fieldsMD is the metadata of a header block: what gRPC and tracing set
// per hop is left out, "-bin" values are decoded.
func fieldsMD(fields []hpack.HeaderField) metadata.MD {
	var md metadata.MD
	for _, hf := range fields {
		if rawgrpc.Reserved(hf.Name) {
			continue
		}
		vals := []string{hf.Value}
		if strings.HasSuffix(hf.Name, "-bin") {
			vs, err := rawgrpc.DecodeBinaryHeader(hf.Value)
			if err != nil {
				continue
			}
			vals = vs
		}
		if md == nil {
			md = metadata.MD{}
		}
		md[hf.Name] = append(md[hf.Name], vals...)
	}
	return md
}
