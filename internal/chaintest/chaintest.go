// Package chaintest starts the real CSI path for tests and benchmarks: a
// proxy over mTLS in front of a driver socket the caller already serves, a
// broker with its client chain, and the broker's front-end socket, all on
// loopback TCP and temporary unix sockets with certificates minted here.
package chaintest

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/telemetry"
	"github.com/csibroker/csibroker/internal/testutil"
	"github.com/csibroker/csibroker/proxy"
)

// TrustDomain of every identity minted here.
const TrustDomain = "test.csibroker"

// Options shape the chain.
type Options struct {
	Driver         string // CSI driver name (the proxy's identity names it)
	DriverEndpoint string // the driver's unix socket, already served by the caller
	Retry          broker.RetryConfig
	Timeout        time.Duration
	MethodTimeouts map[string]time.Duration
	// LogLevel for the broker's and proxy's loggers (default: debug, the most verbose).
	LogLevel slog.Level
	// ProxyCert overrides the proxy's certificate (refusal tests).
	ProxyMaterial *mtls.Material
	// BrokerMaterial overrides the broker's certificate.
	BrokerMaterial *mtls.Material
	// NoWait skips waiting for the broker's connection to become READY.
	NoWait bool
	// Tracer and Spans, when set, are used instead of new ones (so the test's
	// driver can record its spans into the same recorder).
	Tracer *sdktrace.TracerProvider
	Spans  *tracetest.SpanRecorder
	// Node makes the proxy a node plugin's proxy on that node (its identity
	// names the node) and registers the driver as node-local with it.
	Node string
	// MaxMsgSize, when positive, bounds the broker's messages.
	MaxMsgSize int
	// BrokerReload, when positive, makes the broker poll its certificate
	// files at this interval.
	BrokerReload time.Duration
}

// Chain is a running front end → broker → proxy path.
type Chain struct {
	Dir         string
	CA          *mtls.CA
	Front       string // front-end unix socket path
	ProxyAddr   string
	Broker      *broker.Broker
	Proxy       *proxy.Proxy
	Spans       *tracetest.SpanRecorder
	Tracer      *sdktrace.TracerProvider
	Propagator  propagation.TextMapPropagator
	Registry    *prometheus.Registry
	Logs        *SyncBuffer // broker and proxy log lines
	BrokerFiles struct{ Cert, Key, CA string }

	// BrokerSource is the broker's certificate file source (nil when
	// Options.BrokerMaterial was given).
	BrokerSource *mtls.FileSource

	ctx         context.Context
	cancel      context.CancelFunc
	wg          sync.WaitGroup
	proxyCfg    proxy.Config
	proxyLis    *trackingListener
	proxyCancel context.CancelFunc
	proxyDone   chan struct{}
	peerMu      sync.Mutex
	peers       map[string]int // serial of each broker certificate the proxy accepted

	// t is Start's test; Stop fails it with what a server's Serve
	// returned other than a graceful end (served).
	t         testing.TB
	serveMu   sync.Mutex
	serveErrs []error
}

// served records what a proxy's or the front end's Serve returned: nil
// after a graceful stop, else an error Stop fails the test with.
func (c *Chain) served(what string, err error) {
	if err == nil {
		return
	}
	c.serveMu.Lock()
	defer c.serveMu.Unlock()
	c.serveErrs = append(c.serveErrs, fmt.Errorf("%s: Serve: %w", what, err))
}

// recordPeers wraps a server config so the chain can tell which broker
// certificates the proxy accepted.
func (c *Chain) recordPeers(cfg *tls.Config) *tls.Config {
	verify := cfg.VerifyPeerCertificate
	cfg.VerifyPeerCertificate = func(raw [][]byte, chains [][]*x509.Certificate) error {
		if err := verify(raw, chains); err != nil {
			return err
		}
		if cert, err := x509.ParseCertificate(raw[0]); err == nil {
			c.peerMu.Lock()
			if c.peers == nil {
				c.peers = map[string]int{}
			}
			c.peers[cert.SerialNumber.String()]++
			c.peerMu.Unlock()
		}
		return nil
	}
	return cfg
}

// PeerSerials returns how many handshakes the proxy accepted per broker
// certificate serial.
func (c *Chain) PeerSerials() map[string]int {
	c.peerMu.Lock()
	defer c.peerMu.Unlock()
	out := map[string]int{}
	for k, v := range c.peers {
		out[k] = v
	}
	return out
}

// DropProxyConnections closes every connection the proxy accepted, as a
// network blip or a proxy restart would; the broker reconnects by itself.
func (c *Chain) DropProxyConnections() int { return c.proxyLis.dropAll() }

// startProxy starts a proxy with the chain's proxy configuration on addr.
func (c *Chain) startProxy(t testing.TB, addr string) {
	t.Helper()
	p, err := proxy.New(c.proxyCfg)
	if err != nil {
		t.Fatal(err)
	}
	tcp, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(c.ctx)
	c.Proxy, c.proxyCancel, c.proxyDone = p, cancel, make(chan struct{})
	c.proxyLis = &trackingListener{Listener: tcp, conns: map[net.Conn]struct{}{}}
	lis, done := c.proxyLis, c.proxyDone
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		defer close(done)
		c.served("proxy", p.Serve(ctx, lis))
	}()
}

