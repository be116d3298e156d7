package sampledriver

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

func faults(t *testing.T, specs ...string) Faults {
	t.Helper()
	var f Faults
	for _, s := range specs {
		if err := f.Set(s); err != nil {
			t.Fatal(err)
		}
	}
	return f
}

func TestFaultLatency(t *testing.T) {
	// A latency long enough that a machine's stall is not mistaken for it.
	const latency = time.Second
	c, d, stop := serveOn(t, Config{NodeID: "node-1", StateDir: t.TempDir(), Faults: faults(t, "CreateVolume=latency:1s")})
	start := time.Now()
	mustCreate(t, c, "slow", 1<<20)
	if el := time.Since(start); el < latency {
		t.Fatalf("CreateVolume took %v, want at least %v", el, latency)
	}
	start = time.Now()
	if _, err := c.Probe(ctxT(t), &csi.ProbeRequest{}); err != nil {
		t.Fatal(err)
	}
	if el := time.Since(start); el >= latency {
		t.Fatalf("Probe took %v; latency leaked to another method", el)
	}
	// The caller's deadline cuts the latency short and nothing happens.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	_, err := c.CreateVolume(ctx, createReq("never", 1<<20))
	wantCode(t, "CreateVolume past its deadline", err, codes.DeadlineExceeded)
	// A graceful stop waits for every call's handler: a call that ignored
	// its cancellation would have made its volume by then.
	stop()
	for _, v := range d.Volumes() {
		if v.Name == "never" {
			t.Fatal("a call cancelled during its injected latency still created a volume")
		}
	}
}

func TestFaultErrors(t *testing.T) {
	f := faults(t,
		"DeleteVolume=code:Internal",
		"CreateVolume=first:2,code:Unavailable",
		"*=rate:1,code:PermissionDenied",
		"ListVolumes=latency:1ms", // its own entry: the wildcard does not apply
	)
	f.Methods["GetCapacity"] = Fault{First: 1} // no code: Unavailable
	ep, d := StartTest(t, Config{Faults: f})
	c := dial(t, ep)
	ctx := ctxT(t)
	for i := 1; i <= 2; i++ {
		_, err := c.CreateVolume(ctx, createReq("v", 1<<20))
		wantCode(t, "CreateVolume call "+strconv.Itoa(i), err, codes.Unavailable)
	}
	if len(d.Volumes()) != 0 {
		t.Fatal("a call failed before handling created a volume")
	}
	vol := mustCreate(t, c, "v", 1<<20) // third call passes
	_, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()})
	wantCode(t, "DeleteVolume", err, codes.Internal)
	_, err = c.Probe(ctx, &csi.ProbeRequest{})
	wantCode(t, "Probe under the wildcard", err, codes.PermissionDenied)
	_, err = c.GetCapacity(ctx, &csi.GetCapacityRequest{})
	wantCode(t, "fault without a code", err, codes.Unavailable)
	if _, err := c.ListVolumes(ctx, &csi.ListVolumesRequest{}); err != nil {
		t.Fatalf("ListVolumes has its own entry: %v", err)
	}
	want := map[string]int64{"CreateVolume": 3, "DeleteVolume": 1, "Probe": 1, "ListVolumes": 1, "GetCapacity": 1}
	got := d.Calls()
	for m, n := range want {
		if got[m] != n || d.CallCount(m) != n {
			t.Errorf("calls of %s = %d, want %d (all: %v)", m, got[m], n, got)
		}
	}
}

func TestFaultAfterKeepsEffect(t *testing.T) {
	ep, d := StartTest(t, Config{Faults: faults(t, "CreateVolume=first:1,after,code:DeadlineExceeded")})
	c := dial(t, ep)
	_, err := c.CreateVolume(ctxT(t), createReq("lost-reply", 1<<20))
	wantCode(t, "first CreateVolume", err, codes.DeadlineExceeded)
	vols := d.Volumes()
	if len(vols) != 1 || vols[0].Name != "lost-reply" {
		t.Fatalf("volumes after a lost reply: %+v", vols)
	}
	// The CO retries, as external-provisioner does, and gets the same volume.
	if v := mustCreate(t, c, "lost-reply", 1<<20); v.GetVolumeId() != vols[0].ID {
		t.Fatalf("retry created %s, want %s", v.GetVolumeId(), vols[0].ID)
	}
}

func TestFaultRateIsSeeded(t *testing.T) {
	run := func() []bool {
		ep, _ := StartTest(t, Config{Faults: Faults{Seed: 42, Methods: map[string]Fault{"Probe": {Rate: 0.5, Code: codes.Unavailable}}}})
		c := dial(t, ep)
		out := make([]bool, 200)
		for i := range out {
			_, err := c.Probe(ctxT(t), &csi.ProbeRequest{})
			out[i] = err != nil
		}
		return out
	}
	a, b := run(), run()
	failed := 0
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("call %d: the same seed gave different outcomes", i)
		}
		if a[i] {
			failed++
		}
	}
	if failed < 60 || failed > 140 {
		t.Fatalf("%d of 200 calls failed at rate 0.5", failed)
	}
}

