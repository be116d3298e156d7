package chain

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
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
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/csibroker/csibroker/internal/chaintest"
)

// Streaming calls through the front end: each message goes out as it comes,
// and a request message larger than the stream window arrives whole.

// heldSnapshots answers GetMetadataAllocated with one message whose
// capacity is the request's snapshot ID length, then keeps the stream open
// until the caller ends it or its deadline passes, and ends it with that
// status (a driver answering OK there would race the caller's own
// DeadlineExceeded).
type heldSnapshots struct {
	csi.UnimplementedSnapshotMetadataServer
}

func (heldSnapshots) GetMetadataAllocated(req *csi.GetMetadataAllocatedRequest, srv csi.SnapshotMetadata_GetMetadataAllocatedServer) error {
	if err := srv.Send(&csi.GetMetadataAllocatedResponse{VolumeCapacityBytes: int64(len(req.GetSnapshotId()))}); err != nil {
		return err
	}
	<-srv.Context().Done()
	return status.FromContextError(srv.Context().Err()).Err()
}

// counterDesc is a client-streaming method of a CSI service newer than the
// compiled spec: the front end passes it on as a stream. It answers with
// the bytes received, once the caller half-closes.
var counterDesc = grpc.ServiceDesc{
	ServiceName: "csi.v2.Counter",
	HandlerType: (*any)(nil),
	Streams: []grpc.StreamDesc{{StreamName: "Count", ClientStreams: true, Handler: func(_ any, ss grpc.ServerStream) error {
		var n int64
		for {
			in := &wrapperspb.BytesValue{}
			err := ss.RecvMsg(in)
			if err == io.EOF {
				return ss.SendMsg(wrapperspb.Int64(n))
			}
			if err != nil {
				return err
			}
			n += int64(len(in.GetValue()))
		}
	}}},
}

func startStreamDriver(t *testing.T) string {
	t.Helper()
	path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
	lis, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	e := &echoDriver{cancelled: make(chan struct{}, 16)}
	srv := grpc.NewServer(grpc.MaxRecvMsgSize(16 << 20))
	csi.RegisterIdentityServer(srv, e)
	csi.RegisterControllerServer(srv, e)
	csi.RegisterSnapshotMetadataServer(srv, heldSnapshots{})
	srv.RegisterService(&counterDesc, struct{}{})
	go srv.Serve(lis)
	t.Cleanup(func() { srv.Stop(); os.Remove(path) })
	return "unix://" + path
}

// TestFrontEndStreamMessagesGoOutAsTheyCome: a server stream whose driver
// sends one message and keeps the stream open; the caller gets the headers
// and that message while the stream is still open.
func TestFrontEndStreamMessagesGoOutAsTheyCome(t *testing.T) {
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: startStreamDriver(t)})
	conn := chaintest.Dial(t, c.Front)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := csi.NewSnapshotMetadataClient(conn).GetMetadataAllocated(ctx, &csi.GetMetadataAllocatedRequest{SnapshotId: "abc"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Header(); err != nil {
		t.Fatalf("headers of an open stream: %v", err)
	}
	m, err := st.Recv()
	if err != nil || m.GetVolumeCapacityBytes() != 3 {
		t.Fatalf("first message of an open stream: %v, %v", m, err)
	}
}

// TestFrontEndStreamRequestsLargerThanTheWindow: request messages of a
// streaming call larger than the front end's stream window (1 MiB), alone
// and after another message, arrive whole.
func TestFrontEndStreamRequestsLargerThanTheWindow(t *testing.T) {
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: startStreamDriver(t)})
	conn := chaintest.Dial(t, c.Front, grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(16<<20)))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	// A known server-streaming CSI method with a 3 MiB request.
	st, err := csi.NewSnapshotMetadataClient(conn).GetMetadataAllocated(ctx, &csi.GetMetadataAllocatedRequest{SnapshotId: string(make([]byte, 3<<20))})
	if err != nil {
		t.Fatal(err)
	}
	if m, err := st.Recv(); err != nil || m.GetVolumeCapacityBytes() != 3<<20 {
		t.Fatalf("3 MiB request of a server stream: %v, %v", m, err)
	}

	// A client stream of a newer CSI service: 200 KiB, then 900 KiB (the
	// window still holding part of the first), then 2 MiB.
	cs, err := conn.NewStream(ctx, &grpc.StreamDesc{ClientStreams: true}, "/csi.v2.Counter/Count")
	if err != nil {
		t.Fatal(err)
	}
	var want int64
	for _, n := range []int{200 << 10, 900 << 10, 2 << 20} {
		want += int64(n)
		if err := cs.SendMsg(wrapperspb.Bytes(make([]byte, n))); err != nil {
			t.Fatalf("send %d bytes: %v", n, err)
		}
	}
	if err := cs.CloseSend(); err != nil {
		t.Fatal(err)
	}
	got := &wrapperspb.Int64Value{}
	if err := cs.RecvMsg(got); err != nil || got.GetValue() != want {
		t.Fatalf("client stream: counted %d bytes, err %v; want %d", got.GetValue(), err, want)
	}
}

