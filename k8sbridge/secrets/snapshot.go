package secrets

import (
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/csibroker/csibroker/policy"
)

// Snapshot secret references from VolumeSnapshotClass parameters, with the
// rules of external-snapshotter's GetSecretReference:
//
//   - each kind has a name and a namespace parameter
//     (csi.storage.k8s.io/<kind>-secret-name and -namespace); both or neither
//     must be set, and neither may be empty; there is no default secret and
//     there are no deprecated keys;
//   - the name may use ${volumesnapshotcontent.name},
//     ${volumesnapshot.namespace} and ${volumesnapshot.name}; the namespace
//     only ${volumesnapshotcontent.name} and ${volumesnapshot.namespace}
//     (the snapshot's name is its creator's choice, and must not pick where
//     a secret is read from);
//   - the snapshot tokens need the VolumeSnapshot (snap); without it (a
//     pre-provisioned content's ListSnapshots secret) only
//     ${volumesnapshotcontent.name} resolves;
//   - the resolved name must be a DNS subdomain, the namespace a DNS label.
//
// As for StorageClasses, a "$" that does not start a well-formed ${token}
// is an error (upstream leaves such text as it is).

// SnapshotKind names one of the secrets a VolumeSnapshotClass can reference.
type SnapshotKind string

const (
	// Snapshotter is passed to CreateSnapshot and, remembered on the
	// content, to DeleteSnapshot.
	Snapshotter SnapshotKind = "snapshotter"
	// SnapshotterList is passed to ListSnapshots for a pre-provisioned
	// content's status.
	SnapshotterList SnapshotKind = "snapshotter-list"
)

// SnapshotParamKeys returns the name and namespace parameter keys of kind.
func SnapshotParamKeys(kind SnapshotKind) (nameKey, namespaceKey string) {
	return ParameterPrefix + string(kind) + "-secret-name", ParameterPrefix + string(kind) + "-secret-namespace"
}

// SnapshotObject is the VolumeSnapshot a content is bound to, as the
// templates see it.
type SnapshotObject struct{ Namespace, Name string }

// SnapshotRef resolves kind's secret reference from a VolumeSnapshotClass's
// parameters for content contentName of snapshot snap (nil: none known);
// nil and no error when the class names none. Errors name the parameter,
// the template and the reason, and wrap ErrParameter.
func SnapshotRef(kind SnapshotKind, params map[string]string, contentName string, snap *SnapshotObject) (*corev1.SecretReference, error) {
	if kind != Snapshotter && kind != SnapshotterList {
		return nil, fmt.Errorf("unknown snapshot secret kind %q: %w", kind, ErrParameter)
	}
	nameKey, nsKey := SnapshotParamKeys(kind)
	src, err := secretTemplates(string(kind), params, nameKey, nsKey, "", "")
	if err != nil || src == nil {
		return nil, err
	}
	ns, err := expandSnapshotTemplate(src.nsTemplate, false, contentName, snap)
	if err != nil {
		return nil, fmt.Errorf("parameter %s: template %q: %w", src.nsKey, src.nsTemplate, err)
	}
	if errs := validation.IsDNS1123Label(ns); len(errs) > 0 {
		return nil, fmt.Errorf("parameter %s: %s, which is not a valid namespace name: %s: %w",
			src.nsKey, describeResolved(src.nsTemplate, ns), strings.Join(errs, "; "), ErrParameter)
	}
	name, err := expandSnapshotTemplate(src.nameTemplate, true, contentName, snap)
	if err != nil {
		return nil, fmt.Errorf("parameter %s: template %q: %w", src.nameKey, src.nameTemplate, err)
	}
	if errs := validation.IsDNS1123Subdomain(name); len(errs) > 0 {
		return nil, fmt.Errorf("parameter %s: %s, which is not a valid secret name: %s: %w",
			src.nameKey, describeResolved(src.nameTemplate, name), strings.Join(errs, "; "), ErrParameter)
	}
	return &corev1.SecretReference{Name: name, Namespace: ns}, nil
}

// Snapshot template tokens.
const (
	tokenContentName      = "volumesnapshotcontent.name"
	tokenSnapshotName     = "volumesnapshot.name"
	tokenSnapshotNS       = "volumesnapshot.namespace"
	snapshotNamespaceRule = "a secret namespace may use only ${volumesnapshotcontent.name} and ${volumesnapshot.namespace}: the snapshot's name is set by its creator, who must not choose where secrets are read from"
)

func expandSnapshotTemplate(tpl string, forName bool, contentName string, snap *SnapshotObject) (string, error) {
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
		v, err := resolveSnapshotToken(token, forName, contentName, snap)
		if err != nil {
			return "", err
		}
		b.WriteString(v)
	}
}

func resolveSnapshotToken(token string, forName bool, contentName string, snap *SnapshotObject) (string, error) {
	noSnapshot := func() error {
		return fmt.Errorf("${%s} needs the VolumeSnapshot, and there is none here (only ${%s} resolves): %w", token, tokenContentName, ErrParameter)
	}
	switch token {
	case tokenContentName:
		return contentName, nil
	case tokenSnapshotNS:
		if snap == nil {
			return "", noSnapshot()
		}
		return snap.Namespace, nil
	case tokenSnapshotName:
		if !forName {
			return "", fmt.Errorf("${%s} is not allowed here: %s: %w", token, snapshotNamespaceRule, ErrParameter)
		}
		if snap == nil {
			return "", noSnapshot()
		}
		return snap.Name, nil
	}
	allowed := "${volumesnapshotcontent.name}, ${volumesnapshot.namespace}"
	if forName {
		allowed += ", ${volumesnapshot.name}"
	}
	return "", fmt.Errorf("unknown token ${%s} (known here: %s): %w", token, allowed, ErrParameter)
}

// SnapshotPolicySource says where a snapshot secret reference came from,
// for the policy and its audit.
func SnapshotPolicySource(kind SnapshotKind, params map[string]string) policy.Source {
	nameKey, nsKey := SnapshotParamKeys(kind)
	src := policy.Source{Kind: policy.SourceStorageClassParameter, Key: nameKey}
	if t := params[nsKey] + "/" + params[nameKey]; strings.Contains(t, "${") {
		src.Kind, src.Template = policy.SourceTemplate, t
	}
	return src
}
