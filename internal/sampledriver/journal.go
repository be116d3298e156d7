package sampledriver

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// The state lives in two files: state.json, the whole state as of its last
// rewrite, and its journal, state.<N>.journal (N is the snapshot's
// "journal" field), one line per change made since then. A call that
// changes one entry appends a line naming that entry with its new value
// (or none: removed) and syncs the journal before it returns, so its cost
// does not grow with the number of volumes. When the journal grows past
// the snapshot's size (and at least journalCompactMin), the whole state is
// written to a new snapshot naming a new, empty journal, and the old
// journal is removed.
//
// A crash during an append leaves a last line without its newline; loading
// drops it (the call it belonged to never returned). A crash during a
// rewrite leaves the old snapshot, which names the old journal, or the new
// one, which names the new journal: never a snapshot with a journal older
// than itself.

// journalCompactMin is the journal size below which it is never folded
// into the snapshot.
const journalCompactMin = 64 << 10

// Entry kinds of a journal change.
const (
	kindVolume    = "volume"
	kindSnapshot  = "snapshot"
	kindGroup     = "group"
	kindStaged    = "staged"
	kindPublished = "published"
)

// stateKey names one entry of the state.
type stateKey struct{ kind, id string }

func volumeKey(id string) stateKey      { return stateKey{kindVolume, id} }
func snapshotKey(id string) stateKey    { return stateKey{kindSnapshot, id} }
func groupKey(id string) stateKey       { return stateKey{kindGroup, id} }
func stagedKey(id string) stateKey      { return stateKey{kindStaged, id} }
func publishedKey(path string) stateKey { return stateKey{kindPublished, path} }

// change is one entry's new value in a journal line; Value absent: removed.
type change struct {
	Kind  string          `json:"kind"`
	ID    string          `json:"id"`
	Value json.RawMessage `json:"value,omitempty"`
}

// changes encodes the current value of each key as one journal line.
func (st *state) changes(keys []stateKey) ([]byte, error) {
	out := make([]change, 0, len(keys))
	for _, k := range keys {
		var v any
		var ok bool
		switch k.kind {
		case kindVolume:
			v, ok = st.Volumes[k.id]
		case kindSnapshot:
			v, ok = st.Snapshots[k.id]
		case kindGroup:
			v, ok = st.Groups[k.id]
		case kindStaged:
			v, ok = st.Staged[k.id]
		case kindPublished:
			v, ok = st.Published[k.id]
		default:
			return nil, fmt.Errorf("unknown state kind %q", k.kind)
		}
		c := change{Kind: k.kind, ID: k.id}
		if ok {
			b, err := json.Marshal(v)
			if err != nil {
				return nil, err
			}
			c.Value = b
		}
		out = append(out, c)
	}
	line, err := json.Marshal(out)
	if err != nil {
		return nil, err
	}
	return append(line, '\n'), nil
}

// apply replays one journal line onto st.
func (st *state) apply(line []byte) error {
	var cs []change
	if err := json.Unmarshal(line, &cs); err != nil {
		return err
	}
	for _, c := range cs {
		if c.ID == "" {
			return errors.New("a change without an ID")
		}
		var err error
		switch c.Kind {
		case kindVolume:
			err = setOrRemove(st.Volumes, c)
		case kindSnapshot:
			err = setOrRemove(st.Snapshots, c)
		case kindGroup:
			err = setOrRemove(st.Groups, c)
		case kindStaged:
			err = setOrRemove(st.Staged, c)
		case kindPublished:
			err = setOrRemove(st.Published, c)
		default:
			err = fmt.Errorf("unknown kind %q", c.Kind)
		}
		if err != nil {
			return fmt.Errorf("%s %s: %w", c.Kind, c.ID, err)
		}
	}
	return nil
}

func setOrRemove[V any](m map[string]*V, c change) error {
	if len(c.Value) == 0 {
		delete(m, c.ID)
		return nil
	}
	v := new(V)
	if err := json.Unmarshal(c.Value, v); err != nil {
		return err
	}
	m[c.ID] = v
	return nil
}

// journalPath is the path of generation gen's journal next to snapPath.
func journalPath(snapPath string, gen int64) string {
	return fmt.Sprintf("%s.%d.journal", strings.TrimSuffix(snapPath, ".json"), gen)
}

// readState loads the snapshot at snapPath and replays its journal onto
// it. good is the length of the journal's complete lines: what follows
// (torn) is a last line cut short by a crash.
//
// limit, if not negative, is how much of the journal to read: after a
// failed append, what was known good before it (a line written whole whose
// sync failed is not replayed into the state the failed call leaves).
func readState(snapPath string, limit int64) (st *state, good, torn int64, err error) {
	if st, err = loadState(snapPath); err != nil {
		return nil, 0, 0, err
	}
	path := journalPath(snapPath, st.Journal)
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return st, 0, 0, nil
	}
	if err != nil {
		return nil, 0, 0, fmt.Errorf("read state journal: %w", err)
	}
	if limit >= 0 && int64(len(b)) > limit {
		b = b[:limit]
	}
	for off := 0; off < len(b); {
		n := bytes.IndexByte(b[off:], '\n')
		if n < 0 {
			return st, int64(off), int64(len(b) - off), nil
		}
		if err := st.apply(b[off : off+n]); err != nil {
			return nil, 0, 0, fmt.Errorf("state journal %s at byte %d: %w", path, off, err)
		}
		off += n + 1
	}
	return st, int64(len(b)), 0, nil
}

