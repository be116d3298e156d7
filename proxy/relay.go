package proxy

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc/codes"

	"github.com/csibroker/csibroker/internal/hoptrace"
	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/rawgrpc"
)

// The proxy relays HTTP/2 frames between the broker's connections (the proxy
// is their server, over mTLS) and the driver's socket (the proxy is its
// client). A call's frames are read by one connection's reader goroutine and
// written straight to the other connection: no gRPC stream, no message
// decoding, no hand-off to another goroutine. Each side keeps its own stream
// IDs, header compression state and flow-control windows.
//
// Flow control: a connection's window is credited as soon as DATA is read,
// so one slow call never holds back the other calls of its connection; a
// stream's window is credited only once its bytes were passed on, so what
// the proxy holds for a slow receiver is at most one stream window per call
// and direction, with at most maxStreams calls per broker connection. A
// peer that sends beyond the windows the proxy granted is refused with
// FLOW_CONTROL_ERROR, and one that takes no bytes for writeTimeout is
// dropped.

const (
	// Our receive windows, as advertised to both sides.
	streamWindow = 256 << 10
	connWindow   = rawgrpc.ConnWindow
	// maxStreams caps the concurrent calls of one broker connection (the
	// broker's gRPC client queues calls beyond it).
	maxStreams = 1024
	// writeTimeout: a peer that takes no bytes for this long is dropped, so
	// it cannot hold its connection's lock, and the calls waiting on it,
	// for ever.
	writeTimeout = 15 * time.Second
	// defaultPeerStreams is the peer's stream limit before its SETTINGS
	// arrive; no driver stream is opened before them (openLocked).
	defaultPeerStreams = 100
	// Frames we read are at most this large (the HTTP/2 default, which every
	// peer must accept, so any frame we read can be written on unchanged).
	readFrameSize = 16 << 10
	bufSize       = 32 << 10
)

// out is a frame waiting to be written on a leg: DATA (isData) or HEADERS.
type out struct {
	isData bool
	data   []byte
	fields []hpack.HeaderField
	end    bool
	from   *leg // the leg the DATA was read from, credited once it is written
}

// leg is one side of a relayed call: its stream on one connection. Its fields
// are guarded by c.mu.
type leg struct {
	c           *conn
	s           *stream
	id          uint32     // 0 until the stream is opened on c
	sendWin     int64      // what the peer lets us send on this stream
	recvWin     int64      // what we let the peer send on this stream
	unacked     uint32     // bytes read on this leg and passed on, not yet credited back
	msg         msgTracker // gRPC message framing of the DATA sent on this leg
	remoteEnded bool       // the peer sent END_STREAM
	localEnded  bool       // we sent END_STREAM
	sentHeaders bool       // we sent the first HEADERS (for the broker leg: response headers)
	gotHeaders  bool       // driver leg: the driver's response headers arrived
	done        bool       // removed from c.streams
	pending     []out
	blocked     bool // in c.blocked
}

// msgTracker follows the gRPC length-prefixed messages in a byte stream, to
// tell whether it ends between two messages.
type msgTracker struct {
	hdr  [5]byte
	hdrN int
	body uint64
}

func (m *msgTracker) feed(p []byte) {
	for len(p) > 0 {
		if m.body > 0 {
			n := min(uint64(len(p)), m.body)
			m.body -= n
			p = p[n:]
			continue
		}
		n := copy(m.hdr[m.hdrN:], p)
		m.hdrN += n
		p = p[n:]
		if m.hdrN == 5 {
			m.hdrN = 0
			m.body = uint64(binary.BigEndian.Uint32(m.hdr[1:]))
		}
	}
}

func (m *msgTracker) boundary() bool { return m.hdrN == 0 && m.body == 0 }