// RestartProxy stops the proxy as its process would on SIGTERM (GOAWAY to
// the broker, the calls in flight finish) and starts a new one on the same
// address, as a restarted proxy pod would be.
func (c *Chain) RestartProxy(t testing.TB) {
	t.Helper()
	c.StopProxy()
	c.StartProxy(t)
}

// StopProxy stops the proxy gracefully; its address refuses connections
// until StartProxy.
func (c *Chain) StopProxy() {
	c.proxyCancel()
	<-c.proxyDone
	c.Proxy.Close()
}

// StartProxy starts a new proxy on the stopped one's address.
func (c *Chain) StartProxy(t testing.TB) {
	t.Helper()
	// The old proxy's metrics stay in c.Registry; the new one's go to a
	// registry of their own.
	c.proxyCfg.Registerer = prometheus.NewRegistry()
	c.startProxy(t, c.ProxyAddr)
}

// SpareProxy is a second proxy of the chain's driver.
type SpareProxy struct {
	Addr string
	lis  *trackingListener
	stop func()
	reg  *prometheus.Registry
}

// Stop stops the spare proxy gracefully (GOAWAY, calls in flight finish);
// its address then refuses connections.
func (s *SpareProxy) Stop() { s.stop() }

// Handled is how many calls the spare proxy has answered
// (grpc_server_handled_total, every series).
func (s *SpareProxy) Handled() int { return int(CounterSum(s.reg, "grpc_server_handled_total")) }

// CounterSum adds up every series of counter name in g (-1 if g cannot be
// gathered).
func CounterSum(g prometheus.Gatherer, name string) float64 {
	mfs, err := g.Gather()
	if err != nil {
		return -1
	}
	n := 0.0
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				n += m.GetCounter().GetValue()
			}
		}
	}
	return n
}

// StartSpareProxy starts a second proxy of the chain's driver (the same
// identity and driver socket) on a new address, as a replacement pod
// would be; it is stopped at t.Cleanup. material, if given, is its
// certificate instead of the chain proxy's.
func (c *Chain) StartSpareProxy(t testing.TB, material ...*mtls.Material) *SpareProxy {
	t.Helper()
	cfg := c.proxyCfg
	if len(material) > 0 {
		cfg.TLS = mtls.ServerConfig(mtls.StaticSource{M: material[0]}, mtls.AuthorizeOneOf(mtls.BrokerID(TrustDomain)))
	}
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	p, err := proxy.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	tcp, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lis := &trackingListener{Listener: tcp, conns: map[net.Conn]struct{}{}}
	ctx, cancel := context.WithCancel(c.ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.served("spare proxy", p.Serve(ctx, lis))
	}()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			<-done
			p.Close()
		})
	}
	t.Cleanup(stop)
	return &SpareProxy{Addr: tcp.Addr().String(), lis: lis, stop: stop, reg: reg}
}

type trackingListener struct {
	net.Listener
	mu    sync.Mutex
	conns map[net.Conn]struct{}
}

func (l *trackingListener) Accept() (net.Conn, error) {
	conn, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	l.mu.Lock()
	l.conns[conn] = struct{}{}
	l.mu.Unlock()
	return conn, nil
}

func (l *trackingListener) dropAll() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := len(l.conns)
	for conn := range l.conns {
		conn.Close()
		delete(l.conns, conn)
	}
	return n
}

// SyncBuffer is a goroutine-safe log sink.
type SyncBuffer = testutil.SyncBuffer

// ShortTempDir makes a temp dir with a short path (unix sockets are limited
// to 108 bytes), removed at cleanup.
func ShortTempDir(t testing.TB) string { return testutil.ShortTempDir(t) }

var (
	sharedOnce sync.Once
	sharedCA   *mtls.CA
	sharedErr  error
)

// SharedCA is the CA every chain of this test binary trusts, so a test can
// mint special certificates before it starts a chain.
func SharedCA(t testing.TB) *mtls.CA {
	sharedOnce.Do(func() {
		now := time.Now()
		sharedCA, sharedErr = mtls.NewCA("chaintest CA", now.Add(-time.Hour), now.Add(48*time.Hour))
	})
	if sharedErr != nil {
		t.Fatal(sharedErr)
	}
	return sharedCA
}