// stateStore writes the state: journal lines for changes, the whole
// snapshot now and then. Its methods are called with Driver.mu held.
type stateStore struct {
	snapPath string
	gen      int64    // the journal generation the snapshot names
	journal  *os.File // generation gen's journal
	size     int64    // the journal's length as far as it is known good
	snapSize int64    // the snapshot's length when last written or read
	// unsure: a failed append may have left part of a line after size,
	// and cutting it off failed too; the next save rewrites the snapshot
	// and starts a new journal.
	unsure bool
	// dirUnsynced: the directory entry of the journal (made, or named by
	// a renamed snapshot) may not be durable yet: each append syncs the
	// directory until that succeeds, or its fsync alone would not keep it.
	dirUnsynced bool
}

// openStateStore loads the state and opens its journal for appending,
// cutting off a torn last line (dropped: its length).
func openStateStore(snapPath string) (s *stateStore, st *state, dropped int64, err error) {
	st, good, torn, err := readState(snapPath, -1)
	if err != nil {
		return nil, nil, 0, err
	}
	path := journalPath(snapPath, st.Journal)
	_, serr := os.Stat(path)
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		return nil, nil, 0, fmt.Errorf("open state journal: %w", err)
	}
	if torn > 0 {
		if err := f.Truncate(good); err != nil {
			f.Close()
			return nil, nil, 0, fmt.Errorf("cut the torn end off the state journal: %w", err)
		}
	}
	// A journal made here (a new StateDir, or one of a driver before
	// journals) is in the directory durably before the first append
	// counts on it.
	s = &stateStore{snapPath: snapPath, gen: st.Journal, journal: f, size: good, dirUnsynced: errors.Is(serr, fs.ErrNotExist)}
	if fi, err := os.Stat(snapPath); err == nil {
		s.snapSize = fi.Size()
	}
	return s, st, torn, nil
}

// appendChanges appends the current values of keys to the journal and
// syncs it. On failure the journal is cut back to where it was. Not called
// while unsure (Driver.save rewrites the whole state then).
func (s *stateStore) appendChanges(st *state, keys []stateKey) error {
	line, err := st.changes(keys)
	if err != nil {
		return err
	}
	if _, err = s.journal.WriteAt(line, s.size); err == nil {
		err = s.journal.Sync()
	}
	if err != nil {
		if terr := s.journal.Truncate(s.size); terr != nil {
			s.unsure = true
		}
		return fmt.Errorf("append to state journal: %w", err)
	}
	s.size += int64(len(line))
	if s.dirUnsynced {
		if err := syncDir(filepath.Dir(s.snapPath)); err != nil {
			return fmt.Errorf("%w: %v", errRenamedNotSynced, err)
		}
		s.dirUnsynced = false
	}
	return nil
}

// wantsRewrite reports whether the journal should be folded into a new
// snapshot.
func (s *stateStore) wantsRewrite() bool {
	return s.size >= journalCompactMin && s.size > s.snapSize
}

// writeAll writes the whole state as a new snapshot naming a new, empty
// journal, made first so the snapshot's directory sync covers it too. On
// success (or errRenamedNotSynced: the new snapshot is in place, though a
// crash could bring the old one back) the store moves to the new journal
// and removes the old one.
func (s *stateStore) writeAll(st *state) error {
	gen := s.gen + 1
	path := journalPath(s.snapPath, gen)
	f, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("create state journal: %w", err)
	}
	snap := *st
	snap.Journal = gen
	b, err := json.MarshalIndent(&snap, "", "  ")
	if err == nil {
		err = writeFileAtomic(s.snapPath, b, 0o600)
	}
	if err != nil && !errors.Is(err, errRenamedNotSynced) {
		f.Close()
		_ = os.Remove(path)
		return err
	}
	if old := s.journal; old != nil {
		if err == nil {
			// Kept otherwise: the old snapshot that names it could
			// come back. The next start's sweep removes it.
			_ = os.Remove(old.Name())
		}
		_ = old.Close()
	}
	st.Journal = gen
	s.gen, s.journal, s.size, s.snapSize, s.unsure = gen, f, 0, int64(len(b)), false
	s.dirUnsynced = err != nil
	return err
}

func (s *stateStore) close() error {
	if s == nil || s.journal == nil {
		return nil
	}
	err := s.journal.Close()
	s.journal = nil
	return err
}
