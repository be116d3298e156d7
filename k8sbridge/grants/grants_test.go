package grants

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/rand"
	"k8s.io/client-go/dynamic"
	"sigs.k8s.io/yaml"

	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
	"github.com/csibroker/csibroker/policy"
)

// grantWait bounds every wait in these tests.
const grantWait = 30 * time.Second

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// grantCRD reads the SecretGrant CRD from deploy/crds/.
func grantCRD(t *testing.T) *unstructured.Unstructured {
	t.Helper()
	files, err := filepath.Glob(filepath.Join("..", "..", "deploy", "crds", "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no CRD manifests in deploy/crds (err %v)", err)
	}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, doc := range bytes.Split(data, []byte("\n---")) {
			var obj map[string]any
			if err := yaml.Unmarshal(doc, &obj); err != nil {
				t.Fatalf("%s: %v", f, err)
			}
			u := &unstructured.Unstructured{Object: obj}
			if u.GetKind() == "CustomResourceDefinition" && u.GetName() == policy.Resource+"."+policy.APIGroup {
				return u
			}
		}
	}
	t.Fatalf("no CustomResourceDefinition %s.%s in %v", policy.Resource, policy.APIGroup, files)
	return nil
}

// installGrantCRD installs the SecretGrant CRD, under group when it is not
// the CRD's own group (a copy, deleted at the test's cleanup), and waits
// until it is established and served.
func installGrantCRD(t *testing.T, env *testenv.Env, group string) schema.GroupVersionResource {
	t.Helper()
	dyn := dynamic.NewForConfigOrDie(env.RESTConfig())
	crd := grantCRD(t)
	gvr := grantGVR
	if group != policy.APIGroup {
		gvr.Group = group
		crd.SetName(policy.Resource + "." + group)
		crd.SetLabels(nil)
		if err := unstructured.SetNestedField(crd.Object, group, "spec", "group"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), grantWait)
			defer cancel()
			if err := dyn.Resource(crdGVR).Delete(ctx, crd.GetName(), metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
				t.Errorf("delete CRD %s: %v", crd.GetName(), err)
			}
		})
	}
	kubetest.CreateCRD(t, env, crd, gvr)
	return gvr
}

// grantLogSink records a controller's log lines and passes them to t.Log
// until the test is over.
type grantLogSink struct {
	t     testing.TB
	mu    sync.Mutex
	lines []string
	done  bool
}

func newGrantLogSink(t testing.TB) *grantLogSink {
	s := &grantLogSink{t: t}
	t.Cleanup(func() {
		s.mu.Lock()
		s.done = true
		s.mu.Unlock()
	})
	return s
}

func (s *grantLogSink) Write(p []byte) (int, error) {
	line := strings.TrimRight(string(p), "\n")
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lines = append(s.lines, line)
	if !s.done {
		s.t.Log(line)
	}
	return len(p), nil
}

// count is the number of lines holding every one of subs.
func (s *grantLogSink) count(subs ...string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
next:
	for _, l := range s.lines {
		for _, sub := range subs {
			if !strings.Contains(l, sub) {
				continue next
			}
		}
		n++
	}
	return n
}

func (s *grantLogSink) logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(s, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// grantFixture is a running controller with its store, for one test.
type grantFixture struct {
	env   *testenv.Env
	dyn   dynamic.Interface
	gvr   schema.GroupVersionResource
	store *policy.Store
	c     *Controller
	logs  *grantLogSink
}

// startGrantController runs a controller for gvr until the test's cleanup,
// which waits for Run to return. It does not wait for the first sync.
func startGrantController(t *testing.T, env *testenv.Env, gvr schema.GroupVersionResource, writeStatus func() bool) *grantFixture {
	t.Helper()
	f := &grantFixture{
		env:   env,
		dyn:   dynamic.NewForConfigOrDie(env.RESTConfig()),
		gvr:   gvr,
		store: policy.NewStore(nil),
		logs:  newGrantLogSink(t),
	}
	f.c = newController(f.dyn, gvr, f.store, f.logs.logger(), writeStatus)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(grantWait):
			t.Errorf("Run did not return within %s of its context being canceled", grantWait)
		}
	})
	return f
}

