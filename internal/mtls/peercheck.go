package mtls

import (
	"crypto/tls"
	"errors"
	"sync"
	"time"
)

// PeerCheck verifies an established connection's peer again, as its
// handshake did, once that verdict may have changed: the CA bundle or our
// own certificate was reloaded (a CA taken out of the bundle stops its
// certificates here too), or a certificate of the peer's chain has expired.
// Otherwise Verify costs a lock and two comparisons, so it can run for
// every call.
type PeerCheck struct {
	cfg      *tls.Config
	raw      [][]byte
	notAfter time.Time
	// at is our certificate at the handshake.
	at *tls.Certificate

	mu      sync.Mutex
	checked *tls.Certificate // our certificate when the peer last verified
	err     error            // sticky: a peer refused once stays refused
}

// NewPeerCheck keeps what cs's peer showed, to be verified again with cfg,
// the config (ServerConfig or ClientConfig) that accepted it.
func NewPeerCheck(cfg *tls.Config, cs tls.ConnectionState) *PeerCheck {
	p := &PeerCheck{cfg: cfg}
	for i, c := range cs.PeerCertificates {
		p.raw = append(p.raw, c.Raw)
		if i == 0 || c.NotAfter.Before(p.notAfter) {
			p.notAfter = c.NotAfter
		}
	}
	p.at = p.own()
	p.checked = p.at
	if len(p.raw) == 0 {
		p.err = errors.New("mtls: peer presented no certificate")
	}
	return p
}

// own is our certificate now, from cfg's callbacks (they hand out the
// source's current one).
func (p *PeerCheck) own() *tls.Certificate {
	switch {
	case p.cfg.GetCertificate != nil:
		c, _ := p.cfg.GetCertificate(&tls.ClientHelloInfo{})
		return c
	case p.cfg.GetClientCertificate != nil:
		c, _ := p.cfg.GetClientCertificate(&tls.CertificateRequestInfo{})
		return c
	}
	return nil
}

// Verify reports whether the peer would still be accepted now.
func (p *PeerCheck) Verify() error {
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err != nil {
		return p.err
	}
	mine := p.own()
	if mine == p.checked && now.Before(p.notAfter) {
		return nil
	}
	if p.cfg.VerifyPeerCertificate == nil {
		return nil
	}
	if err := p.cfg.VerifyPeerCertificate(p.raw, nil); err != nil {
		p.err = err
		return err
	}
	p.checked = mine
	return nil
}

// Renewed reports whether our own certificate has changed since the
// handshake: a client then opens a new connection for new calls, so the
// peer sees the new certificate before the old one expires.
func (p *PeerCheck) Renewed() bool { return p.own() != p.at }
