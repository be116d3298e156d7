package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// sample is one Prometheus text-format series.
type sample struct {
	name   string
	labels map[string]string
	value  float64
}

// scrapeAPIServer reads kube-apiserver's /metrics with the admin token and
// returns the series of the named metrics.
func (h *Harness) scrapeAPIServer(ctx context.Context, names ...string) ([]sample, error) {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	b, err := h.client.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(ctx)
	if err != nil {
		return nil, fmt.Errorf("scrape kube-apiserver /metrics: %w", err)
	}
	return parseProm(string(b), names...), nil
}

// parseProm parses the lines of the named metrics from Prometheus text format.
func parseProm(text string, names ...string) []sample {
	var out []sample
	for line := range strings.SplitSeq(text, "\n") {
		if line == "" || line[0] == '#' {
			continue
		}
		name := line
		if i := strings.IndexAny(line, "{ "); i >= 0 {
			name = line[:i]
		}
		want := false
		for _, n := range names {
			if n == name {
				want = true
			}
		}
		if !want {
			continue
		}
		s := sample{name: name, labels: map[string]string{}}
		rest := line[len(name):]
		if strings.HasPrefix(rest, "{") {
			end := strings.LastIndexByte(rest, '}')
			if end < 0 {
				continue
			}
			s.labels = parseLabels(rest[1:end])
			rest = rest[end+1:]
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(f[0], 64)
		if err != nil {
			continue
		}
		s.value = v
		out = append(out, s)
	}
	return out
}

func parseLabels(s string) map[string]string {
	m := map[string]string{}
	for len(s) > 0 {
		eq := strings.IndexByte(s, '=')
		if eq < 0 || eq+1 >= len(s) || s[eq+1] != '"' {
			break
		}
		key := strings.TrimSpace(strings.TrimLeft(s[:eq], ","))
		var val strings.Builder
		i := eq + 2
		for ; i < len(s); i++ {
			if s[i] == '\\' && i+1 < len(s) {
				i++
				val.WriteByte(s[i])
				continue
			}
			if s[i] == '"' {
				break
			}
			val.WriteByte(s[i])
		}
		m[key] = val.String()
		s = s[min(i+1, len(s)):]
	}
	return m
}

// scrape reads a process's Prometheus endpoint.
func scrape(ctx context.Context, url string, names ...string) ([]sample, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	return parseProm(string(b), names...), nil
}

// watchesHeld sums apiserver_longrunning_requests{verb="WATCH"} (all
// clients).
func (h *Harness) watchesHeld(ctx context.Context) (int, error) {
	ss, err := h.scrapeAPIServer(ctx, "apiserver_longrunning_requests")
	if err != nil {
		return 0, err
	}
	n := 0.0
	for _, s := range ss {
		if s.labels["verb"] == "WATCH" {
			n += s.value
		}
	}
	return int(n), nil
}

// otlpSink accepts OTLP/HTTP trace exports and discards them, so csibroker's
// tracing runs end to end (spans made, batched, serialized, sent).
type otlpSink struct {
	srv      *http.Server
	url      string
	requests atomic.Int64
	bytes    atomic.Int64
}

func startOTLPSink() (*otlpSink, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &otlpSink{url: "http://" + l.Addr().String()}
	s.srv = &http.Server{
		ReadHeaderTimeout: 5 * time.Second,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			n, _ := io.Copy(io.Discard, r.Body)
			s.requests.Add(1)
			s.bytes.Add(n)
			w.Header().Set("Content-Type", "application/x-protobuf")
			w.WriteHeader(http.StatusOK)
		}),
	}
	go func() { _ = s.srv.Serve(l) }()
	return s, nil
}

func (s *otlpSink) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = s.srv.Shutdown(ctx)
}

// otelEnv points a csibroker process's tracing at the sink.
func (h *Harness) otelEnv(service string) []string {
	if !h.cfg.Tracing || h.sink == nil {
		return nil
	}
	return []string{
		"OTEL_TRACES_EXPORTER=otlp",
		"OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf",
		"OTEL_EXPORTER_OTLP_ENDPOINT=" + h.sink.url,
		"OTEL_SERVICE_NAME=" + service,
		"OTEL_BSP_SCHEDULE_DELAY=1000",
	}
}