// conn is one HTTP/2 connection: to the broker (server side) or to the
// driver (client side).
type conn struct {
	p      *Proxy
	nc     net.Conn
	driver bool
	fr     *http2.Framer
	rd     *rawgrpc.FrameReader // reads fr, header blocks decoded
	br     *bufio.Reader
	bw     *bufio.Writer
	desc   string // for log lines and errors

	mu        sync.Mutex
	enc       *hpack.Encoder
	hbuf      bytes.Buffer
	streams   map[uint32]*leg
	sendWin   int64                // connection-level window the peer grants
	recvWin   int64                // connection-level window we grant
	peer      rawgrpc.PeerSettings // the peer's SETTINGS
	settings  bool                 // the peer's first SETTINGS arrived
	unacked   uint32               // connection-level bytes read, not yet credited back
	nextID    uint32               // driver side: next stream ID to open
	lastID    uint32               // broker side: highest stream ID opened by the broker
	active    int                  // driver side: open streams, counted against maxStreams
	waiting   []*leg               // driver side: legs waiting for a stream slot
	blocked   []*leg               // legs with pending frames
	needFlush bool
	goingAway bool // no new streams on this connection
	// retiring: driver side, its stream IDs nearly used up: no new call
	// comes to it, but the legs queued for a slot still open (the IDs
	// left are plenty for them), and it closes once none is left.
	retiring bool
	draining bool // broker side: GOAWAY sent, close when idle
	// peerCheck verifies a broker connection's certificate again before
	// each new call (nil on the driver side).
	peerCheck *mtls.PeerCheck
	closed    bool
	closeErr  error
	// isClosed mirrors closed for the reader's check after every frame,
	// without taking mu.
	isClosed atomic.Bool
	// shut: drained, writes shut; the reader drops what the peer still
	// sends and closes the connection once the peer has (shutLocked).
	shut   atomic.Bool
	wdlSet time.Time // when the write deadline was last pushed forward

	dconn *conn // broker side: its driver connection for new calls (guarded by Proxy.dmu)
	// dconns: broker side: every driver connection made for it whose
	// reader has not yet returned, retiring ones and those the driver
	// sent GOAWAY on included (guarded by Proxy.dmu).
	dconns []*conn
	owner  *conn // driver side: the broker connection it serves
}

func newConn(p *Proxy, nc net.Conn, driver bool, desc string) *conn {
	c := &conn{p: p, nc: nc, driver: driver, desc: desc,
		br:      bufio.NewReaderSize(nc, bufSize),
		bw:      bufio.NewWriterSize(nc, bufSize),
		streams: map[uint32]*leg{},
		sendWin: rawgrpc.DefaultWindow, recvWin: connWindow, peer: rawgrpc.DefaultPeerSettings(defaultPeerStreams),
		nextID: 1,
	}
	c.fr = http2.NewFramer(c.bw, c.br)
	c.fr.SetMaxReadFrameSize(readFrameSize)
	c.fr.MaxHeaderListSize = rawgrpc.MaxHeaderList
	c.rd = rawgrpc.NewFrameReader(c.fr, 4096)
	c.enc = hpack.NewEncoder(&c.hbuf)
	return c
}

// start writes our half of the connection preface: the client preface
// (driver side), our SETTINGS and the connection window.
func (c *conn) start() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.armWriteDeadline()
	if c.driver {
		if _, err := c.bw.WriteString(http2.ClientPreface); err != nil {
			return err
		}
	}
	settings := []http2.Setting{{ID: http2.SettingInitialWindowSize, Val: streamWindow}, {ID: http2.SettingMaxHeaderListSize, Val: rawgrpc.MaxHeaderList}}
	if c.driver {
		settings = append(settings, http2.Setting{ID: http2.SettingEnablePush, Val: 0})
	} else {
		settings = append(settings, http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: maxStreams})
	}
	if err := c.fr.WriteSettings(settings...); err != nil {
		return err
	}
	if err := c.fr.WriteWindowUpdate(0, connWindow-rawgrpc.DefaultWindow); err != nil {
		return err
	}
	return c.bw.Flush()
}

// armWriteDeadline keeps a write deadline ahead of every write; it is
// pushed forward at most once a second (each push is a timer update).
func (c *conn) armWriteDeadline() {
	if now := time.Now(); now.Sub(c.wdlSet) > time.Second {
		c.nc.SetWriteDeadline(now.Add(writeTimeout))
		c.wdlSet = now
	}
}

// framer returns the framer for a write, with the write deadline armed.
func (c *conn) framer() *http2.Framer {
	c.armWriteDeadline()
	return c.fr
}

