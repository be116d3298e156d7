package mtls

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// CAFile is a CA bundle read from a file and re-read when its contents
// change, for a client that verifies a server outside the broker's own
// trust domain (an external decision point behind a private CA). A changed
// file that does not parse whole keeps the pool in use, as FileSource does.
type CAFile struct {
	path string
	log  *slog.Logger

	cur atomic.Pointer[x509.CertPool]

	mu       sync.Mutex // serializes reloads
	lastRead []byte
	refused  string
}

// NewCAFile reads the bundle once; it fails if the file holds no whole
// certificate.
func NewCAFile(path string, log *slog.Logger) (*CAFile, error) {
	if path == "" {
		return nil, errors.New("mtls: no CA file given")
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	c := &CAFile{path: path, log: log}
	if _, err := c.Reload(); err != nil {
		return nil, err
	}
	return c, nil
}

// Pool returns the CA pool in use.
func (c *CAFile) Pool() *x509.CertPool { return c.cur.Load() }

// Reload reads the file and swaps in its pool if the contents changed and
// parse. It reports whether a swap happened.
func (c *CAFile) Reload() (bool, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	data, err := os.ReadFile(c.path)
	if err != nil {
		return false, c.refuse(fmt.Errorf("mtls: read %s: %w", c.path, err))
	}
	if c.cur.Load() != nil && bytes.Equal(data, c.lastRead) {
		c.refused = ""
		return false, nil
	}
	cas, err := parseCertsPEM(data)
	if err != nil {
		return false, c.refuse(fmt.Errorf("mtls: CA bundle %s: %w", c.path, err))
	}
	pool := x509.NewCertPool()
	for _, ca := range cas {
		pool.AddCert(ca)
	}
	first := c.cur.Load() == nil
	c.lastRead, c.refused = data, ""
	c.cur.Store(pool)
	if !first {
		c.log.Info("mtls: CA bundle reloaded", "file", c.path, "certificates", len(cas))
	}
	return true, nil
}

// refuse logs a refused reload once while the same refusal stands; called
// with mu held.
func (c *CAFile) refuse(err error) error {
	if c.cur.Load() != nil {
		if msg := err.Error(); msg != c.refused {
			c.refused = msg
			c.log.Error("mtls: new CA bundle refused, keeping the previous one (logged again only if the refusal changes)", "err", err)
		}
	}
	return err
}

// Run re-reads the file every interval until ctx is done.
func (c *CAFile) Run(ctx context.Context, interval time.Duration) {
	poll(ctx, interval, func() { _, _ = c.Reload() }) // logged inside
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
