// Package snapshots holds what the snapshot controllers share (the single
// VolumeSnapshotContent controller and the group one): csi-snapshotter's
// test of a final CSI error and its class-parameter rules; the content
// steps over either content type (Contents: the sync frame with its
// driver slot, budget and span, the workers, the informer handlers, the
// update filter, the queueing of a class's or every content); the
// snapshotter secret's lookup and memory on the content (SecretKeys);
// the intent write before a call (Intend); and the pass that settles a
// snapshot intent record's entries (Recovery, Settler; each controller
// undoes an entry itself). Each controller fills Contents with its
// type's accessors; nothing here imports a controller.
package snapshots

import (
	"fmt"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csibroker/csibroker/k8sbridge/secrets"
)

// IsFinal is csi-snapshotter's test of a create error: the driver
// answered, and is not still making the snapshot. Anything that is not a
// gRPC status (the call may not have been sent) and the codes that may
// mean "in progress" (Canceled, DeadlineExceeded, Unavailable,
// ResourceExhausted, Aborted) are not final.
func IsFinal(err error) bool {
	st, ok := status.FromError(err)
	if !ok {
		return false
	}
	switch st.Code() {
	case codes.Canceled, codes.DeadlineExceeded, codes.Unavailable, codes.ResourceExhausted, codes.Aborted:
		return false
	}
	return true
}

// DriverParameters is a snapshot or group snapshot class's parameters for
// the driver: the csi.storage.k8s.io/ keys of the snapshotters' secrets
// stripped, any other key of that prefix refused (as csi-snapshotter
// refuses it: a mistyped secret key would otherwise pass on silently).
func DriverParameters(in map[string]string) (map[string]string, error) {
	known := map[string]bool{}
	for _, k := range []secrets.SnapshotKind{secrets.Snapshotter, secrets.SnapshotterList, secrets.GroupSnapshotter, secrets.GroupSnapshotterGet} {
		n, ns := secrets.SnapshotParamKeys(k)
		known[n], known[ns] = true, true
	}
	out := map[string]string{}
	for k, v := range in {
		if !strings.HasPrefix(k, secrets.ParameterPrefix) {
			out[k] = v
			continue
		}
		if !known[k] {
			return nil, fmt.Errorf("unknown parameter %q with the reserved prefix %s", k, secrets.ParameterPrefix)
		}
	}
	return out, nil
}

// AnnotationsOutside returns cur's annotations with mark as it stands in
// old: the annotations a content update filter compares, the controller's
// own mark (being-created) left out of the comparison. nil when nothing
// is left and old had none, so that a semantic comparison with old holds.
func AnnotationsOutside(old, cur map[string]string, mark string) map[string]string {
	ann := map[string]string{}
	for k, v := range cur {
		ann[k] = v
	}
	delete(ann, mark)
	if v, ok := old[mark]; ok {
		ann[mark] = v
	}
	if len(ann) == 0 && old == nil {
		return nil
	}
	return ann
}
