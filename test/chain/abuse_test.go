package chain

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"runtime/metrics"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/grpcsrv"
	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/proxy"
)

// Abuse: raw HTTP/2 peers attack the servers on the CSI path (the
// front-end socket, the TCP front end, the proxy), each attack for
// abuseAttack, while a normal client calls the same server on a
// connection of its own. For every attack and server:
//
//   - the heap (live after a GC, sampled through the attack and once at
//     its end; every server runs in this process) stays within
//     abuseHeapBudget of what it was idle;
//   - the attacking connection is closed, or throttled: each case says
//     which, what grpc-go does to get there, and asserts it;
//   - the normal client's calls keep succeeding: none fails (each has
//     the sidecars' default timeout, 10 s) and at least one ends during
//     the attack;
//   - the driver never has more calls at once than the proxy's bound
//     (proxy.Config.MaxConcurrentCalls; the chain runs with its
//     default), and has none left once the attacker has gone.
//
// Each attack is bounded by abuseAttack and by a count of frames. One
// second each keeps the 21 cases well under a minute; the bounds they
// check do not depend on it: the held memory of "peer never reads" is the
// same after 1, 3 and 6 s (measured), and the floods cost nothing that
// accumulates.

const (
	// abuseAttack is how long each attack lasts.
	abuseAttack = time.Second
	// abuseHeapBudget is how far above idle the heap may go.
	abuseHeapBudget = 64 << 20
	// abuseDriverLimit is the most calls the driver may have at once:
	// the chain's proxy runs with the default bound.
	abuseDriverLimit = proxy.DefaultMaxConcurrentCalls
	// abuseStreamLimit is every server's stream limit per connection:
	// the front ends' grpcsrv default, and the proxy's MaxConcurrentCalls.
	abuseStreamLimit = grpcsrv.DefaultMaxConcurrentStreams
	// abuseFloodStreams bounds the streams an attacking connection
	// opens. What it has sent when it goes is in the server's socket
	// buffers (up to 6 MiB on loopback TCP), which the server still
	// reads and serves: this many keep that under a few seconds.
	abuseFloodStreams = 16 << 10
	// abuseNormalTimeout bounds each of the normal client's calls (the
	// sidecars' default --timeout).
	abuseNormalTimeout = 10 * time.Second
)

const (
	createPath   = "/csi.v1.Controller/CreateVolume"
	snapshotPath = "/csi.v1.SnapshotMetadata/GetMetadataAllocated" // server streaming
)

// TestAbuse runs every attack against every server (see above).
func TestAbuse(t *testing.T) {
	e := startAbuseEnv(t)
	for _, ac := range abuseCases() {
		for _, tg := range e.targets {
			t.Run(ac.name+"/"+tg.name, func(t *testing.T) { e.runCase(t, ac, tg) })
		}
	}
}

// abuseCase is one attack.
type abuseCase struct {
	name string
	// run attacks tg until ctx ends and returns its connections.
	run func(ctx context.Context, t *testing.T, tg *abuseTarget) []*attacker
	// check asserts what happened to the attacking connections (closed,
	// throttled) and says it.
	check func(t *testing.T, r *abuseResult) string
}

// abuseResult is what a case measured.
type abuseResult struct {
	attackers []*attacker
	// goroutines is the most goroutines above idle during the attack.
	goroutines int64
	// driverCalls is how many calls the driver had during the attack,
	// the normal client's included.
	driverCalls int64
	normal      normalCalls
}

