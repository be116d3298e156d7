package chain

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testutil"
)

// The restart test runs the sample driver as a separate process (this test
// binary re-executed), so that it can really die and be started again.
const (
	childEnv     = "CSIBROKER_CHAIN_CHILD"
	childSocket  = "CSIBROKER_CHILD_SOCKET"
	childState   = "CSIBROKER_CHILD_STATE"
	childExitAft = "CSIBROKER_CHILD_EXIT_AFTER"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "sample-driver" {
		os.Exit(runChildDriver())
	}
	testutil.SkipPackageIfShort("the chain of broker, proxies and drivers under load")
	os.Exit(m.Run())
}

func runChildDriver() int {
	exitAfter, _ := strconv.ParseInt(os.Getenv(childExitAft), 10, 64)
	d, err := sampledriver.New(sampledriver.Config{
		Endpoint: "unix://" + os.Getenv(childSocket),
		StateDir: os.Getenv(childState),
		NodeID:   "node-1",
		Faults:   sampledriver.Faults{ExitAfter: exitAfter},
		Logger:   slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := d.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

type driverProc struct {
	cmd  *exec.Cmd
	done chan struct{}
	code int
}

func startDriverProc(t *testing.T, socket, state string, exitAfter int) *driverProc {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), childEnv+"=sample-driver", childSocket+"="+socket, childState+"="+state, childExitAft+"="+strconv.Itoa(exitAfter))
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &driverProc{cmd: cmd, done: make(chan struct{})}
	go func() {
		err := cmd.Wait()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			p.code = ee.ExitCode()
		}
		close(p.done)
	}()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

// TestDriverRestartWithCallsInFlight kills the driver process in the middle
// of a stream of CreateVolume calls (it exits before answering its 30th call)
// and starts it again, as kubelet would. Calls inside the retry budget must
// all succeed, the proxy must reconnect by itself, and the volumes created
// before the crash must still be there.
func TestDriverRestartWithCallsInFlight(t *testing.T) {
	dir := chaintest.ShortTempDir(t)
	socket, state := filepath.Join(dir, "d.sock"), filepath.Join(dir, "state")
	first := startDriverProc(t, socket, state, 30)
	waitSocket(t, socket)
	c := chaintest.Start(t, chaintest.Options{Driver: sampledriver.DefaultName, DriverEndpoint: "unix://" + socket, LogLevel: slog.LevelWarn,
		Retry: broker.RetryConfig{MaxAttempts: 12, IntervalStart: 50 * time.Millisecond, IntervalMax: 500 * time.Millisecond}})
	client := csi.NewControllerClient(chaintest.Dial(t, c.Front))

	// Supervisor: restart the driver 100ms after it dies.
	var exitedAt, restartedAt atomic.Int64
	restarted := make(chan *driverProc, 1)
	// Its t calls must happen while the test runs: it gives up once the
	// test body has returned (a driver that never died).
	testEnded := make(chan struct{})
	defer close(testEnded)
	go func() {
		select {
		case <-first.done:
		case <-testEnded:
			return
		}
		exitedAt.Store(time.Now().UnixNano())
		time.Sleep(100 * time.Millisecond)
		restartedAt.Store(time.Now().UnixNano())
		restarted <- startDriverProc(t, socket, state, 0)
	}()

	const workers, perWorker = 4, 20
	var failed atomic.Int64
	var firstSuccessAfterExit atomic.Int64
	var errMu sync.Mutex
	var errs []error
	var wg sync.WaitGroup
	capab := []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}}, AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}}
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := 0; i < perWorker; i++ {
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: fmt.Sprintf("vol-%d-%d", w, i), VolumeCapabilities: capab,
					CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20}})
				cancel()
				if err != nil {
					failed.Add(1)
					errMu.Lock()
					errs = append(errs, err)
					errMu.Unlock()
					continue
				}
				if ex := exitedAt.Load(); ex != 0 {
					firstSuccessAfterExit.CompareAndSwap(0, time.Now().UnixNano())
				}
				time.Sleep(5 * time.Millisecond)
			}
		}(w)
	}
	wg.Wait()

	var second *driverProc
	select {
	case second = <-restarted:
	case <-time.After(10 * time.Second):
		t.Fatal("the driver never exited: the fault knob did not fire, so nothing was tested")
	}
	if first.code != sampledriver.FaultExitCode {
		t.Fatalf("driver exited with %d, want the fault exit code %d", first.code, sampledriver.FaultExitCode)
	}
	if failed.Load() != 0 {
		t.Fatalf("%d of %d calls failed across the restart: %v", failed.Load(), workers*perWorker, errs)
	}
	if firstSuccessAfterExit.Load() == 0 {
		t.Fatal("no call succeeded after the driver exited")
	}
	down := time.Duration(restartedAt.Load() - exitedAt.Load())
	recovered := time.Duration(firstSuccessAfterExit.Load() - exitedAt.Load())
	t.Logf("driver exited; restarted after %v; first successful call %v after the exit (reconnect %v after the restart)", down.Round(time.Millisecond), recovered.Round(time.Millisecond), (recovered - down).Round(time.Millisecond))

	// Later calls succeed with no process restarted but the driver, and the
	// volumes made before the crash survived it.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := client.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if got := len(resp.GetEntries()); got != workers*perWorker {
		t.Fatalf("driver lists %d volumes, want %d", got, workers*perWorker)
	}
	select {
	case <-second.done:
		t.Fatal("the restarted driver died")
	default:
	}
}

func waitSocket(t *testing.T, path string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if _, err := os.Stat(path); err == nil {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("driver socket %s did not appear", path)
}
