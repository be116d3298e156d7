package chain

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/chaintest"
)

// moveDriver re-registers the chain's driver with its controller proxy at
// addr, as discovery does when the proxy pod is replaced.
func moveDriver(t *testing.T, c *chaintest.Chain, addr string) {
	t.Helper()
	d, err := c.Broker.Driver(echoName)
	if err != nil {
		t.Fatal(err)
	}
	cfg := d.Config()
	cfg.Controller = &broker.ProxyConfig{Address: addr}
	if err := c.Broker.SetDriver(cfg); err != nil {
		t.Fatal(err)
	}
}

// TestReconfiguredDriverDrainsItsOldProxy: calls in flight when the
// driver's proxy moves finish on the old proxy (no retries are allowed
// here, so none can hide a failure), new calls go to the new one, and the
// old connection is closed once its last call has ended.
func TestReconfiguredDriverDrainsItsOldProxy(t *testing.T) {
	e, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep,
		Retry: broker.RetryConfig{MaxAttempts: 1}})
	spare := c.StartSpareProxy(t)
	client := csi.NewControllerClient(chaintest.Dial(t, c.Front))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	const slow = 4
	errs := make(chan error, slow)
	for i := 0; i < slow; i++ {
		go func() {
			_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: fmt.Sprintf("slow-%d", i), Parameters: map[string]string{"sleep-ms": "2000"}})
			errs <- err
		}()
	}
	for e.calls.Load() < slow {
		if ctx.Err() != nil {
			t.Fatal("the slow calls did not reach the driver")
		}
		time.Sleep(5 * time.Millisecond)
	}
	moveDriver(t, c, spare.Addr)

	if _, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "after"}); err != nil {
		t.Fatalf("a call after the move: %v", err)
	}
	if n := spare.Handled(); n != 1 {
		t.Fatalf("the new proxy answered %d calls after the move, want the one call made since", n)
	}
	if strings.Contains(c.Logs.String(), "proxy connection closed") {
		t.Fatal("the old proxy's connection was closed with calls in flight")
	}
	for i := 0; i < slow; i++ {
		if err := <-errs; err != nil {
			t.Errorf("a call in flight during the move: %v", err)
		}
	}
	waitLog(t, c, "proxy connection closed: the driver was reconfigured or removed", c.ProxyAddr)
	st := c.Broker.Status()
	if len(st) != 1 || len(st[0].Proxies) != 1 || st[0].Proxies[0].Address != spare.Addr || st[0].Proxies[0].State != "READY" {
		t.Fatalf("status after the move: %+v", st)
	}
}

// TestRetriesFollowAMovedDriver: the driver's proxy is gone and callers
// are retrying against its address when the driver is re-registered at a
// new proxy; their next attempts go there, and every call succeeds.
func TestRetriesFollowAMovedDriver(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, LogLevel: 4,
		// A budget (1,000 attempts, 100 s) beyond the callers' 30 s: only
		// a move or a removal ends their retries before their deadline.
		Retry: broker.RetryConfig{MaxAttempts: 1000, IntervalStart: 20 * time.Millisecond, IntervalMax: 100 * time.Millisecond}})
	spare := c.StartSpareProxy(t)
	client := csi.NewControllerClient(chaintest.Dial(t, c.Front))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	c.StopProxy()
	const callers = 4
	var wg sync.WaitGroup
	errs := make([]error, callers)
	for i := 0; i < callers; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: fmt.Sprintf("moved-%d", i)})
		}()
	}
	// Every caller has retried at least once against the stopped proxy.
	deadline := time.Now().Add(20 * time.Second)
	for retriedCount(t, c) < callers {
		if time.Now().After(deadline) {
			t.Fatalf("callers retried %v times against the stopped proxy, want ≥ %d", retriedCount(t, c), callers)
		}
		time.Sleep(5 * time.Millisecond)
	}
	moveDriver(t, c, spare.Addr)
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("caller %d: %v (code %s)", i, err, status.Code(err))
		}
	}
	if n := spare.Handled(); n < callers {
		t.Fatalf("the new proxy answered %d calls, want the %d callers'", n, callers)
	}

	// A driver removed while a call retries against its stopped proxy:
	// the call ends at once instead of spending its retry budget.
	spare.Stop()
	before := retriedCount(t, c)
	done := make(chan error, 1)
	go func() {
		_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "removed"})
		done <- err
	}()
	deadline = time.Now().Add(20 * time.Second)
	for retriedCount(t, c) < before+2 {
		if time.Now().After(deadline) {
			t.Fatal("the last call did not retry against the stopped proxy")
		}
		time.Sleep(5 * time.Millisecond)
	}
	c.Broker.RemoveDriver(echoName)
	removed := time.Now()
	// Unavailable, not the caller's DeadlineExceeded: the retries ended
	// with the removal, long before the budget would have.
	err := <-done
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("a call whose driver was removed: %v (after %v), want Unavailable at once", err, time.Since(removed).Round(time.Millisecond))
	}
	t.Logf("a call whose driver was removed ended %v after the removal: %v", time.Since(removed), err)
}

