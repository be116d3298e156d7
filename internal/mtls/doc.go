// Package mtls builds mutual-TLS configurations from certificate sources that
// re-read their files when they change, and authorizes peers by the
// SPIFFE-style URI SAN of their certificate.
//
// A tls.Config is built once and asks its Source for the current certificate
// and CA pool on every handshake, so a rotation (cert-manager rewriting the
// files) takes effect without a restart and without failing a call; a new file
// that does not parse, whose key does not match, or that has expired is
// refused and the previous material stays in use.
//
// Identities (see design.md):
//
//	spiffe://<trust-domain>/csibroker/broker
//	spiffe://<trust-domain>/csibroker/driver/<driver>
//	spiffe://<trust-domain>/csibroker/driver/<driver>/node/<node>
//
// Authorization fails closed: an Authorizer with no allowed identity admits
// nobody. The package also mints development CAs and certificates.
package mtls
