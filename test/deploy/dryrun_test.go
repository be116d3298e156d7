package deploy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"

	"github.com/csibroker/csibroker/internal/testenv"
)

const fieldManager = "csibroker-deploy-test"

// Every wait of this package is bounded by this.
const waitTimeout = 60 * time.Second

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// warnings records the API server's warnings (deprecations, Pod Security
// violations, unknown fields...) per request.
type warnings struct {
	mu   sync.Mutex
	msgs []string
}

func (w *warnings) HandleWarningHeader(_ int, _ string, text string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.msgs = append(w.msgs, text)
}

func (w *warnings) take() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := w.msgs
	w.msgs = nil
	return out
}

// cluster is the shared control plane prepared for the manifests: the CRDs
// they need exist for real and are Established, their namespaces exist for
// real, and mapper knows every kind.
type cluster struct {
	dyn      dynamic.Interface
	mapper   meta.RESTMapper
	warnings *warnings
}

var prepared struct {
	sync.Mutex
	c   *cluster
	err error
}

// prepare sets the shared control plane up once per package run.
func prepare(t *testing.T) *cluster {
	t.Helper()
	env := testenv.Shared(t)
	prepared.Lock()
	defer prepared.Unlock()
	if prepared.c == nil && prepared.err == nil {
		prepared.c, prepared.err = doPrepare(t, env)
	}
	if prepared.err != nil {
		t.Fatal(prepared.err)
	}
	return prepared.c
}

func doPrepare(t *testing.T, env *testenv.Env) (*cluster, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*waitTimeout)
	defer cancel()
	w := &warnings{}
	cfg := rest.CopyConfig(env.RESTConfig())
	cfg.WarningHandler = w
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	disc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		return nil, err
	}

	// For real: the project's CRDs, and the stand-ins for cert-manager's and
	// the Prometheus Operator's.
	crds := projectCRDs(t)
	crds = append(crds, readYAMLObjects(t, filepath.Join("testdata", "cert-manager-crds.yaml"))...)
	crds = append(crds, readYAMLObjects(t, filepath.Join("testdata", "prometheus-operator-crds.yaml"))...)
	for _, crd := range crds {
		if err := apply(ctx, dyn.Resource(crdGVR), crd, false); err != nil {
			return nil, fmt.Errorf("create CRD %s: %w", crd.GetName(), err)
		}
	}
	for _, crd := range crds {
		name := crd.GetName()
		err := testenv.WaitFor(ctx, waitTimeout, "CRD "+name+" Established", func(ctx context.Context) (bool, string, error) {
			got, err := dyn.Resource(crdGVR).Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, err.Error(), nil
			}
			conds, _, _ := unstructured.NestedSlice(got.Object, "status", "conditions")
			for _, c := range conds {
				m, _ := c.(map[string]any)
				if m["type"] == "Established" {
					return m["status"] == "True", fmt.Sprintf("Established=%v: %v", m["status"], m["message"]), nil
				}
			}
			return false, "no Established condition yet", nil
		})
		if err != nil {
			return nil, err
		}
	}
	if ws := w.take(); len(ws) > 0 {
		return nil, fmt.Errorf("warnings while creating the CRDs: %q", ws)
	}

	// Discovery serves the new kinds a moment after they are Established.
	want := map[schema.GroupVersionKind]bool{}
	for _, dir := range kustomizations {
		for _, o := range build(t, dir) {
			want[o.GroupVersionKind()] = true
		}
	}
	var mapper meta.RESTMapper
	err = testenv.WaitFor(ctx, waitTimeout, "discovery to serve every kind deploy/ uses", func(context.Context) (bool, string, error) {
		groups, err := restmapper.GetAPIGroupResources(disc)
		if err != nil {
			return false, err.Error(), nil
		}
		m := restmapper.NewDiscoveryRESTMapper(groups)
		var missing []string
		for gvk := range want {
			if _, err := m.RESTMapping(gvk.GroupKind(), gvk.Version); err != nil {
				missing = append(missing, gvk.String())
			}
		}
		if len(missing) > 0 {
			sort.Strings(missing)
			return false, "not served: " + strings.Join(missing, ", "), nil
		}
		mapper = m
		return true, "", nil
	})
	if err != nil {
		return nil, err
	}

	// For real: the namespaces. A dry run in a namespace that does not exist
	// fails, and the Pod Security labels they carry take part in the checks.
	for _, ns := range declaredNamespaces(t) {
		if err := apply(ctx, dyn.Resource(schema.GroupVersionResource{Version: "v1", Resource: "namespaces"}), ns, false); err != nil {
			return nil, fmt.Errorf("create namespace %s: %w", ns.GetName(), err)
		}
	}
	if ws := w.take(); len(ws) > 0 {
		return nil, fmt.Errorf("warnings while creating the namespaces: %q", ws)
	}
	return &cluster{dyn: dyn, mapper: mapper, warnings: w}, nil
}