// retriedCount is the chain's csibroker_csi_retries_total, all series.
func retriedCount(t *testing.T, c *chaintest.Chain) float64 {
	t.Helper()
	n := chaintest.CounterSum(c.Registry, "csibroker_csi_retries_total")
	if n < 0 {
		t.Fatal("cannot gather the chain's metrics")
	}
	return n
}

// TestCloseEndsDrainingCalls: Broker.Close also ends the calls still in
// flight on a connection drained by a move, instead of leaving them (and
// the old proxy's socket) until the drain's grace ends; a registration
// after Close is refused.
func TestCloseEndsDrainingCalls(t *testing.T) {
	e, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, Retry: broker.RetryConfig{MaxAttempts: 1}})
	spare := c.StartSpareProxy(t)
	d, err := c.Broker.Driver(echoName)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := d.Controller()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		// It waits for its context: only the broker's Close (Unavailable)
		// or the caller's deadline (DeadlineExceeded) ends it.
		_, err := csi.NewControllerClient(conn).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "slow", Parameters: map[string]string{"wait": "true"}})
		done <- err
	}()
	for e.calls.Load() < 1 {
		if ctx.Err() != nil {
			t.Fatal("the slow call did not reach the driver")
		}
		time.Sleep(5 * time.Millisecond)
	}
	moveDriver(t, c, spare.Addr)
	closed := time.Now()
	c.Broker.Close()
	if err := <-done; status.Code(err) != codes.Unavailable {
		t.Errorf("the draining call ended with %v %v after Close, want Unavailable (the broker closed)", err, time.Since(closed).Round(time.Millisecond))
	}
	cfg := d.Config()
	if err := c.Broker.SetDriver(cfg); err == nil {
		t.Error("SetDriver after Close succeeded")
	}
}

// TestControllerCallsWaitForTheControllerProxy: a driver registered with
// node proxies only (its controller pod not ready: discovery skips it)
// gets no controller call through a node proxy, whose plugin knows nothing
// of publications; a node-local driver, whose node plugins are its
// controllers, does.
func TestControllerCallsWaitForTheControllerProxy(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, Node: "n1"})
	if _, err := c.Broker.ControllerConn(echoName); err != nil {
		t.Fatalf("node-local driver with a node proxy only: %v", err)
	}
	d, err := c.Broker.Driver(echoName)
	if err != nil {
		t.Fatal(err)
	}
	cfg := d.Config()
	cfg.NodeLocal = false
	if err := c.Broker.SetDriver(cfg); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Broker.ControllerConn(echoName); !errors.Is(err, broker.ErrNoProxy) {
		t.Fatalf("driver with a node proxy only: %v, want ErrNoProxy (wait for the controller proxy)", err)
	}
}

// TestRefusedReconfigurationChangesNothing: a new registration that fails
// (a proxy address that cannot be dialled) leaves the driver as it was,
// the timeouts of the connections it would have kept included.
func TestRefusedReconfigurationChangesNothing(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, Timeout: 10 * time.Second,
		Retry: broker.RetryConfig{MaxAttempts: 1}})
	d, err := c.Broker.Driver(echoName)
	if err != nil {
		t.Fatal(err)
	}
	cfg := d.Config()
	cfg.Timeout = 50 * time.Millisecond
	cfg.Nodes = append(cfg.Nodes, broker.ProxyConfig{Node: "n1", Address: "10.0.0.5:%zz"})
	if err := c.Broker.SetDriver(cfg); err == nil {
		t.Fatal("a registration with an address that cannot be dialled was accepted")
	}
	client := csi.NewControllerClient(chaintest.Dial(t, c.Front))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "slow", Parameters: map[string]string{"sleep-ms": "300"}}); err != nil {
		t.Fatalf("a 300 ms call under the registration in force (10 s timeout): %v", err)
	}
}
