package discovery

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"reflect"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/retry"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
)

func proxyPod(name, driver, ip, node string, nodeProxy, ready bool, port string) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "drivers", Labels: map[string]string{"app.kubernetes.io/component": "csibroker-proxy"},
		Annotations: map[string]string{AnnDriver: driver}}, Spec: corev1.PodSpec{NodeName: node},
		Status: corev1.PodStatus{PodIP: ip}}
	if nodeProxy {
		p.Annotations[AnnNodeProxy] = "true"
	}
	if port != "" {
		p.Annotations[AnnProxyPort] = port
	}
	st := corev1.ConditionFalse
	if ready {
		st = corev1.ConditionTrue
	}
	p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: st}}
	return p
}

func TestDriversFromPods(t *testing.T) {
	tmpl := broker.DriverConfig{Timeout: time.Minute}
	pods := []*corev1.Pod{
		proxyPod("ctrl-b", "d1", "10.0.0.2", "n1", false, true, ""),
		proxyPod("ctrl-a", "d1", "10.0.0.1", "n1", false, true, "9000"),
		proxyPod("node-1", "d1", "10.0.1.1", "n1", true, true, ""),
		proxyPod("node-2", "d1", "10.0.1.2", "n2", true, true, ""),
		proxyPod("node-3-notready", "d1", "10.0.1.3", "n3", true, false, ""),
		proxyPod("no-ip", "d2", "", "n1", false, true, ""),
		proxyPod("bad-port", "d3", "10.0.2.1", "n1", false, true, "http"),
		proxyPod("no-driver", "", "10.0.3.1", "n1", false, true, ""),
		proxyPod("not-csi", "my_driver", "10.0.4.1", "n1", false, true, ""),
	}
	got, problems := DriversFromPods(pods, tmpl)
	d1 := got["d1"]
	if d1.Controller == nil || d1.Controller.Address != "10.0.0.1:9000" {
		t.Fatalf("controller %+v: want the first pod by name", d1.Controller)
	}
	if len(d1.Nodes) != 2 || d1.Nodes[0] != (broker.ProxyConfig{Node: "n1", Address: "10.0.1.1:7443"}) || d1.Nodes[1].Node != "n2" {
		t.Fatalf("nodes %+v", d1.Nodes)
	}
	if d1.Timeout != time.Minute {
		t.Fatal("template not applied")
	}
	if _, ok := got["d2"]; ok {
		t.Fatal("a pod without an IP registered a driver")
	}
	if _, ok := got["d3"]; ok || len(problems) != 4 {
		t.Fatalf("problems %v", problems)
	}
	if _, ok := got["my_driver"]; ok {
		t.Fatal("a driver name CSI does not allow was registered")
	}
	for i, want := range []struct{ pod, reason, says string }{
		{"bad-port", ReasonProxyAnnotationInvalid, `"http" is not a port`},
		{"ctrl-b", ReasonProxyNotUsed, "not used: pod drivers/ctrl-a (first by name) is the controller proxy of d1"},
		{"no-driver", ReasonProxyAnnotationInvalid, "no " + AnnDriver + " annotation"},
		{"not-csi", ReasonProxyAnnotationInvalid, `annotation ` + AnnDriver + `: driver name "my_driver" has '_'`},
	} {
		if p := problems[i]; p.Pod.Name != want.pod || p.Reason != want.reason || !strings.Contains(p.Message, want.says) {
			t.Errorf("problem %d: %s (reason %s), want pod %s, %s, saying %q", i, p, p.Reason, want.pod, want.reason, want.says)
		}
	}
	if err := d1.Validate(); err != nil {
		t.Fatal(err)
	}
}

type fakeRegistry struct {
	mu      sync.Mutex
	drivers map[string]broker.DriverConfig
	removed int // RemoveDriver calls for a registered driver
}

func (f *fakeRegistry) SetDriver(c broker.DriverConfig) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.drivers[c.Name] = c
	return nil
}

func (f *fakeRegistry) RemoveDriver(n string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.drivers[n]; ok {
		f.removed++
	}
	delete(f.drivers, n)
}

func (f *fakeRegistry) get(n string) (broker.DriverConfig, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	c, ok := f.drivers[n]
	return c, ok
}

var _ Registry = (*fakeRegistry)(nil)

