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
	// GroupSnapshotter is a VolumeGroupSnapshotClass's secret for
	// CreateVolumeGroupSnapshot and, remembered on the group content,
	// DeleteVolumeGroupSnapshot. Its templates name the group objects:
	// ${volumegroupsnapshotcontent.name}, ${volumegroupsnapshot.namespace}
	// and ${volumegroupsnapshot.name}, with the same rules.
	GroupSnapshotter SnapshotKind = "group-snapshotter"
	// GroupSnapshotterGet is passed to GetVolumeGroupSnapshot.
	GroupSnapshotterGet SnapshotKind = "group-snapshotter-get"
)

// snapshotTokens are the template tokens of one kind of snapshot object.
type snapshotTokens struct{ object, content, name, namespace string }

var (
	singleTokens = snapshotTokens{"VolumeSnapshot", tokenContentName, tokenSnapshotName, tokenSnapshotNS}
	groupTokens  = snapshotTokens{"VolumeGroupSnapshot", "volumegroupsnapshotcontent.name", "volumegroupsnapshot.name", "volumegroupsnapshot.namespace"}
)

// tokensOf is the template tokens of kind's secret (nil: no such kind).
func tokensOf(kind SnapshotKind) *snapshotTokens {
	switch kind {
	case Snapshotter, SnapshotterList:
		return &singleTokens
	case GroupSnapshotter, GroupSnapshotterGet:
		return &groupTokens
	}
	return nil
}

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
	tokens := tokensOf(kind)
	if tokens == nil {
		return nil, fmt.Errorf("unknown snapshot secret kind %q: %w", kind, ErrParameter)
	}
	nameKey, nsKey := SnapshotParamKeys(kind)
	src, err := secretTemplates(string(kind), params, nameKey, nsKey, "", "")
	if err != nil || src == nil {
		return nil, err
	}
	ns, err := expandSnapshotTemplate(tokens, src.nsTemplate, false, contentName, snap)
	if err != nil {
		return nil, fmt.Errorf("parameter %s: template %q: %w", src.nsKey, src.nsTemplate, err)
	}
	if errs := validation.IsDNS1123Label(ns); len(errs) > 0 {
		return nil, fmt.Errorf("parameter %s: %s, which is not a valid namespace name: %s: %w",
			src.nsKey, describeResolved(src.nsTemplate, ns), strings.Join(errs, "; "), ErrParameter)
	}
	name, err := expandSnapshotTemplate(tokens, src.nameTemplate, true, contentName, snap)
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
	tokenContentName  = "volumesnapshotcontent.name"
	tokenSnapshotName = "volumesnapshot.name"
	tokenSnapshotNS   = "volumesnapshot.namespace"
)

func expandSnapshotTemplate(tk *snapshotTokens, tpl string, forName bool, contentName string, snap *SnapshotObject) (string, error) {
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
		v, err := resolveSnapshotToken(tk, token, forName, contentName, snap)
		if err != nil {
			return "", err
		}
		b.WriteString(v)
	}
}

func resolveSnapshotToken(tk *snapshotTokens, token string, forName bool, contentName string, snap *SnapshotObject) (string, error) {
	noSnapshot := func() error {
		return fmt.Errorf("${%s} needs the %s, and there is none here (only ${%s} resolves): %w", token, tk.object, tk.content, ErrParameter)
	}
	switch token {
	case tk.content:
		return contentName, nil
	case tk.namespace:
		if snap == nil {
			return "", noSnapshot()
		}
		return snap.Namespace, nil
	case tk.name:
		if !forName {
			return "", fmt.Errorf("${%s} is not allowed here: a secret namespace may use only ${%s} and ${%s}: the snapshot's name is set by its creator, who must not choose where secrets are read from: %w",
				token, tk.content, tk.namespace, ErrParameter)
		}
		if snap == nil {
			return "", noSnapshot()
		}
		return snap.Name, nil
	}
	allowed := "${" + tk.content + "}, ${" + tk.namespace + "}"
	if forName {
		allowed += ", ${" + tk.name + "}"
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
