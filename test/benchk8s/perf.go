package main

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// perfRecord is `perf record` attached to one process (cpu-clock: no
// hardware counters are needed, so it works in containers).
type perfRecord struct {
	h    *Harness
	proc *proc
	data string
}

func (h *Harness) startPerf(tag string, target *proc) (*perfRecord, error) {
	if _, err := exec.LookPath("perf"); err != nil {
		return nil, fmt.Errorf("-perf: perf is not installed (apt-get install linux-perf): %w", err)
	}
	data := filepath.Join(h.work, "perf-"+tag+".data")
	p, err := h.procs.start(tag+"-perf", "perf", []string{"record", "-e", "cpu-clock", "-F", "999", "-g", "-o", data, "-p", fmt.Sprint(target.pid)}, nil)
	if err != nil {
		return nil, err
	}
	return &perfRecord{h: h, proc: p, data: data}, nil
}

// finish stops recording and returns the hottest functions, self time first,
// then cumulative time.
func (r *perfRecord) finish(ctx context.Context) (string, error) {
	_ = syscall.Kill(r.proc.pid, syscall.SIGINT)
	select {
	case <-r.proc.done:
	case <-time.After(30 * time.Second):
		r.proc.kill()
	}
	var out strings.Builder
	for _, mode := range []struct {
		children string
		fields   string
		limit    int
	}{{"--no-children", "overhead,sym", 25}, {"--children", "overhead_children,overhead,sym", 45}} {
		b, err := exec.CommandContext(ctx, "perf", "report", "--stdio", mode.children, "--fields", mode.fields, "-g", "none",
			"--percent-limit", "1", "-i", r.data).Output()
		if err != nil {
			return "", fmt.Errorf("perf report: %w (log: %s)", err, r.proc.logTail(5))
		}
		n := 0
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "# Samples") || strings.HasPrefix(l, "# Event count") {
				out.WriteString(l + "\n")
				continue
			}
			l = strings.TrimRight(l, " ")
			if l == "" || strings.HasPrefix(l, "#") || n >= mode.limit {
				continue
			}
			// Cumulative: only our own and library functions, not the
			// runtime's and kernel's entry frames.
			if mode.children == "--children" && (strings.Contains(l, "[k]") || strings.Contains(l, "runtime.") || strings.Contains(l, "goexit")) {
				continue
			}
			out.WriteString(l + "\n")
			n++
		}
		out.WriteString("\n")
	}
	r.h.logf("  perf data in %s", r.data)
	return out.String(), nil
}

func (r *perfRecord) stop() { r.proc.stop(5 * time.Second) }
