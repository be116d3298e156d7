package bench

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/mtls"
)

// relay accepts on lis and copies bytes both ways to a connection from dial,
// one connection per accepted one, until either side closes.
func relay(lis net.Listener, dial func() (net.Conn, error)) {
	for {
		in, err := lis.Accept()
		if err != nil {
			return
		}
		go func() {
			out, err := dial()
			if err != nil {
				in.Close()
				return
			}
			go func() { io.Copy(out, in); out.Close() }()
			io.Copy(in, out)
			in.Close()
		}()
	}
}

// tlsRelay serves a byte-copying relay to the driver socket behind a
// loopback mutual-TLS listener (the proxy's place, nothing parsed); it
// returns the listener's address and a client configuration with the
// broker's identity.
func tlsRelay(b *testing.B, driverSock string) (string, *tls.Config) {
	b.Helper()
	ca := chaintest.SharedCA(b)
	now := time.Now()
	bm, err := ca.IssueMaterial(mtls.Leaf{ID: mtls.BrokerID(chaintest.TrustDomain), NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour)})
	if err != nil {
		b.Fatal(err)
	}
	pm, err := ca.IssueMaterial(mtls.Leaf{ID: mtls.DriverID(chaintest.TrustDomain, "floor"), NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour)})
	if err != nil {
		b.Fatal(err)
	}
	tl, err := tls.Listen("tcp", "127.0.0.1:0", mtls.ServerConfig(mtls.StaticSource{M: pm}, mtls.AuthorizeAny()))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { tl.Close() })
	go relay(tl, func() (net.Conn, error) { return net.Dial("unix", driverSock) })
	return tl.Addr().String(), mtls.ClientConfig(mtls.StaticSource{M: bm}, mtls.AuthorizeAny())
}

// startRelays builds the lower bound of any two-process chain: a unix
// socket relay (the front end's place) that opens a mutual-TLS connection to
// tlsRelay (the proxy's place); bytes are copied, nothing is parsed. It
// returns the front socket's path.
func startRelays(b *testing.B, driverSock string) string {
	b.Helper()
	addr, ccfg := tlsRelay(b, driverSock)
	front := filepath.Join(chaintest.ShortTempDir(b), "front.sock")
	ul, err := net.Listen("unix", front)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { ul.Close() })
	go relay(ul, func() (net.Conn, error) { return tls.Dial("tcp", addr, ccfg) })
	return front
}

// echoEnv makes the test binary a byte echo on the unix socket it names
// (BenchmarkFloor/RoundTripC1's peer process).
const echoEnv = "CSIBROKER_BENCH_ECHO"

// runEcho serves a byte echo on sock until SIGTERM.
func runEcho(sock string) int {
	l, err := net.Listen("unix", sock)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	go func() { <-ctx.Done(); l.Close() }()
	for {
		c, err := l.Accept()
		if err != nil {
			return 0
		}
		go func() { io.Copy(c, c); c.Close() }()
	}
}

// startEcho starts a byte echo in a process of its own and returns a
// connection to it.
func startEcho(b *testing.B) net.Conn {
	b.Helper()
	sock := filepath.Join(chaintest.ShortTempDir(b), "echo.sock")
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), echoEnv+"="+sock)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { cmd.Process.Signal(syscall.SIGTERM); cmd.Wait() })
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		c, err := net.Dial("unix", sock)
		if err == nil {
			b.Cleanup(func() { c.Close() })
			return c
		}
		if time.Now().After(deadline) {
			b.Fatalf("echo socket %s: %v", sock, err)
		}
	}
}

