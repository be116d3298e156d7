package deploy

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

// metricDef is an exported metric: whether it is a histogram (queried
// through _bucket, _sum and _count) and its labels.
type metricDef struct {
	histogram bool
	labels    []string
}

// exported lists what the broker and the proxy export, with their labels,
// from testdata/metrics.json: its "metrics" (k8sbridge's
// TestDashboardMetricsAreExported checks them against live registries) and
// its "source_checked" ones (TestSourceCheckedMetrics checks them against
// their declarations). A proxy metric's labels include those its
// PodMonitor adds when scraping (proxyTargetLabels).
var (
	table    = loadTable("testdata/metrics.json")
	exported = table.defs()
	// proxyTargetLabels are set on every proxy series by the PodMonitor's
	// relabelings (from the pod's csibroker.io/driver annotation and its
	// node).
	proxyTargetLabels = table.scrapeLabels()
)

// metricTable is testdata/metrics.json.
type metricTable struct {
	Metrics map[string]struct {
		Type         string   `json:"type"`
		Labels       []string `json:"labels"`
		ScrapeLabels []string `json:"scrape_labels"`
	} `json:"metrics"`
	// SourceChecked are metrics k8sbridge's live test does not make (no
	// volume is attached there): alerts may query them, the dashboard may
	// not (that test requires every metric it shows to be live).
	SourceChecked map[string]struct {
		Type   string   `json:"type"`
		Labels []string `json:"labels"`
		Source string   `json:"source"` // the Go file that declares it
	} `json:"source_checked"`
}

func loadTable(path string) metricTable {
	raw, err := os.ReadFile(path)
	if err != nil {
		panic(err)
	}
	var tbl metricTable
	if err := json.Unmarshal(raw, &tbl); err != nil {
		panic(fmt.Sprintf("%s: %v", path, err))
	}
	return tbl
}

func (tbl metricTable) defs() map[string]metricDef {
	out := map[string]metricDef{}
	for name, m := range tbl.Metrics {
		out[name] = metricDef{histogram: m.Type == "histogram", labels: append(slices.Clone(m.Labels), m.ScrapeLabels...)}
	}
	for name, m := range tbl.SourceChecked {
		out[name] = metricDef{histogram: m.Type == "histogram", labels: slices.Clone(m.Labels)}
	}
	return out
}

func (tbl metricTable) scrapeLabels() []string {
	var out []string
	for _, m := range tbl.Metrics {
		for _, l := range m.ScrapeLabels {
			if !slices.Contains(out, l) {
				out = append(out, l)
			}
		}
	}
	sort.Strings(out)
	return out
}

// targetLabels are the labels Prometheus (via the Prometheus Operator) adds
// to every scraped series.
var targetLabels = []string{"job", "instance", "namespace", "pod", "container", "service", "endpoint"}

var (
	metricRE   = regexp.MustCompile(`\b(?:csibroker|csi_sidecar|grpc_server)_[A-Za-z0-9_]*`)
	groupingRE = regexp.MustCompile(`\b(?:by|without)\s*\(([^)]*)\)`)
	legendRE   = regexp.MustCompile(`\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}`)
	alertVarRE = regexp.MustCompile(`\$labels\.([A-Za-z_][A-Za-z0-9_]*)`)
	matcherRE  = regexp.MustCompile(`^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*$`)
)

// queryCheck is what checkQuery learnt about one PromQL expression.
type queryCheck struct {
	metrics []string        // exported metrics it reads (base names)
	labels  map[string]bool // labels its result may carry
	errs    []string
}

