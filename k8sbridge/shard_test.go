package k8sbridge

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
	"github.com/csibroker/csibroker/k8sbridge/shard"
)

// TestShardedLeadership: twenty drivers, per-driver leader election.
// Three replicas settle to 6 or 7 drivers each, every driver led by one
// replica (its Lease says which; so does csibroker_driver_leader), and
// claims of every driver bind. A fourth replica joins and takes its share
// (5 each). One replica dies without releasing anything, as a crash: the
// others take its drivers within the lease duration and one retry, and the
// claims of those drivers created just before the crash bind. All along,
// no driver is led by two replicas at once.
func TestShardedLeadership(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	const n = 20
	drivers := &testDrivers{}
	var names, classes []string
	for i := range n {
		drv := kubetest.ClusterName(ns, fmt.Sprintf("s%02d.csi.test", i))
		drivers.addDriver(t, sampledriver.Config{Name: drv})
		class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, fmt.Sprintf("s%02d", i)), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
		names, classes = append(names, drv), append(classes, class.Name)
	}
	sharded := func(crash bool) bridgeOpts {
		o := bridgeOpts{leader: true, configureCfg: func(c *Config) { c.LeaderElectionMode = LeaderElectionPerDriver; c.WorkerThreads = 4 }}
		if crash {
			o.configure = func(b *Bridge) { b.keepLeaseOnStop = true }
		}
		return o
	}
	var mu sync.Mutex
	var replicas []*bridgeRun
	start := func(id string, crash bool) *bridgeRun {
		o := sharded(crash)
		o.identity = id
		r := startBridge(t, env, ns, drivers, o)
		mu.Lock()
		replicas = append(replicas, r)
		mu.Unlock()
		return r
	}
	live := func() []*bridgeRun {
		mu.Lock()
		defer mu.Unlock()
		var out []*bridgeRun
		for _, r := range replicas {
			if r.cancel != nil {
				out = append(out, r)
			}
		}
		return out
	}
	// Exclusivity, sampled all along: no driver in two replicas' shares.
	watchCtx, stopWatch := context.WithCancel(ctx)
	var twice []string
	var watched sync.WaitGroup
	watched.Add(1)
	go func() {
		defer watched.Done()
		for watchCtx.Err() == nil {
			owner := map[string]string{}
			for _, r := range live() {
				for _, d := range r.b.shards.Led() {
					if o, ok := owner[d]; ok {
						twice = append(twice, fmt.Sprintf("%s by %s and %s", d, o, r.identity))
					}
					owner[d] = r.identity
				}
			}
			kube.SleepCtx(watchCtx, 20*time.Millisecond)
		}
	}()
	t.Cleanup(func() { stopWatch(); watched.Wait() })

	// settled waits until the live replicas share the drivers: each driver
	// led by exactly one, each replica leading lo..hi, the Lease holder and
	// the metric saying the same.
	settled := func(what string, timeout time.Duration) time.Duration {
		t.Helper()
		began := time.Now()
		err := testenv.WaitFor(ctx, timeout, what, func(context.Context) (bool, string, error) {
			rs := live()
			lo, hi := n/len(rs), (n+len(rs)-1)/len(rs)
			owner := map[string]string{}
			var counts []string
			for _, r := range rs {
				led := r.b.shards.Led()
				counts = append(counts, fmt.Sprintf("%s:%d", r.identity, len(led)))
				if len(led) < lo || len(led) > hi {
					return false, strings.Join(counts, " "), nil
				}
				for _, d := range led {
					if o, ok := owner[d]; ok {
						return false, d + " led by " + o + " and " + r.identity, nil
					}
					owner[d] = r.identity
				}
			}
			if len(owner) != n {
				return false, fmt.Sprintf("%d of %d drivers led (%s)", len(owner), n, strings.Join(counts, " ")), nil
			}
			return true, "", nil
		})
		if err != nil {
			t.Fatal(err)
		}
		took := time.Since(began)
		// What the Leases and the metric say.
		byReplica := map[string]*bridgeRun{}
		for _, r := range live() {
			byReplica[r.identity] = r
			if got := r.metricValue(t, "csibroker_driver_leader", map[string]string{"replica": r.identity}); int(got) != len(r.b.shards.Led()) {
				t.Errorf("%s: csibroker_driver_leader sums to %v, leads %d", r.identity, got, len(r.b.shards.Led()))
			}
		}
		for _, d := range names {
			l, err := c.CoordinationV1().Leases(ns).Get(ctx, shard.DriverLease("csibroker-leader", d), metav1.GetOptions{})
			if err != nil {
				t.Fatalf("driver %s Lease: %v", d, err)
			}
			h := ""
			if l.Spec.HolderIdentity != nil {
				h = *l.Spec.HolderIdentity
			}
			r := byReplica[h]
			if r == nil || !slices.Contains(r.b.shards.Led(), d) {
				t.Errorf("driver %s: Lease held by %q, which does not lead it", d, h)
				continue
			}
			if got := r.metricValue(t, "csibroker_driver_leader", map[string]string{"driver": d, "replica": h}); got != 1 {
				t.Errorf("driver %s: csibroker_driver_leader on %s is %v, want 1", d, h, got)
			}
		}
		coordinators := 0
		for _, r := range live() {
			if ok, _ := r.b.Leader(); ok {
				coordinators++
			}
		}
		if coordinators > 1 {
			t.Errorf("%d coordinators", coordinators)
		}
		var counts []string
		for _, r := range live() {
			counts = append(counts, fmt.Sprintf("%s:%d", r.identity, len(r.b.shards.Led())))
		}
		t.Logf("%s after %v: %s", what, took.Round(10*time.Millisecond), strings.Join(counts, " "))
		return took
	}
	bindAll := func(round string) {
		t.Helper()
		for i := range n {
			kubetest.MakeClaim(t, c, ns, fmt.Sprintf("%s-%02d", round, i), classes[i], "1Gi")
		}
		for i := range n {
			kubetest.WaitBound(t, c, ns, fmt.Sprintf("%s-%02d", round, i), 60*time.Second)
		}
	}

	// a, which will crash, first: alone, it takes every driver, and gives
	// them up as the others join.
	a := start("replica-a", true)
	start("replica-b", false)
	start("replica-c", false)
	settled("three replicas sharing 20 drivers", 60*time.Second)
	bindAll("three")

	start("replica-d", false)
	settled("a fourth replica joined", 30*time.Second)
	bindAll("four")

	// The crash: a's drivers get claims, then a dies.
	aDrivers := a.b.shards.Led()
	created := map[string]time.Time{}
	for i, d := range names {
		if slices.Contains(aDrivers, d) {
			name := fmt.Sprintf("crash-%02d", i)
			kubetest.MakeClaim(t, c, ns, name, classes[i], "1Gi")
			created[name] = time.Now()
		}
	}
	killed := time.Now()
	a.stop()
	lease, retry := a.b.Cfg.LeaderElectionLease, a.b.Cfg.LeaderElectionRetry
	handover := settled("replica-a crashed", 30*time.Second)
	t.Logf("replica-a led %d drivers; the others lead them all %v after the crash (lease duration %v, retry period %v)",
		len(aDrivers), handover.Round(10*time.Millisecond), lease, retry)
	// Settling is polled every 50ms on top; the API server and the
	// survivors' informers share two cores with the replicas.
	if limit := lease + retry + 500*time.Millisecond; handover > limit {
		t.Errorf("handover took %v, over the lease duration plus one retry (%v, with 500ms to observe)", handover, limit)
	}
	var slowest time.Duration
	for name, at := range created {
		kubetest.WaitBound(t, c, ns, name, 60*time.Second)
		pvc, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		// Bound when the PV controller bound it: the claim's last
		// transition is not recorded, so the PV's creation stands for it.
		pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if d := pv.CreationTimestamp.Sub(at); d > slowest {
			slowest = d
		}
	}
	t.Logf("claims of replica-a's drivers created just before the crash: the slowest had its PV %v after its creation (crash %v after the first)",
		slowest.Round(10*time.Millisecond), killed.Sub(minTime(created)).Round(10*time.Millisecond))
	if limit := lease + retry + 2*time.Second; slowest > limit {
		t.Errorf("a claim waited %v for its PV, over the lease duration plus one retry plus 2s to provision (%v)", slowest, limit)
	}
	bindAll("after")
	stopWatch()
	watched.Wait()
	if len(twice) > 0 {
		t.Fatalf("drivers led by two replicas at once: %v", twice[:min(len(twice), 10)])
	}
}

func minTime(m map[string]time.Time) time.Time {
	var out time.Time
	for _, v := range m {
		if out.IsZero() || v.Before(out) {
			out = v
		}
	}
	return out
}
