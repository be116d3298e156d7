package k8sbridge

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

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
	dead := map[*bridgeRun]bool{}
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
			if !dead[r] {
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
			// The status every replica gives (DriverLeaders, from the
			// Leases) says the same.
			for _, r := range rs {
				if got := r.b.DriverLeaders(); !maps.Equal(got, owner) {
					return false, fmt.Sprintf("%s says the leaders are %v", r.identity, got), nil
				}
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
	mu.Lock()
	dead[a] = true
	mu.Unlock()
	lease, retry := a.b.Cfg.LeaderElectionLease, a.b.Cfg.LeaderElectionRetry
	stopped := time.Since(killed)
	handover := stopped + settled("replica-a crashed", 30*time.Second)
	t.Logf("replica-a's Run returned %v after its stop began", stopped.Round(10*time.Millisecond))
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

// TestShardedHandoverDrainsCalls: a replica that leads two drivers, each
// with a CreateVolume in flight, gives one up when a second replica joins:
// it takes no new work for it, lets the call end (the drain), then writes
// the Lease free. The claim binds once, with one volume: nothing leaks,
// nothing is made twice.
func TestShardedHandoverDrainsCalls(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drivers := &testDrivers{}
	slow := sampledriver.Faults{Methods: map[string]sampledriver.Fault{"CreateVolume": {Latency: 1500 * time.Millisecond}}}
	var names []string
	var ds []*sampledriver.Driver
	for i := range 2 {
		drv := kubetest.ClusterName(ns, fmt.Sprintf("drain%d.csi.test", i))
		ds = append(ds, drivers.addDriver(t, sampledriver.Config{Name: drv, Faults: slow}))
		class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, fmt.Sprintf("drain%d", i)), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
		kubetest.MakeClaim(t, c, ns, fmt.Sprintf("claim%d", i), class.Name, "1Gi")
		names = append(names, drv)
	}
	perDriver := func(c *Config) { c.LeaderElectionMode = LeaderElectionPerDriver }
	a := startBridge(t, env, ns, drivers, bridgeOpts{identity: "replica-a", leader: true, configureCfg: perDriver})
	// Both CreateVolume calls in flight: their intents are recorded first.
	if err := testenv.WaitFor(ctx, 30*time.Second, "both intents recorded", func(ctx context.Context) (bool, string, error) {
		ins, err := a.b.Intents().List(ctx)
		return err == nil && len(ins) == 2, fmt.Sprint(len(ins)), nil
	}); err != nil {
		t.Fatal(err)
	}
	b := startBridge(t, env, ns, drivers, bridgeOpts{identity: "replica-b", leader: true, configureCfg: perDriver})
	if err := testenv.WaitFor(ctx, 30*time.Second, "one driver each", func(context.Context) (bool, string, error) {
		la, lb := a.b.shards.Led(), b.b.shards.Led()
		return len(la) == 1 && len(lb) == 1 && la[0] != lb[0], fmt.Sprint(la, lb), nil
	}); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		kubetest.WaitBound(t, c, ns, fmt.Sprintf("claim%d", i), 60*time.Second)
	}
	logs := a.logs.String()
	if !strings.Contains(logs, "giving driver up") || !strings.Contains(logs, "calls_in_flight=1") {
		t.Errorf("replica-a did not give a driver up with its call in flight; log:\n%s", tail(logs, 30))
	}
	if strings.Contains(logs, "cancelled") {
		t.Errorf("the call in flight was cancelled, not drained; log:\n%s", tail(logs, 30))
	}
	for i, d := range ds {
		if got := len(d.Volumes()); got != 1 {
			t.Errorf("driver %s has %d volumes for one claim", names[i], got)
		}
	}
}