// rawCall sends a unary call with an empty message and the given extra
// header fields (content-type included) on stream id, and returns the
// answer's first header block.
func rawCall(t *testing.T, r *rawBroker, id uint32, path string, fields ...hpack.HeaderField) *http2.MetaHeadersFrame {
	t.Helper()
	r.hbuf.Reset()
	for _, f := range append([]hpack.HeaderField{{Name: ":method", Value: "POST"}, {Name: ":scheme", Value: "http"}, {Name: ":path", Value: path},
		{Name: ":authority", Value: "csibroker"}, {Name: "te", Value: "trailers"}}, fields...) {
		r.enc.WriteField(f)
	}
	if err := r.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: r.hbuf.Bytes(), EndHeaders: true}); err != nil {
		t.Fatal(err)
	}
	var msg [5]byte
	binary.BigEndian.PutUint32(msg[1:], 0)
	if err := r.fr.WriteData(id, true, msg[:]); err != nil {
		t.Fatal(err)
	}
	return r.wait(t, "an answer", func(f http2.Frame) bool {
		h, ok := f.(*http2.MetaHeadersFrame)
		return ok && h.StreamID == id
	}).(*http2.MetaHeadersFrame)
}

// TestFrontEndTimeoutCountsFromTheHeaders: a call's grpc-timeout counts
// from its HEADERS, as the caller's deadline does: a request whose message
// arrives 600 ms later reaches the driver with about 600 ms less, not with
// the whole timeout again.
func TestFrontEndTimeoutCountsFromTheHeaders(t *testing.T) {
	path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
	echo, _ := serveDriver(t, path)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: "unix://" + path})
	r := dialRawFront(t, c)
	r.hbuf.Reset()
	for _, f := range []hpack.HeaderField{{Name: ":method", Value: "POST"}, {Name: ":scheme", Value: "http"}, {Name: ":path", Value: "/csi.v1.Controller/CreateVolume"},
		{Name: ":authority", Value: "csibroker"}, {Name: "te", Value: "trailers"}, {Name: "content-type", Value: "application/grpc"}, {Name: "grpc-timeout", Value: "2S"}} {
		r.enc.WriteField(f)
	}
	if err := r.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: r.hbuf.Bytes(), EndHeaders: true}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(600 * time.Millisecond) // the slow upload under test
	body, err := proto.Marshal(&csi.CreateVolumeRequest{Name: "slow-upload"})
	if err != nil {
		t.Fatal(err)
	}
	msg := make([]byte, 5+len(body))
	binary.BigEndian.PutUint32(msg[1:5], uint32(len(body)))
	copy(msg[5:], body)
	if err := r.fr.WriteData(1, true, msg); err != nil {
		t.Fatal(err)
	}
	r.wait(t, "the trailers", func(f http2.Frame) bool {
		h, ok := f.(*http2.MetaHeadersFrame)
		return ok && h.StreamID == 1 && h.StreamEnded()
	})
	echo.mu.Lock()
	left := echo.deadline
	echo.mu.Unlock()
	if left <= 0 || left > 1500*time.Millisecond {
		t.Fatalf("the driver got %v of the caller's 2 s, which had 1.4 s left when the request was whole", left)
	}
}

