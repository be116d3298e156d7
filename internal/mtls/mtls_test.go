package mtls

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"io"
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

func TestParseID(t *testing.T) {
	cases := []struct {
		name, in string
		want     Identity
		wantErr  bool
	}{
		{"broker", "spiffe://td/csibroker/broker", Identity{TrustDomain: "td", Role: RoleBroker}, false},
		{"driver", "spiffe://td/csibroker/driver/d.example.org", Identity{TrustDomain: "td", Role: RoleDriver, Driver: "d.example.org"}, false},
		{"node", "spiffe://td/csibroker/driver/d/node/n1", Identity{TrustDomain: "td", Role: RoleDriver, Driver: "d", Node: "n1"}, false},
		{"client", "spiffe://td/csibroker/client/ops-tool", Identity{TrustDomain: "td", Role: RoleClient, Client: "ops-tool"}, false},
		{"empty client", "spiffe://td/csibroker/client/", Identity{}, true},
		{"client with suffix", "spiffe://td/csibroker/client/a/b", Identity{}, true},
		{"wrong scheme", "https://td/csibroker/broker", Identity{}, true},
		{"no csibroker", "spiffe://td/other/broker", Identity{}, true},
		{"empty driver", "spiffe://td/csibroker/driver/", Identity{}, true},
		{"node without name", "spiffe://td/csibroker/driver/d/node", Identity{}, true},
		{"broker with suffix", "spiffe://td/csibroker/broker/x", Identity{}, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := ParseID(c.in)
			if (err != nil) != c.wantErr {
				t.Fatalf("err = %v, wantErr %v", err, c.wantErr)
			}
			if got != c.want {
				t.Fatalf("got %+v, want %+v", got, c.want)
			}
			if !c.wantErr && got.String() != c.in {
				t.Fatalf("String() = %q, want %q", got.String(), c.in)
			}
		})
	}
}

func TestAuthorizeFrontEndCaller(t *testing.T) {
	authz := AuthorizeFrontEndCaller("td")
	for id, ok := range map[string]bool{
		ClientID("td", "ops"):          true,
		BrokerID("td"):                 true,
		ClientID("other", "ops"):       false,
		DriverID("td", "d"):            false,
		NodeDriverID("td", "d", "n"):   false,
		"spiffe://td/csibroker/nobody": false,
	} {
		if err := authz(id); (err == nil) != ok {
			t.Errorf("%s: err %v, want admitted %v", id, err, ok)
		}
	}
}

func TestAuthorizeOneOfFailsClosed(t *testing.T) {
	if err := AuthorizeOneOf()("spiffe://td/csibroker/broker"); err == nil {
		t.Fatal("empty allow-list admitted a peer")
	}
	a := AuthorizeOneOf(BrokerID("td"))
	if err := a(BrokerID("td")); err != nil {
		t.Fatal(err)
	}
	if err := a(DriverID("td", "x")); err == nil || !strings.Contains(err.Error(), "want spiffe://td/csibroker/broker") {
		t.Fatalf("err = %v", err)
	}
}