// flusher remembers the connections a reader wrote to, to flush them when
// it has nothing more buffered to read: a burst of frames leaves in one
// write.
type flusher struct{ conns []*conn }

func (f *flusher) mark(c *conn) {
	for _, x := range f.conns {
		if x == c {
			return
		}
	}
	f.conns = append(f.conns, c)
}

func (f *flusher) flush() {
	for _, c := range f.conns {
		c.mu.Lock()
		c.flushLocked()
		c.mu.Unlock()
	}
	f.conns = f.conns[:0]
}

func (c *conn) flushLocked() {
	if c.needFlush && !c.closed {
		c.armWriteDeadline()
		if err := c.bw.Flush(); err != nil {
			c.closeLocked(err)
		}
	}
	c.needFlush = false
}

// errConnClosed is a closed connection's error when nothing said why.
var errConnClosed = errors.New("connection closed")

// closeLocked marks the connection closed and closes the socket; the reader
// goroutine then fails every stream left on it.
func (c *conn) closeLocked(err error) {
	if c.closed {
		return
	}
	c.closed, c.closeErr = true, err
	c.isClosed.Store(true)
	c.nc.Close()
}

func (c *conn) writeErr(err error) {
	if err != nil {
		c.closeLocked(err)
	}
}

// connErrorLocked ends the connection for a protocol error of the peer's.
func (c *conn) connErrorLocked(code http2.ErrCode, why string) {
	if c.closed {
		return
	}
	side := "broker"
	if c.driver {
		side = "driver"
	}
	c.p.log.Warn("closing a connection whose peer broke HTTP/2", "side", side, "peer", c.desc, "code", code.String(), "why", why)
	c.framer().WriteGoAway(c.lastID, code, []byte(why))
	c.bw.Flush()
	c.closeLocked(fmt.Errorf("%s: %s", code, why))
}

// goAwayLocked tells the broker to open no more streams on this
// connection (those up to lastID finish as they would), refuses stream
// refuse if not 0, and closes it with why once none is left: at once if
// none is open.
func (c *conn) goAwayLocked(lastID, refuse uint32, why error) {
	if c.closed {
		return
	}
	c.goingAway, c.draining = true, true
	c.writeErr(c.framer().WriteGoAway(lastID, http2.ErrCodeNo, nil))
	if refuse != 0 {
		// After the GOAWAY, so the broker retries it on another connection.
		c.writeErr(c.framer().WriteRSTStream(refuse, http2.ErrCodeRefusedStream))
	}
	c.needFlush = true
	if len(c.streams) == 0 {
		c.shutLocked(why) // the GOAWAY reaches the broker before the close
		return
	}
	c.flushLocked()
}

// writeHeadersLocked writes fields as HEADERS (+ CONTINUATION) on stream id.
func (c *conn) writeHeadersLocked(id uint32, fields []hpack.HeaderField, end bool) {
	c.writeErr(rawgrpc.WriteHeaderBlock(c.framer(), c.enc, &c.hbuf, id, fields, end, c.peer.MaxFrame))
	c.needFlush = true
}

// credit is a number of bytes to credit back to the peer of a leg.
type credit struct {
	l *leg
	n uint32
}

// sendLocked writes o on l, or queues it behind earlier frames or until the
// windows allow. It returns the bytes of DATA written, to credit back to
// o.from's stream.
func (c *conn) sendLocked(l *leg, o out, credits []credit) []credit {
	if l.done || l.localEnded || c.closed {
		return credits // the stream is gone on this side: dropped
	}
	if o.isData && !c.driver {
		l.msg.feed(o.data)
	}
	if len(l.pending) > 0 || l.id == 0 {
		if o.isData {
			if n := len(l.pending); n > 0 && l.pending[n-1].isData && !l.pending[n-1].end && l.pending[n-1].from == o.from {
				// Behind DATA still queued: joined to it, so that a
				// peer's many small (or empty) frames, which flow
				// control does not bound in number, make one entry.
				last := &l.pending[n-1]
				last.data, last.end = append(last.data, o.data...), o.end
				return credits
			}
			if len(o.data) == 0 && !o.end {
				return credits // carries nothing
			}
			o.data = bytes.Clone(o.data)
		}
		l.pending = append(l.pending, o)
		c.markBlocked(l)
		return credits
	}
	return c.writeLocked(l, o, credits)
}

