package k8sbridge

import (
	"errors"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation"
)

// Secret references from StorageClass parameters, with the rules of
// external-provisioner's getSecretReference:
//
//   - each kind has a name and a namespace parameter
//     (csi.storage.k8s.io/<kind>-secret-name and -namespace); both or neither
//     must be set, and neither may be empty;
//   - the provisioner, controller-publish, node-stage and node-publish kinds
//     also honour the deprecated csiProvisionerSecretName-style keys (and
//     setting a kind both ways is an error);
//   - a kind that sets nothing falls back to csi.storage.k8s.io/secret-name
//     and csi.storage.k8s.io/secret-namespace;
//   - the name may use ${pv.name}, ${pvc.namespace}, ${pvc.name} and
//     ${pvc.annotations['<key>']}; the namespace only ${pv.name} and
//     ${pvc.namespace}, because the claim's name and annotations are chosen by
//     whoever creates the claim, and must not pick the namespace a secret is
//     read from (every kind's name, the provisioner's included, may use the
//     claim's name and annotations: upstream allows it since v5.0.0, the
//     resolved reference being kept on the PV for deletion);
//   - the resolved name must be a DNS subdomain, the namespace a DNS label.
//
// One rule is stricter than upstream: a "$" that does not start a well-formed
// ${token} is an error (upstream silently drops "${" and "${}").

// ErrSecretParameter is wrapped by every error SecretRef returns: the
// StorageClass (or the claim it templates from) is wrong, and retrying the
// same objects cannot help.
var ErrSecretParameter = errors.New("invalid secret parameter")

// SecretKind names one of the secrets a StorageClass can reference. Its value
// is the infix of the kind's parameter keys.
type SecretKind string

// The kinds of secret a StorageClass can reference.
const (
	// SecretProvisioner is passed to CreateVolume and DeleteVolume.
	SecretProvisioner SecretKind = "provisioner"
	// SecretControllerPublish becomes the PV's controllerPublishSecretRef.
	SecretControllerPublish SecretKind = "controller-publish"
	// SecretNodeStage becomes the PV's nodeStageSecretRef.
	SecretNodeStage SecretKind = "node-stage"
	// SecretNodePublish becomes the PV's nodePublishSecretRef.
	SecretNodePublish SecretKind = "node-publish"
	// SecretControllerExpand becomes the PV's controllerExpandSecretRef.
	SecretControllerExpand SecretKind = "controller-expand"
	// SecretNodeExpand becomes the PV's nodeExpandSecretRef.
	SecretNodeExpand SecretKind = "node-expand"
	// SecretControllerModify is recorded in the PV's
	// volume.kubernetes.io/controller-modify-secret-* annotations, as
	// external-provisioner does, and passed to ControllerModifyVolume when
	// the claim's VolumeAttributesClass changes (modify.go).
	SecretControllerModify SecretKind = "controller-modify"
)

// SecretKinds returns every kind, in a fixed order.
func SecretKinds() []SecretKind {
	return []SecretKind{SecretProvisioner, SecretControllerPublish, SecretNodeStage,
		SecretNodePublish, SecretControllerExpand, SecretNodeExpand, SecretControllerModify}
}

// Parameter keys shared by every kind.
const (
	// ParameterPrefix starts every StorageClass parameter the provisioner
	// (not the driver) understands.
	ParameterPrefix = "csi.storage.k8s.io/"
	// ParamDefaultSecretName and ParamDefaultSecretNamespace name the secret
	// of every kind that sets none of its own.
	ParamDefaultSecretName      = ParameterPrefix + "secret-name"
	ParamDefaultSecretNamespace = ParameterPrefix + "secret-namespace"
)

// deprecatedSecretKeys are the pre-prefix keys upstream still reads (and, as
// upstream, passes on to the driver: they are not csi.storage.k8s.io/ keys).
var deprecatedSecretKeys = map[SecretKind][2]string{
	SecretProvisioner:       {"csiProvisionerSecretName", "csiProvisionerSecretNamespace"},
	SecretControllerPublish: {"csiControllerPublishSecretName", "csiControllerPublishSecretNamespace"},
	SecretNodeStage:         {"csiNodeStageSecretName", "csiNodeStageSecretNamespace"},
	SecretNodePublish:       {"csiNodePublishSecretName", "csiNodePublishSecretNamespace"},
}

func (k SecretKind) valid() bool {
	switch k {
	case SecretProvisioner, SecretControllerPublish, SecretNodeStage,
		SecretNodePublish, SecretControllerExpand, SecretNodeExpand, SecretControllerModify:
		return true
	}
	return false
}