// handshake runs a real TLS handshake over loopback TCP and returns the
// client's and the server's errors.
func handshake(t *testing.T, server, client *tls.Config) (clientErr, serverErr error) {
	t.Helper()
	lis, err := tls.Listen("tcp", "127.0.0.1:0", server)
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	srvErr := make(chan error, 1)
	go func() {
		c, err := lis.Accept()
		if err != nil {
			srvErr <- err
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if err := c.(*tls.Conn).Handshake(); err != nil {
			srvErr <- err
			return
		}
		_, err = c.Write([]byte("ok"))
		srvErr <- err
	}()
	c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", lis.Addr().String(), client)
	if err == nil {
		c.SetDeadline(time.Now().Add(5 * time.Second))
		// TLS 1.3: the server's verdict on our certificate arrives with the first read.
		_, err = io.ReadFull(c, make([]byte, 2))
		c.Close()
	}
	return err, <-srvErr
}

// testCA is a CA valid from an hour ago to an hour from now.
func testCA(t *testing.T, name string) *CA {
	t.Helper()
	now := time.Now()
	ca, err := NewCA(name, now.Add(-time.Hour), now.Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

func TestHandshakes(t *testing.T) {
	now := time.Now()
	ca := testCA(t, "test CA")
	other := testCA(t, "other CA")
	mat := func(ca *CA, id string, nb, na time.Time) *Material {
		c, k, err := ca.Issue(Leaf{ID: id, NotBefore: nb, NotAfter: na})
		if err != nil {
			t.Fatal(err)
		}
		// Parse as of a time when the certificate was valid so expired ones can be built.
		m, err := ParseMaterial(c, k, ca.CertPEM, nb.Add(time.Second))
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	valid := func(ca *CA, id string) *Material { return mat(ca, id, now.Add(-time.Minute), now.Add(time.Hour)) }
	broker := valid(ca, BrokerID("td"))
	proxyD1 := valid(ca, DriverID("td", "d1"))

	proxySrv := ServerConfig(StaticSource{proxyD1}, AuthorizeOneOf(BrokerID("td")))
	brokerTo := func(driver string, m *Material) *tls.Config {
		return ClientConfig(StaticSource{m}, AuthorizeOneOf(DriverID("td", driver)))
	}

	t.Run("ok", func(t *testing.T) {
		cErr, sErr := handshake(t, proxySrv, brokerTo("d1", broker))
		if cErr != nil || sErr != nil {
			t.Fatalf("client %v, server %v", cErr, sErr)
		}
	})
	t.Run("proxy names another driver", func(t *testing.T) {
		cErr, _ := handshake(t, proxySrv, brokerTo("d2", broker))
		if cErr == nil || !strings.Contains(cErr.Error(), "peer identity spiffe://td/csibroker/driver/d1 is not authorized: want spiffe://td/csibroker/driver/d2") {
			t.Fatalf("client err = %v", cErr)
		}
	})
	t.Run("client from unknown CA", func(t *testing.T) {
		c, k, err := other.Issue(Leaf{ID: BrokerID("td"), NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
		if err != nil {
			t.Fatal(err)
		}
		m, err := ParseMaterial(c, k, ca.CertPEM, now) // trusts the right CA, signed by the wrong one
		if err != nil {
			t.Fatal(err)
		}
		_, sErr := handshake(t, proxySrv, brokerTo("d1", m))
		if sErr == nil || !strings.Contains(sErr.Error(), "unknown authority") {
			t.Fatalf("server err = %v", sErr)
		}
	})
	t.Run("server from unknown CA", func(t *testing.T) {
		c, k, err := other.Issue(Leaf{ID: DriverID("td", "d1"), NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
		if err != nil {
			t.Fatal(err)
		}
		m, err := ParseMaterial(c, k, ca.CertPEM, now)
		if err != nil {
			t.Fatal(err)
		}
		srv := ServerConfig(StaticSource{m}, AuthorizeOneOf(BrokerID("td")))
		cErr, _ := handshake(t, srv, brokerTo("d1", broker))
		if cErr == nil || !strings.Contains(cErr.Error(), "unknown authority") {
			t.Fatalf("client err = %v", cErr)
		}
	})
	t.Run("expired client certificate", func(t *testing.T) {
		expired := mat(ca, BrokerID("td"), now.Add(-2*time.Hour), now.Add(-time.Hour))
		_, sErr := handshake(t, proxySrv, brokerTo("d1", expired))
		if sErr == nil || !strings.Contains(sErr.Error(), "expired") {
			t.Fatalf("server err = %v", sErr)
		}
	})
	t.Run("client without certificate", func(t *testing.T) {
		noCert := &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}}
		_, sErr := handshake(t, proxySrv, noCert)
		if sErr == nil || !strings.Contains(sErr.Error(), "certificate") {
			t.Fatalf("server err = %v", sErr)
		}
	})
	t.Run("a driver may not pose as the broker's peer", func(t *testing.T) {
		_, sErr := handshake(t, proxySrv, brokerTo("d1", valid(ca, DriverID("td", "d2"))))
		if sErr == nil || !strings.Contains(sErr.Error(), "not authorized") {
			t.Fatalf("server err = %v", sErr)
		}
	})
}

func TestFileSourceReload(t *testing.T) {
	dir := t.TempDir()
	if _, err := WriteDevCerts(DevCertsOptions{Dir: dir, TrustDomain: "td", Drivers: []string{"d1"}}); err != nil {
		t.Fatal(err)
	}
	certF, keyF, caF := filepath.Join(dir, "broker.crt"), filepath.Join(dir, "broker.key"), filepath.Join(dir, "ca.crt")
	var logs bytes.Buffer
	src, err := NewFileSource(certF, keyF, caF, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	first := src.Current()
	if first.ID != BrokerID("td") {
		t.Fatalf("id = %s", first.ID)
	}
	if swapped, err := src.Reload(); swapped || err != nil {
		t.Fatalf("unchanged files: swapped=%v err=%v", swapped, err)
	}

	// A garbage certificate is refused and the old one stays.
	orig, err := os.ReadFile(certF)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(certF, []byte("garbage"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := src.Reload(); err == nil {
		t.Fatal("garbage certificate accepted")
	}
	if src.Current() != first || src.Failures() != 1 {
		t.Fatalf("old material not kept (failures=%d)", src.Failures())
	}
	// Polled again, the same refusal is counted, not logged again.
	if _, err := src.Reload(); err == nil || src.Failures() != 2 {
		t.Fatalf("second look at the garbage: %v, failures=%d", err, src.Failures())
	}
	if n := strings.Count(logs.String(), "files refused"); n != 1 {
		t.Fatalf("a refusal that stands was logged %d times, want once:\n%s", n, logs.String())
	}
	// The files in use come back, then the garbage again: news, logged.
	if err := os.WriteFile(certF, orig, 0o644); err != nil {
		t.Fatal(err)
	}
	if swapped, err := src.Reload(); swapped || err != nil {
		t.Fatalf("the files in use again: swapped=%v err=%v", swapped, err)
	}
	if err := os.WriteFile(certF, []byte("garbage"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := src.Reload(); err == nil {
		t.Fatal("garbage certificate accepted")
	}
	if n := strings.Count(logs.String(), "files refused"); n != 2 {
		t.Fatalf("a refusal back after the files were fixed was logged %d times in all, want twice:\n%s", n, logs.String())
	}

	// A new valid certificate is picked up.
	ca, err := LoadCA(caF, filepath.Join(dir, "ca.key"))
	if err != nil {
		t.Fatal(err)
	}
	c, k, err := ca.Issue(Leaf{ID: BrokerID("td"), NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	if err := WriteFileAtomic(keyF, k, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := WriteFileAtomic(certF, c, 0o644); err != nil {
		t.Fatal(err)
	}
	if swapped, err := src.Reload(); !swapped || err != nil {
		t.Fatalf("swapped=%v err=%v", swapped, err)
	}
	if src.Current() == first || src.Current().Leaf.SerialNumber.Cmp(first.Leaf.SerialNumber) == 0 || src.Reloads() != 1 {
		t.Fatal("new certificate not in use")
	}

	// An expired certificate is refused.
	c, k, err = ca.Issue(Leaf{ID: BrokerID("td"), NotBefore: time.Now().Add(-2 * time.Hour), NotAfter: time.Now().Add(-time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	cur := src.Current()
	write := func(key, cert []byte) {
		t.Helper()
		if err := WriteFileAtomic(keyF, key, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := WriteFileAtomic(certF, cert, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	issue := func(l Leaf) (cert, key []byte) {
		t.Helper()
		cert, key, err := ca.Issue(l)
		if err != nil {
			t.Fatal(err)
		}
		return cert, key
	}
	write(k, c)
	if _, err := src.Reload(); err == nil || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("err = %v", err)
	}
	if src.Current() != cur {
		t.Fatal("expired certificate replaced a valid one")
	}
	// A mismatched key is refused.
	_, k2 := issue(Leaf{ID: BrokerID("td"), NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour)})
	c3, _ := issue(Leaf{ID: BrokerID("td"), NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour)})
	write(k2, c3)
	if _, err := src.Reload(); err == nil || !strings.Contains(err.Error(), "does not match") {
		t.Fatalf("mismatched key: err = %v", err)
	}
	if src.Current() != cur {
		t.Fatal("mismatched pair replaced a valid one")
	}

	// A certificate naming another identity is refused: every peer would
	// refuse it.
	c, k = issue(Leaf{ID: DriverID("td", "d1"), NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour)})
	write(k, c)
	if _, err := src.Reload(); err == nil || !strings.Contains(err.Error(), "names "+DriverID("td", "d1")) {
		t.Fatalf("another identity: err = %v", err)
	}
	if src.Current() != cur {
		t.Fatal("a certificate of another identity replaced the one in use")
	}

	// A certificate not valid yet waits: refused now, taken once valid.
	c, k = issue(Leaf{ID: BrokerID("td"), NotBefore: time.Now().Add(time.Hour), NotAfter: time.Now().Add(2 * time.Hour)})
	write(k, c)
	if _, err := src.Reload(); err == nil || !strings.Contains(err.Error(), "not valid before") {
		t.Fatalf("not valid yet: err = %v", err)
	}
	if src.Current() != cur {
		t.Fatal("a certificate not valid yet replaced the one in use")
	}
	src.now = func() time.Time { return time.Now().Add(90 * time.Minute) }
	if swapped, err := src.Reload(); !swapped || err != nil {
		t.Fatalf("once valid: swapped=%v err=%v", swapped, err)
	}
}

// TestCollector: the certificate's expiry, and a file source's reloads and
// refused files, as metrics (zero reloads for a static source).
func TestCollector(t *testing.T) {
	dir := t.TempDir()
	if _, err := WriteDevCerts(DevCertsOptions{Dir: dir, TrustDomain: "td", Drivers: []string{"d1"}}); err != nil {
		t.Fatal(err)
	}
	certF := filepath.Join(dir, "broker.crt")
	src, err := NewFileSource(certF, filepath.Join(dir, "broker.key"), filepath.Join(dir, "ca.crt"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(certF, []byte("garbage"), 0o644); err != nil {
		t.Fatal(err)
	}
	src.Reload() // refused
	values := func(src Source) map[string]float64 {
		t.Helper()
		reg := prometheus.NewRegistry()
		reg.MustRegister(NewCollector(src))
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]float64{}
		for _, mf := range mfs {
			m := mf.GetMetric()[0]
			out[mf.GetName()] = m.GetGauge().GetValue() + m.GetCounter().GetValue()
		}
		return out
	}
	got := values(src)
	if want := float64(src.Current().Leaf.NotAfter.Unix()); got["csibroker_tls_certificate_not_after_timestamp_seconds"] != want {
		t.Errorf("not after %v, want %v", got["csibroker_tls_certificate_not_after_timestamp_seconds"], want)
	}
	if got["csibroker_tls_reload_failures_total"] != 1 || got["csibroker_tls_reloads_total"] != 0 {
		t.Errorf("reloads %v, failures %v; want 0 and 1", got["csibroker_tls_reloads_total"], got["csibroker_tls_reload_failures_total"])
	}
	static := values(StaticSource{M: src.Current()})
	if len(static) != 3 || static["csibroker_tls_reload_failures_total"] != 0 {
		t.Errorf("static source: %v", static)
	}
}

// swapSource is a Source whose material the test replaces.
type swapSource struct{ m atomic.Pointer[Material] }

func (s *swapSource) Current() *Material { return s.m.Load() }

// TestPeerCheck: an established connection's peer is verified again once
// our material changes; a reload of our own certificate under the same CA
// keeps it (and is reported as renewed); a bundle that no longer trusts
// the peer's CA refuses it, for good.
func TestPeerCheck(t *testing.T) {
	now := time.Now()
	ca := testCA(t, "test CA")
	other := testCA(t, "other CA")
	issue := func(ca *CA, id string) *Material {
		m, err := ca.IssueMaterial(Leaf{ID: id, NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	const td = "test.csibroker"
	src := &swapSource{}
	src.m.Store(issue(ca, DriverID(td, "d.csi")))
	peer := issue(ca, BrokerID(td))
	pc := NewPeerCheck(ServerConfig(src, AuthorizeOneOf(BrokerID(td))), tls.ConnectionState{PeerCertificates: []*x509.Certificate{peer.Leaf}}, nil)
	if renewed, err := pc.Check(); err != nil || renewed {
		t.Fatalf("fresh connection: %v, renewed %v", err, renewed)
	}
	// The files reloaded with the same certificate (a new CA bundle, say):
	// new material, the same leaf, nothing renewed.
	same := *src.Current()
	sameCert := *same.Cert
	same.Cert = &sameCert
	src.m.Store(&same)
	if renewed, err := pc.Check(); err != nil || renewed {
		t.Fatalf("material reloaded with the same leaf: %v, renewed %v; want verified, not renewed", err, renewed)
	}
	src.m.Store(issue(ca, DriverID(td, "d.csi")))
	if renewed, err := pc.Check(); err != nil || !renewed {
		t.Fatalf("own certificate reloaded under the same CA: %v, renewed %v; want verified and renewed", err, renewed)
	}
	kept := src.Current()
	src.m.Store(issue(other, DriverID(td, "d.csi"))) // the bundle trusts only the other CA now
	if err := pc.Verify(); err == nil || !strings.Contains(err.Error(), "unknown authority") {
		t.Fatalf("peer's CA left the bundle: %v, want refused", err)
	}
	src.m.Store(kept)
	if err := pc.Verify(); err == nil {
		t.Fatal("a refused peer was accepted again")
	}
	if err := NewPeerCheck(ServerConfig(src, AuthorizeOneOf(BrokerID(td))), tls.ConnectionState{}, nil).Verify(); err == nil {
		t.Fatal("a connection without a peer certificate verified")
	}
	if pc.PeerExpired(now) || !pc.PeerExpired(now.Add(2*time.Hour)) {
		t.Fatalf("a peer certificate valid for an hour: expired now %v, in two hours %v; want false, true", pc.PeerExpired(now), pc.PeerExpired(now.Add(2*time.Hour)))
	}
}

// TestWriteDevCertsKeepsTheCA: an existing CA is reused whatever PEM form
// its key has (SEC 1 "EC PRIVATE KEY", as cert-manager writes it); a CA
// that cannot be loaded (its key gone, or not its key) is never replaced:
// the command fails and writes nothing.
func TestWriteDevCertsKeepsTheCA(t *testing.T) {
	ca := testCA(t, "cluster CA")
	ecKey, ok := ca.Key.(*ecdsa.PrivateKey)
	if !ok {
		t.Fatalf("CA key %T", ca.Key)
	}
	der, err := x509.MarshalECPrivateKey(ecKey)
	if err != nil {
		t.Fatal(err)
	}
	sec1 := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})

	dir := t.TempDir()
	caCert, caKey := filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key")
	if err := os.WriteFile(caCert, ca.CertPEM, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(caKey, sec1, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := WriteDevCerts(DevCertsOptions{Dir: dir, TrustDomain: "td", Drivers: []string{"d.csi"}}); err != nil {
		t.Fatalf("existing CA with a SEC 1 key: %v", err)
	}
	if got, _ := os.ReadFile(caCert); !bytes.Equal(got, ca.CertPEM) {
		t.Fatal("ca.crt was replaced")
	}
	if got, _ := os.ReadFile(caKey); !bytes.Equal(got, sec1) {
		t.Fatal("ca.key was replaced")
	}
	m, err := NewFileSource(filepath.Join(dir, "proxy-d.csi.crt"), filepath.Join(dir, "proxy-d.csi.key"), caCert, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Current().Leaf.Verify(x509.VerifyOptions{Roots: m.Current().Pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		t.Fatalf("the minted certificate does not chain to the existing CA: %v", err)
	}

	other := testCA(t, "other")
	for name, setUp := range map[string]func(dir string) error{
		"key gone": func(dir string) error { return os.WriteFile(filepath.Join(dir, "ca.crt"), ca.CertPEM, 0o644) },
		"another CA's key": func(dir string) error {
			if err := os.WriteFile(filepath.Join(dir, "ca.crt"), ca.CertPEM, 0o644); err != nil {
				return err
			}
			return os.WriteFile(filepath.Join(dir, "ca.key"), other.KeyPEM, 0o600)
		},
	} {
		dir := t.TempDir()
		if err := setUp(dir); err != nil {
			t.Fatal(err)
		}
		before, _ := os.ReadDir(dir)
		if _, err := WriteDevCerts(DevCertsOptions{Dir: dir, TrustDomain: "td", Drivers: []string{"d.csi"}}); err == nil || !strings.Contains(err.Error(), "nothing was written") {
			t.Errorf("%s: %v, want an error that leaves the CA alone", name, err)
		}
		after, _ := os.ReadDir(dir)
		if len(after) != len(before) {
			t.Errorf("%s: %d files before, %d after", name, len(before), len(after))
		}
		if got, _ := os.ReadFile(filepath.Join(dir, "ca.crt")); !bytes.Equal(got, ca.CertPEM) {
			t.Errorf("%s: ca.crt was replaced", name)
		}
	}
}

// TestWriteDevCertsOnlyNodes: --only-nodes mints the node-proxy
// certificates alone from the CA in the directory (nothing that could act
// as the broker), and refuses to start a CA of its own; names that would
// not make a SPIFFE ID are refused before anything is written.
func TestWriteDevCertsOnlyNodes(t *testing.T) {
	dir := t.TempDir()
	if _, err := WriteDevCerts(DevCertsOptions{Dir: dir, TrustDomain: "td", Drivers: []string{"d.csi"}, Nodes: []string{"n1"}, OnlyNodes: true}); err == nil || !strings.Contains(err.Error(), "no CA in") {
		t.Fatalf("--only-nodes without a CA: %v, want a refusal", err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Fatalf("%d files written by a refusal", len(entries))
	}
	if _, err := WriteDevCerts(DevCertsOptions{Dir: dir, TrustDomain: "td"}); err != nil { // the CA (and a broker)
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(dir, "broker.crt")); err != nil {
		t.Fatal(err)
	}
	files, err := WriteDevCerts(DevCertsOptions{Dir: dir, TrustDomain: "td", Drivers: []string{"d.csi", "d.csi"}, Nodes: []string{"n1"}, OnlyNodes: true})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{filepath.Join(dir, "ca.crt"), filepath.Join(dir, "proxy-d.csi-n1.crt")}
	if !slices.Equal(files, want) {
		t.Fatalf("written %v, want %v", files, want)
	}
	for _, f := range []string{"broker.crt", "proxy-d.csi.crt"} {
		if _, err := os.Stat(filepath.Join(dir, f)); !os.IsNotExist(err) {
			t.Errorf("%s: %v, want it not written", f, err)
		}
	}
	for _, o := range []DevCertsOptions{
		{TrustDomain: "Example.ORG/x"},
		{TrustDomain: "td", Drivers: []string{"bad driver/name"}},
		{TrustDomain: "td", Drivers: []string{"my_driver"}}, // a SPIFFE segment, but no CSI name: the broker would refuse it
		{TrustDomain: "td", Drivers: []string{"-d"}},
		{TrustDomain: "td", Drivers: []string{"d"}, Nodes: []string{".."}},
		{TrustDomain: "td", Clients: []string{"a b"}},
	} {
		o.Dir = t.TempDir()
		if _, err := WriteDevCerts(o); err == nil || !strings.Contains(err.Error(), "nothing was written") {
			t.Errorf("%+v: %v, want a refusal", o, err)
		}
		if entries, _ := os.ReadDir(o.Dir); len(entries) != 0 {
			t.Errorf("%+v: %d files written by a refusal", o, len(entries))
		}
	}
}

// TestParseMaterialRefusesACutFile: a CA bundle or a certificate chain
// caught half rewritten (cut inside a PEM block) is refused whole, not
// loaded in part; a key block in the certificate file is skipped, and
// text before a block is allowed, as the standard library allows them.
func TestParseMaterialRefusesACutFile(t *testing.T) {
	now := time.Now()
	ca1, err := NewCA("ca 1", now.Add(-time.Hour), now.Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	ca2, err := NewCA("ca 2", now.Add(-time.Hour), now.Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	certPEM, keyPEM, err := ca2.Issue(Leaf{ID: BrokerID("td"), NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	bundle := append(append([]byte{}, ca1.CertPEM...), ca2.CertPEM...)
	m, err := ParseMaterial(certPEM, keyPEM, bundle, now)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Leaf.Verify(x509.VerifyOptions{Roots: m.Pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		t.Fatalf("the bundle's second CA is not in the pool: %v", err)
	}
	cut := bundle[:len(ca1.CertPEM)+len(ca2.CertPEM)/2]
	if _, err := ParseMaterial(certPEM, keyPEM, cut, now); err == nil || !strings.Contains(err.Error(), "CA bundle") {
		t.Fatalf("a CA bundle cut inside its second certificate: %v, want it refused", err)
	}
	chain := append(append([]byte{}, certPEM...), ca2.CertPEM[:len(ca2.CertPEM)/2]...)
	if _, err := ParseMaterial(chain, keyPEM, bundle, now); err == nil || !strings.Contains(err.Error(), "certificate file") {
		t.Fatalf("a chain cut after its leaf: %v, want it refused", err)
	}
	combined := append(append([]byte("Bag Attributes: from an export\n"), certPEM...), keyPEM...)
	if _, err := ParseMaterial(combined, keyPEM, bundle, now); err != nil {
		t.Fatalf("a certificate file holding its key too, after some text: %v", err)
	}
}

// TestCARenewedWithItsKeyKeepsEveryLeafValid: what deploy/'s CA renewal
// (rotationPolicy: Never) relies on. A CA certificate renewed with the
// same key and subject verifies the leaves of the old one, and the old
// one verifies the leaves of the renewed: peers whose Secrets were renewed
// at different moments still accept each other.
func TestCARenewedWithItsKeyKeepsEveryLeafValid(t *testing.T) {
	now := time.Now()
	old, err := NewCA("csibroker CA", now.Add(-300*24*time.Hour), now.Add(20*24*time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	tmpl := *old.Cert
	tmpl.SerialNumber = big.NewInt(now.UnixNano())
	tmpl.NotBefore, tmpl.NotAfter = now.Add(-time.Hour), now.Add(365*24*time.Hour)
	der, err := x509.CreateCertificate(rand.Reader, &tmpl, &tmpl, old.Key.Public(), old.Key)
	if err != nil {
		t.Fatal(err)
	}
	renewedCert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	renewed := &CA{Cert: renewedCert, Key: old.Key}
	leaf := func(ca *CA) *x509.Certificate {
		c, _, err := ca.Issue(Leaf{ID: BrokerID("td"), NotBefore: now.Add(-time.Minute), NotAfter: now.Add(24 * time.Hour)})
		if err != nil {
			t.Fatal(err)
		}
		block, _ := pem.Decode(c)
		x, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		return x
	}
	for _, tc := range []struct {
		name         string
		issuer, root *CA
	}{{"old leaf, renewed CA trusted", old, renewed}, {"renewed leaf, old CA trusted", renewed, old}} {
		pool := x509.NewCertPool()
		pool.AddCert(tc.root.Cert)
		if _, err := leaf(tc.issuer).Verify(x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
}

// TestWriteDevCertsRefusesFileNameCollisions: "proxy-<driver>-<node>" of
// driver a on node b-c and of driver a-b on node c are one file name; so
// are driver a's node b and driver a-b's controller proxy. Such a run, or
// a later run that would replace another identity's file, writes nothing.
func TestWriteDevCertsRefusesFileNameCollisions(t *testing.T) {
	dir := t.TempDir()
	if _, err := WriteDevCerts(DevCertsOptions{Dir: dir, TrustDomain: "td", Drivers: []string{"a", "a-b"}, Nodes: []string{"b"}}); err == nil || !strings.Contains(err.Error(), "proxy-a-b.crt would hold both") {
		t.Fatalf("colliding names in one run: %v", err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Fatalf("a refused run wrote %d files", len(entries))
	}
	if _, err := WriteDevCerts(DevCertsOptions{Dir: dir, TrustDomain: "td", Drivers: []string{"a-b"}}); err != nil {
		t.Fatal(err)
	}
	before, err := os.ReadFile(filepath.Join(dir, "proxy-a-b.crt"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := WriteDevCerts(DevCertsOptions{Dir: dir, TrustDomain: "td", Drivers: []string{"a"}, Nodes: []string{"b"}, OnlyNodes: true}); err == nil || !strings.Contains(err.Error(), "holds spiffe://td/csibroker/driver/a-b, another identity") {
		t.Fatalf("a later run replacing another identity's file: %v", err)
	}
	if after, _ := os.ReadFile(filepath.Join(dir, "proxy-a-b.crt")); !bytes.Equal(after, before) {
		t.Fatal("the controller proxy's certificate was replaced")
	}
	// The same identities again are re-minted, in another trust domain too.
	if _, err := WriteDevCerts(DevCertsOptions{Dir: dir, TrustDomain: "td", Drivers: []string{"a-b"}}); err != nil {
		t.Fatalf("re-minting the same identities: %v", err)
	}
	if _, err := WriteDevCerts(DevCertsOptions{Dir: dir, TrustDomain: "other.td", Drivers: []string{"a-b"}}); err != nil {
		t.Fatalf("re-minting in another trust domain: %v", err)
	}
}
