package mtls

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/csibroker/csibroker/internal/csiname"
)

// CA is a certificate authority that can issue csibroker certificates. It is
// meant for development, tests and the local demo; production clusters use
// cert-manager (see deploy/).
type CA struct {
	Cert    *x509.Certificate
	Key     crypto.Signer
	CertPEM []byte
	KeyPEM  []byte
}

// NewCA makes a self-signed CA valid from notBefore to notAfter.
func NewCA(commonName string, notBefore, notAfter time.Time) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate CA key: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: commonName, Organization: []string{"csibroker"}},
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("create CA certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	keyPEM, err := encodeKey(key)
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, Key: key, CertPEM: encodeCert(der), KeyPEM: keyPEM}, nil
}

// missing reports whether path does not exist.
func missing(path string) bool {
	_, err := os.Stat(path)
	return errors.Is(err, fs.ErrNotExist)
}

// LoadCA reads a CA certificate and its key (PKCS#8, PKCS#1 or SEC 1 PEM,
// as WriteDevCerts, openssl and cert-manager write them); the key must
// match the certificate, which must be a CA.
func LoadCA(certFile, keyFile string) (*CA, error) {
	certPEM, err := os.ReadFile(certFile)
	if err != nil {
		return nil, err
	}
	keyPEM, err := os.ReadFile(keyFile)
	if err != nil {
		return nil, err
	}
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("load CA %s, %s: %w", certFile, keyFile, err)
	}
	cert := pair.Leaf // X509KeyPair parsed it
	if !cert.IsCA {
		return nil, fmt.Errorf("load CA %s: the certificate is not a CA", certFile)
	}
	signer, ok := pair.PrivateKey.(crypto.Signer)
	if !ok {
		return nil, fmt.Errorf("load CA key %s: not a signing key", keyFile)
	}
	return &CA{Cert: cert, Key: signer, CertPEM: certPEM, KeyPEM: keyPEM}, nil
}

// Leaf describes a certificate to issue.
type Leaf struct {
	ID        string // spiffe:// URI SAN; empty for none (tests of refusals)
	DNSNames  []string
	IPs       []net.IP
	NotBefore time.Time
	NotAfter  time.Time
}

// Issue signs a leaf certificate usable both as a TLS client and server.
func (ca *CA) Issue(l Leaf) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("generate key: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: l.ID, Organization: []string{"csibroker"}},
		NotBefore:    l.NotBefore,
		NotAfter:     l.NotAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		DNSNames:     l.DNSNames,
		IPAddresses:  l.IPs,
	}
	if l.ID != "" {
		u, err := url.Parse(l.ID)
		if err != nil {
			return nil, nil, fmt.Errorf("issue %q: %w", l.ID, err)
		}
		tmpl.URIs = []*url.URL{u}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, key.Public(), ca.Key)
	if err != nil {
		return nil, nil, fmt.Errorf("issue %q: %w", l.ID, err)
	}
	keyPEM, err = encodeKey(key)
	if err != nil {
		return nil, nil, err
	}
	return encodeCert(der), keyPEM, nil
}

// IssueMaterial issues a leaf and returns it as Material trusting this CA.
func (ca *CA) IssueMaterial(l Leaf) (*Material, error) {
	c, k, err := ca.Issue(l)
	if err != nil {
		return nil, err
	}
	return ParseMaterial(c, k, ca.CertPEM, l.NotBefore.Add(time.Second))
}

// DevCertsOptions says what WriteDevCerts mints.
type DevCertsOptions struct {
	Dir         string
	TrustDomain string
	Drivers     []string // one controller-proxy certificate each
	Nodes       []string // with Drivers: one node-proxy certificate per driver and node
	Clients     []string // one TCP front-end client certificate each
	Validity    time.Duration
	// OnlyNodes mints the node-proxy certificates only (no broker,
	// controller-proxy or client certificate), for a node's proxy issued
	// from a CA that also signs the broker's identity.
	OnlyNodes bool
}

