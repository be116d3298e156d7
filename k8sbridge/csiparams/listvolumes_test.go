package csiparams

import (
	"errors"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
)

// withLegacy is a ListVolumes status carrying a legacy condition, as a
// driver built on CSI v1.12 sends it.
func withLegacy(c Condition) *csi.ListVolumesResponse_VolumeStatus {
	st := &csi.ListVolumesResponse_VolumeStatus{PublishedNodeIds: []string{"n1"}}
	st.ProtoReflect().SetUnknown(AppendLegacyCondition(nil, c))
	return st
}

func entry(id string, st *csi.ListVolumesResponse_VolumeStatus) *csi.ListVolumesResponse_Entry {
	return &csi.ListVolumesResponse_Entry{Volume: &csi.Volume{VolumeId: id, CapacityBytes: 1}, Status: st}
}

func TestCheckListVolumesPage(t *testing.T) {
	for _, tc := range []struct {
		name    string
		resp    *csi.ListVolumesResponse
		sent    string
		max     int32
		page    int
		wantErr string
	}{
		{name: "good page", resp: &csi.ListVolumesResponse{Entries: []*csi.ListVolumesResponse_Entry{entry("v1", nil), entry("v2", withLegacy(Condition{Abnormal: true, Message: "x"}))}, NextToken: "t2"}, sent: "t1", max: 2, page: 2},
		{name: "empty answer", resp: &csi.ListVolumesResponse{}, page: 1},
		{name: "empty volume ID", resp: &csi.ListVolumesResponse{Entries: []*csi.ListVolumesResponse_Entry{entry("", nil)}}, page: 1, wantErr: "names no volume"},
		{name: "entry without a volume", resp: &csi.ListVolumesResponse{Entries: []*csi.ListVolumesResponse_Entry{{}}}, page: 1, wantErr: "names no volume"},
		{name: "ID too long", resp: &csi.ListVolumesResponse{Entries: []*csi.ListVolumesResponse_Entry{entry(strings.Repeat("a", MaxVolumeIDBytes+1), nil)}}, page: 1, wantErr: "a volume ID of"},
		{name: "negative capacity", resp: &csi.ListVolumesResponse{Entries: []*csi.ListVolumesResponse_Entry{{Volume: &csi.Volume{VolumeId: "v", CapacityBytes: -1}}}}, page: 1, wantErr: "negative capacity"},
		{name: "token loop", resp: &csi.ListVolumesResponse{NextToken: "t1"}, sent: "t1", page: 3, wantErr: "never end"},
		{name: "more entries than asked", resp: &csi.ListVolumesResponse{Entries: []*csi.ListVolumesResponse_Entry{entry("a", nil), entry("b", nil)}}, max: 1, page: 1, wantErr: "more than the max_entries"},
		{name: "too many pages", resp: &csi.ListVolumesResponse{NextToken: "next"}, sent: "prev", page: MaxListPages, wantErr: "pages"},
		{name: "last page at the bound", resp: &csi.ListVolumesResponse{}, sent: "prev", page: MaxListPages},
		{name: "huge token", resp: &csi.ListVolumesResponse{NextToken: strings.Repeat("t", MaxVolumeIDBytes+1)}, page: 1, wantErr: "next_token of"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := CheckListVolumesPage(tc.resp, tc.sent, tc.max, tc.page)
			if tc.wantErr == "" {
				if err != nil {
					t.Fatalf("unexpected error: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
			}
		})
	}
	if err := CheckListVolumesPage(&csi.ListVolumesResponse{NextToken: "a"}, "a", 0, 2); !errors.Is(err, ErrTokenLoop) {
		t.Fatalf("a loop is %v, want ErrTokenLoop", err)
	}
}

func TestCheckListVolumesPageBadLegacyCondition(t *testing.T) {
	st := &csi.ListVolumesResponse_VolumeStatus{}
	st.ProtoReflect().SetUnknown([]byte{0x12, 0x05, 0x08}) // field 2, length 5, one byte follows
	err := CheckListVolumesPage(&csi.ListVolumesResponse{Entries: []*csi.ListVolumesResponse_Entry{entry("v", st)}}, "", 0, 1)
	if err == nil || !strings.Contains(err.Error(), "volume v") {
		t.Fatalf("a torn condition is %v, want an error naming the volume", err)
	}
}

func TestCheckVolumeHealthPage(t *testing.T) {
	good := &csi.ControllerListVolumeHealthResponse{Entries: []*csi.VolumeHealth{{VolumeId: "v1"}}}
	if err := CheckVolumeHealthPage(good, "", 10, 1); err != nil {
		t.Fatal(err)
	}
	bad := &csi.ControllerListVolumeHealthResponse{Entries: []*csi.VolumeHealth{{}}}
	if err := CheckVolumeHealthPage(bad, "", 10, 1); err == nil || !strings.Contains(err.Error(), "names no volume") {
		t.Fatalf("an entry without an ID is %v", err)
	}
	loop := &csi.ControllerListVolumeHealthResponse{NextToken: "x"}
	if err := CheckVolumeHealthPage(loop, "x", 10, 2); !errors.Is(err, ErrTokenLoop) {
		t.Fatalf("a loop is %v", err)
	}
}

func TestLegacyCondition(t *testing.T) {
	for _, tc := range []struct {
		name   string
		status proto.Message
		want   Condition
		ok     bool
	}{
		{name: "nil status", status: nil},
		{name: "typed nil status", status: (*csi.ListVolumesResponse_VolumeStatus)(nil)},
		{name: "no condition", status: &csi.ListVolumesResponse_VolumeStatus{PublishedNodeIds: []string{"n"}}},
		{name: "abnormal", status: withLegacy(Condition{Abnormal: true, Message: "disk\nfailing"}), want: Condition{Abnormal: true, Message: "disk failing"}, ok: true},
		{name: "normal", status: withLegacy(Condition{Message: "fine"}), want: Condition{Message: "fine"}, ok: true},
		{name: "empty condition", status: withLegacy(Condition{}), ok: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok, err := LegacyCondition(tc.status)
			if err != nil || ok != tc.ok || got != tc.want {
				t.Fatalf("got %+v, %v, %v; want %+v, %v", got, ok, err, tc.want, tc.ok)
			}
		})
	}
	// Two occurrences merge: the last abnormal and message win, and a
	// field the broker does not know is skipped.
	st := &csi.ControllerGetVolumeResponse_VolumeStatus{}
	b := AppendLegacyCondition(nil, Condition{Abnormal: true, Message: "first"})
	b = append(b, 0x18, 0x07) // field 3 varint 7
	b = AppendLegacyCondition(b, Condition{Message: "second"})
	st.ProtoReflect().SetUnknown(b)
	got, ok, err := LegacyCondition(st)
	if err != nil || !ok || got != (Condition{Abnormal: true, Message: "second"}) {
		t.Fatalf("merged: %+v %v %v", got, ok, err)
	}
	// It survives the wire: a status marshalled by an old driver and read
	// by this broker's protobuf.
	wire, err := proto.Marshal(&csi.ListVolumesResponse{Entries: []*csi.ListVolumesResponse_Entry{entry("v", withLegacy(Condition{Abnormal: true, Message: "m"}))}})
	if err != nil {
		t.Fatal(err)
	}
	var back csi.ListVolumesResponse
	if err := proto.Unmarshal(wire, &back); err != nil {
		t.Fatal(err)
	}
	if got, ok, err := LegacyCondition(back.GetEntries()[0].GetStatus()); err != nil || !ok || !got.Abnormal || got.Message != "m" {
		t.Fatalf("after the wire: %+v %v %v", got, ok, err)
	}
}