func abuseCases() []abuseCase {
	// A call that reaches the driver and holds it 20 ms.
	held := grpcMessage(&csi.CreateVolumeRequest{Name: "abuse", Parameters: map[string]string{"hold-ms": "20"}})
	return []abuseCase{
		{
			// HEADERS, the request and RST_STREAM, over and over, on two
			// connections (CVE-2023-44487). grpc-go does not close the
			// connection for it (it does not count resets; closing after
			// too many is Go's net/http answer, not grpc-go's): it runs
			// at most MaxConcurrentStreams handlers per connection and
			// stops reading the connection while that many run, so the
			// server takes the flood no faster than it ends those calls:
			// throttled. Asserted through the goroutines: at most a few
			// per allowed stream (about one is measured, since most
			// calls end before they reach the chain), where an
			// unthrottled server would hold one per reset stream in
			// flight (tens of thousands are sent).
			name: "rapid reset",
			run: func(ctx context.Context, t *testing.T, tg *abuseTarget) []*attacker {
				return inParallel(ctx, t, tg, 2, true, func(ctx context.Context, a *attacker) {
					a.until(ctx, abuseFloodStreams/32, func() bool {
						for range 32 {
							id := a.headers(createPath, false)
							a.fr.WriteData(id, true, held)
							a.fr.WriteRSTStream(id, http2.ErrCodeCancel)
							a.streams++
						}
						return true
					})
				})
			},
			check: func(t *testing.T, r *abuseResult) string {
				var sent []string
				for i, a := range r.attackers {
					if c, how := a.closed(); c {
						t.Logf("attacker %d: %s (grpc-go did not close a reset flood when this was written)", i, how)
					}
					sent = append(sent, strconv.Itoa(a.streams))
				}
				if bound := int64(len(r.attackers) * abuseStreamLimit * 8); r.goroutines > bound {
					t.Errorf("%d goroutines above idle during the flood, more than %d (8 per allowed stream): the resets are not throttled", r.goroutines, bound)
				}
				return fmt.Sprintf("throttled (%s streams reset; +%d goroutines at most)", strings.Join(sent, "+"), r.goroutines)
			},
		},
		neverFinished("streams never finished (unary)", createPath),
		neverFinished("streams never finished (server stream)", snapshotPath),
		{
			// A HEADERS frame without END_HEADERS, then CONTINUATION
			// frames of 16 KiB header fields without end (CVE-2024-27316
			// and its kin): once the header list passes MaxHeaderListSize
			// (1 MiB) x/net's framer, which grpc-go reads with, returns a
			// connection error, and grpc-go closes the connection (with
			// no GOAWAY first): closed.
			name: "CONTINUATION flood",
			run: func(ctx context.Context, t *testing.T, tg *abuseTarget) []*attacker {
				a := attack(t, tg, true)
				a.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: a.headerBlock(createPath), EndHeaders: false})
				pad := strings.Repeat("p", 16<<10)
				a.until(ctx, 1<<14, func() bool {
					for range 4 {
						a.hbuf.Reset()
						a.enc.WriteField(hpack.HeaderField{Name: "x-pad-" + strconv.Itoa(a.frames), Value: pad, Sensitive: true})
						a.fr.WriteContinuation(1, false, a.hbuf.Bytes())
						a.frames++
					}
					c, _ := a.closed()
					return !c
				})
				<-closedOr(a, time.Second)
				return []*attacker{a}
			},
			check: func(t *testing.T, r *abuseResult) string {
				a := r.attackers[0]
				c, how := a.closed()
				if !c {
					t.Errorf("the server kept a connection open that sent %d CONTINUATION frames (%d MiB of header fields)", a.frames, a.frames*16>>10)
				}
				return fmt.Sprintf("closed (%s) after %d frames sent", how, a.frames)
			},
		},
		{
			// The same with empty CONTINUATION frames: the header list
			// never grows, so MaxHeaderListSize never ends it, and
			// grpc-go's framer reads them as fast as they come, holding
			// nothing: neither closed nor throttled, for as long as the
			// peer keeps sending. What ends it is keepalive: no frame is
			// ever complete, so after KeepaliveTime (1 min) without one
			// the server pings, and after KeepaliveTimeout (20 s)
			// without the ack (which cannot come inside a header block)
			// it closes the connection: about 80 s, beyond this test.
			// This is grpc-go's (x/net's) behaviour, not something a
			// server option changes. Asserted instead: the attack costs
			// the server nothing that accumulates (no goroutine, no
			// heap, no call; the other connections unaffected).
			name: "empty CONTINUATION flood",
			run: func(ctx context.Context, t *testing.T, tg *abuseTarget) []*attacker {
				a := attack(t, tg, true)
				a.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: a.headerBlock(createPath), EndHeaders: false})
				a.until(ctx, 1<<16, func() bool {
					for range 256 {
						a.fr.WriteContinuation(1, false, nil)
					}
					a.frames += 256
					return true
				})
				return []*attacker{a}
			},
			check: func(t *testing.T, r *abuseResult) string {
				a := r.attackers[0]
				if r.goroutines > 50 {
					t.Errorf("%d goroutines above idle during a flood of empty CONTINUATION frames on one connection", r.goroutines)
				}
				if c, how := a.closed(); c {
					return fmt.Sprintf("closed (%s) after %d frames sent", how, a.frames)
				}
				return fmt.Sprintf("neither: still open (%d empty frames sent, writes waited %v of %v)", a.frames, a.blocked.Round(time.Millisecond), abuseAttack)
			},
		},
		{
			// PING frames as fast as they go. Keepalive enforcement
			// (MinTime 10 s, pings allowed without calls) counts a strike
			// for every ping sooner than MinTime after the last, and on
			// the third strike sends GOAWAY ENHANCE_YOUR_CALM
			// "too_many_pings" and closes: closed, after at most four
			// acks (the first ping is no strike; each is acked before it
			// is judged).
			name: "PING flood",
			run: func(ctx context.Context, t *testing.T, tg *abuseTarget) []*attacker {
				a := attack(t, tg, true)
				a.until(ctx, 1<<16, func() bool {
					for i := range 64 {
						a.fr.WritePing(false, [8]byte{byte(i), 1, 2, 3, 4, 5, 6, 7})
					}
					a.frames += 64
					c, _ := a.closed()
					return !c
				})
				<-closedOr(a, time.Second)
				return []*attacker{a}
			},
			check: func(t *testing.T, r *abuseResult) string {
				a := r.attackers[0]
				c, how := a.closed()
				acks := a.count(http2.FramePing)
				switch {
				case !c:
					t.Errorf("the server kept a connection that sent %d PINGs open (%d acks)", a.frames, acks)
				case a.goAwayCode() != http2.ErrCodeEnhanceYourCalm:
					t.Errorf("%s, want GOAWAY ENHANCE_YOUR_CALM", how)
				}
				if acks > 4 {
					t.Errorf("%d PINGs acknowledged, want at most 4 (a ping, then keepalive's 3 strikes)", acks)
				}
				// Most of what was "sent" is still in the socket buffers
				// when the server closes.
				return fmt.Sprintf("closed (%s) after %d acks, %d PINGs sent", how, acks, a.frames)
			},
		},
		{
			// Calls whose answers are never read, on two connections,
			// offering HTTP/2's default 64 KiB windows and reading
			// nothing, for 1 KiB answers. The first 64 or so answers fill
			// the peer's connection window; the calls behind them cannot
			// send theirs
			// and so stay among the connection's streams (grpc-go counts
			// a stream until its end is written), so once
			// MaxConcurrentStreams of them wait, every further stream is
			// refused (RST_STREAM REFUSED_STREAM, a few bytes each) and
			// never reaches the driver: throttled. What the server holds
			// is those streams and their answers: MaxConcurrentStreams
			// answers per connection. Asserted: the driver had no more
			// of the attackers' calls than that (and the 64), out of
			// tens of thousands sent.
			name: "peer never reads",
			run: func(ctx context.Context, t *testing.T, tg *abuseTarget) []*attacker {
				req := grpcMessage(&csi.CreateVolumeRequest{Name: "abuse", Parameters: map[string]string{"hold-ms": "5", "reply-bytes": "1024"}})
				return inParallel(ctx, t, tg, 2, false, func(ctx context.Context, a *attacker) {
					a.until(ctx, abuseFloodStreams/16, func() bool {
						for range 16 {
							id := a.headers(createPath, false)
							a.fr.WriteData(id, true, req)
							a.streams++
						}
						return true
					})
				})
			},
			check: func(t *testing.T, r *abuseResult) string {
				var sent []string
				for i, a := range r.attackers {
					if c, how := a.closed(); c {
						t.Logf("attacker %d: %s", i, how)
					}
					sent = append(sent, strconv.Itoa(a.streams))
				}
				// Per connection: the calls whose answers fit in the
				// window and so ended, then MaxConcurrentStreams waiting
				// (and the proxy's own Probe and GetPluginInfo may come).
				taken := r.driverCalls - int64(r.normal.ok+r.normal.failed)
				if bound := int64(len(r.attackers)*(abuseStreamLimit+64) + 16); taken > bound {
					t.Errorf("the driver had %d of the attackers' calls, more than %d (per connection, its stream limit and the 64 answers its window holds): the server kept taking calls whose answers could not be sent", taken, bound)
				}
				return fmt.Sprintf("throttled (%s calls sent, %d reached the driver)", strings.Join(sent, "+"), taken)
			},
		},
	}
}

