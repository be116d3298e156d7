package testenv

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// component is one child process of the control plane.
type component struct {
	name    string
	kind    string // for processes started after the control plane: the program
	logPath string
	cmd     *exec.Cmd
	done    chan struct{} // closed once the process has been reaped
	waitErr error         // valid after done is closed
}

// startComponent starts bin with args in its own process group, with stdout
// and stderr appended to dir/<name>.log.
func startComponent(dir, name, bin string, args []string) (*component, error) {
	logPath := filepath.Join(dir, name+".log")
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open %s log: %w", name, err)
	}
	fmt.Fprintf(logFile, "# %s %s\n", bin, strings.Join(args, " "))

	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	cmd.Env = childEnv()
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	c := &component{name: name, logPath: logPath, cmd: cmd, done: make(chan struct{})}
	register(c)
	go func() {
		c.waitErr = cmd.Wait()
		logFile.Close()
		unregister(c)
		close(c.done)
	}()
	return c, nil
}

// childEnv is the test process's environment without what would point the
// components at another cluster.
func childEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "KUBECONFIG=") {
			continue
		}
		env = append(env, kv)
	}
	return env
}

// exited reports whether the process has ended, and how.
func (c *component) exited() (bool, error) {
	select {
	case <-c.done:
		if c.waitErr == nil {
			return true, errors.New("exit status 0")
		}
		return true, c.waitErr
	default:
		return false, nil
	}
}

// signal sends sig to the component's process group while its leader has
// not been reaped (so the group ID cannot belong to anyone else yet).
func (c *component) signal(sig syscall.Signal) {
	select {
	case <-c.done:
	default:
		_ = syscall.Kill(-c.cmd.Process.Pid, sig)
	}
}

// stop asks the component to terminate, kills its group after grace, and
// waits until it is reaped.
func (c *component) stop(grace time.Duration) {
	c.signal(syscall.SIGTERM)
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-c.done:
	case <-t.C:
		c.signal(syscall.SIGKILL)
		<-c.done
	}
}

// tail returns the last n lines of the component's log.
func (c *component) tail(n int) string { return tailFile(c.logPath, n) }

func tailFile(path string, n int) string {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Sprintf("(cannot read %s: %v)", path, err)
	}
	defer f.Close()
	const maxBytes = 16 << 10
	if st, err := f.Stat(); err == nil && st.Size() > maxBytes {
		_, _ = f.Seek(st.Size()-maxBytes, io.SeekStart)
	}
	b, _ := io.ReadAll(f)
	b = bytes.TrimRight(b, "\n")
	lines := strings.Split(string(b), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// freePorts returns n distinct free TCP ports on 127.0.0.1. The listeners are
// held until all ports are chosen so the same port is not returned twice; a
// port can still be taken by someone else before the component binds it, which
// Start handles by retrying.
func freePorts(n int) ([]int, error) {
	ports := make([]int, 0, n)
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("find a free port: %w", err)
		}
		defer l.Close()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}
