package mtls

import (
	"bytes"
	"crypto/tls"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestCAFileVerifiesAndReloads: an HTTP client using CAFile.Transport trusts
// a server whose certificate chains to the file's CA and names the host
// dialled, refuses any other, and trusts a renewed bundle once it is
// re-read; a cut bundle is refused and the one in use kept.
func TestCAFileVerifiesAndReloads(t *testing.T) {
	now := time.Now()
	serverConfig := func(ca *CA, l Leaf) *tls.Config {
		l.NotBefore, l.NotAfter = now.Add(-time.Minute), now.Add(time.Hour)
		certPEM, keyPEM, err := ca.Issue(l)
		if err != nil {
			t.Fatal(err)
		}
		cert, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			t.Fatal(err)
		}
		return &tls.Config{Certificates: []tls.Certificate{cert}}
	}
	loopback := Leaf{IPs: []net.IP{net.IPv4(127, 0, 0, 1)}}
	oldCA, newCA := testCA(t, "opa-ca-1"), testCA(t, "opa-ca-2")
	oldServer, newServer := serverConfig(oldCA, loopback), serverConfig(newCA, loopback)
	otherName := serverConfig(oldCA, Leaf{DNSNames: []string{"opa.example.com"}})

	dir := t.TempDir()
	path := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(path, oldCA.CertPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	caf, err := NewCAFile(path, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	client := &http.Client{Transport: caf.Transport(nil), Timeout: 5 * time.Second}
	get := func(srv *httptest.Server) error {
		resp, err := client.Get(srv.URL)
		if err != nil {
			return err
		}
		resp.Body.Close()
		return nil
	}
	serve := func(cfg *tls.Config) *httptest.Server {
		srv := httptest.NewUnstartedServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
		srv.TLS = cfg
		srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the refused handshakes
		srv.StartTLS()
		t.Cleanup(srv.Close)
		return srv
	}
	oldSrv, newSrv, otherSrv := serve(oldServer), serve(newServer), serve(otherName)

	if err := get(oldSrv); err != nil {
		t.Fatalf("server of the file's CA refused: %v", err)
	}
	err = get(newSrv)
	if err == nil || !strings.Contains(err.Error(), "unknown authority") || !strings.Contains(err.Error(), path) {
		t.Fatalf("server of another CA: %v, want an unknown-authority refusal naming %s", err, path)
	}
	if err := get(otherSrv); err == nil || !strings.Contains(err.Error(), "127.0.0.1") {
		t.Fatalf("certificate for another host: %v, want a refusal naming the host dialled", err)
	}

	// A bundle cut inside its second block: refused, the old pool kept.
	both := append(append([]byte{}, oldCA.CertPEM...), newCA.CertPEM...)
	if err := os.WriteFile(path, both[:len(both)-40], 0o600); err != nil {
		t.Fatal(err)
	}
	if swapped, err := caf.Reload(); swapped || err == nil {
		t.Fatalf("cut bundle: swapped %v, err %v; want a refusal", swapped, err)
	}
	if err := get(oldSrv); err != nil {
		t.Fatalf("after a refused bundle, the old CA's server is refused: %v", err)
	}
	if !strings.Contains(logs.String(), "new CA bundle refused") {
		t.Errorf("the refusal was not logged: %s", logs.String())
	}

	// The renewed bundle (both CAs), written whole: both servers trusted
	// by the same client configuration.
	if err := os.WriteFile(path, both, 0o600); err != nil {
		t.Fatal(err)
	}
	if swapped, err := caf.Reload(); !swapped || err != nil {
		t.Fatalf("whole bundle: swapped %v, err %v", swapped, err)
	}
	for name, srv := range map[string]*httptest.Server{"old": oldSrv, "new": newSrv} {
		if err := get(srv); err != nil {
			t.Errorf("after the reload, the %s CA's server is refused: %v", name, err)
		}
	}
	if swapped, err := caf.Reload(); swapped || err != nil {
		t.Errorf("unchanged file: swapped %v, err %v; want neither", swapped, err)
	}

	if _, err := NewCAFile(filepath.Join(dir, "missing.pem"), nil); err == nil {
		t.Error("a missing CA file was accepted")
	}
}
