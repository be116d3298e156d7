package proxy

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"go.opentelemetry.io/otel/propagation"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/csibroker/csibroker/internal/rawgrpc"
)

// A proxy between a broker connection and a driver socket, both of them
// unix sockets whose far ends the tests drive frame by frame.

// peerTimeout bounds every wait of these tests on the proxy.
const peerTimeout = 5 * time.Second

// rec is a frame the proxy wrote, copied out of the reader's buffers.
type rec struct {
	typ    http2.FrameType
	stream uint32
	end    bool // END_STREAM
	ack    bool
	fields []hpack.HeaderField
	code   http2.ErrCode // RST_STREAM, GOAWAY
	last   uint32        // GOAWAY
	data   []byte        // PING
}

// h2peer is the far end of one of the proxy's connections: the test
// writes frames (a burst at a time) and reads what the proxy wrote.
type h2peer struct {
	t      *testing.T
	nc     net.Conn
	buf    bytes.Buffer
	w      *http2.Framer // writes to buf
	hbuf   bytes.Buffer
	enc    *hpack.Encoder
	frames chan rec // closed once the proxy closed (or shut) its end
	seen   []rec    // what next and closed read
}

func newH2Peer(t *testing.T, nc net.Conn) *h2peer {
	p := &h2peer{t: t, nc: nc, frames: make(chan rec, 256)}
	p.w = http2.NewFramer(&p.buf, nil)
	p.enc = hpack.NewEncoder(&p.hbuf)
	nc.SetReadDeadline(time.Now().Add(6 * peerTimeout)) // a backstop: no goroutine outlives the test for long
	t.Cleanup(func() { nc.Close() })
	go func() {
		defer close(p.frames)
		defer nc.Close() // the proxy's reader then sees the close
		rd := http2.NewFramer(nil, nc)
		rd.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
		for {
			f, err := rd.ReadFrame()
			if err != nil {
				return
			}
			r := rec{typ: f.Header().Type, stream: f.Header().StreamID}
			switch f := f.(type) {
			case *http2.MetaHeadersFrame:
				r.end, r.fields = f.StreamEnded(), f.Fields
			case *http2.DataFrame:
				r.end = f.StreamEnded()
			case *http2.SettingsFrame:
				r.ack = f.IsAck()
			case *http2.PingFrame:
				r.ack, r.data = f.IsAck(), bytes.Clone(f.Data[:])
			case *http2.RSTStreamFrame:
				r.code = f.ErrCode
			case *http2.GoAwayFrame:
				r.code, r.last = f.ErrCode, f.LastStreamID
			}
			p.frames <- r
		}
	}()
	return p
}

func (p *h2peer) headers(id uint32, end bool, fields ...hpack.HeaderField) {
	p.hbuf.Reset()
	for _, f := range fields {
		p.enc.WriteField(f)
	}
	p.w.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: p.hbuf.Bytes(), EndHeaders: true, EndStream: end})
}

// message writes one empty gRPC message on stream id.
func (p *h2peer) message(id uint32, end bool) { p.w.WriteData(id, end, make([]byte, 5)) }

// ping writes a PING the proxy answers once it has handled what was sent
// before it: each connection's frames are handled in order.
func (p *h2peer) ping() { p.w.WritePing(false, [8]byte{'s', 'y', 'n', 'c'}) }

// send writes what was framed since the last send in one write, so that the
// proxy reads it in one go.
func (p *h2peer) send() {
	p.t.Helper()
	if _, err := p.nc.Write(p.buf.Bytes()); err != nil {
		p.t.Fatalf("write to the proxy: %v", err)
	}
	p.buf.Reset()
}

// next reads the proxy's frames until one matches.
func (p *h2peer) next(what string, match func(rec) bool) rec {
	p.t.Helper()
	timeout := time.After(peerTimeout)
	for {
		select {
		case r, ok := <-p.frames:
			if !ok {
				p.t.Fatalf("the proxy closed the connection before %s; it wrote %v", what, p.seen)
			}
			p.seen = append(p.seen, r)
			if match(r) {
				return r
			}
		case <-timeout:
			p.t.Fatalf("no %s from the proxy after %v; it wrote %v", what, peerTimeout, p.seen)
		}
	}
}

// synced sends a PING and waits for its ACK.
func (p *h2peer) synced() {
	p.t.Helper()
	p.ping()
	p.send()
	p.next("PING ACK", func(r rec) bool { return r.typ == http2.FramePing && r.ack })
}

// closed reports whether the proxy closed (or shut) its end within
// peerTimeout, reading what it wrote until then.
func (p *h2peer) closed() bool {
	timeout := time.After(peerTimeout)
	for {
		select {
		case r, ok := <-p.frames:
			if !ok {
				return true
			}
			p.seen = append(p.seen, r)
		case <-timeout:
			return false
		}
	}
}