func (c *conn) markBlocked(l *leg) {
	if !l.blocked && l.id != 0 {
		l.blocked = true
		c.blocked = append(c.blocked, l)
	}
}

// writeLocked writes as much of o as the windows allow and queues the rest.
func (c *conn) writeLocked(l *leg, o out, credits []credit) []credit {
	if !o.isData {
		c.writeHeadersLocked(l.id, o.fields, o.end)
		l.sentHeaders = true
		if o.end {
			c.endedLocked(l)
		}
		return credits
	}
	data := o.data
	for {
		// A window can be negative (the peer lowered its initial window
		// below what was sent); an empty frame still goes out.
		n := max(min(int64(len(data)), c.sendWin, l.sendWin, int64(c.peer.MaxFrame)), 0)
		if n == 0 && len(data) > 0 {
			break
		}
		last := n == int64(len(data))
		c.writeErr(c.framer().WriteData(l.id, last && o.end, data[:n]))
		c.needFlush = true
		c.sendWin -= n
		l.sendWin -= n
		if o.from != nil && n > 0 {
			credits = append(credits, credit{o.from, uint32(n)})
		}
		data = data[n:]
		if last {
			if o.end {
				c.endedLocked(l)
			}
			return credits
		}
	}
	o.data = bytes.Clone(data)
	l.pending = append([]out{o}, l.pending...)
	c.markBlocked(l)
	return credits
}

// drainLocked writes l's pending frames while the windows allow.
func (c *conn) drainLocked(l *leg, credits []credit) []credit {
	if l.id == 0 {
		return credits
	}
	for len(l.pending) > 0 && !l.done && !c.closed {
		o := l.pending[0]
		l.pending = l.pending[1:]
		before := len(l.pending)
		credits = c.writeLocked(l, o, credits)
		if len(l.pending) > before {
			return credits // put back, partly written: out of window
		}
	}
	l.pending = nil
	return credits
}

// drainBlockedLocked drains every leg waiting for the connection window.
func (c *conn) drainBlockedLocked(credits []credit) []credit {
	legs := c.blocked
	c.blocked = nil
	for _, l := range legs {
		l.blocked = false
	}
	for _, l := range legs {
		credits = c.drainLocked(l, credits)
	}
	return credits
}

// remoteEndedLocked notes that l's peer sent END_STREAM.
func (c *conn) remoteEndedLocked(l *leg) {
	l.remoteEnded = true
	if l.localEnded {
		c.removeLocked(l)
	}
}

// endedLocked notes that we sent END_STREAM on l.
func (c *conn) endedLocked(l *leg) {
	l.localEnded = true
	if !l.remoteEnded && !c.driver {
		// As a gRPC server does: the call is over, so the caller may stop
		// sending.
		c.writeErr(c.framer().WriteRSTStream(l.id, http2.ErrCodeNo))
		l.remoteEnded = true
	}
	if l.remoteEnded {
		c.removeLocked(l)
	}
}

// removeLocked forgets a finished leg. Its queued bytes are dropped: the
// connection windows were credited when they were read, and the stream is
// over.
func (c *conn) removeLocked(l *leg) {
	if l.done {
		return
	}
	l.done = true
	l.pending = nil
	if l.id == 0 {
		// Still waiting for a stream slot: never opened. (The last call
		// waiting on a retiring connection, which no call comes to any
		// more, drains it as the last open stream would.)
		for i, w := range c.waiting {
			if w == l {
				c.waiting = append(c.waiting[:i], c.waiting[i+1:]...)
				break
			}
		}
	} else {
		delete(c.streams, l.id)
		if c.driver {
			c.active--
			c.openWaitingLocked()
		}
	}
	if ((c.goingAway || c.retiring) && c.driver || c.draining) && len(c.streams) == 0 && len(c.waiting) == 0 {
		c.shutLocked(errors.New("connection drained"))
	}
}