func TestFaultExitAfter(t *testing.T) {
	var mu sync.Mutex
	var exits []int
	exit := func(code int) {
		mu.Lock()
		defer mu.Unlock()
		exits = append(exits, code)
	}
	f := faults(t, "CreateVolume=exit-after:2")
	f.ExitAfter = 5
	f.Exit = exit
	ep, d := StartTest(t, Config{Faults: f})
	c := dial(t, ep)
	mustCreate(t, c, "one", 1<<20) // call 1 overall
	_, err := c.CreateVolume(ctxT(t), createReq("two", 1<<20))
	wantCode(t, "CreateVolume that triggers the exit", err, codes.Unavailable)
	if len(d.Volumes()) != 2 {
		t.Fatalf("the call that triggered the exit was not handled first: %+v", d.Volumes())
	}
	for i := 0; i < 2; i++ { // calls 3 and 4
		if _, err := c.Probe(ctxT(t), &csi.ProbeRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	_, err = c.Probe(ctxT(t), &csi.ProbeRequest{}) // call 5
	wantCode(t, "fifth call overall", err, codes.Unavailable)
	mu.Lock()
	defer mu.Unlock()
	if len(exits) != 2 || exits[0] != FaultExitCode || exits[1] != FaultExitCode {
		t.Fatalf("exits %v, want two with code %d", exits, FaultExitCode)
	}
}

// Environment of the driver child process of TestExitAfterRestart.
const (
	helperEnv         = "SAMPLEDRIVER_HELPER_PROCESS"
	helperStateEnv    = "SAMPLEDRIVER_HELPER_STATE"
	helperEndpointEnv = "SAMPLEDRIVER_HELPER_ENDPOINT"
	helperFaultEnv    = "SAMPLEDRIVER_HELPER_FAULT"
)

// TestMain runs the driver process that TestExitAfterRestart starts (this
// test binary again, with helperEnv set) instead of the tests.
func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) == "1" {
		os.Exit(helperDriverProcess())
	}
	os.Exit(m.Run())
}

func helperDriverProcess() int {
	cfg := Config{NodeID: "node-1", StateDir: os.Getenv(helperStateEnv), Endpoint: os.Getenv(helperEndpointEnv)}
	if spec := os.Getenv(helperFaultEnv); spec != "" {
		if err := cfg.Faults.Set(spec); err != nil {
			fmt.Fprintln(os.Stderr, "helper driver:", err)
			return 1
		}
	}
	d, err := New(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "helper driver:", err)
		return 1
	}
	defer d.Close()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	if err := d.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "helper driver:", err)
		return 1
	}
	return 0
}

// waitExit waits for cmd to end, killing it and failing the test after d.
func waitExit(t *testing.T, cmd *exec.Cmd, d time.Duration) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		return err
	case <-time.After(d):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("driver process still running after %v", d)
		return nil
	}
}

// TestExitAfterRestart kills a real driver process with an exit-after fault
// in the middle of a CreateVolume and checks that a restarted process on the
// same state dir knows the volume, so the CO's retry gets it back.
func TestExitAfterRestart(t *testing.T) {
	dir, err := os.MkdirTemp("", "sdp")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "csi.sock")
	start := func(fault string) *exec.Cmd {
		cmd := exec.Command(os.Args[0])
		cmd.Env = append(os.Environ(), helperEnv+"=1", helperStateEnv+"="+filepath.Join(dir, "state"),
			helperEndpointEnv+"=unix://"+sock, helperFaultEnv+"="+fault)
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _, _ = cmd.Process.Wait() })
		return cmd
	}
	waitReady := func(c clients) {
		for i := 0; i < 250; i++ {
			if _, err := os.Stat(sock); err == nil {
				if _, err := c.Probe(ctxT(t), &csi.ProbeRequest{}); err == nil {
					return
				}
			}
			time.Sleep(20 * time.Millisecond)
		}
		t.Fatal("driver process did not come up")
	}

	child := start("CreateVolume=exit-after:2")
	c := dial(t, "unix://"+sock)
	waitReady(c)
	first := mustCreate(t, c, "first", 1<<20)
	_, err = c.CreateVolume(ctxT(t), createReq("second", 1<<20))
	wantCode(t, "CreateVolume that kills the driver", err, codes.Unavailable)
	err = waitExit(t, child, 20*time.Second)
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != FaultExitCode {
		t.Fatalf("driver process ended with %v, want exit status %d", err, FaultExitCode)
	}

	child = start("")
	waitReady(c)
	list, err := c.ListVolumes(ctxT(t), &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	ids := map[string]bool{}
	for _, e := range list.GetEntries() {
		ids[e.GetVolume().GetVolumeId()] = true
	}
	second := mustCreate(t, c, "second", 1<<20) // the CO's retry
	if len(ids) != 2 || !ids[first.GetVolumeId()] || !ids[second.GetVolumeId()] {
		t.Fatalf("after restart: listed %v; first %s, second %s", ids, first.GetVolumeId(), second.GetVolumeId())
	}
	if err := child.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := waitExit(t, child, 20*time.Second); err != nil {
		t.Fatalf("driver process after SIGTERM: %v", err)
	}
	if _, err := os.Stat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket left after a clean stop: %v", err)
	}
}
