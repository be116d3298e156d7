package chain

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/chaintest"
)

// The front end's per-connection memory budget: what it holds of requests
// beyond the stream windows, and how it says no.

// flowPeer is a raw HTTP/2 client of the front end that keeps to the
// windows the front end gives it, and records what it sends back.
type flowPeer struct {
	fr   *http2.Framer
	enc  *hpack.Encoder
	hbuf bytes.Buffer

	mu        sync.Mutex
	cond      *sync.Cond
	initWin   int64 // the front end's SETTINGS_INITIAL_WINDOW_SIZE, 0 before its SETTINGS
	connWin   int64
	streamWin map[uint32]int64
	credited  map[uint32]int64 // WINDOW_UPDATE increments received per stream
	frames    []http2.Frame    // HEADERS, RST_STREAM, GOAWAY and PING frames received
	gone      bool             // the connection ended
	pings     uint64
}

func dialFlowFront(t *testing.T, c *chaintest.Chain) *flowPeer {
	t.Helper()
	nc, err := net.Dial("unix", c.Front)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nc.Close() })
	if _, err := nc.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	p := &flowPeer{fr: http2.NewFramer(nc, nc), connWin: 65535, streamWin: map[uint32]int64{}, credited: map[uint32]int64{}}
	p.cond = sync.NewCond(&p.mu)
	p.enc = hpack.NewEncoder(&p.hbuf)
	p.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	if err := p.fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	go p.read()
	// The front end's SETTINGS and its connection window come first.
	p.await(t, "the front end's SETTINGS and connection window", func() bool { return p.initWin > 0 && p.connWin > 65535 })
	return p
}

func (p *flowPeer) read() {
	for {
		f, err := p.fr.ReadFrame()
		p.mu.Lock()
		if err != nil {
			p.gone = true
			p.cond.Broadcast()
			p.mu.Unlock()
			return
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if v, ok := f.Value(http2.SettingInitialWindowSize); ok && !f.IsAck() {
				p.initWin = int64(v)
			}
		case *http2.WindowUpdateFrame:
			if f.StreamID == 0 {
				p.connWin += int64(f.Increment)
			} else {
				p.streamWin[f.StreamID] += int64(f.Increment)
				p.credited[f.StreamID] += int64(f.Increment)
			}
		case *http2.MetaHeadersFrame, *http2.RSTStreamFrame, *http2.GoAwayFrame, *http2.PingFrame:
			p.frames = append(p.frames, f)
		}
		p.cond.Broadcast()
		p.mu.Unlock()
	}
}

// await waits (at most 10 s) until ok holds; ok runs with p.mu held.
func (p *flowPeer) await(t *testing.T, what string, ok func() bool) {
	t.Helper()
	expired := false
	timer := time.AfterFunc(10*time.Second, func() {
		p.mu.Lock()
		expired = true
		p.cond.Broadcast()
		p.mu.Unlock()
	})
	defer timer.Stop()
	p.mu.Lock()
	defer p.mu.Unlock()
	for !ok() {
		if expired || p.gone {
			t.Fatalf("waited in vain for %s (connection gone: %v)", what, p.gone)
		}
		p.cond.Wait()
	}
}

// frame waits for a received frame ok accepts and returns it.
func (p *flowPeer) frame(t *testing.T, what string, ok func(http2.Frame) bool) http2.Frame {
	t.Helper()
	var found http2.Frame
	p.await(t, what, func() bool {
		for _, f := range p.frames {
			if ok(f) {
				found = f
				return true
			}
		}
		return false
	})
	return found
}

// open sends the HEADERS of a call of path on stream id, with a
// grpc-timeout if timeout is not empty.
func (p *flowPeer) open(t *testing.T, id uint32, path, timeout string) {
	t.Helper()
	p.hbuf.Reset()
	fields := []hpack.HeaderField{{Name: ":method", Value: "POST"}, {Name: ":scheme", Value: "http"}, {Name: ":path", Value: path},
		{Name: ":authority", Value: "front"}, {Name: "content-type", Value: "application/grpc"}, {Name: "te", Value: "trailers"}}
	if timeout != "" {
		fields = append(fields, hpack.HeaderField{Name: "grpc-timeout", Value: timeout})
	}
	for _, f := range fields {
		p.enc.WriteField(f)
	}
	p.mu.Lock()
	p.streamWin[id] = p.initWin
	p.mu.Unlock()
	if err := p.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: p.hbuf.Bytes(), EndHeaders: true}); err != nil {
		t.Fatal(err)
	}
}

