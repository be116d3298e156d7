package k8sbridge

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
)

// TestReadyFollowsCacheSync: /readyz's answer is not ready before the
// informers run and ready once their caches synced, on a real apiserver.
func TestReadyFollowsCacheSync(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	var before error
	r := startBridge(t, env, ns, &testDrivers{}, bridgeOpts{configure: func(b *Bridge) { before = b.Ready() }})
	if before == nil {
		t.Fatal("Ready() was nil before Run started the informers")
	}
	if err := testenv.WaitFor(context.Background(), 30*time.Second, "caches synced", func(context.Context) (bool, string, error) {
		err := r.b.Ready()
		if err != nil {
			return false, err.Error(), nil
		}
		return true, "", nil
	}); err != nil {
		t.Fatal(err)
	}
}

// TestControllersWaitForThePolicy: with something to wait for (the
// SecretGrants in a broker), no claim is provisioned and /readyz says what
// it waits for until it is there; then the claim is provisioned.
func TestControllersWaitForThePolicy(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "wait.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "wait"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	var loaded atomic.Bool
	r := startBridge(t, env, ns, drivers, bridgeOpts{configure: func(b *Bridge) { b.WaitFor(loaded.Load, "grants not loaded (test)") }})
	kubetest.MakeClaim(t, c, ns, "early", class.Name, "1Gi")
	if err := testenv.WaitFor(context.Background(), 30*time.Second, "readyz naming what it waits for", func(context.Context) (bool, string, error) {
		err := r.b.Ready()
		return err != nil && strings.Contains(err.Error(), "grants not loaded (test)"), fmt.Sprint(err), nil
	}); err != nil {
		t.Fatal(err)
	}
	// The bridge is in its wait: the controllers start after it.
	if err := testenv.WaitFor(context.Background(), 30*time.Second, "the bridge waiting before its controllers", func(context.Context) (bool, string, error) {
		return strings.Contains(r.logs.String(), "waiting before running the controllers"), "", nil
	}); err != nil {
		t.Fatal(err)
	}
	released := time.Now()
	loaded.Store(true)
	kubetest.WaitBound(t, c, ns, "early", 60*time.Second)
	for _, at := range d.CallTimes("CreateVolume") {
		if at.Before(released) {
			t.Fatalf("CreateVolume called at %s, before the policy was loaded at %s", at.Format(time.StampMicro), released.Format(time.StampMicro))
		}
	}
	if err := r.b.Ready(); err != nil {
		t.Fatalf("Ready() after the wait: %v", err)
	}
}
