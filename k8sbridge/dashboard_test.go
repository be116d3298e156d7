package k8sbridge

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
	"github.com/csibroker/csibroker/policy"
)

// TestDashboardMetricsAreExported runs the broker through provisioning
// (with a retry and a policy decision), deletion and leaked-volume recovery,
// scrapes its /metrics and the proxy's, and checks that every metric the
// Grafana dashboard in deploy/ queries is among them.
func TestDashboardMetricsAreExported(t *testing.T) {
	raw, err := os.ReadFile("../deploy/monitoring/grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	wanted := map[string]bool{}
	for _, m := range regexp.MustCompile(`\b(csibroker_[a-z_]+|csi_sidecar_[a-z_]+|grpc_server_[a-z_]+)`).FindAllString(string(raw), -1) {
		for _, suf := range []string{"_bucket", "_sum", "_count"} {
			m = strings.TrimSuffix(m, suf)
		}
		wanted[m] = true
	}
	if len(wanted) < 10 {
		t.Fatalf("only %d metrics found in the dashboard: the check would prove little", len(wanted))
	}

	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv, slow := kubetest.ClusterName(ns, "metrics.csi.test"), kubetest.ClusterName(ns, "slowm.csi.test")
	drivers := &testDrivers{}
	drivers.addDriver(t, sampledriver.Config{Name: drv, Faults: sampledriver.Faults{Methods: map[string]sampledriver.Fault{"CreateVolume": {First: 1, Code: 14}}}})
	dSlow := drivers.addDriver(t, sampledriver.Config{Name: slow, Faults: sampledriver.Faults{Methods: map[string]sampledriver.Fault{"CreateVolume": {Latency: time.Second}}}})
	if _, err := c.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "creds"}, StringData: map[string]string{"k": "v"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	rs, errs := policy.Compile([]policy.Grant{{Namespace: ns, Name: "g", Spec: policy.GrantSpec{Drivers: []string{drv}, SecretNames: []string{"creds"},
		Operations: []policy.Operation{policy.AnyOperation}, Requesters: policy.Requesters{Namespaces: []string{policy.Wildcard}}}}})
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	imm, del := storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "m"), drv, imm, del, map[string]string{
		"csi.storage.k8s.io/provisioner-secret-name": "creds", "csi.storage.k8s.io/provisioner-secret-namespace": ns})
	slowClass := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "s"), slow, imm, del, nil)
	r := startBridge(t, env, ns, drivers, bridgeOpts{policy: &policy.Authorizer{Rules: policy.NewStore(rs)}})

	bound := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "m", class.Name, "1Gi").Name, 60*time.Second)
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "m", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.MakeClaim(t, c, ns, "gone", slowClass.Name, "1Gi")
	if err := testenv.WaitFor(ctx, 30*time.Second, "slow CreateVolume in flight", func(context.Context) (bool, string, error) {
		return dSlow.CallCount("CreateVolume") > 0, "", nil
	}); err != nil {
		t.Fatal(err)
	}
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "gone", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := testenv.WaitFor(ctx, 60*time.Second, "deletion and recovery done", func(ctx context.Context) (bool, string, error) {
		_, err := c.CoreV1().PersistentVolumes().Get(ctx, bound.Spec.VolumeName, metav1.GetOptions{})
		return apierrors.IsNotFound(err) && dSlow.CallCount("DeleteVolume") > 0, "", nil
	}); err != nil {
		t.Fatal(err)
	}

	// The bridge's registry, and each chain's (broker client and proxy):
	// scraped one by one over HTTP, as Prometheus scrapes each process.
	gatherers := []prometheus.Gatherer{r.reg}
	for _, ch := range drivers.chains {
		gatherers = append(gatherers, ch.Registry)
	}
	// A driver counts a call when it starts and the broker observes it when
	// it returns: scrape until the last calls' metrics are there (or time
	// runs out and the missing ones are named).
	var missing []string
	deadline := time.Now().Add(30 * time.Second)
	for {
		exported := map[string]bool{}
		for _, g := range gatherers {
			scrape(t, g, exported)
		}
		missing = missing[:0]
		for m := range wanted {
			if !exported[m] {
				missing = append(missing, m)
			}
		}
		if len(missing) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Fatalf("the dashboard queries metrics the live /metrics does not export: %v", missing)
	}
	t.Logf("all %d metrics the dashboard queries are exported", len(wanted))

	// The table test/deploy checks the dashboard's and the alerts' label
	// use against: each metric in it, live, with its type and labels.
	raw, err = os.ReadFile("../test/deploy/testdata/metrics.json")
	if err != nil {
		t.Fatal(err)
	}
	var table struct {
		Metrics map[string]struct {
			Type   string   `json:"type"`
			Labels []string `json:"labels"`
		} `json:"metrics"`
	}
	if err := json.Unmarshal(raw, &table); err != nil {
		t.Fatal(err)
	}
	live := map[string]*dto.MetricFamily{}
	for _, g := range gatherers {
		mfs, err := g.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			live[mf.GetName()] = mf
		}
	}
	for name, want := range table.Metrics {
		mf := live[name]
		if mf == nil {
			t.Errorf("test/deploy/testdata/metrics.json lists %s, which no process exports", name)
			continue
		}
		if typ := strings.ToLower(mf.GetType().String()); typ != want.Type {
			t.Errorf("%s is a %s, the table says %s", name, typ, want.Type)
		}
		var labels []string
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if !slices.Contains(labels, lp.GetName()) {
					labels = append(labels, lp.GetName())
				}
			}
		}
		sort.Strings(labels)
		wantLabels := slices.Sorted(slices.Values(want.Labels))
		if !slices.Equal(labels, wantLabels) {
			t.Errorf("%s has the labels %v, the table says %v", name, labels, wantLabels)
		}
	}
}

func scrape(t *testing.T, g prometheus.Gatherer, into map[string]bool) {
	t.Helper()
	srv := httptest.NewServer(promhttp.HandlerFor(g, promhttp.HandlerOpts{}))
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/metrics: %s", resp.Status)
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "#") || line == "" {
			continue
		}
		name := line
		if i := strings.IndexAny(line, "{ "); i >= 0 {
			name = line[:i]
		}
		for _, suf := range []string{"_bucket", "_sum", "_count"} {
			name = strings.TrimSuffix(name, suf)
		}
		into[name] = true
	}
}
