package snapshots

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/k8sbridge/intent"
	"github.com/csibroker/csibroker/k8sbridge/secrets"
	"github.com/csibroker/csibroker/policy"
)

// SecretKeys name a content controller's snapshotter secret: the kind of
// its class parameters and the content's deletion-secret annotations,
// which remember it.
type SecretKeys struct {
	Kind            secrets.SnapshotKind
	AnnName, AnnNS  string
	What, ClassKind string // "group snapshotter", "VolumeGroupSnapshotClass"
}

// Of is the snapshotter secret of content obj, bound to ref: the one
// remembered on it, else the class's with their templates, whose
// annotations are then added to remember.
func (k SecretKeys) Of(obj metav1.Object, ref corev1.ObjectReference, class string, params, remember map[string]string) (*corev1.SecretReference, policy.Source, error) {
	r, src, err := k.Remembered(obj)
	if err != nil || r != nil {
		return r, src, err
	}
	r, err = secrets.SnapshotRef(k.Kind, params, obj.GetName(), &secrets.SnapshotObject{Namespace: ref.Namespace, Name: ref.Name})
	if err != nil {
		return nil, policy.Source{}, fmt.Errorf("%s %s: %w", k.ClassKind, class, err)
	}
	if r == nil {
		return nil, policy.Source{}, nil
	}
	remember[k.AnnName], remember[k.AnnNS] = r.Name, r.Namespace
	return r, secrets.SnapshotPolicySource(k.Kind, params), nil
}

// Remembered is the secret the content's deletion-secret annotations
// name (nil when it carries neither), and that source for the policy.
func (k SecretKeys) Remembered(obj metav1.Object) (*corev1.SecretReference, policy.Source, error) {
	src := policy.Source{Kind: policy.SourcePVField, Key: "metadata.annotations[" + k.AnnName + "]"}
	name, hasName := obj.GetAnnotations()[k.AnnName]
	ns, hasNS := obj.GetAnnotations()[k.AnnNS]
	if !hasName && !hasNS {
		return nil, src, nil
	}
	if name == "" || ns == "" {
		return nil, src, fmt.Errorf("content %s: annotations %s and %s must both name the %s secret", obj.GetName(), k.AnnName, k.AnnNS, k.What)
	}
	return &corev1.SecretReference{Name: name, Namespace: ns}, src, nil
}

// Intend makes entry e durable in r before its call, unless an earlier
// attempt recorded the same call (as same says): then e is not written
// and the recorded entry is returned.
func Intend[T intent.Entry](ctx context.Context, r *intent.Record[T], e T, same func(a, b T) bool) (T, error) {
	if prev, ok := r.Get(e.Key()); ok && same(prev, e) {
		return prev, nil // recorded by an earlier attempt: no write
	}
	return e, r.Add(ctx, e)
}