// neverFinished opens more streams to path than the server's stream limit,
// on one connection, each with its HEADERS and the first byte of a message
// that never comes whole, and holds them open. The server holds at most
// its stream limit of them and refuses the rest (RST_STREAM
// REFUSED_STREAM): throttled.
//
// At the proxy neither kind goes further: it takes a driver slot and
// opens a driver stream only once a call's request has come
// (rawgrpc.Prefetch). A unary call at a front end waits there for its
// request too. A server-streaming call, though, is forwarded by the front
// ends as soon as it opens, so each of these streams holds one of the
// streams of the broker's connection to the proxy (which takes
// MaxConcurrentCalls streams per connection) until the attacker goes: one
// front-end connection's streams hold them all, and every other call
// through the broker, the Kubernetes controllers' too, waits for one
// until its deadline (the normal client's calls end DeadlineExceeded after
// abuseNormalTimeout). That is csibroker's front end, not grpc-go, and is
// left failing here until the front end waits for the request as the
// proxy does.
func neverFinished(name, path string) abuseCase {
	const over = 64
	return abuseCase{
		name: name,
		run: func(ctx context.Context, t *testing.T, tg *abuseTarget) []*attacker {
			a := attack(t, tg, true)
			part := []byte{0, 0, 0, 1, 0, 'x'} // a 256-byte message, one byte of it
			a.until(ctx, abuseStreamLimit+over, func() bool {
				id := a.headers(path, false)
				a.fr.WriteData(id, false, part)
				a.streams++
				return a.streams < abuseStreamLimit+over
			})
			a.flush()
			<-ctx.Done()
			return []*attacker{a}
		},
		check: func(t *testing.T, r *abuseResult) string {
			a := r.attackers[0]
			if c, how := a.closed(); c {
				return fmt.Sprintf("closed (%s)", how)
			}
			if n := a.refused(); n < over {
				t.Errorf("%d of %d streams refused, want at least the %d over the limit of %d", n, a.streams, over, abuseStreamLimit)
			}
			return fmt.Sprintf("throttled (%d streams opened, %d refused)", a.streams, a.refused())
		},
	}
}

