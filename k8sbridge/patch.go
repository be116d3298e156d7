package k8sbridge

import (
	"encoding/json"

	"k8s.io/apimachinery/pkg/util/strategicpatch"
)

// twoWayPatch is the strategic merge patch that turns old into cur (schema
// is an empty value of their type), nil when cur changes nothing. With rv
// set it carries that resourceVersion, so the write fails with a conflict
// if the object changed since, as an Update of the whole object would; but
// unlike such an Update it leaves alone the fields it does not change,
// including those of a newer API server that this build's types do not
// know (an Update would drop them).
func twoWayPatch(old, cur, schema any, rv string) ([]byte, error) {
	oldJSON, err := json.Marshal(old)
	if err != nil {
		return nil, err
	}
	curJSON, err := json.Marshal(cur)
	if err != nil {
		return nil, err
	}
	patch, err := strategicpatch.CreateTwoWayMergePatch(oldJSON, curJSON, schema)
	if err != nil {
		return nil, err
	}
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
