// Package policy decides whether driver D may receive secret S for CSI
// operation O on behalf of requester R. Decisions are pure functions over plain
// data; loaders turn files, Kubernetes objects (as plain data) or an external
// decision point into rule sets. No Kubernetes client and no gRPC here.
package policy
