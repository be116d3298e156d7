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
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/csibroker/csibroker/internal/hoptrace"
	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/rawgrpc"
)

// The front end speaks HTTP/2 itself instead of running a gRPC server: a
// connection's reader goroutine reads frames, a unary call is handed to a
// goroutine of its own once its request is whole, and that goroutine calls
// the driver's client chain (timeout, retry, tracing, metrics, sanitized
// logging) and writes the answer straight to the socket. A gRPC server
// would add a hand-off to a stream worker, one to its writer goroutine per
// frame group, and its own per-call bookkeeping; on this hop that was about
// as much work as a whole call to a driver. Streaming methods (and methods
// of services this binary does not know) are copied message by message
// through a client stream of the chain.
//
// Flow control: the connection window is credited as DATA arrives. A unary
// request is kept whole (at most MaxMsgSize), so its stream window is
// credited as it arrives too; a streaming request's bytes are credited once
// they were sent on, so what is held for it is at most one stream window,
// except for a message larger than the stream window, which is credited as
// it arrives (or it could never arrive whole) once the connection's budget
// has room for all of it (feConn.held). Answers respect the caller's
// windows.

const (
	feStreamWindow = rawgrpc.StreamWindow
	feConnWindow   = rawgrpc.ConnWindow
	// feMaxStreams caps the concurrent calls of one caller connection; the
	// caller's gRPC queues calls beyond it.
	feMaxStreams = 1024
	// feWriteTimeout: a caller that takes no bytes for this long loses its
	// connection, so it cannot hold the connection's lock for ever.
	feWriteTimeout = 15 * time.Second
	// feHandshakeTimeout bounds the TLS handshake and the client preface.
	feHandshakeTimeout = 10 * time.Second
	feBufSize          = 32 << 10
)

// feServer serves one front end (a driver's socket, or the shared TCP
// listener) until its context ends.
type feServer struct {
	fe  *frontEnd
	tls *tls.Config // nil: plain (unix socket)

	mu       sync.Mutex
	conns    map[*feConn]struct{}
	stopping bool
	wg       sync.WaitGroup
	workers  workerPool
}

// workerPool runs calls on goroutines that outlive them: a call's goroutine
// grows its stack deep into the chain and gRPC's client, and a fresh
// goroutine per call paid for that growth on every call (a tenth of the
// front end's CPU in a profile). A call goes to an idle worker if one
// waits, else to a new one; a worker idle for workerIdle ends.
type workerPool struct{ ch chan func() }

const workerIdle = 30 * time.Second

func (p *workerPool) run(f func()) {
	select {
	case p.ch <- f:
	default:
		go p.work(f)
	}
}

func (p *workerPool) work(f func()) {
	f()
	idle := time.NewTimer(workerIdle)
	defer idle.Stop()
	for {
		select {
		case f = <-p.ch:
			f()
			idle.Reset(workerIdle)
		case <-idle.C:
			return
		}
	}
}

func newFEServer(fe *frontEnd, tlsCfg *tls.Config) *feServer {
	if tlsCfg != nil {
		tlsCfg = tlsCfg.Clone()
		if !slices.Contains(tlsCfg.NextProtos, "h2") {
			tlsCfg.NextProtos = append(tlsCfg.NextProtos, "h2")
		}
	}
	return &feServer{fe: fe, tls: tlsCfg, conns: map[*feConn]struct{}{}, workers: workerPool{ch: make(chan func())}}
}

// serve accepts callers on lis until ctx is done, then lets the calls in
// flight finish (at most 10 s) and returns.
func (s *feServer) serve(ctx context.Context, lis net.Listener) error {
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		select {
		case <-ctx.Done():
			lis.Close()
		case <-stop:
		}
	}()
	var delay time.Duration
	for {
		nc, err := lis.Accept()
		if err != nil {
			if ctx.Err() != nil {
				s.shutdown()
				return nil
			}
			if errors.Is(err, net.ErrClosed) {
				s.shutdown()
				return err
			}
			// Out of file descriptors and the like: wait and go on, as
			// net/http and gRPC servers do.
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			s.fe.b.log.Warn("CSI front end: accept failed; retrying", "err", err, "delay", delay)
			time.Sleep(delay)
			continue
		}
		delay = 0
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.serveConn(nc)
		}()
	}
}