// checkQuery checks a PromQL expression without a PromQL parser: brackets
// and quotes balance; every csibroker_*, csi_sidecar_* and grpc_server_*
// identifier is an exported metric (histograms only through _bucket, _sum
// or _count, other metrics only by their name); label matchers and by()/
// without() name labels those metrics have (or that scraping adds).
func checkQuery(expr string) queryCheck {
	qc := queryCheck{labels: map[string]bool{}}
	errf := func(format string, args ...any) { qc.errs = append(qc.errs, fmt.Sprintf(format, args...)) }
	if err := balanced(expr); err != nil {
		errf("%v", err)
		return qc
	}
	for _, l := range targetLabels {
		qc.labels[l] = true
	}
	bucket := false
	for _, loc := range metricRE.FindAllStringIndex(expr, -1) {
		name := expr[loc[0]:loc[1]]
		base, suffix := name, ""
		if _, ok := exported[name]; !ok {
			for _, s := range []string{"_bucket", "_sum", "_count"} {
				if _, ok := exported[strings.TrimSuffix(name, s)]; ok && strings.HasSuffix(name, s) {
					base, suffix = strings.TrimSuffix(name, s), s
				}
			}
		}
		def, ok := exported[base]
		if !ok {
			errf("%s is not a metric the broker or proxy exports", name)
			continue
		}
		switch {
		case def.histogram && suffix == "":
			errf("%s is a histogram: query %s_bucket, _sum or _count", name, name)
		case !def.histogram && suffix != "":
			errf("%s: %s is not a histogram, it has no %s series", name, base, suffix)
		}
		if suffix == "_bucket" {
			bucket = true
		}
		if !slices.Contains(qc.metrics, base) {
			qc.metrics = append(qc.metrics, base)
		}
		own := map[string]bool{}
		for _, l := range append(slices.Clone(def.labels), targetLabels...) {
			own[l], qc.labels[l] = true, true
		}
		if suffix == "_bucket" {
			own["le"] = true
		}
		rest := strings.TrimLeft(expr[loc[1]:], " ")
		if strings.HasPrefix(rest, "{") {
			end := closing(rest)
			for _, m := range splitMatchers(rest[1:end]) {
				sm := matcherRE.FindStringSubmatch(m)
				if sm == nil {
					errf("%s: malformed label matcher %q", name, m)
					continue
				}
				if !own[sm[1]] {
					errf("%s has no label %q", name, sm[1])
				}
			}
		}
	}
	if bucket {
		qc.labels["le"] = true
	}
	for _, m := range groupingRE.FindAllStringSubmatch(expr, -1) {
		for _, l := range strings.Split(m[1], ",") {
			if l = strings.TrimSpace(l); l != "" && !qc.labels[l] {
				errf("grouping by %q, a label none of %v has", l, qc.metrics)
			}
		}
	}
	return qc
}

// balanced checks (), [] and {} nesting and double quotes.
func balanced(expr string) error {
	var stack []rune
	pairs := map[rune]rune{')': '(', ']': '[', '}': '{'}
	inQuote, escaped := false, false
	for _, r := range expr {
		switch {
		case inQuote && escaped:
			escaped = false
		case inQuote && r == '\\':
			escaped = true
		case r == '"':
			inQuote = !inQuote
		case inQuote:
		case r == '(' || r == '[' || r == '{':
			stack = append(stack, r)
		case pairs[r] != 0:
			if len(stack) == 0 || stack[len(stack)-1] != pairs[r] {
				return fmt.Errorf("unbalanced %q", r)
			}
			stack = stack[:len(stack)-1]
		}
	}
	if inQuote || len(stack) > 0 {
		return fmt.Errorf("unclosed %q", string(stack))
	}
	return nil
}

// closing returns the index of the '}' closing s[0] == '{' (quotes respected).
func closing(s string) int {
	inQuote, escaped := false, false
	for i, r := range s {
		switch {
		case inQuote && escaped:
			escaped = false
		case inQuote && r == '\\':
			escaped = true
		case r == '"':
			inQuote = !inQuote
		case !inQuote && r == '}':
			return i
		}
	}
	return len(s)
}

// splitMatchers splits a selector body at the commas outside quotes.
func splitMatchers(s string) []string {
	var out []string
	inQuote, escaped, start := false, false, 0
	for i, r := range s {
		switch {
		case inQuote && escaped:
			escaped = false
		case inQuote && r == '\\':
			escaped = true
		case r == '"':
			inQuote = !inQuote
		case !inQuote && r == ',':
			out = append(out, s[start:i])
			start = i + 1
		}
	}
	if strings.TrimSpace(s[start:]) != "" {
		out = append(out, s[start:])
	}
	return out
}

