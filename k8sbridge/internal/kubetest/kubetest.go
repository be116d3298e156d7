// Package kubetest holds what the tests of k8sbridge's packages share: the
// real control plane (skipped under -short), CRDs, Events.
//
// Only tests import it.
package kubetest

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/csibroker/csibroker/internal/testenv"
)

// ControlPlane is the package's shared control plane (testenv.Shared). A
// test that needs one is not fast: under -short it is skipped, so that
// go test -short runs the fast tier alone.
func ControlPlane(t testing.TB) *testenv.Env {
	t.Helper()
	if testing.Short() {
		t.Skip("needs the real control plane (skipped with -short)")
	}
	return testenv.Shared(t)
}

// CRDs is where CustomResourceDefinitions are created and read.
var CRDs = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// CreateCRD creates crd (if it is not there yet) and waits until gvr is
// served.
func CreateCRD(t *testing.T, env *testenv.Env, crd *unstructured.Unstructured, gvr schema.GroupVersionResource) {
	t.Helper()
	const wait = 30 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	dyn := dynamic.NewForConfigOrDie(env.RESTConfig())
	if _, err := dyn.Resource(CRDs).Create(ctx, crd, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("create CRD %s: %v", crd.GetName(), err)
	}
	err := testenv.WaitFor(ctx, wait, "CRD "+crd.GetName()+" established and served", func(ctx context.Context) (bool, string, error) {
		got, err := dyn.Resource(CRDs).Get(ctx, crd.GetName(), metav1.GetOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		conds, _, _ := unstructured.NestedSlice(got.Object, "status", "conditions")
		established := false
		for _, c := range conds {
			if m, ok := c.(map[string]any); ok && m["type"] == "Established" && m["status"] == "True" {
				established = true
			}
		}
		if !established {
			return false, fmt.Sprintf("conditions %v", conds), nil
		}
		if _, err := dyn.Resource(gvr).List(ctx, metav1.ListOptions{Limit: 1}); err != nil {
			return false, "established; list: " + err.Error(), nil
		}
		return true, "", nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// ClusterName is s made unique to the test's namespace ns (for
// cluster-scoped objects and driver names).
func ClusterName(ns, s string) string { return ns + "-" + s }

// EventsOf lists the Events on object name in ns, one a line.
func EventsOf(c kubernetes.Interface, ns, name string) string {
	evs, err := c.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + name})
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, e := range evs.Items {
		fmt.Fprintf(&b, "\n  %s %s: %s", e.Type, e.Reason, e.Message)
	}
	return b.String()
}

// WaitEvent waits for an Event with reason on object name whose message
// contains want.
func WaitEvent(t *testing.T, c kubernetes.Interface, ns, name, reason, want string) corev1.Event {
	t.Helper()
	var found corev1.Event
	err := testenv.WaitFor(context.Background(), 30*time.Second, fmt.Sprintf("event %s on %s containing %q", reason, name, want), func(ctx context.Context) (bool, string, error) {
		evs, err := c.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + name})
		if err != nil {
			return false, err.Error(), nil
		}
		for _, e := range evs.Items {
			if e.Reason == reason && strings.Contains(e.Message, want) {
				found = e
				return true, "", nil
			}
		}
		return false, EventsOf(c, ns, name), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return found
}
