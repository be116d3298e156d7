package chain

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"net"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/mtls"
)

// Peers that break HTTP/2's rules, played by a raw HTTP/2 client holding a
// broker certificate: the proxy must refuse them without growing or
// hanging, and without affecting other connections.

// rawBroker is an HTTP/2 client over mTLS that writes frames as told and
// reports what the proxy sends.
type rawBroker struct {
	fr     *http2.Framer
	enc    *hpack.Encoder
	hbuf   bytes.Buffer
	frames chan http2.Frame // RST_STREAM, GOAWAY and HEADERS frames received
	closed chan struct{}
}

func dialRawBroker(t *testing.T, c *chaintest.Chain, read bool, settings ...http2.Setting) *rawBroker {
	t.Helper()
	return dialRawBrokerUntil(t, c, time.Now().Add(time.Hour), read, settings...)
}

// dialRawFront speaks HTTP/2 to c's front end socket, frame by frame,
// reading what comes back.
func dialRawFront(t *testing.T, c *chaintest.Chain, settings ...http2.Setting) *rawBroker {
	t.Helper()
	nc, err := net.Dial("unix", c.Front)
	if err != nil {
		t.Fatal(err)
	}
	return rawPeer(t, nc, true, settings...)
}

// dialRawBrokerUntil is dialRawBroker with a broker certificate that
// expires at notAfter.
func dialRawBrokerUntil(t *testing.T, c *chaintest.Chain, notAfter time.Time, read bool, settings ...http2.Setting) *rawBroker {
	t.Helper()
	now := time.Now()
	m, err := c.CA.IssueMaterial(mtls.Leaf{ID: mtls.BrokerID(chaintest.TrustDomain), NotBefore: now.Add(-time.Minute), NotAfter: notAfter})
	if err != nil {
		t.Fatal(err)
	}
	tc, err := tls.Dial("tcp", c.ProxyAddr, mtls.ClientConfig(mtls.StaticSource{M: m}, mtls.AuthorizeOneOf(mtls.DriverID(chaintest.TrustDomain, echoName))))
	if err != nil {
		t.Fatal(err)
	}
	return rawPeer(t, tc, read, settings...)
}

// rawPeer speaks HTTP/2 as a client on nc, frame by frame.
func rawPeer(t *testing.T, nc net.Conn, read bool, settings ...http2.Setting) *rawBroker {
	t.Helper()
	t.Cleanup(func() { nc.Close() })
	if _, err := nc.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	r := &rawBroker{fr: http2.NewFramer(nc, nc), frames: make(chan http2.Frame, 64), closed: make(chan struct{})}
	r.enc = hpack.NewEncoder(&r.hbuf)
	r.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	if err := r.fr.WriteSettings(settings...); err != nil {
		t.Fatal(err)
	}
	if read {
		go func() {
			defer close(r.closed)
			for {
				f, err := r.fr.ReadFrame()
				if err != nil {
					return
				}
				switch f.(type) {
				case *http2.RSTStreamFrame, *http2.GoAwayFrame, *http2.MetaHeadersFrame, *http2.PingFrame:
					select {
					case r.frames <- f:
					default:
					}
				}
			}
		}()
	}
	return r
}

func (r *rawBroker) headers(id uint32, path string, end bool) {
	r.hbuf.Reset()
	for _, f := range []hpack.HeaderField{{Name: ":method", Value: "POST"}, {Name: ":scheme", Value: "https"}, {Name: ":path", Value: path},
		{Name: ":authority", Value: "proxy"}, {Name: "content-type", Value: "application/grpc"}, {Name: "te", Value: "trailers"}} {
		r.enc.WriteField(f)
	}
	r.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: r.hbuf.Bytes(), EndHeaders: true, EndStream: end})
}

// wait returns the first received frame ok accepts, or fails after 5 s.
func (r *rawBroker) wait(t *testing.T, what string, ok func(http2.Frame) bool) http2.Frame {
	t.Helper()
	timeout := time.After(5 * time.Second)
	for {
		select {
		case f := <-r.frames:
			if ok(f) {
				return f
			}
		case <-timeout:
			t.Fatalf("the proxy never sent %s", what)
			return nil
		}
	}
}