// shutdown sends every connection GOAWAY, waits for their calls, and
// closes what is left after 10 s.
func (s *feServer) shutdown() {
	s.mu.Lock()
	s.stopping = true
	conns := make([]*feConn, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	s.mu.Unlock()
	// Each on its own: a caller that does not read can hold its
	// connection's GOAWAY (and lock) for the write timeout.
	for _, c := range conns {
		go c.goAway()
	}
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	select {
	case <-done:
		return
	case <-time.After(10 * time.Second):
	}
	s.mu.Lock()
	for c := range s.conns {
		c.nc.Close() // first, without the lock: ends a write stuck on such a caller
		c.mu.Lock()
		c.closeLocked(errors.New("front end stopped"))
		c.mu.Unlock()
	}
	s.mu.Unlock()
	<-done
}

func (s *feServer) serveConn(nc net.Conn) {
	var own *tls.Certificate
	if s.tls != nil {
		own = mtls.OwnCert(s.tls) // before the handshake: see mtls.NewPeerCheck
		tc := tls.Server(nc, s.tls)
		ctx, cancel := context.WithTimeout(context.Background(), feHandshakeTimeout)
		err := tc.HandshakeContext(ctx)
		cancel()
		if err != nil {
			s.fe.b.log.Info("CSI front end: TLS handshake failed", "remote", nc.RemoteAddr().String(), "err", err)
			nc.Close()
			return
		}
		nc = tc
	}
	c := newFEConn(s, nc)
	if tc, ok := nc.(*tls.Conn); ok {
		cs := tc.ConnectionState()
		if certs := cs.PeerCertificates; len(certs) > 0 {
			c.caller, _ = mtls.PeerID(certs[0])
			// Checked again before each call (a config that asks for no
			// client certificate has nothing to check).
			c.peerCheck = mtls.NewPeerCheck(s.tls, cs, own)
		}
	}
	s.mu.Lock()
	if s.stopping {
		s.mu.Unlock()
		nc.Close()
		return
	}
	s.conns[c] = struct{}{}
	s.mu.Unlock()
	c.run()
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
}

// feConn is one caller's HTTP/2 connection. The reader goroutine reads
// frames without the lock; every write holds mu.
type feConn struct {
	s      *feServer
	nc     net.Conn
	caller string // the TCP front end's caller: its certificate's SPIFFE ID
	// peerCheck verifies the TCP caller's certificate again before each
	// new call (nil on unix sockets).
	peerCheck *mtls.PeerCheck
	br        *bufio.Reader
	fr        *http2.Framer
	rd        *rawgrpc.FrameReader // reads fr, header blocks decoded

	mu        sync.Mutex
	bw        *bufio.Writer
	enc       *hpack.Encoder
	hbuf      bytes.Buffer
	streams   map[uint32]*feStream
	sendWin   int64                // what the caller lets us send on the connection
	recvWin   int64                // what we let the caller send on the connection
	unacked   uint32               // connection bytes read, not yet credited back
	peer      rawgrpc.PeerSettings // the caller's SETTINGS
	lastID    uint32
	goingAway bool
	started   bool // our SETTINGS are sent: the first frame, before any GOAWAY
	closed    bool
	shut      bool // drained: writes shut, the reader closes it (drainedLocked)
	needFlush bool
	wdlSet    time.Time
	// held counts the bytes of the unary requests of the calls in flight
	// (arriving, or whole and being served) and the streaming request
	// messages credited as they arrive (each counted whole from then until
	// it was sent on), at most maxHeld; hdrHeld the bytes of their header
	// lists, at most maxHdrHeld.
	held, hdrHeld int
	// waiting holds, in the order they came, the streams whose request
	// message at the head of their input is larger than the stream window
	// and waits for room in held to be credited as it arrives (aheadLocked);
	// until then the stream window holds its caller back.
	waiting []*feStream
	// warned: a budget refusal was logged for this connection (once).
	warned bool
}

// feStream is one call. Fields other than in are guarded by c.mu.
type feStream struct {
	id     uint32
	method string
	fields []hpack.HeaderField
	unary  bool
	req    []byte // a unary call's request, as it arrives
	tooBig bool   // the unary request passed MaxMsgSize; its bytes are dropped
	// expiry ends a unary call whose request is not whole at its
	// deadline (nil: no grpc-timeout).
	expiry *time.Timer
	// cond wakes the call's writer waiting for window (made when it first
	// waits; on c.mu): its window or the connection's grew, or it ended.
	// Per call, so that a window update wakes only what it can unblock.
	cond        *sync.Cond
	in          *feInput
	ctx         context.Context
	cancel      context.CancelFunc
	sendWin     int64
	recvWin     int64
	unacked     uint32
	remoteEnded bool
	localEnded  bool
	reset       bool
	contentType string
	// held: bytes of the request counted in feConn.held. A unary call's
	// are what arrived of its request; a streaming call's the sizes of
	// the messages its input credits as they arrive (feInput.ahead), and
	// of those taken from it and being sent on (given back by release).
	held    int
	hdrHeld int  // bytes of its header list counted in feConn.hdrHeld
	waiting bool // in feConn.waiting
	// arrived is when the call's HEADERS were read: its grpc-timeout
	// counts from then, as the caller's deadline does, not from when a
	// slowly sent request was whole.
	arrived time.Time
}

func newFEConn(s *feServer, nc net.Conn) *feConn {
	c := &feConn{s: s, nc: nc,
		br:      bufio.NewReaderSize(nc, feBufSize),
		bw:      bufio.NewWriterSize(nc, feBufSize),
		streams: map[uint32]*feStream{},
		sendWin: rawgrpc.DefaultWindow, recvWin: feConnWindow, peer: rawgrpc.DefaultPeerSettings(0),
	}
	c.fr = http2.NewFramer(c.bw, c.br)
	c.fr.SetMaxReadFrameSize(16 << 10)
	c.fr.MaxHeaderListSize = rawgrpc.MaxHeaderList
	c.rd = rawgrpc.NewFrameReader(c.fr, 4096)
	c.enc = hpack.NewEncoder(&c.hbuf)
	return c
}

func (c *feConn) run() {
	c.nc.SetReadDeadline(time.Now().Add(feHandshakeTimeout))
	preface := make([]byte, len(http2.ClientPreface))
	if _, err := io.ReadFull(c.br, preface); err != nil || string(preface) != http2.ClientPreface {
		c.nc.Close()
		return
	}
	c.nc.SetReadDeadline(time.Time{})
	c.mu.Lock()
	c.armWriteDeadline()
	c.writeErr(c.fr.WriteSettings(
		http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: feMaxStreams},
		http2.Setting{ID: http2.SettingInitialWindowSize, Val: feStreamWindow},
		http2.Setting{ID: http2.SettingMaxHeaderListSize, Val: rawgrpc.MaxHeaderList}))
	c.writeErr(c.fr.WriteWindowUpdate(0, feConnWindow-rawgrpc.DefaultWindow))
	c.writeErr(c.bw.Flush())
	c.started = true
	if c.goingAway {
		// Shut down before the preface: the GOAWAY follows the SETTINGS,
		// which must be the server's first frame (RFC 9113, 3.4).
		c.goAwayLocked(0, 0, errors.New("shutting down"))
	}
	c.mu.Unlock()

	err := c.readLoop()
	c.mu.Lock()
	c.closeLocked(err)
	c.mu.Unlock()
}

func (c *feConn) readLoop() error {
	for {
		fr, err := c.rd.ReadFrame()
		if err != nil {
			var se http2.StreamError
			if errors.As(err, &se) {
				c.mu.Lock()
				c.writeErr(c.fr.WriteRSTStream(se.StreamID, se.Code))
				c.needFlush = true
				c.resetLocked(c.streams[se.StreamID])
				if c.br.Buffered() == 0 {
					c.flushLocked() // nothing more to read now: the reset goes out
				}
				c.mu.Unlock()
				continue
			}
			var ce http2.ConnectionError
			switch {
			case errors.As(err, &ce):
				c.mu.Lock()
				c.connErrorLocked(http2.ErrCode(ce), err.Error())
				c.mu.Unlock()
			case errors.Is(err, http2.ErrFrameTooLarge):
				// Over the SETTINGS_MAX_FRAME_SIZE we announced.
				c.mu.Lock()
				c.connErrorLocked(http2.ErrCodeFrameSize, err.Error())
				c.mu.Unlock()
			}
			return err
		}
		c.mu.Lock()
		if c.shut {
			// Drained: what the caller still sends is read and dropped
			// until it closes.
			c.mu.Unlock()
			continue
		}
		switch fr := fr.(type) {
		case *http2.MetaHeadersFrame:
			c.onHeadersLocked(fr)
		case *http2.DataFrame:
			c.onDataLocked(fr)
		case *http2.RSTStreamFrame:
			c.resetLocked(c.streams[fr.StreamID])
		case *http2.SettingsFrame:
			c.onSettingsLocked(fr)
		case *http2.WindowUpdateFrame:
			c.onWindowUpdateLocked(fr)
		case *http2.PingFrame:
			if !fr.IsAck() {
				c.writeErr(c.framer().WritePing(true, fr.Data))
				c.needFlush = true
			}
		case *http2.GoAwayFrame:
			// The caller opens no more streams; those open finish.
		case *http2.PushPromiseFrame:
			// A client cannot push (RFC 9113, 8.4); its header block
			// would also go undecoded, out of step with its encoder.
			c.connErrorLocked(http2.ErrCodeProtocol, "PUSH_PROMISE from a client")
		}
		if c.br.Buffered() == 0 {
			c.flushLocked()
		}
		closed := c.closed
		c.mu.Unlock()
		if closed {
			return errors.New("connection closed")
		}
	}
}