// abuseDriver is a CSI driver that counts the calls it has at once: a
// unary call from the moment its request has arrived, a stream from its
// start, each until its handler returns. CreateVolume holds for its
// "hold-ms" parameter (or until its call ends) and answers with
// "reply-bytes" bytes of volume context.
type abuseDriver struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer
	csi.UnimplementedSnapshotMetadataServer
	inflight, most atomic.Int64
	calls          atomic.Int64 // every call so far
}

func (d *abuseDriver) enter() func() {
	d.calls.Add(1)
	n := d.inflight.Add(1)
	for m := d.most.Load(); n > m && !d.most.CompareAndSwap(m, n); m = d.most.Load() {
	}
	return func() { d.inflight.Add(-1) }
}

func (d *abuseDriver) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{}, nil
}

func (d *abuseDriver) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: echoName, VendorVersion: "1"}, nil
}

func (d *abuseDriver) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	p := req.GetParameters()
	if ms, err := strconv.Atoi(p["hold-ms"]); err == nil {
		select {
		case <-time.After(time.Duration(ms) * time.Millisecond):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	n, _ := strconv.Atoi(p["reply-bytes"])
	return &csi.CreateVolumeResponse{Volume: &csi.Volume{VolumeId: "id-" + req.GetName(), VolumeContext: map[string]string{"pad": strings.Repeat("r", n)}}}, nil
}

// startAbuseDriver serves an abuseDriver on a temp unix socket.
func startAbuseDriver(t *testing.T) (*abuseDriver, string) {
	t.Helper()
	path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
	lis, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	d := &abuseDriver{}
	srv := grpc.NewServer(
		grpc.UnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			defer d.enter()()
			return h(ctx, req)
		}),
		grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			defer d.enter()()
			return h(srv, ss)
		}))
	csi.RegisterIdentityServer(srv, d)
	csi.RegisterControllerServer(srv, d)
	// Unimplemented, but its handler waits for the request first, as a
	// real one's does.
	csi.RegisterSnapshotMetadataServer(srv, d)
	go srv.Serve(lis)
	t.Cleanup(func() { srv.Stop(); os.Remove(path) })
	return d, "unix://" + path
}

