package grpcsrv

import (
	"context"
	"crypto/x509"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/rawgrpc"
	"github.com/csibroker/csibroker/internal/testutil"
)

// peak records the most calls echo handled at once.
var active, peak atomic.Int32

// echo answers every method with its request; "/t.S/Block" first waits
// for release to be closed.
func echo(release <-chan struct{}) grpc.StreamHandler {
	return func(_ any, ss grpc.ServerStream) error {
		n := active.Add(1)
		defer active.Add(-1)
		for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
		}
		var f rawgrpc.Frame
		if err := ss.RecvMsg(&f); err != nil {
			return err
		}
		if m, _ := grpc.MethodFromServerStream(ss); m == "/t.S/Block" {
			select {
			case <-release:
			case <-ss.Context().Done():
				return ss.Context().Err()
			}
		}
		return ss.SendMsg(&f)
	}
}

func invoke(ctx context.Context, cc *grpc.ClientConn, method string, payload []byte) error {
	return cc.Invoke(ctx, method, &rawgrpc.Frame{Payload: payload}, &rawgrpc.Frame{}, grpc.ForceCodecV2(rawgrpc.Codec{}))
}

// unixServer serves a raw echo server with opts on a temporary socket
// (through UnixListener) and dials it with DialUnix.
func unixServer(t *testing.T, release <-chan struct{}, opts ...grpc.ServerOption) *grpc.ClientConn {
	t.Helper()
	dir, err := os.MkdirTemp("", "gs")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "s.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(append(opts, grpc.ForceServerCodecV2(rawgrpc.Codec{}), grpc.UnknownServiceHandler(echo(release)))...)
	go srv.Serve(UnixListener(lis))
	t.Cleanup(srv.Stop)
	cc, err := grpc.NewClient("passthrough:///"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithContextDialer(DialUnix))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

func TestLimitsDefaults(t *testing.T) {
	got := Limits{MaxConcurrentStreams: 7, KeepaliveTime: time.Second}.WithDefaults()
	want := Limits{MaxConcurrentStreams: 7, MaxRecvMsgSize: DefaultMaxMsgSize, MaxSendMsgSize: DefaultMaxMsgSize,
		MaxHeaderListSize: DefaultMaxHeaderListSize, KeepaliveMinTime: DefaultKeepaliveMinTime, KeepaliveTime: time.Second,
		KeepaliveTimeout: DefaultKeepaliveTimeout, ConnectionTimeout: DefaultConnectionTimeout, MaxConnectionIdle: DefaultMaxConnectionIdle}
	if got != want {
		t.Errorf("got %+v\nwant %+v", got, want)
	}
	// The broker pings idle connections every 30 s: a policy stricter than
	// that would disconnect it.
	if d := (Limits{}).WithDefaults(); d.KeepaliveMinTime > 20*time.Second {
		t.Errorf("default KeepaliveMinTime %v is over 20s", d.KeepaliveMinTime)
	}
}

// TestServerOptionsLimits: the limits of ServerOptions hold on a real
// server.
func TestServerOptionsLimits(t *testing.T) {
	release := make(chan struct{})
	cc := unixServer(t, release, ServerOptions(Limits{MaxConcurrentStreams: 2, MaxRecvMsgSize: 1 << 10, MaxHeaderListSize: 8 << 10})...)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	t.Run("message size", func(t *testing.T) {
		if err := invoke(ctx, cc, "/t.S/M", make([]byte, 1<<10)); err != nil {
			t.Fatalf("a message at the limit: %v", err)
		}
		if err := invoke(ctx, cc, "/t.S/M", make([]byte, 1<<10+1)); status.Code(err) != codes.ResourceExhausted {
			t.Fatalf("a message over the limit: %v, want ResourceExhausted", err)
		}
	})
	t.Run("header list size", func(t *testing.T) {
		big := metadata.AppendToOutgoingContext(ctx, "x-big", strings.Repeat("a", 16<<10))
		if err := invoke(big, cc, "/t.S/M", nil); err == nil {
			t.Fatal("metadata over the header list limit was accepted")
		}
	})
	t.Run("concurrent streams", func(t *testing.T) {
		peak.Store(0)
		var wg sync.WaitGroup
		done := make(chan error, 5)
		for range 5 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				done <- invoke(ctx, cc, "/t.S/Block", nil)
			}()
		}
		time.Sleep(300 * time.Millisecond)
		if n := active.Load(); n != 2 {
			t.Errorf("%d calls in the handler at once, want the limit, 2", n)
		}
		close(release)
		wg.Wait()
		close(done)
		for err := range done {
			if err != nil {
				t.Errorf("a call queued behind the stream limit: %v", err)
			}
		}
		if n := peak.Load(); n != 2 {
			t.Errorf("at most %d calls in the handler at once, want 2", n)
		}
	})
}

