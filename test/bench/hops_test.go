package bench

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/sampledriver"
)

// BenchmarkHopsC32 measures Probe throughput at concurrency 32 as each hop is
// added: the driver socket alone; the proxy over mTLS (and, for comparison,
// a byte-copying relay behind an mTLS listener in the proxy's place); the
// broker's client (timeout, retry, tracing, metrics) to the proxy; and the
// broker's front-end socket. It shows where the chain's cost lies.
func BenchmarkHopsC32(b *testing.B) { benchHops(b, 32) }

// BenchmarkHopsC1 is the same at concurrency 1, reporting each hop's p50
// latency: where the chain's added latency lies.
func BenchmarkHopsC1(b *testing.B) { benchHops(b, 1) }

func benchHops(b *testing.B, conc int) {
	ep := startDriverProcess(b)
	tp := sdktrace.NewTracerProvider()
	b.Cleanup(func() { tp.Shutdown(context.Background()) })
	c := chaintest.Start(b, chaintest.Options{Driver: sampledriver.DefaultName, DriverEndpoint: ep, LogLevel: slog.LevelWarn, Tracer: tp})
	m, err := chaintest.SharedCA(b).IssueMaterial(mtls.Leaf{ID: mtls.BrokerID(chaintest.TrustDomain), NotBefore: c.CA.Cert.NotBefore, NotAfter: c.CA.Cert.NotAfter})
	if err != nil {
		b.Fatal(err)
	}
	pconn, err := grpc.NewClient("passthrough:///"+c.ProxyAddr, grpc.WithTransportCredentials(credentials.NewTLS(mtls.ClientConfig(mtls.StaticSource{M: m}, mtls.AuthorizeAny()))))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { pconn.Close() })
	d, err := c.Broker.Driver(sampledriver.DefaultName)
	if err != nil {
		b.Fatal(err)
	}
	bconn, err := d.Controller()
	if err != nil {
		b.Fatal(err)
	}
	// The proxy's floor: a byte-copying relay behind the same mTLS listener
	// kind (nothing parsed), to tell the proxy's own cost from the hop's.
	raddr, rcfg := tlsRelay(b, ep[len("unix://"):])
	rconn, err := grpc.NewClient("passthrough:///"+raddr, grpc.WithTransportCredentials(credentials.NewTLS(rcfg)))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { rconn.Close() })
	probe := method{"Probe", nil}
	for _, s := range []struct {
		name string
		cc   grpc.ClientConnInterface
	}{{"1-driver", chaintest.Dial(b, ep[len("unix://"):])}, {"2-proxy", pconn}, {"2b-tls-byte-relay", rconn}, {"3-broker-client", bconn}, {"4-front-end", chaintest.Dial(b, c.Front)}} {
		b.Run(s.name, func(b *testing.B) {
			cc := s.cc
			probe.call = func(ctx context.Context, _ *side) error {
				_, err := csi.NewIdentityClient(cc).Probe(ctx, &csi.ProbeRequest{})
				return err
			}
			if conc > 1 {
				_, r := run(context.Background(), b, probe, &side{name: s.name}, b.N, conc, 0)
				b.ReportMetric(r, "calls/s")
				return
			}
			ctx := context.Background()
			lat := make([]time.Duration, 0, b.N)
			for i := 0; i < 20+b.N; i++ {
				t0 := time.Now()
				if err := probe.call(ctx, nil); err != nil {
					b.Fatal(err)
				}
				if i >= 20 {
					lat = append(lat, time.Since(t0))
				}
			}
			b.ReportMetric(us(quantile(lat, .5)), "p50-µs")
			b.ReportMetric(us(quantile(lat, .99)), "p99-µs")
			b.ReportMetric(0, "ns/op")
		})
	}
}
