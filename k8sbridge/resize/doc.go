// Package resize is the volume expansion controller, as external-resizer:
// a bound claim asking for more than its volume holds is expanded with
// ControllerExpandVolume (or handed to the kubelet when the driver only
// expands on the node), with the claim's resize status and conditions
// written as the resizer writes them.
//
// It reaches Kubernetes and the drivers through k8sbridge/internal/kube and
// internal/drivers, and imports no other controller.
package resize