// TestFrontEndExpiredTimeoutAndOtherProtocols: "grpc-timeout: 0n" is a
// deadline that has passed (DeadlineExceeded, as a gRPC server answers
// it), not "no deadline"; a content-type of another protocol that starts
// like gRPC's (grpc-web) is refused with 415, as gRPC's servers refuse it.
func TestFrontEndExpiredTimeoutAndOtherProtocols(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	r := dialRawFront(t, c)
	grpcCT := hpack.HeaderField{Name: "content-type", Value: "application/grpc"}

	h := rawCall(t, r, 1, "/csi.v1.Identity/Probe", grpcCT, hpack.HeaderField{Name: "grpc-timeout", Value: "0n"})
	if got := h.PseudoValue("status"); got != "200" {
		t.Fatalf(":status %q, want 200", got)
	}
	if !h.StreamEnded() {
		// Headers, then trailers.
		h = r.wait(t, "trailers", func(f http2.Frame) bool {
			m, ok := f.(*http2.MetaHeadersFrame)
			return ok && m.StreamID == 1 && m.StreamEnded()
		}).(*http2.MetaHeadersFrame)
	}
	if got := h.Fields; rawField(got, "grpc-status") != strconv.Itoa(int(codes.DeadlineExceeded)) {
		t.Fatalf("grpc-timeout 0n: grpc-status %q (%q), want %d", rawField(got, "grpc-status"), rawField(got, "grpc-message"), codes.DeadlineExceeded)
	}

	h = rawCall(t, r, 3, "/csi.v1.Identity/Probe", hpack.HeaderField{Name: "content-type", Value: "application/grpc-web+proto"})
	if got := h.PseudoValue("status"); got != "415" {
		t.Fatalf("grpc-web content-type: :status %q, want 415", got)
	}

	// The connection still serves gRPC calls, with a timeout.
	h = rawCall(t, r, 5, "/csi.v1.Identity/Probe", hpack.HeaderField{Name: "content-type", Value: "application/grpc+proto"}, hpack.HeaderField{Name: "grpc-timeout", Value: "5S"})
	for !h.StreamEnded() {
		h = r.wait(t, "trailers", func(f http2.Frame) bool {
			m, ok := f.(*http2.MetaHeadersFrame)
			return ok && m.StreamID == 5
		}).(*http2.MetaHeadersFrame)
	}
	if got := rawField(h.Fields, "grpc-status"); got != "0" {
		t.Fatalf("Probe after them: grpc-status %q (%q)", got, rawField(h.Fields, "grpc-message"))
	}
}

func rawField(fields []hpack.HeaderField, name string) string {
	for _, f := range fields {
		if f.Name == name {
			return f.Value
		}
	}
	return ""
}

// TestFrontEndFrameTooLarge: a frame over the 16 KiB the front end allows
// closes the connection with GOAWAY(FRAME_SIZE_ERROR), saying why, not
// silently.
func TestFrontEndFrameTooLarge(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	r := dialRawFront(t, c)
	r.hbuf.Reset()
	for _, f := range []hpack.HeaderField{{Name: ":method", Value: "POST"}, {Name: ":scheme", Value: "http"}, {Name: ":path", Value: "/csi.v1.Identity/Probe"},
		{Name: ":authority", Value: "csibroker"}, {Name: "content-type", Value: "application/grpc"}} {
		r.enc.WriteField(f)
	}
	if err := r.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: r.hbuf.Bytes(), EndHeaders: true}); err != nil {
		t.Fatal(err)
	}
	if err := r.fr.WriteData(1, true, make([]byte, 20<<10)); err != nil {
		t.Fatal(err)
	}
	g := r.wait(t, "GOAWAY", func(f http2.Frame) bool { _, ok := f.(*http2.GoAwayFrame); return ok }).(*http2.GoAwayFrame)
	if g.ErrCode != http2.ErrCodeFrameSize {
		t.Fatalf("GOAWAY %v (%q), want FRAME_SIZE_ERROR", g.ErrCode, g.DebugData())
	}
}

// TestFrontEndKeepsToTheCallersHeaderListLimit: a caller that announces a
// 4 KiB header list limit gets a status whose message is over it cut to
// fit, with its code and a note, and response metadata over it as an
// Internal error naming the limit; each call fails alone, and the
// connection goes on serving calls (gRPC's client would close it on a
// block over its limit).
func TestFrontEndKeepsToTheCallersHeaderListLimit(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	client := csi.NewControllerClient(chaintest.Dial(t, c.Front, grpc.WithMaxHeaderListSize(4096)))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	long := strings.Repeat("n", 8<<10)
	_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: long, Parameters: map[string]string{"code": "5", "quiet": "true"}})
	msg := status.Convert(err).Message()
	if status.Code(err) != codes.NotFound || !strings.HasPrefix(msg, "driver says NotFound for nnnn") || !strings.Contains(msg, "header list limit of 4096 bytes") || len(msg) > 4096 {
		t.Fatalf("long status message: %v (%d bytes) %.300q, want NotFound cut to fit with a note", status.Code(err), len(msg), msg)
	}

	_, err = client.CreateVolume(metadata.AppendToOutgoingContext(ctx, "x-echo-md", strings.Repeat("m", 5<<10)), &csi.CreateVolumeRequest{Name: "md"})
	if status.Code(err) != codes.Internal || !strings.Contains(status.Convert(err).Message(), "over the 4096 bytes the caller accepts") {
		t.Fatalf("response headers over the limit: %v", err)
	}

	if resp, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "after"}); err != nil || resp.GetVolume().GetVolumeId() != "id-after" {
		t.Fatalf("a call after them on the same connection: %v, %v", resp, err)
	}
}

