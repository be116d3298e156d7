package proxy

import (
	"bytes"
	"io"
	"log/slog"
	"net"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/csibroker/csibroker/internal/rawgrpc"
)

// A driver connection's write side, driven directly: what the proxy writes
// is read back frame by frame.

// frameOf builds a frame as a peer would send it.
func frameOf(t *testing.T, write func(*http2.Framer) error) http2.Frame {
	t.Helper()
	f, err := makeFrame(write)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// makeFrame is frameOf for goroutines other than the test's.
func makeFrame(write func(*http2.Framer) error) (http2.Frame, error) {
	var b bytes.Buffer
	fr := http2.NewFramer(&b, &b)
	if err := write(fr); err != nil {
		return nil, err
	}
	return fr.ReadFrame()
}

// readFrames reads what the proxy wrote until its end of the pipe closes.
// A net.Pipe write returns only once read, so what the proxy wrote before
// the test closes its end is all read.
func readFrames(rd *http2.Framer) []http2.Frame {
	var out []http2.Frame
	for {
		f, err := rd.ReadFrame()
		if err != nil {
			return out
		}
		out = append(out, f)
	}
}

// TestEmptyDataFrameOnANegativeWindow: a driver that lowers its initial
// window below what a stream has already sent leaves that stream's window
// negative; the caller's empty END_STREAM DATA frame (a half-close) must
// still go out, not crash the proxy.
func TestEmptyDataFrameOnANegativeWindow(t *testing.T) {
	a, b := net.Pipe()
	t.Cleanup(func() { a.Close(); b.Close() })
	p := &Proxy{log: slog.New(slog.DiscardHandler), target: "unix:///driver.sock"}
	c := newConn(p, a, true, "driver")
	frames := make(chan http2.Frame, 16)
	go func() {
		rd := http2.NewFramer(nil, b)
		for {
			f, err := rd.ReadFrame()
			if err != nil {
				close(frames)
				return
			}
			if d, ok := f.(*http2.DataFrame); ok {
				cp, err := makeFrame(func(fr *http2.Framer) error { return fr.WriteData(d.StreamID, d.StreamEnded(), bytes.Clone(d.Data())) })
				if err != nil {
					close(frames) // the test sees too few frames
					return
				}
				frames <- cp
			}
		}
	}()
	c.onSettings(frameOf(t, func(fr *http2.Framer) error { return fr.WriteSettings() }).(*http2.SettingsFrame), nil)
	l := &leg{c: c, s: &stream{p: p}}
	c.mu.Lock()
	c.openLocked(l)
	c.writeLocked(l, out{isData: true, data: make([]byte, 60000)}, nil)
	c.flushLocked()
	c.mu.Unlock()
	c.onSettings(frameOf(t, func(fr *http2.Framer) error {
		return fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1000})
	}).(*http2.SettingsFrame), nil)
	if l.sendWin >= 0 {
		t.Fatalf("stream window %d after the driver lowered it, want negative", l.sendWin)
	}
	c.mu.Lock()
	c.sendLocked(l, out{isData: true, end: true}, nil)
	c.flushLocked()
	c.mu.Unlock()
	var n int
	timeout := time.After(5 * time.Second)
	for {
		select {
		case f := <-frames:
			d := f.(*http2.DataFrame)
			n += len(d.Data())
			if d.StreamEnded() {
				if n != 60000 {
					t.Fatalf("%d bytes before END_STREAM, want 60000", n)
				}
				return
			}
		case <-timeout:
			t.Fatal("the half-close never went out")
		}
	}
}