// serveNonReadingDriver serves the echo driver with streaming calls that
// never read their requests (they end with their call, or after 20 s),
// and returns its endpoint.
func serveNonReadingDriver(t *testing.T) string {
	t.Helper()
	path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
	serveDriver(t, path, grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		select { // never reads; ends with its call
		case <-time.After(20 * time.Second):
		case <-ss.Context().Done():
		}
		return h(srv, ss)
	}))
	return "unix://" + path
}

func heapMiB() int64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc >> 20)
}

// TestRelayRefusesDataBeyondItsWindow: a broker that ignores flow control
// sends 64 MiB into a call whose driver does not read; the proxy resets the
// stream with FLOW_CONTROL_ERROR and holds no more than its window.
func TestRelayRefusesDataBeyondItsWindow(t *testing.T) {
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: serveNonReadingDriver(t)})
	r := dialRawBroker(t, c, true)
	before := heapMiB()
	r.headers(1, "/csi.v1.SnapshotMetadata/GetMetadataAllocated", false)
	chunk := make([]byte, 16<<10)
	binary.BigEndian.PutUint32(chunk[1:], 1<<30)
	for i := 0; i < 64*64; i++ {
		if err := r.fr.WriteData(1, false, chunk); err != nil {
			break // the proxy may close the connection as well
		}
	}
	r.wait(t, "RST_STREAM(FLOW_CONTROL_ERROR) or GOAWAY(FLOW_CONTROL_ERROR)", func(f http2.Frame) bool {
		switch f := f.(type) {
		case *http2.RSTStreamFrame:
			return f.StreamID == 1 && f.ErrCode == http2.ErrCodeFlowControl
		case *http2.GoAwayFrame:
			return f.ErrCode == http2.ErrCodeFlowControl
		}
		return false
	})
	if grew := heapMiB() - before; grew > 8 {
		t.Fatalf("heap grew by %d MiB after a peer sent 64 MiB beyond the windows", grew)
	}
}

// TestRelayBoundsItsOwnCalls: 64 MiB sent into GetInfo (answered by the
// proxy itself) ends the call with ResourceExhausted, holding nothing.
func TestRelayBoundsItsOwnCalls(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	r := dialRawBroker(t, c, true, http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 20})
	before := heapMiB()
	r.headers(1, "/csibroker.proxyinfo.v1.ProxyInfo/GetInfo", false)
	chunk := make([]byte, 16<<10)
	for i := 0; i < 64*64; i++ {
		if err := r.fr.WriteData(1, false, chunk); err != nil {
			break
		}
	}
	r.wait(t, "grpc-status 8 (ResourceExhausted)", func(f http2.Frame) bool {
		h, ok := f.(*http2.MetaHeadersFrame)
		return ok && headerValue(h.Fields, "grpc-status") == "8"
	})
	if grew := heapMiB() - before; grew > 8 {
		t.Fatalf("heap grew by %d MiB", grew)
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

// TestRelayRefusesInvalidSettings: SETTINGS_MAX_FRAME_SIZE 0 is a protocol
// error: GOAWAY, and the proxy goes on serving other connections.
func TestRelayRefusesInvalidSettings(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	r := dialRawBroker(t, c, true, http2.Setting{ID: http2.SettingMaxFrameSize, Val: 0})
	r.headers(1, "/not.csi/"+strings.Repeat("x", 10), true)
	r.wait(t, "GOAWAY(PROTOCOL_ERROR)", func(f http2.Frame) bool {
		g, ok := f.(*http2.GoAwayFrame)
		return ok && g.ErrCode == http2.ErrCodeProtocol
	})
	select {
	case <-r.closed:
	case <-time.After(5 * time.Second):
		t.Fatal("the proxy kept the connection open")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := csi.NewControllerClient(brokerConn(t, c)).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "after"}); err != nil {
		t.Fatalf("call on a good connection: %v", err)
	}
}

