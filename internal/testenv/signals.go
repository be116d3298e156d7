package testenv

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Everything this process has started and not yet cleaned up, so that an
// interrupt can clean up before the process dies.
var live struct {
	sync.Mutex
	components map[*component]struct{}
	dirs       map[string]struct{}
}

var installOnce sync.Once

// LeaveSignalsToCaller keeps testenv from installing its SIGINT/SIGTERM
// handler, which kills the control plane and the process at once. A
// program that stops its environments itself on a signal (the demo) calls
// it before Start; should it die without stopping them, Pdeathsig still
// takes the components down.
func LeaveSignalsToCaller() { installOnce.Do(func() {}) }

func register(c *component) {
	installOnce.Do(installSignalHandler)
	live.Lock()
	defer live.Unlock()
	if live.components == nil {
		live.components = map[*component]struct{}{}
	}
	live.components[c] = struct{}{}
}

func unregister(c *component) {
	live.Lock()
	defer live.Unlock()
	delete(live.components, c)
}

func registerDir(dir string) {
	installOnce.Do(installSignalHandler)
	live.Lock()
	defer live.Unlock()
	if live.dirs == nil {
		live.dirs = map[string]struct{}{}
	}
	live.dirs[dir] = struct{}{}
}

func unregisterDir(dir string) {
	live.Lock()
	defer live.Unlock()
	delete(live.dirs, dir)
}

// installSignalHandler kills every live component and removes every live
// directory on SIGINT or SIGTERM, then re-raises the signal with its default
// action so the process still dies of it.
func installSignalHandler() {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		sig := <-ch
		fmt.Fprintf(os.Stderr, "testenv: %v: stopping the control plane\n", sig)
		cleanupAll()
		signal.Reset(sig)
		_ = syscall.Kill(os.Getpid(), sig.(syscall.Signal))
		// Should the signal be blocked or ignored by the parent's setup,
		// still exit the way a signalled process would be reported.
		time.Sleep(time.Second)
		os.Exit(128 + int(sig.(syscall.Signal)))
	}()
}

func cleanupAll() {
	live.Lock()
	comps := make([]*component, 0, len(live.components))
	for c := range live.components {
		comps = append(comps, c)
	}
	dirs := make([]string, 0, len(live.dirs))
	for d := range live.dirs {
		dirs = append(dirs, d)
	}
	live.Unlock()

	for _, c := range comps {
		c.signal(syscall.SIGKILL)
	}
	deadline := time.After(5 * time.Second)
	for _, c := range comps {
		select {
		case <-c.done:
		case <-deadline:
		}
	}
	for _, d := range dirs {
		_ = os.RemoveAll(d)
	}
}

const (
	dirPrefix    = "csibroker-testenv-"
	ownerPIDFile = "owner.pid"
)

// sweepStaleDirs removes temporary directories left by test processes that
// died without cleaning up (a test timeout panics the binary, which runs no
// cleanup; Pdeathsig takes the components down, but not their directory).
// A directory is stale when the process recorded in it no longer exists.
func sweepStaleDirs() {
	matches, _ := filepath.Glob(filepath.Join(os.TempDir(), dirPrefix+"*"))
	for _, dir := range matches {
		b, err := os.ReadFile(filepath.Join(dir, ownerPIDFile))
		if err != nil {
			continue // not ours, or being created right now
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || pid <= 0 || pid == os.Getpid() {
			continue
		}
		if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
			_ = os.RemoveAll(dir)
		}
	}
}
