package bench

import (
	"context"
	"log/slog"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/sampledriver"
)

// BenchmarkHopsC32 measures Probe throughput at concurrency 32 as each hop is
// added: the driver socket alone; the proxy over mTLS; the broker's client
// connection (timeout, retry, tracing, metrics) to the proxy; and the
// broker's front-end socket. It shows where the chain's cost lies.
func BenchmarkHopsC32(b *testing.B) {
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
	probe := method{"Probe", nil}
	for _, s := range []struct {
		name string
		cc   grpc.ClientConnInterface
	}{{"1-driver", chaintest.Dial(b, ep[len("unix://"):])}, {"2-proxy", pconn}, {"3-broker-client", bconn}, {"4-front-end", chaintest.Dial(b, c.Front)}} {
		b.Run(s.name, func(b *testing.B) {
			cc := s.cc
			probe.call = func(ctx context.Context, _ *side) error {
				_, err := csi.NewIdentityClient(cc).Probe(ctx, &csi.ProbeRequest{})
				return err
			}
			r := run(context.Background(), b, probe, &side{name: s.name}, b.N, 32)
			b.ReportMetric(r, "calls/s")
		})
	}
}
