package k8sbridge

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
)

// TestLeaderFailover: two replicas, one Lease for everything. The leader dies
// (without releasing its Lease, as a crash would) while claims are pending;
// the standby, whose caches are warm, takes over after the Lease expires and
// finishes every claim, leaking nothing. The take-over time is reported.
func TestLeaderFailover(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "ha.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv, Faults: sampledriver.Faults{Methods: map[string]sampledriver.Fault{"CreateVolume": {Latency: 300 * time.Millisecond}}}})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "ha"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)

	crash := func(b *Bridge) { b.keepLeaseOnStop = true }
	first := startBridge(t, env, ns, drivers, bridgeOpts{identity: "replica-a", leader: true, configure: crash, configureCfg: func(c *Config) { c.WorkerThreads = 2 }})
	if err := testenv.WaitFor(ctx, 30*time.Second, "replica-a leading", func(context.Context) (bool, string, error) {
		ok, _ := first.b.Leader()
		return ok, "", nil
	}); err != nil {
		t.Fatal(err)
	}
	second := startBridge(t, env, ns, drivers, bridgeOpts{identity: "replica-b", leader: true, configureCfg: func(c *Config) { c.WorkerThreads = 2 }})

	const n = 12
	for i := 0; i < n; i++ {
		kubetest.MakeClaim(t, c, ns, fmt.Sprintf("claim-%02d", i), class.Name, "1Gi")
	}
	countPVs := func() int {
		pvs, err := c.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return -1
		}
		k := 0
		for _, pv := range pvs.Items {
			if pv.Spec.CSI != nil && pv.Spec.CSI.Driver == drv {
				k++
			}
		}
		return k
	}
	if err := testenv.WaitFor(ctx, 30*time.Second, "a few PVs from replica-a", func(context.Context) (bool, string, error) {
		k := countPVs()
		return k >= 2, fmt.Sprint(k), nil
	}); err != nil {
		t.Fatal(err)
	}
	if ok, _ := second.b.Leader(); ok {
		t.Fatal("replica-b leads while replica-a holds the Lease")
	}
	before := countPVs()
	if before >= n {
		t.Fatal("every claim was done before the crash: nothing was pending")
	}
	killed := time.Now()
	first.stop()
	afterKill := countPVs()

	var tookOver, nextPV time.Duration
	err := testenv.WaitFor(ctx, 60*time.Second, "replica-b to create a PV", func(context.Context) (bool, string, error) {
		if ok, _ := second.b.Leader(); ok && tookOver == 0 {
			tookOver = time.Since(killed)
		}
		k := countPVs()
		if k > afterKill {
			nextPV = time.Since(killed)
			return true, "", nil
		}
		return false, fmt.Sprintf("%d PVs", k), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("leader killed with %d of %d claims provisioned; standby leading after %v, next PV after %v (lease duration %v)",
		before, n, tookOver.Round(10*time.Millisecond), nextPV.Round(10*time.Millisecond), second.b.Cfg.LeaderElectionLease)
	for i := 0; i < n; i++ {
		kubetest.WaitBound(t, c, ns, fmt.Sprintf("claim-%02d", i), 60*time.Second)
	}
	noLeaks(t, env, ns, d, drv)
	if got := len(d.Volumes()); got != n {
		t.Fatalf("driver has %d volumes for %d claims", got, n)
	}
}

// TestLeadsAgainAfterLosingTheLease: another holder takes the Lease for a
// moment; the broker stops leading, leads again once it can, and then
// provisions as before (each term gets fresh work queues).
func TestLeadsAgainAfterLosingTheLease(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "again.csi.test")
	drivers := &testDrivers{}
	drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "again"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	r := startBridge(t, env, ns, drivers, bridgeOpts{identity: "only-replica", leader: true})
	kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "before", class.Name, "1Gi").Name, 60*time.Second)

	// Take the Lease: a holder that renewed just now, for 3s.
	takeLease(t, c, ns, "intruder", 3)
	if err := testenv.WaitFor(ctx, 30*time.Second, "the broker to stop leading", func(context.Context) (bool, string, error) {
		ok, _ := r.b.Leader()
		return !ok, "", nil
	}); err != nil {
		t.Fatal(err)
	}
	if err := testenv.WaitFor(ctx, 30*time.Second, "the broker to lead again", func(context.Context) (bool, string, error) {
		ok, _ := r.b.Leader()
		return ok, "", nil
	}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "after", class.Name, "1Gi").Name, 60*time.Second)
}

// takeLease makes holder the broker's leader Lease holder, renewed now, for
// secs seconds. The broker renews the Lease every half second, so the
// update is retried on a conflict.
func takeLease(t *testing.T, c kubernetes.Interface, ns, holder string, secs int32) {
	t.Helper()
	ctx := context.Background()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		lease, err := c.CoordinationV1().Leases(ns).Get(ctx, "csibroker-leader", metav1.GetOptions{})
		if err != nil {
			return err
		}
		now := metav1.NewMicroTime(time.Now())
		lease.Spec.HolderIdentity, lease.Spec.LeaseDurationSeconds, lease.Spec.RenewTime, lease.Spec.AcquireTime = &holder, &secs, &now, &now
		_, err = c.CoordinationV1().Leases(ns).Update(ctx, lease, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		t.Fatalf("take the Lease for %s: %v", holder, err)
	}
}

