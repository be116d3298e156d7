package csiparams

// Checks of the listings volume health monitoring reads from a driver
// (ListVolumes, ControllerListVolumeHealth) and of the conditions in them:
// a driver's answers are input the broker does not control. A page that
// fails a check ends the sweep with an error; nothing is concluded from a
// listing that was not read to its end (a volume "missing" from half a
// listing is not missing).

import (
	"errors"
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// Bounds of a listing.
const (
	// ListPageSize is the max_entries the broker asks for in each page.
	ListPageSize = 500
	// MaxListPages bounds the pages of one listing: 5 million volumes at
	// ListPageSize; a driver that hands out more is looping.
	MaxListPages = 10000
	// MaxVolumeIDBytes bounds a listed volume ID (the spec asks plugins
	// for 128 bytes at most; a PV's volume handle may be longer, but not
	// this long).
	MaxVolumeIDBytes = 4096
	// MaxConditionMessage bounds a condition's message once sanitized
	// (bytes), so an Event stays readable.
	MaxConditionMessage = 512
)

// ErrTokenLoop is a listing whose next_token is the token just sent: the
// same page would be asked for ever.
var ErrTokenLoop = errors.New("the driver's next_token is the starting_token it was sent (the listing would never end)")

// CheckListPage checks the paging of page number page (counted from 1) of
// a listing by method: it holds no more entries than maxEntries asked
// (the spec's MUST), its next_token does not send the listing back to
// where it was, and the listing has not gone on for more than
// MaxListPages pages.
func CheckListPage(method string, page int, sent, next string, entries int, maxEntries int32) error {
	switch {
	case maxEntries > 0 && entries > int(maxEntries):
		return fmt.Errorf("%s page %d: %d entries, more than the max_entries %d asked", method, page, entries, maxEntries)
	case next != "" && next == sent:
		return fmt.Errorf("%s page %d: %w", method, page, ErrTokenLoop)
	case next != "" && page >= MaxListPages:
		return fmt.Errorf("%s: more than %d pages; the listing is given up", method, MaxListPages)
	case len(next) > MaxVolumeIDBytes:
		return fmt.Errorf("%s page %d: next_token of %d bytes", method, page, len(next))
	}
	return nil
}

// checkListedID checks one listed volume ID.
func checkListedID(method string, page, i int, id string) error {
	switch {
	case id == "":
		return fmt.Errorf("%s page %d: entry %d names no volume", method, page, i)
	case len(id) > MaxVolumeIDBytes:
		return fmt.Errorf("%s page %d: entry %d: a volume ID of %d bytes", method, page, i, len(id))
	}
	return nil
}

// CheckListVolumesPage checks page number page of a ListVolumes listing,
// asked with starting_token sent and max_entries maxEntries: its paging
// (CheckListPage), and each entry names a volume of a sane ID, has no
// negative capacity and, if it carries a legacy volume condition, one that
// decodes.
func CheckListVolumesPage(resp *csi.ListVolumesResponse, sent string, maxEntries int32, page int) error {
	const method = "ListVolumes"
	if err := CheckListPage(method, page, sent, resp.GetNextToken(), len(resp.GetEntries()), maxEntries); err != nil {
		return err
	}
	for i, e := range resp.GetEntries() {
		v := e.GetVolume()
		if err := checkListedID(method, page, i, v.GetVolumeId()); err != nil {
			return err
		}
		if c := v.GetCapacityBytes(); c < 0 {
			return fmt.Errorf("%s page %d: volume %s has a negative capacity (%d bytes)", method, page, v.GetVolumeId(), c)
		}
		if _, _, err := LegacyCondition(e.GetStatus()); err != nil {
			return fmt.Errorf("%s page %d: volume %s: %w", method, page, v.GetVolumeId(), err)
		}
	}
	return nil
}

// CheckVolumeHealthPage checks page number page of a
// ControllerListVolumeHealth listing: its paging, and each entry names a
// volume of a sane ID.
func CheckVolumeHealthPage(resp *csi.ControllerListVolumeHealthResponse, sent string, maxEntries int32, page int) error {
	const method = "ControllerListVolumeHealth"
	if err := CheckListPage(method, page, sent, resp.GetNextToken(), len(resp.GetEntries()), maxEntries); err != nil {
		return err
	}
	for i, h := range resp.GetEntries() {
		if err := checkListedID(method, page, i, h.GetVolumeId()); err != nil {
			return err
		}
	}
	return nil
}

// Condition is what a driver says of a volume's health: abnormal or not,
// and its message, sanitized (SanitizeMessage).
type Condition struct {
	Abnormal bool
	Message  string
}

// The legacy VolumeCondition message: field 2 of
// ListVolumesResponse.VolumeStatus and of
// ControllerGetVolumeResponse.VolumeStatus in CSI up to v1.12, with
// abnormal (1, bool) and message (2, string). CSI v1.13 removed it
// (reserved 2) with the VOLUME_CONDITION capability, value 11; drivers
// built on an older spec still send both, and Go's protobuf keeps the field
// among the status's unknown fields.
const (
	legacyConditionField = 2
	legacyAbnormalField  = 1
	legacyMessageField   = 2
)

// LegacyCondition reads the legacy volume condition from a volume status
// (ListVolumesResponse.VolumeStatus or
// ControllerGetVolumeResponse.VolumeStatus): ok is false when the status
// carries none (nil status too). Several occurrences merge, as protobuf
// merges a message field: the last value of each field wins.
func LegacyCondition(status proto.Message) (c Condition, ok bool, err error) {
	if status == nil {
		return Condition{}, false, nil
	}
	m := status.ProtoReflect()
	if !m.IsValid() {
		return Condition{}, false, nil
	}
	var msg []byte
	for b := []byte(m.GetUnknown()); len(b) > 0; {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return Condition{}, false, fmt.Errorf("volume status: %w", protowire.ParseError(n))
		}
		b = b[n:]
		if num == legacyConditionField && typ == protowire.BytesType {
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return Condition{}, false, fmt.Errorf("volume condition: %w", protowire.ParseError(n))
			}
			if err := decodeLegacyCondition(v, &c, &msg); err != nil {
				return Condition{}, false, err
			}
			ok = true
			b = b[n:]
			continue
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return Condition{}, false, fmt.Errorf("volume status: %w", protowire.ParseError(n))
		}
		b = b[n:]
	}
	c.Message = SanitizeMessage(string(msg))
	return c, ok, nil
}