// armWriteDeadline keeps a write deadline ahead of every write, pushed
// forward at most once a second.
func (c *feConn) armWriteDeadline() {
	if now := time.Now(); now.Sub(c.wdlSet) > time.Second {
		c.nc.SetWriteDeadline(now.Add(feWriteTimeout))
		c.wdlSet = now
	}
}

func (c *feConn) framer() *http2.Framer {
	c.armWriteDeadline()
	return c.fr
}

func (c *feConn) writeErr(err error) {
	if err != nil {
		c.closeLocked(err)
	}
}

func (c *feConn) flushLocked() {
	if c.needFlush && !c.closed {
		c.armWriteDeadline()
		c.writeErr(c.bw.Flush())
	}
	c.needFlush = false
}

// closeLocked closes the socket and cancels every call still on it.
func (c *feConn) closeLocked(error) {
	if c.closed {
		return
	}
	c.closed = true
	c.nc.Close()
	for id, st := range c.streams {
		c.arrivedLocked(st)
		st.reset = true
		if st.cancel != nil {
			st.cancel()
		}
		if st.in != nil {
			st.in.abort()
		}
		st.wake()
		// What it held is given back, as removeLocked does: nothing is
		// counted for a call that is gone.
		c.held -= st.held
		c.hdrHeld -= st.hdrHeld
		st.held, st.hdrHeld, st.waiting = 0, 0, false
		delete(c.streams, id)
	}
	c.waiting = nil
}

func (c *feConn) connErrorLocked(code http2.ErrCode, why string) {
	if c.closed {
		return
	}
	c.s.fe.b.log.Warn("CSI front end: closing a connection whose caller broke HTTP/2", "code", code.String(), "why", why)
	c.framer().WriteGoAway(c.lastID, code, []byte(why))
	c.bw.Flush()
	c.closeLocked(fmt.Errorf("%s: %s", code, why))
}

// goAway tells the caller to open no more streams; the connection closes
// once its calls are done.
func (c *feConn) goAway() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.goingAway {
		c.goAwayLocked(c.lastID, 0, errors.New("front end stopped"))
	}
}

// goAwayLocked tells the caller to open no more streams (those up to
// lastID finish as they would), refuses stream refuse if not 0, and closes
// the connection with why once none is left: at once if none is open.
func (c *feConn) goAwayLocked(lastID, refuse uint32, why error) {
	if c.closed {
		return
	}
	c.goingAway = true
	if !c.started {
		// Sent by run once its SETTINGS are (a caller that never sends
		// its preface is closed at the handshake timeout).
		return
	}
	c.writeErr(c.framer().WriteGoAway(lastID, http2.ErrCodeNo, nil))
	if refuse != 0 {
		// After the GOAWAY, so the caller retries it on another connection.
		c.writeErr(c.framer().WriteRSTStream(refuse, http2.ErrCodeRefusedStream))
	}
	c.needFlush = true
	c.flushLocked()
	if len(c.streams) == 0 {
		c.drainedLocked(why)
	}
}

// resetLocked ends a call the caller reset (or whose frames were bad).
func (c *feConn) resetLocked(st *feStream) {
	if st == nil {
		return
	}
	c.arrivedLocked(st)
	st.reset, st.remoteEnded, st.localEnded = true, true, true
	if st.cancel != nil {
		st.cancel()
	}
	if st.in != nil {
		st.in.abort()
	}
	c.removeLocked(st)
	st.wake()
}

func (c *feConn) removeLocked(st *feStream) {
	if c.streams[st.id] != st {
		return
	}
	if st.waiting {
		c.unwaitLocked(st)
	}
	c.releaseLocked(st)
	c.hdrHeld -= st.hdrHeld
	st.hdrHeld = 0
	delete(c.streams, st.id)
	if c.goingAway && len(c.streams) == 0 {
		c.drainedLocked(errors.New("connection drained"))
	}
}

// drainedLocked ends a connection whose calls are done after its GOAWAY:
// what is written is flushed and the writes shut, and the reader closes
// the connection once the caller has (or after rawgrpc.DrainLinger), so
// that no unread bytes of the caller's reset it before the last answer is
// through.
func (c *feConn) drainedLocked(why error) {
	if c.closed || c.shut {
		return
	}
	c.flushLocked()
	if c.closed {
		return
	}
	if rawgrpc.ShutdownWrite(c.nc) {
		c.shut = true
		return
	}
	c.closeLocked(why)
}

func (c *feConn) onHeadersLocked(fr *http2.MetaHeadersFrame) {
	id := fr.StreamID
	end := fr.StreamEnded()
	if st := c.streams[id]; st != nil {
		// Trailers from the caller: gRPC clients send none; they end the
		// request.
		if end {
			c.endRequestLocked(st)
		}
		return
	}
	if id%2 == 0 {
		c.connErrorLocked(http2.ErrCodeProtocol, fmt.Sprintf("the caller opened stream %d, an even ID", id))
		return
	}
	if id <= c.lastID {
		// A stream already finished here: its late frames are dropped.
		return
	}
	prevID := c.lastID
	c.lastID = id
	if c.peerCheck != nil && !c.goingAway {
		if err := c.peerCheck.Verify(); err != nil {
			// The caller's certificate expired, or its CA left the bundle,
			// since the handshake: no new call on this connection.
			c.s.fe.b.log.Warn("CSI TCP front end refuses new calls from a connection whose certificate no longer verifies; closing it", "remote", c.nc.RemoteAddr().String(), "caller", c.caller, "err", err)
			c.goAwayLocked(prevID, id, err)
			return
		}
	}
	if c.goingAway || len(c.streams) >= feMaxStreams {
		c.writeErr(c.framer().WriteRSTStream(id, http2.ErrCodeRefusedStream))
		c.needFlush = true
		return
	}
	path := fr.PseudoValue("path")
	st := &feStream{id: id, method: path, fields: fr.RegularFields(), sendWin: c.peer.InitialWindow, recvWin: feStreamWindow, arrived: time.Now()}
	ct := rawgrpc.HeaderValue(st.fields, "content-type")
	if fr.PseudoValue("method") != "POST" || !rawgrpc.IsGRPCContentType(ct) {
		// Not a gRPC call: answered as a gRPC server does.
		c.writeHeadersLocked(id, []hpack.HeaderField{{Name: ":status", Value: "415"}}, true)
		if !end {
			c.writeErr(c.framer().WriteRSTStream(id, http2.ErrCodeNo))
		}
		return
	}
	// Its header list is kept as long as the call is here: counted in
	// hdrHeld (at most maxHdrHeld), so that calls whose requests never end
	// cannot hold header lists without bound.
	hdrHeld := int(rawgrpc.HeaderListSize(st.fields))
	if c.hdrHeld+hdrHeld > maxHdrHeld {
		c.refuseLocked(id, "the header lists of its calls in flight", maxHdrHeld)
		return
	}
	st.contentType = ct
	st.remoteEnded = end
	st.hdrHeld = hdrHeld
	c.hdrHeld += hdrHeld
	c.streams[id] = st
	st.unary = c.s.fe.method(path).unary
	if st.unary {
		if end {
			hoptrace.Mark(hoptrace.FERequestWhole)
			c.s.workers.run(func() { c.serveUnary(st) })
		} else if v, ok := rawgrpc.LookupHeader(st.fields, "grpc-timeout"); ok {
			// The deadline runs from the HEADERS, as a gRPC server's
			// handler context does: a request still arriving then is
			// answered and its bytes dropped.
			if d, err := rawgrpc.ParseTimeout(v); err == nil {
				st.expiry = time.AfterFunc(time.Until(st.arrived.Add(d)), func() { c.expire(st) })
			}
		}
		return
	}
	st.in = &feInput{max: c.s.fe.b.opts.MaxMsgSize}
	st.in.cond = sync.NewCond(&st.in.mu)
	if end {
		st.in.push(nil, true)
	}
	go c.serveStream(st)
}