func isHeaders(r rec) bool { return r.typ == http2.FrameHeaders }

// relayEnv is a proxy whose driver socket the test serves.
type relayEnv struct {
	t       *testing.T
	dir     string
	p       *Proxy
	drivers chan *h2peer // the proxy's driver connections, as accepted
}

// newRelayEnv starts a driver socket whose connections send the preface
// SETTINGS given; prop, if not nil, is the proxy's propagator.
func newRelayEnv(t *testing.T, prop propagation.TextMapPropagator, settings ...http2.Setting) *relayEnv {
	dir, err := os.MkdirTemp("", "px") // short: a unix socket path has at most 107 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "d.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lis.Close() })
	p, err := New(Config{DriverEndpoint: "unix://" + sock, TLS: &tls.Config{}, Propagator: prop})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	e := &relayEnv{t: t, dir: dir, p: p, drivers: make(chan *h2peer, 8)}
	go func() {
		for {
			nc, err := lis.Accept()
			if err != nil {
				return
			}
			nc.SetReadDeadline(time.Now().Add(peerTimeout))
			preface := make([]byte, len(http2.ClientPreface))
			if _, err := io.ReadFull(nc, preface); err != nil || string(preface) != http2.ClientPreface {
				t.Errorf("the proxy's driver connection began with %q, %v", preface, err)
				nc.Close()
				return
			}
			d := newH2Peer(t, nc)
			d.w.WriteSettings(settings...)
			if _, err := nc.Write(d.buf.Bytes()); err != nil {
				t.Errorf("driver SETTINGS: %v", err)
			}
			d.buf.Reset()
			e.drivers <- d
		}
	}()
	return e
}

// broker connects a broker to the proxy as serveConn would after the TLS
// handshake and the preface; done is closed once the proxy's reader of the
// connection has returned.
func (e *relayEnv) broker() (b *h2peer, c *conn, done chan struct{}) {
	t := e.t
	b, c = e.brokerConn()
	far := b.nc
	done = make(chan struct{})
	go func() {
		defer close(done)
		c.readLoop(func(fr *http2.MetaHeadersFrame, f *flusher) { e.p.onBrokerHeaders(c, fr, f) })
	}()
	t.Cleanup(func() {
		far.Close()
		select {
		case <-done:
		case <-time.After(peerTimeout):
			t.Error("the proxy's reader of the broker connection never returned")
		}
	})
	b.w.WriteSettings()
	return b, c, done
}

