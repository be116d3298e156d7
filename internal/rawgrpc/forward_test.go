package rawgrpc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/testing/protocmp"
)

// serveUnix serves srv on a fresh unix socket and returns a client
// connection to it.
func serveUnix(t *testing.T, srv *grpc.Server) *grpc.ClientConn {
	t.Helper()
	dir, err := os.MkdirTemp("", "fw")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "s.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	cc, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

// backend answers by method:
//
//	/t.S/Echo   each request message back, then the status the request's
//	            metadata "code" and "msg" name (OK if none); headers and
//	            trailers echo the request's "x-*" metadata as "h-*"/"t-*",
//	            and "deadline-ms" in the header is the deadline left
//	/t.S/Early  the status at once, before reading anything
//	/t.S/Block  waits for the call's end, and reports it on cancelled
type backend struct {
	cancelled chan error
	calls     atomic.Int32
}

func (b *backend) handle(_ any, ss grpc.ServerStream) error {
	b.calls.Add(1)
	method, _ := grpc.MethodFromServerStream(ss)
	ctx := ss.Context()
	md, _ := metadata.FromIncomingContext(ctx)
	end := func() error {
		tr := metadata.MD{}
		for k, v := range md {
			if len(k) > 2 && k[:2] == "x-" {
				tr["t-"+k[2:]] = v
			}
		}
		ss.SetTrailer(tr)
		code := codes.OK
		if v := md.Get("code"); len(v) > 0 {
			n, _ := strconv.Atoi(v[0])
			code = codes.Code(n)
		}
		if code == codes.OK {
			return nil
		}
		msg := ""
		if v := md.Get("msg-bin"); len(v) > 0 {
			msg = v[0]
		}
		st := status.New(code, msg)
		if len(md.Get("details")) > 0 {
			st, _ = st.WithDetails(&errdetails.ErrorInfo{Reason: "r", Domain: "d", Metadata: map[string]string{"k": "v"}})
		}
		return st.Err()
	}
	switch method {
	case "/t.S/Early":
		return end()
	case "/t.S/Block":
		<-ctx.Done()
		b.cancelled <- ctx.Err()
		return ctx.Err()
	}
	hd := metadata.MD{}
	for k, v := range md {
		if len(k) > 2 && k[:2] == "x-" {
			hd["h-"+k[2:]] = v
		}
	}
	if dl, ok := ctx.Deadline(); ok {
		hd.Set("deadline-ms", strconv.FormatInt(time.Until(dl).Milliseconds(), 10))
	}
	if len(md.Get("no-headers")) == 0 {
		if err := ss.SendHeader(hd); err != nil {
			return err
		}
	}
	for {
		var f Frame
		if err := ss.RecvMsg(&f); err != nil {
			if errors.Is(err, io.EOF) {
				return end()
			}
			return err
		}
		if err := ss.SendMsg(&f); err != nil {
			return err
		}
	}
}

// startForwarder starts backend and a forwarding server in front of it,
// and returns a client connection to the forwarder. With prefetch, the
// forwarder waits for each call's first message before it calls the
// backend.
func startForwarder(t *testing.T, prefetch ...bool) (*grpc.ClientConn, *backend) {
	t.Helper()
	b := &backend{cancelled: make(chan error, 1)}
	back := serveUnix(t, grpc.NewServer(grpc.ForceServerCodecV2(Codec{}), grpc.UnknownServiceHandler(b.handle)))
	front := grpc.NewServer(grpc.ForceServerCodecV2(Codec{}), grpc.UnknownServiceHandler(func(_ any, in grpc.ServerStream) error {
		method, _ := grpc.MethodFromServerStream(in)
		if len(prefetch) > 0 && prefetch[0] {
			var err error
			if in, err = Prefetch(in); err != nil {
				return err
			}
		}
		ctx, cancel := context.WithCancel(in.Context())
		defer cancel()
		ctx, _ = OutgoingContext(ctx)
		out, err := back.NewStream(ctx, StreamDesc, method, grpc.ForceCodecV2(Codec{}))
		if err != nil {
			return err
		}
		return Forward(in, out)
	}))
	return serveUnix(t, front), b
}

type result struct {
	header, trailer metadata.MD
	msgs            []string
	err             error
}

// call sends msgs on method with md and collects the answer.
func call(ctx context.Context, cc *grpc.ClientConn, method string, md metadata.MD, msgs ...string) result {
	ctx = metadata.NewOutgoingContext(ctx, md)
	var r result
	s, err := cc.NewStream(ctx, StreamDesc, method, grpc.ForceCodecV2(Codec{}))
	if err != nil {
		r.err = err
		return r
	}
	for _, m := range msgs {
		if err := s.SendMsg(&Frame{Payload: []byte(m)}); err != nil {
			break
		}
	}
	s.CloseSend()
	for {
		var f Frame
		if err := s.RecvMsg(&f); err != nil {
			if !errors.Is(err, io.EOF) {
				r.err = err
			}
			break
		}
		r.msgs = append(r.msgs, string(f.Payload))
	}
	r.header, _ = s.Header()
	r.trailer = s.Trailer()
	return r
}

func TestForwardStatusPassesThrough(t *testing.T) {
	cc, _ := startForwarder(t)
	codesToTry := []codes.Code{42, 1000}
	for c := codes.OK; c <= codes.Unauthenticated; c++ {
		codesToTry = append(codesToTry, c)
	}
	for _, code := range codesToTry {
		for _, method := range []string{"/t.S/Echo", "/t.S/Early"} {
			t.Run(fmt.Sprintf("%s/%d", method, code), func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				msg := "it went wrong: 100% ünïcode\n"
				r := call(ctx, cc, method, metadata.Pairs("code", strconv.Itoa(int(code)), "msg-bin", msg, "details", "1"), "a")
				st := status.Convert(r.err)
				if st.Code() != code {
					t.Fatalf("code %v, want %v (%v)", st.Code(), code, r.err)
				}
				if code == codes.OK {
					return
				}
				if st.Message() != msg {
					t.Errorf("message %q, want %q", st.Message(), msg)
				}
				want := []any{&errdetails.ErrorInfo{Reason: "r", Domain: "d", Metadata: map[string]string{"k": "v"}}}
				if d := cmp.Diff(want, st.Details(), protocmp.Transform()); d != "" {
					t.Errorf("details (-want +got):\n%s", d)
				}
			})
		}
	}
}