// TestQueuedLegsWaitAfterGoAwayAndGoOutWhenOpened: a leg queued behind the
// driver's stream limit is written and flushed as soon as a slot frees,
// with no other write to carry it. After a GOAWAY that refuses the open
// stream (last stream 0), no queued leg is opened as that stream is
// removed: it fails with the GOAWAY instead. A connection whose stream IDs
// are nearly used up takes no new call, but the legs already queued on it
// still open there (there are IDs left for them) and it closes after them.
func TestQueuedLegsWaitAfterGoAwayAndGoOutWhenOpened(t *testing.T) {
	for _, mode := range []string{"slot frees", "GOAWAY", "stream IDs nearly used up"} {
		goAway := mode == "GOAWAY"
		a, b := net.Pipe()
		p := &Proxy{log: slog.New(slog.DiscardHandler), target: "unix:///driver.sock"}
		d := newConn(p, a, true, "driver")
		ba, bb := net.Pipe()
		t.Cleanup(func() { a.Close(); b.Close(); ba.Close(); bb.Close() })
		go io.Copy(io.Discard, bb)
		bc := newConn(p, ba, false, "broker")
		d.onSettings(frameOf(t, func(fr *http2.Framer) error {
			return fr.WriteSettings(http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: 1})
		}).(*http2.SettingsFrame), nil)
		mk := func(bid uint32) *leg {
			s := &stream{p: p}
			s.b = &leg{c: bc, id: bid, s: s, sendWin: 65535}
			bc.streams[bid] = s.b
			s.d = &leg{c: d, s: s}
			return s.d
		}
		hdr := out{fields: []hpack.HeaderField{{Name: ":method", Value: "POST"}, {Name: ":path", Value: "/csi.v1.Identity/Probe"}}}
		first, second := mk(1), mk(3)
		rd := http2.NewFramer(nil, b)
		rd.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
		got := make(chan []http2.Frame, 1)
		go func() { got <- readFrames(rd) }()
		d.mu.Lock()
		d.openLocked(first)
		d.writeLocked(first, hdr, nil)
		if d.openLocked(second) {
			t.Fatal("a second stream opened beyond the driver's limit of 1")
		}
		second.pending = append(second.pending, hdr)
		d.flushLocked()
		d.mu.Unlock()
		var idsLow uint32
		if mode == "stream IDs nearly used up" {
			d.mu.Lock()
			idsLow = rawgrpc.LastStreamID - rawgrpc.StreamIDMargin + 2
			d.nextID = idsLow
			d.mu.Unlock()
			bc.dconn = d
			// The next call finds the IDs nearly used up and dials a new
			// connection (there is no driver at the target: that fails).
			if nc, err := p.driverConn(bc); err == nil {
				t.Fatalf("%s: the next call went to %v, want a dial of a new connection", mode, nc)
			}
		}
		if goAway {
			var f flusher
			d.onGoAway(frameOf(t, func(fr *http2.Framer) error { return fr.WriteGoAway(0, http2.ErrCodeNo, nil) }).(*http2.GoAwayFrame), &f)
			f.flush()
		}
		// Without GOAWAY, the driver answers the first call whole: its slot
		// frees. Nothing else is written or flushed here.
		d.mu.Lock()
		first.localEnded, first.remoteEnded = true, true
		d.removeLocked(first)
		closedEarly := d.closed || d.shut.Load()
		if idsLow != 0 && second.id == idsLow {
			second.localEnded, second.remoteEnded = true, true
			d.removeLocked(second)
		}
		closedAfter := d.closed || d.shut.Load()
		d.mu.Unlock()
		a.Close()
		frames := <-got
		b.Close()
		var streams []uint32
		for _, f := range frames {
			if h, ok := f.(*http2.MetaHeadersFrame); ok {
				streams = append(streams, h.StreamID)
			}
		}
		switch {
		case mode == "slot frees" && (len(streams) != 2 || streams[1] != 3):
			t.Errorf("%s: HEADERS written on streams %v, want [1 3] (the queued call flushed once the slot freed)", mode, streams)
		case goAway && len(streams) != 1:
			t.Errorf("%s: HEADERS written on streams %v, want only [1]", mode, streams)
		case goAway && second.id != 0:
			t.Errorf("%s: the queued leg got stream %d", mode, second.id)
		case idsLow != 0 && (len(streams) != 2 || streams[1] != idsLow):
			t.Errorf("%s: HEADERS written on streams %v, want [1 %d] (the queued call opened on the old connection)", mode, streams, idsLow)
		case idsLow != 0 && (closedEarly || !closedAfter):
			t.Errorf("%s: closed while a queued call was left: %v; closed once none was: %v; want false, true", mode, closedEarly, closedAfter)
		}
	}
}

// TestSecondHeaderBlockFromTheDriverFailsTheCall: a driver that sends a
// second header block before its trailers (a malformed answer, which
// gRPC's client fails) has its stream reset, and the broker gets the
// call's end as Internal, not the block: however many a misbehaving
// driver sends, none is passed on or queued.
func TestSecondHeaderBlockFromTheDriverFailsTheCall(t *testing.T) {
	a, b := net.Pipe()
	ba, bb := net.Pipe()
	t.Cleanup(func() { a.Close(); b.Close(); ba.Close(); bb.Close() })
	p := &Proxy{log: slog.New(slog.DiscardHandler), target: "/driver.sock"}
	d := newConn(p, a, true, "driver")
	bc := newConn(p, ba, false, "broker")
	d.onSettings(frameOf(t, func(fr *http2.Framer) error { return fr.WriteSettings() }).(*http2.SettingsFrame), nil)
	s := &stream{p: p}
	s.b = &leg{c: bc, id: 1, s: s, sendWin: 65535, remoteEnded: true}
	bc.streams[1] = s.b
	s.d = &leg{c: d, s: s, localEnded: true}
	d.mu.Lock()
	d.openLocked(s.d)
	d.mu.Unlock()
	collect := func(nc net.Conn) chan []http2.Frame {
		rd := http2.NewFramer(nil, nc)
		rd.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
		got := make(chan []http2.Frame, 1)
		go func() { got <- readFrames(rd) }()
		return got
	}
	toDriver, toBroker := collect(b), collect(bb)
	hdr := &http2.MetaHeadersFrame{
		HeadersFrame: frameOf(t, func(fr *http2.Framer) error {
			return fr.WriteHeaders(http2.HeadersFrameParam{StreamID: s.d.id, BlockFragment: []byte{0x88}, EndHeaders: true})
		}).(*http2.HeadersFrame),
		Fields: []hpack.HeaderField{{Name: ":status", Value: "200"}, {Name: "content-type", Value: "application/grpc"}},
	}
	for i := 0; i < 3; i++ {
		var f flusher
		p.onDriverHeaders(d, hdr, &f)
		f.flush()
	}
	a.Close()
	ba.Close()
	var brokerHeaders []*http2.MetaHeadersFrame
	for _, f := range <-toBroker {
		if h, ok := f.(*http2.MetaHeadersFrame); ok {
			brokerHeaders = append(brokerHeaders, h)
		}
	}
	var reset bool
	for _, f := range <-toDriver {
		if r, ok := f.(*http2.RSTStreamFrame); ok && r.StreamID == s.d.id {
			reset = true
		}
	}
	if len(brokerHeaders) != 2 || !brokerHeaders[1].StreamEnded() || brokerHeaders[1].PseudoValue("status") != "" ||
		headerValue(brokerHeaders[1].Fields, "grpc-status") != "13" {
		t.Fatalf("the broker got %d header blocks %v, want the response headers and then trailers with grpc-status 13", len(brokerHeaders), brokerHeaders)
	}
	if !reset {
		t.Error("the driver's stream was not reset")
	}
}

func headerValue(fields []hpack.HeaderField, name string) string {
	for _, f := range fields {
		if f.Name == name {
			return f.Value
		}
	}
	return ""
}
