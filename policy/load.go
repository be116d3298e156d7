package policy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"time"

	"go.yaml.in/yaml/v3"
	sigsjson "sigs.k8s.io/json"
)

// MaxPolicyFileSize bounds a grant file.
const MaxPolicyFileSize = 16 << 20

// ParseGrants reads SecretGrant objects, as kubectl would accept them, from
// YAML or JSON:
//
//   - one object (apiVersion policy.csibroker.io/v1alpha1, kind SecretGrant,
//     metadata {name, namespace}, spec);
//   - several YAML documents separated by "---", each an object or a list;
//   - a list of objects (a YAML sequence or JSON array), or a List /
//     SecretGrantList object with items (kubectl get -o yaml).
//
// Parsing is strict and all-or-nothing: malformed YAML or JSON, a wrong
// apiVersion or kind, or an unknown spec field fails the whole input, so a
// broken file never replaces working rules. Whether each grant makes sense
// is Compile's job, which reports it per grant. Empty documents are skipped.
func ParseGrants(data []byte) ([]Grant, error) {
	if len(data) > MaxPolicyFileSize {
		return nil, fmt.Errorf("policy input is %d bytes, more than %d", len(data), MaxPolicyFileSize)
	}
	docs, err := decodeDocuments(data)
	if err != nil {
		return nil, err
	}
	var grants []Grant
	for i, doc := range docs {
		where := fmt.Sprintf("document %d", i+1)
		if err := collectGrants(doc, where, &grants); err != nil {
			return nil, err
		}
	}
	return grants, nil
}

// LoadFile reads and parses a grant file (see ParseGrants).
func LoadFile(path string) ([]Grant, error) {
	data, err := ReadFile(path)
	if err != nil {
		return nil, err
	}
	return ParseFile(path, data)
}

// ReadFile reads a grant file, at most MaxPolicyFileSize+1 bytes of it
// (ParseFile refuses a file over the limit).
func ReadFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("load policy file: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxPolicyFileSize+1))
	if err != nil {
		return nil, fmt.Errorf("load policy file %s: %w", path, err)
	}
	return data, nil
}

// ParseFile parses the content of grant file path (see ParseGrants); a file
// with no document in it is an error.
func ParseFile(path string, data []byte) ([]Grant, error) {
	grants, err := ParseGrants(data)
	if err != nil {
		return nil, fmt.Errorf("load policy file %s: %w", path, err)
	}
	if len(grants) == 0 && !hasDocument(data) {
		// Most likely caught while being rewritten in place: dropping
		// every grant of the file (its Deny grants too) is not what its
		// writer meant.
		return nil, fmt.Errorf("load policy file %s: no YAML or JSON document in it (empty, or comments only); write [] for a file with no grants", path)
	}
	return grants, nil
}

// hasDocument reports whether data holds a document that is not empty.
func hasDocument(data []byte) bool {
	docs, err := decodeDocuments(data)
	if err != nil {
		return true // not empty: malformed, which ParseGrants reports
	}
	for _, d := range docs {
		if d != nil {
			return true
		}
	}
	return false
}

// LoadFile loads the grants of a file into the store, as its file source
// (see Store.UpdateSource: other sources keep their grants). On
// a read or parse error the store keeps its current rules and the error is
// returned; invalid grants in a well-formed file are returned as RuleErrors.
func (s *Store) LoadFile(path string, opts ...CompileOption) ([]RuleError, error) {
	grants, err := LoadFile(path)
	if err != nil {
		return nil, err
	}
	return s.UpdateSource(SourceFile, grants, opts...), nil
}

// LoadData is LoadFile with the file's content already read.
func (s *Store) LoadData(path string, data []byte, opts ...CompileOption) ([]RuleError, error) {
	grants, err := ParseFile(path, data)
	if err != nil {
		return nil, err
	}
	return s.UpdateSource(SourceFile, grants, opts...), nil
}

// decodeDocuments turns the input into JSON-shaped values, one per document.
func decodeDocuments(data []byte) ([]any, error) {
	trimmed := bytes.TrimSpace(data)
	if len(trimmed) > 0 && (trimmed[0] == '{' || trimmed[0] == '[') {
		dec := json.NewDecoder(bytes.NewReader(trimmed))
		dec.UseNumber()
		var v any
		if err := dec.Decode(&v); err == nil {
			if _, err := dec.Token(); err != io.EOF {
				return nil, errors.New("JSON input: trailing data after the first value")
			}
			// A key given twice in one object is refused, as the YAML
			// decoder and kubectl refuse it (encoding/json keeps the last:
			// "action": "Deny" then "Allow" would load an Allow grant).
			// That decoder refuses numbers encoding/json keeps (1e400 is
			// out of float64's range); its refusal is the file's, or a
			// duplicate after such a number would go by unseen.
			var probe any
			strictErrs, err := sigsjson.UnmarshalStrict(trimmed, &probe, sigsjson.DisallowDuplicateFields)
			if err != nil {
				return nil, fmt.Errorf("JSON input: %w", err)
			}
			if len(strictErrs) > 0 {
				return nil, fmt.Errorf("JSON input: %w", errors.Join(strictErrs...))
			}
			return []any{v}, nil
		}
		// Not JSON: YAML flow style perhaps; the YAML parser will say.
	}
	var docs []any
	dec := yaml.NewDecoder(bytes.NewReader(data))
	for i := 1; ; i++ {
		var v any
		err := dec.Decode(&v)
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("document %d: %w", i, err)
		}
		v, err = jsonShaped(v)
		if err != nil {
			return nil, fmt.Errorf("document %d: %w", i, err)
		}
		docs = append(docs, v)
	}
	return docs, nil
}