// shutLocked ends a drained connection: what is written is flushed and
// the writes shut, and the reader closes the connection once the peer has
// (or after rawgrpc.DrainLinger), so that no unread bytes of the peer's
// reset it before the last answer is through.
func (c *conn) shutLocked(why error) {
	if c.closed || c.shut.Load() {
		return
	}
	c.flushLocked()
	if c.closed {
		return
	}
	if rawgrpc.ShutdownWrite(c.nc) {
		c.shut.Store(true)
		c.closeErr = why
		return
	}
	c.closeLocked(why)
}

// openLocked gives a driver leg its stream ID now, or queues it while the
// driver's concurrent-stream limit is reached or not yet known: until the
// driver's first SETTINGS arrive (as gRPC's client waits for its server's
// preface), since a driver allowing fewer streams than assumed would
// refuse the others.
func (c *conn) openLocked(l *leg) bool {
	if !c.settings || uint32(c.active) >= c.peer.MaxStreams {
		c.waiting = append(c.waiting, l)
		return false
	}
	l.id = c.nextID
	c.nextID += 2
	c.active++
	l.sendWin, l.recvWin = c.peer.InitialWindow, streamWindow
	c.streams[l.id] = l
	return true
}

// shortenTimeoutLocked takes the time since a queued leg's call arrived
// (its dial and its wait for a stream slot) off the grpc-timeout of its
// request headers, as gRPC computes the field when it writes them: the
// driver's deadline is then no later than the caller's.
func (l *leg) shortenTimeoutLocked() {
	if len(l.pending) == 0 || l.pending[0].isData {
		return
	}
	waited := time.Since(l.s.start)
	fields := l.pending[0].fields
	for i, hf := range fields {
		if hf.Name != "grpc-timeout" {
			continue
		}
		if d, err := rawgrpc.ParseTimeout(hf.Value); err == nil {
			fields[i].Value = rawgrpc.EncodeTimeout(max(d-waited, time.Nanosecond))
		}
		return
	}
}

// openWaitingLocked opens queued legs as the driver's stream limit allows
// (none once it sent GOAWAY: they fail with it) and flushes what it wrote:
// the caller that freed the slot may have nothing else to send here.
func (c *conn) openWaitingLocked() {
	opened := false
	defer func() {
		if opened {
			c.flushLocked()
		}
	}()
	for len(c.waiting) > 0 && c.settings && uint32(c.active) < c.peer.MaxStreams && !c.closed && !c.goingAway {
		l := c.waiting[0]
		c.waiting = c.waiting[1:]
		if l.done {
			continue
		}
		c.openLocked(l)
		opened = true
		l.shortenTimeoutLocked()
		// Credits owed for what was queued go to the broker's connection,
		// whose lock is never taken while holding this one: a rare path (a
		// call queued behind the driver's stream limit), so a goroutine.
		if cr := c.drainLocked(l, nil); len(cr) > 0 {
			go func() {
				var f flusher
				applyCredits(cr, &f)
				f.flush()
			}()
		}
	}
}

// creditLocked returns n bytes of l's stream window to its peer, in updates
// of at least a quarter window.
func (c *conn) creditLocked(l *leg, n uint32) {
	if c.closed || l.done || l.remoteEnded {
		return
	}
	l.unacked += n
	if l.unacked >= streamWindow/4 {
		c.writeErr(c.framer().WriteWindowUpdate(l.id, l.unacked))
		l.recvWin += int64(l.unacked)
		l.unacked = 0
		c.needFlush = true
	}
}

// applyCredits credits legs on other connections, one lock at a time.
func applyCredits(credits []credit, f *flusher) {
	for _, x := range credits {
		c := x.l.c
		c.mu.Lock()
		c.creditLocked(x.l, x.n)
		c.mu.Unlock()
		if f != nil {
			f.mark(c)
		}
	}
}

