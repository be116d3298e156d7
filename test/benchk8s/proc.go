package main

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/procfs"
)

// proc is one child process. It runs in its own process group and is sent
// SIGKILL should the harness die first (Pdeathsig).
type proc struct {
	name    string
	pid     int
	logPath string
	started time.Time
	cmd     *exec.Cmd
	done    chan struct{}
	waitErr error
}

// procs tracks every live child so that an error or an interrupt stops them all.
type procs struct {
	mu   sync.Mutex
	live map[*proc]struct{}
	dir  string
}

// start runs bin with args, output appended to <dir>/<name>.log.
func (ps *procs) start(name, bin string, args, env []string) (*proc, error) {
	logPath := filepath.Join(ps.dir, name+".log")
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(f, "# %s %s\n", bin, strings.Join(args, " "))
	cmd := exec.Command(bin, args...)
	cmd.Dir = ps.dir
	cmd.Stdout, cmd.Stderr = f, f
	cmd.Env = append(childEnv(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.live == nil {
		ps.live = map[*proc]struct{}{}
	}
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, pid: cmd.Process.Pid, logPath: logPath, started: time.Now(), cmd: cmd, done: make(chan struct{})}
	ps.live[p] = struct{}{}
	go func() {
		p.waitErr = cmd.Wait()
		f.Close()
		ps.mu.Lock()
		delete(ps.live, p)
		ps.mu.Unlock()
		close(p.done)
	}()
	return p, nil
}

// childEnv is the harness's environment without what would point a child at
// another cluster or exporter.
func childEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "KUBECONFIG=") || strings.HasPrefix(kv, "OTEL_") {
			continue
		}
		env = append(env, kv)
	}
	return env
}

// exited says whether the process has ended.
func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM to the process group, then SIGKILL after grace.
func (p *proc) stop(grace time.Duration) {
	if p == nil || p.exited() {
		return
	}
	_ = syscall.Kill(-p.pid, syscall.SIGTERM)
	select {
	case <-p.done:
		return
	case <-time.After(grace):
	}
	p.kill()
}

// kill sends SIGKILL to the process group and waits for the process.
func (p *proc) kill() {
	if p == nil || p.exited() {
		return
	}
	_ = syscall.Kill(-p.pid, syscall.SIGKILL)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
	}
}

// killAll kills every live child at once (interrupt, error paths).
func (ps *procs) killAll() {
	ps.mu.Lock()
	live := make([]*proc, 0, len(ps.live))
	for p := range ps.live {
		live = append(live, p)
	}
	ps.mu.Unlock()
	for _, p := range live {
		_ = syscall.Kill(-p.pid, syscall.SIGKILL)
	}
	for _, p := range live {
		p.kill()
	}
}

// stopAll stops every live child gently.
func (ps *procs) stopAll() {
	ps.mu.Lock()
	live := make([]*proc, 0, len(ps.live))
	for p := range ps.live {
		live = append(live, p)
	}
	ps.mu.Unlock()
	var wg sync.WaitGroup
	for _, p := range live {
		wg.Go(func() { p.stop(5 * time.Second) })
	}
	wg.Wait()
}

// logTail returns the last n lines of the process's log.
func (p *proc) logTail(n int) string {
	b, err := os.ReadFile(p.logPath)
	if err != nil {
		return ""
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// died returns an error with the log tail if the process has exited.
func (p *proc) died() error {
	if !p.exited() {
		return nil
	}
	return fmt.Errorf("%s (pid %d) exited: %v; end of %s:\n%s", p.name, p.pid, p.waitErr, p.logPath, p.logTail(25))
}

// cpuSeconds is the CPU time (user and system) of the process so far.
func (p *proc) cpuSeconds() (float64, error) {
	pp, err := procfs.NewProc(p.pid)
	if err != nil {
		return 0, err
	}
	st, err := pp.Stat()
	if err != nil {
		return 0, err
	}
	return st.CPUTime(), nil
}

// ctxSwitches is the number of context switches (voluntary and not) of
// the process's threads so far: /proc/<pid>/status counts one thread
// only, so it sums /proc/<pid>/task/*/status. A thread that has exited is
// no longer counted (Go's runtime keeps its threads).
func (p *proc) ctxSwitches() (uint64, error) {
	ts, err := procfs.AllThreads(p.pid)
	if err != nil {
		return 0, err
	}
	var n uint64
	for _, t := range ts {
		st, err := t.NewStatus()
		if err != nil {
			continue // the thread ended meanwhile
		}
		n += st.TotalCtxtSwitches()
	}
	return n, nil
}

// memory returns VmRSS and VmHWM (peak RSS) in bytes from /proc/<pid>/status.
func (p *proc) memory() (rss, hwm int64, err error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", p.pid))
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		for key, dst := range map[string]*int64{"VmRSS:": &rss, "VmHWM:": &hwm} {
			if rest, ok := strings.CutPrefix(line, key); ok {
				kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
				*dst = kb * 1024
			}
		}
	}
	return rss, hwm, sc.Err()
}

// smapsRollup is the part of /proc/<pid>/smaps_rollup the harness reads.
type smapsRollup struct {
	pss  int64 // proportional set size: each shared page divided among its sharers
	anon int64 // anonymous memory (heap, stacks), never shared here
}

func (p *proc) smaps() (smapsRollup, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", p.pid))
	if err != nil {
		return smapsRollup{}, err
	}
	var m smapsRollup
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		kb, _ := strconv.ParseInt(f[1], 10, 64)
		switch f[0] {
		case "Pss:":
			m.pss = kb * 1024
		case "Anonymous:":
			m.anon = kb * 1024
		}
	}
	return m, nil
}

// freePort returns a free TCP port on 127.0.0.1.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// waitHTTP polls url until it answers 200, the process dies, or timeout.
func waitHTTP(ctx context.Context, p *proc, url string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	c := &http.Client{Timeout: time.Second}
	for {
		if err := p.died(); err != nil {
			return err
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if resp, err := c.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: %s not ready after %s; end of %s:\n%s", p.name, url, timeout, p.logPath, p.logTail(20))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// waitSocket polls until a unix socket accepts connections.
func waitSocket(ctx context.Context, p *proc, path string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		if err := p.died(); err != nil {
			return err
		}
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			c.Close()
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: socket %s not listening after %s; end of %s:\n%s", p.name, path, timeout, p.logPath, p.logTail(20))
		case <-time.After(20 * time.Millisecond):
		}
	}
}