// abuseTarget is one server under attack.
type abuseTarget struct {
	name   string
	dial   func(t *testing.T) net.Conn // a raw connection, ready for the preface
	scheme string
	extra  []hpack.HeaderField // request headers the server needs (routing)
	// normal makes one ordinary call on the normal client's connection.
	normal func(ctx context.Context, name string) error
}

// abuseEnv is the chain every attack runs against.
type abuseEnv struct {
	driver     *abuseDriver
	targets    []*abuseTarget
	goroutines int // with every server up and idle
}

func startAbuseEnv(t *testing.T) *abuseEnv {
	t.Helper()
	d, ep := startAbuseDriver(t)
	// No logs, and spans made but not kept: chaintest's span recorder
	// would keep every span of every attacking call in the heap.
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, LogLevel: slog.LevelError + 100, Tracer: sdktrace.NewTracerProvider()})
	e := &abuseEnv{driver: d}
	now := time.Now()
	issue := func(id string) *mtls.Material {
		m, err := c.CA.IssueMaterial(mtls.Leaf{ID: id, NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
		if err != nil {
			t.Fatal(err)
		}
		return m
	}

	// The TCP front end, as TestTCPFrontEnd starts it.
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := c.Broker.ServeTCP(ctx, lis, mtls.ServerConfig(mtls.StaticSource{M: issue(mtls.BrokerID(chaintest.TrustDomain))}, mtls.AuthorizeFrontEndCaller(chaintest.TrustDomain))); err != nil {
			t.Errorf("TCP front end: %v", err)
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	tcpFront := lis.Addr().String()

	brokerServer := mtls.AuthorizeOneOf(mtls.BrokerID(chaintest.TrustDomain))
	proxyServer := mtls.AuthorizeOneOf(mtls.DriverID(chaintest.TrustDomain, echoName))
	tool := mtls.ClientConfig(mtls.StaticSource{M: issue(mtls.ClientID(chaintest.TrustDomain, "abuse-tool"))}, brokerServer)
	brk := mtls.ClientConfig(mtls.StaticSource{M: issue(mtls.BrokerID(chaintest.TrustDomain))}, proxyServer)
	dialTLS := func(addr string, cfg *tls.Config) func(t *testing.T) net.Conn {
		return func(t *testing.T) net.Conn {
			t.Helper()
			nc, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, cfg)
			if err != nil {
				t.Fatal(err)
			}
			return nc
		}
	}
	grpcTLS := func(addr string, cfg *tls.Config) *grpc.ClientConn {
		conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return conn
	}
	normal := func(conn *grpc.ClientConn, md ...string) func(context.Context, string) error {
		cc := csi.NewControllerClient(conn)
		return func(ctx context.Context, name string) error {
			if len(md) > 0 {
				ctx = metadata.AppendToOutgoingContext(ctx, md...)
			}
			_, err := cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name})
			return err
		}
	}
	e.targets = []*abuseTarget{
		{
			name: "front-end socket",
			dial: func(t *testing.T) net.Conn {
				t.Helper()
				nc, err := net.Dial("unix", c.Front)
				if err != nil {
					t.Fatal(err)
				}
				return nc
			},
			scheme: "http",
			normal: normal(chaintest.Dial(t, c.Front)),
		},
		{
			// A CSI client of the TCP front end holds a certificate of
			// its own and names the driver.
			name:   "TCP front end",
			dial:   dialTLS(tcpFront, tool),
			scheme: "https",
			extra:  []hpack.HeaderField{{Name: broker.MetadataDriver, Value: echoName}},
			normal: normal(grpcTLS(tcpFront, tool), broker.MetadataDriver, echoName),
		},
		{
			// The proxy's only peer is the broker: the attacker holds a
			// broker certificate (a compromised broker, or its stolen
			// key), and the normal client is a broker connection of its
			// own.
			name:   "proxy",
			dial:   dialTLS(c.ProxyAddr, brk),
			scheme: "https",
			normal: normal(grpcTLS(c.ProxyAddr, brk)),
		},
	}
	// Every normal client's connection is up before any attack.
	cctx, ccancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer ccancel()
	for _, tg := range e.targets {
		if err := tg.normal(cctx, "warm-up"); err != nil {
			t.Fatalf("%s: a normal call before any attack: %v", tg.name, err)
		}
	}
	e.goroutines = runtime.NumGoroutine()
	return e
}

