package sampledriver

import (
	"context"
	"net"
	"os"
	"path/filepath"
)

// TestingT is the part of testing.TB that StartTest uses (declared here so
// that the driver binary does not link package testing).
type TestingT interface {
	Helper()
	Cleanup(func())
	Fatalf(format string, args ...any)
	Errorf(format string, args ...any)
	Logf(format string, args ...any)
}

// StartTest serves a driver for a test on a fresh unix socket and returns
// its endpoint ("unix:///tmp/sd.../csi.sock") and the driver. Empty
// cfg.StateDir gets a temporary directory (removed at cleanup), empty
// cfg.NodeID becomes "node-1". At cleanup the driver stops, its node mounts
// are undone and its StateDir lock is released.
//
// Socket paths are kept short (os.MkdirTemp("", "sd")): unix socket paths
// are limited to 108 bytes and t.TempDir() can be longer.
func StartTest(t TestingT, cfg Config) (endpoint string, d *Driver) {
	t.Helper()
	sockDir, err := os.MkdirTemp("", "sd")
	if err != nil {
		t.Fatalf("sample driver: socket dir: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	if cfg.StateDir == "" {
		dir, err := os.MkdirTemp("", "sdstate")
		if err != nil {
			t.Fatalf("sample driver: state dir: %v", err)
		}
		cfg.StateDir = dir
		// Registered before the driver's cleanup, so it runs after it.
		t.Cleanup(func() { os.RemoveAll(dir) })
	}
	if cfg.NodeID == "" {
		cfg.NodeID = "node-1"
	}
	sock := filepath.Join(sockDir, "csi.sock")
	cfg.Endpoint = "unix://" + sock
	d, err = New(cfg)
	if err != nil {
		t.Fatalf("sample driver: %v", err)
	}
	lis, err := net.Listen("unix", sock)
	if err != nil {
		d.Close()
		t.Fatalf("sample driver: listen: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Serve(ctx, lis) }()
	t.Cleanup(func() {
		cancel()
		// A driver that stopped serving on its own, or leaves mounts
		// behind, fails the test that started it.
		if err := <-done; err != nil {
			t.Errorf("sample driver: serve: %v", err)
		}
		if err := d.UnmountAll(); err != nil {
			t.Errorf("sample driver: unmount: %v", err)
		}
		d.Close()
	})
	return cfg.Endpoint, d
}
