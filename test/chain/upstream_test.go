package chain

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/chaintest"
)

// TestFrontEndFollowsProxyRestarts restarts the proxy three times (GOAWAY,
// the calls in flight finish, a new proxy on the same address) while four
// callers keep calling through the front end. The broker's own connection
// to the proxy must finish what the old proxy accepted, retry what it
// refused, and dial the new one: no call fails, and calls succeed after
// each restart.
func TestFrontEndFollowsProxyRestarts(t *testing.T) {
	e, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, LogLevel: 4,
		Retry: broker.RetryConfig{MaxAttempts: 8, IntervalStart: 20 * time.Millisecond, IntervalMax: 200 * time.Millisecond}})
	client := csi.NewControllerClient(chaintest.Dial(t, c.Front))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	var ok atomic.Int64
	var mu sync.Mutex
	var failures []error
	stop := make(chan struct{})
	var stopOnce sync.Once
	var wg sync.WaitGroup
	// Stopped on a failure too (t.Fatal below), not left calling.
	t.Cleanup(func() { stopOnce.Do(func() { close(stop) }); wg.Wait() })
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ctx.Err() == nil; i++ {
				select {
				case <-stop:
					return
				default:
				}
				_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: fmt.Sprintf("r-%d-%d", g, i), Parameters: map[string]string{"sleep-ms": "5"}})
				if err != nil {
					mu.Lock()
					failures = append(failures, err)
					mu.Unlock()
					continue
				}
				ok.Add(1)
			}
		}()
	}
	waitOK := func(n int64) {
		t.Helper()
		for ok.Load() < n {
			if ctx.Err() != nil {
				t.Fatalf("only %d calls succeeded, want %d", ok.Load(), n)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	waitOK(20)
	for r := 0; r < 3; r++ {
		c.RestartProxy(t)
		waitOK(ok.Load() + 20)
	}
	stopOnce.Do(func() { close(stop) })
	wg.Wait()
	for _, err := range failures {
		t.Errorf("call failed: %v", err)
	}
	if e.calls.Load() < ok.Load() {
		t.Errorf("driver saw %d calls, callers %d successes", e.calls.Load(), ok.Load())
	}
	t.Logf("%d calls succeeded across 3 proxy restarts", ok.Load())
}

// TestFrontEndBoundsAnswers: an answer larger than the broker's MaxMsgSize
// fails with ResourceExhausted and a clear message, and the connection
// serves the next call.
func TestFrontEndBoundsAnswers(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, MaxMsgSize: 1 << 20})
	client := csi.NewControllerClient(chaintest.Dial(t, c.Front))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "huge", Parameters: map[string]string{"reply-bytes": fmt.Sprint(2 << 20)}})
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "larger than max") {
		t.Fatalf("a 2 MiB answer with a 1 MiB limit: %v", err)
	}
	resp, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "small", Parameters: map[string]string{"reply-bytes": "1000"}})
	if err != nil || len(resp.GetVolume().GetVolumeContext()["pad"]) != 1000 {
		t.Fatalf("the next call: %v", err)
	}
}

// TestProxyConnectionStateFollowsTheProxy: the broker keeps its connection
// to a proxy up by itself, so its state (the status API and the
// csibroker_proxy_connection_state metric) says whether the proxy is
// reachable, and a proxy that comes back is connected before any call.
func TestProxyConnectionStateFollowsTheProxy(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	state := func() string {
		st := c.Broker.Status()
		if len(st) != 1 || len(st[0].Proxies) != 1 {
			t.Fatalf("status %+v", st)
		}
		return st[0].Proxies[0].State
	}
	waitState := func(want ...string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			got := state()
			for _, w := range want {
				if got == w {
					return
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("proxy connection state %s, want %v", got, want)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	waitState("READY")
	c.StopProxy()
	waitState("TRANSIENT_FAILURE")
	// Said in the log, once per reason, with the driver and the proxy.
	waitLog(t, c, "proxy connection failed", "connection refused", echoName)
	// Two more redials fail alike before the proxy comes back.
	for deadline := time.Now().Add(10 * time.Second); strings.Count(c.Logs.String(), `"msg":"proxy connection failed again"`) < 2; {
		if time.Now().After(deadline) {
			t.Fatalf("the broker did not keep redialling a stopped proxy:\n%s", c.Logs.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	c.StartProxy(t)
	waitState("READY")
	waitLog(t, c, "proxy connected", c.ProxyAddr)
	if n := strings.Count(c.Logs.String(), `"msg":"proxy connection failed"`); n != 1 {
		t.Errorf("%d warnings for one refused proxy, want 1 (repeated failures alike are debug lines)", n)
	}
	metrics, err := c.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, mf := range metrics {
		if mf.GetName() != "csibroker_proxy_connection_state" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "state" && l.GetValue() == "READY" {
					found = true
				}
			}
		}
	}
	if !found {
		t.Fatal("csibroker_proxy_connection_state has no READY series after the proxy came back")
	}
}
