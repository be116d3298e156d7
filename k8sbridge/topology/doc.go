// Package topology decides the topology of a CreateVolume request and the
// node affinity of the PV that comes back, as external-provisioner does.
//
// Everything here is pure: plain data in (Node values the caller builds from
// its Node and CSINode listers, the StorageClass's allowedTopologies), a
// requirement or an error out. It must not read the API server nor call a
// driver.
//
// The cluster is seen through NodesOf, whose two rules hold wherever the
// broker reads topology: a CSINode whose Node object is missing is no node
// (its keys decide nothing; external-provisioner may use them, the broker
// refuses the claim until a node that exists registers the driver), and of
// two entries for one driver in a CSINode the first counts.
package topology
