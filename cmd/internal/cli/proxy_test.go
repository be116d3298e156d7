package cli

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/csibroker/csibroker/internal/mtls"
)

// TestProxyRefusesACertificateForAnotherNode: a node plugin's proxy whose
// certificate names another node does not start (the broker would refuse
// it at every handshake, and a reload keeps the identity it started
// with); one whose certificate names its node serves until stopped.
func TestProxyRefusesACertificateForAnotherNode(t *testing.T) {
	now := time.Now()
	ca, err := mtls.NewCA("test CA", now.Add(-time.Hour), now.Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	caFile := write("ca.crt", ca.CertPEM)
	run := func(node, certNode string) error {
		certPEM, keyPEM, err := ca.Issue(mtls.Leaf{ID: mtls.NodeDriverID("csibroker.local", "x.csi.test", certNode), NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		return RunProxy(ctx, "proxy", "test", []string{"--driver-endpoint", "unix://" + filepath.Join(dir, "none.sock"), "--listen", "127.0.0.1:0", "--node", node,
			"--tls-cert", write(certNode+".crt", certPEM), "--tls-key", write(certNode+".key", keyPEM), "--tls-ca", caFile}, io.Discard)
	}
	if err := run("node-1", "node-2"); err == nil || !strings.Contains(err.Error(), `names node "node-2" but --node is "node-1"`) {
		t.Fatalf("a proxy with another node's certificate: %v, want it refused saying so", err)
	}
	// Its own node's certificate: it serves until its context ends.
	if err := run("node-1", "node-1"); err != nil {
		t.Fatalf("a proxy with its own node's certificate: %v, want it to serve until stopped", err)
	}
}
