package cli

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/csibroker/csibroker/internal/fakekubelet"
	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testutil"
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

// TestProxyFlags: the liveness and registration flags are checked before
// anything starts.
func TestProxyFlags(t *testing.T) {
	base := []string{"--driver-endpoint", "unix:///csi/csi.sock", "--listen", "127.0.0.1:0"}
	for _, c := range []struct {
		name string
		args []string
		want string
	}{
		{"probe timeout", []string{"--probe-timeout", "0s"}, "--probe-timeout must be positive"},
		{"registration without a node", []string{"--kubelet-registration-path", "/var/lib/kubelet/plugins/x/csi.sock"}, "--kubelet-registration-path needs --node"},
		{"relative registration path", []string{"--node", "n1", "--kubelet-registration-path", "csi.sock"}, "want the driver socket's absolute path"},
		{"relative registry", []string{"--node", "n1", "--kubelet-registration-path", "/k/csi.sock", "--plugin-registration-path", "reg"}, "--plugin-registration-path \"reg\": want an absolute path"},
		{"metrics on a health path", []string{"--metrics-path", "/livez"}, "taken by the proxy's health endpoint"},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := RunProxy(context.Background(), "proxy", "test", append(slices.Clone(base), c.args...), io.Discard)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("%v: %v, want %q", c.args, err, c.want)
			}
		})
	}
}

// TestProxyRegistersWithTheKubelet: `csibroker-proxy --node ...
// --kubelet-registration-path ...` in front of the sample driver registers
// it with a kubelet that watches the registry directory through the
// kubelet's own plugin-registration API, answers /healthz from the
// driver's Probe, and deregisters the driver when it stops.
func TestProxyRegistersWithTheKubelet(t *testing.T) {
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
	certPEM, keyPEM, err := ca.Issue(mtls.Leaf{ID: mtls.NodeDriverID("csibroker.local", "sample.csibroker.io", "node-1"), NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	endpoint, _ := sampledriver.StartTest(t, sampledriver.Config{Name: "sample.csibroker.io", NodeID: "node-1",
		Topology: map[string]string{"topology.sample.csibroker.io/node": "node-1"}})
	sock := strings.TrimPrefix(endpoint, "unix://")
	regDir := testutil.ShortTempDir(t)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	httpAddr := lis.Addr().String()
	lis.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	k := &fakekubelet.Kubelet{Dir: regDir, Interval: 20 * time.Millisecond}
	go k.Run(ctx)
	proxyCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- RunProxy(proxyCtx, "proxy", "test", []string{"--driver-endpoint", endpoint, "--listen", "127.0.0.1:0", "--node", "node-1",
			"--http-endpoint", httpAddr, "--probe-timeout", "1s",
			"--kubelet-registration-path", sock, "--plugin-registration-path", regDir,
			"--tls-cert", write("tls.crt", certPEM), "--tls-key", write("tls.key", keyPEM), "--tls-ca", write("ca.crt", ca.CertPEM)}, io.Discard)
	}()
	evs, err := k.WaitEvent(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	if ev := evs[0]; ev.Kind != "registered" || ev.Name != "sample.csibroker.io" || ev.Endpoint != sock || ev.NodeID != "node-1" ||
		ev.Topology["topology.sample.csibroker.io/node"] != "node-1" || ev.Socket != filepath.Join(regDir, "sample.csibroker.io-reg.sock") {
		t.Errorf("registration: %+v", ev)
	}
	for _, path := range []string{"/healthz", "/healthz/driver", "/livez", "/readyz"} {
		resp, err := http.Get("http://" + httpAddr + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Errorf("%s = %d %q", path, resp.StatusCode, body)
		}
	}
	stop()
	if err := <-done; err != nil {
		t.Fatalf("proxy: %v", err)
	}
	evs, err = k.WaitEvent(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	if ev := evs[1]; ev.Kind != "deregistered" || ev.Name != "sample.csibroker.io" {
		t.Errorf("after the proxy stopped: %+v, want the driver deregistered", ev)
	}
}
