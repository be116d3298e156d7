// Package deploy checks the manifests under deploy/: every kustomization
// builds (in-process, with kustomize's krusty and its default load
// restrictions, as kubectl apply -k would), every object it yields is
// accepted by a real kube-apiserver (internal/testenv) with a strict
// server-side dry run, the broker's RBAC is least-privilege (no list or watch
// of Secrets, asserted on the objects and by SubjectAccessReviews against the
// real authorizer), the manifests agree with each other and with the code
// (flags, certificate identities, discovery labels, the example SecretGrant
// admitting the example StorageClass's secret, one csibroker image set by
// the kustomizations' images entries), the dashboard and alert rules query
// only metrics the broker and proxy export, and the Dockerfile builds the
// image with the Go release go.mod requires.
//
// cert-manager and the Prometheus Operator are not installed in the test
// cluster: their objects are validated against minimal CRDs under testdata/
// that declare the fields deploy/ uses, with the upstream names and types.
//
// It holds only tests; it runs with plain `go test` and needs the binaries
// from hack/control-plane.sh.
package deploy
