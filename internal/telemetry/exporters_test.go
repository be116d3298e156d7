package telemetry

import (
	"context"
	"strings"
	"testing"
)

func TestSpanExporters(t *testing.T) {
	for _, tc := range []struct {
		name, exporter, protocol string
		want                     int
		wantErr                  string
	}{
		{name: "default is otlp over http", exporter: "", want: 1},
		{name: "none", exporter: "none", want: 0},
		{name: "console", exporter: "console", want: 1},
		{name: "otlp over grpc", exporter: "otlp", protocol: "grpc", want: 1},
		{name: "two exporters", exporter: "otlp, console", want: 2},
		{name: "unknown exporter", exporter: "zipkin", wantErr: `OTEL_TRACES_EXPORTER "zipkin"`},
		{name: "unknown protocol", exporter: "otlp", protocol: "http/json", wantErr: `OTEL_EXPORTER_OTLP_PROTOCOL "http/json"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("OTEL_TRACES_EXPORTER", tc.exporter)
			t.Setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "")
			t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", tc.protocol)
			t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
			exps, err := spanExporters(context.Background())
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want it to contain %s", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(exps) != tc.want {
				t.Fatalf("%d exporters, want %d", len(exps), tc.want)
			}
			for _, e := range exps {
				_ = e.Shutdown(context.Background())
			}
		})
	}
}
