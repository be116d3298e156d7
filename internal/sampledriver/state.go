package sampledriver

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"
)

const stateVersion = 1

// state is everything the driver remembers, persisted as state.json and
// its journal (journal.go).
type state struct {
	Version   int                     `json:"version"`
	Journal   int64                   `json:"journal,omitempty"` // the journal generation (see journal.go)
	Volumes   map[string]*volume      `json:"volumes"`           // by volume ID
	Snapshots map[string]*snapshot    `json:"snapshots"`         // by snapshot ID
	Groups    map[string]*group       `json:"groups,omitempty"`  // group snapshots by group snapshot ID
	Staged    map[string]*staging     `json:"staged"`            // by volume ID (this node)
	Published map[string]*publication `json:"published"`         // by target path (this node)
}

type volume struct {
	ID                string            `json:"id"`
	Name              string            `json:"name"`
	CapacityBytes     int64             `json:"capacityBytes"`
	Parameters        map[string]string `json:"parameters,omitempty"`
	MutableParameters map[string]string `json:"mutableParameters,omitempty"`
	Topology          map[string]string `json:"topology,omitempty"`
	SourceVolumeID    string            `json:"sourceVolumeId,omitempty"`
	SourceSnapshotID  string            `json:"sourceSnapshotId,omitempty"`
	Created           time.Time         `json:"created"`
	// Attachments are ControllerPublishVolume results by node ID.
	Attachments map[string]*attachment `json:"attachments,omitempty"`
}

type attachment struct {
	Readonly       bool              `json:"readonly"`
	AccessMode     int32             `json:"accessMode"`
	PublishContext map[string]string `json:"publishContext,omitempty"`
}

type snapshot struct {
	ID             string            `json:"id"`
	Name           string            `json:"name"`
	SourceVolumeID string            `json:"sourceVolumeId"`
	SizeBytes      int64             `json:"sizeBytes"`
	Parameters     map[string]string `json:"parameters,omitempty"`
	Topology       map[string]string `json:"topology,omitempty"`
	Created        time.Time         `json:"created"`
	// GroupID is the group snapshot this snapshot was cut for (empty: a
	// snapshot of its own). Such a snapshot has no name and goes with
	// its group.
	GroupID string `json:"groupId,omitempty"`
}

// group is a group snapshot: one snapshot per source volume, cut
// together.
type group struct {
	ID          string            `json:"id"`
	Name        string            `json:"name"`
	SnapshotIDs []string          `json:"snapshotIds"` // in source volume order
	Parameters  map[string]string `json:"parameters,omitempty"`
	Created     time.Time         `json:"created"`
}

// staging is a NodeStageVolume bind mount on this node.
type staging struct {
	VolumeID   string `json:"volumeId"`
	Path       string `json:"path"`
	Source     string `json:"source"` // the volume directory
	AccessMode int32  `json:"accessMode"`
	// ExpandedBytes is the size NodeExpandVolume last reported (0: never).
	ExpandedBytes int64 `json:"expandedBytes,omitempty"`
}

// publication is a NodePublishVolume bind mount on this node.
type publication struct {
	VolumeID    string `json:"volumeId"`
	TargetPath  string `json:"targetPath"`
	StagingPath string `json:"stagingPath"`
	Source      string `json:"source"` // the volume directory
	Readonly    bool   `json:"readonly"`
	AccessMode  int32  `json:"accessMode"`
}

func newState() *state {
	return &state{
		Version:   stateVersion,
		Volumes:   map[string]*volume{},
		Snapshots: map[string]*snapshot{},
		Groups:    map[string]*group{},
		Staged:    map[string]*staging{},
		Published: map[string]*publication{},
	}
}

// loadState reads path; a missing file is an empty state.
func loadState(path string) (*state, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return newState(), nil
	}
	if err != nil {
		return nil, fmt.Errorf("read state: %w", err)
	}
	st := newState()
	if err := json.Unmarshal(b, st); err != nil {
		return nil, fmt.Errorf("parse state %s: %w", path, err)
	}
	if st.Version != stateVersion {
		return nil, fmt.Errorf("state %s: version %d, want %d", path, st.Version, stateVersion)
	}
	if st.Volumes == nil {
		st.Volumes = map[string]*volume{}
	}
	if st.Snapshots == nil {
		st.Snapshots = map[string]*snapshot{}
	}
	if st.Groups == nil {
		st.Groups = map[string]*group{}
	}
	if st.Staged == nil {
		st.Staged = map[string]*staging{}
	}
	if st.Published == nil {
		st.Published = map[string]*publication{}
	}
	return st, nil
}

// writeFileAtomic replaces path with data: a temp file in the same directory
// is written and fsynced, renamed over path, and the directory is fsynced so
// the rename itself is durable.
func writeFileAtomic(path string, data []byte, perm os.FileMode) (err error) {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".*.tmp")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer func() {
		if err != nil {
			_ = os.Remove(tmp)
		}
	}()
	if _, err = f.Write(data); err != nil {
		_ = f.Close()
		return err
	}
	if err = f.Chmod(perm); err != nil {
		_ = f.Close()
		return err
	}
	if err = f.Sync(); err != nil {
		_ = f.Close()
		return err
	}
	if err = f.Close(); err != nil {
		return err
	}
	if err = os.Rename(tmp, path); err != nil {
		return err
	}
	// From here the new file is in place: a failure only leaves the
	// rename not yet durable, and must not be undone as a failed write.
	if err := syncDir(dir); err != nil {
		return fmt.Errorf("%w: %v", errRenamedNotSynced, err)
	}
	return nil
}

// syncDir makes the entries of directory dir durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// errRenamedNotSynced: the file was replaced, but its directory could not
// be synced.
var errRenamedNotSynced = errors.New("written and renamed, but the directory could not be synced")
