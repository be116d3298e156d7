package proxy

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc/codes"

	"github.com/csibroker/csibroker/internal/rawgrpc"
)

// The proxy relays HTTP/2 frames between the broker's connections (the proxy
// is their server, over mTLS) and the driver's socket (the proxy is its
// client). A call's frames are read by one connection's reader goroutine and
// written straight to the other connection: no gRPC stream, no message
// decoding, no hand-off to another goroutine. Each side keeps its own stream
// IDs, header compression state and flow-control windows; the proxy credits
// the sender only for bytes it has passed on, so what it buffers for a slow
// receiver is bounded by the windows it advertises.

const (
	// Our receive windows, as advertised to both sides.
	streamWindow = rawgrpc.StreamWindow
	connWindow   = rawgrpc.ConnWindow
	// Frames we read are at most this large (the HTTP/2 default, which every
	// peer must accept, so any frame we read can be written on unchanged).
	readFrameSize = 16 << 10
	// initialWindow is HTTP/2's initial window before SETTINGS say otherwise.
	initialWindow = 65535
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
	id          uint32 // 0 until the stream is opened on c
	sendWin     int64  // what the peer lets us send on this stream
	unacked     uint32 // bytes read on this leg and passed on, not yet credited back
	remoteEnded bool   // the peer sent END_STREAM
	localEnded  bool   // we sent END_STREAM
	sentHeaders bool   // we sent the first HEADERS (for the broker leg: response headers)
	done        bool   // removed from c.streams
	pending     []out
	blocked     bool // in c.blocked
	waitingOpen bool // in c.waiting
}

// conn is one HTTP/2 connection: to the broker (server side) or to the
// driver (client side).
type conn struct {
	p      *Proxy
	nc     net.Conn
	driver bool
	fr     *http2.Framer
	br     *bufio.Reader
	bw     *bufio.Writer
	desc   string // for log lines and errors

	mu         sync.Mutex
	enc        *hpack.Encoder
	hbuf       bytes.Buffer
	streams    map[uint32]*leg
	sendWin    int64  // connection-level window the peer grants
	initWin    int64  // the peer's SETTINGS_INITIAL_WINDOW_SIZE
	maxFrame   uint32 // the peer's SETTINGS_MAX_FRAME_SIZE
	maxStreams uint32 // the peer's SETTINGS_MAX_CONCURRENT_STREAMS
	unacked    uint32 // connection-level bytes passed on, not yet credited back
	nextID     uint32 // driver side: next stream ID to open
	lastID     uint32 // broker side: highest stream ID opened by the broker
	active     int    // driver side: open streams, counted against maxStreams
	waiting    []*leg // driver side: legs waiting for a stream slot
	blocked    []*leg // legs with pending frames
	needFlush  bool
	goingAway  bool // no new streams on this connection
	closed     bool
	closeErr   error
	draining   bool // broker side: GOAWAY sent, close when idle
}

func newConn(p *Proxy, nc net.Conn, driver bool, desc string) *conn {
	c := &conn{p: p, nc: nc, driver: driver, desc: desc,
		br:      bufio.NewReaderSize(nc, bufSize),
		bw:      bufio.NewWriterSize(nc, bufSize),
		streams: map[uint32]*leg{},
		sendWin: initialWindow, initWin: initialWindow, maxFrame: readFrameSize, maxStreams: ^uint32(0),
		nextID: 1,
	}
	c.fr = http2.NewFramer(c.bw, c.br)
	c.fr.SetMaxReadFrameSize(readFrameSize)
	c.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	c.enc = hpack.NewEncoder(&c.hbuf)
	return c
}

// start writes our half of the connection preface: the client preface
// (driver side), our SETTINGS and the connection window.
func (c *conn) start() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.driver {
		if _, err := c.bw.WriteString(http2.ClientPreface); err != nil {
			return err
		}
	}
	settings := []http2.Setting{{ID: http2.SettingInitialWindowSize, Val: streamWindow}}
	if c.driver {
		settings = append(settings, http2.Setting{ID: http2.SettingEnablePush, Val: 0})
	}
	if err := c.fr.WriteSettings(settings...); err != nil {
		return err
	}
	if err := c.fr.WriteWindowUpdate(0, connWindow-initialWindow); err != nil {
		return err
	}
	return c.bw.Flush()
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
		if err := c.bw.Flush(); err != nil {
			c.closeLocked(err)
		}
	}
	c.needFlush = false
}

// closeLocked marks the connection closed and closes the socket; the reader
// goroutine then fails every stream left on it.
func (c *conn) closeLocked(err error) {
	if c.closed {
		return
	}
	c.closed, c.closeErr = true, err
	c.nc.Close()
}

func (c *conn) writeErr(err error) {
	if err != nil {
		c.closeLocked(err)
	}
}

