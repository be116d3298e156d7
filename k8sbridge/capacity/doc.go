// Package capacity is the storage capacity controller, as
// external-provisioner's pkg/capacity: for every registered driver with
// GET_CAPACITY it keeps one CSIStorageCapacity object per StorageClass and
// topology segment (or node, for node-local drivers), refreshed by polling
// and after each volume made or deleted, and removes the objects of
// drivers and classes that are gone.
//
// It reaches Kubernetes and the drivers through k8sbridge/internal/kube and
// internal/drivers, and imports no other controller.
package capacity
