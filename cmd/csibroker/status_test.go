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

// TestStatusShowsEachDriversLeader: with per-driver leader election, the
// status API names the replica leading each driver and `csibroker status`
// prints it in a column (a driver no replica leads says so); without it,
// there is no such column.
func TestStatusShowsEachDriversLeader(t *testing.T) {
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
	for _, d := range []string{"a.csi.test", "b.csi.test"} {
		if err := b.SetDriver(broker.DriverConfig{Name: d, Controller: &broker.ProxyConfig{Address: "127.0.0.1:1"}}); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name    string
		leaders map[string]string
		want    []string
		notWant []string
	}{
		{"per-driver", map[string]string{"a.csi.test": "replica-2"}, []string{"LED BY", "replica-2", "(none)", "coordinator"}, nil},
		{"one lease", nil, nil, []string{"LED BY", "coordinator"}},
	} {
		srv := &broker.StatusServer{B: b, Version: "v", DriverLeaders: func() map[string]string { return tc.leaders }}
		st, err := srv.GetStatus(context.Background(), nil)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range st.GetDrivers() {
			if d.GetLeader() != tc.leaders[d.GetName()] {
				t.Errorf("%s: driver %s led by %q, want %q", tc.name, d.GetName(), d.GetLeader(), tc.leaders[d.GetName()])
			}
		}
		var out bytes.Buffer
		if err := printStatus(&out, st); err != nil {
			t.Fatal(err)
		}
		for _, w := range tc.want {
			if !strings.Contains(out.String(), w) {
				t.Errorf("%s: status output lacks %q:\n%s", tc.name, w, out.String())
			}
		}
		for _, w := range tc.notWant {
			if strings.Contains(out.String(), w) {
				t.Errorf("%s: status output has %q:\n%s", tc.name, w, out.String())
			}
		}
	}
}