// brokerConn connects a broker to the proxy, with no reader on the proxy's
// side yet.
func (e *relayEnv) brokerConn() (*h2peer, *conn) {
	t := e.t
	lis, err := net.Listen("unix", filepath.Join(e.dir, "b.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	far, err := net.Dial("unix", lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	near, err := lis.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { near.Close() })
	c := newConn(e.p, near, false, "broker")
	if err := c.start(); err != nil {
		t.Fatal(err)
	}
	e.p.bmu.Lock()
	e.p.bconns[c] = struct{}{} // as serveConn does: Close finds it
	e.p.bmu.Unlock()
	return newH2Peer(t, far), c
}

// driver is the proxy's next driver connection.
func (e *relayEnv) driver() *h2peer {
	e.t.Helper()
	select {
	case d := <-e.drivers:
		return d
	case <-time.After(peerTimeout):
		e.t.Fatal("the proxy never connected to the driver")
		return nil
	}
}

// request is the header block of a call to method.
func request(method string, extra ...hpack.HeaderField) []hpack.HeaderField {
	return append([]hpack.HeaderField{{Name: ":method", Value: "POST"}, {Name: ":scheme", Value: "https"},
		{Name: ":path", Value: method}, {Name: ":authority", Value: "proxy"},
		{Name: "content-type", Value: "application/grpc"}, {Name: "te", Value: "trailers"}}, extra...)
}

var (
	okHeaders = []hpack.HeaderField{{Name: ":status", Value: "200"}, {Name: "content-type", Value: "application/grpc"}}
	okStatus  = []hpack.HeaderField{{Name: "grpc-status", Value: "0"}}
)

const deleteVolume = "/csi.v1.Controller/DeleteVolume"

// callAtTheDriver has the broker send a DeleteVolume on stream 1 and waits
// until the whole call has reached the driver: the broker's end, the
// driver's, and the call's HEADERS there.
func (e *relayEnv) callAtTheDriver() (b, d *h2peer, call rec) {
	b, _, _ = e.broker()
	b.headers(1, false, request(deleteVolume)...)
	b.message(1, true)
	b.send()
	d = e.driver()
	call = d.next("the call", isHeaders)
	d.next("the call's end", func(r rec) bool { return r.typ == http2.FrameData && r.end })
	return b, d, call
}

// TestRelayDropsWhatABrokerSendsAfterAConnectionError: a call the broker
// sent after a frame that is a connection error (here a SETTINGS value out
// of range), in the same write, is refused with the connection: the GOAWAY
// tells the broker it was not processed, and the broker retries it
// elsewhere, so it must not reach the driver (RFC 9113, 6.8), which would
// run it twice.
func TestRelayDropsWhatABrokerSendsAfterAConnectionError(t *testing.T) {
	e := newRelayEnv(t, nil)
	b, d, first := e.callAtTheDriver()
	d.headers(first.stream, false, okHeaders...)
	d.message(first.stream, false)
	d.headers(first.stream, true, okStatus...)
	d.send()
	b.next("the first call's trailers", func(r rec) bool { return isHeaders(r) && r.stream == 1 && r.end })

	// ENABLE_PUSH 2 is a PROTOCOL_ERROR of the connection (RFC 9113, 6.5.2).
	b.w.WriteRawFrame(http2.FrameSettings, 0, 0, []byte{0, byte(http2.SettingEnablePush), 0, 0, 0, 2})
	b.headers(3, false, request(deleteVolume)...)
	b.message(3, true)
	b.send()
	ga := b.next("GOAWAY", func(r rec) bool { return r.typ == http2.FrameGoAway })
	if ga.code != http2.ErrCodeProtocol || ga.last != 1 {
		t.Errorf("GOAWAY %v, last stream %d; want PROTOCOL_ERROR, last stream 1", ga.code, ga.last)
	}
	if !b.closed() {
		t.Fatal("the broker connection stayed open after its GOAWAY")
	}
	// The driver connection closes with the broker's.
	if !d.closed() {
		t.Fatal("the driver connection stayed open after its broker connection closed")
	}
	for _, r := range d.seen {
		if isHeaders(r) && r.stream != first.stream {
			t.Errorf("the call the broker sent after the connection error (stream 3, beyond the GOAWAY's last stream) reached the driver as stream %d: %v", r.stream, r.fields)
		}
	}
}

// TestRelayClosedBrokerConnectionStartsNoCall: a call whose HEADERS are
// handled after its broker connection was closed under the reader (a
// failed write, the proxy stopping) does not reach the driver, though the
// connection's driver connection is still open.
func TestRelayClosedBrokerConnectionStartsNoCall(t *testing.T) {
	e := newRelayEnv(t, nil)
	_, bc := e.brokerConn()
	// The test is bc's reader: the first call made the driver connection.
	if _, err := e.p.driverConn(bc); err != nil {
		t.Fatal(err)
	}
	d := e.driver()
	d.synced() // the driver's SETTINGS are in
	bc.mu.Lock()
	bc.closeLocked(errors.New("a write failed"))
	bc.mu.Unlock()
	hf := frameOf(t, func(fr *http2.Framer) error {
		return fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: []byte{0x88}, EndHeaders: true, EndStream: true})
	}).(*http2.HeadersFrame)
	var f flusher
	e.p.onBrokerHeaders(bc, &http2.MetaHeadersFrame{HeadersFrame: hf, Fields: request(deleteVolume)}, &f)
	f.flush()
	d.synced() // what the proxy wrote to the driver before is read
	for _, r := range d.seen {
		if isHeaders(r) {
			t.Errorf("a call on a closed broker connection reached the driver as stream %d: %v", r.stream, r.fields)
		}
	}
}

// TestRelayDropsWhatADriverSendsAfterAConnectionError: an answer the driver
// sent after a frame that is a connection error (a PUSH_PROMISE: the proxy
// disabled push) is not relayed: the broker gets the call's end as the
// loss of the driver's connection (Unavailable), not the driver's OK.
func TestRelayDropsWhatADriverSendsAfterAConnectionError(t *testing.T) {
	e := newRelayEnv(t, nil)
	b, d, call := e.callAtTheDriver()
	d.w.WritePushPromise(http2.PushPromiseParam{StreamID: call.stream, PromiseID: 2, BlockFragment: []byte{0x88}, EndHeaders: true})
	d.headers(call.stream, true, append(okHeaders, okStatus...)...)
	d.send()
	end := b.next("the call's end", func(r rec) bool {
		return r.stream == 1 && (isHeaders(r) && r.end || r.typ == http2.FrameRSTStream)
	})
	if got := headerValue(end.fields, "grpc-status"); end.typ != http2.FrameHeaders || got != "14" {
		t.Errorf("the call ended with %v grpc-status %q (%v); want trailers with grpc-status 14 (Unavailable): the driver's answer came after its connection error",
			end.typ, got, end.fields)
	}
	if !d.closed() {
		t.Fatal("the driver connection stayed open after its connection error")
	}
	var goAway bool
	for _, r := range d.seen {
		goAway = goAway || r.typ == http2.FrameGoAway && r.code == http2.ErrCodeProtocol
	}
	if !goAway {
		t.Errorf("the driver got no GOAWAY PROTOCOL_ERROR; it got %v", d.seen)
	}
}

