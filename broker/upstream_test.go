package broker

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"encoding/base64"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/rawgrpc"
)

// h2peer is a small HTTP/2 server over mTLS standing in for a proxy, so the
// broker's own connection can be driven into what a real proxy rarely does:
// a stream limit of one, silence. Every request is answered with an empty
// gRPC message and status OK after delay.
type h2peer struct {
	maxStreams  uint32
	answerPings bool
	delay       time.Duration
	// goAway: answer each connection's first request, but send GOAWAY
	// (that request being the last one processed) as soon as it arrives.
	goAway bool
	// overflow: answer a request's HEADERS with two stream WINDOW_UPDATEs
	// of 2^31-1 (the second takes the window past 2^31-1; the connection
	// window is never opened), and nothing else.
	overflow bool
	// push: answer a request's HEADERS with a PUSH_PROMISE, and nothing
	// else.
	push bool
	// bigFrame: answer a request's HEADERS with a DATA frame of 64 KiB,
	// over the 16 KiB the broker reads (it announces no other), and
	// nothing else.
	bigFrame bool
	// goAwayCode is the code of the last GOAWAY the broker sent.
	goAwayCode http2.ErrCode
	// maxHeaderList, if set, is announced as SETTINGS_MAX_HEADER_LIST_SIZE.
	maxHeaderList uint32
	// trailers, if set, end every answer instead of grpc-status 0;
	// headers are added to every answer's response headers.
	trailers, headers []hpack.HeaderField
	// stall: open windows of 1 GiB, then stop reading at the first
	// request's HEADERS, until stall is closed (a proxy that hangs).
	stall chan struct{}

	mu       sync.Mutex
	conns    int
	open     int
	maxOpen  int
	requests int
	pings    int // answered
	lis      net.Listener
}

const peerTD = "test.csibroker"