// writeHeadersLocked encodes fields and writes them as HEADERS (+
// CONTINUATION) on stream id.
func (c *conn) writeHeadersLocked(id uint32, fields []hpack.HeaderField, end bool) {
	c.hbuf.Reset()
	for _, f := range fields {
		c.enc.WriteField(f)
	}
	block := c.hbuf.Bytes()
	max := int(c.maxFrame)
	first := block
	if len(first) > max {
		first = block[:max]
	}
	c.writeErr(c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: first, EndStream: end, EndHeaders: len(first) == len(block)}))
	for rest := block[len(first):]; len(rest) > 0; {
		n := min(len(rest), max)
		c.writeErr(c.fr.WriteContinuation(id, n == len(rest), rest[:n]))
		rest = rest[n:]
	}
	c.needFlush = true
}

// credit is a number of bytes to credit back to the peer of a leg.
type credit struct {
	l *leg
	n uint32
}

// sendLocked writes o on l, or queues it behind earlier frames or until the
// windows allow. It returns the bytes of DATA written, to credit back to
// o.from's connection.
func (c *conn) sendLocked(l *leg, o out, credits []credit) []credit {
	if l.done || l.localEnded || c.closed {
		// The stream is gone on this side: what was read is dropped, and
		// credited so the sender's connection window does not shrink.
		if o.isData && o.from != nil && len(o.data) > 0 {
			credits = append(credits, credit{o.from, uint32(len(o.data))})
		}
		return credits
	}
	if len(l.pending) > 0 || l.id == 0 {
		if o.isData {
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
		n := int64(len(data))
		n = min(n, c.sendWin, l.sendWin, int64(c.maxFrame))
		if n < 0 {
			n = 0
		}
		if n == 0 && len(data) > 0 {
			break
		}
		last := n == int64(len(data))
		c.writeErr(c.fr.WriteData(l.id, last && o.end, data[:n]))
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
			// Put back, partly written: out of window.
			return credits
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

// endedLocked notes that we sent END_STREAM on l.
func (c *conn) endedLocked(l *leg) {
	l.localEnded = true
	if !l.remoteEnded && !c.driver {
		// As a gRPC server does: the call is over, so the caller may stop
		// sending.
		c.writeErr(c.fr.WriteRSTStream(l.id, http2.ErrCodeNo))
		l.remoteEnded = true
	}
	if l.remoteEnded {
		c.removeLocked(l)
	}
}

// removeLocked forgets a finished leg.
func (c *conn) removeLocked(l *leg) {
	if l.done {
		return
	}
	l.done = true
	l.pending = nil
	if l.id != 0 {
		delete(c.streams, l.id)
	}
	if c.driver && l.id != 0 {
		c.active--
		c.openWaitingLocked()
	}
	if c.goingAway && len(c.streams) == 0 && c.driver {
		c.closeLocked(errors.New("driver connection drained"))
	}
	if c.draining && len(c.streams) == 0 {
		c.flushLocked()
		c.closeLocked(errors.New("connection drained"))
	}
}

// openLocked gives a driver leg its stream ID now, or queues it while the
// driver's concurrent-stream limit is reached.
func (c *conn) openLocked(l *leg) bool {
	if uint32(c.active) >= c.maxStreams {
		l.waitingOpen = true
		c.waiting = append(c.waiting, l)
		return false
	}
	l.id = c.nextID
	c.nextID += 2
	c.active++
	l.sendWin = c.initWin
	c.streams[l.id] = l
	return true
}

func (c *conn) openWaitingLocked() {
	for len(c.waiting) > 0 && uint32(c.active) < c.maxStreams && !c.closed {
		l := c.waiting[0]
		c.waiting = c.waiting[1:]
		l.waitingOpen = false
		if l.done {
			continue
		}
		c.openLocked(l)
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

// creditLocked returns n bytes of window for l's stream and connection,
// in updates of at least a quarter window.
func (c *conn) creditLocked(l *leg, n uint32) {
	if c.closed {
		return
	}
	c.unacked += n
	if c.unacked >= connWindow/4 {
		c.writeErr(c.fr.WriteWindowUpdate(0, c.unacked))
		c.unacked = 0
		c.needFlush = true
	}
	if l.done || l.remoteEnded {
		return
	}
	l.unacked += n
	if l.unacked >= streamWindow/4 {
		c.writeErr(c.fr.WriteWindowUpdate(l.id, l.unacked))
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
		fr, err := c.fr.ReadFrame()
		if err != nil {
			var se http2.StreamError
			if errors.As(err, &se) {
				// A malformed frame on one stream: reset it on both legs.
				c.mu.Lock()
				c.writeErr(c.fr.WriteRSTStream(se.StreamID, se.Code))
				c.needFlush = true
				c.mu.Unlock()
				f.mark(c)
				c.streamReset(se.StreamID, se.Code, &f)
				continue
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
			credits = c.onWindowUpdate(fr, credits)
			f.mark(c)
		case *http2.PingFrame:
			if !fr.IsAck() {
				c.mu.Lock()
				c.writeErr(c.fr.WritePing(true, fr.Data))
				c.needFlush = true
				c.mu.Unlock()
				f.mark(c)
			}
		case *http2.GoAwayFrame:
			c.onGoAway(fr, &f)
		}
		applyCredits(credits, &f)
		if c.br.Buffered() == 0 {
			f.flush()
		}
	}
}

// onData passes a DATA frame on to the other leg of its stream.
func (c *conn) onData(fr *http2.DataFrame, credits []credit, f *flusher) []credit {
	c.mu.Lock()
	l := c.streams[fr.StreamID]
	// Padding is never passed on: credit it now.
	pad := fr.Length - uint32(len(fr.Data()))
	if l == nil {
		// A stream already finished here: its bytes still count against
		// the connection window.
		if fr.Length > 0 {
			c.unacked += fr.Length
			if c.unacked >= connWindow/4 {
				c.writeErr(c.fr.WriteWindowUpdate(0, c.unacked))
				c.unacked = 0
				c.needFlush = true
				f.mark(c)
			}
		}
		c.mu.Unlock()
		return credits
	}
	if pad > 0 {
		credits = append(credits, credit{l, pad})
	}
	end := fr.StreamEnded()
	if end {
		l.remoteEnded = true
		if l.localEnded {
			c.removeLocked(l)
		}
	}
	s := l.s
	c.mu.Unlock()

	if s.local != nil {
		// A call the proxy answers itself: keep the request.
		credits = append(credits, credit{l, uint32(len(fr.Data()))})
		s.local.add(fr.Data(), end)
		return credits
	}
	other := s.other(l)
	if other == nil {
		credits = append(credits, credit{l, uint32(len(fr.Data()))})
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
		s.finish(rstCode(code))
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
	if l.id == 0 {
		// Still waiting for a stream slot: never opened.
		l.done = true
		return
	}
	c.writeErr(c.fr.WriteRSTStream(l.id, code))
	c.needFlush = true
	l.localEnded, l.remoteEnded = true, true
	c.removeLocked(l)
}

func (c *conn) onSettings(fr *http2.SettingsFrame, credits []credit) []credit {
	if fr.IsAck() {
		return credits
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	fr.ForeachSetting(func(s http2.Setting) error {
		switch s.ID {
		case http2.SettingInitialWindowSize:
			delta := int64(s.Val) - c.initWin
			c.initWin = int64(s.Val)
			for _, l := range c.streams {
				l.sendWin += delta
				if len(l.pending) > 0 {
					c.markBlocked(l)
				}
			}
		case http2.SettingMaxFrameSize:
			c.maxFrame = s.Val
		case http2.SettingMaxConcurrentStreams:
			c.maxStreams = s.Val
		case http2.SettingHeaderTableSize:
			c.enc.SetMaxDynamicTableSizeLimit(s.Val)
		}
		return nil
	})
	c.writeErr(c.fr.WriteSettingsAck())
	c.needFlush = true
	if c.driver {
		c.openWaitingLocked()
	}
	return c.drainBlockedLocked(credits)
}

func (c *conn) onWindowUpdate(fr *http2.WindowUpdateFrame, credits []credit) []credit {
	c.mu.Lock()
	defer c.mu.Unlock()
	if fr.StreamID == 0 {
		c.sendWin += int64(fr.Increment)
		return c.drainBlockedLocked(credits)
	}
	l := c.streams[fr.StreamID]
	if l == nil {
		return credits
	}
	l.sendWin += int64(fr.Increment)
	return c.drainLocked(l, credits)
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
		c.waiting = nil
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
	c.nc.Close()
	legs := make([]*leg, 0, len(c.streams)+len(c.waiting))
	for _, l := range c.streams {
		legs = append(legs, l)
	}
	legs = append(legs, c.waiting...)
	c.waiting = nil
	for _, l := range legs {
		l.remoteEnded, l.localEnded = true, true
		c.removeLocked(l)
	}
	c.mu.Unlock()
	if c.driver {
		c.p.dropDriverConn(c)
	} else {
		c.p.forgetBrokerConn(c)
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
}

func describeConnErr(err error) string {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return "the driver closed the connection"
	}
	return err.Error()
}

// rstCode is the status gRPC gives a stream reset with code.
func rstCode(code http2.ErrCode) codes.Code {
	switch code {
	case http2.ErrCodeRefusedStream:
		return codes.Unavailable
	case http2.ErrCodeCancel:
		return codes.Canceled
	case http2.ErrCodeEnhanceYourCalm:
		return codes.ResourceExhausted
	case http2.ErrCodeInadequateSecurity:
		return codes.PermissionDenied
	}
	return codes.Internal
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
		f = append(f, hpack.HeaderField{Name: "grpc-message", Value: encodeGRPCMessage(msg)})
	}
	return f
}

// encodeGRPCMessage percent-encodes a status message as gRPC's wire format
// requires.
func encodeGRPCMessage(msg string) string {
	var b strings.Builder
	for i := 0; i < len(msg); i++ {
		ch := msg[i]
		if ch >= 0x20 && ch <= 0x7e && ch != '%' {
			b.WriteByte(ch)
			continue
		}
		fmt.Fprintf(&b, "%%%02X", ch)
	}
	return b.String()
}