// SecretParamKeys returns the name and namespace parameter keys of a kind (for messages and for stripping).
// An unknown kind has none.
func SecretParamKeys(kind SecretKind) (nameKey, namespaceKey string) {
	if !kind.valid() {
		return "", ""
	}
	return ParameterPrefix + string(kind) + "-secret-name", ParameterPrefix + string(kind) + "-secret-namespace"
}

// DeprecatedSecretParamKeys returns the deprecated (unprefixed) name and
// namespace keys of a kind, or empty strings for kinds that never had them.
func DeprecatedSecretParamKeys(kind SecretKind) (nameKey, namespaceKey string) {
	keys := deprecatedSecretKeys[kind]
	return keys[0], keys[1]
}

// kindTemplates are the templates of kind's secret: its own parameters
// (the deprecated ones included) or, when the class sets none of them, the
// default csi.storage.k8s.io/secret-name and -namespace; nil when neither.
func kindTemplates(kind SecretKind, params map[string]string) (*secretSource, error) {
	nameKey, nsKey := SecretParamKeys(kind)
	depName, depNS := DeprecatedSecretParamKeys(kind)
	src, err := secretTemplates(string(kind), params, nameKey, nsKey, depName, depNS)
	if err != nil || src != nil {
		return src, err
	}
	return secretTemplates("default", params, ParamDefaultSecretName, ParamDefaultSecretNamespace, "", "")
}

// SecretRef resolves the kind's secret reference from StorageClass parameters; nil (no error) when the class names none. claim may be nil (deletion: only ${pv.name} resolves).
//
// For deletion, upstream passes a claim carrying only the name and namespace
// of the PV's claimRef, so that ${pvc.name} and ${pvc.namespace} resolve as at
// creation; a caller may do the same. Errors name the parameter, the template
// and the reason, and wrap ErrSecretParameter.
func SecretRef(kind SecretKind, params map[string]string, pvName string, claim *corev1.PersistentVolumeClaim) (*corev1.SecretReference, error) {
	if !kind.valid() {
		return nil, fmt.Errorf("unknown secret kind %q: %w", kind, ErrSecretParameter)
	}
	src, err := kindTemplates(kind, params)
	if err != nil || src == nil {
		return nil, err
	}

	ns, err := expandSecretTemplate(src.nsTemplate, false, pvName, claim)
	if err != nil {
		return nil, fmt.Errorf("parameter %s: template %q: %w", src.nsKey, src.nsTemplate, err)
	}
	if errs := validation.IsDNS1123Label(ns); len(errs) > 0 {
		return nil, fmt.Errorf("parameter %s: %s, which is not a valid namespace name: %s: %w",
			src.nsKey, describeResolved(src.nsTemplate, ns), strings.Join(errs, "; "), ErrSecretParameter)
	}
	name, err := expandSecretTemplate(src.nameTemplate, true, pvName, claim)
	if err != nil {
		return nil, fmt.Errorf("parameter %s: template %q: %w", src.nameKey, src.nameTemplate, err)
	}
	if errs := validation.IsDNS1123Subdomain(name); len(errs) > 0 {
		return nil, fmt.Errorf("parameter %s: %s, which is not a valid secret name: %s: %w",
			src.nameKey, describeResolved(src.nameTemplate, name), strings.Join(errs, "; "), ErrSecretParameter)
	}
	return &corev1.SecretReference{Name: name, Namespace: ns}, nil
}

// describeResolved says what a template gave, for messages; what it gave
// from a claim's annotation may be long (up to 256 KiB), so it is cut.
func describeResolved(template, resolved string) string {
	if template == resolved {
		return fmt.Sprintf("%q", template)
	}
	const keep = 100
	if len(resolved) > keep {
		return fmt.Sprintf("template %q resolved to %q... (%d bytes)", template, strings.ToValidUTF8(resolved[:keep], ""), len(resolved))
	}
	return fmt.Sprintf("template %q resolved to %q", template, resolved)
}

// secretSource is where a kind's templates came from.
type secretSource struct {
	nameKey, nameTemplate string
	nsKey, nsTemplate     string
}

