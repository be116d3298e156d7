//go:build hoptrace

package bench

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/csibroker/csibroker/internal/hoptrace"
)

// BenchmarkHopTrace says where a chain call's time goes at concurrency 1:
// for Probe and CreateVolume, b.N chain calls, each after a direct one (as
// BenchmarkLatencyC1 makes them), timed at hoptrace's points; for each
// stretch between two points in a row, its p50 and p90 over the calls
// that passed both. Only with `-tags hoptrace`:
//
//	go test -tags hoptrace -run '^$' -bench HopTrace -benchtime 5000x ./test/bench/
//
// A stretch that ends with a write can look long, or the next one
// negative: a write that wakes the reader's thread may let it run first.
// The medians of the stretches need not add up to the call's.
func BenchmarkHopTrace(b *testing.B) {
	for _, m := range methods {
		b.Run(m.name, func(b *testing.B) { hopTrace(b, m) })
	}
}

func hopTrace(b *testing.B, m method) {
	if b.N > hoptrace.MaxCalls {
		b.Fatalf("at most %d calls", hoptrace.MaxCalls)
	}
	direct, chain := setup(b)
	ctx := context.Background()
	for i := 0; i < 1000; i++ { // warm up both sides
		if err := m.call(ctx, direct); err != nil {
			b.Fatal(err)
		}
		if err := m.call(ctx, chain); err != nil {
			b.Fatal(err)
		}
	}
	directD := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t := time.Now()
		if err := m.call(ctx, direct); err != nil {
			b.Fatal(err)
		}
		directD = append(directD, time.Since(t))
		hoptrace.Begin(i)
		hoptrace.Mark(hoptrace.CallerSends)
		err := m.call(ctx, chain)
		hoptrace.Mark(hoptrace.CallerReturns)
		hoptrace.Begin(-1)
		if err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	if b.N < 100 {
		return // the framework's first, one-call round
	}

	chainD := make([]time.Duration, 0, b.N)
	for i := 0; i < b.N; i++ {
		t := hoptrace.Times(i)
		chainD = append(chainD, time.Duration(t[hoptrace.CallerReturns]-t[hoptrace.CallerSends]))
	}
	dp, cp := us(quantile(directD, .5)), us(quantile(chainD, .5))
	fmt.Printf("HopTrace %s: %d calls; p50 direct %.1f µs, chain %.1f µs (added %.1f)\n", m.name, b.N, dp, cp, cp-dp)
	for p := hoptrace.CallerSends; p+1 < hoptrace.NumPoints; p++ {
		var d []time.Duration
		for i := 0; i < b.N; i++ {
			t := hoptrace.Times(i)
			if t[p] != 0 && t[p+1] != 0 {
				d = append(d, time.Duration(t[p+1]-t[p]))
			}
		}
		if len(d) == 0 {
			fmt.Printf("  %-40s → %-40s  no call passed both\n", p, p+1)
			continue
		}
		fmt.Printf("  %-40s → %-40s  p50 %6.1f µs  p90 %6.1f µs  (%d calls)\n", p, p+1, us(quantile(d, .5)), us(quantile(d, .9)), len(d))
		b.ReportMetric(us(quantile(d, .5)), fmt.Sprintf("p50-µs-%02d-%02d", p, p+1))
	}
}
