// Package attach is the attach/detach controller, as external-attacher for
// every registered driver: it publishes volumes to nodes for
// VolumeAttachments (ControllerPublishVolume), unpublishes them when the
// attachment goes, keeps the finalizers external-attacher keeps, and checks
// attached volumes against the driver's published nodes.
//
// A driver's publish context is checked (csiparams.CheckPublished) before
// it is written into the attachment's status. The reconcile asks each
// driver's proxy on its own goroutine, so a hung ListVolumes holds up only
// that driver's check, and a panic in it is logged and counted, not fatal.
//
// It reaches Kubernetes and the drivers through k8sbridge/internal/kube and
// internal/drivers, and imports no other controller.
package attach
