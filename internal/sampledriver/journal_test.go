package sampledriver

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

// persisted is what a new Driver on d's StateDir would load, as JSON.
func persisted(t *testing.T, d *Driver) []byte {
	t.Helper()
	st, _, torn, err := readState(d.statePath, -1)
	if err != nil {
		t.Fatalf("read the saved state: %v", err)
	}
	if torn != 0 {
		t.Fatalf("the journal ends in %d bytes of a torn line", torn)
	}
	b, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func inMemory(t *testing.T, d *Driver) []byte {
	t.Helper()
	d.mu.Lock()
	defer d.mu.Unlock()
	b, err := json.Marshal(d.st)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func journalFiles(t *testing.T, dir string) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(dir, "state.*.journal"))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestEveryChangeIsSaved: after each call that changes the state, what a
// restart would load is what the driver holds, and the change went to the
// journal, not to a rewrite of state.json.
func TestEveryChangeIsSaved(t *testing.T) {
	stateDir := t.TempDir()
	cfg := Config{NodeID: "node-1", StateDir: stateDir, CapacityBytes: 100 << 20}
	staging, target := mountPaths(t)
	c, d, _ := serveOn(t, cfg)
	t.Cleanup(func() {
		for _, p := range []string{target, staging} {
			if ok, _ := isMountPoint(p); ok {
				_ = unmount(p)
			}
		}
	})
	ctx := ctxT(t)
	capa := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
	var vol *csi.Volume
	var pubCtx map[string]string
	var snapID string
	steps := []struct {
		name string
		call func() error
	}{
		{"CreateVolume", func() error {
			r, err := c.CreateVolume(ctx, createReq("v", 10<<20))
			vol = r.GetVolume()
			return err
		}},
		{"ControllerPublishVolume", func() error {
			r, err := c.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol.GetVolumeId(), NodeId: "node-1", VolumeCapability: capa})
			pubCtx = r.GetPublishContext()
			return err
		}},
		{"NodeStageVolume", func() error {
			_, err := c.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging, VolumeCapability: capa, PublishContext: pubCtx})
			return err
		}},
		{"NodePublishVolume", func() error {
			_, err := c.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging, TargetPath: target, VolumeCapability: capa, PublishContext: pubCtx})
			return err
		}},
		{"ControllerExpandVolume", func() error {
			_, err := c.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: vol.GetVolumeId(), CapacityRange: &csi.CapacityRange{RequiredBytes: 20 << 20}})
			return err
		}},
		{"NodeExpandVolume", func() error {
			_, err := c.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: vol.GetVolumeId(), VolumePath: target, StagingTargetPath: staging, CapacityRange: &csi.CapacityRange{RequiredBytes: 20 << 20}})
			return err
		}},
		{"ControllerModifyVolume", func() error {
			_, err := c.ControllerModifyVolume(ctx, &csi.ControllerModifyVolumeRequest{VolumeId: vol.GetVolumeId(), MutableParameters: map[string]string{"iops": "500"}})
			return err
		}},
		{"CreateSnapshot", func() error {
			r, err := c.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "s", SourceVolumeId: vol.GetVolumeId()})
			snapID = r.GetSnapshot().GetSnapshotId()
			return err
		}},
		{"DeleteSnapshot", func() error {
			_, err := c.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snapID})
			return err
		}},
		{"NodeUnpublishVolume", func() error {
			_, err := c.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: vol.GetVolumeId(), TargetPath: target})
			return err
		}},
		{"NodeUnstageVolume", func() error {
			_, err := c.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: staging})
			return err
		}},
		{"ControllerUnpublishVolume", func() error {
			_, err := c.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol.GetVolumeId(), NodeId: "node-1"})
			return err
		}},
		{"DeleteVolume", func() error {
			_, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()})
			return err
		}},
	}
	snapBefore, err := os.ReadFile(filepath.Join(stateDir, "state.json"))
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	for _, s := range steps {
		before := inMemory(t, d)
		if err := s.call(); err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		mem := inMemory(t, d)
		if bytes.Equal(mem, before) {
			t.Fatalf("%s changed nothing the state holds", s.name)
		}
		if disk := persisted(t, d); !bytes.Equal(disk, mem) {
			t.Fatalf("after %s a restart would load\n%s\nbut the driver holds\n%s", s.name, disk, mem)
		}
	}
	if snapAfter, _ := os.ReadFile(filepath.Join(stateDir, "state.json")); !bytes.Equal(snapAfter, snapBefore) {
		t.Errorf("state.json was rewritten by small changes (%d bytes before, %d after)", len(snapBefore), len(snapAfter))
	}
	if j := journalFiles(t, stateDir); len(j) != 1 {
		t.Fatalf("journals %v, want one", j)
	} else if b, _ := os.ReadFile(j[0]); bytes.Count(b, []byte("\n")) != len(steps) {
		t.Fatalf("journal has %d lines after %d changes", bytes.Count(b, []byte("\n")), len(steps))
	}
}