// TestRelayRetiringDriverConnectionCloses: a driver connection that
// retires (its stream IDs nearly used up) while calls wait on it for a
// stream slot (the driver allows none) closes once those calls are gone:
// reset by the broker, or ended with the broker's connection or the proxy.
func TestRelayRetiringDriverConnectionCloses(t *testing.T) {
	for _, how := range []string{"the broker resets the queued call", "the broker's connection drops", "the proxy closes"} {
		t.Run(how, func(t *testing.T) {
			e := newRelayEnv(t, nil, http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: 0})
			b, bc, _ := e.broker()
			b.headers(1, false, request(deleteVolume)...)
			b.message(1, true)
			b.synced()
			old := e.driver()
			e.p.dmu.Lock()
			dc := bc.dconn
			e.p.dmu.Unlock()
			dc.mu.Lock()
			dc.nextID = rawgrpc.LastStreamID - rawgrpc.StreamIDMargin + 2
			dc.mu.Unlock()
			// The next call finds the stream IDs nearly used up: it goes to
			// a new connection, and the old one retires with its call
			// still waiting for a slot.
			b.headers(3, false, request(deleteVolume)...)
			b.message(3, true)
			b.synced()
			cur := e.driver()
			dc.mu.Lock()
			retiring, waiting := dc.retiring, len(dc.waiting)
			dc.mu.Unlock()
			if !retiring || waiting != 1 {
				t.Fatalf("old driver connection: retiring %v with %d calls waiting, want true with 1", retiring, waiting)
			}
			switch how {
			case "the broker resets the queued call":
				b.w.WriteRSTStream(1, http2.ErrCodeCancel)
				b.send()
			case "the broker's connection drops":
				b.nc.Close()
			case "the proxy closes":
				e.p.Close()
			}
			if !old.closed() {
				t.Fatalf("%s: the retiring driver connection stayed open with no call left on it", how)
			}
			if how != "the broker resets the queued call" && !cur.closed() {
				t.Fatalf("%s: the current driver connection stayed open", how)
			}
		})
	}
}

// slowPropagator takes delay to extract the trace context of a call that
// has the field slowField: time the proxy spends on a call before it
// queues it (in production, mostly a dial of the driver).
type slowPropagator struct {
	propagation.TextMapPropagator
	delay time.Duration
}

const slowField = "x-test-slow"

func (s slowPropagator) Extract(ctx context.Context, carrier propagation.TextMapCarrier) context.Context {
	if carrier.Get(slowField) != "" {
		time.Sleep(s.delay)
	}
	return s.TextMapPropagator.Extract(ctx, carrier)
}

// TestRelayQueuedCallTimeoutCountsFromItsArrival: a call that waits for a
// stream slot of the driver's reaches it with a grpc-timeout shortened by
// all the time since the call arrived, not only by the time it spent
// queued: what the proxy did before it queued the call counts too.
func TestRelayQueuedCallTimeoutCountsFromItsArrival(t *testing.T) {
	const delay, timeout = 300 * time.Millisecond, 10 * time.Second
	e := newRelayEnv(t, slowPropagator{propagation.TraceContext{}, delay}, http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: 1})
	b, _, _ := e.broker()
	b.headers(1, false, request(deleteVolume)...)
	b.message(1, true)
	b.send()
	d := e.driver()
	first := d.next("the first call", isHeaders)
	// The driver holds its one slot: the second call queues.
	sent := time.Now()
	b.headers(3, false, request(deleteVolume,
		hpack.HeaderField{Name: "grpc-timeout", Value: rawgrpc.EncodeTimeout(timeout)},
		hpack.HeaderField{Name: slowField, Value: "1"})...)
	b.message(3, true)
	b.synced()
	d.headers(first.stream, true, append(okHeaders, okStatus...)...)
	d.send()
	second := d.next("the queued call", func(r rec) bool { return isHeaders(r) && r.stream != first.stream })
	elapsed := time.Since(sent)
	left, err := rawgrpc.ParseTimeout(headerValue(second.fields, "grpc-timeout"))
	if err != nil {
		t.Fatal(err)
	}
	// (EncodeTimeout rounds up, to the microsecond here.)
	if left > timeout-delay+time.Millisecond || left < timeout-elapsed-time.Millisecond {
		t.Fatalf("the queued call reached the driver with grpc-timeout %v; want at most %v (the %v the proxy took before it queued the call counts) and at least %v",
			left, timeout-delay, delay, timeout-elapsed)
	}
}
