package mtls

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Material is one consistent set of our certificate, its key and the CA pool
// that peers' certificates must chain to.
type Material struct {
	Cert *tls.Certificate
	Leaf *x509.Certificate
	ID   string // our own spiffe:// identity
	Pool *x509.CertPool
}

// Source hands out the current Material.
type Source interface {
	Current() *Material
}

// StaticSource is a Source whose material never changes (tests, tools).
type StaticSource struct{ M *Material }

// Current returns the fixed material.
func (s StaticSource) Current() *Material { return s.M }

// FileSource reads a certificate, its key and a CA bundle from files and
// re-reads them when their contents change. A reload that fails keeps the
// previous material.
type FileSource struct {
	certFile, keyFile, caFile string
	now                       func() time.Time
	r                         reloader[Material]
}

// NewFileSource loads the files once; it fails if they are not a valid set.
func NewFileSource(certFile, keyFile, caFile string, log *slog.Logger) (*FileSource, error) {
	if certFile == "" || keyFile == "" || caFile == "" {
		return nil, errors.New("mtls: certificate, key and CA files are all required")
	}
	s := &FileSource{certFile: certFile, keyFile: keyFile, caFile: caFile, now: time.Now}
	s.r = reloader[Material]{files: []string{certFile, keyFile, caFile}, parse: s.parse, log: log,
		msgReloaded: "mtls: certificate reloaded",
		msgRefused:  "mtls: new certificate files refused, keeping the previous ones (logged again only if the refusal changes)"}
	if err := s.r.start(); err != nil {
		return nil, err
	}
	return s, nil
}

// Current returns the material in use.
func (s *FileSource) Current() *Material { return s.r.cur.Load() }

// Reloads and Failures count successful swaps and refused new files.
func (s *FileSource) Reloads() int64  { return s.r.reloads.Load() }
func (s *FileSource) Failures() int64 { return s.r.failures.Load() }

// Reload reads the files and swaps in their material if it changed and is
// valid. It reports whether a swap happened.
func (s *FileSource) Reload() (bool, error) { return s.r.reload() }

// Run polls the files every interval until ctx is done. Kubernetes secret
// volumes and cert-manager replace files by renaming symlinks, which polling
// the contents handles without special cases.
func (s *FileSource) Run(ctx context.Context, interval time.Duration) { s.r.run(ctx, interval) }

// parse makes the material of the files' contents, cur being the material
// in use (nil the first time).
func (s *FileSource) parse(raw [][]byte, cur *Material) (*Material, []any, error) {
	m, err := ParseMaterial(raw[0], raw[1], raw[2], s.now())
	if err != nil {
		return nil, nil, fmt.Errorf("mtls: %s, %s, %s: %w", s.certFile, s.keyFile, s.caFile, err)
	}
	if cur != nil {
		// Peers decide by identity and validity: material they would
		// refuse is kept out, as a broken file is. Not remembered, so the
		// same files are examined again (a certificate not valid yet is
		// taken once it is).
		switch {
		case m.ID != cur.ID:
			return nil, nil, fmt.Errorf("mtls: %s names %s, not %s as the certificate in use does (peers would refuse it)", s.certFile, m.ID, cur.ID)
		case s.now().Before(m.Leaf.NotBefore):
			return nil, nil, fmt.Errorf("mtls: %s is not valid before %s", s.certFile, m.Leaf.NotBefore.UTC().Format(time.RFC3339))
		}
	}
	return m, []any{"identity", m.ID, "not_after", m.Leaf.NotAfter.UTC().Format(time.RFC3339), "serial", m.Leaf.SerialNumber.String()}, nil
}

// reloader is what FileSource and CAFile share: a value made from files
// and made again when their contents change; new contents that are refused
// leave the value in use.
type reloader[T any] struct {
	files []string
	// parse makes the value of the files' contents, cur being the value in
	// use (nil the first time), and the attributes to log its reload with.
	parse                   func(raw [][]byte, cur *T) (*T, []any, error)
	log                     *slog.Logger
	msgReloaded, msgRefused string

	cur atomic.Pointer[T]

	mu                sync.Mutex // serializes reloads
	lastRead          [][]byte
	refused           string // the last refusal logged, so one that stands is logged once
	reloads, failures atomic.Int64
}