func (c *feConn) endRequestLocked(st *feStream) {
	if st.remoteEnded {
		return
	}
	c.arrivedLocked(st)
	st.remoteEnded = true
	if st.unary {
		hoptrace.Mark(hoptrace.FERequestWhole)
		c.s.workers.run(func() { c.serveUnary(st) })
	} else {
		st.in.push(nil, true)
		if st.waiting {
			// Its message can no longer arrive whole (next says so).
			c.unwaitLocked(st)
		}
	}
	if st.localEnded {
		c.removeLocked(st)
	}
}

func (c *feConn) onDataLocked(fr *http2.DataFrame) {
	n := fr.Length
	c.recvWin -= int64(n)
	if c.recvWin < 0 {
		c.connErrorLocked(http2.ErrCodeFlowControl, "DATA beyond the connection window")
		return
	}
	c.unacked += n
	if c.unacked >= feConnWindow/4 {
		c.writeErr(c.framer().WriteWindowUpdate(0, c.unacked))
		c.recvWin += int64(c.unacked)
		c.unacked = 0
		c.needFlush = true
	}
	st := c.streams[fr.StreamID]
	if st == nil || st.remoteEnded {
		return
	}
	st.recvWin -= int64(n)
	if st.recvWin < 0 {
		c.writeErr(c.framer().WriteRSTStream(st.id, http2.ErrCodeFlowControl))
		c.needFlush = true
		c.resetLocked(st)
		return
	}
	data := fr.Data()
	if st.unary {
		// A unary request is kept whole, bounded by MaxMsgSize: its
		// window is credited as it arrives. The requests of a
		// connection's calls in flight hold at most maxHeld bytes
		// together, until each call ends (releaseLocked).
		if len(st.req)+len(data) > c.s.fe.b.opts.MaxMsgSize+5 {
			c.releaseLocked(st)
			st.tooBig, st.req = true, nil
		}
		if !st.tooBig {
			if limit := c.maxHeld(); c.held+len(data) > limit {
				// Not served yet (its request is not whole): refused,
				// the caller may retry it.
				st.req = nil
				c.refuseLocked(st.id, "the requests of its calls in flight", limit)
				c.resetLocked(st)
				return
			}
			st.req = append(st.req, data...)
			st.held += len(data)
			c.held += len(data)
		}
		c.creditLocked(st, n)
	} else {
		// Padding is never passed on: credited now; messages once sent
		// on (the caller's backpressure), but for those larger than the
		// stream window, credited as they arrive when the connection's
		// budget lets them (they must be able to arrive whole).
		st.in.push(data, false)
		if pad := n - uint32(len(data)); pad > 0 {
			c.creditLocked(st, pad)
		}
		if !st.waiting {
			c.aheadLocked(st)
		}
	}
	if fr.StreamEnded() {
		c.endRequestLocked(st)
	}
}

// creditLocked returns n bytes of st's window, in updates of at least a
// quarter window.
func (c *feConn) creditLocked(st *feStream, n uint32) {
	if c.closed || st.remoteEnded || st.reset {
		return
	}
	st.unacked += n
	if st.unacked >= feStreamWindow/4 {
		c.writeErr(c.framer().WriteWindowUpdate(st.id, st.unacked))
		st.recvWin += int64(st.unacked)
		st.unacked = 0
		c.needFlush = true
	}
}

func (c *feConn) onSettingsLocked(fr *http2.SettingsFrame) {
	if fr.IsAck() {
		return
	}
	var maxWin int64
	for _, st := range c.streams {
		maxWin = max(maxWin, st.sendWin)
	}
	delta, code, err := c.peer.Apply(fr, c.enc, maxWin)
	if err != nil {
		c.connErrorLocked(code, "SETTINGS: "+err.Error())
		return
	}
	for _, st := range c.streams {
		st.sendWin += delta
		if delta > 0 {
			st.wake()
		}
	}
	c.writeErr(c.framer().WriteSettingsAck())
	c.needFlush = true
}

func (c *feConn) onWindowUpdateLocked(fr *http2.WindowUpdateFrame) {
	if fr.StreamID == 0 {
		shut := c.sendWin <= 0
		if !rawgrpc.GrowWindow(&c.sendWin, fr.Increment) {
			c.connErrorLocked(http2.ErrCodeFlowControl, "connection window beyond 2^31-1")
			return
		}
		if shut {
			// Only then can a writer be waiting on the connection's
			// window; the others wait on their streams'.
			for _, st := range c.streams {
				st.wake()
			}
		}
		return
	}
	st := c.streams[fr.StreamID]
	if st == nil {
		return
	}
	if !rawgrpc.GrowWindow(&st.sendWin, fr.Increment) {
		c.writeErr(c.framer().WriteRSTStream(st.id, http2.ErrCodeFlowControl))
		c.needFlush = true
		c.resetLocked(st)
		return
	}
	st.wake()
}

// writeHeadersLocked writes fields as HEADERS (+ CONTINUATION) on stream id.
func (c *feConn) writeHeadersLocked(id uint32, fields []hpack.HeaderField, end bool) {
	c.writeErr(rawgrpc.WriteHeaderBlock(c.framer(), c.enc, &c.hbuf, id, fields, end, c.peer.MaxFrame))
	c.needFlush = true
}