// readLoop reads frames until the connection fails, then fails its streams.
func (c *conn) readLoop(onHeaders func(*http2.MetaHeadersFrame, *flusher)) {
	var f flusher
	var credits []credit
	for {
		fr, err := c.rd.ReadFrame()
		if c.shut.Load() {
			// Drained: dropped until the peer closes (or the linger
			// deadline passes).
			if err != nil {
				c.fail(err) // keeps the reason shutLocked gave
				return
			}
			continue
		}
		if c.isClosed.Load() {
			// Closed since the last frame: by a connection error of the
			// peer's (a frame handler sent GOAWAY), a failed write, or
			// another goroutine. What the peer sent after is not acted
			// on, however much of it is buffered: the GOAWAY told the
			// peer which of its streams were not processed, and it may
			// retry those elsewhere (RFC 9113, 6.8).
			f.flush()
			c.fail(errConnClosed) // keeps the reason it was closed with
			return
		}
		if _, ok := fr.(*http2.MetaHeadersFrame); hoptrace.Enabled && ok {
			if c.driver {
				hoptrace.Mark(hoptrace.ProxyAnswerRead)
			} else {
				hoptrace.Mark(hoptrace.ProxyRequestRead)
			}
		}
		if err != nil {
			var se http2.StreamError
			if errors.As(err, &se) {
				// A malformed frame on one stream: reset it on both legs.
				c.mu.Lock()
				c.writeErr(c.framer().WriteRSTStream(se.StreamID, se.Code))
				c.needFlush = true
				c.mu.Unlock()
				f.mark(c)
				c.streamReset(se.StreamID, se.Code, &f)
				if c.br.Buffered() == 0 {
					f.flush() // nothing more to read now: the reset goes out
				}
				continue
			}
			var ce http2.ConnectionError
			if errors.As(err, &ce) {
				c.mu.Lock()
				c.connErrorLocked(http2.ErrCode(ce), err.Error())
				c.mu.Unlock()
			}
			f.flush()
			c.fail(err)
			return
		}
		credits = credits[:0]
		switch fr := fr.(type) {
		case *http2.MetaHeadersFrame:
			onHeaders(fr, &f)
		case *http2.DataFrame:
			credits = c.onData(fr, credits, &f)
		case *http2.RSTStreamFrame:
			c.streamReset(fr.StreamID, fr.ErrCode, &f)
		case *http2.SettingsFrame:
			credits = c.onSettings(fr, credits)
			f.mark(c)
		case *http2.WindowUpdateFrame:
			credits = c.onWindowUpdate(fr, credits, &f)
			f.mark(c)
		case *http2.PingFrame:
			if !fr.IsAck() {
				c.mu.Lock()
				c.writeErr(c.framer().WritePing(true, fr.Data))
				c.needFlush = true
				c.mu.Unlock()
				f.mark(c)
			}
		case *http2.GoAwayFrame:
			c.onGoAway(fr, &f)
		case *http2.PushPromiseFrame:
			// Neither peer may push: the broker is a client, and the
			// driver was told SETTINGS_ENABLE_PUSH 0 (RFC 9113, 8.4).
			c.mu.Lock()
			c.connErrorLocked(http2.ErrCodeProtocol, "PUSH_PROMISE")
			c.mu.Unlock()
		}
		applyCredits(credits, &f)
		if c.br.Buffered() == 0 {
			// (hoptrace: a flush that relays frames, not only this
			// connection's acks.)
			relayed := hoptrace.Enabled && slices.ContainsFunc(f.conns, func(x *conn) bool { return x != c })
			f.flush()
			switch {
			case relayed && c.driver:
				hoptrace.Mark(hoptrace.ProxyAnswerSent)
			case relayed:
				hoptrace.Mark(hoptrace.ProxyRequestSent)
			}
		}
	}
}