func TestHealthCondition(t *testing.T) {
	for _, tc := range []struct {
		name string
		h    *csi.VolumeHealth
		want Condition
	}{
		{name: "nil", h: nil},
		{name: "no entries", h: &csi.VolumeHealth{VolumeId: "v"}},
		{name: "degraded", h: &csi.VolumeHealth{VolumeId: "v", HealthStatuses: []*csi.VolumeHealth_VolumeHealthEntry{{Status: csi.VolumeHealthErrorType_DEGRADED, Reason: "SlowDisk", Message: "one replica lost"}}},
			want: Condition{Abnormal: true, Message: "DEGRADED SlowDisk: one replica lost"}},
		{name: "unknown type alone is ignored", h: &csi.VolumeHealth{VolumeId: "v", HealthStatuses: []*csi.VolumeHealth_VolumeHealthEntry{{Status: 42, Reason: "New"}}}},
		{name: "unknown beside known", h: &csi.VolumeHealth{VolumeId: "v", HealthStatuses: []*csi.VolumeHealth_VolumeHealthEntry{
			{Status: 42, Reason: "New"}, {Status: csi.VolumeHealthErrorType_DATA_LOSS, Reason: "Gone"}}},
			want: Condition{Abnormal: true, Message: "type 42 New; DATA_LOSS Gone"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := HealthCondition(tc.h); got != tc.want {
				t.Fatalf("got %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestSanitizeMessage(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"", ""},
		{"  plain  ", "plain"},
		{"a\x00b\r\nc\td", "a b c d"},
		{"bad \xff utf8", "bad \uFFFD utf8"},
		{"esc \x1b[31mred", "esc [31mred"},
	} {
		if got := SanitizeMessage(tc.in); got != tc.want {
			t.Errorf("SanitizeMessage(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
	long := SanitizeMessage(strings.Repeat("é", MaxConditionMessage))
	if len(long) > MaxConditionMessage || !utf8.ValidString(long) || !strings.HasSuffix(long, "…") {
		t.Fatalf("a long message: %d bytes, valid %v, %q…", len(long), utf8.ValidString(long), long[len(long)-8:])
	}
}