// errCallGone: the caller reset the call or its connection closed.
var errCallGone = errors.New("the caller is gone")

// sendHeaders writes a call's response headers.
func (c *feConn) sendHeaders(st *feStream, md metadata.MD) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if st.reset || c.closed {
		return errCallGone
	}
	fields := append(make([]hpack.HeaderField, 0, 2+len(md)), hpack.HeaderField{Name: ":status", Value: "200"}, hpack.HeaderField{Name: "content-type", Value: st.contentType})
	fields = appendMD(fields, md)
	if !c.peer.HeaderListFits(fields) {
		// The caller would refuse the block (gRPC's client closes the
		// whole connection on it): the call fails alone, saying why.
		err := status.Errorf(codes.Internal, "csibroker: the answer's header metadata is %d bytes, over the %d bytes the caller accepts (its SETTINGS_MAX_HEADER_LIST_SIZE)", rawgrpc.HeaderListSize(fields), c.peer.MaxHeaderList)
		c.s.fe.b.log.Warn("CSI front end: answer headers over the caller's header list limit", "method", st.method, "error", err)
		return err
	}
	c.writeHeadersLocked(st.id, fields, false)
	if !st.unary {
		// A stream's headers go out now: its first message may be long
		// in coming. (A unary call's go out with its answer.)
		c.flushLocked()
	}
	return nil
}

// sendWhole writes one gRPC message whose prefix msg holds, as one DATA
// frame when the windows and the frame size allow.
func (c *feConn) sendWhole(st *feStream, msg []byte) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.sendDataLocked(st, msg)
}

// sendMessage writes one gRPC message within the caller's windows, waiting
// for them to open.
func (c *feConn) sendMessage(st *feStream, payload []byte) error {
	var prefix [5]byte
	binary.BigEndian.PutUint32(prefix[1:], uint32(len(payload)))
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.sendDataLocked(st, prefix[:]); err != nil {
		return err
	}
	if err := c.sendDataLocked(st, payload); err != nil {
		return err
	}
	// Each message of a stream goes out as it comes: the next may be long
	// in coming, or wait for the caller's next request.
	c.flushLocked()
	return nil
}

func (c *feConn) sendDataLocked(st *feStream, data []byte) error {
	var stop func() bool
	defer func() {
		if stop != nil {
			stop()
		}
	}()
	for len(data) > 0 {
		if st.reset || c.closed {
			return errCallGone
		}
		n := min(int64(len(data)), c.sendWin, st.sendWin, int64(c.peer.MaxFrame))
		if n <= 0 {
			if st.ctx != nil && st.ctx.Err() != nil {
				// The call's deadline passed while the caller's windows
				// stayed shut: the answer is given up, not held for ever.
				c.writeErr(c.framer().WriteRSTStream(st.id, http2.ErrCodeCancel))
				c.needFlush = true
				c.flushLocked()
				c.resetLocked(st)
				return errCallGone
			}
			// Flush what is written before waiting for the caller (or
			// for the call's end).
			c.flushLocked()
			if stop == nil && st.ctx != nil {
				// The wait ends with the call too; registered once.
				stop = context.AfterFunc(st.ctx, func() {
					c.mu.Lock()
					st.wake()
					c.mu.Unlock()
				})
			}
			if st.cond == nil {
				st.cond = sync.NewCond(&c.mu)
			}
			st.cond.Wait()
			continue
		}
		c.writeErr(c.framer().WriteData(st.id, false, data[:n]))
		c.needFlush = true
		c.sendWin -= n
		st.sendWin -= n
		data = data[n:]
	}
	return nil
}

// finish writes the call's status in trailers (alone, if no headers were
// sent), flushes, and forgets the call.
func (c *feConn) finish(st *feStream, headersSent bool, err error, trailer metadata.MD) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.endLocked(st, headersSent, err, trailer) {
		return
	}
	if len(c.streams) > 0 && c.needFlush && !c.closed {
		// Other calls are in flight on this connection: let those whose
		// answers are ready write them before the flush, so that under
		// load several answers share one socket write. A lone call's
		// answer goes out at once.
		c.mu.Unlock()
		runtime.Gosched()
		c.mu.Lock()
	}
	c.flushLocked()
}

// endLocked writes st's status (and trailer) and ends the call, unflushed;
// false if it was reset, or the connection closed, before.
func (c *feConn) endLocked(st *feStream, headersSent bool, err error, trailer metadata.MD) bool {
	if st.reset || c.closed {
		return false
	}
	s := status.Convert(err)
	fields := make([]hpack.HeaderField, 0, 5+len(trailer))
	if !headersSent {
		fields = append(fields, hpack.HeaderField{Name: ":status", Value: "200"}, hpack.HeaderField{Name: "content-type", Value: st.contentType})
	}
	fields = append(fields, hpack.HeaderField{Name: "grpc-status", Value: strconv.Itoa(int(s.Code()))})
	if msg := s.Message(); msg != "" {
		fields = append(fields, hpack.HeaderField{Name: "grpc-message", Value: rawgrpc.EncodeStatusMessage(msg)})
	}
	if p := s.Proto(); p != nil && len(p.Details) > 0 {
		if b, merr := proto.Marshal(p); merr == nil {
			fields = append(fields, hpack.HeaderField{Name: "grpc-status-details-bin", Value: rawgrpc.EncodeBinaryHeader(string(b))})
		}
	}
	if fields = appendMD(fields, trailer); !c.peer.HeaderListFits(fields) {
		fields = c.shrinkStatus(st, headersSent, s)
	}
	if fields == nil {
		// Not even the status fits: the call is reset, as gRPC's server
		// does.
		c.writeErr(c.framer().WriteRSTStream(st.id, http2.ErrCodeInternal))
	} else {
		c.writeHeadersLocked(st.id, fields, true)
	}
	st.localEnded = true
	if !st.remoteEnded {
		// As a gRPC server does: the call is over, so the caller may stop
		// sending.
		c.writeErr(c.framer().WriteRSTStream(st.id, http2.ErrCodeNo))
		st.remoteEnded = true
		if st.in != nil {
			st.in.abort()
		}
	}
	// Removed before the answer can reach the caller, so that a caller
	// keeping to the stream limit is never refused (the removal closes a
	// draining connection once its last call is done, flushing first).
	c.removeLocked(st)
	return true
}

