package testenv

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"sigs.k8s.io/yaml"
)

// The snapshot side of a cluster: external-snapshotter's CRDs, its
// snapshot-controller and its csi-snapshotter sidecar, the reference
// behaviour csibroker's snapshot controller is compared against.

// SnapshotterVersion is the external-snapshotter release whose
// snapshot-controller and csi-snapshotter hack/sidecars.sh builds.
const SnapshotterVersion = "v8.7.0"

// SnapshotClientModule is external-snapshotter's client module, whose
// config/crd holds the CRDs (the go.mod version's; v8.6.0 is what
// SnapshotterVersion's binaries are built with).
const SnapshotClientModule = "github.com/kubernetes-csi/external-snapshotter/client/v8"

// GroupSnapshotVersion is the groupsnapshot.storage.k8s.io version
// snapshot-controller and csi-snapshotter v8.7.0 use (the CRDs also serve
// v1beta1 and v1beta2, and store v1beta2).
const GroupSnapshotVersion = "v1"

// SnapshotCRDs are the CRDs InstallSnapshotCRDs installs, as group and
// plural resource.
var SnapshotCRDs = []schema.GroupResource{
	{Group: "snapshot.storage.k8s.io", Resource: "volumesnapshotclasses"},
	{Group: "snapshot.storage.k8s.io", Resource: "volumesnapshotcontents"},
	{Group: "snapshot.storage.k8s.io", Resource: "volumesnapshots"},
	{Group: "groupsnapshot.storage.k8s.io", Resource: "volumegroupsnapshotclasses"},
	{Group: "groupsnapshot.storage.k8s.io", Resource: "volumegroupsnapshotcontents"},
	{Group: "groupsnapshot.storage.k8s.io", Resource: "volumegroupsnapshots"},
}

var crdResource = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// SnapshotCRDDir is config/crd of SnapshotClientModule at the version this
// module's go.mod requires, in the Go module cache.
func SnapshotCRDDir() (string, error) {
	cmd := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", SnapshotClientModule)
	cmd.Dir = moduleRoot()
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("testenv: locate %s: %w: %s", SnapshotClientModule, err, strings.TrimSpace(stderr.String()))
	}
	dir := strings.TrimSpace(string(out))
	if dir == "" {
		return "", fmt.Errorf("testenv: %s is not in the module cache: run go mod download %s", SnapshotClientModule, SnapshotClientModule)
	}
	return filepath.Join(dir, "config", "crd"), nil
}

// InstallSnapshotCRDs installs the six CRDs of SnapshotClientModule
// (snapshots and group snapshots: classes, contents and the namespaced
// objects) and waits until each is established and every version it
// serves can be listed. CRDs already there are left as they are, so it
// can run once per test on a shared control plane.
func (e *Env) InstallSnapshotCRDs(ctx context.Context) error {
	dir, err := SnapshotCRDDir()
	if err != nil {
		return err
	}
	dyn, err := dynamic.NewForConfig(e.RESTConfig())
	if err != nil {
		return err
	}
	for _, gr := range SnapshotCRDs {
		crd, err := readCRD(filepath.Join(dir, gr.Group+"_"+gr.Resource+".yaml"))
		if err != nil {
			return err
		}
		if _, err := dyn.Resource(crdResource).Create(ctx, crd, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("testenv: create CRD %s: %w", crd.GetName(), err)
		}
	}
	for _, gr := range SnapshotCRDs {
		if err := waitCRD(ctx, dyn, gr); err != nil {
			return err
		}
	}
	return nil
}

func readCRD(path string) (*unstructured.Unstructured, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("testenv: %w", err)
	}
	var obj map[string]any
	if err := yaml.Unmarshal(bytes.TrimPrefix(data, []byte("---\n")), &obj); err != nil {
		return nil, fmt.Errorf("testenv: parse %s: %w", path, err)
	}
	return &unstructured.Unstructured{Object: obj}, nil
}

// waitCRD waits until CRD gr is established and each served version lists.
func waitCRD(ctx context.Context, dyn dynamic.Interface, gr schema.GroupResource) error {
	name := gr.Resource + "." + gr.Group
	return WaitFor(ctx, 30*time.Second, "CRD "+name+" established and served", func(ctx context.Context) (bool, string, error) {
		crd, err := dyn.Resource(crdResource).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		if !crdEstablished(crd) {
			conds, _, _ := unstructured.NestedSlice(crd.Object, "status", "conditions")
			return false, fmt.Sprintf("conditions %v", conds), nil
		}
		for _, v := range servedVersions(crd) {
			gvr := gr.WithVersion(v)
			if _, err := dyn.Resource(gvr).List(ctx, metav1.ListOptions{Limit: 1}); err != nil {
				return false, fmt.Sprintf("established; list %s: %v", gvr, err), nil
			}
		}
		return true, "", nil
	})
}

func crdEstablished(crd *unstructured.Unstructured) bool {
	conds, _, _ := unstructured.NestedSlice(crd.Object, "status", "conditions")
	for _, c := range conds {
		if m, ok := c.(map[string]any); ok && m["type"] == "Established" && m["status"] == "True" {
			return true
		}
	}
	return false
}

func servedVersions(crd *unstructured.Unstructured) []string {
	vs, _, _ := unstructured.NestedSlice(crd.Object, "spec", "versions")
	var out []string
	for _, v := range vs {
		if m, ok := v.(map[string]any); ok && m["served"] == true {
			if name, ok := m["name"].(string); ok {
				out = append(out, name)
			}
		}
	}
	return out
}

// SidecarDir is where hack/sidecars.sh keeps sidecar name at version:
// ${CSIBROKER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/csibroker}/sidecars/<name>-<version>.
func SidecarDir(name, version string) string {
	return filepath.Join(cacheRoot(), "sidecars", name+"-"+version)
}

// sidecarBin returns the path of a sidecar built by hack/sidecars.sh, or
// an error saying how to build it.
func sidecarBin(name, version string) (string, error) {
	bin := filepath.Join(SidecarDir(name, version), name)
	st, err := os.Stat(bin)
	if err == nil && !st.IsDir() && st.Mode()&0o111 != 0 {
		return bin, nil
	}
	return "", fmt.Errorf("testenv: %s %s not found at %s: run hack/sidecars.sh build (or make sidecars) to build it from the Go module proxy "+
		"(about 5 minutes the first time on 2 cores for csi-snapshotter, seconds for snapshot-controller after it; cached after)", name, version, bin)
}

// errNoEndpoint: a started process never answered on its HTTP endpoint.
var errNoEndpoint = errors.New("did not serve its HTTP endpoint")
