// Package provision turns pending claims into volumes and PVs and deletes
// the volumes of released PVs, as external-provisioner: topology and
// parameters (k8sbridge/topology, csiparams), secrets decided by the policy,
// the intent recorded before CreateVolume so that no volume leaks
// (recovery deletes what a dead broker or a vanished claim left), node-local
// placement, rescheduling, clone and snapshot sources and the finalizers
// that protect them.
//
// Provisioner, Deleter and SourceProtector are its controllers; they reach
// Kubernetes and the drivers through k8sbridge/internal/kube and
// internal/drivers, and import no other controller.
package provision
