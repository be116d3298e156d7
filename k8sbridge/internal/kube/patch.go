package kube

import (
	"encoding/json"
	"errors"

	jsonpatch "gopkg.in/evanphx/json-patch.v4"
	"k8s.io/apimachinery/pkg/util/strategicpatch"
)

// TwoWayPatch is the strategic merge patch that turns old into cur (schema
// is an empty value of their type), nil when cur changes nothing. With rv
// set it carries that resourceVersion, so the write fails with a conflict
// if the object changed since, as an Update of the whole object would; but
// unlike such an Update it leaves alone the fields it does not change,
// including those of a newer API server that this build's types do not
// know (an Update would drop them).
func TwoWayPatch(old, cur, schema any, rv string) ([]byte, error) {
	oldJSON, curJSON, err := marshalPair(old, cur)
	if err != nil {
		return nil, err
	}
	patch, err := strategicpatch.CreateTwoWayMergePatch(oldJSON, curJSON, schema)
	if err != nil {
		return nil, err
	}
	return withResourceVersion(patch, rv)
}

// MergePatch is twoWayPatch as a JSON merge patch (RFC 7386), for objects
// whose maps hold keys from outside the cluster (a driver's publish context
// becomes a VolumeAttachment's attachmentMetadata, and a strategic merge
// patch would read a key spelt like a directive as one: "$patch": "delete"
// drops the whole map) and for custom resources (VolumeSnapshots), which
// take no strategic merge patch. A merge patch replaces lists whole, so it always
// carries rv: the write fails if the object changed since it was read.
func MergePatch(old, cur any, rv string) ([]byte, error) {
	if rv == "" {
		return nil, errors.New("a merge patch needs the resourceVersion it was made from")
	}
	oldJSON, curJSON, err := marshalPair(old, cur)
	if err != nil {
		return nil, err
	}
	patch, err := jsonpatch.CreateMergePatch(oldJSON, curJSON)
	if err != nil {
		return nil, err
	}
	return withResourceVersion(patch, rv)
}

func marshalPair(old, cur any) ([]byte, []byte, error) {
	oldJSON, err := json.Marshal(old)
	if err != nil {
		return nil, nil, err
	}
	curJSON, err := json.Marshal(cur)
	return oldJSON, curJSON, err
}

// withResourceVersion is patch with metadata.resourceVersion rv (none for
// ""), nil when patch changes nothing.
func withResourceVersion(patch []byte, rv string) ([]byte, error) {
	if string(patch) == "{}" {
		return nil, nil
	}
	if rv == "" {
		return patch, nil
	}
	var m map[string]any
	if err := json.Unmarshal(patch, &m); err != nil {
		return nil, err
	}
	meta, _ := m["metadata"].(map[string]any)
	if meta == nil {
		meta = map[string]any{}
		m["metadata"] = meta
	}
	meta["resourceVersion"] = rv
	return json.Marshal(m)
}