// projectCRDs are the CustomResourceDefinitions in deploy/crds (not its
// examples).
func projectCRDs(t testing.TB) []*unstructured.Unstructured {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(deployDir(t, "crds"), "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var out []*unstructured.Unstructured
	for _, f := range files {
		for _, o := range readYAMLObjects(t, f) {
			if o.GetKind() == "CustomResourceDefinition" {
				out = append(out, o)
			}
		}
	}
	if len(out) == 0 {
		t.Fatal("no CRD in deploy/crds")
	}
	return out
}

// declaredNamespaces are the Namespace objects of every kustomization.
func declaredNamespaces(t testing.TB) []*unstructured.Unstructured {
	seen := map[string]*unstructured.Unstructured{}
	for _, dir := range kustomizations {
		for _, o := range ofKind(build(t, dir), "Namespace") {
			seen[o.GetName()] = o
		}
	}
	var out []*unstructured.Unstructured
	for _, o := range seen {
		out = append(out, o)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].GetName() < out[j].GetName() })
	return out
}

// apply is a server-side apply with strict field validation: an unknown or
// duplicate field is an error, not a warning.
func apply(ctx context.Context, ri dynamic.ResourceInterface, obj *unstructured.Unstructured, dryRun bool) error {
	data, err := json.Marshal(obj.Object)
	if err != nil {
		return err
	}
	force := true
	opts := metav1.PatchOptions{FieldManager: fieldManager, Force: &force, FieldValidation: metav1.FieldValidationStrict}
	if dryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	_, err = ri.Patch(ctx, obj.GetName(), types.ApplyPatchType, data, opts)
	return err
}

// resource returns the client for obj, refusing a namespaced object that
// names no namespace (it would land in whatever namespace the applier's
// context has).
func (c *cluster) resource(obj *unstructured.Unstructured) (dynamic.ResourceInterface, error) {
	gvk := obj.GroupVersionKind()
	m, err := c.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		return nil, err
	}
	if m.Scope.Name() == meta.RESTScopeNameNamespace {
		if obj.GetNamespace() == "" {
			return nil, errors.New("namespaced object without a namespace")
		}
		return c.dyn.Resource(m.Resource).Namespace(obj.GetNamespace()), nil
	}
	if obj.GetNamespace() != "" {
		return nil, fmt.Errorf("cluster-scoped object with namespace %q", obj.GetNamespace())
	}
	return c.dyn.Resource(m.Resource), nil
}

// dryRun applies obj with a server-side dry run and returns the error and
// the warnings the API server sent.
func (c *cluster) dryRun(ctx context.Context, obj *unstructured.Unstructured) ([]string, error) {
	c.warnings.take()
	ri, err := c.resource(obj)
	if err != nil {
		return nil, err
	}
	err = apply(ctx, ri, obj, true)
	return c.warnings.take(), err
}