// decodeLegacyCondition merges one encoded VolumeCondition into c and msg.
func decodeLegacyCondition(b []byte, c *Condition, msg *[]byte) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return fmt.Errorf("volume condition: %w", protowire.ParseError(n))
		}
		b = b[n:]
		switch {
		case num == legacyAbnormalField && typ == protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return fmt.Errorf("volume condition: abnormal: %w", protowire.ParseError(n))
			}
			c.Abnormal = v != 0
			b = b[n:]
		case num == legacyMessageField && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return fmt.Errorf("volume condition: message: %w", protowire.ParseError(n))
			}
			*msg = v
			b = b[n:]
		default:
			n = protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				return fmt.Errorf("volume condition: %w", protowire.ParseError(n))
			}
			b = b[n:]
		}
	}
	return nil
}

// AppendLegacyCondition encodes c as the legacy condition field of a
// volume status (a driver built on CSI up to v1.12 sends this), for
// SetUnknown: what drivers and tests that speak the old spec send.
func AppendLegacyCondition(b []byte, c Condition) []byte {
	var inner []byte
	if c.Abnormal {
		inner = protowire.AppendTag(inner, legacyAbnormalField, protowire.VarintType)
		inner = protowire.AppendVarint(inner, 1)
	}
	if c.Message != "" {
		inner = protowire.AppendTag(inner, legacyMessageField, protowire.BytesType)
		inner = protowire.AppendString(inner, c.Message)
	}
	b = protowire.AppendTag(b, legacyConditionField, protowire.BytesType)
	return protowire.AppendBytes(b, inner)
}

// HealthCondition is the condition of a CSI v1.13 VolumeHealth: abnormal
// when it holds an entry of a known error type (DEGRADED, INACCESSIBLE,
// DATA_LOSS; the spec has COs ignore types they do not know), its message
// made of the entries ("DEGRADED Reason: message; ...", unknown types
// named by number).
func HealthCondition(h *csi.VolumeHealth) Condition {
	var c Condition
	var parts []string
	for _, e := range h.GetHealthStatuses() {
		st := e.GetStatus()
		name, known := csi.VolumeHealthErrorType_name[int32(st)]
		if !known || st == csi.VolumeHealthErrorType_UNKNOWN_VOLUME_HEALTH_TYPE {
			name = fmt.Sprintf("type %d", int32(st))
		} else {
			c.Abnormal = true
		}
		p := name + " " + e.GetReason()
		if m := e.GetMessage(); m != "" {
			p += ": " + m
		}
		parts = append(parts, p)
	}
	if c.Abnormal {
		c.Message = SanitizeMessage(strings.Join(parts, "; "))
	}
	return c
}

// SanitizeMessage makes a driver's message fit for an Event: valid UTF-8,
// no control characters (each run of them, and of spaces, becomes one
// space), trimmed, and at most MaxConditionMessage bytes (cut at a
// character boundary, "…" marking the cut).
func SanitizeMessage(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	var b strings.Builder
	space := false
	for _, r := range s {
		if unicode.IsControl(r) || unicode.IsSpace(r) || r == '\u2028' || r == '\u2029' {
			space = true
			continue
		}
		if space && b.Len() > 0 {
			b.WriteByte(' ')
		}
		space = false
		b.WriteRune(r)
		if b.Len() > MaxConditionMessage+utf8.UTFMax {
			break
		}
	}
	out := b.String()
	if len(out) <= MaxConditionMessage {
		return out
	}
	const ellipsis = "…"
	cut := MaxConditionMessage - len(ellipsis)
	for cut > 0 && !utf8.RuneStart(out[cut]) {
		cut--
	}
	return out[:cut] + ellipsis
}
