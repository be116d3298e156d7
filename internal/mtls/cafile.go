package mtls

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"
)

// CAFile is a CA bundle read from a file and re-read when its contents
// change, for a client that verifies a server outside the broker's own
// trust domain (an external decision point behind a private CA). A changed
// file that does not parse whole keeps the pool in use, as FileSource does.
type CAFile struct {
	path string
	r    reloader[x509.CertPool]
}

// NewCAFile reads the bundle once; it fails if the file holds no whole
// certificate.
func NewCAFile(path string, log *slog.Logger) (*CAFile, error) {
	if path == "" {
		return nil, errors.New("mtls: no CA file given")
	}
	c := &CAFile{path: path}
	c.r = reloader[x509.CertPool]{files: []string{path}, parse: c.parse, log: log,
		msgReloaded: "mtls: CA bundle reloaded",
		msgRefused:  "mtls: new CA bundle refused, keeping the previous one (logged again only if the refusal changes)"}
	if err := c.r.start(); err != nil {
		return nil, err
	}
	return c, nil
}

// Pool returns the CA pool in use.
func (c *CAFile) Pool() *x509.CertPool { return c.r.cur.Load() }

// Reload reads the file and swaps in its pool if the contents changed and
// parse. It reports whether a swap happened.
func (c *CAFile) Reload() (bool, error) { return c.r.reload() }

// Run re-reads the file every interval until ctx is done.
func (c *CAFile) Run(ctx context.Context, interval time.Duration) { c.r.run(ctx, interval) }

// parse makes the pool of the bundle read.
func (c *CAFile) parse(raw [][]byte, _ *x509.CertPool) (*x509.CertPool, []any, error) {
	cas, err := parseCertsPEM(raw[0])
	if err != nil {
		return nil, nil, fmt.Errorf("mtls: CA bundle %s: %w", c.path, err)
	}
	pool := x509.NewCertPool()
	for _, ca := range cas {
		pool.AddCert(ca)
	}
	return pool, []any{"file", c.path, "certificates", len(cas)}, nil
}

// Transport returns an HTTP transport, made from base (nil: a clone of
// http.DefaultTransport), that verifies servers against the pool in use:
// requests go through a clone of base whose RootCAs is the current pool,
// and a reload makes a new clone (the old one's idle connections are
// closed), so a renewed bundle is trusted without rebuilding the client.
// Verification is the standard one, host name included.
func (c *CAFile) Transport(base *http.Transport) http.RoundTripper {
	if base == nil {
		base = http.DefaultTransport.(*http.Transport)
	}
	return &poolTransport{caf: c, base: base.Clone()}
}

type poolTransport struct {
	caf  *CAFile
	base *http.Transport

	mu   sync.Mutex
	pool *x509.CertPool // the pool cur was made for
	cur  *http.Transport
}

func (t *poolTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	pool := t.caf.Pool()
	t.mu.Lock()
	if t.cur == nil || pool != t.pool {
		tr := t.base.Clone()
		if tr.TLSClientConfig == nil {
			tr.TLSClientConfig = &tls.Config{MinVersion: tls.VersionTLS12}
		}
		tr.TLSClientConfig.RootCAs = pool
		if t.cur != nil {
			t.cur.CloseIdleConnections()
		}
		t.cur, t.pool = tr, pool
	}
	cur := t.cur
	t.mu.Unlock()
	resp, err := cur.RoundTrip(req)
	var unknown x509.UnknownAuthorityError
	if errors.As(err, &unknown) {
		err = fmt.Errorf("%w (the CAs trusted are those of %s)", err, t.caf.path)
	}
	return resp, err
}

// CloseIdleConnections closes the idle connections of the transport in use.
func (t *poolTransport) CloseIdleConnections() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.cur != nil {
		t.cur.CloseIdleConnections()
	}
}
