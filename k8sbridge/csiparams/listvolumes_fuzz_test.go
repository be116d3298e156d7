package csiparams

import (
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
)

// FuzzCheckListVolumes feeds ListVolumes answers (any bytes a driver may
// send, legacy volume conditions in unknown fields included) to the page
// check: nothing may panic; a page it accepts names every volume, within
// the bounds, and every condition in it decodes to a message fit for an
// Event.
func FuzzCheckListVolumes(f *testing.F) {
	for _, r := range []*csi.ListVolumesResponse{
		{Entries: []*csi.ListVolumesResponse_Entry{entry("v1", withLegacy(Condition{Abnormal: true, Message: "disk failing"})), entry("v2", nil)}, NextToken: "t"},
		{Entries: []*csi.ListVolumesResponse_Entry{{Volume: &csi.Volume{}}}},
		{NextToken: "same"},
		{},
	} {
		b, _ := proto.Marshal(r)
		f.Add(b, "same", int32(2), 1)
	}
	f.Add([]byte{0x0a, 0x04, 0x12, 0x02, 0x12, 0x7f}, "", int32(0), 1)
	f.Fuzz(func(t *testing.T, data []byte, sent string, maxEntries int32, page int) {
		var resp csi.ListVolumesResponse
		if proto.Unmarshal(data, &resp) != nil {
			return
		}
		if err := CheckListVolumesPage(&resp, sent, maxEntries, page); err != nil {
			return
		}
		if maxEntries > 0 && len(resp.GetEntries()) > int(maxEntries) {
			t.Fatalf("accepted %d entries for max_entries %d", len(resp.GetEntries()), maxEntries)
		}
		if resp.GetNextToken() != "" && resp.GetNextToken() == sent {
			t.Fatal("accepted a token loop")
		}
		for _, e := range resp.GetEntries() {
			if id := e.GetVolume().GetVolumeId(); id == "" || len(id) > MaxVolumeIDBytes {
				t.Fatalf("accepted volume ID %q", id)
			}
			c, _, err := LegacyCondition(e.GetStatus())
			if err != nil {
				t.Fatalf("accepted a page whose condition does not decode: %v", err)
			}
			checkMessage(t, c.Message)
		}
	})
}

func checkMessage(t *testing.T, m string) {
	t.Helper()
	if len(m) > MaxConditionMessage || !utf8.ValidString(m) || strings.TrimSpace(m) != m {
		t.Fatalf("message %q is not sanitized", m)
	}
	for _, r := range m {
		if unicode.IsControl(r) {
			t.Fatalf("message %q keeps a control character", m)
		}
	}
}
