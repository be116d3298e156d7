//go:build linux

package tracing

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/csibroker/csibroker/internal/testenv"
)

func TestMain(m *testing.M) {
	// The PV controller hands claims to their provisioner.
	testenv.Main(m, testenv.Options{ControllerManager: true})
}

const (
	goodDriver = "good.tracing.csibroker.test"
	badDriver  = "failing.tracing.csibroker.test"
	// The sample driver's injected error message starts so: it must
	// appear in no span.
	faultMessage = "injected fault"
	waitTimeout  = 60 * time.Second
)

// TestProvisioningTraceInJaeger provisions a claim through the broker and
// reads its trace back from Jaeger; another claim's CreateVolume fails; the
// broker's exemplars name traces Jaeger has.
func TestProvisioningTraceInJaeger(t *testing.T) {
	// Both first: a missing binary fails the test before anything starts.
	jaeger := testenv.NewJaeger(t)
	env := testenv.Shared(t)
	bin := buildBinary(t)
	c := env.Client()
	ns := env.NewNamespace(t)
	brokerNS := env.NewNamespace(t)
	s := startStack(t, bin, env, jaeger, brokerNS, []driverSpec{
		{name: goodDriver},
		{name: badDriver, faults: []string{"CreateVolume=rate:1,code:Internal"}},
	})
	ctx := t.Context()
	createClass(t, c, ns+"-good", goodDriver)
	createClass(t, c, ns+"-bad", badDriver)
	createClaim(t, c, ns, "data", ns+"-good")
	createClaim(t, c, ns, "doomed", ns+"-bad")

	var okTrace string
	t.Run("provisioned claim", func(t *testing.T) {
		err := testenv.WaitFor(ctx, waitTimeout, "PVC "+ns+"/data Bound", func(ctx context.Context) (bool, string, error) {
			pvc, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "data", metav1.GetOptions{})
			if err != nil {
				return false, "", err
			}
			return pvc.Status.Phase == corev1.ClaimBound, string(pvc.Status.Phase), nil
		})
		if err != nil {
			t.Fatal(err)
		}
		okTrace = eventTrace(t, c, ns, "data", "ProvisioningSucceeded")
		root := "provision " + ns + "/data"
		tr := s.waitTrace(ctx, okTrace, complete(root))
		t.Logf("trace %s:\n%s", okTrace, summary(tr))
		checkProvisionTrace(t, tr, root, ns, "data", goodDriver)
		for _, svc := range []string{brokerService, proxyService, driverService} {
			if sp := findSpan(tr, svc, "csi.v1.Controller/CreateVolume"); sp != nil {
				t.Logf("%s's span of CreateVolume: %s", svc, strings.Join(allValues(*sp), " "))
			}
		}

		// One trace for the claim: a search by its attribute finds this one.
		traces, err := jaeger.Traces(ctx, brokerService, map[string][]string{
			"operation": {root}, "tags": {fmt.Sprintf(`{"k8s.pvc.namespace":%q,"k8s.pvc.name":"data"}`, ns)}})
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, x := range traces {
			ids = append(ids, x.TraceID)
		}
		if len(ids) != 1 || ids[0] != okTrace {
			t.Errorf("Jaeger's search for %s's provisioning found traces %v, want only %s (the Event's)", root, ids, okTrace)
		}
	})

	var failedTrace string
	t.Run("failed CreateVolume", func(t *testing.T) {
		failedTrace = eventTrace(t, c, ns, "doomed", "ProvisioningFailed")
		root := "provision " + ns + "/doomed"
		tr := s.waitTrace(ctx, failedTrace, complete(root))
		t.Logf("trace %s:\n%s", failedTrace, summary(tr))
		checkProvisionTrace(t, tr, root, ns, "doomed", badDriver)

		// The broker's span of the call, and the driver's own, fail with
		// the driver's code.
		call := findSpan(tr, brokerService, "broker /csi.v1.Controller/CreateVolume")
		if call == nil {
			t.Fatal("no broker span of CreateVolume")
		}
		wantTag(t, *call, "otel.status_code", "ERROR")
		wantTag(t, *call, "rpc.grpc.status_code", "Internal")
		drv := findSpan(tr, driverService, "csi.v1.Controller/CreateVolume")
		wantTag(t, *drv, "otel.status_code", "ERROR")
		wantTag(t, *drv, "rpc.response.status_code", "INTERNAL")
		for _, svc := range []string{brokerService, proxyService} {
			if sp := findSpan(tr, svc, "csi.v1.Controller/CreateVolume"); sp != nil {
				wantTag(t, *sp, "rpc.response.status_code", "INTERNAL")
			}
		}
		if got, _ := rootSpan(tr, root).Tag("otel.status_code"); got != "ERROR" {
			t.Errorf("span %q: otel.status_code %q, want ERROR", root, got)
		}
		// No span carries the driver's message (it may quote a request's
		// secrets): a status code, no message body.
		for _, sp := range tr.Spans {
			for _, kv := range allValues(sp) {
				if strings.Contains(kv, faultMessage) {
					t.Errorf("span %q of %s carries a message body: %s", sp.OperationName, tr.Service(sp), kv)
				}
			}
		}
	})

	t.Run("exemplars", func(t *testing.T) {
		if okTrace == "" || failedTrace == "" {
			t.Skip("needs both provisioning traces")
		}
		ex := scrapeExemplars(t, s.metricsURL)
		for _, want := range []struct{ series, label string }{
			{"csibroker_csi_call_duration_seconds", `driver="` + goodDriver + `"`},
			{"csi_sidecar_operations_seconds", `driver_name="` + goodDriver + `"`},
		} {
			ids := ex.traces(want.series, want.label, "CreateVolume", "OK")
			if len(ids) != 1 || ids[0] != okTrace {
				t.Errorf("%s{%s} CreateVolume OK: exemplar trace IDs %v, want [%s] (the claim's provisioning)", want.series, want.label, ids, okTrace)
			}
		}
		if ids := ex.provisions(goodDriver, ns+"-good"); len(ids) != 1 || ids[0] != okTrace {
			t.Errorf("csibroker_provision_duration_seconds{driver=%q,storage_class=%q}: exemplar trace IDs %v, want [%s]", goodDriver, ns+"-good", ids, okTrace)
		}
		if ids := ex.traces("csibroker_csi_call_duration_seconds", `driver="`+badDriver+`"`, "CreateVolume", "Internal"); len(ids) == 0 {
			t.Errorf("no exemplar on the failed CreateVolume calls' series")
		}
		// Every trace an exemplar names is in Jaeger.
		all := ex.all()
		if len(all) == 0 {
			t.Fatal("no exemplar in the OpenMetrics scrape")
		}
		for _, id := range all {
			s.waitTrace(ctx, id, func(tr testenv.JaegerTrace) (bool, string) { return len(tr.Spans) > 0, summary(tr) })
		}
		t.Logf("%d exemplars, their %d traces all in Jaeger", len(ex), len(all))

		// Without the OpenMetrics Accept header: the classic text
		// format, which has no exemplars.
		resp, err := http.Get(s.metricsURL)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			if exemplarRE.MatchString(sc.Text()) {
				t.Fatalf("exemplar in the text format: %s", sc.Text())
			}
		}
	})
}