// onData passes a DATA frame on to the other leg of its stream.
func (c *conn) onData(fr *http2.DataFrame, credits []credit, f *flusher) []credit {
	c.mu.Lock()
	// The connection window is credited at once: what is held back is
	// bounded per stream.
	c.recvWin -= int64(fr.Length)
	if c.recvWin < 0 {
		c.connErrorLocked(http2.ErrCodeFlowControl, "DATA beyond the connection window")
		c.mu.Unlock()
		return credits
	}
	c.unacked += fr.Length
	if c.unacked >= connWindow/4 {
		c.writeErr(c.framer().WriteWindowUpdate(0, c.unacked))
		c.recvWin += int64(c.unacked)
		c.unacked = 0
		c.needFlush = true
		f.mark(c)
	}
	l := c.streams[fr.StreamID]
	if l == nil || l.remoteEnded {
		// A stream already finished here (or DATA after its END_STREAM):
		// dropped.
		c.mu.Unlock()
		return credits
	}
	l.recvWin -= int64(fr.Length)
	if l.recvWin < 0 {
		c.writeErr(c.framer().WriteRSTStream(fr.StreamID, http2.ErrCodeFlowControl))
		c.needFlush = true
		c.mu.Unlock()
		f.mark(c)
		c.streamReset(fr.StreamID, http2.ErrCodeFlowControl, f)
		return credits
	}
	// Padding is never passed on: credit it now.
	if pad := fr.Length - uint32(len(fr.Data())); pad > 0 {
		credits = append(credits, credit{l, pad})
	}
	end := fr.StreamEnded()
	if end {
		c.remoteEndedLocked(l)
	}
	s := l.s
	c.mu.Unlock()

	if s.local != nil {
		// A call the proxy answers itself: keep the request (bounded).
		credits = append(credits, credit{l, uint32(len(fr.Data()))})
		s.local.add(fr.Data(), end)
		return credits
	}
	other := s.other(l)
	if other == nil {
		return credits
	}
	oc := other.c
	oc.mu.Lock()
	credits = oc.sendLocked(other, out{isData: true, data: fr.Data(), end: end, from: l}, credits)
	oc.mu.Unlock()
	f.mark(oc)
	return credits
}

// streamReset passes a stream's reset on to its other leg.
func (c *conn) streamReset(id uint32, code http2.ErrCode, f *flusher) {
	c.mu.Lock()
	l := c.streams[id]
	if l == nil {
		c.mu.Unlock()
		return
	}
	// A driver that reset a call it had already answered (as gRPC servers
	// do when the caller has not finished sending) changes nothing for the
	// caller, who gets the answer.
	answered := c.driver && l.remoteEnded
	l.remoteEnded, l.localEnded = true, true
	c.removeLocked(l)
	s := l.s
	c.mu.Unlock()
	if answered {
		return
	}
	if s.local != nil {
		s.local.cancel()
		s.finish(codes.Canceled)
		return
	}
	other := s.other(l)
	if other == nil {
		return
	}
	if c.driver {
		s.finish(rawgrpc.RSTCode(code))
	} else {
		s.finish(codes.Canceled)
	}
	other.c.resetLeg(other, code)
	f.mark(other.c)
}

// resetLeg sends RST_STREAM on l (or drops it before it was opened).
func (c *conn) resetLeg(l *leg, code http2.ErrCode) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if l.done || c.closed {
		return
	}
	if l.id != 0 {
		c.writeErr(c.framer().WriteRSTStream(l.id, code))
		c.needFlush = true
	}
	l.localEnded, l.remoteEnded = true, true
	c.removeLocked(l)
}

