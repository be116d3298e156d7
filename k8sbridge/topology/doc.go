// Package topology decides the topology of a CreateVolume request and the
// node affinity of the PV that comes back, as external-provisioner does.
//
// Everything here is pure: plain data in (Node values the caller builds from
// its Node and CSINode listers, the StorageClass's allowedTopologies), a
// requirement or an error out. It must not read the API server nor call a
// driver.
package topology
