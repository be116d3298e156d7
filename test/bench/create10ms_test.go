package bench

import (
	"context"
	"log/slog"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"google.golang.org/grpc"

	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/sampledriver"
)

const createLatencyEnv = "CSIBROKER_BENCH_CREATE_LATENCY"

// BenchmarkCreateVolume10ms: a CreateVolume whose driver takes 10 ms, at
// concurrency 1, four ways in one run, round robin: directly on the
// driver's socket; the Kubernetes controllers' path (a typed CSI client on
// the broker's connection: broker → proxy → driver); the front-end chain
// (front-end socket → broker → proxy → driver); and two byte-copying
// relays in the broker's and the proxy's places (unix socket, then mTLS;
// nothing parsed), the floor of any two-hop design. Each side has a
// sample driver process of its own. Reported: each side's p50, what each
// adds to the direct p50, that as a fraction of the direct p50, and the
// chain's addition over the relays'.
func BenchmarkCreateVolume10ms(b *testing.B) {
	os.Setenv(createLatencyEnv, "10ms")
	defer os.Unsetenv(createLatencyEnv)
	epDirect, epCtrl, epFront, epRelay := startDriverProcess(b), startDriverProcess(b), startDriverProcess(b), startDriverProcess(b)
	tp := sdktrace.NewTracerProvider()
	b.Cleanup(func() { tp.Shutdown(context.Background()) })
	ctrlChain := chaintest.Start(b, chaintest.Options{Driver: sampledriver.DefaultName, DriverEndpoint: epCtrl, LogLevel: slog.LevelWarn, Tracer: tp})
	frontChain := chaintest.Start(b, chaintest.Options{Driver: sampledriver.DefaultName, DriverEndpoint: epFront, LogLevel: slog.LevelWarn, Tracer: tp})
	ctrlConn, err := ctrlChain.Broker.ControllerConn(sampledriver.DefaultName)
	if err != nil {
		b.Fatal(err)
	}
	type way struct {
		name string
		conn grpc.ClientConnInterface
		lat  []time.Duration
	}
	ways := []*way{
		{name: "direct", conn: chaintest.Dial(b, epDirect[len("unix://"):])},
		{name: "controllers", conn: ctrlConn},
		{name: "frontend", conn: chaintest.Dial(b, frontChain.Front)},
		{name: "relays", conn: chaintest.Dial(b, startRelays(b, epRelay[len("unix://"):]))},
	}
	ctx := context.Background()
	seq := 0
	call := func(w *way) time.Duration {
		seq++
		t0 := time.Now()
		_, err := csi.NewControllerClient(w.conn).CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: w.name + "-" + strconv.Itoa(seq), VolumeCapabilities: capab, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20}})
		if err != nil {
			b.Fatalf("%s: %v", w.name, err)
		}
		return time.Since(t0)
	}
	for range 5 {
		for _, w := range ways {
			call(w)
		}
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for _, w := range ways {
			w.lat = append(w.lat, call(w))
		}
	}
	b.StopTimer()
	p50 := map[string]time.Duration{}
	for _, w := range ways {
		p50[w.name] = quantile(w.lat, .5)
		b.ReportMetric(us(p50[w.name]), w.name+"-p50-µs")
	}
	d, relays := p50["direct"], p50["relays"]-p50["direct"]
	for _, n := range []string{"controllers", "frontend", "relays"} {
		added := p50[n] - d
		b.ReportMetric(us(added), n+"-added-p50-µs")
		b.ReportMetric(float64(added)/float64(d), n+"-added/direct")
		if n != "relays" && relays > 0 {
			b.ReportMetric(float64(added)/float64(relays), n+"-added/relays-added")
		}
	}
	b.ReportMetric(0, "ns/op")
}