func (c *conn) onSettings(fr *http2.SettingsFrame, credits []credit) []credit {
	if fr.IsAck() {
		return credits
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.settings {
		c.settings = true
		c.peer.MaxStreams = ^uint32(0) // no limit unless the peer states one
	}
	var maxWin int64
	for _, l := range c.streams {
		maxWin = max(maxWin, l.sendWin)
	}
	delta, code, err := c.peer.Apply(fr, c.enc, maxWin)
	if err != nil {
		c.connErrorLocked(code, "SETTINGS: "+err.Error())
		return credits
	}
	for _, l := range c.streams {
		l.sendWin += delta
		if delta != 0 && len(l.pending) > 0 {
			c.markBlocked(l)
		}
	}
	c.writeErr(c.framer().WriteSettingsAck())
	c.needFlush = true
	if c.driver {
		c.openWaitingLocked()
	}
	return c.drainBlockedLocked(credits)
}

func (c *conn) onWindowUpdate(fr *http2.WindowUpdateFrame, credits []credit, f *flusher) []credit {
	c.mu.Lock()
	if fr.StreamID == 0 {
		if !rawgrpc.GrowWindow(&c.sendWin, fr.Increment) {
			c.connErrorLocked(http2.ErrCodeFlowControl, "connection window beyond 2^31-1")
			c.mu.Unlock()
			return credits
		}
		credits = c.drainBlockedLocked(credits)
		c.mu.Unlock()
		return credits
	}
	l := c.streams[fr.StreamID]
	if l == nil {
		c.mu.Unlock()
		return credits
	}
	if !rawgrpc.GrowWindow(&l.sendWin, fr.Increment) {
		c.writeErr(c.framer().WriteRSTStream(fr.StreamID, http2.ErrCodeFlowControl))
		c.needFlush = true
		c.mu.Unlock()
		c.streamReset(fr.StreamID, http2.ErrCodeFlowControl, f)
		return credits
	}
	credits = c.drainLocked(l, credits)
	c.mu.Unlock()
	return credits
}

// onGoAway: the broker closes its connection (nothing to do until its
// streams end), or the driver shuts down: streams it never saw fail with
// Unavailable (safe to retry) and new calls go to a new connection.
func (c *conn) onGoAway(fr *http2.GoAwayFrame, f *flusher) {
	c.mu.Lock()
	c.goingAway = true
	var refused []*leg
	if c.driver {
		for id, l := range c.streams {
			if id > fr.LastStreamID {
				refused = append(refused, l)
			}
		}
		refused = append(refused, c.waiting...)
	}
	for _, l := range refused {
		l.remoteEnded, l.localEnded = true, true
		c.removeLocked(l)
	}
	if c.driver && len(c.streams) == 0 {
		c.closeLocked(errors.New("driver sent GOAWAY"))
	}
	c.mu.Unlock()
	if c.driver {
		c.p.dropDriverConn(c)
	}
	for _, l := range refused {
		l.s.fail(codes.Unavailable, fmt.Sprintf("csibroker proxy: driver at %s: shutting down (GOAWAY %s) before it saw the call", c.p.target, fr.ErrCode), f)
	}
}

// fail ends every stream of a connection that is gone.
func (c *conn) fail(err error) {
	c.mu.Lock()
	if c.closeErr == nil {
		c.closeErr = err
	}
	why := c.closeErr
	c.closed = true
	c.isClosed.Store(true)
	c.nc.Close()
	legs := make([]*leg, 0, len(c.streams)+len(c.waiting))
	for _, l := range c.streams {
		legs = append(legs, l)
	}
	legs = append(legs, c.waiting...)
	for _, l := range legs {
		l.remoteEnded, l.localEnded = true, true
		c.removeLocked(l)
	}
	c.mu.Unlock()
	if c.driver {
		c.p.forgetDriverConn(c)
	}
	var f flusher
	for _, l := range legs {
		s := l.s
		if s.local != nil {
			s.local.cancel()
			s.finish(codes.Canceled)
			continue
		}
		if c.driver {
			s.fail(codes.Unavailable, fmt.Sprintf("csibroker proxy: driver at %s: connection lost: %v", c.p.target, describeConnErr(why)), &f)
		} else if other := s.other(l); other != nil {
			s.finish(codes.Canceled)
			other.c.resetLeg(other, http2.ErrCodeCancel)
			f.mark(other.c)
		}
	}
	f.flush()
	if !c.driver {
		c.p.closeDriverConn(c)
		c.p.forgetBrokerConn(c)
	}
}

func describeConnErr(err error) string {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return "the driver closed the connection"
	}
	return err.Error()
}

// statusFields are the fields of a trailers-only response (no headers sent
// yet) or of trailers carrying code and msg.
func statusFields(headersSent bool, code codes.Code, msg string) []hpack.HeaderField {
	f := make([]hpack.HeaderField, 0, 4)
	if !headersSent {
		f = append(f, hpack.HeaderField{Name: ":status", Value: "200"}, hpack.HeaderField{Name: "content-type", Value: "application/grpc"})
	}
	f = append(f, hpack.HeaderField{Name: "grpc-status", Value: strconv.Itoa(int(code))})
	if msg != "" {
		f = append(f, hpack.HeaderField{Name: "grpc-message", Value: rawgrpc.EncodeStatusMessage(msg)})
	}
	return f
}
