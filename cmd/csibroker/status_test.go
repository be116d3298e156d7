package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/mtls"
)

// TestStatusWithARelativeSocketPath: `csibroker status --socket` takes a
// path relative to the working directory, as `broker --status-socket`
// does (unix://relative/path would read its first element as an authority).
func TestStatusWithARelativeSocketPath(t *testing.T) {
	dir, err := os.MkdirTemp("", "csb-status-") // short: unix socket paths are limited
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	now := time.Now()
	ca, err := mtls.NewCA("test CA", now.Add(-time.Hour), now.Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	m, err := ca.IssueMaterial(mtls.Leaf{ID: mtls.BrokerID("td"), NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	b, err := broker.New(broker.Options{TrustDomain: "td", TLS: mtls.StaticSource{M: m}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- serveStatus(ctx, filepath.Join(dir, "run", "status.sock"), &broker.StatusServer{B: b, Version: "test-version"})
	}()
	t.Cleanup(func() { cancel(); <-done })
	t.Chdir(dir)
	var out, errOut bytes.Buffer
	var last error
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		out.Reset()
		errOut.Reset()
		if last = runStatus(context.Background(), []string{"--socket", "run/status.sock", "--timeout", "2s"}, &out, &errOut); last == nil {
			break
		}
	}
	if last != nil {
		t.Fatalf("status --socket run/status.sock: %v %s", last, errOut.String())
	}
	if !strings.Contains(out.String(), "test-version") {
		t.Fatalf("status output does not show the broker's version:\n%s", out.String())
	}
}