// settle waits until what the last case left behind has gone: the
// driver's calls, the servers' goroutines for its connections.
func (e *abuseEnv) settle(t *testing.T, why string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for e.driver.inflight.Load() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%s: the driver still has %d calls", why, e.driver.inflight.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	for runtime.NumGoroutine() > e.goroutines+20 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if g := runtime.NumGoroutine(); g > e.goroutines+20 {
		t.Logf("%s: %d goroutines, %d when idle", why, g, e.goroutines)
	}
}

func (e *abuseEnv) runCase(t *testing.T, ac abuseCase, tg *abuseTarget) {
	e.settle(t, "before the attack")
	idle, idleG := heapNow(), int64(runtime.NumGoroutine())
	e.driver.most.Store(0)
	calls0 := e.driver.calls.Load()

	ctx, cancel := context.WithTimeout(context.Background(), abuseAttack)
	defer cancel()
	var wg sync.WaitGroup
	// The heap and the goroutines, sampled through the attack.
	var peak, peakG atomic.Int64
	peak.Store(idle)
	peakG.Store(idleG)
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			if g := int64(runtime.NumGoroutine()); g > peakG.Load() {
				peakG.Store(g)
			}
			if h := heapNow(); h > peak.Load() {
				peak.Store(h)
			}
		}
	}()
	// The normal client, one call after another.
	r := &abuseResult{}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ctx.Err() == nil && i < 1<<20; i++ {
			cctx, ccancel := context.WithTimeout(context.Background(), abuseNormalTimeout)
			start := time.Now()
			err := tg.normal(cctx, "normal-"+strconv.Itoa(i))
			ccancel()
			r.normal.add(time.Since(start), err)
		}
	}()

	r.attackers = ac.run(ctx, t, tg)
	<-ctx.Done()
	wg.Wait()
	// What the server still holds for the attackers, now quiet but
	// connected.
	held := heapNow()
	peak.Store(max(peak.Load(), held))
	r.goroutines = peakG.Load() - idleG
	r.driverCalls = e.driver.calls.Load() - calls0
	most := e.driver.most.Load()
	how := ac.check(t, r)

	for _, a := range r.attackers {
		a.nc.Close()
		<-a.done
	}
	e.settle(t, "once the attacker has gone")
	after := heapNow()

	delta := peak.Load() - idle
	t.Logf("%s | heap: +%.1f MiB at most, +%.1f MiB held at the end, %+.1f MiB once gone (idle %.1f MiB) | normal client: %s | driver: %d calls at once at most",
		how, mib(delta), mib(held-idle), mib(after-idle), mib(idle), &r.normal, most)
	if delta > abuseHeapBudget {
		t.Errorf("the heap grew %.1f MiB above idle, more than %d MiB", mib(delta), abuseHeapBudget>>20)
	}
	if r.normal.failed > 0 || r.normal.ok == 0 {
		t.Errorf("the normal client, on a connection of its own: %s during the attack (first error: %v)", &r.normal, r.normal.firstErr)
	}
	if most > abuseDriverLimit {
		t.Errorf("the driver had %d calls at once, more than the proxy's bound of %d", most, abuseDriverLimit)
	}
}

