package cli

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// TestValidateMetricsPath: a --metrics-path is taken only if it is a clean
// absolute path of literal characters, not a health path. Each path taken
// registers on a ServeMux beside the health paths without a panic, and a
// GET of it reaches the metrics handler; the refused ones would panic at
// start, never match, or serve more than the one path.
func TestValidateMetricsPath(t *testing.T) {
	for _, tc := range []struct {
		name, path string
		want       string // part of the error; empty: taken
	}{
		{"default", "/metrics", ""},
		{"nested", "/debug/metrics", ""},
		{"dots and dashes", "/csi-broker.v1_metrics~", ""},
		{"sub-delimiters", "/m;v=1+x", ""},
		{"non-ASCII", "/métriques", ""},

		{"empty", "", "want a path such as /metrics"},
		{"relative", "metrics", "want a path such as /metrics"},
		{"root", "/", "want a path such as /metrics"},
		{"health", "/healthz", "taken by the health endpoint"},
		{"readiness", "/readyz", "taken by the health endpoint"},
		{"open brace", "/metrics{", `'{' is not allowed`},
		{"lone brace", "/{", `'{' is not allowed`},
		{"wildcard", "/{name}", `'{' is not allowed`},
		{"end anchor", "/metrics/{$}", `'{' is not allowed`},
		{"close brace", "/metrics}", `'}' is not allowed`},
		{"space", "/a b", `' ' is not allowed`},
		{"method", "GET /metrics", "want a path such as /metrics"},
		{"method after slash", "/ GET", `' ' is not allowed`},
		{"tab", "/a\tb", `'\t' is not allowed`},
		{"newline", "/metrics\n", `'\n' is not allowed`},
		{"no-break space", "/a\u00a0b", `'\u00a0' is not allowed`},
		{"control", "/m\x7f", `'\x7f' is not allowed`},
		{"query", "/metrics?format=text", `'?' is not allowed`},
		{"fragment", "/metrics#x", `'#' is not allowed`},
		{"escape", "/m%2Fx", `'%' is not allowed`},
		{"bad escape", "/m%zz", `'%' is not allowed`},
		{"invalid UTF-8", "/m\xff", "not valid UTF-8"},
		{"trailing slash", "/metrics/", "not a clean path (/metrics is)"},
		{"double slash", "//metrics", "not a clean path (/metrics is)"},
		{"dot", "/./metrics", "not a clean path (/metrics is)"},
		{"dot-dot", "/x/../metrics", "not a clean path (/metrics is)"},
		{"dot-dot onto health", "/x/../healthz", "not a clean path (/healthz is)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := ValidateMetricsPath(tc.path)
			if tc.want != "" {
				if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), "--metrics-path ") {
					t.Fatalf("ValidateMetricsPath(%q): %v, want an error naming --metrics-path and saying %q", tc.path, err, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatalf("ValidateMetricsPath(%q): %v, want it taken", tc.path, err)
			}
			mux := http.NewServeMux()
			mux.HandleFunc("/healthz", func(http.ResponseWriter, *http.Request) {})
			mux.HandleFunc("/readyz", func(http.ResponseWriter, *http.Request) {})
			func() {
				defer func() {
					if r := recover(); r != nil {
						t.Fatalf("ServeMux.Handle(%q) panics: %v", tc.path, r)
					}
				}()
				mux.HandleFunc(tc.path, func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusAccepted) })
			}()
			srv := httptest.NewServer(mux)
			defer srv.Close()
			resp, err := http.Get(srv.URL + tc.path)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusAccepted {
				t.Errorf("GET %s: HTTP %d, want the metrics handler's %d", tc.path, resp.StatusCode, http.StatusAccepted)
			}
		})
	}
}

// TestTLSFlagsValidate: the certificate files are required, and a reload
// interval that is not positive is refused, not taken as another value.
func TestTLSFlagsValidate(t *testing.T) {
	ok := TLSFlags{Cert: "c", Key: "k", CA: "ca", TrustDomain: "td", ReloadInterval: time.Second}
	if err := ok.Validate(); err != nil {
		t.Fatalf("valid flags: %v", err)
	}
	for name, edit := range map[string]func(*TLSFlags){
		"no cert":           func(f *TLSFlags) { f.Cert = "" },
		"no trust domain":   func(f *TLSFlags) { f.TrustDomain = "" },
		"zero interval":     func(f *TLSFlags) { f.ReloadInterval = 0 },
		"negative interval": func(f *TLSFlags) { f.ReloadInterval = -time.Second },
	} {
		f := ok
		edit(&f)
		if err := f.Validate(); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}