// TestShardedMemberRenewalFails: the API server refuses one replica's
// member Lease renewals a while (a partition, say), while a CreateVolume
// of every driver is in flight. That replica stops leading its drivers
// within the renew deadline (its calls cancelled), before the other takes
// them once the lease duration has passed; no driver is led by both at
// any moment. Every claim binds, each driver holding one volume for it.
// When its renewals pass again the first replica rejoins and takes its
// share back.
func TestShardedMemberRenewalFails(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drivers := &testDrivers{}
	const n = 4
	slow := sampledriver.Faults{Methods: map[string]sampledriver.Fault{"CreateVolume": {Latency: 5 * time.Second}}}
	var classes []string
	var ds []*sampledriver.Driver
	for i := range n {
		drv := kubetest.ClusterName(ns, fmt.Sprintf("part%d.csi.test", i))
		ds = append(ds, drivers.addDriver(t, sampledriver.Config{Name: drv, Faults: slow}))
		classes = append(classes, kubetest.MakeClass(t, c, kubetest.ClusterName(ns, fmt.Sprintf("part%d", i)), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil).Name)
	}
	var failing atomic.Bool
	member := "/leases/" + shard.MemberLease("csibroker-leader", "replica-a")
	rc := rest.CopyConfig(env.RESTConfig())
	rc.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		return roundTripFunc(func(req *http.Request) (*http.Response, error) {
			if failing.Load() && req.Method == http.MethodPut && strings.HasSuffix(req.URL.Path, member) {
				return nil, errors.New("test: member lease renewal refused")
			}
			return rt.RoundTrip(req)
		})
	}
	leases := kubernetes.NewForConfigOrDie(rc)
	a := startBridge(t, env, ns, drivers, bridgeOpts{identity: "replica-a", leader: true, configureCfg: func(c *Config) {
		c.LeaderElectionMode, c.LeaseClient = LeaderElectionPerDriver, leases
	}})
	b := startBridge(t, env, ns, drivers, bridgeOpts{identity: "replica-b", leader: true, configureCfg: func(c *Config) { c.LeaderElectionMode = LeaderElectionPerDriver }})
	share := func(what string, wantA, wantB int) time.Duration {
		t.Helper()
		began := time.Now()
		if err := testenv.WaitFor(ctx, 30*time.Second, what, func(context.Context) (bool, string, error) {
			la, lb := a.b.shards.Led(), b.b.shards.Led()
			return len(la) == wantA && len(lb) == wantB, fmt.Sprint(la, lb), nil
		}); err != nil {
			t.Fatal(err)
		}
		return time.Since(began)
	}
	share("two drivers each", 2, 2)
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	both := make(chan string, 1)
	go func() {
		for watchCtx.Err() == nil {
			for _, d := range a.b.shards.Led() {
				if slices.Contains(b.b.shards.Led(), d) {
					select {
					case both <- d:
					default:
					}
				}
			}
			kube.SleepCtx(watchCtx, 10*time.Millisecond)
		}
	}()
	for i, class := range classes {
		kubetest.MakeClaim(t, c, ns, fmt.Sprintf("data%d", i), class, "1Gi")
	}
	// Every CreateVolume in flight: their intents are recorded first.
	if err := testenv.WaitFor(ctx, 30*time.Second, "every intent recorded", func(ctx context.Context) (bool, string, error) {
		ins, err := a.b.Intents().List(ctx)
		return err == nil && len(ins) == n, fmt.Sprint(len(ins)), nil
	}); err != nil {
		t.Fatal(err)
	}
	failing.Store(true)
	stopped := share("replica-a stops leading", 0, 2)
	taken := stopped + share("replica-b takes every driver", 0, n)
	lease, renew, retry := a.b.Cfg.LeaderElectionLease, a.b.Cfg.LeaderElectionRenew, a.b.Cfg.LeaderElectionRetry
	t.Logf("renewals refused: replica-a stopped leading after %v, replica-b led all after %v (renew deadline %v, lease %v, retry %v)",
		stopped.Round(10*time.Millisecond), taken.Round(10*time.Millisecond), renew, lease, retry)
	if stopped > renew+retry+500*time.Millisecond {
		t.Errorf("replica-a kept leading %v after its renewals began to fail", stopped)
	}
	if taken > lease+retry+500*time.Millisecond {
		t.Errorf("replica-b took replica-a's drivers %v after replica-a's renewals began to fail", taken)
	}
	for i := range n {
		kubetest.WaitBound(t, c, ns, fmt.Sprintf("data%d", i), 60*time.Second)
	}
	for i, d := range ds {
		if got := len(d.Volumes()); got != 1 {
			t.Errorf("driver %d has %d volumes for one claim", i, got)
		}
	}
	// Its calls were cancelled as it stopped (not left running until
	// the driver answered), and taken up by replica-b.
	if logs := a.logs.String(); !strings.Contains(logs, "stopped leading driver") || !strings.Contains(logs, "code = Canceled") {
		t.Errorf("replica-a did not stop leading with its calls cancelled; log:\n%s", tail(logs, 30))
	}
	failing.Store(false)
	share("replica-a back, two each again", 2, 2)
	stopWatch()
	select {
	case d := <-both:
		t.Fatalf("driver %s led by both replicas at once", d)
	default:
	}
}

