package k8sbridge

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/policy"
)

// errSecretDenied marks a policy denial; the caller makes it an Event.
var errSecretDenied = errors.New("secret access denied by policy")

// secretUse is one wish to hand a secret to a driver.
type secretUse struct {
	driver    string
	op        policy.Operation
	ref       *corev1.SecretReference
	source    policy.Source
	requester policy.Requester
	// recordedNSLabels are the requesting namespace's labels recorded when
	// the volume was made (on its PV) or attached (on its
	// VolumeAttachment), used when the namespace no longer exists.
	recordedNSLabels map[string]string
}

// recordedNamespaceLabels are the labels pv records of its claim's
// namespace (nil when it records none): decisions made after the
// namespace is gone use them.
func recordedNamespaceLabels(pv *corev1.PersistentVolume) map[string]string {
	var recorded map[string]string
	if pv == nil {
		return nil
	}
	if a := pv.Annotations[kube.AnnNamespaceLabels]; a != "" {
		_ = json.Unmarshal([]byte(a), &recorded)
	}
	return recorded
}

// namespaceLabels are ns's labels from the cache; nil if it has not got
// ns (empty, not nil, for a namespace without labels).
func (b *Bridge) namespaceLabels(ns string) map[string]string {
	n, err := b.namespaces.Get(ns)
	if err != nil {
		return nil
	}
	if n.Labels == nil {
		return map[string]string{}
	}
	return n.Labels
}

// readNamespaceLabels are ns's labels from the cache or, when the cache
// has not got ns (a namespace made with its claim may not have reached
// it yet), from the API server; nil if neither has it.
func (b *Bridge) readNamespaceLabels(ctx context.Context, ns string) map[string]string {
	if l := b.namespaceLabels(ns); l != nil {
		return l
	}
	n, err := b.cfg.Client.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
	if err != nil {
		return nil
	}
	if n.Labels == nil {
		return map[string]string{}
	}
	return n.Labels
}

// secretNotFound is fetchSecret's error for a secret that does not exist.
type secretNotFound struct{ error }

func (e secretNotFound) Unwrap() error { return e.error }

// fetchSecret asks the policy, and only on an allow GETs the secret (no
// Secret informer: the broker never lists or watches Secrets). The returned
// map goes into the CSI request and nowhere else.
func (b *Bridge) fetchSecret(ctx context.Context, u secretUse) (map[string]string, error) {
	if u.ref == nil {
		return nil, nil
	}
	if err := b.decideSecret(ctx, u); err != nil {
		return nil, err
	}
	s, err := b.cfg.Client.CoreV1().Secrets(u.ref.Namespace).Get(ctx, u.ref.Name, metav1.GetOptions{})
	if err != nil {
		if apierrors.IsNotFound(err) {
			from := ""
			if u.source.Key != "" {
				from = " (named by " + u.source.Key + ")"
			}
			return nil, secretNotFound{fmt.Errorf("secret %s/%s%s for %s of driver %s not found: create it, or correct the reference", u.ref.Namespace, u.ref.Name, from, u.op, u.driver)}
		}
		// The API error names the object, never its content.
		return nil, fmt.Errorf("get secret %s/%s: %w", u.ref.Namespace, u.ref.Name, err)
	}
	out := make(map[string]string, len(s.Data)+len(s.StringData))
	for k, v := range s.Data {
		out[k] = string(v)
	}
	return out, nil
}

// decideSecret asks the policy whether u may happen: an error (wrapping
// errSecretDenied) says which rule denied what. The decision is counted and
// audited.
func (b *Bridge) decideSecret(ctx context.Context, u secretUse) error {
	if u.requester.Namespace != "" && u.requester.NamespaceLabels == nil {
		nsLabels := b.namespaceLabels(u.requester.Namespace)
		if nsLabels == nil && u.recordedNSLabels == nil {
			// Not in the cache, and nothing recorded: asked of the API
			// server, so that its labels decide (unknown labels fail
			// closed, which would refuse a legitimate claim).
			nsLabels = b.readNamespaceLabels(ctx, u.requester.Namespace)
		}
		if nsLabels == nil {
			// The namespace is gone (its volumes are being cleaned up):
			// decide with the labels it had when the volume was made.
			nsLabels = u.recordedNSLabels
		}
		u.requester.NamespaceLabels = nsLabels
	}
	req := policy.Request{Driver: u.driver, Operation: u.op, Secret: policy.SecretRef{Namespace: u.ref.Namespace, Name: u.ref.Name}, Source: u.source, Requester: u.requester}
	d := b.cfg.Policy.Decide(ctx, req)
	b.metrics.secretDecision.WithLabelValues(u.driver, string(u.op), d.Result()).Inc()
	policy.Audit(b.log, req, d)
	if !d.Allowed {
		hint := ""
		if req.Requester.Namespace != "" && req.Requester.NamespaceLabels == nil {
			// Decided without the namespace's labels (a Deny grant's
			// namespaceSelector fails closed on them, an Allow grant's
			// selects nothing): say how to make them known.
			hint = fmt.Sprintf(" (namespace %s could not be read; for a PersistentVolume (or its VolumeAttachment) whose claim's namespace is gone, its %s annotation, a JSON object, gives the labels to decide with)",
				req.Requester.Namespace, kube.AnnNamespaceLabels)
		}
		return fmt.Errorf("%w: %s%s", errSecretDenied, d.Reason, hint)
	}
	return nil
}
