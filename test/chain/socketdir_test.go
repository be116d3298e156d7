package chain

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/chaintest"
)

// waitPath waits until path exists (want true) or is gone (want false).
func waitPath(t *testing.T, path string, want bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := os.Stat(path)
		if (err == nil) == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: exists %v after 10s, want %v (stat: %v)", path, err == nil, want, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestSocketDirFollowsTheRegistry: the front-end socket directory has a
// socket for every registered driver, one registered later (as discovery
// does) included, none on a reserved path; a removed driver's socket lets
// its call in flight finish and goes, and comes back when the driver does.
func TestSocketDirFollowsTheRegistry(t *testing.T) {
	e, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	dir := chaintest.ShortTempDir(t)
	reserved := filepath.Join(dir, "csibroker-status.sock")
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- c.Broker.ServeSocketDir(ctx, dir, reserved) }()
	defer func() {
		cancel()
		<-served
	}()
	callCtx, callCancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer callCancel()

	echoSock := filepath.Join(dir, echoName+".sock")
	waitPath(t, echoSock, true)
	client := csi.NewControllerClient(chaintest.Dial(t, echoSock))
	if _, err := client.CreateVolume(callCtx, &csi.CreateVolumeRequest{Name: "first"}); err != nil {
		t.Fatalf("a call through the directory's socket: %v", err)
	}

	// Drivers registered later: one gets its socket, one whose socket
	// would be the reserved path gets none, and an error says why.
	d, err := c.Broker.Driver(echoName)
	if err != nil {
		t.Fatal(err)
	}
	echoCfg := d.Config()
	for _, name := range []string{"later.csi.test", "csibroker-status"} {
		if err := c.Broker.SetDriver(broker.DriverConfig{Name: name, Controller: &broker.ProxyConfig{Address: c.ProxyAddr}}); err != nil {
			t.Fatal(err)
		}
	}
	laterSock := filepath.Join(dir, "later.csi.test.sock")
	waitPath(t, laterSock, true)
	if _, err := os.Stat(reserved); err == nil {
		t.Fatalf("a driver's socket took the reserved path %s", reserved)
	}
	var sockets map[string]string
	deadline := time.Now().Add(10 * time.Second)
	for {
		sockets = map[string]string{}
		for _, ds := range c.Broker.Status() {
			sockets[ds.Name] = ds.Socket
		}
		logs := c.Logs.String()
		reported := strings.Contains(logs, "its path is reserved") && strings.Contains(logs, "csibroker-status")
		if reported && sockets[echoName] == echoSock && sockets["later.csi.test"] == laterSock {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 10s: status sockets %v, reserved path reported %v; logs:\n%s", sockets, reported, logs)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if sockets["csibroker-status"] != "" {
		t.Errorf("status sockets %v: the driver on the reserved path has one", sockets)
	}

	// A socket that cannot be made (its path is taken by a directory with
	// something in it) is tried again with no registry change, and serves
	// once the path is free.
	blocked := filepath.Join(dir, "blocked.csi.test.sock")
	if err := os.MkdirAll(filepath.Join(blocked, "x"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := c.Broker.SetDriver(broker.DriverConfig{Name: "blocked.csi.test", Controller: &broker.ProxyConfig{Address: c.ProxyAddr}}); err != nil {
		t.Fatal(err)
	}
	deadline = time.Now().Add(10 * time.Second)
	for !strings.Contains(c.Logs.String(), "socket failed") {
		if time.Now().After(deadline) {
			t.Fatalf("no error logged for the socket whose path is taken:\n%s", c.Logs.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := os.RemoveAll(blocked); err != nil {
		t.Fatal(err)
	}
	waitPath(t, blocked, true)
	if fi, err := os.Stat(blocked); err != nil || fi.Mode()&os.ModeSocket == 0 {
		t.Fatalf("%s once free: %v, %v; want a socket", blocked, fi, err)
	}

	// Removed with a call in flight: the call finishes, then the socket goes.
	slow := make(chan error, 1)
	go func() {
		_, err := client.CreateVolume(callCtx, &csi.CreateVolumeRequest{Name: "slow", Parameters: map[string]string{"sleep-ms": "1000"}})
		slow <- err
	}()
	for e.calls.Load() < 2 {
		if callCtx.Err() != nil {
			t.Fatal("the slow call did not reach the driver")
		}
		time.Sleep(5 * time.Millisecond)
	}
	c.Broker.RemoveDriver(echoName)
	if err := <-slow; err != nil {
		t.Fatalf("the call in flight when its driver was removed: %v", err)
	}
	waitPath(t, echoSock, false)
	if _, err := os.Stat(laterSock); err != nil {
		t.Fatalf("another driver's socket went with the removed one: %v", err)
	}

	// Back again.
	if err := c.Broker.SetDriver(echoCfg); err != nil {
		t.Fatal(err)
	}
	waitPath(t, echoSock, true)
	again := csi.NewControllerClient(chaintest.Dial(t, echoSock))
	if _, err := again.CreateVolume(callCtx, &csi.CreateVolumeRequest{Name: "again"}); err != nil {
		t.Fatalf("a call through the socket made again: %v", err)
	}

	cancel()
	if err := <-served; err != nil {
		t.Fatalf("ServeSocketDir: %v", err)
	}
	served <- nil // for the deferred wait
	for _, p := range []string{echoSock, laterSock} {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s after the directory stopped serving: %v", p, err)
		}
	}
}
