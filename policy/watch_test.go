package policy

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestPolicyFileErrorsLoggedOnChange: invalid grants of the policy file are
// logged when a load's set differs from the previous one's (an edit that
// breaks a grant at a re-read is said), once, not at every re-read.
func TestPolicyFileErrorsLoggedOnChange(t *testing.T) {
	var buf bytes.Buffer
	w := &FileWatcher{Log: slog.New(slog.NewTextHandler(&buf, nil))}
	typo := []RuleError{{Namespace: "ns", Name: "g", Message: "spec.condition: undeclared reference to 'requst'"}}
	deny := []RuleError{{Namespace: "ns", Name: "d", Message: "spec.drivers: must list at least one driver", FailClosed: true}}
	w.logErrors(nil)
	if buf.Len() != 0 {
		t.Fatalf("a valid file logged: %s", buf.String())
	}
	w.logErrors(typo)
	if !strings.Contains(buf.String(), "invalid grant not applied") || !strings.Contains(buf.String(), "requst") {
		t.Fatalf("a grant broken by an edit was not logged: %s", buf.String())
	}
	buf.Reset()
	w.logErrors(typo)
	if buf.Len() != 0 {
		t.Fatalf("the same invalid grant logged again at a re-read: %s", buf.String())
	}
	w.logErrors(deny)
	if !strings.Contains(buf.String(), "denies every secret of its namespace") {
		t.Fatalf("an invalid deny grant was not logged as fail-closed: %s", buf.String())
	}
	buf.Reset()
	w.logErrors(nil)
	if !strings.Contains(buf.String(), "every grant is valid again") {
		t.Fatalf("the fix was not logged: %s", buf.String())
	}
}

// TestPolicyFileAppliedOnceItHoldsStill: a re-read policy file is applied
// only when it has not changed since the re-read before, so a file caught
// half rewritten (which may still parse, with fewer or weaker grants) is
// never applied; an unchanged file is not applied again.
func TestPolicyFileAppliedOnceItHoldsStill(t *testing.T) {
	s := FileWatcher{done: []byte("v1")}
	steps := []struct {
		read  string
		apply bool
	}{
		{"v1", false},       // unchanged
		{"v2-half", false},  // new: wait
		{"v2-whole", false}, // changed again: wait
		{"v2-whole", true},  // held still: apply
		{"v2-whole", false}, // applied already
		{"v3", false},       // new: wait
		{"v2-whole", false}, // back to the applied content: nothing new
		{"v3", false},       // new again after that: wait
		{"v3", true},        // held still
	}
	for i, st := range steps {
		got := s.settled([]byte(st.read))
		if got != st.apply {
			t.Fatalf("step %d (read %q): apply %v, want %v", i+1, st.read, got, st.apply)
		}
		if got {
			s.done = []byte(st.read)
		}
	}
}

// TestFileWatcherAppliesAChangedFile: the watcher applies a rewritten file
// at a later re-read, and keeps the rules in force when the file breaks.
func TestFileWatcherAppliesAChangedFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "grants.yaml")
	if err := os.WriteFile(path, []byte(twoGrantsYAML), 0o600); err != nil {
		t.Fatal(err)
	}
	logs := &lockedBuffer{}
	w := &FileWatcher{Path: path, Interval: 10 * time.Millisecond, Log: slog.New(slog.NewTextHandler(logs, nil))}
	var s Store
	if err := w.Load(&s); err != nil || s.Load().Len() != 2 {
		t.Fatalf("load: %v, %d rules", err, s.Load().Len())
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx, &s)
	waitFor := func(what string, ok func() bool) {
		t.Helper()
		for end := time.Now().Add(5 * time.Second); !ok(); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(end) {
				t.Fatalf("%s: not within 5s; log: %s", what, logs.String())
			}
		}
	}
	if err := os.WriteFile(path, []byte("[]"), 0o600); err != nil {
		t.Fatal(err)
	}
	waitFor("the emptied file applied", func() bool { return s.Load().Len() == 0 })
	if err := os.WriteFile(path, []byte("spec: [broken"), 0o600); err != nil {
		t.Fatal(err)
	}
	empty := s.Load()
	waitFor("the broken file refused", func() bool { return strings.Contains(logs.String(), "keeping the previous rules") })
	if s.Load() != empty {
		t.Error("a broken file replaced the rules in force")
	}
}

// lockedBuffer is a bytes.Buffer the watcher's goroutine and the test share.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