func (f *grantFixture) waitSynced(t *testing.T) {
	t.Helper()
	err := testenv.WaitFor(context.Background(), grantWait, "the grant controller to sync", func(context.Context) (bool, string, error) {
		return f.c.HasSynced(), "not synced", nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// grantObject is a SecretGrant admitting drivers to receive secret of ns
// for CreateVolume on behalf of PVCs in namespace team-a.
func grantObject(gvr schema.GroupVersionResource, ns, name, secret string, drivers ...string) *unstructured.Unstructured {
	ds := make([]any, len(drivers))
	for i, d := range drivers {
		ds[i] = d
	}
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": gvr.GroupVersion().String(),
		"kind":       policy.Kind,
		"metadata":   map[string]any{"name": name, "namespace": ns},
		"spec": map[string]any{
			"drivers":     ds,
			"secretNames": []any{secret},
			"operations":  []any{string(policy.OpCreateVolume)},
			"requesters":  map[string]any{"namespaces": []any{"team-a"}},
		},
	}}
}

func (f *grantFixture) create(t *testing.T, u *unstructured.Unstructured) *unstructured.Unstructured {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), grantWait)
	defer cancel()
	got, err := f.dyn.Resource(f.gvr).Namespace(u.GetNamespace()).Create(ctx, u, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create secretgrant %s/%s: %v", u.GetNamespace(), u.GetName(), err)
	}
	return got
}

// update changes the spec of grant ns/name with edit and returns the
// updated object.
func (f *grantFixture) update(t *testing.T, ns, name string, edit func(spec map[string]any)) *unstructured.Unstructured {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), grantWait)
	defer cancel()
	r := f.dyn.Resource(f.gvr).Namespace(ns)
	var got *unstructured.Unstructured
	err := testenv.WaitFor(ctx, grantWait, "update of secretgrant "+ns+"/"+name, func(ctx context.Context) (bool, string, error) {
		u, err := r.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, "", err
		}
		edit(u.Object["spec"].(map[string]any))
		got, err = r.Update(ctx, u, metav1.UpdateOptions{})
		if apierrors.IsConflict(err) {
			return false, err.Error(), nil // the controller wrote its status meanwhile
		}
		return err == nil, "", err
	})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// grantRequest asks whether driver may receive secret ns/secret for
// CreateVolume on behalf of PVC team-a/data.
func grantRequest(ns, secret, driver string) policy.Request {
	return policy.Request{
		Driver:    driver,
		Operation: policy.OpCreateVolume,
		Secret:    policy.SecretRef{Namespace: ns, Name: secret},
		Source:    policy.Source{Kind: policy.SourceStorageClassParameter, Key: "csi.storage.k8s.io/provisioner-secret-name"},
		Requester: policy.Requester{
			Kind: policy.KindPersistentVolumeClaim, Namespace: "team-a", Name: "data",
			NamespaceLabels: map[string]string{}, StorageClass: "fast",
		},
	}
}

// grantErrorsIn are the keys of the invalid grants of namespace ns in the
// store's rule set (grants of other tests' namespaces may linger while those
// namespaces are being deleted).
func grantErrorsIn(store *policy.Store, ns string) []string {
	var keys []string
	for _, e := range store.Load().Errors() {
		if e.Namespace == ns {
			keys = append(keys, e.Key())
		}
	}
	return keys
}