func createClass(t *testing.T, c kubernetes.Interface, name, driver string) {
	t.Helper()
	imm, del := storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete
	_, err := c.StorageV1().StorageClasses().Create(t.Context(), &storagev1.StorageClass{
		ObjectMeta: metav1.ObjectMeta{Name: name}, Provisioner: driver, VolumeBindingMode: &imm, ReclaimPolicy: &del,
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = c.StorageV1().StorageClasses().Delete(context.Background(), name, metav1.DeleteOptions{})
	})
}

func createClaim(t *testing.T, c kubernetes.Interface, ns, name, class string) {
	t.Helper()
	_, err := c.CoreV1().PersistentVolumeClaims(ns).Create(t.Context(), &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			StorageClassName: &class,
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
}

var eventTraceRE = regexp.MustCompile(`\(trace ([0-9a-f]{32})\)$`)

// eventTrace waits for an Event with reason on claim ns/name and returns
// the trace ID written into it.
func eventTrace(t *testing.T, c kubernetes.Interface, ns, name, reason string) string {
	t.Helper()
	var id string
	err := testenv.WaitFor(t.Context(), waitTimeout, fmt.Sprintf("a %s Event on PVC %s/%s with a trace ID", reason, ns, name),
		func(ctx context.Context) (bool, string, error) {
			evs, err := c.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + name})
			if err != nil {
				return false, "", err
			}
			var seen []string
			for _, e := range evs.Items {
				seen = append(seen, e.Reason+": "+e.Message)
				if m := eventTraceRE.FindStringSubmatch(e.Message); e.Reason == reason && m != nil {
					id = m[1]
					return true, "", nil
				}
			}
			return false, strings.Join(seen, "; "), nil
		})
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// checkProvisionTrace checks what every provisioning trace holds: the
// claim's span as the root, with the claim as its attributes, and under it
// the broker's, the proxy's and the driver's spans of CreateVolume, each
// the child of the one before.
func checkProvisionTrace(t *testing.T, tr testenv.JaegerTrace, root, ns, name, driver string) {
	t.Helper()
	r := rootSpan(tr, root)
	if r == nil {
		t.Fatalf("no span %q in the trace", root)
	}
	if p := r.Parent(); p != "" {
		t.Errorf("span %q has a parent %s; want it the root", root, p)
	}
	wantTag(t, *r, "k8s.pvc.namespace", ns)
	wantTag(t, *r, "k8s.pvc.name", name)
	wantTag(t, *r, "csi.driver", driver)
	byID := map[string]testenv.JaegerSpan{}
	for _, sp := range tr.Spans {
		byID[sp.SpanID] = sp
		if sp.TraceID != tr.TraceID {
			t.Errorf("span %q has trace ID %s in trace %s", sp.OperationName, sp.TraceID, tr.TraceID)
		}
	}
	// From the driver's span up to the root: driver ← proxy ← broker's
	// client span ← broker's call span ← ... ← the claim's.
	drv := findSpan(tr, driverService, "csi.v1.Controller/CreateVolume")
	if drv == nil {
		t.Fatal("no driver span of CreateVolume")
	}
	wantTag(t, *drv, "span.kind", "server")
	var chain []string
	for sp, ok := *drv, true; ok; sp, ok = byID[sp.Parent()] {
		chain = append(chain, tr.Service(sp)+": "+sp.OperationName)
		if sp.SpanID == r.SpanID {
			break
		}
	}
	want := []string{
		driverService + ": csi.v1.Controller/CreateVolume",
		proxyService + ": csi.v1.Controller/CreateVolume",
		brokerService + ": csi.v1.Controller/CreateVolume",
		brokerService + ": broker /csi.v1.Controller/CreateVolume",
	}
	if len(chain) < len(want)+1 || strings.Join(chain[:len(want)], "|") != strings.Join(want, "|") || chain[len(chain)-1] != brokerService+": "+root {
		t.Errorf("from the driver's span to the root:\n  %s\nwant it to begin with\n  %s\nand end at %s: %s", strings.Join(chain, "\n  "), strings.Join(want, "\n  "), brokerService, root)
	}
	for _, svc := range []string{brokerService, proxyService, driverService} {
		if !hasService(tr, svc) {
			t.Errorf("no span of service %s in the trace", svc)
		}
	}
}

