package chain

import (
	"encoding/binary"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/protobuf/proto"

	"github.com/csibroker/csibroker/internal/chaintest"
)

// Unary requests the front end is still receiving: their deadline and
// their memory.

// openCall sends a CreateVolume's HEADERS (with grpc-timeout, if not
// empty) on stream id, without ending the stream.
func openCall(r *rawBroker, id uint32, timeout string) {
	r.hbuf.Reset()
	fields := []hpack.HeaderField{{Name: ":method", Value: "POST"}, {Name: ":scheme", Value: "http"}, {Name: ":path", Value: "/csi.v1.Controller/CreateVolume"},
		{Name: ":authority", Value: "front"}, {Name: "content-type", Value: "application/grpc"}, {Name: "te", Value: "trailers"}}
	if timeout != "" {
		fields = append(fields, hpack.HeaderField{Name: "grpc-timeout", Value: timeout})
	}
	for _, f := range fields {
		r.enc.WriteField(f)
	}
	r.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: r.hbuf.Bytes(), EndHeaders: true})
}

// sendData writes p on stream id in frames of at most 16 KiB.
func sendData(t *testing.T, r *rawBroker, id uint32, p []byte, end bool) {
	t.Helper()
	for len(p) > 0 || end {
		n := min(len(p), 16<<10)
		last := n == len(p)
		if err := r.fr.WriteData(id, end && last, p[:n]); err != nil {
			t.Fatal(err)
		}
		p = p[n:]
		if last {
			return
		}
	}
}

// statusOf waits for the trailers ending stream id and returns their
// grpc-status and grpc-message.
func statusOf(t *testing.T, r *rawBroker, id uint32) (string, string) {
	t.Helper()
	f := r.wait(t, fmt.Sprintf("the trailers of stream %d", id), func(f http2.Frame) bool {
		h, ok := f.(*http2.MetaHeadersFrame)
		return ok && h.StreamID == id && h.StreamEnded()
	}).(*http2.MetaHeadersFrame)
	return headerValue(f.Fields, "grpc-status"), headerValue(f.Fields, "grpc-message")
}

// refused waits for the end of stream id and fails unless it is RST_STREAM
// REFUSED_STREAM: a call refused for a budget of its connection, which the
// caller's gRPC may retry (RESOURCE_EXHAUSTED would read as the driver's).
func refused(t *testing.T, r *rawBroker, id uint32) {
	t.Helper()
	f := r.wait(t, fmt.Sprintf("the end of stream %d", id), func(f http2.Frame) bool {
		switch f := f.(type) {
		case *http2.RSTStreamFrame:
			return f.StreamID == id
		case *http2.MetaHeadersFrame:
			return f.StreamID == id && f.StreamEnded()
		}
		return false
	})
	if rst, ok := f.(*http2.RSTStreamFrame); !ok || rst.ErrCode != http2.ErrCodeRefusedStream {
		if h, ok := f.(*http2.MetaHeadersFrame); ok {
			t.Fatalf("stream %d: status %s %q, want RST_STREAM REFUSED_STREAM", id, headerValue(h.Fields, "grpc-status"), headerValue(h.Fields, "grpc-message"))
		}
		t.Fatalf("stream %d: %v, want RST_STREAM REFUSED_STREAM", id, f)
	}
}

// TestFrontEndDeadlineOfARequestStillArriving: a CreateVolume whose caller
// sends part of its request and stops is answered DEADLINE_EXCEEDED when
// its grpc-timeout (counted from the HEADERS) runs out, and never reaches
// the driver (the front end kept the bytes with no end, as long as the
// connection lasted).
func TestFrontEndDeadlineOfARequestStillArriving(t *testing.T) {
	e, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	r := dialRawFront(t, c)
	openCall(r, 1, "300m")
	prefix := make([]byte, 5)
	binary.BigEndian.PutUint32(prefix[1:], 1<<20)
	sendData(t, r, 1, append(prefix, make([]byte, 100)...), false)
	start := time.Now()
	code, msg := statusOf(t, r, 1)
	if code != "4" || !strings.Contains(msg, "deadline") {
		t.Fatalf("status %s %q, want DEADLINE_EXCEEDED (4)", code, msg)
	}
	if waited := time.Since(start); waited > 3*time.Second {
		t.Errorf("answered after %v, with a 300 ms deadline", waited)
	}
	if n := e.calls.Load(); n != 0 {
		t.Errorf("the driver got %d calls", n)
	}
}