func TestForwardMessagesAndMetadata(t *testing.T) {
	for _, prefetch := range []bool{false, true} {
		t.Run(fmt.Sprintf("prefetch=%v", prefetch), func(t *testing.T) { testForwardMessagesAndMetadata(t, prefetch) })
	}
}

func testForwardMessagesAndMetadata(t *testing.T, prefetch bool) {
	cc, _ := startForwarder(t, prefetch)
	bin := string([]byte{0, 1, 2, 0xff})
	tests := []struct {
		name   string
		method string
		md     metadata.MD
		msgs   []string
		want   result
	}{{
		name:   "unary with headers, trailers and binary metadata",
		method: "/t.S/Echo",
		md:     metadata.Pairs("x-a", "1", "x-b-bin", bin),
		msgs:   []string{"one"},
		want: result{msgs: []string{"one"},
			header:  metadata.Pairs("h-a", "1", "h-b-bin", bin),
			trailer: metadata.Pairs("t-a", "1", "t-b-bin", bin)},
	}, {
		name:   "a stream both ways",
		method: "/t.S/Echo",
		md:     metadata.Pairs("x-a", "1"),
		msgs:   []string{"1", "", "3", string(make([]byte, 3<<20))},
		want: result{msgs: []string{"1", "", "3", string(make([]byte, 3<<20))},
			header: metadata.Pairs("h-a", "1"), trailer: metadata.Pairs("t-a", "1")},
	}, {
		name:   "no message either way",
		method: "/t.S/Echo",
		md:     metadata.Pairs("x-a", "1"),
		want:   result{header: metadata.Pairs("h-a", "1"), trailer: metadata.Pairs("t-a", "1")},
	}, {
		name:   "a status alone, with trailers",
		method: "/t.S/Early",
		md:     metadata.Pairs("x-a", "1", "code", "5"),
		msgs:   []string{"ignored", "ignored"},
		want:   result{trailer: metadata.Pairs("t-a", "1"), err: status.Error(codes.NotFound, "")},
	}, {
		name:   "an error after the messages, headers never sent",
		method: "/t.S/Echo",
		md:     metadata.Pairs("no-headers", "1", "code", "10", "msg-bin", "m", "x-a", "1"),
		msgs:   []string{"m1"},
		want:   result{msgs: []string{"m1"}, trailer: metadata.Pairs("t-a", "1"), err: status.Error(codes.Aborted, "m")},
	}}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			got := call(ctx, cc, tc.method, tc.md, tc.msgs...)
			if status.Code(got.err) != status.Code(tc.want.err) || status.Convert(got.err).Message() != status.Convert(tc.want.err).Message() {
				t.Fatalf("error %v, want %v", got.err, tc.want.err)
			}
			if d := cmp.Diff(tc.want.msgs, got.msgs); d != "" {
				t.Errorf("messages (-want +got):\n%s", d)
			}
			strip := func(md metadata.MD) metadata.MD {
				md = md.Copy()
				delete(md, "content-type")
				delete(md, "deadline-ms")
				if len(md) == 0 {
					return nil
				}
				return md
			}
			if d := cmp.Diff(strip(tc.want.header), strip(got.header)); d != "" {
				t.Errorf("header (-want +got):\n%s", d)
			}
			if d := cmp.Diff(strip(tc.want.trailer), strip(got.trailer)); d != "" {
				t.Errorf("trailer (-want +got):\n%s", d)
			}
		})
	}
}

