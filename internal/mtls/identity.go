package mtls

import (
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"strings"
)

// Role is what a csibroker identity is.
type Role string

const (
	RoleBroker Role = "broker"
	RoleDriver Role = "driver"
	// RoleClient is a CSI client of the broker's mTLS TCP front end (a tool,
	// a remote orchestrator). Proxies refuse it: it reaches drivers only
	// through the broker.
	RoleClient Role = "client"
)

// Identity is a parsed csibroker SPIFFE ID.
type Identity struct {
	TrustDomain string
	Role        Role
	Driver      string // for RoleDriver
	Node        string // for a node plugin's proxy; empty for a controller proxy
	Client      string // for RoleClient
}

// String renders the identity as its SPIFFE URI.
func (id Identity) String() string {
	switch id.Role {
	case RoleBroker:
		return BrokerID(id.TrustDomain)
	case RoleDriver:
		if id.Node != "" {
			return NodeDriverID(id.TrustDomain, id.Driver, id.Node)
		}
		return DriverID(id.TrustDomain, id.Driver)
	case RoleClient:
		return ClientID(id.TrustDomain, id.Client)
	}
	return fmt.Sprintf("spiffe://%s/csibroker/%s", id.TrustDomain, id.Role)
}

// BrokerID is the broker's SPIFFE ID in trustDomain.
func BrokerID(trustDomain string) string {
	return "spiffe://" + trustDomain + "/csibroker/broker"
}

// DriverID is the SPIFFE ID of the controller proxy of driver.
func DriverID(trustDomain, driver string) string {
	return "spiffe://" + trustDomain + "/csibroker/driver/" + driver
}

// NodeDriverID is the SPIFFE ID of driver's node-plugin proxy on node.
func NodeDriverID(trustDomain, driver, node string) string {
	return DriverID(trustDomain, driver) + "/node/" + node
}

// ClientID is the SPIFFE ID of a client of the TCP front end named name.
func ClientID(trustDomain, name string) string {
	return "spiffe://" + trustDomain + "/csibroker/client/" + name
}

// ErrNoIdentity means a certificate carries no spiffe:// URI SAN.
var ErrNoIdentity = errors.New("certificate has no spiffe:// URI SAN")

// ParseID parses a csibroker SPIFFE ID.
func ParseID(s string) (Identity, error) {
	u, err := url.Parse(s)
	if err != nil {
		return Identity{}, fmt.Errorf("parse identity %q: %w", s, err)
	}
	if u.Scheme != "spiffe" || u.Host == "" {
		return Identity{}, fmt.Errorf("identity %q: want spiffe://<trust-domain>/csibroker/<role>", s)
	}
	parts := strings.Split(strings.TrimPrefix(u.Path, "/"), "/")
	if len(parts) < 2 || parts[0] != "csibroker" {
		return Identity{}, fmt.Errorf("identity %q: path must start with /csibroker/", s)
	}
	id := Identity{TrustDomain: u.Host, Role: Role(parts[1])}
	switch {
	case id.Role == RoleBroker && len(parts) == 2:
		return id, nil
	case id.Role == RoleDriver && len(parts) == 3 && parts[2] != "":
		id.Driver = parts[2]
		return id, nil
	case id.Role == RoleDriver && len(parts) == 5 && parts[2] != "" && parts[3] == "node" && parts[4] != "":
		id.Driver, id.Node = parts[2], parts[4]
		return id, nil
	case id.Role == RoleClient && len(parts) == 3 && parts[2] != "":
		id.Client = parts[2]
		return id, nil
	}
	return Identity{}, fmt.Errorf("identity %q: not a csibroker broker, driver or client identity", s)
}

// PeerID returns the single spiffe:// URI SAN of a certificate.
func PeerID(cert *x509.Certificate) (string, error) {
	var found string
	for _, u := range cert.URIs {
		if u.Scheme != "spiffe" {
			continue
		}
		if found != "" {
			return "", fmt.Errorf("certificate %q has more than one spiffe:// URI SAN", cert.Subject.CommonName)
		}
		found = u.String()
	}
	if found == "" {
		return "", ErrNoIdentity
	}
	return found, nil
}

// Authorizer decides whether a verified peer identity may talk to us.
type Authorizer func(id string) error

// AuthorizeOneOf admits exactly the listed identities. With none listed it
// admits nobody.
func AuthorizeOneOf(ids ...string) Authorizer {
	allowed := make(map[string]struct{}, len(ids))
	for _, id := range ids {
		allowed[id] = struct{}{}
	}
	return func(id string) error {
		if _, ok := allowed[id]; ok {
			return nil
		}
		if len(ids) == 1 {
			return fmt.Errorf("peer identity %s is not authorized: want %s", id, ids[0])
		}
		return fmt.Errorf("peer identity %s is not authorized: want one of %s", id, strings.Join(ids, ", "))
	}
}

// AuthorizeAny admits every identity that carries a verified certificate. It
// is meant for tests and tools, never for the broker or the proxy.
func AuthorizeAny() Authorizer { return func(string) error { return nil } }

// AuthorizeFrontEndCaller admits the callers of the broker's TCP front end:
// a client or the broker itself, in trustDomain. A driver's proxy never
// calls the broker and is refused.
func AuthorizeFrontEndCaller(trustDomain string) Authorizer {
	return func(id string) error {
		p, err := ParseID(id)
		if err != nil {
			return err
		}
		switch {
		case p.TrustDomain != trustDomain:
			return fmt.Errorf("peer identity %s is not in trust domain %s", id, trustDomain)
		case p.Role == RoleDriver:
			return fmt.Errorf("peer identity %s is a driver's: drivers never call the broker", id)
		}
		return nil
	}
}
