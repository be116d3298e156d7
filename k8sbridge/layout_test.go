package k8sbridge

import (
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

const module = "github.com/csibroker/csibroker/k8sbridge"

// controllerPackages are the folders of k8sbridge that hold a controller.
// Every other folder is shared plumbing (internal/...) or a pure package
// (topology, csiparams, secrets, intent) or stands apart (grants,
// discovery); a new folder must be named here or in notController.
var controllerPackages = []string{"attach", "capacity", "groupsnapshot", "health", "modify", "provision", "resize", "snapshot"}

// notController are the folders that hold no controller.
var notController = []string{"csiparams", "discovery", "grants", "intent", "internal", "secrets", "shard", "topology"}

// TestControllersImportNoController reads the imports of every Go file
// (tests included) under each controller package and fails if one imports
// another controller package, or k8sbridge itself: controllers share only
// the plumbing below them. It also fails on a folder it does not know, so
// that a new controller is held to the rule from its first commit.
func TestControllersImportNoController(t *testing.T) {
	entries, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if !e.IsDir() || strings.HasPrefix(e.Name(), ".") || e.Name() == "testdata" {
			continue
		}
		if !slices.Contains(controllerPackages, e.Name()) && !slices.Contains(notController, e.Name()) {
			t.Errorf("folder k8sbridge/%s is neither a controller nor plumbing: name it in controllerPackages or notController (layout_test.go)", e.Name())
		}
	}
	for _, pkg := range controllerPackages {
		files, err := filepath.Glob(filepath.Join(pkg, "*.go"))
		if err != nil {
			t.Fatal(err)
		}
		if len(files) == 0 {
			t.Errorf("controller package k8sbridge/%s has no Go files", pkg)
		}
		for _, f := range files {
			for _, imp := range importsOf(t, f) {
				if imp == module {
					t.Errorf("%s imports k8sbridge: a controller must not reach back into its caller", f)
					continue
				}
				rest, ok := strings.CutPrefix(imp, module+"/")
				if !ok {
					continue
				}
				if other, _, _ := strings.Cut(rest, "/"); other != pkg && slices.Contains(controllerPackages, other) {
					t.Errorf("%s imports controller package k8sbridge/%s: controllers never import each other (move what they share to k8sbridge/internal/kube)", f, other)
				}
			}
		}
	}
}

// TestPlumbingImportsNoController: the shared and pure packages sit below
// the controllers, so none of them may import one (or k8sbridge).
func TestPlumbingImportsNoController(t *testing.T) {
	for _, dir := range notController {
		err := filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") {
				return err
			}
			for _, imp := range importsOf(t, path) {
				rest, ok := strings.CutPrefix(imp, module+"/")
				if imp == module {
					t.Errorf("%s imports k8sbridge", path)
				} else if top, _, _ := strings.Cut(rest, "/"); ok && slices.Contains(controllerPackages, top) {
					t.Errorf("%s imports controller package k8sbridge/%s", path, top)
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
}

// importsOf is the import paths of the Go file path.
func importsOf(t *testing.T, path string) []string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.ImportsOnly)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, is := range f.Imports {
		p, err := strconv.Unquote(is.Path.Value)
		if err != nil {
			t.Fatalf("%s: import %s: %v", path, is.Path.Value, err)
		}
		out = append(out, p)
	}
	return out
}