// TestRelayStuckBrokerStallsNoOtherBroker: a broker connection that stops
// reading (windows granted, a hung or partitioned peer) must not hold back
// calls of another broker connection.
func TestRelayStuckBrokerStallsNoOtherBroker(t *testing.T) {
	path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
	echo, _ := serveDriver(t, path)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: "unix://" + path})
	r := dialRawBroker(t, c, false, http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1<<31 - 1})
	r.fr.WriteWindowUpdate(0, 1<<31-1-65535)
	r.headers(1, "/csi.v1.SnapshotMetadata/GetMetadataAllocated", false)
	r.fr.WriteData(1, true, []byte{0, 0, 0, 0, 3, 0x0a, 1, 's'}) // GetMetadataAllocatedRequest{snapshot_id: "s"}
	waitSendsBlocked(t, echo, 1)                                 // ~7 MB of answer fills the socket buffers
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := csi.NewControllerClient(brokerConn(t, c)).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "small"}); err != nil {
		t.Fatalf("call on another broker connection while one broker does not read: %v", err)
	}
}

// TestRelayRefusesOversizedHeaderList: a request whose metadata is over the
// proxy's header list limit (1 MiB, in its SETTINGS) is refused with
// RST_STREAM(FRAME_SIZE_ERROR), not forwarded with its last fields dropped;
// the connection goes on serving calls.
func TestRelayRefusesOversizedHeaderList(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	refusesOversizedHeaderList(t, dialRawBroker(t, c, true), "/csibroker.proxyinfo.v1.ProxyInfo/GetInfo")
}

// TestFrontEndRefusesOversizedHeaderList: the same at the broker's front
// end, for a caller that ignores its SETTINGS (gRPC's client does not send
// such a request at all).
func TestFrontEndRefusesOversizedHeaderList(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	refusesOversizedHeaderList(t, dialRawFront(t, c), "/csi.v1.Identity/Probe")
}

// refusesOversizedHeaderList sends a Probe with 1.2 MiB of metadata on
// stream 1 (three fields, each under the limit) and expects it reset with
// FRAME_SIZE_ERROR and never answered, then calls next on stream 3 and
// expects grpc-status 0.
func refusesOversizedHeaderList(t *testing.T, r *rawBroker, next string) {
	t.Helper()
	r.hbuf.Reset()
	for _, f := range []hpack.HeaderField{{Name: ":method", Value: "POST"}, {Name: ":scheme", Value: "https"}, {Name: ":path", Value: "/csi.v1.Identity/Probe"},
		{Name: ":authority", Value: "proxy"}, {Name: "content-type", Value: "application/grpc"}, {Name: "te", Value: "trailers"},
		{Name: "x-big-1", Value: strings.Repeat("a", 400<<10)}, {Name: "x-big-2", Value: strings.Repeat("b", 400<<10)}, {Name: "x-big-3", Value: strings.Repeat("c", 400<<10)}} {
		r.enc.WriteField(f)
	}
	block := r.hbuf.Bytes()
	const frag = 16 << 10
	if err := r.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block[:frag], EndStream: true}); err != nil {
		t.Fatal(err)
	}
	for rest := block[frag:]; len(rest) > 0; {
		n := min(len(rest), frag)
		if err := r.fr.WriteContinuation(1, n == len(rest), rest[:n]); err != nil {
			t.Fatal(err)
		}
		rest = rest[n:]
	}
	r.wait(t, "RST_STREAM(FRAME_SIZE_ERROR) on stream 1", func(f http2.Frame) bool {
		rst, ok := f.(*http2.RSTStreamFrame)
		if ok && rst.StreamID == 1 && rst.ErrCode != http2.ErrCodeFrameSize {
			t.Fatalf("stream 1 reset with %v, want FRAME_SIZE_ERROR", rst.ErrCode)
		}
		if h, ok := f.(*http2.MetaHeadersFrame); ok && h.StreamID == 1 {
			t.Fatalf("stream 1 was answered (%v): the request went on", h.Fields)
		}
		return ok && rst.StreamID == 1
	})
	r.headers(3, next, false)
	if err := r.fr.WriteData(3, true, []byte{0, 0, 0, 0, 0}); err != nil {
		t.Fatal(err)
	}
	r.wait(t, "grpc-status 0 on stream 3 of the same connection", func(f http2.Frame) bool {
		h, ok := f.(*http2.MetaHeadersFrame)
		return ok && h.StreamID == 3 && headerValue(h.Fields, "grpc-status") == "0"
	})
}