// The checker itself catches what it is meant to.
func TestCheckQuery(t *testing.T) {
	for _, tc := range []struct {
		expr string
		ok   bool
	}{
		{`sum by (driver, method, code) (rate(csibroker_csi_call_duration_seconds_count{driver=~"$driver"}[5m]))`, true},
		{`histogram_quantile(0.99, sum by (le, driver) (rate(csibroker_csi_call_duration_seconds_bucket[5m])))`, true},
		{`max by (pod) (csibroker_leader)`, true},
		{`rate(csibroker_csi_calls_total[5m])`, false},                                 // not exported
		{`csibroker_csi_call_duration_seconds`, false},                                 // histogram without suffix
		{`rate(csibroker_csi_retries_total_count[5m])`, false},                         // counter as histogram
		{`sum by (driver_name) (rate(csibroker_csi_retries_total[5m]))`, false},        // label of another metric
		{`rate(csibroker_csi_retries_total{driver_name="x"}[5m])`, false},              // matcher on a missing label
		{`sum by (le) (rate(csibroker_provision_operations_total[5m]))`, false},        // le without buckets
		{`sum(rate(csibroker_csi_retries_total{driver="a,b", code!="OK"}[5m])`, false}, // unbalanced
		{`sum by (driver, grpc_method) (rate(grpc_server_handled_total{grpc_code!="OK"}[5m]))`, true},
	} {
		qc := checkQuery(tc.expr)
		if (len(qc.errs) == 0) != tc.ok {
			t.Errorf("%s: errors %q, want ok=%v", tc.expr, qc.errs, tc.ok)
		}
	}
}