// send writes data on stream id within the windows, waiting (at most 10 s
// for each frame) for the front end to open them.
func (p *flowPeer) send(t *testing.T, id uint32, data []byte, end bool) {
	t.Helper()
	for {
		var n int
		if len(data) > 0 {
			p.await(t, fmt.Sprintf("window to send the %d bytes left on stream %d (credited so far: %d)", len(data), id, p.creditedTo(id)),
				func() bool { return p.connWin > 0 && p.streamWin[id] > 0 })
			p.mu.Lock()
			n = int(min(int64(len(data)), 16<<10, p.connWin, p.streamWin[id]))
			p.connWin -= int64(n)
			p.streamWin[id] -= int64(n)
			p.mu.Unlock()
		}
		last := n == len(data)
		if err := p.fr.WriteData(id, end && last, data[:n]); err != nil {
			t.Fatal(err)
		}
		if data = data[n:]; last {
			return
		}
	}
}

func (p *flowPeer) creditedTo(id uint32) int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.credited[id]
}

// sync returns once the front end has handled every frame sent before:
// it answers a PING in order, after the WINDOW_UPDATEs those frames earned.
func (p *flowPeer) sync(t *testing.T) {
	t.Helper()
	p.mu.Lock()
	p.pings++
	var data [8]byte
	binary.BigEndian.PutUint64(data[:], p.pings)
	p.mu.Unlock()
	if err := p.fr.WritePing(false, data); err != nil {
		t.Fatal(err)
	}
	p.frame(t, "the PING's ack", func(f http2.Frame) bool {
		pf, ok := f.(*http2.PingFrame)
		return ok && pf.IsAck() && pf.Data == data
	})
}

// uncredited fails unless the front end has returned none of stream id's
// window.
func (p *flowPeer) uncredited(t *testing.T, id uint32, why string) {
	t.Helper()
	p.sync(t)
	if n := p.creditedTo(id); n != 0 {
		t.Fatalf("stream %d: %d bytes credited, want none: %s", id, n, why)
	}
}

func (p *flowPeer) rst(t *testing.T, id uint32) {
	t.Helper()
	if err := p.fr.WriteRSTStream(id, http2.ErrCodeCancel); err != nil {
		t.Fatal(err)
	}
}

func isRST(id uint32, code http2.ErrCode) func(http2.Frame) bool {
	return func(f http2.Frame) bool {
		r, ok := f.(*http2.RSTStreamFrame)
		return ok && r.StreamID == id && r.ErrCode == code
	}
}

func isTrailers(id uint32) func(http2.Frame) bool {
	return func(f http2.Frame) bool {
		h, ok := f.(*http2.MetaHeadersFrame)
		return ok && h.StreamID == id && h.StreamEnded()
	}
}

// allocatedRequest is a framed GetMetadataAllocatedRequest whose message is
// exactly size bytes.
func allocatedRequest(t *testing.T, size int) []byte {
	t.Helper()
	var msg []byte
	for id := size - 2; ; id-- { // the ID's length and its varint
		m, err := proto.Marshal(&csi.GetMetadataAllocatedRequest{SnapshotId: strings.Repeat("s", id)})
		if err != nil {
			t.Fatal(err)
		}
		if len(m) == size {
			msg = m
			break
		}
		if len(m) < size {
			t.Fatalf("no request message of %d bytes", size)
		}
	}
	frame := make([]byte, 5, 5+len(msg))
	binary.BigEndian.PutUint32(frame[1:], uint32(len(msg)))
	return append(frame, msg...)
}

