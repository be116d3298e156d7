package k8sbridge

import (
	"context"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/testenv"
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
	if _, ok := got["d3"]; ok || len(problems) != 2 {
		t.Fatalf("problems %v", problems)
	}
	if err := d1.Validate(); err != nil {
		t.Fatal(err)
	}
}

type fakeRegistry struct {
	mu      sync.Mutex
	drivers map[string]broker.DriverConfig
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
	delete(f.drivers, n)
}

func (f *fakeRegistry) get(n string) (broker.DriverConfig, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	c, ok := f.drivers[n]
	return c, ok
}

var _ Registry = (*fakeRegistry)(nil)

// TestDiscoveryOnRealAPIServer: proxy pods appear, become ready, move and go
// away; the registry follows. The static driver is never touched.
func TestDiscoveryOnRealAPIServer(t *testing.T) {
	env := testenv.Shared(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	reg := &fakeRegistry{drivers: map[string]broker.DriverConfig{}}
	drv := clusterName(ns, "disc.csi.test")
	selector := "csibroker-test=" + ns
	// Two proxy namespaces (one watch of all namespaces, filtered); a
	// tenant's namespace is not one of them.
	tenant := env.NewNamespace(t)
	d, err := NewDiscovery(c, selector, []string{ns, env.NewNamespace(t)}, reg, broker.DriverConfig{}, []string{"static.csi.test"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	go d.Run(ctx)

	mk := func(pns, drv, name, ip string, nodeProxy bool) {
		p := proxyPod(name, drv, "", "", nodeProxy, false, "")
		p.Namespace = pns
		p.Labels = map[string]string{"csibroker-test": ns}
		p.Spec.Containers = []corev1.Container{{Name: "proxy", Image: "csibroker"}}
		p.Status = corev1.PodStatus{}
		created, err := c.CoreV1().Pods(pns).Create(ctx, p, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		// The scheduler updates the pod too (no node can take it), so retry
		// on conflicts, as a kubelet would.
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
	// A Ready pod in the tenant's namespace, offering a proxy of its own
	// driver: created first, and never registered.
	impostor := clusterName(tenant, "impostor.csi.test")
	mk(tenant, impostor, "impostor", "10.9.9.9", false)
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
	if err := c.CoreV1().Pods(ns).Delete(ctx, "controller", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	err = testenv.WaitFor(ctx, 30*time.Second, "driver removed", func(context.Context) (bool, string, error) {
		_, ok := reg.get(drv)
		return !ok, "", nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
