package chain

import (
	"context"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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
