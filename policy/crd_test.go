package policy

import (
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/csibroker/csibroker/internal/csiname"
)

// The CRD manifest and the Go types must agree: a controller converts the
// unstructured spec into GrantSpec by JSON name.

type schema struct {
	Type                 string             `yaml:"type"`
	Required             []string           `yaml:"required"`
	Properties           map[string]*schema `yaml:"properties"`
	Items                *schema            `yaml:"items"`
	AdditionalProperties *schema            `yaml:"additionalProperties"`
	Enum                 []string           `yaml:"enum"`
	Pattern              string             `yaml:"pattern"`
	MaxLength            int                `yaml:"maxLength"`
	MinItems             int                `yaml:"minItems"`
}

type crd struct {
	Spec struct {
		Group string `yaml:"group"`
		Scope string `yaml:"scope"`
		Names struct {
			Kind     string `yaml:"kind"`
			ListKind string `yaml:"listKind"`
			Plural   string `yaml:"plural"`
		} `yaml:"names"`
		Versions []struct {
			Name         string            `yaml:"name"`
			Subresources map[string]any    `yaml:"subresources"`
			Columns      []map[string]any  `yaml:"additionalPrinterColumns"`
			Schema       map[string]schema `yaml:"schema"`
		} `yaml:"versions"`
	} `yaml:"spec"`
}

func loadCRD(t *testing.T) *crd {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("..", "deploy", "crds", "policy.csibroker.io_secretgrants.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var c crd
	if err := yaml.Unmarshal(data, &c); err != nil {
		t.Fatal(err)
	}
	return &c
}

// jsonFields returns a struct type's JSON field names and which are required
// (no omitempty).
func jsonFields(t reflect.Type) (names, required []string) {
	for f := range t.Fields() {
		tag := f.Tag.Get("json")
		name, opts, _ := strings.Cut(tag, ",")
		names = append(names, name)
		if !strings.Contains(opts, "omitempty") {
			required = append(required, name)
		}
	}
	slices.Sort(names)
	slices.Sort(required)
	return names, required
}

func propNames(s *schema) []string {
	var out []string
	for k := range s.Properties {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func TestCRDMatchesGoTypes(t *testing.T) {
	c := loadCRD(t)
	s := c.Spec
	if s.Group != APIGroup || s.Scope != "Namespaced" || s.Names.Kind != Kind || s.Names.ListKind != ListKind || s.Names.Plural != Resource {
		t.Fatalf("group/names: %+v", s)
	}
	if len(s.Versions) != 1 || APIGroup+"/"+s.Versions[0].Name != APIVersion {
		t.Fatalf("versions: %+v", s.Versions)
	}
	v := s.Versions[0]
	if _, ok := v.Subresources["status"]; !ok {
		t.Error("no status subresource")
	}
	var cols []string
	for _, col := range v.Columns {
		cols = append(cols, col["name"].(string))
	}
	for _, want := range []string{"Drivers", "Operations", "Valid", "Ready", "Age"} {
		if !slices.Contains(cols, want) {
			t.Errorf("printer columns %v lack %s", cols, want)
		}
	}
	root := v.Schema["openAPIV3Schema"]
	specSchema := root.Properties["spec"]

	for _, tc := range []struct {
		path  string
		s     *schema
		typ   reflect.Type
		check bool // compare required
	}{
		{"spec", specSchema, reflect.TypeFor[GrantSpec](), true},
		{"spec.requesters", specSchema.Properties["requesters"], reflect.TypeFor[Requesters](), true},
		{"spec.requesters.namespaceSelector", specSchema.Properties["requesters"].Properties["namespaceSelector"], reflect.TypeFor[LabelSelector](), true},
		{"matchExpressions[]", specSchema.Properties["requesters"].Properties["namespaceSelector"].Properties["matchExpressions"].Items, reflect.TypeFor[LabelSelectorRequirement](), true},
	} {
		names, required := jsonFields(tc.typ)
		if got := propNames(tc.s); !slices.Equal(got, names) {
			t.Errorf("%s: CRD properties %v, Go JSON fields %v", tc.path, got, names)
		}
		req := slices.Clone(tc.s.Required)
		slices.Sort(req)
		if tc.check && !slices.Equal(req, required) {
			t.Errorf("%s: CRD required %v, Go non-omitempty fields %v", tc.path, req, required)
		}
	}

	ops := []string{"*"}
	for _, o := range knownOperations {
		ops = append(ops, string(o))
	}
	if got := specSchema.Properties["operations"].Items.Enum; !slices.Equal(got, ops) {
		t.Errorf("operations enum %v, want %v", got, ops)
	}
	if got := specSchema.Properties["action"].Enum; !slices.Equal(got, []string{string(ActionAllow), string(ActionDeny)}) {
		t.Errorf("action enum %v", got)
	}
	opEnum := specSchema.Properties["requesters"].Properties["namespaceSelector"].Properties["matchExpressions"].Items.Properties["operator"].Enum
	if !slices.Equal(opEnum, []string{"In", "NotIn", "Exists", "DoesNotExist"}) {
		t.Errorf("selector operator enum %v", opEnum)
	}
	if specSchema.Properties["condition"].MaxLength != MaxConditionLength {
		t.Errorf("condition maxLength %d, want %d", specSchema.Properties["condition"].MaxLength, MaxConditionLength)
	}
	for _, f := range []string{"drivers", "secretNames", "operations"} {
		if specSchema.Properties[f].MinItems != 1 {
			t.Errorf("%s: minItems %d, want 1", f, specSchema.Properties[f].MinItems)
		}
	}

	// The CRD's patterns reject no more than Compile accepts, and accept
	// nothing Compile rejects, on a set of samples.
	samples := []string{"*", "a", "A", "ab", "a.b-c", "nfs.csi.example.com", "-a", "a-", ".a", "a b", "a_b", "team-*", "x*", "*x", "a*b", "a**",
		"Team", "team-a", "a.", strings.Repeat("a", 63), strings.Repeat("a", 64), ""}
	for _, tc := range []struct {
		field string
		s     *schema
		ok    func(string) bool
	}{
		{"drivers", specSchema.Properties["drivers"].Items, func(x string) bool { return x == "*" || csiname.Valid(x) }},
		{"secretNames", specSchema.Properties["secretNames"].Items, func(x string) bool {
			if x == "*" {
				return true
			}
			if p, ok := strings.CutSuffix(x, "*"); ok {
				return dnsSubdomainPrefix(p)
			}
			return dnsSubdomain(x)
		}},
		{"requesters.namespaces", specSchema.Properties["requesters"].Properties["namespaces"].Items, func(x string) bool { return x == "*" || dnsLabel(x) }},
	} {
		re := regexp.MustCompile(tc.s.Pattern)
		for _, x := range samples {
			crdOK := re.MatchString(x) && len(x) <= tc.s.MaxLength && x != ""
			if crdOK != tc.ok(x) {
				t.Errorf("%s: %q: CRD accepts %v, Compile accepts %v", tc.field, x, crdOK, tc.ok(x))
			}
		}
	}
}