// checkIDParts refuses, before anything is written, a trust domain or a
// name that would not make a valid SPIFFE ID segment (or file name): the
// trust domain's characters are SPIFFE's (lower-case letters, digits, '.',
// '-', '_'), a name's also upper-case letters.
func checkIDParts(o DevCertsOptions) error {
	var errs []error
	if o.TrustDomain == "" {
		errs = append(errs, errors.New("trust domain is required"))
	} else if !segmentOK(o.TrustDomain, false) {
		errs = append(errs, fmt.Errorf("trust domain %q: use lower-case letters, digits, '.', '-' and '_' only", o.TrustDomain))
	}
	for _, l := range []struct {
		what  string
		names []string
	}{{"node", o.Nodes}, {"client", o.Clients}} {
		for _, n := range l.names {
			if !segmentOK(n, true) || n == "." || n == ".." {
				errs = append(errs, fmt.Errorf("%s name %q: use letters, digits, '.', '-' and '_' only", l.what, n))
			}
		}
	}
	for _, n := range o.Drivers {
		// A CSI name (what the broker's registry and policy accept) is
		// also a valid SPIFFE ID segment and file name.
		if err := csiname.Check(n); err != nil {
			errs = append(errs, err)
		}
	}
	if o.OnlyNodes && (len(o.Drivers) == 0 || len(o.Nodes) == 0 || len(o.Clients) > 0) {
		errs = append(errs, errors.New("only node-proxy certificates asked for: give drivers and nodes, and no clients"))
	}
	return errors.Join(errs...)
}

func segmentOK(s string, upper bool) bool {
	if s == "" {
		return false
	}
	for _, r := range s {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9', r == '.', r == '-', r == '_':
		case upper && r >= 'A' && r <= 'Z':
		default:
			return false
		}
	}
	return true
}