// Start builds the chain; everything is stopped at t.Cleanup.
func Start(t testing.TB, o Options) *Chain {
	t.Helper()
	c := &Chain{Dir: ShortTempDir(t), Spans: tracetest.NewSpanRecorder(), Registry: prometheus.NewRegistry(), Logs: &SyncBuffer{}, t: t}
	c.Tracer = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(c.Spans))
	if o.Tracer != nil {
		c.Tracer, c.Spans = o.Tracer, o.Spans
	}
	c.Propagator = telemetry.Propagator()
	if o.LogLevel == 0 {
		o.LogLevel = slog.LevelDebug
	}
	log := slog.New(slog.NewJSONHandler(c.Logs, &slog.HandlerOptions{Level: o.LogLevel}))

	now := time.Now()
	ca := SharedCA(t)
	c.CA = ca
	// The broker reads its certificate from files so rotation can be tested.
	certPEM, keyPEM, err := ca.Issue(mtls.Leaf{ID: mtls.BrokerID(TrustDomain), NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	c.BrokerFiles.Cert, c.BrokerFiles.Key, c.BrokerFiles.CA = filepath.Join(c.Dir, "broker.crt"), filepath.Join(c.Dir, "broker.key"), filepath.Join(c.Dir, "ca.crt")
	for f, b := range map[string][]byte{c.BrokerFiles.Cert: certPEM, c.BrokerFiles.Key: keyPEM, c.BrokerFiles.CA: ca.CertPEM} {
		if err := os.WriteFile(f, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	var brokerSrc mtls.Source
	if o.BrokerMaterial != nil {
		brokerSrc = mtls.StaticSource{M: o.BrokerMaterial}
	} else {
		fs, err := mtls.NewFileSource(c.BrokerFiles.Cert, c.BrokerFiles.Key, c.BrokerFiles.CA, log)
		if err != nil {
			t.Fatal(err)
		}
		brokerSrc = fs
		c.BrokerSource = fs
	}
	proxyMat := o.ProxyMaterial
	if proxyMat == nil {
		id := mtls.DriverID(TrustDomain, o.Driver)
		if o.Node != "" {
			id = mtls.NodeDriverID(TrustDomain, o.Driver, o.Node)
		}
		if proxyMat, err = ca.IssueMaterial(mtls.Leaf{ID: id, NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)}); err != nil {
			t.Fatal(err)
		}
	}

	ctx, cancel := context.WithCancel(context.Background())
	c.cancel = cancel
	if o.BrokerReload > 0 && c.BrokerSource != nil {
		c.wg.Add(1)
		go func() { defer c.wg.Done(); c.BrokerSource.Run(ctx, o.BrokerReload) }()
	}

	// Proxy.
	c.proxyCfg = proxy.Config{
		DriverEndpoint: o.DriverEndpoint,
		Node:           o.Node,
		Version:        "test",
		Identity:       proxyMat.ID,
		TLS:            c.recordPeers(mtls.ServerConfig(mtls.StaticSource{M: proxyMat}, mtls.AuthorizeOneOf(mtls.BrokerID(TrustDomain)))),
		Logger:         log,
		TracerProvider: c.Tracer,
		Propagator:     c.Propagator,
		Registerer:     c.Registry,
	}
	c.ctx = ctx
	c.startProxy(t, "127.0.0.1:0")
	c.ProxyAddr = c.proxyLis.Addr().String()

	// Broker.
	b, err := broker.New(broker.Options{TrustDomain: TrustDomain, TLS: brokerSrc, Logger: log, TracerProvider: c.Tracer, Propagator: c.Propagator, Registerer: c.Registry, MaxMsgSize: o.MaxMsgSize})
	if err != nil {
		t.Fatal(err)
	}
	c.Broker = b
	dc := broker.DriverConfig{Name: o.Driver, Controller: &broker.ProxyConfig{Address: c.ProxyAddr}, Retry: o.Retry, Timeout: o.Timeout, MethodTimeouts: o.MethodTimeouts}
	if o.Node != "" {
		dc.Controller, dc.NodeLocal = nil, true
		dc.Nodes = []broker.ProxyConfig{{Node: o.Node, Address: c.ProxyAddr}}
	}
	if err := b.SetDriver(dc); err != nil {
		t.Fatal(err)
	}
	c.Front = filepath.Join(c.Dir, "front.sock")
	c.wg.Add(1)
	go func() { defer c.wg.Done(); c.served("front end", b.ServeSocket(ctx, o.Driver, c.Front)) }()

	t.Cleanup(c.Stop)
	waitCtx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	for {
		if _, err := os.Stat(c.Front); err == nil {
			break
		}
		if waitCtx.Err() != nil {
			t.Fatalf("front-end socket %s did not appear", c.Front)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if !o.NoWait {
		if err := b.WaitReady(waitCtx); err != nil {
			t.Fatalf("broker → proxy connection: %v", err)
		}
	}
	return c
}

// Stop stops the front end, the proxy and the broker.
func (c *Chain) Stop() {
	c.cancel()
	c.wg.Wait()
	c.Broker.Close()
	c.Proxy.Close()
	c.serveMu.Lock()
	defer c.serveMu.Unlock()
	for _, err := range c.serveErrs {
		c.t.Errorf("chain: %v", err)
	}
	c.serveErrs = nil
}

// Dial opens a plain CSI client connection to a unix socket.
func Dial(t testing.TB, path string, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	opts = append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)
	conn, err := grpc.NewClient("unix://"+path, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// ErrTimeout is returned by Eventually.
var ErrTimeout = errors.New("timed out")