// TestRelayRefusesStreamsBeyondItsLimit: a broker that ignores the
// proxy's SETTINGS_MAX_CONCURRENT_STREAMS (1024) and opens one more call
// gets RST_STREAM(REFUSED_STREAM) for it, so what the proxy holds per
// connection stays bounded.
func TestRelayRefusesStreamsBeyondItsLimit(t *testing.T) {
	path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
	serveDriver(t, path)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: "unix://" + path})
	r := dialRawBroker(t, c, true)
	const limit = 1024
	for i := uint32(0); i <= limit; i++ {
		r.headers(1+2*i, "/csi.v1.Identity/Probe", false) // requests never finished
	}
	over := uint32(1 + 2*limit)
	f := r.wait(t, "RST_STREAM(REFUSED_STREAM)", func(f http2.Frame) bool {
		rst, ok := f.(*http2.RSTStreamFrame)
		return ok && rst.ErrCode == http2.ErrCodeRefusedStream
	})
	if id := f.Header().StreamID; id != over {
		t.Fatalf("stream %d refused, want only the one over the limit, %d", id, over)
	}
}

// TestRelayKeepsToTheDriversHeaderListLimit: a driver that announces a
// 4 KiB header list limit never receives a call whose metadata is over
// it: the proxy answers Internal naming both sizes, and the next call
// goes through.
func TestRelayKeepsToTheDriversHeaderListLimit(t *testing.T) {
	path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
	e, _ := serveDriver(t, path, grpc.MaxHeaderListSize(4096))
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: "unix://" + path})
	client := csi.NewControllerClient(brokerConn(t, c))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// The first call lets the proxy read the driver's SETTINGS.
	if _, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "first"}); err != nil {
		t.Fatal(err)
	}
	_, err := client.CreateVolume(metadata.AppendToOutgoingContext(ctx, "x-big", strings.Repeat("b", 5000)), &csi.CreateVolumeRequest{Name: "big"})
	if status.Code(err) != codes.Internal || !strings.Contains(status.Convert(err).Message(), "over the 4096 bytes the driver") {
		t.Fatalf("metadata over the driver's limit: %v", err)
	}
	if _, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "after"}); err != nil {
		t.Fatalf("a call after it: %v", err)
	}
	if n := e.calls.Load(); n != 2 {
		t.Fatalf("the driver saw %d calls, want 2 (the one over its limit never sent)", n)
	}
}

// TestRelayQueuesFramesNotTheirCount: DATA frames behind ones a driver's
// shut window holds are queued as their bytes, not one entry each: half a
// million empty frames (which flow control does not bound) leave the
// proxy's heap as it was.
func TestRelayQueuesFramesNotTheirCount(t *testing.T) {
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: serveNonReadingDriver(t)})
	r := dialRawBroker(t, c, true)
	r.headers(1, "/csi.v1.SnapshotMetadata/GetMetadataAllocated", false)
	chunk := make([]byte, 16<<10)
	binary.BigEndian.PutUint32(chunk[1:], 1<<30)
	for i := 0; i < 8; i++ { // 128 KiB: past the driver's window, within the proxy's
		if err := r.fr.WriteData(1, false, chunk); err != nil {
			t.Fatal(err)
		}
	}
	before := heapMiB()
	for i := 0; i < 500_000; i++ {
		if err := r.fr.WriteData(1, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.fr.WritePing(false, [8]byte{7}); err != nil {
		t.Fatal(err)
	}
	r.wait(t, "the PING's ack, after every empty frame", func(f http2.Frame) bool {
		p, ok := f.(*http2.PingFrame)
		return ok && p.IsAck() && p.Data == [8]byte{7}
	})
	if grew := heapMiB() - before; grew > 8 {
		t.Fatalf("heap grew by %d MiB for half a million empty DATA frames", grew)
	}
}