// The Grafana dashboard parses, is provisionable (datasource variable, unique
// panel ids, every panel queried), queries only exported metrics with their
// real labels, and shows every metric the broker and proxy export.
func TestDashboardMetrics(t *testing.T) {
	data, err := os.ReadFile(deployDir(t, filepath.Join("monitoring", "grafana-dashboard.json")))
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		UID           string `json:"uid"`
		Title         string `json:"title"`
		SchemaVersion int    `json:"schemaVersion"`
		Templating    struct {
			List []struct {
				Name       string          `json:"name"`
				Type       string          `json:"type"`
				Query      json.RawMessage `json:"query"`
				Definition string          `json:"definition"`
			} `json:"list"`
		} `json:"templating"`
		Panels []json.RawMessage `json:"panels"`
	}
	if err := json.Unmarshal(data, &dash); err != nil {
		t.Fatalf("grafana-dashboard.json: %v", err)
	}
	if dash.UID == "" || dash.Title == "" || dash.SchemaVersion == 0 {
		t.Errorf("dashboard needs uid, title and schemaVersion: %q %q %d", dash.UID, dash.Title, dash.SchemaVersion)
	}

	type target struct {
		Expr         string `json:"expr"`
		LegendFormat string `json:"legendFormat"`
		Datasource   struct {
			UID string `json:"uid"`
		} `json:"datasource"`
	}
	type panel struct {
		ID      int               `json:"id"`
		Type    string            `json:"type"`
		Title   string            `json:"title"`
		Panels  []json.RawMessage `json:"panels"`
		Targets []target          `json:"targets"`
		GridPos *struct {
			H, W, X, Y int
		} `json:"gridPos"`
	}
	var panels []panel
	var flatten func(raw []json.RawMessage)
	flatten = func(raw []json.RawMessage) {
		for _, r := range raw {
			var p panel
			if err := json.Unmarshal(r, &p); err != nil {
				t.Fatalf("panel: %v", err)
			}
			panels = append(panels, p)
			flatten(p.Panels)
		}
	}
	flatten(dash.Panels)

	vars := map[string]bool{}
	for _, v := range dash.Templating.List {
		vars[v.Name] = true
	}
	if !vars["datasource"] {
		t.Error("no datasource variable: the dashboard would be tied to one Grafana's data source UID")
	}

	used := map[string]bool{}
	ids := map[int]string{}
	var titles []string
	check := func(where, expr, legend string) {
		if strings.TrimSpace(expr) == "" {
			t.Errorf("%s: empty query", where)
			return
		}
		qc := checkQuery(expr)
		for _, e := range qc.errs {
			t.Errorf("%s: %s\n\tin %s", where, e, expr)
		}
		for _, m := range qc.metrics {
			used[m] = true
		}
		for _, m := range legendRE.FindAllStringSubmatch(legend, -1) {
			if !qc.labels[m[1]] {
				t.Errorf("%s: legend {{%s}}: no such label in %s", where, m[1], expr)
			}
		}
		for _, m := range regexp.MustCompile(`\$([a-z_]+)`).FindAllStringSubmatch(expr, -1) {
			if !vars[m[1]] && !strings.HasPrefix(m[1], "__") {
				t.Errorf("%s: $%s is not a dashboard variable", where, m[1])
			}
		}
	}
	for _, p := range panels {
		where := fmt.Sprintf("panel %d %q", p.ID, p.Title)
		if prev, dup := ids[p.ID]; dup {
			t.Errorf("%s: id %d also used by %q", where, p.ID, prev)
		}
		ids[p.ID] = p.Title
		if p.GridPos == nil || p.GridPos.W == 0 || p.GridPos.H == 0 {
			t.Errorf("%s: no gridPos", where)
		}
		if p.Type == "row" {
			continue
		}
		titles = append(titles, p.Title)
		if len(p.Targets) == 0 {
			t.Errorf("%s: no query", where)
		}
		for _, tg := range p.Targets {
			if tg.Datasource.UID != "${datasource}" {
				t.Errorf("%s: datasource %q, want ${datasource}", where, tg.Datasource.UID)
			}
			check(where, tg.Expr, tg.LegendFormat)
		}
	}
	for _, v := range dash.Templating.List {
		if v.Type != "query" {
			continue
		}
		var q struct {
			Query string `json:"query"`
		}
		if err := json.Unmarshal(v.Query, &q); err != nil {
			t.Errorf("variable %s: query %s: %v", v.Name, v.Query, err)
		}
		check("variable "+v.Name, q.Query, "")
	}
	for m := range used {
		if _, ok := table.SourceChecked[m]; ok {
			t.Errorf("the dashboard shows %s, which k8sbridge's TestDashboardMetricsAreExported does not see live: make that test exercise it and move it to \"metrics\" in testdata/metrics.json", m)
		}
	}

	var missing []string
	for m := range table.Metrics {
		if !used[m] {
			missing = append(missing, m)
		}
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Errorf("exported metrics no panel shows: %v", missing)
	}

	// The panels the operators asked for.
	for _, want := range []string{
		"CSI operations rate by driver, method and code", "latency p50", "latency p99", "retries",
		"In-flight", "Proxy connection state", "Provisioning rate", "Provisioning failures",
		"Provisioning duration", "Secret policy", "Work queue depth", "Leader",
	} {
		if !slices.ContainsFunc(titles, func(s string) bool { return strings.Contains(strings.ToLower(s), strings.ToLower(want)) }) {
			t.Errorf("no panel about %q", want)
		}
	}
}

