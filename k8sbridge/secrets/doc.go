// Package secrets turns a StorageClass's secret parameters into secret
// references, as external-provisioner does: the csi.storage.k8s.io/ keys of
// each kind (provisioner, controller-publish, node-stage, node-publish,
// controller-expand, node-expand, controller-modify), the deprecated keys,
// the default secret-name/-namespace, and the ${pvc.name}, ${pvc.namespace},
// ${pv.name} and ${pvc.annotations['k']} templates with upstream's rules.
//
// It is pure: it names secrets and says where a name came from (for the
// policy's audit); it never reads one.
package secrets
