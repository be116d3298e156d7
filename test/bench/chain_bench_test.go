// Package bench measures the CSI path side by side: the same calls to a
// sample driver directly on its socket, and through front end → broker →
// proxy (mTLS) → driver, in one run, reported as figures and ratios.
//
//	go test -run='^$' -bench=. -benchtime=2000x -count=3 ./test/bench/
package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/procfs"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"google.golang.org/grpc"

	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/sampledriver"
)

// side is one way of reaching a driver.
type side struct {
	name      string
	conn      *grpc.ClientConn
	seq       atomic.Int64
	prefix    string
	driverPID int // the side's sample driver process
}

// setup starts two sample drivers with their own state, each in a process
// of its own as in production (so the driver's garbage and fsyncs do not
// share a runtime with the broker), one reached directly and one through the
// chain, so that both see the same state growth.
func setup(b *testing.B) (direct, chain *side) {
	b.Helper()
	epDirect, pidDirect := startDriverProcessPID(b)
	epChain, pidChain := startDriverProcessPID(b)
	// Tracing as in production without an OTEL exporter configured: spans
	// are made (trace IDs reach Events and logs) and sampled, not recorded.
	tp := sdktrace.NewTracerProvider()
	b.Cleanup(func() { tp.Shutdown(context.Background()) })
	c := chaintest.Start(b, chaintest.Options{Driver: sampledriver.DefaultName, DriverEndpoint: epChain, LogLevel: slog.LevelWarn, Tracer: tp})
	direct = &side{name: "direct", conn: chaintest.Dial(b, epDirect[len("unix://"):]), prefix: "d", driverPID: pidDirect}
	chain = &side{name: "chain", conn: chaintest.Dial(b, c.Front), prefix: "c", driverPID: pidChain}
	return direct, chain
}

const childEnv = "CSIBROKER_BENCH_DRIVER"

// TestMain doubles as the sample driver's process: the benchmark re-executes
// its own binary with childEnv set to a socket path.
func TestMain(m *testing.M) {
	if sock := os.Getenv(childEnv); sock != "" {
		os.Exit(runDriver(sock))
	}
	if sock := os.Getenv(echoEnv); sock != "" {
		os.Exit(runEcho(sock))
	}
	os.Exit(m.Run())
}

func runDriver(sock string) int {
	cfg := sampledriver.Config{Endpoint: "unix://" + sock, StateDir: filepath.Join(filepath.Dir(sock), "state"), NodeID: "node-1",
		Logger: slog.New(slog.DiscardHandler)}
	// CSIBROKER_BENCH_PROBE_LATENCY makes Probe take that long, to tell a
	// hop's work from the cost of waking idle threads after a slow call.
	if d, err := time.ParseDuration(os.Getenv("CSIBROKER_BENCH_PROBE_LATENCY")); err == nil && d > 0 {
		cfg.Faults.Methods = map[string]sampledriver.Fault{"Probe": {Latency: d}}
	}
	// CSIBROKER_BENCH_CREATE_LATENCY makes CreateVolume take that long
	// (BenchmarkCreateVolume10ms: a driver whose storage answers in
	// milliseconds).
	if d, err := time.ParseDuration(os.Getenv(createLatencyEnv)); err == nil && d > 0 {
		cfg.Faults.Methods = map[string]sampledriver.Fault{"CreateVolume": {Latency: d}}
	}
	d, err := sampledriver.New(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	if err := d.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// startDriverProcess runs a sample driver in a child process and returns
// its endpoint; it is stopped (by PID) at cleanup.
func startDriverProcess(b *testing.B) string {
	b.Helper()
	ep, _ := startDriverProcessPID(b)
	return ep
}

// startDriverProcessPID is startDriverProcess that also returns the
// driver's PID.
func startDriverProcessPID(b *testing.B) (string, int) {
	b.Helper()
	dir := chaintest.ShortTempDir(b)
	sock := filepath.Join(dir, "csi.sock")
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), childEnv+"="+sock)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	b.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(sock); err == nil {
			return "unix://" + sock, cmd.Process.Pid
		}
		if time.Now().After(deadline) {
			b.Fatalf("driver socket %s did not appear", sock)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

var capab = []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}}, AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}}

type method struct {
	name string
	call func(ctx context.Context, s *side) error
}

var methods = []method{
	{"Probe", func(ctx context.Context, s *side) error {
		_, err := csi.NewIdentityClient(s.conn).Probe(ctx, &csi.ProbeRequest{})
		return err
	}},
	{"CreateVolume", func(ctx context.Context, s *side) error {
		n := s.seq.Add(1)
		_, err := csi.NewControllerClient(s.conn).CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: fmt.Sprintf("%s-%d", s.prefix, n), VolumeCapabilities: capab, CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20}})
		return err
	}},
}