func TestForwardDeadlineAndCancellation(t *testing.T) {
	cc, b := startForwarder(t)
	t.Run("deadline", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		r := call(ctx, cc, "/t.S/Echo", nil, "x")
		if r.err != nil {
			t.Fatal(r.err)
		}
		v := r.header.Get("deadline-ms")
		if len(v) == 0 {
			t.Fatal("the backend saw no deadline")
		}
		if ms, _ := strconv.Atoi(v[0]); ms <= 2000 || ms > 3000 {
			t.Errorf("the backend saw %s ms left, want about 3000", v[0])
		}
	})
	t.Run("deadline expires", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		r := call(ctx, cc, "/t.S/Block", nil)
		if status.Code(r.err) != codes.DeadlineExceeded {
			t.Errorf("caller: %v, want DeadlineExceeded", r.err)
		}
		select {
		case err := <-b.cancelled:
			if err == nil {
				t.Error("the backend's call did not end")
			}
		case <-time.After(5 * time.Second):
			t.Fatal("the backend's call did not end")
		}
	})
	t.Run("cancellation", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan result, 1)
		go func() { done <- call(ctx, cc, "/t.S/Block", nil) }()
		time.Sleep(100 * time.Millisecond)
		cancel()
		if r := <-done; status.Code(r.err) != codes.Canceled {
			t.Errorf("caller: %v, want Canceled", r.err)
		}
		select {
		case err := <-b.cancelled:
			if !errors.Is(err, context.Canceled) {
				t.Errorf("the backend's call ended with %v, want Canceled", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("the cancellation did not reach the backend")
		}
	})
}

func TestForwardedMetadata(t *testing.T) {
	in := metadata.MD{
		":authority": {"a"}, "content-type": {"application/grpc"}, "user-agent": {"u"}, "te": {"trailers"},
		"grpc-timeout": {"1S"}, "grpc-trace-bin": {"x"}, ":path": {"/p"},
		"traceparent": {"00-..."}, "tracestate": {"s"}, "baggage": {"b"},
		"x-csibroker-node": {"n1"}, "k-bin": {string([]byte{0, 1})}, "multi": {"1", "2"},
	}
	want := metadata.MD{"x-csibroker-node": {"n1"}, "k-bin": {string([]byte{0, 1})}, "multi": {"1", "2"}}
	got := ForwardedMetadata(in)
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("(-want +got):\n%s", d)
	}
	got["multi"][0] = "changed"
	if in["multi"][0] != "1" {
		t.Error("the copy shares its values with the incoming metadata")
	}
	if d := cmp.Diff(metadata.MD{}, ForwardedMetadata(nil)); d != "" {
		t.Errorf("nil: %s", d)
	}
}

// TestPrefetchWaitsForTheRequest: with Prefetch, a call that has sent
// nothing has not reached the backend; its first message, when it comes,
// is the first the backend receives.
func TestPrefetchWaitsForTheRequest(t *testing.T) {
	cc, b := startForwarder(t, true)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := cc.NewStream(ctx, StreamDesc, "/t.S/Echo", grpc.ForceCodecV2(Codec{}))
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	if n := b.calls.Load(); n != 0 {
		t.Fatalf("the backend has %d calls before the request was sent", n)
	}
	if err := s.SendMsg(&Frame{Payload: []byte("first")}); err != nil {
		t.Fatal(err)
	}
	s.CloseSend()
	var f Frame
	if err := s.RecvMsg(&f); err != nil || string(f.Payload) != "first" {
		t.Fatalf("answer %q, %v", f.Payload, err)
	}
	if err := s.RecvMsg(&f); !errors.Is(err, io.EOF) {
		t.Fatalf("end: %v", err)
	}
	if n := b.calls.Load(); n != 1 {
		t.Errorf("the backend had %d calls, want 1", n)
	}
}