// TestTornJournalLine: a last journal line cut short (a stop during an
// append) is dropped on start; the changes before it stand and later ones
// are appended after them, not after the torn bytes.
func TestTornJournalLine(t *testing.T) {
	stateDir := t.TempDir()
	cfg := Config{NodeID: "node-1", StateDir: stateDir, CapacityBytes: 100 << 20}
	c1, d1, stop1 := serveOn(t, cfg)
	a := mustCreate(t, c1, "a", 1<<20)
	want := persisted(t, d1)
	stop1()
	j := journalFiles(t, stateDir)
	if len(j) != 1 {
		t.Fatalf("journals %v", j)
	}
	f, err := os.OpenFile(j[0], os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString(`[{"kind":"volume","id":"sv-torn","value":{"id":"sv-`); err != nil {
		t.Fatal(err)
	}
	f.Close()

	c2, d2, stop2 := serveOn(t, cfg)
	if got := inMemory(t, d2); !bytes.Equal(got, want) {
		t.Fatalf("after a torn line the driver holds\n%s\nwant\n%s", got, want)
	}
	if got, err := os.ReadFile(j[0]); err != nil || bytes.Contains(got, []byte("sv-torn")) || !bytes.HasSuffix(got, []byte("\n")) {
		t.Fatalf("the journal still ends in the torn line (%v): %s", err, got)
	}
	b := mustCreate(t, c2, "b", 1<<20)
	stop2()
	_, d3, _ := serveOn(t, cfg)
	vols := d3.Volumes()
	if len(vols) != 2 || (vols[0].ID != a.GetVolumeId() && vols[1].ID != a.GetVolumeId()) || (vols[0].ID != b.GetVolumeId() && vols[1].ID != b.GetVolumeId()) {
		t.Fatalf("volumes after two restarts: %+v, want %s and %s", vols, a.GetVolumeId(), b.GetVolumeId())
	}
}

// TestJournalFoldedIntoSnapshot: a journal grown past the snapshot is
// folded into a new state.json naming a new journal; the old journal is
// removed and a restart loads everything.
func TestJournalFoldedIntoSnapshot(t *testing.T) {
	stateDir := t.TempDir()
	cfg := Config{NodeID: "node-1", StateDir: stateDir, CapacityBytes: 1 << 40}
	c1, d1, stop1 := serveOn(t, cfg)
	first := journalFiles(t, stateDir)
	var ids []string
	for i := 0; len(ids) < 2000; i++ {
		ids = append(ids, mustCreate(t, c1, fmt.Sprintf("vol-%04d", i), 1<<20).GetVolumeId())
		d1.mu.Lock()
		gen := d1.st.Journal
		d1.mu.Unlock()
		if gen > 0 {
			break
		}
	}
	d1.mu.Lock()
	gen, size := d1.st.Journal, d1.store.size
	d1.mu.Unlock()
	if gen != 1 || size != 0 {
		t.Fatalf("after %d volumes: journal generation %d, size %d; want a fold into generation 1", len(ids), gen, size)
	}
	if len(ids) < journalCompactMin/1000 {
		t.Fatalf("folded after only %d volumes (journal under %d bytes)", len(ids), journalCompactMin)
	}
	snap, err := os.ReadFile(filepath.Join(stateDir, "state.json"))
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		if !bytes.Contains(snap, []byte(id)) {
			t.Fatalf("volume %s is not in the new state.json", id)
		}
	}
	if j := journalFiles(t, stateDir); len(j) != 1 || j[0] == first[0] || !strings.HasSuffix(j[0], "state.1.journal") {
		t.Fatalf("journals after the fold %v (before %v)", j, first)
	}
	last := mustCreate(t, c1, "after-fold", 1<<20).GetVolumeId()
	stop1()
	// What a stop in the middle of a fold can leave: the next
	// generation's journal made but never named, and an old one. Were
	// either replayed, the last volume would be gone.
	for _, p := range []string{"state.2.journal", "state.0.journal"} {
		if err := os.WriteFile(filepath.Join(stateDir, p), []byte(`[{"kind":"volume","id":"`+last+`"}]`+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	_, d2, _ := serveOn(t, cfg)
	if n := len(d2.Volumes()); n != len(ids)+1 {
		t.Fatalf("%d volumes after a restart, want %d", n, len(ids)+1)
	}
	if _, ok := d2.st.Volumes[last]; !ok {
		t.Fatalf("the volume made after the fold is lost")
	}
	if j := journalFiles(t, stateDir); len(j) != 1 || !strings.HasSuffix(j[0], "state.1.journal") {
		t.Fatalf("journals after a restart %v, want only the named one", j)
	}
}

// TestCorruptJournalRefusesToStart: a bad line with lines after it is not a
// torn append but damage; the driver says where and does not start.
func TestCorruptJournalRefusesToStart(t *testing.T) {
	stateDir := t.TempDir()
	cfg := Config{NodeID: "node-1", StateDir: stateDir, CapacityBytes: 100 << 20}
	c1, _, stop1 := serveOn(t, cfg)
	mustCreate(t, c1, "a", 1<<20)
	stop1()
	j := journalFiles(t, stateDir)[0]
	b, err := os.ReadFile(j)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(j, append([]byte("{not json\n"), b...), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = New(cfg)
	if err == nil || !strings.Contains(err.Error(), "state.0.journal at byte 0") {
		t.Fatalf("New on a damaged journal: %v", err)
	}
}

// TestFailedJournalWrite: a change whose journal write fails fails its call
// and is not held in memory; the next change writes the whole state anew.
func TestFailedJournalWrite(t *testing.T) {
	stateDir := t.TempDir()
	cfg := Config{NodeID: "node-1", StateDir: stateDir, CapacityBytes: 100 << 20}
	c, d, _ := serveOn(t, cfg)
	a := mustCreate(t, c, "a", 1<<20)
	d.mu.Lock()
	d.store.journal.Close() // every write and truncation of it now fails
	d.mu.Unlock()
	_, err := c.CreateVolume(ctxT(t), createReq("b", 1<<20))
	wantCode(t, "CreateVolume with a failing journal", err, codes.Internal)
	if vols := d.Volumes(); len(vols) != 1 || vols[0].ID != a.GetVolumeId() {
		t.Fatalf("volumes after a failed save: %+v", vols)
	}
	if _, err := c.CreateVolume(ctxT(t), createReq("b", 1<<20)); err != nil {
		t.Fatalf("CreateVolume after the failure: %v", err)
	}
	if disk, mem := persisted(t, d), inMemory(t, d); !bytes.Equal(disk, mem) {
		t.Fatalf("a restart would load\n%s\nbut the driver holds\n%s", disk, mem)
	}
	if d.st.Journal != 1 {
		t.Fatalf("journal generation %d after the failure, want a new one (1)", d.st.Journal)
	}
}
