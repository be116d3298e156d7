// Package modify is the volume modification controller, as
// external-resizer's modify controller: a bound claim whose
// volumeAttributesClassName differs from its current one has its volume
// changed with ControllerModifyVolume, and the claim's status says where it
// stands (Pending, InProgress, Infeasible).
//
// It reaches Kubernetes and the drivers through k8sbridge/internal/kube and
// internal/drivers, and imports no other controller.
package modify
