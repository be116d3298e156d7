package policy

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"
)

// FileWatcher loads a policy file into a Store and re-reads it every
// Interval. A re-read is applied only once it holds still (settled): a
// file rewritten in place and caught half-way is often still valid YAML
// (a grant cut before its "action: Deny" line is an Allow grant), and
// one interval later it is whole. A re-read that fails to read or parse
// keeps the rules in force; the file's invalid grants are logged when
// they change, not at every re-read.
type FileWatcher struct {
	Path     string
	Interval time.Duration
	Log      *slog.Logger

	done, seen []byte // the content handled last, and the latest read
	errsLogged string // the invalid grants logged last (logErrors)
}

// Load reads and applies the file once, at start-up: an unreadable or
// unparsable file is an error.
func (w *FileWatcher) Load(s *Store) error {
	data, err := ReadFile(w.Path)
	if err != nil {
		return err
	}
	errs, err := s.LoadData(w.Path, data)
	if err != nil {
		return err
	}
	w.done = data
	w.logErrors(errs)
	return nil
}

// Run re-reads the file every Interval until ctx is done.
func (w *FileWatcher) Run(ctx context.Context, s *Store) {
	t := time.NewTicker(w.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			data, err := ReadFile(w.Path)
			if err != nil {
				w.Log.Error("policy file unreadable; keeping the previous rules", "file", w.Path, "err", err)
				continue
			}
			if !w.settled(data) {
				continue
			}
			w.done = data // said once, until the file changes
			errs, err := s.LoadData(w.Path, data)
			if err != nil {
				w.Log.Error("policy file unreadable; keeping the previous rules", "file", w.Path, "err", err)
				continue
			}
			w.logErrors(errs)
		}
	}
}

// settled records data as the latest read and reports whether to apply
// it: it differs from the content handled last (applied, or refused with
// an error logged) and has not changed since the re-read before.
func (w *FileWatcher) settled(data []byte) bool {
	if bytes.Equal(data, w.done) {
		w.seen = data
		return false // nothing new
	}
	held := bytes.Equal(data, w.seen)
	w.seen = data
	return held
}

// logErrors logs the invalid grants of a load when they differ from the
// previous load's, so an edit that breaks a grant is said once, not at
// every re-read.
func (w *FileWatcher) logErrors(errs []RuleError) {
	var b strings.Builder
	for _, e := range errs {
		fmt.Fprintf(&b, "%s: %s (fail-closed %t)\n", e.Key(), e.Message, e.FailClosed)
	}
	if b.String() == w.errsLogged {
		return
	}
	for _, e := range errs {
		if e.FailClosed {
			w.Log.Error("policy file: invalid deny grant; it denies every secret of its namespace (or, without one, every secret) until fixed", "grant", e.Key(), "err", e.Message)
		} else {
			w.Log.Error("policy file: invalid grant not applied", "grant", e.Key(), "err", e.Message)
		}
	}
	if len(errs) == 0 && w.errsLogged != "" {
		w.Log.Info("policy file: every grant is valid again")
	}
	w.errsLogged = b.String()
}