// The alert rules query only exported metrics with their real labels, name
// only labels their result has in annotations, and cover what an operator
// must be woken for.
func TestPrometheusRules(t *testing.T) {
	rule := find(t, build(t, "monitoring"), "PrometheusRule", brokerNamespace, "csibroker")
	groups, _, _ := unstructured.NestedSlice(rule.Object, "spec", "groups")
	alerts := map[string]bool{}
	for _, g := range groups {
		rules, _ := g.(map[string]any)["rules"].([]any)
		for _, r := range rules {
			r := r.(map[string]any)
			name, _ := r["alert"].(string)
			if name == "" {
				name, _ = r["record"].(string)
			}
			expr, _ := r["expr"].(string)
			qc := checkQuery(expr)
			for _, e := range qc.errs {
				t.Errorf("%s: %s\n\tin %s", name, e, expr)
			}
			if len(qc.metrics) == 0 && !strings.Contains(expr, "up{") {
				t.Errorf("%s: queries no csibroker metric: %s", name, expr)
			}
			if _, ok := r["alert"]; !ok {
				continue
			}
			alerts[name] = true
			labels, _ := r["labels"].(map[string]any)
			if s, _ := labels["severity"].(string); !slices.Contains([]string{"critical", "warning", "info"}, s) {
				t.Errorf("%s: severity %q", name, s)
			}
			if f, ok := r["for"].(string); ok {
				if _, err := time.ParseDuration(f); err != nil {
					t.Errorf("%s: for %q: %v", name, f, err)
				}
			}
			ann, _ := r["annotations"].(map[string]any)
			if ann["summary"] == nil || ann["description"] == nil {
				t.Errorf("%s: needs summary and description annotations", name)
			}
			for _, a := range ann {
				for _, m := range alertVarRE.FindAllStringSubmatch(a.(string), -1) {
					if !qc.labels[m[1]] {
						t.Errorf("%s: annotation uses $labels.%s, which %s does not have", name, m[1], expr)
					}
				}
			}
		}
	}
	for _, want := range []string{
		"CSIBrokerHighCSIErrorRatio", "CSIBrokerSecretPolicyDenies", "CSIBrokerProxyNotReady",
		"CSIBrokerNoLeader", "CSIBrokerWorkQueueGrowing", "CSIBrokerCertificateExpiresSoon", "CSIBrokerCertificateRefused",
		"CSIBrokerProvisioningFailing", "CSIBrokerDeletionFailing", "CSIBrokerDeletionNodeGone", "CSIBrokerAttachFailing",
		"CSIBrokerRecoveryNeedsAdmin",
	} {
		if !alerts[want] {
			t.Errorf("no alert %s", want)
		}
	}
}

// declRE matches a metric vector's declaration in the Go sources:
// prometheus.New<Type>Vec(prometheus.<Type>Opts{Namespace: "ns", Name:
// "name", ...}, []string{labels}).
var declRE = regexp.MustCompile(`prometheus\.New(Counter|Gauge|Histogram|Summary)Vec\(prometheus\.\w+Opts\{\s*Namespace:\s*"([a-z_]+)",\s*Name:\s*"([a-z_]+)",[^}]*?\},\s*\[\]string\{([^}]*)\}\)`)

// The metrics testdata/metrics.json lists as source-checked (alerts query
// them, no live test makes them) are declared in the Go file it names,
// with the type and labels it says, and are not also live-checked ones.
func TestSourceCheckedMetrics(t *testing.T) {
	if len(table.SourceChecked) == 0 {
		t.Skip("no source-checked metrics")
	}
	for name, want := range table.SourceChecked {
		if _, dup := table.Metrics[name]; dup {
			t.Errorf("%s is listed both as live-checked and as source-checked", name)
		}
		src, err := os.ReadFile(filepath.Join(repoRoot(t), want.Source))
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		found := false
		for _, m := range declRE.FindAllStringSubmatch(string(src), -1) {
			if m[2]+"_"+m[3] != name {
				continue
			}
			found = true
			if typ := strings.ToLower(m[1]); typ != want.Type {
				t.Errorf("%s is declared a %s in %s, the table says %s", name, typ, want.Source, want.Type)
			}
			var labels []string
			for _, l := range strings.Split(m[4], ",") {
				if l = strings.Trim(strings.TrimSpace(l), `"`); l != "" {
					labels = append(labels, l)
				}
			}
			if !slices.Equal(slices.Sorted(slices.Values(labels)), slices.Sorted(slices.Values(want.Labels))) {
				t.Errorf("%s has the labels %v in %s, the table says %v", name, labels, want.Source, want.Labels)
			}
		}
		if !found {
			t.Errorf("%s: no declaration in %s", name, want.Source)
		}
	}
}

// spanAttrRE matches a span attribute's declaration in the Go sources.
var spanAttrRE = regexp.MustCompile(`attribute\.(?:String|Int|Bool|Int64)\("([a-z0-9_.]+)"`)