// TestFrontEndBoundsStreamRequestsStillArriving: a streaming request
// message larger than the stream window is credited as it arrives only
// while the connection's budget (two messages of MaxMsgSize, shared with
// unary requests) holds all of it; others wait behind the stream window,
// are not failed, and are let in, in order, as the budget is given back:
// by a call the caller resets, a message sent on, a call the front end
// resets, a call ended at its deadline. Calls that wait, and end waiting,
// hold nothing. At the end the whole budget, and no more, is there again.
func TestFrontEndBoundsStreamRequestsStillArriving(t *testing.T) {
	const maxMsg = 4 << 20
	const alloc = "/csi.v1.SnapshotMetadata/GetMetadataAllocated"
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: startStreamDriver(t), MaxMsgSize: maxMsg})
	p := dialFlowFront(t, c)
	req := allocatedRequest(t, maxMsg) // 5+maxMsg bytes: two fill the budget
	win := int(p.initWin)
	if len(req) <= win {
		t.Fatalf("a request of %d bytes fits the %d bytes stream window", len(req), win)
	}
	most := req[:len(req)-1]
	// let opens stream id and sends all but the last byte of a request
	// the budget has room for: credited as it arrives.
	let := func(id uint32) {
		t.Helper()
		p.open(t, id, alloc, "")
		p.send(t, id, most, false)
	}
	// hold opens stream id and sends the request's first window: the
	// budget is full, so none of it is credited.
	hold := func(id uint32, why string) {
		t.Helper()
		p.open(t, id, alloc, "")
		p.send(t, id, req[:win], false)
		p.uncredited(t, id, why)
	}
	// rest sends what is left of a held request but its last byte, once
	// the budget lets it in.
	rest := func(id uint32, why string) {
		t.Helper()
		p.await(t, fmt.Sprintf("credit on stream %d: %s", id, why), func() bool { return p.credited[id] > 0 })
		p.send(t, id, most[win:], false)
	}

	let(1)
	let(3)
	hold(5, "streams 1 and 3 hold the whole budget")
	// One waiting behind it that the caller resets, and one that ends
	// inside its message: they hold nothing, and do not hold up 5.
	hold(7, "streams 1 and 3 hold the whole budget")
	p.rst(t, 7)
	hold(9, "streams 1 and 3 hold the whole budget")
	p.send(t, 9, nil, true)
	if f := p.frame(t, "the trailers of stream 9", isTrailers(9)).(*http2.MetaHeadersFrame); headerValue(f.Fields, "grpc-status") != "13" {
		t.Fatalf("a request ended inside its message: status %s %q, want INTERNAL (13)", headerValue(f.Fields, "grpc-status"), headerValue(f.Fields, "grpc-message"))
	}
	// A small streaming request is not held up by the budget.
	p.open(t, 11, alloc, "")
	p.send(t, 11, allocatedRequest(t, 10), true)
	p.frame(t, "the answer's headers on stream 11", func(f http2.Frame) bool {
		h, ok := f.(*http2.MetaHeadersFrame)
		return ok && h.StreamID == 11
	})

	// The caller resets 1: 5 is let in.
	p.rst(t, 1)
	rest(5, "stream 1 was reset by the caller")

	// 3's request ends and is sent on: 13 is let in.
	hold(13, "streams 3 and 5 hold the whole budget")
	p.send(t, 3, req[len(req)-1:], true)
	p.frame(t, "the answer's headers on stream 3", func(f http2.Frame) bool {
		h, ok := f.(*http2.MetaHeadersFrame)
		return ok && h.StreamID == 3
	})
	rest(13, "stream 3's request was sent on")

	// The front end resets 5 (its caller overflowed its send window): 15
	// is let in.
	hold(15, "streams 5 and 13 hold the whole budget")
	if err := p.fr.WriteWindowUpdate(5, 1<<31-1); err != nil {
		t.Fatal(err)
	}
	p.frame(t, "RST_STREAM FLOW_CONTROL_ERROR on stream 5", isRST(5, http2.ErrCodeFlowControl))
	rest(15, "stream 5 was reset by the front end")

	// The caller resets 13 and 15; 17, let in, ends at its deadline.
	p.rst(t, 13)
	p.rst(t, 15)
	p.open(t, 17, alloc, "1S")
	p.send(t, 17, req[:win], false)
	if f := p.frame(t, "the trailers of stream 17", isTrailers(17)).(*http2.MetaHeadersFrame); headerValue(f.Fields, "grpc-status") != "4" {
		t.Fatalf("stream 17: status %s %q, want DEADLINE_EXCEEDED (4)", headerValue(f.Fields, "grpc-status"), headerValue(f.Fields, "grpc-message"))
	}
	if p.creditedTo(17) == 0 {
		t.Fatal("stream 17 was never credited: the budget was not given back")
	}

	// All given back: two whole requests fit again, and not a byte more
	// (a unary request's first byte is refused).
	let(19)
	let(21)
	p.open(t, 23, "/csi.v1.Controller/CreateVolume", "")
	p.send(t, 23, []byte{0}, false)
	p.frame(t, "RST_STREAM REFUSED_STREAM on stream 23", isRST(23, http2.ErrCodeRefusedStream))
}