// TestStreamsKeepTheDriversTimeout: a server stream the driver holds open
// ends with DeadlineExceeded at the driver's timeout for the method (the
// caller set none), and is counted in the call metrics like a unary call.
func TestStreamsKeepTheDriversTimeout(t *testing.T) {
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: startStreamDriver(t),
		Timeout: 30 * time.Second, MethodTimeouts: map[string]time.Duration{"GetMetadataAllocated": 300 * time.Millisecond}})
	conn := chaintest.Dial(t, c.Front)
	start := time.Now()
	// The caller has no deadline of its own; it gives up after 10 s by
	// cancelling, so a stream the broker left open ends Canceled, not
	// DeadlineExceeded.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	time.AfterFunc(10*time.Second, cancel)
	st, err := csi.NewSnapshotMetadataClient(conn).GetMetadataAllocated(ctx, &csi.GetMetadataAllocatedRequest{SnapshotId: "held"})
	if err != nil {
		t.Fatal(err)
	}
	var rerr error
	for rerr == nil {
		_, rerr = st.Recv()
	}
	if status.Code(rerr) != codes.DeadlineExceeded {
		t.Fatalf("stream ended with %v after %v, want DeadlineExceeded at the 300 ms method timeout", rerr, time.Since(start))
	}
	counted := func() bool {
		mfs, err := c.Registry.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() != "csibroker_csi_call_duration_seconds" {
				continue
			}
			for _, m := range mf.GetMetric() {
				var method, code string
				for _, l := range m.GetLabel() {
					switch l.GetName() {
					case "method":
						method = l.GetValue()
					case "code":
						code = l.GetValue()
					}
				}
				if method == "GetMetadataAllocated" && code == "DeadlineExceeded" && m.GetHistogram().GetSampleCount() > 0 {
					return true
				}
			}
		}
		return false
	}
	for deadline := time.Now().Add(5 * time.Second); !counted(); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the stream is not in csibroker_csi_call_duration_seconds{method=GetMetadataAllocated,code=DeadlineExceeded}")
		}
	}
}

// TestFrontEndAnswerHeldByAShutWindowEndsAtTheDeadline: a caller that
// never opens its flow-control window does not hold the answer (and the
// broker's worker) past the call's deadline: the front end resets the
// stream with CANCEL once grpc-timeout has passed.
func TestFrontEndAnswerHeldByAShutWindowEndsAtTheDeadline(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	r := dialRawFront(t, c, http2.Setting{ID: http2.SettingInitialWindowSize, Val: 0})
	start := time.Now()
	rawCall(t, r, 1, "/csi.v1.Controller/CreateVolume", hpack.HeaderField{Name: "content-type", Value: "application/grpc"}, hpack.HeaderField{Name: "grpc-timeout", Value: "500m"})
	rst := r.wait(t, "RST_STREAM for the held answer", func(f http2.Frame) bool {
		rs, ok := f.(*http2.RSTStreamFrame)
		return ok && rs.StreamID == 1
	}).(*http2.RSTStreamFrame)
	if rst.ErrCode != http2.ErrCodeCancel {
		t.Errorf("stream reset with %v, want CANCEL", rst.ErrCode)
	}
	if d := time.Since(start); d < 400*time.Millisecond {
		t.Errorf("stream reset %v after the call, before its 500ms deadline", d.Round(time.Millisecond))
	}
}