// secretTemplates finds a kind's name and namespace templates among the
// current and deprecated keys; nil when none is set.
func secretTemplates(kind string, params map[string]string, nameKey, nsKey, depNameKey, depNSKey string) (*secretSource, error) {
	var names, namespaces []string // keys present
	src := &secretSource{}
	for _, k := range []string{depNameKey, nameKey} {
		if v, ok := params[k]; ok && k != "" {
			names = append(names, k)
			src.nameKey, src.nameTemplate = k, v
		}
	}
	for _, k := range []string{depNSKey, nsKey} {
		if v, ok := params[k]; ok && k != "" {
			namespaces = append(namespaces, k)
			src.nsKey, src.nsTemplate = k, v
		}
	}
	switch {
	case len(names) > 1:
		return nil, fmt.Errorf("%s secret name set twice, by %s and by %s (the former is deprecated; keep only the latter): %w",
			kind, names[0], names[1], ErrSecretParameter)
	case len(namespaces) > 1:
		return nil, fmt.Errorf("%s secret namespace set twice, by %s and by %s (the former is deprecated; keep only the latter): %w",
			kind, namespaces[0], namespaces[1], ErrSecretParameter)
	case len(names) == 1 && len(namespaces) == 0:
		return nil, fmt.Errorf("parameter %s is set but %s is not: a secret's name and namespace must be set together: %w",
			names[0], nsKey, ErrSecretParameter)
	case len(names) == 0 && len(namespaces) == 1:
		return nil, fmt.Errorf("parameter %s is set but %s is not: a secret's name and namespace must be set together: %w",
			namespaces[0], nameKey, ErrSecretParameter)
	case len(names) == 0:
		return nil, nil
	case src.nameTemplate == "":
		return nil, fmt.Errorf("parameter %s is empty: %w", src.nameKey, ErrSecretParameter)
	case src.nsTemplate == "":
		return nil, fmt.Errorf("parameter %s is empty: %w", src.nsKey, ErrSecretParameter)
	}
	return src, nil
}

// Template tokens.
const (
	tokenPVName         = "pv.name"
	tokenPVCName        = "pvc.name"
	tokenPVCNamespace   = "pvc.namespace"
	tokenAnnotationHead = "pvc.annotations['"
	tokenAnnotationTail = "']"
)

// expandSecretTemplate replaces every ${token} of tpl. Namespace templates
// (forName false) accept only ${pv.name} and ${pvc.namespace}.
func expandSecretTemplate(tpl string, forName bool, pvName string, claim *corev1.PersistentVolumeClaim) (string, error) {
	var b strings.Builder
	rest := tpl
	for {
		i := strings.IndexByte(rest, '$')
		if i < 0 {
			b.WriteString(rest)
			return b.String(), nil
		}
		b.WriteString(rest[:i])
		rest = rest[i:]
		if !strings.HasPrefix(rest, "${") {
			return "", fmt.Errorf("%q must start a ${...} token: %w", "$", ErrSecretParameter)
		}
		end := strings.IndexByte(rest, '}')
		if end < 0 {
			return "", fmt.Errorf("%q is not closed by %q: %w", "${", "}", ErrSecretParameter)
		}
		token := rest[2:end]
		rest = rest[end+1:]
		v, err := resolveSecretToken(token, forName, pvName, claim)
		if err != nil {
			return "", err
		}
		b.WriteString(v)
	}
}

func resolveSecretToken(token string, forName bool, pvName string, claim *corev1.PersistentVolumeClaim) (string, error) {
	const namespaceRule = "a secret namespace may use only ${pv.name} and ${pvc.namespace}: the claim's name and annotations are set by its creator, who must not choose where secrets are read from"
	noClaim := func() error {
		return fmt.Errorf("${%s} needs the claim, and there is none (deletion without a claim resolves only ${pv.name}): %w", token, ErrSecretParameter)
	}
	switch {
	case token == tokenPVName:
		return pvName, nil
	case token == tokenPVCNamespace:
		if claim == nil {
			return "", noClaim()
		}
		return claim.Namespace, nil
	case token == tokenPVCName:
		if !forName {
			return "", fmt.Errorf("${%s} is not allowed here: %s: %w", token, namespaceRule, ErrSecretParameter)
		}
		if claim == nil {
			return "", noClaim()
		}
		return claim.Name, nil
	case strings.HasPrefix(token, tokenAnnotationHead) && strings.HasSuffix(token, tokenAnnotationTail) &&
		len(token) >= len(tokenAnnotationHead)+len(tokenAnnotationTail):
		if !forName {
			return "", fmt.Errorf("${%s} is not allowed here: %s: %w", token, namespaceRule, ErrSecretParameter)
		}
		if claim == nil {
			return "", noClaim()
		}
		key := token[len(tokenAnnotationHead) : len(token)-len(tokenAnnotationTail)]
		v, ok := claim.Annotations[key]
		if !ok {
			return "", fmt.Errorf("${%s}: claim %s/%s has no annotation %q: %w", token, claim.Namespace, claim.Name, key, ErrSecretParameter)
		}
		return v, nil
	}
	allowed := "${pv.name}, ${pvc.namespace}"
	if forName {
		allowed = "${pv.name}, ${pvc.namespace}, ${pvc.name}, ${pvc.annotations['<key>']}"
	}
	return "", fmt.Errorf("unknown token ${%s} (known here: %s): %w", token, allowed, ErrSecretParameter)
}