// waitRemoved waits until driver drv is no longer registered.
func (f *fakeRegistry) waitRemoved(t *testing.T, ctx context.Context, drv string) {
	t.Helper()
	err := testenv.WaitFor(ctx, 30*time.Second, "driver "+drv+" removed", func(context.Context) (bool, string, error) {
		_, ok := f.get(drv)
		return !ok, "", nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// deletePods deletes pods of namespace ns at once (no grace period).
func deletePods(t *testing.T, ctx context.Context, c kubernetes.Interface, ns string, pods ...string) {
	t.Helper()
	for _, pod := range pods {
		if err := c.CoreV1().Pods(ns).Delete(ctx, pod, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
			t.Fatal(err)
		}
	}
}

// makeReadyProxyPod creates a proxy pod of driver drv in namespace pns,
// labelled for selector "csibroker-test=<label>", and marks it Running and
// Ready at ip, as a kubelet would.
func makeReadyProxyPod(t *testing.T, ctx context.Context, c kubernetes.Interface, label, pns, drv, name, ip, port string, nodeProxy bool) {
	t.Helper()
	p := proxyPod(name, drv, "", "", nodeProxy, false, port)
	p.Namespace = pns
	p.Labels = map[string]string{"csibroker-test": label}
	p.Spec.Containers = []corev1.Container{{Name: "proxy", Image: "csibroker"}}
	// No scheduler takes it, so the pod changes only when the test
	// changes it.
	p.Spec.SchedulerName = "csibroker-test-no-scheduler"
	p.Status = corev1.PodStatus{}
	created, err := c.CoreV1().Pods(pns).Create(ctx, p, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// Retry on conflicts, as a kubelet would.
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := c.CoreV1().Pods(pns).Get(ctx, created.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		cur.Status = corev1.PodStatus{PodIP: ip, Phase: corev1.PodRunning, Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}}
		_, err = c.CoreV1().Pods(pns).UpdateStatus(ctx, cur, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

// runDiscovery runs d until the test ends and fails the test if Run
// returns an error.
func runDiscovery(t *testing.T, d *Discovery) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("discovery: Run: %v", err)
			}
		case <-time.After(20 * time.Second):
			t.Errorf("discovery: Run did not return within 20s of its context's end")
		}
	})
}

// TestDiscoveryOnRealAPIServer: proxy pods appear, become ready, move and go
// away; the registry follows. The static driver is never touched, even when
// a Ready proxy pod names it.
func TestDiscoveryOnRealAPIServer(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const static = "static.csi.test"
	staticCfg := broker.DriverConfig{Name: static, Controller: &broker.ProxyConfig{Address: "192.0.2.1:7443"}, Timeout: time.Minute}
	reg := &fakeRegistry{drivers: map[string]broker.DriverConfig{static: staticCfg}}
	drv := kubetest.ClusterName(ns, "disc.csi.test")
	selector := "csibroker-test=" + ns
	logs := &chaintest.SyncBuffer{}
	// Two proxy namespaces (one watch of all namespaces, filtered); a
	// tenant's namespace is not one of them.
	tenant := env.NewNamespace(t)
	d, err := New(c, selector, []string{ns, env.NewNamespace(t)}, reg, broker.DriverConfig{}, []string{static}, slog.New(slog.NewTextHandler(logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	d.goneGrace = 200 * time.Millisecond
	// Events go to the API server, as the broker's do; this replica is a
	// standby until the test says otherwise.
	bcast := record.NewBroadcaster(record.WithContext(ctx))
	bcast.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: c.CoreV1().Events("")})
	defer bcast.Shutdown()
	var leading atomic.Bool
	d.ReportTo(bcast.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "csibroker-test"}), leading.Load)
	runDiscovery(t, d)

	mk := func(pns, drv, name, ip string, nodeProxy bool) {
		t.Helper()
		makeReadyProxyPod(t, ctx, c, ns, pns, drv, name, ip, "", nodeProxy)
	}
	// A Ready pod in the tenant's namespace, offering a proxy of its own
	// driver, and a Ready pod in a proxy namespace naming the static
	// driver: created first, and never registered.
	impostor := kubetest.ClusterName(tenant, "impostor.csi.test")
	mk(tenant, impostor, "impostor", "10.9.9.9", false)
	mk(ns, static, "static-proxy", "10.8.8.8", false)
	makeReadyProxyPod(t, ctx, c, ns, ns, drv, "bad-port", "10.1.0.9", "http", false)
	mk(ns, drv, "controller", "10.1.0.1", false)
	err = testenv.WaitFor(ctx, 30*time.Second, "driver discovered", func(context.Context) (bool, string, error) {
		cfg, ok := reg.get(drv)
		return ok && cfg.Controller != nil && cfg.Controller.Address == "10.1.0.1:7443", "", nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if cfg, ok := reg.get(impostor); ok {
		t.Fatalf("a pod outside the proxy namespaces was registered: %+v", cfg)
	}
	// The pass that registered drv saw the static driver's pod (made
	// before it): it said so and left the static entry as it was.
	if !strings.Contains(logs.String(), "reason="+ReasonProxyShadowed) || !strings.Contains(logs.String(), "names driver "+static) {
		t.Errorf("no warning about the pod naming the static driver:\n%s", logs.String())
	}
	// This replica becomes the leader: each pod it cannot use gets its
	// Warning Event, with no pod changing.
	leading.Store(true)
	kubetest.WaitEvent(t, c, tenant, "impostor", ReasonProxyOutsideNamespaces, "namespace "+tenant+", where proxies are not discovered")
	kubetest.WaitEvent(t, c, ns, "static-proxy", ReasonProxyShadowed, "names driver "+static)
	kubetest.WaitEvent(t, c, ns, "bad-port", ReasonProxyAnnotationInvalid, `csibroker.io/proxy-port "http" is not a port`)
	if cfg, ok := reg.get(static); !ok || !reflect.DeepEqual(cfg, staticCfg) {
		t.Fatalf("static entry %s (present %v), want %s untouched", describeDriverConfig(cfg), ok, describeDriverConfig(staticCfg))
	}
	// The static driver's pod goes first: the pass that removes drv has
	// seen it gone.
	deletePods(t, ctx, c, ns, "static-proxy", "controller")
	reg.waitRemoved(t, ctx, drv)
	// Its pod gone too, the static driver is still registered as it was.
	if cfg, ok := reg.get(static); !ok || !reflect.DeepEqual(cfg, staticCfg) {
		t.Fatalf("static entry %s (present %v) after its pod went away, want %s untouched", describeDriverConfig(cfg), ok, describeDriverConfig(staticCfg))
	}
}

// TestDiscoveryKeepsADriverThroughABriefUnreadiness: a driver whose only
// proxy pod goes not Ready for less than the grace keeps its registration
// throughout (a readiness blip or a rollout must not make the broker forget
// the driver's objects); once its pod is gone for longer, it is removed,
// not before the grace has passed.
func TestDiscoveryKeepsADriverThroughABriefUnreadiness(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	reg := &fakeRegistry{drivers: map[string]broker.DriverConfig{}}
	drv := kubetest.ClusterName(ns, "blip.csi.test")
	d, err := New(c, "csibroker-test="+ns, []string{ns}, reg, broker.DriverConfig{}, nil, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	// A fake clock measures the grace: the test steps it, so nothing
	// here waits for time to pass or for something not to happen.
	const grace = 30 * time.Second
	fake := testingclock.NewFakeClock(time.Now())
	d.goneGrace, d.clock = grace, fake
	runDiscovery(t, d)
	makeReadyProxyPod(t, ctx, c, ns, ns, drv, "proxy", "10.1.0.1", "", false)
	err = testenv.WaitFor(ctx, 30*time.Second, "driver discovered", func(context.Context) (bool, string, error) {
		_, ok := reg.get(drv)
		return ok, "", nil
	})
	if err != nil {
		t.Fatal(err)
	}
	setReady := func(ready corev1.ConditionStatus) {
		t.Helper()
		err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			cur, err := c.CoreV1().Pods(ns).Get(ctx, "proxy", metav1.GetOptions{})
			if err != nil {
				return err
			}
			cur.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: ready}}
			_, err = c.CoreV1().Pods(ns).UpdateStatus(ctx, cur, metav1.UpdateOptions{})
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	// waitGone waits until discovery's last sync saw drv without a Ready
	// proxy pod (gone) or with one again (!gone).
	waitGone := func(gone bool, what string) {
		t.Helper()
		err := testenv.WaitFor(ctx, 30*time.Second, what, func(context.Context) (bool, string, error) {
			d.mu.Lock()
			_, ok := d.goneSince[drv]
			d.mu.Unlock()
			return ok == gone, "", nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	removals := func() int {
		reg.mu.Lock()
		defer reg.mu.Unlock()
		return reg.removed
	}

	setReady(corev1.ConditionFalse)
	waitGone(true, "discovery to see the proxy pod not Ready")
	if _, ok := reg.get(drv); !ok {
		t.Fatal("the driver was removed as soon as its proxy pod went not Ready")
	}
	setReady(corev1.ConditionTrue)
	waitGone(false, "discovery to see the proxy pod Ready again")
	// Past the grace of the blip: the timer it set fires and discovery
	// syncs. Had it removed the driver then, the next pass (the pod's
	// deletion, below) would find no registered driver to keep.
	fake.Step(grace)

	deletePods(t, ctx, c, ns, "proxy")
	waitGone(true, "discovery to see the proxy pod gone")
	if _, ok := reg.get(drv); !ok || removals() != 0 {
		t.Fatalf("after a blip shorter than the grace: registered %v, %d removals; want kept throughout", ok, removals())
	}
	// Just short of the grace, a pass (another driver's pod appearing)
	// keeps the driver; at the grace, it is removed.
	fake.Step(grace - time.Millisecond)
	other := kubetest.ClusterName(ns, "other.csi.test")
	makeReadyProxyPod(t, ctx, c, ns, ns, other, "other-proxy", "10.1.0.2", "", false)
	err = testenv.WaitFor(ctx, 30*time.Second, "the other driver discovered", func(context.Context) (bool, string, error) {
		_, ok := reg.get(other)
		return ok, "", nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := reg.get(drv); !ok || removals() != 0 {
		t.Fatalf("driver removed %v before the grace of %v (registered %v, %d removals)", grace-time.Millisecond, grace, ok, removals())
	}
	fake.Step(time.Millisecond)
	reg.waitRemoved(t, ctx, drv)
}

func describeDriverConfig(c broker.DriverConfig) string {
	ctrl := "none"
	if c.Controller != nil {
		ctrl = c.Controller.Address
	}
	return fmt.Sprintf("{name %s controller %s nodes %v timeout %v}", c.Name, ctrl, c.Nodes, c.Timeout)
}

// TestDiscoveryFeedsBroker: discovery registers a proxy pod's driver with a
// real broker, whose calls then reach that driver through its proxy over
// mTLS; a pod naming the broker's static driver changes nothing; the
// driver is unregistered when its pod goes away.
func TestDiscoveryFeedsBroker(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	found, static := kubetest.ClusterName(ns, "found.csi.test"), kubetest.ClusterName(ns, "static.csi.test")
	quiet := slog.New(slog.DiscardHandler)
	// The discovered driver's proxy (its certificate names found); the
	// broker of its chain is not used.
	ep, _ := sampledriver.StartTest(t, sampledriver.Config{Name: found, Logger: quiet})
	foundChain := chaintest.Start(t, chaintest.Options{Driver: found, DriverEndpoint: ep, LogLevel: slog.LevelWarn, Timeout: 30 * time.Second})
	// The broker under test, with static registered at start-up.
	ep, _ = sampledriver.StartTest(t, sampledriver.Config{Name: static, Logger: quiet})
	brokerChain := chaintest.Start(t, chaintest.Options{Driver: static, DriverEndpoint: ep, LogLevel: slog.LevelWarn, Timeout: 30 * time.Second})
	br := brokerChain.Broker
	staticStatus := driverStatus(t, br, static)

	d, err := New(c, "csibroker-test="+ns, []string{ns}, br, broker.DriverConfig{Timeout: 30 * time.Second}, []string{static}, quiet)
	if err != nil {
		t.Fatal(err)
	}
	d.goneGrace = 200 * time.Millisecond
	runDiscovery(t, d)
	host, port, err := net.SplitHostPort(foundChain.ProxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	// A pod naming the static driver, at an address nobody serves: made
	// first, so the pass that registers found has seen it.
	makeReadyProxyPod(t, ctx, c, ns, ns, static, "static-proxy", host, "1", false)
	makeReadyProxyPod(t, ctx, c, ns, ns, found, "found-proxy", host, port, false)

	pluginName := func(ctx context.Context, driver string) (string, error) {
		conn, err := br.ControllerConn(driver)
		if err != nil {
			return "", err
		}
		resp, err := csi.NewIdentityClient(conn).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
		return resp.GetName(), err
	}
	err = testenv.WaitFor(ctx, 30*time.Second, "the broker to reach "+found+" through the discovered proxy", func(ctx context.Context) (bool, string, error) {
		name, err := pluginName(ctx, found)
		if err != nil {
			return false, err.Error(), nil
		}
		if name != found {
			return false, "", fmt.Errorf("GetPluginInfo through %s's route answered %q", found, name)
		}
		return true, "", nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if st := driverStatus(t, br, found); len(st.Proxies) != 1 || st.Proxies[0].Address != foundChain.ProxyAddr || st.Proxies[0].Node != "" {
		t.Errorf("%s registered as %+v, want its controller proxy at %s", found, st.Proxies, foundChain.ProxyAddr)
	}
	if st := driverStatus(t, br, static); !reflect.DeepEqual(st.Proxies, staticStatus.Proxies) {
		t.Errorf("static driver %s: proxies %+v, want %+v untouched by the pod naming it", static, st.Proxies, staticStatus.Proxies)
	}
	if name, err := pluginName(ctx, static); err != nil || name != static {
		t.Errorf("static driver %s: GetPluginInfo answered %q, %v", static, name, err)
	}

	// Both pods go: found is unregistered, static stays.
	deletePods(t, ctx, c, ns, "static-proxy", "found-proxy")
	err = testenv.WaitFor(ctx, 30*time.Second, found+" unregistered", func(context.Context) (bool, string, error) {
		_, err := br.ControllerConn(found)
		return errors.Is(err, broker.ErrUnknownDriver), fmt.Sprint(err), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := br.DriverNames(); !reflect.DeepEqual(got, []string{static}) {
		t.Errorf("registered drivers %v, want only the static %s", got, static)
	}
	if name, err := pluginName(ctx, static); err != nil || name != static {
		t.Errorf("static driver %s after the pods went: GetPluginInfo answered %q, %v", static, name, err)
	}
}

func driverStatus(t *testing.T, br *broker.Broker, driver string) broker.DriverStatus {
	t.Helper()
	for _, s := range br.Status() {
		if s.Name == driver {
			for i := range s.Proxies {
				s.Proxies[i].State = "" // connection state comes and goes
			}
			return s
		}
	}
	t.Fatalf("driver %s is not registered with the broker (%v)", driver, br.DriverNames())
	return broker.DriverStatus{}
}

// TestDiscoveryWarnsOncePerProblem: a problem that stands (a pod's bad port
// annotation) is logged when it appears, not again at every later sync,
// and again once it has gone and come back.
func TestDiscoveryWarnsOncePerProblem(t *testing.T) {
	idx := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
	bad := proxyPod("bad-port", "d3", "10.0.2.1", "n1", false, true, "http")
	idx.Add(bad)
	var logs bytes.Buffer
	d, err := New(nil, "app=proxy", nil, &fakeRegistry{drivers: map[string]broker.DriverConfig{}}, broker.DriverConfig{}, nil, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	d.pods = corelisters.NewPodLister(idx)
	count := func() int { return strings.Count(logs.String(), "bad-port") }
	d.sync()
	d.sync()
	if n := count(); n != 1 {
		t.Fatalf("after two syncs the pod's problem was logged %d times, want once:\n%s", n, logs.String())
	}
	idx.Delete(bad)
	d.sync()
	idx.Add(bad)
	d.sync()
	if n := count(); n != 2 {
		t.Fatalf("a problem back after it went was logged %d times in all, want twice:\n%s", n, logs.String())
	}
}

// TestDiscoveryEventsFromTheLeader: a problem pod gets a Warning Event
// from the replica that leads, once while the problem stands; a standby
// records none, and a replica that becomes the leader records the problems
// that stand.
func TestDiscoveryEventsFromTheLeader(t *testing.T) {
	idx := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
	bad := proxyPod("bad-port", "d3", "10.0.2.1", "n1", false, true, "http")
	bad.UID = "uid-bad-port"
	static := proxyPod("static-proxy", "static.csi.test", "10.0.2.2", "n1", false, true, "")
	static.UID = "uid-static"
	idx.Add(bad)
	idx.Add(static)
	d, err := New(nil, "app=proxy", nil, &fakeRegistry{drivers: map[string]broker.DriverConfig{}}, broker.DriverConfig{}, []string{"static.csi.test"}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	d.pods = corelisters.NewPodLister(idx)
	rec := record.NewFakeRecorder(100)
	var leading atomic.Bool
	d.ReportTo(rec, leading.Load)
	events := func() []string {
		var got []string
		for {
			select {
			case e := <-rec.Events:
				got = append(got, e)
			default:
				sort.Strings(got)
				return got
			}
		}
	}
	d.sync()
	if got := events(); len(got) != 0 {
		t.Fatalf("a standby recorded Events: %q", got)
	}
	leading.Store(true)
	d.sync()
	d.sync()
	got := events()
	if len(got) != 2 || !strings.HasPrefix(got[0], "Warning "+ReasonProxyAnnotationInvalid+` csibroker.io/proxy-port "http" is not a port`) ||
		!strings.HasPrefix(got[1], "Warning "+ReasonProxyShadowed+" names driver static.csi.test, which the broker's static registry configures") {
		t.Fatalf("the leader's Events over two syncs: %q, want one %s and one %s", got, ReasonProxyAnnotationInvalid, ReasonProxyShadowed)
	}
	// Leadership lost, then won again: the problems that stand are
	// recorded by the new term.
	leading.Store(false)
	d.sync()
	leading.Store(true)
	idx.Delete(static)
	d.sync()
	if got := events(); len(got) != 1 || !strings.HasPrefix(got[0], "Warning "+ReasonProxyAnnotationInvalid) {
		t.Fatalf("Events after leadership came back: %q, want the bad port's again", got)
	}
}

// TestDiscoveryNudgedWhenItBecomesTheLeader: a standby that becomes the
// leader syncs again though no pod changed, so that it records the Events
// of the problems that stand (TestDiscoveryEventsFromTheLeader: a sync as
// the leader records them).
func TestDiscoveryNudgedWhenItBecomesTheLeader(t *testing.T) {
	d, err := New(nil, "app=proxy", nil, &fakeRegistry{drivers: map[string]broker.DriverConfig{}}, broker.DriverConfig{}, nil, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	d.leaderPoll = 10 * time.Millisecond
	var leading atomic.Bool
	d.ReportTo(record.NewFakeRecorder(1), leading.Load)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); d.watchLeadership(ctx, false) }()
	defer func() { cancel(); <-done }()
	leading.Store(true)
	select {
	case <-d.kick:
	case <-time.After(10 * time.Second):
		t.Fatal("no sync asked for 10s after this replica became the leader")
	}
}

// A second proxy for a node already served, and pods of one driver that
// disagree about node-local, are said on the pods concerned.
func TestDriversFromPodsConflicts(t *testing.T) {
	local := func(p *corev1.Pod) *corev1.Pod { p.Annotations[AnnNodeLocal] = "true"; return p }
	pods := []*corev1.Pod{
		local(proxyPod("node-1", "d1", "10.0.1.1", "n1", true, true, "")),
		local(proxyPod("node-1-old", "d1", "10.0.1.9", "n1", true, true, "")),
		proxyPod("ctrl", "d1", "10.0.0.1", "n2", false, true, ""),
	}
	got, problems := DriversFromPods(pods, broker.DriverConfig{Timeout: time.Minute})
	d1 := got["d1"]
	if !d1.NodeLocal || len(d1.Nodes) != 1 || d1.Nodes[0].Address != "10.0.1.1:7443" || d1.Controller == nil {
		t.Fatalf("driver %+v", d1)
	}
	if len(problems) != 2 {
		t.Fatalf("problems %v, want two", problems)
	}
	for i, want := range []struct{ pod, says string }{
		{"node-1-old", "not used: pod drivers/node-1 (first by name) is the proxy of d1 on node n1"},
		{"ctrl", "has no " + AnnNodeLocal + "=true annotation, but pod drivers/node-1 of driver d1 has"},
	} {
		if p := problems[i]; p.Pod.Name != want.pod || p.Reason != ReasonProxyNotUsed || !strings.Contains(p.Message, want.says) {
			t.Errorf("problem %d: %s (reason %s), want pod %s saying %q", i, p, p.Reason, want.pod, want.says)
		}
	}
}
