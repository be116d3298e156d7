// Package capacity is the storage capacity controller, as
// external-provisioner's pkg/capacity: for every registered driver with
// GET_CAPACITY it keeps one CSIStorageCapacity object per StorageClass and
// topology segment (or node, for node-local drivers), refreshed by polling
// and after each volume made or deleted, and removes the objects of
// drivers and classes that are gone.
//
// Each driver has capacityWorkers refreshes in progress at most, each on a
// worker of its own beside the shared ones (kube.DriverSlots and
// kube.Pool): a driver whose GetCapacity hangs delays only its own
// objects. A driver's answer is checked (csiparams.CheckCapacity) before
// it is written; a refused one, or a refresh that panics, is an Event on
// the class and a retry with backoff, the object keeping its last value.
//
// It reaches Kubernetes and the drivers through k8sbridge/internal/kube and
// internal/drivers, and imports no other controller.
package capacity