// shrinkStatus makes the trailers of a status whose trailers are over the
// caller's header list limit: the same code, without metadata and details,
// and the message cut to fit with a note saying so; nil if not even the
// code fits.
func (c *feConn) shrinkStatus(st *feStream, headersSent bool, s *status.Status) []hpack.HeaderField {
	lim := uint64(c.peer.MaxHeaderList)
	c.s.fe.b.log.Warn("CSI front end: trailers over the caller's header list limit; metadata and details dropped, message shortened",
		"method", st.method, "code", s.Code().String(), "limit_bytes", lim)
	var fields []hpack.HeaderField
	if !headersSent {
		fields = append(fields, hpack.HeaderField{Name: ":status", Value: "200"}, hpack.HeaderField{Name: "content-type", Value: st.contentType})
	}
	fields = append(fields, hpack.HeaderField{Name: "grpc-status", Value: strconv.Itoa(int(s.Code()))})
	used := rawgrpc.HeaderListSize(fields)
	if used > lim {
		return nil
	}
	note := rawgrpc.EncodeStatusMessage(fmt.Sprintf(" [csibroker: status cut to the caller's header list limit of %d bytes]", lim))
	room := int64(lim) - int64(used) - int64(len("grpc-message")+32) - int64(len(note))
	if room < 0 {
		return fields
	}
	msg := rawgrpc.EncodeStatusMessage(s.Message())
	if int64(len(msg)) > room {
		cut := int(room)
		// Not inside a %XX escape.
		for i := max(cut-2, 0); i < cut; i++ {
			if msg[i] == '%' {
				cut = i
				break
			}
		}
		msg = msg[:cut]
	}
	return append(fields, hpack.HeaderField{Name: "grpc-message", Value: msg + note})
}

// wake wakes st's writer if it waits for window (c.mu held).
func (st *feStream) wake() {
	if st.cond != nil {
		st.cond.Broadcast()
	}
}

// arrivedLocked ends st's request's expiry (it is whole, reset or
// refused).
func (c *feConn) arrivedLocked(st *feStream) {
	if st.expiry != nil {
		st.expiry.Stop()
		st.expiry = nil
	}
}

// releaseLocked gives back the bytes st's request held of maxHeld.
func (c *feConn) releaseLocked(st *feStream) {
	if st.held == 0 {
		return
	}
	c.held -= st.held
	st.held = 0
	if len(c.waiting) > 0 {
		c.aheadWaitingLocked()
	}
}

// maxHeld bounds the bytes of the unary requests of a connection's calls
// in flight, and of the streaming request messages credited as they
// arrive: two of the largest.
func (c *feConn) maxHeld() int { return 2 * (c.s.fe.b.opts.MaxMsgSize + 5) }

// aheadLocked credits what arrived of the message at the head of st's
// input if it is larger than the stream window, still arriving, and the
// connection's budget has room for all of it (counted in held from then
// until it was sent on), or if it was already let in; else st waits in
// c.waiting (after those that waited before it), held back by the stream
// window. False: it waits.
func (c *feConn) aheadLocked(st *feStream) bool {
	if c.closed || st.remoteEnded || st.reset {
		return true
	}
	room := c.maxHeld() - c.held
	if len(c.waiting) > 0 && c.waiting[0] != st {
		room = 0 // none jumps the queue: a large message is not starved by smaller ones
	}
	owe, took, need, short := st.in.creditAhead(room)
	if need > 0 {
		if !st.waiting {
			st.waiting = true
			c.waiting = append(c.waiting, st)
		}
		return false
	}
	st.held += took
	c.held += took
	if owe > 0 {
		c.creditLocked(st, uint32(owe))
	}
	if int64(short) > st.recvWin && st.unacked > 0 {
		// The caller cannot send the rest of the message without the
		// credit waiting to make up a quarter window: sent now.
		c.writeErr(c.framer().WriteWindowUpdate(st.id, st.unacked))
		st.recvWin += int64(st.unacked)
		st.unacked = 0
		c.needFlush = true
	}
	return true
}

// aheadWaitingLocked lets in the waiting streams' messages, in the order
// they came, while the budget has room.
func (c *feConn) aheadWaitingLocked() {
	for len(c.waiting) > 0 {
		st := c.waiting[0]
		if !c.aheadLocked(st) {
			return
		}
		// (A failed write closes the connection, emptying waiting.)
		if len(c.waiting) > 0 && c.waiting[0] == st {
			st.waiting = false
			c.waiting = slices.Delete(c.waiting, 0, 1)
		}
	}
}

// unwaitLocked takes st out of c.waiting (its call ended, or its request
// did): the one then first may fit where st did not.
func (c *feConn) unwaitLocked(st *feStream) {
	st.waiting = false
	if i := slices.Index(c.waiting, st); i >= 0 {
		c.waiting = slices.Delete(c.waiting, i, i+1)
		if i == 0 {
			c.aheadWaitingLocked()
		}
	}
}

// refuseLocked refuses call id for a budget of its connection: with
// RST_STREAM REFUSED_STREAM, which a gRPC client retries transparently
// and otherwise reports as Unavailable. It is only for calls of which
// nothing was served yet (the driver never saw them). Not
// RESOURCE_EXHAUSTED: to a CSI caller that is the driver saying it has no
// room (external-provisioner reschedules the claim), not a limit of one
// connection to the broker.
func (c *feConn) refuseLocked(id uint32, budget string, limit int) {
	if !c.warned {
		c.warned = true
		c.s.fe.b.log.Warn("CSI front end: refusing calls (REFUSED_STREAM, retried by the caller) on a connection over a memory budget; logged once per connection",
			"budget", budget, "limit_bytes", limit)
	}
	c.writeErr(c.framer().WriteRSTStream(id, http2.ErrCodeRefusedStream))
	c.needFlush = true
}

// maxHdrHeld bounds the bytes of the header lists of a connection's calls
// in flight: four of the largest the front end accepts (each call's is
// kept for the call), 4 KiB for each of feMaxStreams calls.
const maxHdrHeld = 4 * rawgrpc.MaxHeaderList

// expire answers DeadlineExceeded to a unary call whose deadline passed
// before its request was whole, and drops what arrived of it.
func (c *feConn) expire(st *feStream) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if st.remoteEnded || c.streams[st.id] != st {
		return
	}
	c.arrivedLocked(st)
	st.req = nil
	c.endLocked(st, false, status.Error(codes.DeadlineExceeded, "csibroker: the call's deadline passed before its request arrived whole"), nil)
	c.flushLocked()
}

// credit returns n bytes of a streaming call's window once they were taken
// from its input to be sent on, and credits the next message if it is
// larger than the stream window and already arriving (aheadLocked).
func (c *feConn) credit(st *feStream, n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.creditLocked(st, uint32(n))
	if !st.waiting && c.streams[st.id] == st {
		c.aheadLocked(st)
	}
	c.flushLocked()
}

