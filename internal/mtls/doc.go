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
// Identities (docs/security.md):
//
//	spiffe://<trust-domain>/csibroker/broker
//	spiffe://<trust-domain>/csibroker/driver/<driver>
//	spiffe://<trust-domain>/csibroker/driver/<driver>/node/<node>
//	spiffe://<trust-domain>/csibroker/client/<name>
//
// The last is a client of the broker's mTLS TCP front end. Proxies admit
// only the broker; the front end admits clients and the broker, never a
// driver's proxy (drivers never call the broker).
//
// Authorization fails closed: an Authorizer with no allowed identity admits
// nobody. AuthorizeAny is for tests and tools, never for the broker or the
// proxy.
//
// # Open connections
//
// A handshake's verdict can go stale while its connection stays open.
// PeerCheck verifies the peer again once that may have changed: the CA
// bundle or our own certificate was reloaded (a CA taken out of the bundle
// stops its certificates here too), or a certificate the peer presented
// has expired. Otherwise it costs a lock and two comparisons, so it can run
// for every call. A peer refused once stays refused on that connection.
//
// # Other sources
//
// CAFile is a CA bundle alone, re-read when it changes, for a client that
// verifies a server outside the trust domain (the policy's external
// decision point behind a private CA); its Transport trusts a renewed
// bundle without rebuilding the client.
//
// # Metrics
//
// NewCollector exports, for a Source,
// csibroker_tls_certificate_not_after_timestamp_seconds,
// csibroker_tls_reloads_total and csibroker_tls_reload_failures_total.
//
// The package also mints development CAs and certificates (csibroker certs,
// the demo, tests).
package mtls