// start makes the first value; it fails if the files are refused.
func (r *reloader[T]) start() error {
	if r.log == nil {
		r.log = slog.New(slog.DiscardHandler)
	}
	_, err := r.reload()
	return err
}

// reload reads the files and swaps in their value if they changed and
// parse. It reports whether a swap happened.
func (r *reloader[T]) reload() (bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	raw := make([][]byte, len(r.files))
	for i, f := range r.files {
		b, err := os.ReadFile(f)
		if err != nil {
			return false, r.refuse(fmt.Errorf("mtls: read %s: %w", f, err))
		}
		raw[i] = b
	}
	cur := r.cur.Load()
	if cur != nil && slices.EqualFunc(raw, r.lastRead, bytes.Equal) {
		r.refused = "" // the files in use again: a refusal after this is news
		return false, nil
	}
	v, attrs, err := r.parse(raw, cur)
	if err != nil {
		// Remember nothing: a later complete write must be re-examined.
		return false, r.refuse(err)
	}
	r.lastRead, r.refused = raw, ""
	r.cur.Store(v)
	if cur != nil {
		r.reloads.Add(1)
		r.log.Info(r.msgReloaded, attrs...)
	}
	return true, nil
}

// refuse counts a refused reload and logs it, once while the same refusal
// stands (run polls every interval); called with mu held.
func (r *reloader[T]) refuse(err error) error {
	if r.cur.Load() != nil {
		r.failures.Add(1)
		if msg := err.Error(); msg != r.refused {
			r.refused = msg
			r.log.Error(r.msgRefused, "err", err)
		}
	}
	return err
}

// run reloads every interval (a second if it is not positive) until ctx is
// done; refusals are logged inside.
func (r *reloader[T]) run(ctx context.Context, interval time.Duration) {
	if interval <= 0 {
		interval = time.Second
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			_, _ = r.reload()
		}
	}
}

// ParseMaterial validates and parses PEM certificate, key and CA bundle.
func ParseMaterial(certPEM, keyPEM, caPEM []byte, now time.Time) (*Material, error) {
	// Every certificate block whole and parsed, nothing after the last: a
	// file caught half rewritten inside a block (a bundle cut in its second
	// CA, a chain in the certificate after its leaf) is refused and the
	// material in use kept, not loaded in part. A cut exactly between two
	// blocks cannot be told from a shorter file.
	if _, err := parseCertsPEM(certPEM); err != nil {
		return nil, fmt.Errorf("certificate file: %w", err)
	}
	cas, err := parseCertsPEM(caPEM)
	if err != nil {
		return nil, fmt.Errorf("CA bundle: %w", err)
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("certificate and key: %w", err)
	}
	leaf := cert.Leaf
	if leaf == nil {
		if leaf, err = x509.ParseCertificate(cert.Certificate[0]); err != nil {
			return nil, fmt.Errorf("parse certificate: %w", err)
		}
		cert.Leaf = leaf
	}
	if now.After(leaf.NotAfter) {
		return nil, fmt.Errorf("certificate expired at %s", leaf.NotAfter.UTC().Format(time.RFC3339))
	}
	id, err := PeerID(leaf)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	for _, c := range cas {
		pool.AddCert(c)
	}
	return &Material{Cert: &cert, Leaf: leaf, ID: id, Pool: pool}, nil
}

// parseCertsPEM parses the certificates of a PEM file (other blocks are
// skipped), refusing it if it holds none, a certificate that does not
// parse, or anything but whitespace after its last whole block.
func parseCertsPEM(data []byte) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	rest := data
	for {
		block, r := pem.Decode(rest)
		if block == nil {
			break
		}
		rest = r
		if block.Type != "CERTIFICATE" {
			continue // a key in the same file, say: skipped, as tls.X509KeyPair does
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("certificate %d: %w", len(out)+1, err)
		}
		out = append(out, c)
	}
	if len(bytes.TrimSpace(rest)) > 0 {
		return nil, fmt.Errorf("%d bytes after certificate %d are no whole PEM block (the file is cut short or malformed)", len(bytes.TrimSpace(rest)), len(out))
	}
	if len(out) == 0 {
		return nil, errors.New("holds no PEM certificate")
	}
	return out, nil
}
