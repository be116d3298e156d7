package kube

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/policy"
)

// ErrSecretDenied marks a policy denial; the caller makes it an Event.
var ErrSecretDenied = errors.New("secret access denied by policy")

// SecretUse is one wish to hand a secret to a driver.
type SecretUse struct {
	Driver    string
	Op        policy.Operation
	Ref       *corev1.SecretReference
	Source    policy.Source
	Requester policy.Requester
	// RecordedNSLabels are the requesting namespace's labels recorded when
	// the volume was made (on its PV) or attached (on its
	// VolumeAttachment), used when the namespace no longer exists.
	RecordedNSLabels map[string]string
}

// RecordedNamespaceLabels are the labels pv records of its claim's
// namespace (nil when it records none): decisions made after the
// namespace is gone use them.
func RecordedNamespaceLabels(pv *corev1.PersistentVolume) map[string]string {
	var recorded map[string]string
	if pv == nil {
		return nil
	}
	if a := pv.Annotations[AnnNamespaceLabels]; a != "" {
		_ = json.Unmarshal([]byte(a), &recorded)
	}
	return recorded
}

// NamespaceLabels are ns's labels from the cache; nil if it has not got
// ns (empty, not nil, for a namespace without labels).
func (b *Env) NamespaceLabels(ns string) map[string]string {
	n, err := b.Namespaces.Get(ns)
	if err != nil {
		return nil
	}
	if n.Labels == nil {
		return map[string]string{}
	}
	return n.Labels
}

// ReadNamespaceLabels are ns's labels from the cache or, when the cache
// has not got ns (a namespace made with its claim may not have reached
// it yet), from the API server; nil if neither has it.
func (b *Env) ReadNamespaceLabels(ctx context.Context, ns string) map[string]string {
	if l := b.NamespaceLabels(ns); l != nil {
		return l
	}
	n, err := b.Cfg.Client.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
	if err != nil {
		return nil
	}
	if n.Labels == nil {
		return map[string]string{}
	}
	return n.Labels
}

// SecretNotFound is fetchSecret's error for a secret that does not exist.
type SecretNotFound struct{ error }

func (e SecretNotFound) Unwrap() error { return e.error }

// FetchSecret asks the policy, and only on an allow GETs the secret (no
// Secret informer: the broker never lists or watches Secrets). The returned
// map goes into the CSI request and nowhere else.
func (b *Env) FetchSecret(ctx context.Context, u SecretUse) (map[string]string, error) {
	if u.Ref == nil {
		return nil, nil
	}
	if err := b.DecideSecret(ctx, u); err != nil {
		return nil, err
	}
	s, err := b.Cfg.Client.CoreV1().Secrets(u.Ref.Namespace).Get(ctx, u.Ref.Name, metav1.GetOptions{})
	if err != nil {
		if apierrors.IsNotFound(err) {
			from := ""
			if u.Source.Key != "" {
				from = " (named by " + u.Source.Key + ")"
			}
			return nil, SecretNotFound{fmt.Errorf("secret %s/%s%s for %s of driver %s not found: create it, or correct the reference", u.Ref.Namespace, u.Ref.Name, from, u.Op, u.Driver)}
		}
		// The API error names the object, never its content.
		return nil, fmt.Errorf("get secret %s/%s: %w", u.Ref.Namespace, u.Ref.Name, err)
	}
	out := make(map[string]string, len(s.Data)+len(s.StringData))
	for k, v := range s.Data {
		out[k] = string(v)
	}
	return out, nil
}

// DecideSecret asks the policy whether u may happen: an error (wrapping
// errSecretDenied) says which rule denied what. The decision is counted and
// audited.
func (b *Env) DecideSecret(ctx context.Context, u SecretUse) error {
	if u.Requester.Namespace != "" && u.Requester.NamespaceLabels == nil {
		nsLabels := b.NamespaceLabels(u.Requester.Namespace)
		if nsLabels == nil && u.RecordedNSLabels == nil {
			// Not in the cache, and nothing recorded: asked of the API
			// server, so that its labels decide (unknown labels fail
			// closed, which would refuse a legitimate claim).
			nsLabels = b.ReadNamespaceLabels(ctx, u.Requester.Namespace)
		}
		if nsLabels == nil {
			// The namespace is gone (its volumes are being cleaned up):
			// decide with the labels it had when the volume was made.
			nsLabels = u.RecordedNSLabels
		}
		u.Requester.NamespaceLabels = nsLabels
	}
	req := policy.Request{Driver: u.Driver, Operation: u.Op, Secret: policy.SecretRef{Namespace: u.Ref.Namespace, Name: u.Ref.Name}, Source: u.Source, Requester: u.Requester}
	d := b.Cfg.Policy.Decide(ctx, req)
	b.Metrics.SecretDecision.WithLabelValues(u.Driver, string(u.Op), d.Result()).Inc()
	policy.Audit(b.Log, req, d)
	if !d.Allowed {
		hint := ""
		if req.Requester.Namespace != "" && req.Requester.NamespaceLabels == nil {
			// Decided without the namespace's labels (a Deny grant's
			// namespaceSelector fails closed on them, an Allow grant's
			// selects nothing): say how to make them known.
			hint = fmt.Sprintf(" (namespace %s could not be read; for a PersistentVolume (or its VolumeAttachment) whose claim's namespace is gone, its %s annotation, a JSON object, gives the labels to decide with)",
				req.Requester.Namespace, AnnNamespaceLabels)
		}
		return fmt.Errorf("%w: %s%s", ErrSecretDenied, d.Reason, hint)
	}
	return nil
}