// release gives back the n bytes a streaming call's message held of
// maxHeld once it was sent on (none if the call is gone: removeLocked gave
// them back), and lets in the messages waiting for them.
func (c *feConn) release(st *feStream, n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	n = min(n, st.held)
	st.held -= n
	c.held -= n
	if n > 0 && len(c.waiting) > 0 {
		c.aheadWaitingLocked()
	}
	c.flushLocked()
}

// appendMD adds metadata to header fields, "-bin" values encoded.
func appendMD(fields []hpack.HeaderField, md metadata.MD) []hpack.HeaderField {
	for k, vs := range md {
		if rawgrpc.Reserved(k) {
			continue
		}
		bin := strings.HasSuffix(k, "-bin")
		for _, v := range vs {
			if bin {
				v = rawgrpc.EncodeBinaryHeader(v)
			}
			fields = append(fields, hpack.HeaderField{Name: k, Value: v})
		}
	}
	return fields
}

// begin makes a call's context: the caller's deadline, its metadata for the
// next hop, and a server span that continues the caller's trace.
func (c *feConn) begin(st *feStream) (context.Context, metadata.MD, trace.Span, error) {
	// The caller's metadata for the next hop, without what gRPC and tracing
	// set per hop; routing reads the same map.
	out := make(metadata.MD, len(st.fields))
	var trErr error
	var timeout time.Duration
	hasTimeout := false
	for _, hf := range st.fields {
		switch {
		case hf.Name == "grpc-timeout":
			d, err := rawgrpc.ParseTimeout(hf.Value)
			if err != nil {
				trErr = status.Errorf(codes.Internal, "csibroker: %v", err)
				continue
			}
			// "0n" is a deadline that has passed, not "no deadline".
			timeout, hasTimeout = d, true
		case hf.Name == "grpc-encoding" && hf.Value != "identity":
			trErr = status.Errorf(codes.Unimplemented, "csibroker: compressed requests (grpc-encoding %q) are not supported", hf.Value)
		case rawgrpc.Reserved(hf.Name):
		case strings.HasSuffix(hf.Name, "-bin"):
			vs, err := rawgrpc.DecodeBinaryHeader(hf.Value)
			if err != nil {
				trErr = status.Errorf(codes.Internal, "csibroker: metadata %s: malformed binary value", hf.Name)
				continue
			}
			out[hf.Name] = append(out[hf.Name], vs...)
		default:
			out[hf.Name] = append(out[hf.Name], hf.Value)
		}
	}
	b := c.s.fe.b
	ctx := b.opts.Propagator.Extract(context.Background(), rawgrpc.FieldsCarrier{Fields: &st.fields})
	ctx, span := b.tracer.Start(ctx, strings.TrimPrefix(st.method, "/"), c.s.fe.method(st.method).spanOpts...)
	if c.caller != "" {
		span.SetAttributes(attribute.String("csibroker.caller", c.caller))
	}
	ctx = metadata.NewOutgoingContext(ctx, out)
	var cancel context.CancelFunc
	if hasTimeout {
		ctx, cancel = context.WithDeadline(ctx, st.arrived.Add(timeout))
	} else {
		ctx, cancel = context.WithCancel(ctx)
	}
	c.mu.Lock()
	st.ctx, st.cancel = ctx, cancel
	gone := st.reset || c.closed
	c.mu.Unlock()
	if gone {
		cancel()
	}
	return ctx, out, span, trErr
}

func endSpan(span trace.Span, err error) {
	code := status.Code(err)
	span.SetAttributes(attribute.String("rpc.response.status_code", code.String()))
	switch code {
	case codes.Unknown, codes.DeadlineExceeded, codes.Unimplemented, codes.Internal, codes.Unavailable, codes.DataLoss:
		span.SetStatus(otelcodes.Error, code.String())
	}
	span.End()
}

// serveUnary calls the chain with a whole request and writes the answer.
func (c *feConn) serveUnary(st *feStream) {
	hoptrace.Mark(hoptrace.FEWorkerStarts)
	ctx, md, span, err := c.begin(st)
	hoptrace.Mark(hoptrace.FEBegun)
	defer st.cancel()
	var hdr, trl metadata.MD
	var msg []byte // the answer, its prefix included
	if err == nil {
		msg, hdr, trl, err = c.callUnary(ctx, st, md)
	}
	headersSent := false
	if err == nil || len(hdr) > 0 {
		switch herr := c.sendHeaders(st, hdr); {
		case errors.Is(herr, errCallGone):
			endSpan(span, status.Error(codes.Canceled, herr.Error()))
			return
		case herr != nil:
			err, trl = herr, nil
		default:
			headersSent = true
		}
	}
	if err == nil {
		if werr := c.sendWhole(st, msg); werr != nil {
			endSpan(span, status.Error(codes.Canceled, werr.Error()))
			return
		}
	}
	c.finish(st, headersSent, err, trl)
	hoptrace.Mark(hoptrace.FEAnswerWritten)
	endSpan(span, err)
}

func (c *feConn) callUnary(ctx context.Context, st *feStream, md metadata.MD) (msg []byte, hdr, trl metadata.MD, err error) {
	maxMsg := c.s.fe.b.opts.MaxMsgSize
	req := st.req
	switch {
	case st.tooBig:
		return nil, nil, nil, status.Errorf(codes.ResourceExhausted, "csibroker: received message larger than max (%d bytes)", maxMsg)
	case len(req) < 5:
		return nil, nil, nil, status.Error(codes.Internal, "csibroker: the request holds no message")
	case req[0] != 0:
		return nil, nil, nil, status.Error(codes.Unimplemented, "csibroker: compressed requests are not supported")
	case int(binary.BigEndian.Uint32(req[1:5])) != len(req)-5:
		return nil, nil, nil, status.Error(codes.Internal, "csibroker: a unary request must hold exactly one message")
	}
	pc, err := c.s.fe.route(st.method, md)
	if err != nil {
		return nil, nil, nil, err
	}
	return c.s.fe.b.invokeFrames(ctx, pc, st.method, md, req)
}