func startPeer(t *testing.T, p *h2peer) (addr string, client *tls.Config) {
	t.Helper()
	now := time.Now()
	ca, err := mtls.NewCA("peer test CA", now.Add(-time.Hour), now.Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	pm, err := ca.IssueMaterial(mtls.Leaf{ID: mtls.DriverID(peerTD, "peer.csi.test"), NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	bm, err := ca.IssueMaterial(mtls.Leaf{ID: mtls.BrokerID(peerTD), NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	scfg := mtls.ServerConfig(mtls.StaticSource{M: pm}, mtls.AuthorizeOneOf(mtls.BrokerID(peerTD)))
	scfg.NextProtos = []string{"h2"}
	lis, err := tls.Listen("tcp", "127.0.0.1:0", scfg)
	if err != nil {
		t.Fatal(err)
	}
	p.lis = lis
	var accepted []net.Conn
	var acceptedMu sync.Mutex
	t.Cleanup(func() {
		lis.Close()
		acceptedMu.Lock()
		defer acceptedMu.Unlock()
		for _, nc := range accepted {
			nc.Close()
		}
	})
	go func() {
		for {
			nc, err := lis.Accept()
			if err != nil {
				return
			}
			acceptedMu.Lock()
			accepted = append(accepted, nc)
			acceptedMu.Unlock()
			go p.serve(nc)
		}
	}()
	return lis.Addr().String(), mtls.ClientConfig(mtls.StaticSource{M: bm}, mtls.AuthorizeOneOf(mtls.DriverID(peerTD, "peer.csi.test")))
}

func (p *h2peer) serve(nc net.Conn) {
	defer nc.Close()
	p.mu.Lock()
	p.conns++
	p.mu.Unlock()
	preface := make([]byte, len(http2.ClientPreface))
	if _, err := io.ReadFull(nc, preface); err != nil {
		return
	}
	fr := http2.NewFramer(nc, nc)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	var wmu sync.Mutex
	var hbuf bytes.Buffer
	enc := hpack.NewEncoder(&hbuf)
	headers := func(id uint32, end bool, fields ...hpack.HeaderField) {
		hbuf.Reset()
		for _, f := range fields {
			enc.WriteField(f)
		}
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: hbuf.Bytes(), EndHeaders: true, EndStream: end})
	}
	wmu.Lock()
	settings := []http2.Setting{{ID: http2.SettingMaxConcurrentStreams, Val: p.maxStreams}}
	if p.maxHeaderList > 0 {
		settings = append(settings, http2.Setting{ID: http2.SettingMaxHeaderListSize, Val: p.maxHeaderList})
	}
	if p.stall != nil {
		settings = append(settings, http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 30})
	}
	fr.WriteSettings(settings...)
	if p.stall != nil {
		fr.WriteWindowUpdate(0, 1<<30)
	}
	wmu.Unlock()
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				wmu.Lock()
				fr.WriteSettingsAck()
				wmu.Unlock()
			}
		case *http2.GoAwayFrame:
			p.mu.Lock()
			p.goAwayCode = f.ErrCode
			p.mu.Unlock()
		case *http2.PingFrame:
			if !f.IsAck() && p.answerPings {
				wmu.Lock()
				fr.WritePing(true, f.Data)
				wmu.Unlock()
				p.mu.Lock()
				p.pings++
				p.mu.Unlock()
			}
		case *http2.MetaHeadersFrame:
			if p.stall != nil {
				<-p.stall
				return
			}
			if p.push {
				wmu.Lock()
				hbuf.Reset()
				enc.WriteField(hpack.HeaderField{Name: ":method", Value: "GET"})
				fr.WritePushPromise(http2.PushPromiseParam{StreamID: f.StreamID, PromiseID: 2, BlockFragment: hbuf.Bytes(), EndHeaders: true})
				wmu.Unlock()
				continue
			}
			if p.bigFrame {
				wmu.Lock()
				fr.WriteData(f.StreamID, false, make([]byte, 64<<10))
				wmu.Unlock()
				continue
			}
			if p.overflow {
				wmu.Lock()
				fr.WriteWindowUpdate(f.StreamID, 1<<31-1)
				fr.WriteWindowUpdate(f.StreamID, 1<<31-1)
				wmu.Unlock()
				continue
			}
			p.mu.Lock()
			p.open++
			p.requests++
			p.maxOpen = max(p.maxOpen, p.open)
			p.mu.Unlock()
		case *http2.DataFrame:
			if !f.StreamEnded() {
				continue
			}
			id := f.StreamID
			if p.goAway {
				wmu.Lock()
				fr.WriteGoAway(id, http2.ErrCodeNo, nil)
				wmu.Unlock()
			}
			go func() {
				time.Sleep(p.delay)
				p.mu.Lock()
				p.open--
				p.mu.Unlock()
				wmu.Lock()
				defer wmu.Unlock()
				headers(id, false, append([]hpack.HeaderField{{Name: ":status", Value: "200"}, {Name: "content-type", Value: "application/grpc"}}, p.headers...)...)
				fr.WriteData(id, false, []byte{0, 0, 0, 0, 0})
				trailers := p.trailers
				if trailers == nil {
					trailers = []hpack.HeaderField{{Name: "grpc-status", Value: "0"}}
				}
				headers(id, true, trailers...)
			}()
		}
	}
}

func newTestUpstream(t *testing.T, addr string, tlsCfg *tls.Config) *upstream {
	t.Helper()
	b, err := New(Options{TrustDomain: peerTD, TLS: mtls.StaticSource{M: &mtls.Material{}}})
	if err != nil {
		t.Fatal(err)
	}
	p := &proxyConn{cfg: ProxyConfig{Address: addr}, driver: "peer.csi.test", retry: RetryConfig{MaxAttempts: 1}}
	p.driverCfg.Store(&DriverConfig{Name: "peer.csi.test", Timeout: 10 * time.Second})
	u := newUpstream(b, p, tlsCfg)
	t.Cleanup(u.close)
	return u
}

