// Package tracing checks, end to end against a real tracing backend, that a
// Kubernetes operation is one trace: a real control plane (internal/testenv
// with kube-controller-manager), the sample driver, its proxy and the broker
// run as processes of the csibroker binary, each exporting its spans over
// OTLP to Jaeger all-in-one with nothing but the standard OTEL_* variables,
// and the test reads the provisioning trace back from Jaeger's query API.
// It also checks the latency histograms' exemplars against the traces
// Jaeger has.
//
// It holds only tests; it runs with plain `go test` and needs the binaries
// from hack/control-plane.sh and hack/jaeger.sh (make test builds both).
package tracing
