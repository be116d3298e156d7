// Package chaintest starts the real CSI path for tests and benchmarks: a
// proxy over mTLS in front of a driver socket the caller already serves, a
// broker with its client chain, and the broker's front-end socket, all on
// loopback TCP and temporary unix sockets with certificates minted here.
package chaintest

import (
	"bytes"
	"context"
	"errors"
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
	// LogLevel for the broker's and proxy's loggers (default: debug, the most verbose).
	LogLevel slog.Level
	// ProxyCert overrides the proxy's certificate (refusal tests).
	ProxyMaterial *mtls.Material
	// BrokerMaterial overrides the broker's certificate.
	BrokerMaterial *mtls.Material
	// NoWait skips waiting for the broker's connection to become READY.
	NoWait bool
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

	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// SyncBuffer is a goroutine-safe log sink.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns everything written so far.
func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// ShortTempDir makes a temp dir with a short path (unix sockets are limited
// to 108 bytes), removed at cleanup.
func ShortTempDir(t testing.TB) string {
	d, err := os.MkdirTemp("", "cb")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

// Start builds the chain; everything is stopped at t.Cleanup.
func Start(t testing.TB, o Options) *Chain {
	t.Helper()
	c := &Chain{Dir: ShortTempDir(t), Spans: tracetest.NewSpanRecorder(), Registry: prometheus.NewRegistry(), Logs: &SyncBuffer{}}
	c.Tracer = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(c.Spans))
	c.Propagator = telemetry.Propagator()
	if o.LogLevel == 0 {
		o.LogLevel = slog.LevelDebug
	}
	log := slog.New(slog.NewJSONHandler(c.Logs, &slog.HandlerOptions{Level: o.LogLevel}))

	now := time.Now()
	ca, err := mtls.NewCA("chaintest CA", now.Add(-time.Hour), now.Add(24*time.Hour))
	if err != nil {
		t.Fatal(err)
	}
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
	}
	proxyMat := o.ProxyMaterial
	if proxyMat == nil {
		if proxyMat, err = ca.IssueMaterial(mtls.Leaf{ID: mtls.DriverID(TrustDomain, o.Driver), NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)}); err != nil {
			t.Fatal(err)
		}
	}

	ctx, cancel := context.WithCancel(context.Background())
	c.cancel = cancel

	// Proxy.
	p, err := proxy.New(proxy.Config{
		DriverEndpoint: o.DriverEndpoint,
		Version:        "test",
		Identity:       proxyMat.ID,
		TLS:            mtls.ServerConfig(mtls.StaticSource{M: proxyMat}, mtls.AuthorizeOneOf(mtls.BrokerID(TrustDomain))),
		Logger:         log,
		TracerProvider: c.Tracer,
		Propagator:     c.Propagator,
		Registerer:     c.Registry,
	})
	if err != nil {
		t.Fatal(err)
	}
	c.Proxy = p
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c.ProxyAddr = lis.Addr().String()
	c.wg.Add(1)
	go func() { defer c.wg.Done(); _ = p.Serve(ctx, lis) }()

	// Broker.
	b, err := broker.New(broker.Options{TrustDomain: TrustDomain, TLS: brokerSrc, Logger: log, TracerProvider: c.Tracer, Propagator: c.Propagator, Registerer: c.Registry})
	if err != nil {
		t.Fatal(err)
	}
	c.Broker = b
	if err := b.SetDriver(broker.DriverConfig{Name: o.Driver, Controller: &broker.ProxyConfig{Address: c.ProxyAddr}, Retry: o.Retry, Timeout: o.Timeout}); err != nil {
		t.Fatal(err)
	}
	c.Front = filepath.Join(c.Dir, "front.sock")
	c.wg.Add(1)
	go func() { defer c.wg.Done(); _ = b.ServeSocket(ctx, o.Driver, c.Front) }()

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