// TestUpstreamStuckProxyHoldsUpNoOneElse: a proxy that stops reading holds
// a large request's write, and with it its connection's lock, until the
// write deadline; meanwhile the connection's state, the status snapshot and
// the metrics' proxy states are read, and the registry changed (its lock is
// what every call needs), without waiting; draining and closing that
// connection do not wait either, and close ends the stuck call.
func TestUpstreamStuckProxyHoldsUpNoOneElse(t *testing.T) {
	peer := &h2peer{maxStreams: 10, answerPings: true, stall: make(chan struct{})}
	addr, cfg := startPeer(t, peer)
	t.Cleanup(func() { close(peer.stall) })
	u := newTestUpstream(t, addr, cfg)
	u.p.up = u
	b := u.b
	b.mu.Lock()
	b.drivers[u.p.driver] = &Driver{name: u.p.driver, b: b, controller: u.p, nodes: map[string]*proxyConn{}, stats: &driverStats{}}
	b.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := u.get(ctx)
	if err != nil {
		t.Fatal(err)
	}
	big := make([]byte, 64<<20)
	binary.BigEndian.PutUint32(big[1:], uint32(len(big)-5))
	bigErr := make(chan error, 1)
	go func() {
		_, _, _, err := u.attempt(ctx, u.b.desc(u.p, "/csi.v1.Controller/CreateVolume"), "/csi.v1.Controller/CreateVolume", nil, big)
		bigErr <- err
	}()
	// Wait until the write holds the connection's lock for good.
	for held, deadline := 0, time.Now().Add(10*time.Second); held < 10; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the large request's write never blocked")
		}
		if c.mu.TryLock() {
			c.mu.Unlock()
			held = 0
		} else {
			held++
		}
	}
	within := func(what string, f func()) {
		t.Helper()
		done := make(chan struct{})
		start := time.Now()
		go func() { f(); close(done) }()
		select {
		case <-done:
		case <-time.After(2 * time.Second):
			t.Fatalf("%s waited on the stuck proxy's connection (still waiting after %v)", what, time.Since(start).Round(time.Millisecond))
		}
	}
	within("the connection's state", func() { u.state() })
	within("the metrics' proxy states", func() { b.proxyStates() })
	within("the status snapshot", func() { b.Status() })
	within("a registry change", func() { b.RemoveDriver("other.csi.test") })
	// Draining the stuck connection (its driver reconfigured) and then
	// closing it (the grace period over) wait for nothing either, and the
	// call whose write was stuck ends with the broker's reason.
	within("draining the connection", func() { u.drain() })
	if c.takesCalls() {
		t.Fatal("a drained connection still takes calls")
	}
	within("closing the drained connection", func() { u.failOld(errDriverChanged) })
	select {
	case err := <-bigErr:
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), errDriverChanged.Error()) {
			t.Fatalf("the stuck call ended with %v; want Unavailable saying %q", err, errDriverChanged)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("the stuck call still waits after its connection was closed")
	}
}