// TestStreamsCountInTheStatus: streams are calls like any other in the
// driver's counts that `csibroker status` shows: in flight while open, then
// total, and failed when they end in an error.
func TestStreamsCountInTheStatus(t *testing.T) {
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: startStreamDriver(t)})
	conn := chaintest.Dial(t, c.Front)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	counts := func() (inflight, total, failed int64) {
		t.Helper()
		st := c.Broker.Status()
		if len(st) != 1 {
			t.Fatalf("status %+v", st)
		}
		return st[0].Inflight, st[0].Total, st[0].Failed
	}
	waitCounts := func(inflight, total, failed int64) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			i, n, f := counts()
			if i == inflight && n == total && f == failed {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("status counts in flight %d, total %d, failed %d; want %d, %d, %d", i, n, f, inflight, total, failed)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	i0, n0, f0 := counts()

	// A client stream that ends well.
	cs, err := conn.NewStream(ctx, &grpc.StreamDesc{ClientStreams: true}, "/csi.v2.Counter/Count")
	if err != nil {
		t.Fatal(err)
	}
	if err := cs.SendMsg(wrapperspb.Bytes([]byte("abc"))); err != nil {
		t.Fatal(err)
	}
	waitCounts(i0+1, n0, f0)
	if err := cs.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if err := cs.RecvMsg(&wrapperspb.Int64Value{}); err != nil {
		t.Fatal(err)
	}
	waitCounts(i0, n0+1, f0)

	// A server stream the caller abandons: it ends Canceled.
	sctx, scancel := context.WithCancel(ctx)
	st, err := csi.NewSnapshotMetadataClient(conn).GetMetadataAllocated(sctx, &csi.GetMetadataAllocatedRequest{SnapshotId: "s"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	waitCounts(i0+1, n0+1, f0)
	scancel()
	waitCounts(i0, n0+2, f0+1)
}

// TestFrontEndSocketIsNotTakenFromAnotherServer: a front-end socket that
// answers belongs to another server (a second broker sharing the
// directory) and is neither taken nor removed; on the way out a front end
// removes its socket file only while it is still its own.
func TestFrontEndSocketIsNotTakenFromAnotherServer(t *testing.T) {
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: startStreamDriver(t)})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.Broker.ServeSocket(ctx, echoName, c.Front); err == nil || !strings.Contains(err.Error(), "another process serves this socket") {
		t.Fatalf("serving a socket another server answers on: %v, want refused", err)
	}
	if _, err := csi.NewIdentityClient(chaintest.Dial(t, c.Front)).Probe(ctx, &csi.ProbeRequest{}); err != nil {
		t.Fatalf("the first server's socket after the refusal: %v", err)
	}

	path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
	sctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Broker.ServeSocket(sctx, echoName, path) }()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if nc, err := net.Dial("unix", path); err == nil {
			nc.Close()
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("the front end never served %s: %v", path, err)
		}
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o660 {
		t.Fatalf("the front-end socket's mode: %v, %v; want 0660", fi.Mode(), err)
	}
	// Another server takes the path over (as an operator's restart might).
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	other, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	stop()
	if err := <-done; err != nil {
		t.Fatalf("the front end's end: %v", err)
	}
	if nc, err := net.Dial("unix", path); err != nil {
		t.Fatalf("the other server's socket after the front end ended: %v", err)
	} else {
		nc.Close()
	}
}

// TestFrontEndShutdownBeforeThePreface: a connection whose caller has not
// sent its preface when the front end stops still gets SETTINGS first
// (RFC 9113, 3.4; gRPC's client fails a connection whose first frame is
// another), then GOAWAY.
func TestFrontEndShutdownBeforeThePreface(t *testing.T) {
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: startStreamDriver(t)})
	path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	done := make(chan error, 1)
	go func() { done <- c.Broker.ServeSocket(ctx, echoName, path) }()
	var nc net.Conn
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		var err error
		if nc, err = net.Dial("unix", path); err == nil {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("the front end never served %s: %v", path, err)
		}
	}
	defer nc.Close()
	time.Sleep(100 * time.Millisecond) // the connection is the front end's
	stop()
	time.Sleep(100 * time.Millisecond) // its GOAWAY is due
	nc.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := nc.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(nc, nc)
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	var types []http2.FrameType
	for len(types) < 4 {
		f, err := fr.ReadFrame()
		if err != nil {
			break
		}
		types = append(types, f.Header().Type)
	}
	if len(types) == 0 || types[0] != http2.FrameSettings || !slices.Contains(types, http2.FrameGoAway) {
		t.Fatalf("frames after a shutdown before the preface: %v, want SETTINGS first, then GOAWAY", types)
	}
	if err := <-done; err != nil {
		t.Fatalf("the front end's end: %v", err)
	}
}