// Every object of every kustomization is accepted by the real kube-apiserver
// (admission, validation, CRD schemas and CEL rules, Pod Security warnings)
// in a strict server-side dry run; nothing but the CRDs and namespaces is
// created.
func TestServerSideDryRun(t *testing.T) {
	c := prepare(t)
	for _, dir := range kustomizations {
		t.Run(dir, func(t *testing.T) {
			for _, obj := range build(t, dir) {
				ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
				ws, err := c.dryRun(ctx, obj)
				cancel()
				if err != nil {
					t.Errorf("%s: %v", describe(obj), err)
				}
				if len(ws) > 0 {
					t.Errorf("%s: API server warnings: %q", describe(obj), ws)
				}
			}
		})
	}

	t.Run("every namespace used is declared", func(t *testing.T) {
		declared := map[string]bool{}
		for _, ns := range declaredNamespaces(t) {
			declared[ns.GetName()] = true
		}
		for _, dir := range kustomizations {
			for _, o := range build(t, dir) {
				if ns := o.GetNamespace(); ns != "" && !declared[ns] {
					t.Errorf("deploy/%s: %s is in namespace %q, which no kustomization creates", dir, describe(o), ns)
				}
			}
		}
	})

	// The checks above must be able to fail: a misspelt field, a field in the
	// wrong place of a custom resource, and a container that breaks the
	// namespace's Pod Security profile are each caught.
	t.Run("the dry run is strict", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()

		dep := find(t, build(t, "base"), "Deployment", brokerNamespace, "csibroker").DeepCopy()
		containers, _, _ := unstructured.NestedSlice(dep.Object, "spec", "template", "spec", "containers")
		containers[0].(map[string]any)["livenessProbes"] = containers[0].(map[string]any)["livenessProbe"]
		_ = unstructured.SetNestedSlice(dep.Object, containers, "spec", "template", "spec", "containers")
		if _, err := c.dryRun(ctx, dep); err == nil || !strings.Contains(err.Error(), "livenessProbes") {
			t.Errorf("a Deployment with a misspelt field: want an error naming it, got %v", err)
		}

		cert := find(t, build(t, "cert-manager"), "Certificate", brokerNamespace, "csibroker-broker").DeepCopy()
		uris, _, _ := unstructured.NestedStringSlice(cert.Object, "spec", "uris")
		unstructured.RemoveNestedField(cert.Object, "spec", "uris")
		_ = unstructured.SetNestedStringSlice(cert.Object, uris, "spec", "uri")
		if _, err := c.dryRun(ctx, cert); err == nil || !strings.Contains(err.Error(), "uri") {
			t.Errorf("a Certificate with spec.uri for spec.uris: want an error, got %v", err)
		}

		rule := find(t, build(t, "monitoring"), "PrometheusRule", brokerNamespace, "csibroker").DeepCopy()
		groups, _, _ := unstructured.NestedSlice(rule.Object, "spec", "groups")
		rules := groups[1].(map[string]any)["rules"].([]any)
		rules[0].(map[string]any)["for"] = "five minutes"
		_ = unstructured.SetNestedSlice(rule.Object, groups, "spec", "groups")
		if _, err := c.dryRun(ctx, rule); err == nil {
			t.Error("a PrometheusRule with for: \"five minutes\": want an error")
		}

		grant := find(t, build(t, "examples"), "SecretGrant", "sample-storage", "sample-provisioner").DeepCopy()
		unstructured.RemoveNestedField(grant.Object, "spec", "requesters", "namespaces")
		if _, err := c.dryRun(ctx, grant); err == nil {
			t.Error("a SecretGrant without requesters.namespaces or namespaceSelector: want the CRD's CEL rule to refuse it")
		}

		dep = find(t, build(t, "base"), "Deployment", brokerNamespace, "csibroker").DeepCopy()
		containers, _, _ = unstructured.NestedSlice(dep.Object, "spec", "template", "spec", "containers")
		unstructured.RemoveNestedField(containers[0].(map[string]any), "securityContext", "capabilities")
		_ = unstructured.SetNestedSlice(dep.Object, containers, "spec", "template", "spec", "containers")
		if ws, err := c.dryRun(ctx, dep); err != nil || len(ws) == 0 {
			t.Errorf("a broker keeping its capabilities: want a Pod Security warning from namespace %s, got error %v, warnings %q", brokerNamespace, err, ws)
		}
	})
}

// Manifests describe desired state only.
func TestObjectsCarryNoStatus(t *testing.T) {
	for _, dir := range kustomizations {
		for _, o := range build(t, dir) {
			if _, ok := o.Object["status"]; ok {
				t.Errorf("deploy/%s: %s carries a status", dir, describe(o))
			}
		}
	}
}
