package deploy

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"

	"github.com/csibroker/csibroker/internal/testenv"
)

// The API server allows privileged containers, as every cluster that runs
// CSI node plugins does (kubeadm's default); Pod Security admission still
// keeps them out of namespaces that do not allow them.
func TestMain(m *testing.M) {
	testenv.Main(m, testenv.Options{APIServerFlags: []string{"--allow-privileged=true"}})
}

// kustomizations are the directories under deploy/ that an admin builds.
var kustomizations = []string{".", "base", "cert-manager", "examples", "monitoring", "per-driver"}

// Names shared by the manifests and the assertions.
const (
	brokerNamespace = "csibroker"
	trustDomain     = "csibroker.local"
	sampleDriver    = "sample.csibroker.io"
	// proxySelector is the broker's --discover-proxies: csibroker's own
	// key, so that the label can be added to a driver's pod template
	// without touching its workload's (immutable) selector.
	proxySelector = "csibroker.io/proxy=true"
	// image is the csibroker image every kustomization's containers run:
	// "csibroker" in the manifests, tagged by their images entries.
	image = "csibroker:latest"
)

// repoRoot is the module root (the directory holding go.mod).
func repoRoot(t testing.TB) string {
	t.Helper()
	dir, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "go.mod")); err != nil {
		t.Fatalf("module root not found at %s: %v", dir, err)
	}
	return dir
}

func deployDir(t testing.TB, sub string) string {
	return filepath.Join(repoRoot(t), "deploy", sub)
}

var builds struct {
	sync.Mutex
	out map[string][]*unstructured.Unstructured
}

// build runs kustomize on deploy/<dir> in-process, with the default options
// (load restrictions: files only from within the kustomization's root, no
// plugins), as `kubectl apply -k` and `kustomize build` do. The result is
// cached; callers must not modify it (use DeepCopy).
func build(t testing.TB, dir string) []*unstructured.Unstructured {
	t.Helper()
	builds.Lock()
	defer builds.Unlock()
	if objs, ok := builds.out[dir]; ok {
		return objs
	}
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	resMap, err := k.Run(filesys.MakeFsOnDisk(), deployDir(t, dir))
	if err != nil {
		t.Fatalf("kustomize build deploy/%s: %v", dir, err)
	}
	var objs []*unstructured.Unstructured
	for _, r := range resMap.Resources() {
		js, err := r.MarshalJSON()
		if err != nil {
			t.Fatalf("kustomize build deploy/%s: %s: %v", dir, r.CurId(), err)
		}
		u, err := decodeJSON(js)
		if err != nil {
			t.Fatalf("kustomize build deploy/%s: %s: %v", dir, r.CurId(), err)
		}
		objs = append(objs, u...)
	}
	if builds.out == nil {
		builds.out = map[string][]*unstructured.Unstructured{}
	}
	builds.out[dir] = objs
	return objs
}

// decodeJSON decodes one object, or the items of a List, keeping integers as
// int64 as the API machinery does.
func decodeJSON(js []byte) ([]*unstructured.Unstructured, error) {
	obj, _, err := unstructured.UnstructuredJSONScheme.Decode(js, nil, nil)
	if err != nil {
		return nil, err
	}
	switch o := obj.(type) {
	case *unstructured.Unstructured:
		return []*unstructured.Unstructured{o}, nil
	case *unstructured.UnstructuredList:
		var out []*unstructured.Unstructured
		for i := range o.Items {
			out = append(out, &o.Items[i])
		}
		return out, nil
	}
	return nil, fmt.Errorf("unexpected object %T", obj)
}

// readYAMLObjects reads every object of a multi-document YAML file (Lists
// are expanded); empty documents are skipped.
func readYAMLObjects(t testing.TB, path string) []*unstructured.Unstructured {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var out []*unstructured.Unstructured
	for i := 1; ; i++ {
		doc, err := r.Read()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("%s: document %d: %v", path, i, err)
		}
		js, err := yaml.YAMLToJSON(doc)
		if err != nil {
			t.Fatalf("%s: document %d: %v", path, i, err)
		}
		if s := strings.TrimSpace(string(js)); s == "null" || s == "" {
			continue
		}
		objs, err := decodeJSON(js)
		if err != nil {
			t.Fatalf("%s: document %d: %v", path, i, err)
		}
		out = append(out, objs...)
	}
	return out
}

// find returns the one object of kind and name (and namespace, unless
// empty), failing the test when there is not exactly one.
func find(t testing.TB, objs []*unstructured.Unstructured, kind, namespace, name string) *unstructured.Unstructured {
	t.Helper()
	var found []*unstructured.Unstructured
	for _, o := range objs {
		if o.GetKind() == kind && o.GetName() == name && (namespace == "" || o.GetNamespace() == namespace) {
			found = append(found, o)
		}
	}
	if len(found) != 1 {
		t.Fatalf("want exactly one %s %s/%s, found %d (objects: %s)", kind, namespace, name, len(found), describeAll(objs))
	}
	return found[0]
}

func ofKind(objs []*unstructured.Unstructured, kind string) []*unstructured.Unstructured {
	var out []*unstructured.Unstructured
	for _, o := range objs {
		if o.GetKind() == kind {
			out = append(out, o)
		}
	}
	return out
}

// typed converts an object into a typed API struct.
func typed[T any](t testing.TB, u *unstructured.Unstructured) *T {
	t.Helper()
	var out T
	if err := runtime.DefaultUnstructuredConverter.FromUnstructuredWithValidation(u.Object, &out, true); err != nil {
		t.Fatalf("%s: %v", describe(u), err)
	}
	return &out
}

func describe(u *unstructured.Unstructured) string {
	if u.GetNamespace() != "" {
		return fmt.Sprintf("%s %s/%s", u.GetKind(), u.GetNamespace(), u.GetName())
	}
	return fmt.Sprintf("%s %s", u.GetKind(), u.GetName())
}

func describeAll(objs []*unstructured.Unstructured) string {
	var s []string
	for _, o := range objs {
		s = append(s, describe(o))
	}
	sort.Strings(s)
	return strings.Join(s, ", ")
}