// The dashboard reaches traces: a tracing data source variable; the
// latency panels show the histograms' exemplars, whose trace_id opens the
// trace on that data source; and the CSI call and provisioning panels link
// each driver/method (or driver/StorageClass) series to a trace search
// there, in Jaeger's and in Tempo's query language, by span attributes the
// broker sets and labels the panel's series have.
func TestDashboardTraceLinks(t *testing.T) {
	data, err := os.ReadFile(deployDir(t, filepath.Join("monitoring", "grafana-dashboard.json")))
	if err != nil {
		t.Fatal(err)
	}
	type link struct {
		Title string `json:"title"`
		URL   string `json:"url"`
	}
	type fieldConfig struct {
		Defaults struct {
			Links []link `json:"links"`
		} `json:"defaults"`
		Overrides []struct {
			Matcher struct {
				ID      string `json:"id"`
				Options string `json:"options"`
			} `json:"matcher"`
			Properties []struct {
				ID    string          `json:"id"`
				Value json.RawMessage `json:"value"`
			} `json:"properties"`
		} `json:"overrides"`
	}
	var dash struct {
		Templating struct {
			List []struct {
				Name  string `json:"name"`
				Type  string `json:"type"`
				Query any    `json:"query"`
			} `json:"list"`
		} `json:"templating"`
		Panels []struct {
			ID          int         `json:"id"`
			Title       string      `json:"title"`
			FieldConfig fieldConfig `json:"fieldConfig"`
			Targets     []struct {
				Expr     string `json:"expr"`
				Exemplar bool   `json:"exemplar"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(data, &dash); err != nil {
		t.Fatalf("grafana-dashboard.json: %v", err)
	}

	tracing := false
	for _, v := range dash.Templating.List {
		if v.Name == "tracing" {
			tracing = true
			if v.Type != "datasource" || (v.Query != "jaeger" && v.Query != "tempo") {
				t.Errorf("variable tracing: type %q query %v, want a datasource variable of type jaeger or tempo", v.Type, v.Query)
			}
		}
	}
	if !tracing {
		t.Fatal("no tracing data source variable")
	}

	// The span attributes the broker and its controllers set.
	attrs := map[string]bool{}
	for _, dir := range []string{"broker", "k8sbridge", "proxy"} {
		// Each folder and its packages below (k8sbridge has one per
		// controller).
		err := filepath.WalkDir(filepath.Join(repoRoot(t), dir), func(f string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(f, ".go") || strings.HasSuffix(f, "_test.go") {
				return err
			}
			src, err := os.ReadFile(f)
			if err != nil {
				return err
			}
			for _, m := range spanAttrRE.FindAllStringSubmatch(string(src), -1) {
				attrs[m[1]] = true
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if !attrs["csi.driver"] {
		t.Fatal("found no span attribute declarations (csi.driver) in broker/ and k8sbridge/")
	}

	fieldRE := regexp.MustCompile(`\$\{__field\.labels\.([A-Za-z_][A-Za-z0-9_]*)\}`)
	// explore checks an Explore URL on the tracing data source and
	// returns its queries.
	explore := func(where string, l link) []map[string]any {
		u, err := url.Parse(l.URL)
		if err != nil || u.Path != "/explore" {
			t.Errorf("%s: link %q: URL %q is not an Explore URL (%v)", where, l.Title, l.URL, err)
			return nil
		}
		var left struct {
			Datasource string           `json:"datasource"`
			Queries    []map[string]any `json:"queries"`
			Range      struct{ From, To string }
		}
		if err := json.Unmarshal([]byte(u.Query().Get("left")), &left); err != nil {
			t.Errorf("%s: link %q: left pane: %v", where, l.Title, err)
			return nil
		}
		if left.Datasource != "${tracing}" || len(left.Queries) == 0 || left.Range.From != "${__from}" || left.Range.To != "${__to}" {
			t.Errorf("%s: link %q: data source %q, %d queries, range %v: want ${tracing}, the dashboard's time range", where, l.Title, left.Datasource, len(left.Queries), left.Range)
		}
		for _, q := range left.Queries {
			if ds, _ := q["datasource"].(map[string]any); ds == nil || ds["uid"] != "${tracing}" {
				t.Errorf("%s: link %q: query data source %v, want ${tracing}", where, l.Title, q["datasource"])
			}
		}
		return left.Queries
	}

	searched := map[string]bool{} // panel titles with both searches
	for _, p := range dash.Panels {
		where := fmt.Sprintf("panel %d %q", p.ID, p.Title)
		labels := map[string]bool{}
		latency := false
		for _, tg := range p.Targets {
			for l := range checkQuery(tg.Expr).labels {
				labels[l] = true
			}
			if strings.Contains(tg.Expr, "histogram_quantile") &&
				(strings.Contains(tg.Expr, "csibroker_csi_call_duration_seconds_bucket") || strings.Contains(tg.Expr, "csi_sidecar_operations_seconds_bucket")) {
				latency = true
			}
		}
		if latency {
			for i, tg := range p.Targets {
				if !tg.Exemplar {
					t.Errorf("%s: target %d does not show exemplars", where, i)
				}
			}
			opens := false
			for _, o := range p.FieldConfig.Overrides {
				if o.Matcher.ID != "byName" || o.Matcher.Options != "trace_id" {
					continue
				}
				for _, pr := range o.Properties {
					var ls []link
					if pr.ID != "links" || json.Unmarshal(pr.Value, &ls) != nil {
						continue
					}
					for _, l := range ls {
						for _, q := range explore(where, l) {
							opens = opens || q["query"] == "${__value.raw}"
						}
					}
				}
			}
			if !opens {
				t.Errorf("%s: no link from an exemplar's trace_id to its trace on ${tracing}", where)
			}
		}
		var jaeger, tempo bool
		for _, l := range p.FieldConfig.Defaults.Links {
			for _, m := range fieldRE.FindAllStringSubmatch(l.URL+l.Title, -1) {
				if !labels[m[1]] {
					t.Errorf("%s: link %q names label %s, which the panel's series do not have", where, l.Title, m[1])
				}
			}
			for _, q := range explore(where, l) {
				switch q["queryType"] {
				case "search": // Jaeger
					jaeger = true
					tags, _ := q["tags"].(string)
					if q["service"] != "csibroker-broker" || !strings.Contains(tags, "${__field.labels.") {
						t.Errorf("%s: Jaeger search %v: want service csibroker-broker and tags from the series' labels", where, q)
					}
					for _, kv := range strings.Fields(tags) {
						if k, _, _ := strings.Cut(kv, "="); k != "error" && !attrs[k] {
							t.Errorf("%s: Jaeger search by tag %s, which no span carries", where, k)
						}
					}
				case "traceql": // Tempo
					tempo = true
					expr, _ := q["query"].(string)
					for _, m := range regexp.MustCompile(`\bspan\.([a-z0-9_.]+)\s*=`).FindAllStringSubmatch(expr, -1) {
						if !attrs[m[1]] {
							t.Errorf("%s: TraceQL by span.%s, which no span carries", where, m[1])
						}
					}
					if !strings.Contains(expr, "${__field.labels.") {
						t.Errorf("%s: TraceQL %q does not select by the series' labels", where, expr)
					}
				default:
					t.Errorf("%s: link %q: query type %v", where, l.Title, q["queryType"])
				}
			}
		}
		if jaeger && tempo {
			searched[p.Title] = true
		} else if len(p.FieldConfig.Defaults.Links) > 0 {
			t.Errorf("%s: links search Jaeger %v, Tempo %v: want both", where, jaeger, tempo)
		}
		if latency && !searched[p.Title] {
			t.Errorf("%s: a latency panel without trace searches per series", where)
		}
	}
	for _, want := range []string{"CSI error ratio by driver and method", "Provisioning failures", "Provisioning duration"} {
		if !slices.ContainsFunc(slices.Collect(maps.Keys(searched)), func(s string) bool { return strings.Contains(s, want) }) {
			t.Errorf("no trace search from the panel %q", want)
		}
	}
}