func TestSocketBuffers(t *testing.T) {
	cc := unixServer(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := invoke(ctx, cc, "/t.S/M", nil); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	sock := filepath.Join(dir, "b.sock")
	if len(sock) > 100 {
		t.Skip("temp dir too long for a socket path")
	}
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := UnixListener(lis).Accept()
		if err == nil {
			accepted <- c
		}
	}()
	c, err := DialUnix(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s := <-accepted
	defer s.Close()
	limit := SocketBuffer
	if b, err := os.ReadFile("/proc/sys/net/core/wmem_max"); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && n < limit {
			limit = n // the kernel caps what a process may set
		}
	}
	for name, conn := range map[string]net.Conn{"dialled": c, "accepted": s} {
		snd, rcv, err := SocketBuffers(conn)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: SO_SNDBUF %d, SO_RCVBUF %d", name, snd, rcv)
		if snd < limit {
			t.Errorf("%s: SO_SNDBUF %d, want at least %d", name, snd, limit)
		}
	}
}

// switchSource is a Source whose material a test replaces.
type switchSource struct{ m atomic.Pointer[mtls.Material] }

func (s *switchSource) Current() *mtls.Material { return s.m.Load() }

// tlsServer serves a raw echo server with Credentials on loopback TCP;
// the server trusts the source's pool and only the broker's identity.
func tlsServer(t *testing.T, src mtls.Source, log *slog.Logger) string {
	t.Helper()
	cfg := mtls.ServerConfig(src, mtls.AuthorizeOneOf(mtls.BrokerID("test")))
	srv := grpc.NewServer(grpc.Creds(Credentials(cfg, log, LogHandshakeRefusals("handshake refused a peer"))), grpc.StatsHandler(CallTracker()),
		grpc.ChainUnaryInterceptor(UnaryCheckPeer()), grpc.ChainStreamInterceptor(StreamCheckPeer()),
		grpc.ForceServerCodecV2(rawgrpc.Codec{}), grpc.UnknownServiceHandler(echo(nil)))
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}

func dialTLS(t *testing.T, addr string, m *mtls.Material) *grpc.ClientConn {
	t.Helper()
	cfg := mtls.ClientConfig(mtls.StaticSource{M: m}, mtls.AuthorizeAny())
	cc, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

// waitClosed waits for cc's connection to leave READY (the server closed it).
func waitClosed(t *testing.T, cc *grpc.ClientConn) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for s := cc.GetState(); s == connectivity.Ready; s = cc.GetState() {
		if !cc.WaitForStateChange(ctx, s) {
			t.Fatal("the server kept the connection of a refused peer open")
		}
	}
}

