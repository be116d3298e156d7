// Package cli holds what the csibroker commands share: the TLS and logging
// flags, flag parsing, the HTTP endpoint, and the proxy command itself, so that
// the proxy can also be built as a binary of its own (cmd/csibroker-proxy) that
// links none of the broker's Kubernetes machinery. It parses flags into config
// structs and wires packages; it holds no logic of its own.
package cli