// TestPerDriverWorksWithTheDeployedRBAC: two replicas with per-driver
// leader election, every request made as a service account holding
// exactly deploy/base/rbac.yaml's ClusterRole and Role and
// deploy/per-driver/rbac.yaml's Role, share two drivers and bind a claim
// of each; neither logs a forbidden request. test/deploy says what the
// manifests grant; this says the sharded broker needs no more.
func TestPerDriverWorksWithTheDeployedRBAC(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ctx, c, ns := context.Background(), env.Client(), env.NewNamespace(t)
	clusterRules, nsRules := deployedRBAC(t)
	f, err := os.Open(filepath.Join("..", "deploy", "per-driver", "rbac.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var shardRules []rbacv1.PolicyRule
	dec := utilyaml.NewYAMLOrJSONDecoder(f, 4096)
	for {
		var r rbacv1.Role
		if err := dec.Decode(&r); err != nil {
			break
		}
		if r.Kind == "Role" {
			shardRules = r.Rules
		}
	}
	if len(shardRules) == 0 {
		t.Fatal("deploy/per-driver/rbac.yaml: no Role rules")
	}
	sa := rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Name: "csibroker", Namespace: ns}
	roleName := kubetest.ClusterName(ns, "broker")
	if _, err := c.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: roleName}, Rules: clusterRules}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.RbacV1().ClusterRoles().Delete(context.Background(), roleName, metav1.DeleteOptions{}) })
	if _, err := c.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: roleName},
		RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: roleName}, Subjects: []rbacv1.Subject{sa}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.RbacV1().ClusterRoleBindings().Delete(context.Background(), roleName, metav1.DeleteOptions{})
	})
	for name, rules := range map[string][]rbacv1.PolicyRule{"csibroker": nsRules, "csibroker-per-driver": shardRules} {
		if _, err := c.RbacV1().Roles(ns).Create(ctx, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: name}, Rules: rules}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if _, err := c.RbacV1().RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: name},
			RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: name}, Subjects: []rbacv1.Subject{sa}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	asBroker := rest.CopyConfig(env.RESTConfig())
	asBroker.Impersonate = rest.ImpersonationConfig{UserName: "system:serviceaccount:" + ns + ":csibroker",
		Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"}}
	brokerClient := kubernetes.NewForConfigOrDie(asBroker)
	if err := testenv.WaitFor(ctx, 30*time.Second, "the broker's RBAC in effect", func(ctx context.Context) (bool, string, error) {
		_, err := brokerClient.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{Limit: 1})
		return err == nil, fmt.Sprint(err), nil
	}); err != nil {
		t.Fatal(err)
	}
	drivers := &testDrivers{}
	var classes []string
	for i := range 2 {
		drv := kubetest.ClusterName(ns, fmt.Sprintf("rbac%d.csi.test", i))
		drivers.addDriver(t, sampledriver.Config{Name: drv})
		classes = append(classes, kubetest.MakeClass(t, c, kubetest.ClusterName(ns, fmt.Sprintf("rbac%d", i)), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil).Name)
	}
	var rs []*bridgeRun
	for _, id := range []string{"replica-a", "replica-b"} {
		rs = append(rs, startBridge(t, env, ns, drivers, bridgeOpts{identity: id, leader: true, configureCfg: func(cfg *Config) {
			cfg.Client, cfg.SnapshotClient, cfg.LeaderElectionMode = brokerClient, nil, LeaderElectionPerDriver
		}}))
	}
	if err := testenv.WaitFor(ctx, 30*time.Second, "one driver each", func(context.Context) (bool, string, error) {
		la, lb := rs[0].b.shards.Led(), rs[1].b.shards.Led()
		return len(la) == 1 && len(lb) == 1, fmt.Sprint(la, lb), nil
	}); err != nil {
		t.Fatal(err)
	}
	for i, class := range classes {
		kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, fmt.Sprintf("data%d", i), class, "1Gi").Name, 60*time.Second)
	}
	for _, r := range rs {
		for _, line := range strings.Split(r.logs.String(), "\n") {
			if strings.Contains(line, "forbidden") {
				t.Errorf("%s: a request was forbidden: %s", r.identity, line)
			}
		}
	}
}