// TestFrontEndBoundsRequestsStillArriving: with a 1 MiB message limit, the
// unary requests a connection is still sending hold at most two such
// messages: a third is refused (REFUSED_STREAM); once the first two are
// reset, a whole request of the same size is served.
func TestFrontEndBoundsRequestsStillArriving(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, MaxMsgSize: 1 << 20})
	r := dialRawFront(t, c)
	msg, err := proto.Marshal(&csi.CreateVolumeRequest{Name: "big", Parameters: map[string]string{"big": strings.Repeat("x", 900<<10), "quiet": "true"}})
	if err != nil {
		t.Fatal(err)
	}
	frame := make([]byte, 5, 5+len(msg))
	binary.BigEndian.PutUint32(frame[1:], uint32(len(msg)))
	frame = append(frame, msg...)
	part := frame[:len(frame)-1] // all but the last byte: never whole
	for _, id := range []uint32{1, 3, 5} {
		openCall(r, id, "")
		sendData(t, r, id, part, false)
	}
	refused(t, r, 5)
	for _, id := range []uint32{1, 3} {
		if err := r.fr.WriteRSTStream(id, http2.ErrCodeCancel); err != nil {
			t.Fatal(err)
		}
	}
	openCall(r, 7, "")
	sendData(t, r, 7, frame, true)
	if code, text := statusOf(t, r, 7); code != "0" {
		t.Fatalf("a whole request after the others were reset: status %s %q, want OK", code, text)
	}
}

// TestFrontEndBoundsWholeRequestsInFlight: with a 1 MiB message limit,
// the whole unary requests of the calls a connection has in flight (the
// driver slow to answer) hold at most two such messages too: a third is
// refused (REFUSED_STREAM) while they are served, and served once they are
// done.
func TestFrontEndBoundsWholeRequestsInFlight(t *testing.T) {
	echo, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, MaxMsgSize: 1 << 20})
	r := dialRawFront(t, c)
	request := func(name, sleep string) []byte {
		msg, err := proto.Marshal(&csi.CreateVolumeRequest{Name: name, Parameters: map[string]string{"big": strings.Repeat("x", 900<<10), "quiet": "true", "sleep-ms": sleep}})
		if err != nil {
			t.Fatal(err)
		}
		frame := make([]byte, 5, 5+len(msg))
		binary.BigEndian.PutUint32(frame[1:], uint32(len(msg)))
		return append(frame, msg...)
	}
	for i, id := range []uint32{1, 3} {
		openCall(r, id, "")
		sendData(t, r, id, request(fmt.Sprint("slow-", i), "1500"), true)
	}
	echo.waitCreateCalls(t, 2) // both whole, at the driver
	openCall(r, 5, "")
	sendData(t, r, 5, request("third", "0"), true)
	refused(t, r, 5)
	// The slow calls' trailers, in whichever order they come.
	ended := map[uint32]string{}
	r.wait(t, "the trailers of streams 1 and 3", func(f http2.Frame) bool {
		if h, ok := f.(*http2.MetaHeadersFrame); ok && h.StreamEnded() && (h.StreamID == 1 || h.StreamID == 3) {
			ended[h.StreamID] = headerValue(h.Fields, "grpc-status")
		}
		return len(ended) == 2
	})
	if ended[1] != "0" || ended[3] != "0" {
		t.Fatalf("slow calls: grpc-status %v, want 0 for both", ended)
	}
	openCall(r, 7, "")
	sendData(t, r, 7, request("after", "0"), true)
	if code, text := statusOf(t, r, 7); code != "0" {
		t.Fatalf("a request after the others were served: status %s %q, want OK", code, text)
	}
}