// TestLeaseHeldUntilTheTermHasStopped: a leader that stops (SIGTERM)
// releases its Lease only once its controllers have stopped, so a standby
// cannot start its own while a worker of this term is still finishing.
func TestLeaseHeldUntilTheTermHasStopped(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	r, ended, release := leaderWithHeldCreate(t, env, ns, "lease", nil)
	holder := func() string {
		l, err := c.CoordinationV1().Leases(ns).Get(ctx, "csibroker-leader", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if l.Spec.HolderIdentity == nil {
			return ""
		}
		return *l.Spec.HolderIdentity
	}
	r.cancel() // as SIGTERM does
	r.cancel = nil
	select {
	case <-ended:
	case <-time.After(10 * time.Second):
		release()
		t.Fatal("the term never ended")
	}
	// The worker stays busy until finish is closed: the Lease must stay
	// held all that time. Its release writes the time it was made, which
	// must come after the worker was let go.
	if h := holder(); h != "broker-0" {
		t.Fatalf("while a worker of the term is still running, the Lease is held by %q, want broker-0", h)
	}
	finished := time.Now().Truncate(time.Microsecond)
	release()
	select {
	case <-r.exited:
	case <-time.After(20 * time.Second):
		t.Fatal("Run did not return")
	}
	l, err := c.CoordinationV1().Leases(ns).Get(ctx, "csibroker-leader", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	switch {
	case l.Spec.HolderIdentity != nil && *l.Spec.HolderIdentity != "":
		t.Fatalf("after the stop the Lease is held by %q, want it released", *l.Spec.HolderIdentity)
	case l.Spec.RenewTime == nil || l.Spec.RenewTime.Time.Before(finished):
		t.Fatalf("the Lease was released at %v, before the term's last worker finished (%v)", l.Spec.RenewTime, finished)
	}
}

// TestLeaseNotReleasedWhenARenewalFails: a leader whose renewals fail
// (the API server refuses its lease writes a while) ends its term, but
// does not write the lease free while its workers are still running, as
// client-go's ReleaseOnCancel does: a standby would lead at once beside
// them. The lease is left to expire.
func TestLeaseNotReleasedWhenARenewalFails(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	// Lease writes that keep this replica the holder fail while failing
	// is set; any other lease request (a release writes no holder) passes.
	var failing atomic.Bool
	rc := rest.CopyConfig(env.RESTConfig())
	rc.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		return roundTripFunc(func(req *http.Request) (*http.Response, error) {
			if failing.Load() && req.Method == http.MethodPut && strings.Contains(req.URL.Path, "/leases/") && req.Body != nil {
				body, err := io.ReadAll(req.Body)
				if err != nil {
					return nil, err
				}
				req.Body = io.NopCloser(bytes.NewReader(body))
				if bytes.Contains(body, []byte("broker-0")) { // the holder, in JSON or protobuf
					return nil, errors.New("test: lease renewal refused")
				}
			}
			return rt.RoundTrip(req)
		})
	}
	leases := kubernetes.NewForConfigOrDie(rc)
	r, _, release := leaderWithHeldCreate(t, env, ns, "renew", func(cfg *Config) { cfg.LeaseClient = leases })
	failing.Store(true)
	if err := testenv.WaitFor(ctx, 20*time.Second, "the term ended by the failed renewal", func(context.Context) (bool, string, error) {
		r.b.leaderMu.Lock()
		defer r.b.leaderMu.Unlock()
		return !r.b.leading, "", nil
	}); err != nil {
		t.Fatal(err)
	}
	l, err := c.CoordinationV1().Leases(ns).Get(ctx, "csibroker-leader", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if h := l.Spec.HolderIdentity; h == nil || *h != "broker-0" {
		holder := "no one"
		if h != nil {
			holder = fmt.Sprintf("%q", *h)
		}
		t.Fatalf("after a failed renewal, with a worker of the term still running, the Lease is held by %s, want broker-0 (left to expire, not released)", holder)
	}
	failing.Store(false)
	release()
}

// leaderWithHeldCreate starts a leader (configured by cfg, if set) with a
// driver and class named after name, and a claim whose CreateVolume the
// driver has answered but whose worker is held until release is called
// (at the test's end if not before); ended receives once the term's
// context is done while it is held.
func leaderWithHeldCreate(t *testing.T, env *testenv.Env, ns, name string, cfg func(*Config)) (r *bridgeRun, ended <-chan struct{}, release func()) {
	t.Helper()
	c := env.Client()
	drv := kubetest.ClusterName(ns, name+".csi.test")
	drivers := &testDrivers{}
	drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, name), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	entered, endedC, finish := make(chan struct{}, 1), make(chan struct{}, 1), make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(finish) }) }
	r = startBridge(t, env, ns, drivers, bridgeOpts{leader: true, configureCfg: cfg, configure: func(b *Bridge) {
		b.prov.AfterCreate = func(ctx context.Context, _ string) {
			entered <- struct{}{}
			select {
			case <-ctx.Done():
				endedC <- struct{}{}
			case <-finish:
				return
			}
			<-finish // a worker slow to finish, until the test lets it
		}
	}})
	t.Cleanup(release) // before the bridge's stop, which waits for the worker
	kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi")
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("CreateVolume never returned")
	}
	return r, endedC, release
}
