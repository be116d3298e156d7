package mtls

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"sync"
	"time"
)

// PeerCheck verifies an established connection's peer again, as its
// handshake did, once that verdict may have changed: the CA bundle or our
// own certificate was reloaded (a CA taken out of the bundle stops its
// certificates here too), or a certificate the peer presented has expired.
// Otherwise Verify costs a lock and two comparisons, so it can run for
// every call.
type PeerCheck struct {
	cfg   *tls.Config
	raw   [][]byte
	certs []*x509.Certificate
	// at is our certificate at the handshake; atExpiry when it expires.
	at       *tls.Certificate
	atExpiry time.Time

	mu       sync.Mutex
	notAfter time.Time        // the earliest expiry of the peer's certificates still valid at the last check
	checked  *tls.Certificate // our certificate when the peer last verified
	renewed  bool             // checked is another leaf than at
	err      error            // sticky: a peer refused once stays refused
}

// OwnCert is the certificate cfg (ServerConfig or ClientConfig) hands out
// now, from its callbacks.
func OwnCert(cfg *tls.Config) *tls.Certificate {
	switch {
	case cfg.GetCertificate != nil:
		c, _ := cfg.GetCertificate(&tls.ClientHelloInfo{})
		return c
	case cfg.GetClientCertificate != nil:
		c, _ := cfg.GetClientCertificate(&tls.CertificateRequestInfo{})
		return c
	}
	return nil
}

// NewPeerCheck keeps what cs's peer showed, to be verified again with cfg,
// the config that accepted it. own is our certificate as read before the
// handshake (nil: read now); read before, a reload during the handshake
// shows as a renewal, never as none.
func NewPeerCheck(cfg *tls.Config, cs tls.ConnectionState, own *tls.Certificate) *PeerCheck {
	p := &PeerCheck{cfg: cfg, certs: cs.PeerCertificates}
	for _, c := range cs.PeerCertificates {
		p.raw = append(p.raw, c.Raw)
	}
	if own == nil {
		own = OwnCert(cfg)
	}
	p.at, p.checked = own, own
	if own != nil {
		leaf := own.Leaf
		if leaf == nil && len(own.Certificate) > 0 {
			leaf, _ = x509.ParseCertificate(own.Certificate[0])
		}
		if leaf != nil {
			p.atExpiry = leaf.NotAfter
		}
	}
	p.notAfter = p.earliestExpiry(time.Now())
	if len(p.raw) == 0 {
		p.err = errors.New("mtls: peer presented no certificate")
	}
	return p
}

// earliestExpiry is the earliest NotAfter among the peer's certificates
// still valid at now: one already expired (an extra certificate outside
// the chain that verified) does not make every later check a full one.
func (p *PeerCheck) earliestExpiry(now time.Time) time.Time {
	var t time.Time
	for _, c := range p.certs {
		if c.NotAfter.After(now) && (t.IsZero() || c.NotAfter.Before(t)) {
			t = c.NotAfter
		}
	}
	return t
}

// Verify reports whether the peer would still be accepted now.
func (p *PeerCheck) Verify() error {
	_, err := p.Check()
	return err
}

// Check is Verify, and also reports whether our own certificate (its leaf,
// not merely the reloaded material: a new CA bundle alone renews nothing)
// has changed since the handshake: a client then moves new calls to a new
// connection, so the peer sees the new certificate before the old one
// expires. Our material is read once per call.
func (p *PeerCheck) Check() (renewed bool, err error) {
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err != nil {
		return p.renewed, p.err
	}
	mine := OwnCert(p.cfg)
	if mine == p.checked && now.Before(p.notAfter) {
		return p.renewed, nil
	}
	if p.cfg.VerifyPeerCertificate != nil {
		if err := p.cfg.VerifyPeerCertificate(p.raw, nil); err != nil {
			p.err = err
			return p.renewed, err
		}
	}
	p.checked = mine
	p.renewed = !sameLeaf(mine, p.at)
	p.notAfter = p.earliestExpiry(now)
	return p.renewed, nil
}

func sameLeaf(a, b *tls.Certificate) bool {
	if a == b {
		return true
	}
	if a == nil || b == nil || len(a.Certificate) == 0 || len(b.Certificate) == 0 {
		return false
	}
	return bytes.Equal(a.Certificate[0], b.Certificate[0])
}

// PeerExpired reports whether the leaf certificate the peer showed at the
// handshake has expired by now: a Check that fails then may be nothing but
// a routine renewal on the peer's side, which a new handshake picks up.
// (Only the leaf: an extra certificate already expired at the handshake,
// which earliestExpiry tolerates, says nothing about a later failure.)
func (p *PeerCheck) PeerExpired(now time.Time) bool {
	return len(p.certs) > 0 && !now.Before(p.certs[0].NotAfter)
}

// OwnExpired reports whether the certificate we showed at the handshake
// has expired: the peer refuses new calls on the connection from then on.
func (p *PeerCheck) OwnExpired(now time.Time) bool {
	return !p.atExpiry.IsZero() && !now.Before(p.atExpiry)
}