// TestPushPromiseIsAProtocolError: a client pushing is a connection
// error (RFC 9113, 8.4), at the front end and at the proxy's broker side;
// ignored, its header block went undecoded and every later one was read
// against the wrong table.
func TestPushPromiseIsAProtocolError(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	for name, r := range map[string]*rawBroker{"front end": dialRawFront(t, c), "proxy": dialRawBroker(t, c, true)} {
		r.headers(1, "/csi.v1.Identity/Probe", false)
		r.hbuf.Reset()
		r.enc.WriteField(hpack.HeaderField{Name: ":method", Value: "GET"})
		if err := r.fr.WritePushPromise(http2.PushPromiseParam{StreamID: 1, PromiseID: 2, BlockFragment: r.hbuf.Bytes(), EndHeaders: true}); err != nil {
			t.Fatal(err)
		}
		r.wait(t, "GOAWAY PROTOCOL_ERROR from the "+name, func(f http2.Frame) bool {
			g, ok := f.(*http2.GoAwayFrame)
			return ok && g.ErrCode == http2.ErrCodeProtocol
		})
	}
}

// TestFrontEndWindowUpdateWakesItsCall: answers held by shut stream
// windows go out as their own windows open, each on its own (a window
// update wakes only the call it can unblock).
func TestFrontEndWindowUpdateWakesItsCall(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	r := dialRawFront(t, c, http2.Setting{ID: http2.SettingInitialWindowSize, Val: 0})
	ct := hpack.HeaderField{Name: "content-type", Value: "application/grpc"}
	rawCall(t, r, 1, "/csi.v1.Controller/CreateVolume", ct)
	rawCall(t, r, 3, "/csi.v1.Controller/CreateVolume", ct)
	for _, id := range []uint32{3, 1} {
		if err := r.fr.WriteWindowUpdate(id, 1<<16); err != nil {
			t.Fatal(err)
		}
		if code, msg := statusOf(t, r, id); code != "0" {
			t.Fatalf("stream %d: status %s %q, want OK once its window opened", id, code, msg)
		}
	}
}

// TestFrontEndBoundsHeaderListsOfCallsInFlight: each call's header list
// is kept while the call is in flight, and a connection's calls hold at
// most 4 MiB of them: calls whose requests never end cannot pile up header
// lists of up to 1 MiB each. A fifth call of 900 KiB of metadata is
// refused (REFUSED_STREAM); once one of the others is reset, a call of the
// same size is served.
func TestFrontEndBoundsHeaderListsOfCallsInFlight(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	r := dialRawFront(t, c)
	big := strings.Repeat("m", 900<<10)
	open := func(id uint32) {
		r.hbuf.Reset()
		for _, f := range []hpack.HeaderField{{Name: ":method", Value: "POST"}, {Name: ":scheme", Value: "http"}, {Name: ":path", Value: "/csi.v1.Controller/CreateVolume"},
			{Name: ":authority", Value: "front"}, {Name: "content-type", Value: "application/grpc"}, {Name: "te", Value: "trailers"}, {Name: "x-big", Value: big}} {
			r.enc.WriteField(f)
		}
		block := r.hbuf.Bytes()
		first := block[:16<<10]
		if err := r.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: first}); err != nil {
			t.Fatal(err)
		}
		for rest := block[len(first):]; len(rest) > 0; {
			n := min(len(rest), 16<<10)
			if err := r.fr.WriteContinuation(id, n == len(rest), rest[:n]); err != nil {
				t.Fatal(err)
			}
			rest = rest[n:]
		}
	}
	for _, id := range []uint32{1, 3, 5, 7} {
		open(id)
	}
	open(9)
	refused(t, r, 9)
	if err := r.fr.WriteRSTStream(1, http2.ErrCodeCancel); err != nil {
		t.Fatal(err)
	}
	msg, err := proto.Marshal(&csi.CreateVolumeRequest{Name: "after"})
	if err != nil {
		t.Fatal(err)
	}
	frame := make([]byte, 5, 5+len(msg))
	binary.BigEndian.PutUint32(frame[1:], uint32(len(msg)))
	open(11)
	sendData(t, r, 11, append(frame, msg...), true)
	if code, text := statusOf(t, r, 11); code != "0" {
		t.Fatalf("a call after another was reset: status %s %q, want OK", code, text)
	}
}