// serveStream copies a streaming call message by message through a client
// stream of the chain.
func (c *feConn) serveStream(st *feStream) {
	ctx, md, span, err := c.begin(st)
	defer st.cancel()
	var cs grpc.ClientStream
	if err == nil {
		var pc *proxyConn
		if pc, err = c.s.fe.route(st.method, md); err == nil {
			// live: a registration that changed since the route was read.
			if pc, err = pc.live(); err == nil {
				cs, err = pc.conn.NewStream(ctx, rawgrpc.StreamDesc, st.method, rawgrpc.CallOption())
			}
		}
	}
	if err != nil {
		c.finish(st, false, err, nil)
		endSpan(span, err)
		return
	}
	// Requests: from the caller to the next hop, credited once sent on.
	upErr := make(chan error, 1)
	go func() {
		for {
			msg, n, held, err := st.in.next()
			if err != nil {
				if errors.Is(err, io.EOF) {
					upErr <- cs.CloseSend()
				} else {
					// A bad request: its status is the call's (sent
					// before the cancel, so the reader below finds it).
					upErr <- err
					st.cancel()
				}
				return
			}
			c.credit(st, n)
			err = cs.SendMsg(&rawgrpc.Frame{Payload: msg})
			if held > 0 {
				// Counted in the connection's budget until sent on:
				// until gRPC took it, that is. SendMsg returns once the
				// message is queued on the next hop's transport, which
				// keeps it until that hop's window lets it out, so one
				// message per stream can be held there beyond the
				// budget (as in any gRPC proxy).
				c.release(st, held)
			}
			if err != nil {
				// The next hop ended the call; its status comes from RecvMsg.
				upErr <- nil
				return
			}
		}
	}()
	headersSent := false
	// sent writes the headers once; false: the call is over.
	sent := func(hdr metadata.MD) bool {
		err := c.sendHeaders(st, hdr)
		switch {
		case errors.Is(err, errCallGone):
			endSpan(span, status.Error(codes.Canceled, err.Error()))
			return false
		case err != nil:
			c.finish(st, false, err, nil)
			endSpan(span, err)
			return false
		}
		headersSent = true
		return true
	}
	if hdr, herr := cs.Header(); herr == nil && hdr != nil {
		if !sent(hdr) {
			return
		}
	}
	for {
		f := &rawgrpc.Frame{}
		rerr := cs.RecvMsg(f)
		if rerr != nil {
			if errors.Is(rerr, io.EOF) {
				rerr = nil
			}
			// The request side's own error, if it already has one, is the
			// call's; never wait for a caller that has not half-closed.
			select {
			case uerr := <-upErr:
				if uerr != nil && !errors.Is(uerr, io.EOF) {
					rerr = uerr
				}
			default:
			}
			c.finish(st, headersSent, rerr, cs.Trailer())
			endSpan(span, rerr)
			return
		}
		if !headersSent && !sent(nil) {
			return
		}
		if err := c.sendMessage(st, f.Payload); err != nil {
			endSpan(span, status.Error(codes.Canceled, err.Error()))
			return
		}
	}
}

// feInput holds a streaming call's request bytes until they are sent on.
type feInput struct {
	mu       sync.Mutex
	cond     *sync.Cond
	buf      []byte
	credited int // bytes at the head of buf whose window was returned on arrival
	// ahead is the size (prefix included) of the message at the head of
	// buf once it is let in to be credited as it arrives (creditAhead), 0
	// before; next hands it back with the message, to be released from
	// the connection's budget once the message was sent on.
	ahead   int
	ended   bool
	aborted bool
	max     int
}

// push adds request bytes (copied). Their window is returned once they are
// sent on (next), so a slow next hop holds the caller back; or, for a
// message larger than the stream window, as they arrive (creditAhead).
func (in *feInput) push(p []byte, end bool) {
	in.mu.Lock()
	if !in.aborted {
		in.grow(len(p))
		in.buf = append(in.buf, p...)
	}
	in.ended = in.ended || end
	in.mu.Unlock()
	in.cond.Broadcast()
}

// grow makes room for extra more bytes in buf: no more than a window
// beyond what it holds, nor beyond the message let in at its head.
func (in *feInput) grow(extra int) {
	need := len(in.buf) + extra
	if need <= cap(in.buf) {
		return
	}
	size := max(need, min(2*cap(in.buf), need+feStreamWindow))
	if in.ahead >= need {
		size = min(size, in.ahead)
	}
	b := make([]byte, len(in.buf), size)
	copy(b, in.buf)
	in.buf = b
}

// creditAhead returns the bytes of the message at the head of buf to credit
// now, those not credited yet, if that message is larger than the stream
// window (it could never arrive whole otherwise), still arriving, not over
// max, and let in: already, or now if room holds all of it (took: its
// size, counted in the connection's budget from now until next hands it
// back). need: its size, if it is to be let in but room does not hold it.
// short: the bytes still to come of a message at the head that is not
// larger than the stream window (they must not wait for credit held back
// to be sent in larger updates).
func (in *feInput) creditAhead(room int) (owe, took, need, short int) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.aborted {
		return 0, 0, 0, 0
	}
	if len(in.buf) < 5 {
		return 0, 0, 0, 5 - len(in.buf)
	}
	n := int(binary.BigEndian.Uint32(in.buf[1:5]))
	switch {
	case n > in.max || len(in.buf) >= 5+n:
		return 0, 0, 0, 0
	case 5+n <= feStreamWindow:
		return 0, 0, 0, 5 + n - len(in.buf)
	}
	if in.ahead == 0 {
		if 5+n > room {
			return 0, 0, 5 + n, 0
		}
		in.ahead, took = 5+n, 5+n
	}
	owe = len(in.buf) - in.credited
	in.credited = len(in.buf)
	return owe, took, 0, 0
}

// abort ends the input; its bytes are dropped.
func (in *feInput) abort() {
	in.mu.Lock()
	in.aborted = true
	in.buf, in.credited, in.ahead = nil, 0, 0
	in.mu.Unlock()
	in.cond.Broadcast()
}

// next returns the next whole message, the bytes to credit for it (those
// not credited on arrival), and the bytes it held of the connection's
// budget (its size if it was credited as it arrived, else 0); io.EOF once
// the caller half-closed between messages.
func (in *feInput) next() ([]byte, int, int, error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	for {
		if in.aborted {
			return nil, 0, 0, status.Error(codes.Canceled, "csibroker: the caller reset the call")
		}
		if len(in.buf) >= 5 {
			if in.buf[0] != 0 {
				return nil, 0, 0, status.Error(codes.Unimplemented, "csibroker: compressed requests are not supported")
			}
			n := int(binary.BigEndian.Uint32(in.buf[1:5]))
			if n > in.max {
				return nil, 0, 0, status.Errorf(codes.ResourceExhausted, "csibroker: received message larger than max (%d vs. %d bytes)", n, in.max)
			}
			if len(in.buf) >= 5+n {
				// Not copied: what follows in buf is appended after it,
				// never over it.
				msg := in.buf[5 : 5+n : 5+n]
				if rest := in.buf[5+n:]; 5+n > feStreamWindow {
					// Not kept alive by the bytes after it (at most a
					// window's).
					in.buf = bytes.Clone(rest)
				} else {
					in.buf = rest
				}
				early := min(in.credited, 5+n)
				in.credited -= early
				held := in.ahead
				in.ahead = 0
				return msg, 5 + n - early, held, nil
			}
		}
		if in.ended {
			if len(in.buf) == 0 {
				return nil, 0, 0, io.EOF
			}
			return nil, 0, 0, status.Error(codes.Internal, "csibroker: the request ended inside a message")
		}
		in.cond.Wait()
	}
}
