// Package attach is the attach/detach controller, as external-attacher for
// every registered driver: it publishes volumes to nodes for
// VolumeAttachments (ControllerPublishVolume), unpublishes them when the
// attachment goes, keeps the finalizers external-attacher keeps, and checks
// attached volumes against the driver's published nodes.
//
// It reaches Kubernetes and the drivers through k8sbridge/internal/kube and
// internal/drivers, and imports no other controller.
package attach
