// Package testutil holds the few test helpers that packages below
// internal/chaintest need too (chaintest imports the broker and the proxy,
// so their own tests cannot import it). It imports nothing of the project.
package testutil

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// SyncBuffer is a goroutine-safe log sink.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns everything written so far.
func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// ShortTempDir makes a temp dir with a short path (unix sockets are limited
// to 108 bytes), removed at cleanup.
func ShortTempDir(t testing.TB) string {
	t.Helper()
	d, err := os.MkdirTemp("", "cb")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

// SkipPackageIfShort, called first in a package's TestMain, ends a
// package of slow tests (a real control plane, processes, load) under
// `go test -short`, saying so: -short is the fast tier, the full run is
// `make test`.
func SkipPackageIfShort(why string) {
	flag.Parse()
	if testing.Short() {
		fmt.Printf("skipped under -short (%s); make test runs it\n", why)
		os.Exit(0)
	}
}

// CounterValue is a Prometheus counter's current value.
func CounterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		return -1
	}
	return m.GetCounter().GetValue()
}
