// Package smoke checks, on a real control plane (internal/testenv with
// kube-controller-manager and kube-scheduler, no kubelet), the Kubernetes
// behaviour the broker builds on: the PV controller binds claims, the
// attach/detach controller creates and deletes VolumeAttachments, and the
// scheduler selects a node for WaitForFirstConsumer claims. If one of these
// fails, the bug is in the test environment, not in the broker.
//
// It holds only tests; it runs with plain `go test` and needs the binaries
// from hack/control-plane.sh.
package smoke
