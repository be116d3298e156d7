package mtls

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"time"
)

// ServerConfig returns a TLS config for a server that requires a client
// certificate chaining to the source's CA pool and authorized by authz.
func ServerConfig(src Source, authz Authorizer) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		// Verification happens in VerifyPeerCertificate against the pool
		// current at handshake time, so a rotated CA applies at once. It is
		// also called when the client sends no certificate, and refuses that
		// with a clear error (RequireAnyClientCert would refuse it before any
		// callback could say so).
		ClientAuth: tls.RequestClientCert,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			return src.Current().Cert, nil
		},
		VerifyPeerCertificate: verifier(src, authz, x509.ExtKeyUsageClientAuth),
		NextProtos:            []string{"h2"},
		// VerifyPeerCertificate is not called on a resumed session, so no
		// session may be resumed: every connection shows a certificate
		// checked against the CA and the authorizer of that moment.
		SessionTicketsDisabled: true,
	}
}

// ClientConfig returns a TLS config for a client that presents the source's
// certificate and accepts only a server chaining to the source's CA pool and
// authorized by authz. Server names are not checked: identity is the URI SAN.
func ClientConfig(src Source, authz Authorizer) *tls.Config {
	return &tls.Config{
		MinVersion:         tls.VersionTLS12,
		InsecureSkipVerify: true, // replaced by VerifyPeerCertificate below
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return src.Current().Cert, nil
		},
		VerifyPeerCertificate: verifier(src, authz, x509.ExtKeyUsageServerAuth),
		NextProtos:            []string{"h2"},
	}
}

func verifier(src Source, authz Authorizer, usage x509.ExtKeyUsage) func([][]byte, [][]*x509.Certificate) error {
	return func(raw [][]byte, _ [][]*x509.Certificate) error {
		if len(raw) == 0 {
			return errors.New("mtls: peer presented no certificate")
		}
		certs := make([]*x509.Certificate, len(raw))
		for i, b := range raw {
			c, err := x509.ParseCertificate(b)
			if err != nil {
				return fmt.Errorf("mtls: parse peer certificate: %w", err)
			}
			certs[i] = c
		}
		inter := x509.NewCertPool()
		for _, c := range certs[1:] {
			inter.AddCert(c)
		}
		leaf := certs[0]
		if _, err := leaf.Verify(x509.VerifyOptions{
			Roots:         src.Current().Pool,
			Intermediates: inter,
			CurrentTime:   time.Now(),
			KeyUsages:     []x509.ExtKeyUsage{usage},
		}); err != nil {
			return fmt.Errorf("mtls: verify peer certificate %s: %w", describe(leaf), err)
		}
		id, err := PeerID(leaf)
		if err != nil {
			return fmt.Errorf("mtls: peer certificate %s: %w", describe(leaf), err)
		}
		if authz == nil {
			return fmt.Errorf("mtls: peer identity %s is not authorized: no identity is allowed", id)
		}
		if err := authz(id); err != nil {
			return fmt.Errorf("mtls: %w", err)
		}
		return nil
	}
}

func describe(c *x509.Certificate) string {
	for _, u := range c.URIs {
		return fmt.Sprintf("%q (serial %s)", u.String(), c.SerialNumber)
	}
	return fmt.Sprintf("CN=%q (serial %s)", c.Subject.CommonName, c.SerialNumber)
}