func TestCheckPeer(t *testing.T) {
	now := time.Now()
	ca, err := mtls.NewCA("test CA", now.Add(-time.Hour), now.Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	leaf := func(id string, notAfter time.Time) *mtls.Material {
		m, err := ca.IssueMaterial(mtls.Leaf{ID: id, NotBefore: now.Add(-time.Minute), NotAfter: notAfter})
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	server := leaf("spiffe://test/csibroker/driver/d", now.Add(time.Hour))

	t.Run("expired since the handshake", func(t *testing.T) {
		var logs testutil.SyncBuffer
		src := &switchSource{}
		src.m.Store(server)
		addr := tlsServer(t, src, slog.New(slog.NewTextHandler(&logs, nil)))
		expiry := time.Now().Add(1500 * time.Millisecond)
		cc := dialTLS(t, addr, leaf(mtls.BrokerID("test"), expiry))
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := invoke(ctx, cc, "/t.S/M", nil); err != nil {
			t.Fatalf("a call before expiry: %v", err)
		}
		time.Sleep(time.Until(expiry) + 100*time.Millisecond)
		err := invoke(ctx, cc, "/t.S/M", nil)
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "expired") {
			t.Fatalf("a call after expiry: %v, want Unavailable naming the expiry", err)
		}
		waitClosed(t, cc)
		if l := logs.String(); !strings.Contains(l, "level=INFO") || !strings.Contains(l, "expired since the handshake") || strings.Contains(l, "level=WARN") {
			t.Errorf("logs:\n%s\nwant one INFO line about the expiry, no warning", l)
		}
		// The new handshake fails (the client hears "bad certificate"),
		// and the server's log says why.
		if err := invoke(ctx, cc, "/t.S/M", nil); status.Code(err) != codes.Unavailable {
			t.Errorf("a call on a new connection: %v, want Unavailable", err)
		}
		if l := logs.String(); !strings.Contains(l, "level=WARN msg=\"handshake refused a peer\"") || !strings.Contains(l, "expired") {
			t.Errorf("the refused handshake was not logged:\n%s", l)
		}
	})

	t.Run("CA left the bundle", func(t *testing.T) {
		var logs testutil.SyncBuffer
		src := &switchSource{}
		src.m.Store(server)
		addr := tlsServer(t, src, slog.New(slog.NewTextHandler(&logs, nil)))
		cc := dialTLS(t, addr, leaf(mtls.BrokerID("test"), now.Add(time.Hour)))
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := invoke(ctx, cc, "/t.S/M", nil); err != nil {
			t.Fatal(err)
		}
		other, err := mtls.NewCA("another CA", now.Add(-time.Hour), now.Add(time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		// A reload makes new material (a new certificate value, the same
		// leaf) with the new bundle.
		m := *server
		cert := *server.Cert
		m.Cert, m.Pool = &cert, mustPool(t, other)
		src.m.Store(&m)
		err = invoke(ctx, cc, "/t.S/M", nil)
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "no longer verifies") {
			t.Fatalf("a call after the CA left: %v, want Unavailable", err)
		}
		waitClosed(t, cc)
		if l := logs.String(); !strings.Contains(l, "level=WARN") || !strings.Contains(l, "no longer verifies") {
			t.Errorf("logs:\n%s\nwant a warning", l)
		}
	})

	t.Run("a refused connection closes after its calls in flight", func(t *testing.T) {
		// What CallTracker counts: the connection stays while a call
		// runs on it.
		c := &connState{nc: &fakeConn{}, log: slog.New(slog.DiscardHandler)}
		c.inflight.Add(2)
		c.refused.Store(true)
		c.release()
		time.Sleep(2 * closeLinger)
		if c.nc.(*fakeConn).closed.Load() {
			t.Fatal("closed with a call in flight")
		}
		c.release()
		time.Sleep(2 * closeLinger)
		if !c.nc.(*fakeConn).closed.Load() {
			t.Fatal("not closed after its last call")
		}
	})
}

type fakeConn struct {
	net.Conn
	closed atomic.Bool
}

func (f *fakeConn) Close() error { f.closed.Store(true); return nil }

func mustPool(t *testing.T, ca *mtls.CA) *x509.CertPool {
	t.Helper()
	p := x509.NewCertPool()
	if !p.AppendCertsFromPEM(ca.CertPEM) {
		t.Fatal("CA certificate not parsed")
	}
	return p
}