// complete reports a provisioning trace whole: its root span root and the
// four spans of its CreateVolume call (the broker's, its gRPC client's,
// the proxy's and the driver's), which reach Jaeger in separate batches.
func complete(root string) func(testenv.JaegerTrace) (bool, string) {
	return func(tr testenv.JaegerTrace) (bool, string) {
		const op = "csi.v1.Controller/CreateVolume"
		ok := hasSpan(tr, brokerService, root) && hasSpan(tr, brokerService, "broker /"+op) &&
			hasSpan(tr, brokerService, op) && hasSpan(tr, proxyService, op) && hasSpan(tr, driverService, op)
		return ok, summary(tr)
	}
}

func rootSpan(tr testenv.JaegerTrace, op string) *testenv.JaegerSpan {
	return findSpan(tr, brokerService, op)
}

func findSpan(tr testenv.JaegerTrace, service, op string) *testenv.JaegerSpan {
	for i, sp := range tr.Spans {
		if tr.Service(sp) == service && sp.OperationName == op {
			return &tr.Spans[i]
		}
	}
	return nil
}

func hasSpan(tr testenv.JaegerTrace, service, op string) bool {
	return findSpan(tr, service, op) != nil
}

func hasService(tr testenv.JaegerTrace, service string) bool {
	for _, sp := range tr.Spans {
		if tr.Service(sp) == service {
			return true
		}
	}
	return false
}