func quantile(d []time.Duration, q float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[int(q*float64(len(s)-1))]
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// BenchmarkLatencyC1 alternates one direct call and one chain call, b.N
// times each, at concurrency 1, and reports both sides' p50/p99, the added
// p50 and the ratio.
func BenchmarkLatencyC1(b *testing.B) {
	for _, m := range methods {
		b.Run(m.name, func(b *testing.B) {
			direct, chain := setup(b)
			ctx := context.Background()
			// Warm both paths (connections, TLS, caches).
			for i := 0; i < 20; i++ {
				if err := m.call(ctx, direct); err != nil {
					b.Fatal(err)
				}
				if err := m.call(ctx, chain); err != nil {
					b.Fatal(err)
				}
			}
			dl := make([]time.Duration, 0, b.N)
			cl := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				if err := m.call(ctx, direct); err != nil {
					b.Fatal(err)
				}
				t1 := time.Now()
				if err := m.call(ctx, chain); err != nil {
					b.Fatal(err)
				}
				t2 := time.Now()
				dl = append(dl, t1.Sub(t0))
				cl = append(cl, t2.Sub(t1))
			}
			b.StopTimer()
			dp50, _, cp50, _ := reportLatencies(b, dl, cl)
			b.ReportMetric(float64(cp50)/float64(dp50), "chain/direct-p50")
		})
	}
}

// BenchmarkLatencyC8 is BenchmarkLatencyC1 for Probe at concurrency 8: the
// sides alternate in eight rounds of b.N/8 calls each, eight callers at a
// time; it reports both sides' p50/p99 and the added p50 and p99. Under
// moderate load calls have company on their connections, which c=1 and
// c=32 (throughput) do not show: what sharing a socket write costs a
// call's latency, or saves it.
func BenchmarkLatencyC8(b *testing.B) {
	const conc, rounds = 8, 8
	m := methods[0]
	direct, chain := setup(b)
	ctx := context.Background()
	timed(ctx, b, m, direct, 64, conc)
	timed(ctx, b, m, chain, 64, conc)
	per := max(b.N/rounds, conc)
	var dl, cl []time.Duration
	b.ResetTimer()
	for r := 0; r < rounds; r++ {
		dl = append(dl, timed(ctx, b, m, direct, per, conc)...)
		cl = append(cl, timed(ctx, b, m, chain, per, conc)...)
	}
	b.StopTimer()
	_, dp99, _, cp99 := reportLatencies(b, dl, cl)
	b.ReportMetric(us(cp99-dp99), "added-p99-µs")
}

// reportLatencies reports both sides' p50 and p99 and the added p50, and
// returns the four quantiles.
func reportLatencies(b *testing.B, direct, chain []time.Duration) (dp50, dp99, cp50, cp99 time.Duration) {
	dp50, dp99, cp50, cp99 = quantile(direct, .5), quantile(direct, .99), quantile(chain, .5), quantile(chain, .99)
	b.ReportMetric(us(dp50), "direct-p50-µs")
	b.ReportMetric(us(dp99), "direct-p99-µs")
	b.ReportMetric(us(cp50), "chain-p50-µs")
	b.ReportMetric(us(cp99), "chain-p99-µs")
	b.ReportMetric(us(cp50-dp50), "added-p50-µs")
	b.ReportMetric(0, "ns/op") // the per-op figure mixes both sides; the metrics above are the result
	return dp50, dp99, cp50, cp99
}

// timed makes n calls with c workers and returns each call's latency.
func timed(ctx context.Context, b *testing.B, m method, s *side, n, c int) []time.Duration {
	var next atomic.Int64
	lat := make([][]time.Duration, c)
	errs := make(chan error, c)
	var wg sync.WaitGroup
	for w := 0; w < c; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(n) {
				t0 := time.Now()
				if err := m.call(ctx, s); err != nil {
					errs <- err
					return
				}
				lat[w] = append(lat[w], time.Since(t0))
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		b.Fatalf("%s %s: %v", s.name, m.name, err)
	}
	var out []time.Duration
	for _, l := range lat {
		out = append(out, l...)
	}
	return out
}

// run makes at least n calls with c workers, and goes on until at least
// minDur has passed; it returns the calls made and calls per second.
func run(ctx context.Context, b *testing.B, m method, s *side, n, c int, minDur time.Duration) (int, float64) {
	var next, made atomic.Int64
	var wg sync.WaitGroup
	var failed atomic.Value
	start := time.Now()
	until := start.Add(minDur)
	for w := 0; w < c; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(n) || time.Now().Before(until) {
				if err := m.call(ctx, s); err != nil {
					failed.CompareAndSwap(nil, err)
					return
				}
				made.Add(1)
			}
		}()
	}
	wg.Wait()
	if err := failed.Load(); err != nil {
		b.Fatalf("%s %s: %v", s.name, m.name, err)
	}
	k := int(made.Load())
	return k, float64(k) / time.Since(start).Seconds()
}

