package deploy

import (
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// Every kustomization builds with kustomize's default (root-only) load
// restrictions and yields what an admin expects from it.
func TestKustomizeBuild(t *testing.T) {
	want := map[string][]struct{ kind, namespace, name string }{
		".": {
			{"CustomResourceDefinition", "", "secretgrants.policy.csibroker.io"},
			{"Namespace", "", brokerNamespace},
			{"Deployment", brokerNamespace, "csibroker"},
			{"Issuer", brokerNamespace, "csibroker-ca"},
			{"Certificate", brokerNamespace, "csibroker-broker"},
		},
		"base": {
			{"Namespace", "", brokerNamespace},
			{"ServiceAccount", brokerNamespace, "csibroker"},
			{"ClusterRole", "", "csibroker"},
			{"ClusterRoleBinding", "", "csibroker"},
			{"Role", brokerNamespace, "csibroker"},
			{"RoleBinding", brokerNamespace, "csibroker"},
			{"Deployment", brokerNamespace, "csibroker"},
			{"PodDisruptionBudget", brokerNamespace, "csibroker"},
			{"Service", brokerNamespace, "csibroker-metrics"},
		},
		"cert-manager": {
			{"Issuer", brokerNamespace, "csibroker-selfsigned"},
			{"Certificate", brokerNamespace, "csibroker-ca"},
			{"Issuer", brokerNamespace, "csibroker-ca"},
			{"Certificate", brokerNamespace, "csibroker-broker"},
		},
		"examples": {
			{"CSIDriver", "", sampleDriver},
			{"Certificate", brokerNamespace, "sample-csibroker-io-proxy"},
			{"Deployment", brokerNamespace, "sample-csi-controller"},
			{"DaemonSet", "sample-csi", "sample-csi-node"},
			{"StorageClass", "", "csibroker-sample"},
			{"Secret", "sample-storage", "sample-provisioner-creds"},
			{"SecretGrant", "sample-storage", "sample-provisioner"},
			{"PersistentVolumeClaim", "sample-app", "data"},
		},
		"per-driver": {
			{"Deployment", brokerNamespace, "csibroker"},
			{"Role", brokerNamespace, "csibroker"},
			{"Role", brokerNamespace, "csibroker-per-driver"},
			{"RoleBinding", brokerNamespace, "csibroker-per-driver"},
		},
		"monitoring": {
			{"ServiceMonitor", brokerNamespace, "csibroker"},
			{"PodMonitor", brokerNamespace, "csibroker-proxies"},
			{"PrometheusRule", brokerNamespace, "csibroker"},
			{"ConfigMap", brokerNamespace, "csibroker-grafana-dashboard"},
		},
	}
	for _, dir := range kustomizations {
		t.Run(dir, func(t *testing.T) {
			objs := build(t, dir)
			if len(objs) == 0 {
				t.Fatal("no objects")
			}
			for _, o := range objs {
				if o.GetAPIVersion() == "" || o.GetKind() == "" || o.GetName() == "" {
					t.Errorf("object without apiVersion, kind or name: %v", o.Object)
				}
			}
			for _, w := range want[dir] {
				find(t, objs, w.kind, w.namespace, w.name)
			}
			t.Logf("deploy/%s: %d objects: %s", dir, len(objs), describeAll(objs))
		})
	}

	t.Run("registry ConfigMap is generated", func(t *testing.T) {
		var names []string
		for _, cm := range ofKind(build(t, "base"), "ConfigMap") {
			names = append(names, cm.GetName())
		}
		if len(names) != 1 || !strings.HasPrefix(names[0], "csibroker-registry-") {
			t.Fatalf("want one generated csibroker-registry-<hash> ConfigMap, got %v", names)
		}
	})
}

// No manifest is left out: every YAML file under deploy/ (but the CRD
// directory, which deploy/kustomization.yaml references, and the standalone
// registry example) is a resource or generator input of some kustomization.
func TestEveryManifestIsInAKustomization(t *testing.T) {
	root := deployDir(t, "")
	listed := map[string]bool{}
	var walk func(dir string)
	walk = func(dir string) {
		data, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		var k struct {
			Resources          []string `json:"resources"`
			ConfigMapGenerator []struct {
				Files []string `json:"files"`
			} `json:"configMapGenerator"`
		}
		if err := yaml.Unmarshal(data, &k); err != nil {
			t.Fatalf("%s/kustomization.yaml: %v", dir, err)
		}
		for _, r := range k.Resources {
			p := filepath.Clean(filepath.Join(dir, r))
			listed[p] = true
			if st, err := os.Stat(p); err == nil && st.IsDir() {
				walk(p)
			}
		}
		for _, g := range k.ConfigMapGenerator {
			for _, f := range g.Files {
				if i := strings.IndexByte(f, '='); i >= 0 {
					f = f[i+1:]
				}
				listed[filepath.Clean(filepath.Join(dir, f))] = true
			}
		}
	}
	for _, dir := range kustomizations {
		walk(filepath.Join(root, dir))
	}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			if rel == "crds" {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".yaml") || d.Name() == "kustomization.yaml" || rel == filepath.Join("examples", "registry.yaml") {
			return nil
		}
		if !listed[path] {
			t.Errorf("deploy/%s is in no kustomization", rel)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