// attacker is a raw HTTP/2 client that writes what an attack says, as fast
// as the server takes it, and (if it reads) records what comes back.
type attacker struct {
	nc   net.Conn
	bw   *bufio.Writer
	fr   *http2.Framer
	enc  *hpack.Encoder
	hbuf bytes.Buffer
	tg   *abuseTarget
	next uint32 // the next stream ID

	// Writing (the attack's goroutine only): what was sent, the time
	// spent waiting for the server to take it, the first write error.
	streams, frames int
	blocked         time.Duration
	writeErr        error

	// Reading, if the attacker reads.
	reads    bool
	mu       sync.Mutex
	received map[http2.FrameType]int
	rst      map[http2.ErrCode]int
	goAway   string // the first GOAWAY, described
	goCode   http2.ErrCode
	closedAt time.Time // when reading ended (EOF or error); zero while open
	done     chan struct{}
}

// attack opens an attacking connection to tg, offering HTTP/2's default
// windows and reading what the server sends if reads; it is closed at
// t.Cleanup.
func attack(t *testing.T, tg *abuseTarget, reads bool) *attacker {
	t.Helper()
	nc := tg.dial(t)
	t.Cleanup(func() { nc.Close() })
	a := &attacker{nc: nc, tg: tg, next: 1, reads: reads,
		received: map[http2.FrameType]int{}, rst: map[http2.ErrCode]int{}, done: make(chan struct{})}
	a.bw = bufio.NewWriterSize(timedWriter{a}, 64<<10)
	a.fr = http2.NewFramer(a.bw, nc)
	a.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	a.enc = hpack.NewEncoder(&a.hbuf)
	a.bw.WriteString(http2.ClientPreface)
	a.fr.WriteSettings()
	a.flush()
	if reads {
		go a.read()
	} else {
		close(a.done)
	}
	return a
}

func (a *attacker) read() {
	defer close(a.done)
	for {
		f, err := a.fr.ReadFrame()
		a.mu.Lock()
		if err != nil {
			a.closedAt = time.Now()
			a.mu.Unlock()
			return
		}
		a.received[f.Header().Type]++
		switch f := f.(type) {
		case *http2.RSTStreamFrame:
			a.rst[f.ErrCode]++
		case *http2.GoAwayFrame:
			if a.goAway == "" {
				a.goAway, a.goCode = fmt.Sprintf("GOAWAY %v %q", f.ErrCode, f.DebugData()), f.ErrCode
			}
		}
		a.mu.Unlock()
	}
}

// timedWriter writes to the attacker's connection, counting the time the
// server keeps the attacker waiting and keeping the first error.
type timedWriter struct{ a *attacker }

func (w timedWriter) Write(p []byte) (int, error) {
	start := time.Now()
	n, err := w.a.nc.Write(p)
	w.a.blocked += time.Since(start)
	if err != nil && w.a.writeErr == nil {
		w.a.writeErr = err
	}
	return n, err
}

// flush writes what is buffered. A write error (the server closed the
// connection, or the attack's time is up) ends the attack.
func (a *attacker) flush() error {
	if a.writeErr != nil {
		return a.writeErr
	}
	return a.bw.Flush()
}

// until runs step, then flushes, until ctx ends, a write fails or step
// says it is done; at most limit times.
func (a *attacker) until(ctx context.Context, limit int, step func() bool) {
	if dl, ok := ctx.Deadline(); ok {
		a.nc.SetWriteDeadline(dl)
	}
	for i := 0; i < limit && ctx.Err() == nil; i++ {
		if !step() || a.flush() != nil {
			return
		}
	}
}

