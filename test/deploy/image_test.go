package deploy

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// kustomizationImages reads the images entries of deploy/<dir>.
func kustomizationImages(t *testing.T, dir string) map[string]string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(deployDir(t, dir), "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var k struct {
		Images []struct {
			Name    string `json:"name"`
			NewName string `json:"newName"`
			NewTag  string `json:"newTag"`
			Digest  string `json:"digest"`
		} `json:"images"`
	}
	if err := yaml.Unmarshal(data, &k); err != nil {
		t.Fatalf("deploy/%s/kustomization.yaml: %v", dir, err)
	}
	out := map[string]string{}
	for _, i := range k.Images {
		name := i.Name
		if i.NewName != "" {
			name = i.NewName
		}
		switch {
		case i.Digest != "":
			out[i.Name] = name + "@" + i.Digest
		case i.NewTag != "":
			out[i.Name] = name + ":" + i.NewTag
		default:
			out[i.Name] = name
		}
	}
	return out
}

var imageLineRE = regexp.MustCompile(`(?m)^\s*(?:-\s*)?image:\s*"?([^"\s#]+)`)

// The csibroker image is named in one way everywhere: "csibroker" without
// a tag in the manifests, and the same images entry in deploy/base and
// deploy/examples, so that an overlay's entry for "csibroker" points the
// broker, the proxies and the sample driver at one build.
func TestImageIsSetByKustomization(t *testing.T) {
	base, examples := kustomizationImages(t, "base")["csibroker"], kustomizationImages(t, "examples")["csibroker"]
	if base != image || examples != image {
		t.Errorf("images entries for csibroker: deploy/base %q, deploy/examples %q; want both %q", base, examples, image)
	}
	root := deployDir(t, "")
	err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".yaml") {
			return err
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		for _, m := range imageLineRE.FindAllStringSubmatch(string(data), -1) {
			ref := m[1]
			name := ref
			if i := strings.LastIndexByte(name, '/'); i >= 0 {
				name = name[i+1:]
			}
			if n, _, _ := strings.Cut(strings.SplitN(name, "@", 2)[0], ":"); n == "csibroker" && ref != "csibroker" {
				t.Errorf("deploy/%s: image %q: write csibroker (the kustomization's images entry sets the tag)", rel, ref)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// The Dockerfile builds with the Go version go.mod requires (its toolchain
// line, else its go line), not whatever a floating tag holds that day.
func TestDockerfileGoVersion(t *testing.T) {
	read := func(name string) string {
		data, err := os.ReadFile(filepath.Join(repoRoot(t), name))
		if err != nil {
			t.Fatal(err)
		}
		return string(data)
	}
	mod := read("go.mod")
	want := ""
	if m := regexp.MustCompile(`(?m)^go\s+(\S+)`).FindStringSubmatch(mod); m != nil {
		want = m[1]
	}
	if m := regexp.MustCompile(`(?m)^toolchain\s+go(\S+)`).FindStringSubmatch(mod); m != nil {
		want = m[1]
	}
	if strings.Count(want, ".") != 2 {
		t.Fatalf("go.mod names Go %q: want a release such as 1.26.8", want)
	}
	m := regexp.MustCompile(`(?m)^FROM\s+golang:(\S+)`).FindStringSubmatch(read("Dockerfile"))
	if m == nil {
		t.Fatal("Dockerfile: no FROM golang:<version> build stage")
	}
	if tag := m[1]; tag != want && !strings.HasPrefix(tag, want+"-") && !strings.HasPrefix(tag, want+"@") {
		t.Errorf("Dockerfile builds with golang:%s; go.mod requires Go %s", tag, want)
	}
}
