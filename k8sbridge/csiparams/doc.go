// Package csiparams turns a claim and its StorageClass into the parts of a
// CSI request, as external-provisioner does: the driver's parameters (the
// csi.storage.k8s.io/ keys stripped, the extra create metadata added), the
// volume capabilities, the capacity range and the volume name; and it
// classifies CreateVolume errors (final, maybe in progress, reschedule).
//
// It is pure: plain data in, plain data out, no API server and no driver.
package csiparams