// TestFrontEndBudgetRefusalIsUnavailable: a call refused for a memory
// budget of the caller's connection reaches a gRPC caller as Unavailable
// (the call may be retried), never as ResourceExhausted, which a CSI
// caller reads as the driver having no room; the broker logs which budget.
func TestFrontEndBudgetRefusalIsUnavailable(t *testing.T) {
	echo, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, MaxMsgSize: 1 << 20})
	client := csi.NewControllerClient(chaintest.Dial(t, c.Front)) // one connection
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	request := func(name, sleep string) *csi.CreateVolumeRequest {
		return &csi.CreateVolumeRequest{Name: name, Parameters: map[string]string{"big": strings.Repeat("x", 900<<10), "quiet": "true", "sleep-ms": sleep}}
	}
	slow := make(chan error, 2)
	for i := range 2 {
		go func() {
			_, err := client.CreateVolume(ctx, request(fmt.Sprint("slow-", i), "1500"))
			slow <- err
		}()
	}
	echo.waitCreateCalls(t, 2)
	_, err := client.CreateVolume(ctx, request("third", "0"))
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("a call over its connection's budget: %v, want Unavailable", err)
	}
	if !strings.Contains(c.Logs.String(), "memory budget") {
		t.Errorf("no log of the refusal; logs:\n%s", c.Logs.String())
	}
	for range 2 {
		if err := <-slow; err != nil {
			t.Fatalf("slow call: %v", err)
		}
	}
	if _, err := client.CreateVolume(ctx, request("after", "0")); err != nil {
		t.Fatalf("a call once the others were done: %v", err)
	}
}

// TestFrontEndNodeNamedTwice: the node metadata key given twice is the
// caller's error (which node it meant is not for the broker to guess),
// for unary and streaming calls alike.
func TestFrontEndNodeNamedTwice(t *testing.T) {
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: startStreamDriver(t)})
	conn := chaintest.Dial(t, c.Front)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	twice := metadata.AppendToOutgoingContext(ctx, broker.MetadataNode, "node-a", broker.MetadataNode, "node-b")
	check := func(what string, err error) {
		t.Helper()
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), broker.MetadataNode) || !strings.Contains(err.Error(), "given 2 times") {
			t.Fatalf("%s with the node named twice: %v, want InvalidArgument naming %s", what, err, broker.MetadataNode)
		}
	}
	_, err := csi.NewControllerClient(conn).CreateVolume(twice, &csi.CreateVolumeRequest{Name: "twice"})
	check("CreateVolume", err)
	st, err := csi.NewSnapshotMetadataClient(conn).GetMetadataAllocated(twice, &csi.GetMetadataAllocatedRequest{SnapshotId: "s"})
	if err == nil {
		_, err = st.Recv()
	}
	check("GetMetadataAllocated", err)
	// Once is fine.
	once := metadata.AppendToOutgoingContext(ctx, broker.MetadataNode, "node-a")
	if _, err := csi.NewControllerClient(conn).CreateVolume(once, &csi.CreateVolumeRequest{Name: "once"}); err != nil {
		t.Fatalf("CreateVolume with the node named once: %v", err)
	}
}