// headers writes the HEADERS of a new gRPC call to path.
func (a *attacker) headers(path string, endStream bool) uint32 {
	id := a.next
	a.next += 2
	a.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: a.headerBlock(path), EndHeaders: true, EndStream: endStream})
	return id
}

func (a *attacker) headerBlock(path string) []byte {
	a.hbuf.Reset()
	for _, f := range append([]hpack.HeaderField{{Name: ":method", Value: "POST"}, {Name: ":scheme", Value: a.tg.scheme},
		{Name: ":path", Value: path}, {Name: ":authority", Value: "csibroker"}, {Name: "content-type", Value: "application/grpc"},
		{Name: "te", Value: "trailers"}}, a.tg.extra...) {
		a.enc.WriteField(f)
	}
	return a.hbuf.Bytes()
}

// closed reports whether the server has closed the connection, and how.
func (a *attacker) closed() (bool, string) {
	if !a.reads {
		if a.writeErr != nil && !errors.Is(a.writeErr, os.ErrDeadlineExceeded) {
			return true, "write: " + a.writeErr.Error()
		}
		return false, ""
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closedAt.IsZero() {
		return false, ""
	}
	if a.goAway != "" {
		return true, a.goAway + ", then closed"
	}
	return true, "closed without GOAWAY"
}

func (a *attacker) goAwayCode() http2.ErrCode {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.goCode
}

func (a *attacker) refused() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.rst[http2.ErrCodeRefusedStream]
}

func (a *attacker) count(ft http2.FrameType) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.received[ft]
}

// inParallel opens n attacking connections to tg and runs body on each
// until ctx ends.
func inParallel(ctx context.Context, t *testing.T, tg *abuseTarget, n int, reads bool, body func(context.Context, *attacker)) []*attacker {
	as := make([]*attacker, n)
	for i := range as {
		as[i] = attack(t, tg, reads)
	}
	var wg sync.WaitGroup
	for _, a := range as {
		wg.Add(1)
		go func() { defer wg.Done(); body(ctx, a) }()
	}
	wg.Wait()
	return as
}

// closedOr is closed when a's connection has been closed, or after d.
func closedOr(a *attacker, d time.Duration) <-chan struct{} {
	ch := make(chan struct{})
	go func() {
		defer close(ch)
		select {
		case <-a.done:
		case <-time.After(d):
		}
	}()
	return ch
}

// grpcMessage frames m as one gRPC message.
func grpcMessage(m proto.Message) []byte {
	b, err := proto.Marshal(m)
	if err != nil {
		panic(err)
	}
	return append(binary.BigEndian.AppendUint32([]byte{0}, uint32(len(b))), b...)
}

// normalCalls is what the normal client saw during an attack.
type normalCalls struct {
	ok, failed int
	firstErr   error
	latencies  []time.Duration
}

func (n *normalCalls) add(d time.Duration, err error) {
	if err != nil {
		n.failed++
		if n.firstErr == nil {
			n.firstErr = err
		}
		return
	}
	n.ok++
	n.latencies = append(n.latencies, d)
}

func (n *normalCalls) String() string {
	if len(n.latencies) == 0 {
		return fmt.Sprintf("%d ok, %d failed", n.ok, n.failed)
	}
	l := slices.Clone(n.latencies)
	slices.Sort(l)
	return fmt.Sprintf("%d ok, %d failed, p50 %v, max %v", n.ok, n.failed, l[len(l)/2].Round(10*time.Microsecond), l[len(l)-1].Round(10*time.Microsecond))
}

// heapNow runs a GC and returns the heap it found live. What is allocated
// while it marks counts as live, so a busy moment reads a little high.
func heapNow() int64 {
	runtime.GC()
	s := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
	metrics.Read(s)
	return int64(s[0].Value.Uint64())
}

func mib(b int64) float64 { return float64(b) / (1 << 20) }