func wantTag(t *testing.T, sp testenv.JaegerSpan, key, want string) {
	t.Helper()
	if got, ok := sp.Tag(key); !ok || got != want {
		t.Errorf("span %q: tag %s = %q (present %v), want %q", sp.OperationName, key, got, ok, want)
	}
}

// allValues is every string a span carries: tags and log (event) fields.
func allValues(sp testenv.JaegerSpan) []string {
	var out []string
	for _, kv := range sp.Tags {
		out = append(out, kv.Key+"="+fmt.Sprint(kv.Value))
	}
	for _, l := range sp.Logs {
		for _, kv := range l.Fields {
			out = append(out, kv.Key+"="+fmt.Sprint(kv.Value))
		}
	}
	return out
}

// summary is the trace's spans, one a line, for the test's log.
func summary(tr testenv.JaegerTrace) string {
	var lines []string
	for _, sp := range tr.Spans {
		st, _ := sp.Tag("otel.status_code")
		lines = append(lines, fmt.Sprintf("  %-24s %-48s %s", tr.Service(sp), sp.OperationName, st))
	}
	sort.Strings(lines)
	return strings.Join(lines, "\n")
}

// An OpenMetrics bucket line with an exemplar:
// name_bucket{labels} count # {trace_id="..."} value [timestamp]
var exemplarRE = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)_bucket\{([^}]*)\} \S+ # \{trace_id="([0-9a-f]{32})"\}`)

// exemplar is one bucket's exemplar.
type exemplar struct{ series, labels, traceID string }

type exemplars []exemplar

// scrapeExemplars reads the broker's metrics in the OpenMetrics format,
// as Prometheus asks for them when it scrapes exemplars.
func scrapeExemplars(t *testing.T, url string) exemplars {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Accept", "application/openmetrics-text; version=1.0.0; charset=utf-8")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/openmetrics-text") {
		t.Fatalf("Content-Type %q: the broker does not serve OpenMetrics", ct)
	}
	var out exemplars
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if m := exemplarRE.FindStringSubmatch(sc.Text()); m != nil {
			out = append(out, exemplar{series: m[1], labels: m[2], traceID: m[3]})
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// traces returns the distinct trace IDs of series' exemplars whose labels
// hold label, the method and the code (in either histogram's label names).
func (ex exemplars) traces(series, label, method, code string) []string {
	seen := map[string]bool{}
	var out []string
	for _, e := range ex {
		if e.series != series || !strings.Contains(e.labels, label) {
			continue
		}
		if !(strings.Contains(e.labels, `method="`+method+`"`) || strings.Contains(e.labels, `method_name="/csi.v1.Controller/`+method+`"`)) {
			continue
		}
		if !(strings.Contains(e.labels, `code="`+code+`"`) || strings.Contains(e.labels, `grpc_status_code="`+code+`"`)) {
			continue
		}
		if !seen[e.traceID] {
			seen[e.traceID] = true
			out = append(out, e.traceID)
		}
	}
	return out
}

func (ex exemplars) all() []string {
	seen := map[string]bool{}
	var out []string
	for _, e := range ex {
		if !seen[e.traceID] {
			seen[e.traceID] = true
			out = append(out, e.traceID)
		}
	}
	return out
}

// provisions returns the trace IDs of the provisioning histogram's
// exemplars of driver and class.
func (ex exemplars) provisions(driver, class string) []string {
	var out []string
	for _, e := range ex {
		if e.series == "csibroker_provision_duration_seconds" && strings.Contains(e.labels, `driver="`+driver+`"`) &&
			strings.Contains(e.labels, `storage_class="`+class+`"`) && !slices.Contains(out, e.traceID) {
			out = append(out, e.traceID)
		}
	}
	return out
}