// waitDecision waits until the store decides req with allowed and, when
// rule is not empty, by rule.
func (f *grantFixture) waitDecision(t *testing.T, what string, req policy.Request, allowed bool, rule string) {
	t.Helper()
	err := testenv.WaitFor(context.Background(), grantWait, what, func(context.Context) (bool, string, error) {
		d := f.store.Decide(req)
		state := fmt.Sprintf("allowed=%v rule=%s reason=%q", d.Allowed, d.Rule, d.Reason)
		return d.Allowed == allowed && (rule == "" || d.Rule == rule), state, nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// waitStatus waits until grant ns/name's status has observedGeneration equal
// to its generation and conditions Valid and Ready as wanted (reason, and a
// message containing msg), and returns the Valid condition.
func (f *grantFixture) waitStatus(t *testing.T, ns, name string, valid, ready metav1.ConditionStatus, validReason, readyReason, msg string) metav1.Condition {
	t.Helper()
	var got metav1.Condition
	err := testenv.WaitFor(context.Background(), grantWait, fmt.Sprintf("status of secretgrant %s/%s: Valid=%s Ready=%s", ns, name, valid, ready),
		func(ctx context.Context) (bool, string, error) {
			u, err := f.dyn.Resource(f.gvr).Namespace(ns).Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, "", err
			}
			st := readGrantStatus(u)
			state := fmt.Sprintf("generation %d, status %+v", u.GetGeneration(), st)
			v := meta.FindStatusCondition(st.Conditions, policy.ConditionValid)
			r := meta.FindStatusCondition(st.Conditions, policy.ConditionReady)
			gen := u.GetGeneration()
			if st.ObservedGeneration != gen || v == nil || r == nil || v.ObservedGeneration != gen || r.ObservedGeneration != gen {
				return false, state, nil
			}
			if v.Status != valid || v.Reason != validReason || r.Status != ready || r.Reason != readyReason || !strings.Contains(v.Message, msg) {
				return false, state, nil
			}
			if v.LastTransitionTime.IsZero() || r.LastTransitionTime.IsZero() {
				return false, state, nil
			}
			got = *v
			return true, "", nil
		})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

func TestGrantControllerFollowsCreateUpdateDelete(t *testing.T) {
	env := kubetest.ControlPlane(t)
	gvr := installGrantCRD(t, env, policy.APIGroup)
	ns := env.NewNamespace(t)
	f := startGrantController(t, env, gvr, nil)
	f.waitSynced(t)

	nfs := grantRequest(ns, "creds", "nfs.csi.example.com")
	ebs := grantRequest(ns, "creds", "ebs.csi.example.com")
	if d := f.store.Decide(nfs); d.Allowed || d.Rule != policy.RuleDefaultDeny {
		t.Fatalf("before any grant: %+v, want default deny", d)
	}

	f.create(t, grantObject(gvr, ns, "creds", "creds", "nfs.csi.example.com"))
	f.waitDecision(t, "the new grant to admit nfs", nfs, true, ns+"/creds")
	if d := f.store.Decide(ebs); d.Allowed {
		t.Fatalf("ebs admitted by a grant for nfs only: %+v", d)
	}
	f.waitStatus(t, ns, "creds", metav1.ConditionTrue, metav1.ConditionTrue, policy.ReasonCompiled, policy.ReasonApplied, "")

	// Change the drivers: the decision follows without a restart.
	u := f.update(t, ns, "creds", func(spec map[string]any) { spec["drivers"] = []any{"ebs.csi.example.com"} })
	if u.GetGeneration() < 2 {
		t.Fatalf("generation %d after a spec change", u.GetGeneration())
	}
	f.waitDecision(t, "the changed grant to admit ebs", ebs, true, ns+"/creds")
	f.waitDecision(t, "the changed grant to stop admitting nfs", nfs, false, policy.RuleDefaultDeny)
	f.waitStatus(t, ns, "creds", metav1.ConditionTrue, metav1.ConditionTrue, policy.ReasonCompiled, policy.ReasonApplied, "")

	// Delete it: default deny again.
	ctx, cancel := context.WithTimeout(context.Background(), grantWait)
	defer cancel()
	if err := f.dyn.Resource(gvr).Namespace(ns).Delete(ctx, "creds", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	f.waitDecision(t, "default deny after the grant is deleted", ebs, false, policy.RuleDefaultDeny)
	if d := f.store.Decide(nfs); d.Allowed {
		t.Fatalf("nfs admitted after the grant was deleted: %+v", d)
	}
	if n := f.logs.count("invalid SecretGrant", ns+"/"); n != 0 {
		t.Fatalf("%d invalid grants logged for valid grants", n)
	}
}

func TestGrantControllerReportsInvalidGrant(t *testing.T) {
	env := kubetest.ControlPlane(t)
	gvr := installGrantCRD(t, env, policy.APIGroup)
	ns := env.NewNamespace(t)
	f := startGrantController(t, env, gvr, nil)
	f.waitSynced(t)

	f.create(t, grantObject(gvr, ns, "good", "good-creds", "nfs.csi.example.com"))
	// A CEL syntax error: the CRD schema cannot catch it, the controller must.
	bad := grantObject(gvr, ns, "bad-cel", "other-creds", "nfs.csi.example.com")
	if err := unstructured.SetNestedField(bad.Object, `request.driver ==`, "spec", "condition"); err != nil {
		t.Fatal(err)
	}
	f.create(t, bad)

	v := f.waitStatus(t, ns, "bad-cel", metav1.ConditionFalse, metav1.ConditionFalse, policy.ReasonInvalid, policy.ReasonNotApplied, "spec.condition: ")
	t.Logf("Valid condition of the invalid grant: %+v", v)
	f.waitStatus(t, ns, "good", metav1.ConditionTrue, metav1.ConditionTrue, policy.ReasonCompiled, policy.ReasonApplied, "")

	// The other grant applies; the invalid one is not half-applied.
	f.waitDecision(t, "the valid grant to apply", grantRequest(ns, "good-creds", "nfs.csi.example.com"), true, ns+"/good")
	if d := f.store.Decide(grantRequest(ns, "other-creds", "nfs.csi.example.com")); d.Allowed || d.Rule != policy.RuleDefaultDeny {
		t.Fatalf("secret of the invalid grant: %+v, want default deny", d)
	}
	if errs := grantErrorsIn(f.store, ns); len(errs) != 1 || errs[0] != ns+"/bad-cel" {
		t.Fatalf("invalid grants in %s: %v, want only bad-cel", ns, errs)
	}
	if n := f.logs.count("invalid SecretGrant", ns+"/bad-cel"); n != 1 {
		t.Fatalf("the invalid grant was logged %d times, want once", n)
	}

	// Fixed: Valid again, and it applies.
	f.update(t, ns, "bad-cel", func(spec map[string]any) { spec["condition"] = `request.requester.namespace == "team-a"` })
	f.waitStatus(t, ns, "bad-cel", metav1.ConditionTrue, metav1.ConditionTrue, policy.ReasonCompiled, policy.ReasonApplied, "")
	f.waitDecision(t, "the fixed grant to apply", grantRequest(ns, "other-creds", "nfs.csi.example.com"), true, ns+"/bad-cel")
}

func TestGrantControllerInvalidDenyGrantFailsClosed(t *testing.T) {
	env := kubetest.ControlPlane(t)
	gvr := installGrantCRD(t, env, policy.APIGroup)
	ns := env.NewNamespace(t)
	f := startGrantController(t, env, gvr, nil)
	f.waitSynced(t)

	req := grantRequest(ns, "creds", "nfs.csi.example.com")
	f.create(t, grantObject(gvr, ns, "allow", "creds", "nfs.csi.example.com"))
	f.waitDecision(t, "the allow grant to apply", req, true, ns+"/allow")

	deny := grantObject(gvr, ns, "deny-broken", "creds", "*")
	spec := deny.Object["spec"].(map[string]any)
	spec["action"] = string(policy.ActionDeny)
	spec["condition"] = `request.driver ==`
	f.create(t, deny)

	f.waitDecision(t, "the invalid deny grant to lock the namespace", req, false, ns+"/deny-broken")
	f.waitStatus(t, ns, "deny-broken", metav1.ConditionFalse, metav1.ConditionTrue, policy.ReasonInvalid, policy.ReasonFailClosed, "spec.condition: ")
}

func TestGrantControllerStandbyWritesNoStatus(t *testing.T) {
	env := kubetest.ControlPlane(t)
	gvr := installGrantCRD(t, env, policy.APIGroup)
	ns := env.NewNamespace(t)
	var leader atomic.Bool
	f := startGrantController(t, env, gvr, leader.Load)
	f.waitSynced(t)

	f.create(t, grantObject(gvr, ns, "good", "creds", "nfs.csi.example.com"))
	bad := grantObject(gvr, ns, "bad", "creds", "nfs.csi.example.com")
	if err := unstructured.SetNestedField(bad.Object, `request.driver ==`, "spec", "condition"); err != nil {
		t.Fatal(err)
	}
	f.create(t, bad)

	// The standby's rules are warm...
	f.waitDecision(t, "the standby to apply the valid grant", grantRequest(ns, "creds", "nfs.csi.example.com"), true, ns+"/good")
	err := testenv.WaitFor(context.Background(), grantWait, "the invalid grant in the standby's rule set", func(context.Context) (bool, string, error) {
		errs := grantErrorsIn(f.store, ns)
		return len(errs) == 1 && errs[0] == ns+"/bad", fmt.Sprint(errs), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// ...and the status writes it would make were held back...
	err = testenv.WaitFor(context.Background(), grantWait, "the standby to hold back both status writes", func(context.Context) (bool, string, error) {
		n := f.c.statusSkips.Load()
		return n >= 2, fmt.Sprintf("%d held back", n), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// ...so nothing was written.
	ctx, cancel := context.WithTimeout(context.Background(), grantWait)
	defer cancel()
	for _, name := range []string{"good", "bad"} {
		u, err := f.dyn.Resource(gvr).Namespace(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if st, ok := u.Object["status"]; ok {
			t.Fatalf("standby wrote the status of %s: %v", name, st)
		}
	}
	if n := f.c.statusWrites.Load(); n != 0 {
		t.Fatalf("standby made %d status writes", n)
	}

	// Leadership: the held-back statuses are written.
	leader.Store(true)
	f.waitStatus(t, ns, "good", metav1.ConditionTrue, metav1.ConditionTrue, policy.ReasonCompiled, policy.ReasonApplied, "")
	f.waitStatus(t, ns, "bad", metav1.ConditionFalse, metav1.ConditionFalse, policy.ReasonInvalid, policy.ReasonNotApplied, "spec.condition: ")
}

func TestGrantControllerWithoutCRDRetriesAndDeniesByDefault(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	// A group no CRD serves (yet), so the shared SecretGrant CRD the other
	// tests install does not interfere.
	group := "t" + rand.String(8) + ".test.csibroker.io"
	gvr := schema.GroupVersionResource{Group: group, Version: grantGVR.Version, Resource: grantGVR.Resource}
	f := startGrantController(t, env, gvr, nil)

	err := testenv.WaitFor(context.Background(), grantWait, "the controller to retry listing a resource that is not served", func(context.Context) (bool, string, error) {
		n := f.c.watchErrors.Load()
		return n >= 2, fmt.Sprintf("%d failures", n), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := f.logs.count("level=ERROR", "SecretGrant CRD is not installed", "default deny in enforce mode"); n < 1 {
		t.Fatalf("no clear error logged for the missing CRD")
	}
	if f.c.HasSynced() {
		t.Fatal("HasSynced without the CRD")
	}
	req := grantRequest(ns, "creds", "nfs.csi.example.com")
	if d := f.store.Decide(req); d.Allowed || d.Mode != policy.ModeEnforce || d.Rule != policy.RuleDefaultDeny {
		t.Fatalf("without the CRD: %+v, want default deny in enforce mode", d)
	}

	// Installed later: picked up without a restart.
	installGrantCRD(t, env, group)
	f.waitSynced(t)
	f.create(t, grantObject(gvr, ns, "creds", "creds", "nfs.csi.example.com"))
	f.waitDecision(t, "the grant to apply once the CRD is installed", req, true, ns+"/creds")
}

func TestGrantFromObjectUnreadableSpec(t *testing.T) {
	for _, tc := range []struct {
		name       string
		spec       any
		failClosed bool
	}{
		{"drivers not a list, Allow", map[string]any{"drivers": "nfs", "secretNames": []any{"s"}, "operations": []any{"*"}, "requesters": map[string]any{"namespaces": []any{"*"}}}, false},
		{"drivers not a list, Deny", map[string]any{"action": "Deny", "drivers": "nfs", "secretNames": []any{"s"}, "operations": []any{"*"}, "requesters": map[string]any{"namespaces": []any{"*"}}}, true},
		{"action unreadable", map[string]any{"action": int64(3), "drivers": []any{"nfs"}}, true},
		{"no spec", nil, false},
		{"spec not an object", "x", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			u := &unstructured.Unstructured{Object: map[string]any{"metadata": map[string]any{"namespace": "ns", "name": "g", "generation": int64(4)}}}
			if tc.spec != nil {
				u.Object["spec"] = tc.spec
			}
			g, err := grantFromObject(u)
			if err == nil || !strings.HasPrefix(err.Error(), "spec: ") {
				t.Fatalf("err %v, want a spec error", err)
			}
			_, errs := policy.Compile([]policy.Grant{g})
			if len(errs) != 1 || errs[0].FailClosed != tc.failClosed || errs[0].Generation != 4 {
				t.Fatalf("compile errors %+v, want one with FailClosed=%v generation 4", errs, tc.failClosed)
			}
		})
	}
}

func TestGrantStatusUpdate(t *testing.T) {
	old := metav1.NewTime(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC))
	other := metav1.Condition{Type: "Other", Status: metav1.ConditionTrue, Reason: "X", LastTransitionTime: old}
	valid := grantResult{namespace: "ns", generation: 2}
	invalid := grantResult{namespace: "ns", generation: 3, invalid: true, message: "spec.condition: boom"}

	obj := func(st *grantStatus) *unstructured.Unstructured {
		u := &unstructured.Unstructured{Object: map[string]any{}}
		if st != nil {
			u.Object["status"] = map[string]any{}
			m := u.Object["status"].(map[string]any)
			m["observedGeneration"] = st.ObservedGeneration
			var cs []any
			for _, c := range st.Conditions {
				cs = append(cs, map[string]any{
					"type": c.Type, "status": string(c.Status), "reason": c.Reason, "message": c.Message,
					"observedGeneration": c.ObservedGeneration, "lastTransitionTime": c.LastTransitionTime.UTC().Format(time.RFC3339),
				})
			}
			m["conditions"] = cs
		}
		return u
	}

	// No status yet: both conditions are added.
	want, changed := statusUpdate(obj(nil), valid)
	if !changed || want.ObservedGeneration != 2 || len(want.Conditions) != 2 {
		t.Fatalf("from nothing: changed=%v %+v", changed, want)
	}
	// Written once, the same result changes nothing.
	if _, changed := statusUpdate(obj(&want), valid); changed {
		t.Fatal("same result, status rewritten")
	}

	// Another writer's condition is kept; lastTransitionTime moves only with
	// the status.
	v, r := valid.conditions()
	v.LastTransitionTime, r.LastTransitionTime = old, old
	cur := grantStatus{ObservedGeneration: 2, Conditions: []metav1.Condition{other, v, r}}
	next, changed := statusUpdate(obj(&cur), grantResult{namespace: "ns", generation: 5})
	if !changed || next.ObservedGeneration != 5 {
		t.Fatalf("new generation: changed=%v %+v", changed, next)
	}
	if c := meta.FindStatusCondition(next.Conditions, policy.ConditionValid); !c.LastTransitionTime.Equal(&old) || c.ObservedGeneration != 5 {
		t.Fatalf("Valid stayed True but %+v", c)
	}
	if c := meta.FindStatusCondition(next.Conditions, "Other"); c == nil {
		t.Fatal("another writer's condition was dropped")
	}
	bad, changed := statusUpdate(obj(&cur), invalid)
	c := meta.FindStatusCondition(bad.Conditions, policy.ConditionValid)
	if !changed || c.Status != metav1.ConditionFalse || c.Reason != policy.ReasonInvalid || c.Message != invalid.message || c.LastTransitionTime.Equal(&old) {
		t.Fatalf("turned invalid: %+v", c)
	}
	if c := meta.FindStatusCondition(bad.Conditions, policy.ConditionReady); c.Status != metav1.ConditionFalse || c.Reason != policy.ReasonNotApplied {
		t.Fatalf("Ready of an invalid Allow grant: %+v", c)
	}
	if _, r := (grantResult{namespace: "ns", invalid: true, failClosed: true}).conditions(); r.Status != metav1.ConditionTrue || r.Reason != policy.ReasonFailClosed {
		t.Fatalf("Ready of an invalid Deny grant: %+v", r)
	}
	if s := grantTruncate(strings.Repeat("é", grantMaxMessage)); len(s) > grantMaxMessage || !strings.HasSuffix(s, "...") || !utf8.ValidString(s) {
		t.Fatalf("truncated message: %d bytes, valid UTF-8 %v", len(s), utf8.ValidString(s))
	}
}

// TestGrantSpecMayDiffer: a status or metadata update of the same grant
// only has its status checked; a new generation, or a grant deleted and
// made again under its name (same generation, another UID, as a relist
// reports it), is compiled again.
func TestGrantSpecMayDiffer(t *testing.T) {
	obj := func(uid string, gen int64) *unstructured.Unstructured {
		u := &unstructured.Unstructured{}
		u.SetNamespace("ns")
		u.SetName("g")
		u.SetUID(types.UID(uid))
		u.SetGeneration(gen)
		return u
	}
	for _, tc := range []struct {
		name     string
		old, cur *unstructured.Unstructured
		want     bool
	}{
		{"status write", obj("a", 1), obj("a", 1), false},
		{"spec changed", obj("a", 1), obj("a", 2), true},
		{"deleted and made again, seen at a relist", obj("a", 1), obj("b", 1), true},
	} {
		if got := grantSpecMayDiffer(tc.old, tc.cur); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}
