package testenv

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// New starts a control plane for one test and stops it at the test's cleanup,
// failing the test when it cannot start. Under go test -short (the fast
// tier) the test is skipped, saying so; make test runs it. Progress lines go
// to t.Logf unless opts.Logf is set; when the test fails, the tail of every
// component's log is logged before the stop.
func New(t testing.TB, opts Options) *Env {
	t.Helper()
	skipIfShort(t)
	if opts.Logf == nil {
		opts.Logf = t.Logf
	}
	e, err := Start(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("testenv: logs of the control plane at the failure:%s", e.LogTails(30))
		}
		e.Stop()
	})
	return e
}

// The control plane shared by the tests of one package (see Main).
var shared struct {
	sync.Mutex
	main    bool // Main is running
	opts    Options
	env     *Env
	err     error
	started bool
}

// Main runs a package's tests with one control plane shared between them, started
// on the first call to Shared (so a run that selects no such test starts
// nothing) and stopped when the tests are done. Call it from TestMain:
//
//	func TestMain(m *testing.M) { testenv.Main(m, testenv.Options{ControllerManager: true}) }
//
// It exits the process with the tests' status.
func Main(m *testing.M, opts Options) {
	os.Exit(runMain(m, opts))
}

func runMain(m *testing.M, opts Options) int {
	shared.Lock()
	shared.main, shared.opts = true, opts
	shared.Unlock()

	code := m.Run()

	shared.Lock()
	defer shared.Unlock()
	if shared.env != nil {
		if code != 0 {
			fmt.Fprintf(os.Stderr, "testenv: logs of the shared control plane after the failure:%s\n", shared.env.LogTails(30))
		}
		shared.env.Stop()
		shared.env = nil
	}
	return code
}

// Shared returns the package's shared control plane, starting it on the first
// call. The test fails if the package's TestMain does not call Main, or if
// the control plane cannot start (every later call fails with the same error).
// Under go test -short the test is skipped, as New's.
func Shared(t testing.TB) *Env {
	t.Helper()
	skipIfShort(t)
	shared.Lock()
	defer shared.Unlock()
	if !shared.main {
		t.Fatal("testenv.Shared: no shared control plane; call testenv.Main(m, opts) from the package's TestMain")
	}
	if !shared.started {
		shared.started = true
		shared.env, shared.err = Start(context.Background(), shared.opts)
	}
	if shared.err != nil {
		t.Fatal(shared.err)
	}
	return shared.env
}

// skipIfShort skips a test that needs a real control plane under -short.
func skipIfShort(t testing.TB) {
	t.Helper()
	if testing.Short() {
		t.Skip("needs a real control plane: skipped under -short (the fast tier); make test runs it")
	}
}

var notDNS = regexp.MustCompile(`[^a-z0-9]+`)

// NewNamespace creates a namespace for one test, named after it, with the
// "default" service account already present (the controller that would create
// it may not be running, and without it pods are refused). The namespace and
// its pods are deleted at the test's cleanup.
func (e *Env) NewNamespace(t testing.TB) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	prefix := strings.Trim(notDNS.ReplaceAllString(strings.ToLower(t.Name()), "-"), "-")
	if len(prefix) > 40 {
		prefix = strings.TrimRight(prefix[:40], "-")
	}
	if prefix == "" {
		prefix = "test"
	}
	c := e.Client()
	ns, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{
		ObjectMeta: metav1.ObjectMeta{GenerateName: prefix + "-", Labels: map[string]string{"csibroker.test/testenv": "true"}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("testenv: create namespace: %v", err)
	}
	_, err = c.CoreV1().ServiceAccounts(ns.Name).Create(ctx, &corev1.ServiceAccount{
		ObjectMeta: metav1.ObjectMeta{Name: "default"},
	}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("testenv: create service account %s/default: %v", ns.Name, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		// No kubelet will ever confirm a graceful pod deletion.
		zero := int64(0)
		if err := c.CoreV1().Pods(ns.Name).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: &zero}, metav1.ListOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("testenv: delete pods in %s: %v", ns.Name, err)
		}
		if err := c.CoreV1().Namespaces().Delete(ctx, ns.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("testenv: delete namespace %s: %v", ns.Name, err)
		}
	})
	return ns.Name
}
