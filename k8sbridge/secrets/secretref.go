package secrets

import (
	"errors"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/csibroker/csibroker/policy"
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

// ErrParameter is wrapped by every error SecretRef returns: the
// StorageClass (or the claim it templates from) is wrong, and retrying the
// same objects cannot help.
var ErrParameter = errors.New("invalid secret parameter")

// Kind names one of the secrets a StorageClass can reference. Its value
// is the infix of the kind's parameter keys.
type Kind string

// The kinds of secret a StorageClass can reference.
const (
	// Provisioner is passed to CreateVolume and DeleteVolume.
	Provisioner Kind = "provisioner"
	// ControllerPublish becomes the PV's controllerPublishSecretRef.
	ControllerPublish Kind = "controller-publish"
	// NodeStage becomes the PV's nodeStageSecretRef.
	NodeStage Kind = "node-stage"
	// NodePublish becomes the PV's nodePublishSecretRef.
	NodePublish Kind = "node-publish"
	// ControllerExpand becomes the PV's controllerExpandSecretRef.
	ControllerExpand Kind = "controller-expand"
	// NodeExpand becomes the PV's nodeExpandSecretRef.
	NodeExpand Kind = "node-expand"
	// ControllerModify is recorded in the PV's
	// volume.kubernetes.io/controller-modify-secret-* annotations, as
	// external-provisioner does, and passed to ControllerModifyVolume when
	// the claim's VolumeAttributesClass changes (modify.go).
	ControllerModify Kind = "controller-modify"
)

// Kinds returns every kind, in a fixed order.
func Kinds() []Kind {
	return []Kind{Provisioner, ControllerPublish, NodeStage,
		NodePublish, ControllerExpand, NodeExpand, ControllerModify}
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
var deprecatedSecretKeys = map[Kind][2]string{
	Provisioner:       {"csiProvisionerSecretName", "csiProvisionerSecretNamespace"},
	ControllerPublish: {"csiControllerPublishSecretName", "csiControllerPublishSecretNamespace"},
	NodeStage:         {"csiNodeStageSecretName", "csiNodeStageSecretNamespace"},
	NodePublish:       {"csiNodePublishSecretName", "csiNodePublishSecretNamespace"},
}

func (k Kind) valid() bool {
	switch k {
	case Provisioner, ControllerPublish, NodeStage,
		NodePublish, ControllerExpand, NodeExpand, ControllerModify:
		return true
	}
	return false
}

// ParamKeys returns the name and namespace parameter keys of a kind (for messages and for stripping).
// An unknown kind has none.
func ParamKeys(kind Kind) (nameKey, namespaceKey string) {
	if !kind.valid() {
		return "", ""
	}
	return ParameterPrefix + string(kind) + "-secret-name", ParameterPrefix + string(kind) + "-secret-namespace"
}

// DeprecatedParamKeys returns the deprecated (unprefixed) name and
// namespace keys of a kind, or empty strings for kinds that never had them.
func DeprecatedParamKeys(kind Kind) (nameKey, namespaceKey string) {
	keys := deprecatedSecretKeys[kind]
	return keys[0], keys[1]
}

// kindTemplates are the templates of kind's secret: its own parameters
// (the deprecated ones included) or, when the class sets none of them, the
// default csi.storage.k8s.io/secret-name and -namespace; nil when neither.
func kindTemplates(kind Kind, params map[string]string) (*secretSource, error) {
	nameKey, nsKey := ParamKeys(kind)
	depName, depNS := DeprecatedParamKeys(kind)
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
// and the reason, and wrap ErrParameter.
func Ref(kind Kind, params map[string]string, pvName string, claim *corev1.PersistentVolumeClaim) (*corev1.SecretReference, error) {
	if !kind.valid() {
		return nil, fmt.Errorf("unknown secret kind %q: %w", kind, ErrParameter)
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
			src.nsKey, describeResolved(src.nsTemplate, ns), strings.Join(errs, "; "), ErrParameter)
	}
	name, err := expandSecretTemplate(src.nameTemplate, true, pvName, claim)
	if err != nil {
		return nil, fmt.Errorf("parameter %s: template %q: %w", src.nameKey, src.nameTemplate, err)
	}
	if errs := validation.IsDNS1123Subdomain(name); len(errs) > 0 {
		return nil, fmt.Errorf("parameter %s: %s, which is not a valid secret name: %s: %w",
			src.nameKey, describeResolved(src.nameTemplate, name), strings.Join(errs, "; "), ErrParameter)
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
			kind, names[0], names[1], ErrParameter)
	case len(namespaces) > 1:
		return nil, fmt.Errorf("%s secret namespace set twice, by %s and by %s (the former is deprecated; keep only the latter): %w",
			kind, namespaces[0], namespaces[1], ErrParameter)
	case len(names) == 1 && len(namespaces) == 0:
		return nil, fmt.Errorf("parameter %s is set but %s is not: a secret's name and namespace must be set together: %w",
			names[0], nsKey, ErrParameter)
	case len(names) == 0 && len(namespaces) == 1:
		return nil, fmt.Errorf("parameter %s is set but %s is not: a secret's name and namespace must be set together: %w",
			namespaces[0], nameKey, ErrParameter)
	case len(names) == 0:
		return nil, nil
	case src.nameTemplate == "":
		return nil, fmt.Errorf("parameter %s is empty: %w", src.nameKey, ErrParameter)
	case src.nsTemplate == "":
		return nil, fmt.Errorf("parameter %s is empty: %w", src.nsKey, ErrParameter)
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
			return "", fmt.Errorf("%q must start a ${...} token: %w", "$", ErrParameter)
		}
		end := strings.IndexByte(rest, '}')
		if end < 0 {
			return "", fmt.Errorf("%q is not closed by %q: %w", "${", "}", ErrParameter)
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
		return fmt.Errorf("${%s} needs the claim, and there is none (deletion without a claim resolves only ${pv.name}): %w", token, ErrParameter)
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
			return "", fmt.Errorf("${%s} is not allowed here: %s: %w", token, namespaceRule, ErrParameter)
		}
		if claim == nil {
			return "", noClaim()
		}
		return claim.Name, nil
	case strings.HasPrefix(token, tokenAnnotationHead) && strings.HasSuffix(token, tokenAnnotationTail) &&
		len(token) >= len(tokenAnnotationHead)+len(tokenAnnotationTail):
		if !forName {
			return "", fmt.Errorf("${%s} is not allowed here: %s: %w", token, namespaceRule, ErrParameter)
		}
		if claim == nil {
			return "", noClaim()
		}
		key := token[len(tokenAnnotationHead) : len(token)-len(tokenAnnotationTail)]
		v, ok := claim.Annotations[key]
		if !ok {
			return "", fmt.Errorf("${%s}: claim %s/%s has no annotation %q: %w", token, claim.Namespace, claim.Name, key, ErrParameter)
		}
		return v, nil
	}
	allowed := "${pv.name}, ${pvc.namespace}"
	if forName {
		allowed = "${pv.name}, ${pvc.namespace}, ${pvc.name}, ${pvc.annotations['<key>']}"
	}
	return "", fmt.Errorf("unknown token ${%s} (known here: %s): %w", token, allowed, ErrParameter)
}

// PolicySource says where a reference came from, for the policy and its audit.
// It names the keys SecretRef read, deprecated ones included.
func PolicySource(kind Kind, params map[string]string) policy.Source {
	nameKey, _ := ParamKeys(kind)
	src := policy.Source{Kind: policy.SourceStorageClassParameter, Key: nameKey}
	if t, err := kindTemplates(kind, params); err == nil && t != nil {
		src.Key = t.nameKey
		if strings.Contains(t.nameTemplate+t.nsTemplate, "${") {
			src.Kind = policy.SourceTemplate
			src.Template = t.nsTemplate + "/" + t.nameTemplate
		}
	}
	return src
}