// BenchmarkFloor is BenchmarkLatencyC1 and BenchmarkThroughputC32 for Probe
// with the broker and proxy replaced by byte-copying relays: what two more
// hops cost on this machine before any gRPC, tracing or routing work.
func BenchmarkFloor(b *testing.B) {
	probe := methods[0]
	b.Run("LatencyC1", func(b *testing.B) {
		epDirect, epRelay := startDriverProcess(b), startDriverProcess(b)
		direct := &side{name: "direct", conn: chaintest.Dial(b, epDirect[len("unix://"):])}
		chain := &side{name: "relays", conn: chaintest.Dial(b, startRelays(b, epRelay[len("unix://"):]))}
		ctx := context.Background()
		for i := 0; i < 20; i++ {
			if err := probe.call(ctx, direct); err != nil {
				b.Fatal(err)
			}
			if err := probe.call(ctx, chain); err != nil {
				b.Fatal(err)
			}
		}
		dl, cl := make([]time.Duration, 0, b.N), make([]time.Duration, 0, b.N)
		for i := 0; i < b.N; i++ {
			t0 := time.Now()
			if err := probe.call(ctx, direct); err != nil {
				b.Fatal(err)
			}
			t1 := time.Now()
			if err := probe.call(ctx, chain); err != nil {
				b.Fatal(err)
			}
			t2 := time.Now()
			dl, cl = append(dl, t1.Sub(t0)), append(cl, t2.Sub(t1))
		}
		dp50, cp50 := quantile(dl, .5), quantile(cl, .5)
		b.ReportMetric(us(dp50), "direct-p50-µs")
		b.ReportMetric(us(cp50), "relays-p50-µs")
		b.ReportMetric(us(cp50-dp50), "added-p50-µs")
		b.ReportMetric(0, "ns/op")
	})
	// RoundTripC1: a 64-byte write and its echo between two processes over
	// a unix socket, alternating with a direct Probe: what one process
	// hop costs on this machine without any protocol, against a whole
	// gRPC call; then the echo back to back (threads never idle).
	b.Run("RoundTripC1", func(b *testing.B) {
		direct := &side{name: "direct", conn: chaintest.Dial(b, startDriverProcess(b)[len("unix://"):])}
		echo := startEcho(b)
		ctx := context.Background()
		msg, got := make([]byte, 64), make([]byte, 64)
		ping := func() {
			if _, err := echo.Write(msg); err != nil {
				b.Fatal(err)
			}
			if _, err := io.ReadFull(echo, got); err != nil {
				b.Fatal(err)
			}
		}
		for i := 0; i < 20; i++ {
			ping()
			if err := probe.call(ctx, direct); err != nil {
				b.Fatal(err)
			}
		}
		el, dl := make([]time.Duration, 0, b.N), make([]time.Duration, 0, b.N)
		for i := 0; i < b.N; i++ {
			t0 := time.Now()
			ping()
			t1 := time.Now()
			if err := probe.call(ctx, direct); err != nil {
				b.Fatal(err)
			}
			t2 := time.Now()
			el, dl = append(el, t1.Sub(t0)), append(dl, t2.Sub(t1))
		}
		// The same echo back to back, nothing in between: the peer's
		// threads never go idle.
		hot := make([]time.Duration, 0, b.N)
		for i := 0; i < b.N; i++ {
			t0 := time.Now()
			ping()
			hot = append(hot, time.Since(t0))
		}
		ep50, dp50 := quantile(el, .5), quantile(dl, .5)
		b.ReportMetric(us(quantile(hot, .5)), "socket-back-to-back-p50-µs")
		b.ReportMetric(us(ep50), "socket-p50-µs")
		b.ReportMetric(us(dp50), "grpc-probe-p50-µs")
		b.ReportMetric(float64(dp50)/float64(ep50), "grpc/socket")
		b.ReportMetric(0, "ns/op")
	})
	b.Run("ThroughputC32", func(b *testing.B) {
		epDirect, epRelay := startDriverProcess(b), startDriverProcess(b)
		direct := &side{name: "direct", conn: chaintest.Dial(b, epDirect[len("unix://"):])}
		chain := &side{name: "relays", conn: chaintest.Dial(b, startRelays(b, epRelay[len("unix://"):]))}
		ctx := context.Background()
		run(ctx, b, probe, direct, 64, 32, 0)
		run(ctx, b, probe, chain, 64, 32, 0)
		per := max(b.N/8, 1)
		var dSum, cSum float64
		for r := 0; r < 8; r++ {
			_, d := run(ctx, b, probe, direct, per, 32, 300*time.Millisecond)
			_, c := run(ctx, b, probe, chain, per, 32, 300*time.Millisecond)
			dSum, cSum = dSum+d, cSum+c
		}
		b.ReportMetric(dSum/8, "direct-calls/s")
		b.ReportMetric(cSum/8, "relays-calls/s")
		b.ReportMetric(cSum/dSum, "relays/direct-throughput")
		b.ReportMetric(0, "ns/op")
	})
}