// jsonShaped converts what the YAML decoder produced into values that
// encoding/json can marshal (string map keys only).
func jsonShaped(v any) (any, error) {
	switch t := v.(type) {
	case map[string]any:
		for k, e := range t {
			c, err := jsonShaped(e)
			if err != nil {
				return nil, err
			}
			t[k] = c
		}
		return t, nil
	case map[any]any:
		m := make(map[string]any, len(t))
		for k, e := range t {
			ks, ok := k.(string)
			if !ok {
				return nil, fmt.Errorf("mapping key %v is not a string", k)
			}
			c, err := jsonShaped(e)
			if err != nil {
				return nil, err
			}
			m[ks] = c
		}
		return m, nil
	case []any:
		for i, e := range t {
			c, err := jsonShaped(e)
			if err != nil {
				return nil, err
			}
			t[i] = c
		}
		return t, nil
	case time.Time:
		return t.UTC().Format(time.RFC3339), nil
	default:
		return v, nil
	}
}

func collectGrants(v any, where string, out *[]Grant) error {
	switch t := v.(type) {
	case nil:
		return nil // empty document
	case []any:
		for i, item := range t {
			if err := collectObject(item, fmt.Sprintf("%s, item %d", where, i+1), out, false); err != nil {
				return err
			}
		}
		return nil
	default:
		return collectObject(v, where, out, true)
	}
}

func collectObject(v any, where string, out *[]Grant, listOK bool) error {
	obj, ok := v.(map[string]any)
	if !ok {
		return fmt.Errorf("%s: want a %s object, got %T", where, Kind, v)
	}
	kind, _ := obj["kind"].(string)
	if listOK && (kind == "List" || kind == ListKind) {
		items, ok := obj["items"].([]any)
		if !ok && obj["items"] != nil {
			return fmt.Errorf("%s: %s items is not a list", where, kind)
		}
		for i, item := range items {
			if err := collectObject(item, fmt.Sprintf("%s, item %d", where, i+1), out, false); err != nil {
				return err
			}
		}
		return nil
	}
	g, err := grantFromObject(obj)
	if err != nil {
		return fmt.Errorf("%s: %w", where, err)
	}
	*out = append(*out, g)
	return nil
}

var objectFields = []string{"apiVersion", "kind", "metadata", "spec", "status"}

// grantFromObject reads one SecretGrant object.
func grantFromObject(obj map[string]any) (Grant, error) {
	for k := range obj {
		if !slices.Contains(objectFields, k) {
			return Grant{}, fmt.Errorf("unknown field %q in a %s object", k, Kind)
		}
	}
	if av, _ := obj["apiVersion"].(string); av != APIVersion {
		return Grant{}, fmt.Errorf("apiVersion %q: want %s", obj["apiVersion"], APIVersion)
	}
	if k, _ := obj["kind"].(string); k != Kind {
		return Grant{}, fmt.Errorf("kind %q: want %s", obj["kind"], Kind)
	}
	var meta struct {
		Name       string `json:"name"`
		Namespace  string `json:"namespace"`
		Generation int64  `json:"generation"`
	}
	if err := remarshal(obj["metadata"], &meta, false); err != nil {
		return Grant{}, fmt.Errorf("metadata: %w", err)
	}
	g := Grant{Namespace: meta.Namespace, Name: meta.Name, Generation: meta.Generation}
	if obj["spec"] == nil {
		return Grant{}, fmt.Errorf("%s %s/%s has no spec", Kind, g.Namespace, g.Name)
	}
	if err := remarshal(obj["spec"], &g.Spec, true); err != nil {
		return Grant{}, fmt.Errorf("%s %s/%s: spec: %w", Kind, g.Namespace, g.Name, err)
	}
	return g, nil
}

// remarshal decodes a JSON-shaped value into out through encoding/json, so
// the JSON tags (the CRD's field names) are what counts.
func remarshal(v any, out any, strict bool) error {
	if v == nil {
		return nil
	}
	if _, ok := v.(map[string]any); !ok {
		return fmt.Errorf("want an object, got %T", v)
	}
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	// Field names match case-sensitively, as the API server matches them
	// (encoding/json would take "Action" for "action", which kubectl
	// refuses).
	if !strict {
		return sigsjson.UnmarshalCaseSensitivePreserveInts(data, out)
	}
	strictErrs, err := sigsjson.UnmarshalStrict(data, out, sigsjson.DisallowUnknownFields)
	if err != nil {
		return err
	}
	return errors.Join(strictErrs...)
}