// TestUpstreamKeepsToTheStreamLimit: with a proxy that allows one stream,
// four concurrent calls all succeed, one at a time.
func TestUpstreamKeepsToTheStreamLimit(t *testing.T) {
	peer := &h2peer{maxStreams: 1, answerPings: true, delay: 30 * time.Millisecond}
	addr, cfg := startPeer(t, peer)
	u := newTestUpstream(t, addr, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _, _, err := u.attempt(ctx, u.b.desc(u.p, "/csi.v1.Identity/Probe"), "/csi.v1.Identity/Probe", nil, []byte{0, 0, 0, 0, 0})
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	peer.mu.Lock()
	defer peer.mu.Unlock()
	if peer.requests != 4 || peer.maxOpen != 1 {
		t.Fatalf("the proxy saw %d requests, at most %d at once; want 4, one at a time", peer.requests, peer.maxOpen)
	}
}

// TestUpstreamRefusesStreamWindowOverflow: a proxy that grows a call's send
// window past 2^31-1 ends that call with Internal (a stream
// FLOW_CONTROL_ERROR), saying so, and does not leave it waiting.
func TestUpstreamRefusesStreamWindowOverflow(t *testing.T) {
	addr, cfg := startPeer(t, &h2peer{maxStreams: 10, answerPings: true, overflow: true})
	u := newTestUpstream(t, addr, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// A request larger than the initial window, so the call is still
	// sending when the WINDOW_UPDATE arrives.
	req := make([]byte, 5+200<<10)
	binary.BigEndian.PutUint32(req[1:5], uint32(len(req)-5))
	_, _, _, err := u.attempt(ctx, u.b.desc(u.p, "/csi.v1.Identity/Probe"), "/csi.v1.Identity/Probe", nil, req)
	if status.Code(err) != codes.Internal || !strings.Contains(err.Error(), "overflowed the call's window") {
		t.Fatalf("call ended with %v, want Internal naming the overflowed window", err)
	}
	if ctx.Err() != nil {
		t.Fatal("the call waited for its deadline")
	}
}

// TestUpstreamKeepalive: a connection to a proxy that answers pings stays;
// one to a proxy that went silent is closed after an unanswered ping, so
// the next call dials again instead of waiting on a dead connection.
func TestUpstreamKeepalive(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	alivePeer := &h2peer{maxStreams: 10, answerPings: true}
	addr, cfg := startPeer(t, alivePeer)
	au := newTestUpstream(t, addr, cfg)
	// Pings every 50 ms, each given 500 ms: a machine stalled for 50 ms
	// must not look like a dead proxy.
	au.kaTime, au.kaTimeout = 50*time.Millisecond, 500*time.Millisecond
	alive, err := au.get(ctx)
	if err != nil {
		t.Fatal(err)
	}
	silentPeer := &h2peer{maxStreams: 10}
	addr, cfg = startPeer(t, silentPeer)
	su := newTestUpstream(t, addr, cfg)
	su.kaTime, su.kaTimeout = 50*time.Millisecond, 50*time.Millisecond
	silent, err := su.get(ctx)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for silent.takesCalls() && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	silent.mu.Lock()
	why := silent.err
	silent.mu.Unlock()
	if why == nil || !strings.Contains(why.Error(), "keepalive") {
		t.Fatalf("the silent proxy's connection: %v, want closed after an unanswered keepalive ping", why)
	}
	// Two more pings answered: the broker sends a ping only after it has
	// checked the answer to the one before (500 ms later), so one check
	// of an answered ping was made, which would have closed a connection
	// that did not count the answer.
	alivePeer.mu.Lock()
	from := alivePeer.pings
	alivePeer.mu.Unlock()
	for {
		alivePeer.mu.Lock()
		n := alivePeer.pings
		alivePeer.mu.Unlock()
		if n >= from+2 || ctx.Err() != nil {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if ctx.Err() != nil {
		alive.mu.Lock()
		why := alive.err
		alive.mu.Unlock()
		t.Fatalf("the proxy that answers pings was not pinged twice more (its connection: %v)", why)
	}
	if !alive.takesCalls() {
		t.Fatal("the connection to a proxy that answers pings was closed")
	}
	// The next call dials a new connection.
	if _, _, _, err := su.attempt(ctx, su.b.desc(su.p, "/csi.v1.Identity/Probe"), "/csi.v1.Identity/Probe", nil, []byte{0, 0, 0, 0, 0}); err != nil {
		t.Fatalf("call after the keepalive closed the connection: %v", err)
	}
}

// TestUpstreamRedialsWhileDraining: a proxy that sends GOAWAY keeps serving
// the call in flight; the broker dials a new connection at once, not when
// that call ends, so the state stays READY and new calls do not wait.
func TestUpstreamRedialsWhileDraining(t *testing.T) {
	peer := &h2peer{maxStreams: 10, answerPings: true, delay: 2 * time.Second, goAway: true}
	addr, cfg := startPeer(t, peer)
	u := newTestUpstream(t, addr, cfg)
	u.keepConnected()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, _, _, err := u.attempt(ctx, u.b.desc(u.p, "/csi.v1.Identity/Probe"), "/csi.v1.Identity/Probe", nil, []byte{0, 0, 0, 0, 0})
		done <- err
	}()
	conns := func() int {
		peer.mu.Lock()
		defer peer.mu.Unlock()
		return peer.conns
	}
	for conns() < 2 || u.state() != "READY" {
		select {
		case err := <-done:
			t.Fatalf("the call in flight ended (%v) before the broker had a second connection READY (connections: %d, state %s)", err, conns(), u.state())
		case <-time.After(10 * time.Millisecond):
		}
	}
	if err := <-done; err != nil {
		t.Fatalf("the call on the draining connection: %v", err)
	}
}

// TestUpstreamLargeRequestAfterIdle: a request larger than the write buffer
// reaches the socket while it is written, before any flush; on a
// connection idle for longer than the write timeout (played here by
// setting the socket's deadline to now) the write deadline must be moved
// ahead of that write, or the connection fails with an i/o timeout and
// every call on it with it.
func TestUpstreamLargeRequestAfterIdle(t *testing.T) {
	peer := &h2peer{maxStreams: 10, answerPings: true}
	addr, cfg := startPeer(t, peer)
	u := newTestUpstream(t, addr, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	probe := u.b.desc(u.p, "/csi.v1.Identity/Probe")
	if _, _, _, err := u.attempt(ctx, probe, "/csi.v1.Identity/Probe", nil, []byte{0, 0, 0, 0, 0}); err != nil {
		t.Fatal(err)
	}
	c, err := u.get(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	c.deadline = time.Now()
	c.nc.SetWriteDeadline(c.deadline)
	c.mu.Unlock()
	req := make([]byte, 5+upBufSize+1024) // under the initial stream window (the peer gives no more)
	binary.BigEndian.PutUint32(req[1:5], uint32(len(req)-5))
	if _, _, _, err := u.attempt(ctx, probe, "/csi.v1.Identity/Probe", nil, req); err != nil {
		t.Fatalf("a large request after the write deadline passed: %v", err)
	}
}

// TestUpstreamClosesAConnectionWhoseStreamIDsRunOut: the call that takes a
// connection's last stream ID is its last; once it ends the connection is
// closed (not kept with its goroutines), and the next call goes to a new
// one.
func TestUpstreamClosesAConnectionWhoseStreamIDsRunOut(t *testing.T) {
	peer := &h2peer{maxStreams: 10, answerPings: true}
	addr, cfg := startPeer(t, peer)
	u := newTestUpstream(t, addr, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	probe := u.b.desc(u.p, "/csi.v1.Identity/Probe")
	c, err := u.get(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	c.nextID = rawgrpc.LastStreamID - rawgrpc.StreamIDMargin - 2
	c.mu.Unlock()
	if _, _, _, err := u.attempt(ctx, probe, "/csi.v1.Identity/Probe", nil, []byte{0, 0, 0, 0, 0}); err != nil {
		t.Fatalf("the connection's last call: %v", err)
	}
	c.mu.Lock()
	closedWith := c.err
	c.mu.Unlock()
	if !errors.Is(closedWith, errStreamIDsUsed) {
		t.Fatalf("after its last call the connection ended with %v, want %v", closedWith, errStreamIDsUsed)
	}
	if _, _, _, err := u.attempt(ctx, probe, "/csi.v1.Identity/Probe", nil, []byte{0, 0, 0, 0, 0}); err != nil {
		t.Fatalf("a call after it: %v", err)
	}
	peer.mu.Lock()
	defer peer.mu.Unlock()
	if peer.conns != 2 {
		t.Fatalf("the proxy saw %d connections, want 2", peer.conns)
	}
}

// TestUpstreamKeepsToTheProxysHeaderListLimit: a call whose metadata is
// over the proxy's SETTINGS_MAX_HEADER_LIST_SIZE fails before it is sent,
// with Internal naming both sizes; the connection goes on serving calls.
func TestUpstreamKeepsToTheProxysHeaderListLimit(t *testing.T) {
	peer := &h2peer{maxStreams: 10, answerPings: true, maxHeaderList: 4096}
	addr, cfg := startPeer(t, peer)
	u := newTestUpstream(t, addr, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	probe := u.b.desc(u.p, "/csi.v1.Identity/Probe")
	empty := []byte{0, 0, 0, 0, 0}
	// The first call reads the proxy's SETTINGS.
	if _, _, _, err := u.attempt(ctx, probe, "/csi.v1.Identity/Probe", nil, empty); err != nil {
		t.Fatal(err)
	}
	_, _, _, err := u.attempt(ctx, probe, "/csi.v1.Identity/Probe", metadata.Pairs("x-big", strings.Repeat("b", 5000)), empty)
	if status.Code(err) != codes.Internal || !strings.Contains(err.Error(), "over the 4096 bytes proxy") {
		t.Fatalf("metadata over the proxy's limit: %v", err)
	}
	if _, _, _, err := u.attempt(ctx, probe, "/csi.v1.Identity/Probe", nil, empty); err != nil {
		t.Fatalf("a call after it: %v", err)
	}
	peer.mu.Lock()
	defer peer.mu.Unlock()
	if peer.requests != 2 || peer.conns != 1 {
		t.Fatalf("the proxy saw %d requests on %d connections, want 2 on 1 (the one over the limit never sent)", peer.requests, peer.conns)
	}
}

// TestTrailerStatusAsGRPCReadsIt: the status the broker reads from a
// proxy's trailers is the one gRPC's own client reads from the same
// trailers (code, and message and details where they are well formed),
// including trailers a conforming driver never sends. Each case is answered
// by the same peer to both clients.
func TestTrailerStatusAsGRPCReadsIt(t *testing.T) {
	details := func(code codes.Code, msg string) string {
		st, err := status.New(code, msg).WithDetails(&errdetails.ErrorInfo{Reason: "QUOTA", Domain: "csi.test"})
		if err != nil {
			t.Fatal(err)
		}
		b, err := proto.Marshal(st.Proto())
		if err != nil {
			t.Fatal(err)
		}
		return base64.RawStdEncoding.EncodeToString(b)
	}
	hf := func(kv ...string) []hpack.HeaderField {
		var out []hpack.HeaderField
		for i := 0; i+1 < len(kv); i += 2 {
			out = append(out, hpack.HeaderField{Name: kv[i], Value: kv[i+1]})
		}
		return out
	}
	type answer struct{ headers, trailers []hpack.HeaderField }
	for name, a := range map[string]answer{
		"ok":                 {trailers: hf("grpc-status", "0")},
		"not found":          {trailers: hf("grpc-status", "5", "grpc-message", "no such volume")},
		"no grpc-status":     {trailers: hf("grpc-message", "lost")},
		"malformed status":   {trailers: hf("grpc-status", "five")},
		"details":            {trailers: hf("grpc-status", "8", "grpc-message", "full", "grpc-status-details-bin", details(codes.ResourceExhausted, "full"))},
		"details mismatch":   {trailers: hf("grpc-status", "8", "grpc-message", "full", "grpc-status-details-bin", details(codes.NotFound, "full"))},
		"details malformed":  {trailers: hf("grpc-status", "8", "grpc-message", "full", "grpc-status-details-bin", "!!not base64!!")},
		"details not status": {trailers: hf("grpc-status", "8", "grpc-message", "full", "grpc-status-details-bin", base64.RawStdEncoding.EncodeToString([]byte{0xff, 0xff}))},
		"details twice": {trailers: hf("grpc-status", "8", "grpc-message", "full",
			"grpc-status-details-bin", details(codes.ResourceExhausted, "a"), "grpc-status-details-bin", details(codes.ResourceExhausted, "b"))},
		"malformed binary header":  {headers: hf("x-trace-bin", "!!not base64!!"), trailers: hf("grpc-status", "0")},
		"malformed binary trailer": {trailers: hf("grpc-status", "0", "x-trace-bin", "!!not base64!!")},
	} {
		t.Run(name, func(t *testing.T) {
			addr, cfg := startPeer(t, &h2peer{maxStreams: 10, headers: a.headers, trailers: a.trailers})
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			u := newTestUpstream(t, addr, cfg)
			req := []byte{0, 0, 0, 0, 0}
			_, _, _, ours := u.attempt(ctx, u.b.desc(u.p, "/csi.v1.Identity/Probe"), "/csi.v1.Identity/Probe", nil, req)

			cc, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
			if err != nil {
				t.Fatal(err)
			}
			defer cc.Close()
			theirs := cc.Invoke(ctx, "/csi.v1.Identity/Probe", &emptypb.Empty{}, &emptypb.Empty{})

			o, g := status.Convert(ours), status.Convert(theirs)
			if o.Code() != g.Code() {
				t.Fatalf("code %v (%v), gRPC's client reads %v (%v)", o.Code(), ours, g.Code(), theirs)
			}
			if o.Code() == codes.Internal || strings.Contains(g.Message(), "malformed") {
				return // each says what is wrong in its own words
			}
			if o.Message() != g.Message() || !proto.Equal(o.Proto(), g.Proto()) {
				t.Fatalf("status %v, gRPC's client reads %v", o.Proto(), g.Proto())
			}
		})
	}
}

// TestUpstreamRefusesPushPromise: a proxy that pushes (the broker said
// SETTINGS_ENABLE_PUSH 0) breaks the protocol: its connection is closed
// and the call fails at once, saying so, instead of reading the
// connection's later header blocks against the wrong table.
func TestUpstreamRefusesPushPromise(t *testing.T) {
	addr, cfg := startPeer(t, &h2peer{maxStreams: 10, answerPings: true, push: true})
	u := newTestUpstream(t, addr, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req := make([]byte, 5)
	_, _, _, err := u.attempt(ctx, u.b.desc(u.p, "/csi.v1.Identity/Probe"), "/csi.v1.Identity/Probe", nil, req)
	if err == nil || !strings.Contains(err.Error(), "PUSH_PROMISE") {
		t.Fatalf("call ended with %v, want a failure naming the PUSH_PROMISE", err)
	}
	if ctx.Err() != nil {
		t.Fatal("the call waited for its deadline")
	}
}

// TestUpstreamRefusesFramesOverTheDefaultSize: a proxy that sends a frame
// larger than the 16 KiB the broker reads (it announces no larger) has its
// connection closed with GOAWAY(FRAME_SIZE_ERROR), and the call fails at
// once instead of the broker buffering frames of up to 16 MiB.
func TestUpstreamRefusesFramesOverTheDefaultSize(t *testing.T) {
	peer := &h2peer{maxStreams: 10, answerPings: true, bigFrame: true}
	addr, cfg := startPeer(t, peer)
	u := newTestUpstream(t, addr, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, _, _, err := u.attempt(ctx, u.b.desc(u.p, "/csi.v1.Identity/Probe"), "/csi.v1.Identity/Probe", nil, make([]byte, 5))
	if err == nil || ctx.Err() != nil {
		t.Fatalf("call ended with %v (context: %v), want a failure at once", err, ctx.Err())
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		peer.mu.Lock()
		code := peer.goAwayCode
		peer.mu.Unlock()
		if code == http2.ErrCodeFrameSize {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("GOAWAY code %v, want FRAME_SIZE_ERROR", code)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestAnsweredMarksOnlyTheProxysStatus: a status read from the answer's
// trailers is marked as answered, and keeps the mark when a secret is
// redacted from it; one the broker makes itself is not, whatever its
// message says.
func TestAnsweredMarksOnlyTheProxysStatus(t *testing.T) {
	fromDriver := trailerStatus([]hpack.HeaderField{{Name: "grpc-status", Value: "8"}, {Name: "grpc-message", Value: "no room for key s3cr3t"}}, "proxy:1")
	if !Answered(fromDriver) || status.Code(fromDriver) != codes.ResourceExhausted || status.Convert(fromDriver).Message() != "no room for key s3cr3t" {
		t.Fatalf("the trailers' status: %v, answered %v", fromDriver, Answered(fromDriver))
	}
	redacted := redactValues(fromDriver, []string{"s3cr3t"})
	if !Answered(redacted) || status.Convert(redacted).Message() != "no room for key ***stripped***" {
		t.Fatalf("redacted: %v, answered %v", redacted, Answered(redacted))
	}
	if err := trailerStatus([]hpack.HeaderField{{Name: "grpc-status", Value: "x"}}, "proxy:1"); Answered(err) {
		t.Fatalf("a malformed grpc-status is the broker's reading, not an answer: %v", err)
	}
	if err := trailerStatus([]hpack.HeaderField{{Name: "grpc-status", Value: "0"}}, "proxy:1"); err != nil {
		t.Fatalf("OK: %v", err)
	}
	for _, err := range []error{
		status.Error(codes.ResourceExhausted, "received message larger than max (4 bytes)"),
		fmt.Errorf("wrapped: %w", status.Error(codes.OutOfRange, "x")),
		nil,
	} {
		if Answered(err) {
			t.Errorf("%v taken as answered", err)
		}
	}
	if !Answered(fmt.Errorf("wrapped: %w", fromDriver)) {
		t.Error("a wrapped answer lost its mark")
	}
}