// WriteDevCerts writes ca.crt/ca.key, broker.crt/broker.key and, per driver,
// proxy-<driver>.crt/.key (plus proxy-<driver>-<node>.crt/.key per node) and,
// per client, client-<name>.crt/.key into Dir. An existing CA in Dir is reused so certificates can be re-minted.
func WriteDevCerts(o DevCertsOptions) ([]string, error) {
	if err := checkIDParts(o); err != nil {
		return nil, fmt.Errorf("%w; nothing was written", err)
	}
	o.Drivers, o.Nodes, o.Clients = dedupe(o.Drivers), dedupe(o.Nodes), dedupe(o.Clients)
	if o.Validity <= 0 {
		o.Validity = 30 * 24 * time.Hour
	}
	if err := os.MkdirAll(o.Dir, 0o755); err != nil {
		return nil, err
	}
	// What to write, checked whole before anything is: driver and node
	// names may hold '-', so "proxy-<driver>-<node>" of one pair can be
	// the file of another pair or of a controller proxy.
	type leafFile struct{ base, id string }
	var plan []leafFile
	if !o.OnlyNodes {
		plan = append(plan, leafFile{"broker", BrokerID(o.TrustDomain)})
	}
	for _, d := range o.Drivers {
		if !o.OnlyNodes {
			plan = append(plan, leafFile{"proxy-" + d, DriverID(o.TrustDomain, d)})
		}
		for _, n := range o.Nodes {
			plan = append(plan, leafFile{"proxy-" + d + "-" + n, NodeDriverID(o.TrustDomain, d, n)})
		}
	}
	for _, c := range o.Clients { // none with OnlyNodes (checkIDParts)
		plan = append(plan, leafFile{"client-" + c, ClientID(o.TrustDomain, c)})
	}
	byBase := map[string]string{}
	for _, f := range plan {
		if other, ok := byBase[f.base]; ok && other != f.id {
			return nil, fmt.Errorf("%s.crt would hold both %s and %s (driver and node names joined by '-'); mint them in separate directories; nothing was written", filepath.Join(o.Dir, f.base), other, f.id)
		}
		byBase[f.base] = f.id
		if data, err := os.ReadFile(filepath.Join(o.Dir, f.base+".crt")); err == nil {
			if certs, err := parseCertsPEM(data); err == nil {
				if id, err := PeerID(certs[0]); err == nil && id != f.id && !sameButTrustDomain(id, f.id) {
					// A trust domain changed is a re-mint; another
					// identity under this file name is not.
					return nil, fmt.Errorf("%s.crt holds %s, another identity than the %s this run would write there (driver and node names joined by '-' can name one file); remove it or mint in another directory; nothing was written", filepath.Join(o.Dir, f.base), id, f.id)
				}
			}
		}
	}
	now := time.Now().Add(-time.Minute)
	caCert, caKey := filepath.Join(o.Dir, "ca.crt"), filepath.Join(o.Dir, "ca.key")
	ca, err := LoadCA(caCert, caKey)
	switch {
	case err == nil:
	case missing(caCert) && missing(caKey) && o.OnlyNodes:
		return nil, fmt.Errorf("no CA in %s (ca.crt and ca.key): node-proxy certificates alone are issued from the CA that signs the broker's; nothing was written", o.Dir)
	case missing(caCert) && missing(caKey):
		// A new dev CA only where there is none: a CA that cannot be read
		// is never replaced (its certificates would stop being trusted).
		if ca, err = NewCA("csibroker dev CA", now, now.Add(10*365*24*time.Hour)); err != nil {
			return nil, err
		}
		if err := writeFile(caCert, ca.CertPEM, 0o644); err != nil {
			return nil, err
		}
		if err := writeFile(caKey, ca.KeyPEM, 0o600); err != nil {
			return nil, err
		}
	default:
		return nil, fmt.Errorf("%w; nothing was written (remove both %s and %s to mint a new dev CA)", err, caCert, caKey)
	}
	written := []string{caCert}
	for _, f := range plan {
		c, k, err := ca.Issue(Leaf{ID: f.id, DNSNames: []string{"localhost"}, IPs: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}, NotBefore: now, NotAfter: now.Add(o.Validity)})
		if err != nil {
			return nil, err
		}
		if err := writeFile(filepath.Join(o.Dir, f.base+".crt"), c, 0o644); err != nil {
			return nil, err
		}
		written = append(written, filepath.Join(o.Dir, f.base+".crt"))
		if err := writeFile(filepath.Join(o.Dir, f.base+".key"), k, 0o600); err != nil {
			return nil, err
		}
	}
	return written, nil
}

// writeFile replaces path atomically so a watcher never reads half a file.
func writeFile(path string, data []byte, mode os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".tmp-"+filepath.Base(path))
	if err != nil {
		return err
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		os.Remove(tmp.Name())
		return err
	}
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		os.Remove(tmp.Name())
		return err
	}
	if err := tmp.Close(); err != nil {
		os.Remove(tmp.Name())
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// WriteFileAtomic is writeFile for callers (tests rotating certificates).
func WriteFileAtomic(path string, data []byte, mode os.FileMode) error {
	return writeFile(path, data, mode)
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(err) // crypto/rand never fails on Linux
	}
	return n
}

func encodeCert(der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

func encodeKey(k *ecdsa.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

// dedupe drops repeated names, keeping the first of each.
func dedupe(names []string) []string {
	var out []string
	for _, n := range names {
		if !slices.Contains(out, n) {
			out = append(out, n)
		}
	}
	return out
}

// sameButTrustDomain reports whether identities a and b differ at most in
// their trust domain.
func sameButTrustDomain(a, b string) bool {
	pa, err1 := ParseID(a)
	pb, err2 := ParseID(b)
	if err1 != nil || err2 != nil {
		return false
	}
	pa.TrustDomain = pb.TrustDomain
	return pa == pb
}