// BenchmarkThroughputC32 makes b.N calls with 32 concurrent callers on each
// side, alternating the sides in eight rounds so both meet the same machine
// noise and the same driver state size, and reports calls/s and the ratio.
// Each side's round lasts at least roundMin, so that the figure does not
// depend on how many calls -benchtime asks for (a round of a few hundred
// calls is mostly ramp-up and measured CPU time is coarse).
func BenchmarkThroughputC32(b *testing.B) {
	const conc, rounds, roundMin = 32, 8, 300 * time.Millisecond
	for _, m := range methods {
		b.Run(m.name, func(b *testing.B) {
			direct, chain := setup(b)
			ctx := context.Background()
			run(ctx, b, m, direct, 64, conc, 0)
			run(ctx, b, m, chain, 64, conc, 0)
			per := b.N / rounds
			if per < 1 {
				per = 1
			}
			var dSum, cSum float64
			var dCPU, cCPU time.Duration
			var dN, cN int
			var dSys, cSys uint64
			b.ResetTimer()
			for r := 0; r < rounds; r++ {
				t0 := cpuTime(b, direct, chain)
				n, rate := run(ctx, b, m, direct, per, conc, roundMin)
				dSum, dN = dSum+rate, dN+n
				t1 := cpuTime(b, direct, chain)
				n, rate = run(ctx, b, m, chain, per, conc, roundMin)
				cSum, cN = cSum+rate, cN+n
				t2 := cpuTime(b, direct, chain)
				dCPU += t1.self - t0.self + t1.direct - t0.direct
				cCPU += t2.self - t1.self + t2.chain - t1.chain
				dSys += t1.selfSys - t0.selfSys + t1.directSys - t0.directSys
				cSys += t2.selfSys - t1.selfSys + t2.chainSys - t1.chainSys
			}
			b.StopTimer()
			d, c := dSum/rounds, cSum/rounds
			b.ReportMetric(d, "direct-calls/s")
			b.ReportMetric(c, "chain-calls/s")
			b.ReportMetric(c/d, "chain/direct-throughput")
			// CPU per call of everything a side runs (the caller, and for
			// the chain the front end, broker and proxy, all in this
			// process; plus the side's driver process): steadier than
			// calls/s on a shared machine, and what the chain's own work
			// changes.
			b.ReportMetric(us(dCPU)/float64(dN), "direct-cpu-µs/call")
			b.ReportMetric(us(cCPU)/float64(cN), "chain-cpu-µs/call")
			// Read and write system calls per call, counted the same way:
			// how well each side batches frames into socket reads and
			// writes.
			b.ReportMetric(float64(dSys)/float64(dN), "direct-rw-syscalls/call")
			b.ReportMetric(float64(cSys)/float64(cN), "chain-rw-syscalls/call")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// cpuSample is the CPU time used so far by this process and by the two
// sides' driver processes, and the read and write system calls each made
// (/proc/<pid>/io).
type cpuSample struct {
	self, direct, chain          time.Duration
	selfSys, directSys, chainSys uint64
}

func cpuTime(b *testing.B, direct, chain *side) cpuSample {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	d, err1 := procCPU(direct.driverPID)
	c, err2 := procCPU(chain.driverPID)
	s, err3 := procSyscalls(os.Getpid())
	ds, err4 := procSyscalls(direct.driverPID)
	cs, err5 := procSyscalls(chain.driverPID)
	if err := errors.Join(err1, err2, err3, err4, err5); err != nil {
		b.Fatal(err)
	}
	return cpuSample{self: time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), direct: d, chain: c,
		selfSys: s, directSys: ds, chainSys: cs}
}

// procSyscalls is the number of read and write system calls a process made
// so far.
func procSyscalls(pid int) (uint64, error) {
	p, err := procfs.NewProc(pid)
	if err != nil {
		return 0, err
	}
	io, err := p.IO()
	if err != nil {
		return 0, err
	}
	return io.SyscR + io.SyscW, nil
}

// procCPU is the CPU time (user and system) a process used so far.
func procCPU(pid int) (time.Duration, error) {
	p, err := procfs.NewProc(pid)
	if err != nil {
		return 0, err
	}
	st, err := p.Stat()
	if err != nil {
		return 0, err
	}
	return time.Duration(st.CPUTime() * float64(time.Second)), nil
}
