package rawgrpc

import (
	"bytes"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc/codes"
)

// gRPC's wire conventions on HTTP/2, for the hops that speak HTTP/2
// themselves (the broker's front end, the proxy's relay) instead of going
// through a gRPC server. grpc-go keeps these helpers internal.

// Reserved says whether a header is set by gRPC itself or by tracing per
// hop, and so is never copied from one hop to the next as metadata.
func Reserved(k string) bool { return reserved(k) }

// EncodeStatusMessage percent-encodes a status message as the grpc-message
// header requires.
func EncodeStatusMessage(msg string) string {
	var b strings.Builder
	for i := 0; i < len(msg); i++ {
		ch := msg[i]
		if ch >= 0x20 && ch <= 0x7e && ch != '%' {
			b.WriteByte(ch)
			continue
		}
		fmt.Fprintf(&b, "%%%02X", ch)
	}
	return b.String()
}

// ParseTimeout reads a grpc-timeout header value: at most eight digits and
// a unit (H, M, S, m, u, n).
func ParseTimeout(v string) (time.Duration, error) {
	if len(v) < 2 || len(v) > 9 {
		return 0, fmt.Errorf("grpc-timeout %q: want 1 to 8 digits and a unit", v)
	}
	n, err := strconv.ParseInt(v[:len(v)-1], 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("grpc-timeout %q: not a number of units", v)
	}
	var unit time.Duration
	switch v[len(v)-1] {
	case 'H':
		unit = time.Hour
	case 'M':
		unit = time.Minute
	case 'S':
		unit = time.Second
	case 'm':
		unit = time.Millisecond
	case 'u':
		unit = time.Microsecond
	case 'n':
		unit = time.Nanosecond
	default:
		return 0, fmt.Errorf("grpc-timeout %q: unknown unit", v)
	}
	if unit > time.Nanosecond && n > int64(1<<63-1)/int64(unit) {
		return 1<<63 - 1, nil
	}
	return time.Duration(n) * unit, nil
}

// DecodeBinaryHeader decodes the value of a "-bin" header: base64, padded
// or not; several values may be joined by commas.
func DecodeBinaryHeader(v string) ([]string, error) {
	parts := strings.Split(v, ",")
	out := make([]string, 0, len(parts))
	for _, p := range parts {
		enc := base64.RawStdEncoding
		if len(p)%4 == 0 {
			enc = base64.StdEncoding
		}
		b, err := enc.DecodeString(p)
		if err != nil {
			return nil, err
		}
		out = append(out, string(b))
	}
	return out, nil
}

// EncodeBinaryHeader encodes one value of a "-bin" header as gRPC does
// (base64 without padding).
func EncodeBinaryHeader(v string) string { return base64.RawStdEncoding.EncodeToString([]byte(v)) }

// IsGRPCContentType reports whether a request's content-type is gRPC's:
// "application/grpc", alone or followed by "+" and a codec or by ";"
// (as gRPC's servers accept it; "application/grpc-web" is another
// protocol).
func IsGRPCContentType(ct string) bool {
	rest, ok := strings.CutPrefix(ct, "application/grpc")
	return ok && (rest == "" || rest[0] == '+' || rest[0] == ';')
}

// HeaderValue is the value of the first field named name, or "".
func HeaderValue(fields []hpack.HeaderField, name string) string {
	v, _ := LookupHeader(fields, name)
	return v
}

// LookupHeader is HeaderValue, and whether a field of that name is there.
func LookupHeader(fields []hpack.HeaderField, name string) (string, bool) {
	for _, hf := range fields {
		if hf.Name == name {
			return hf.Value, true
		}
	}
	return "", false
}

// WriteHeaderBlock encodes fields with enc (through buf) and writes them on
// stream id as a HEADERS frame and as many CONTINUATION frames as the
// peer's maxFrame requires.
//
// Fields whose value is new on every call (the trace context, the
// deadline) are sent as never-indexed literals: in the hpack table they
// would only push out the fields that repeat (path, content type,
// metadata), which then go out as literals again, to be encoded and
// decoded with their strings copied, on every call.
func WriteHeaderBlock(fr *http2.Framer, enc *hpack.Encoder, buf *bytes.Buffer, id uint32, fields []hpack.HeaderField, end bool, maxFrame uint32) error {
	buf.Reset()
	for _, f := range fields {
		switch f.Name {
		case "traceparent", "grpc-timeout":
			f.Sensitive = true
		}
		if err := enc.WriteField(f); err != nil {
			return err
		}
	}
	block := buf.Bytes()
	first := block[:min(len(block), int(maxFrame))]
	if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: first, EndStream: end, EndHeaders: len(first) == len(block)}); err != nil {
		return err
	}
	for rest := block[len(first):]; len(rest) > 0; {
		n := min(len(rest), int(maxFrame))
		if err := fr.WriteContinuation(id, n == len(rest), rest[:n]); err != nil {
			return err
		}
		rest = rest[n:]
	}
	return nil
}

// DecodeStatusMessage undoes EncodeStatusMessage; a malformed escape is
// kept as it is, as gRPC does.
func DecodeStatusMessage(v string) string {
	if !strings.Contains(v, "%") {
		return v
	}
	var b strings.Builder
	for i := 0; i < len(v); i++ {
		if v[i] == '%' && i+2 < len(v) {
			if n, err := strconv.ParseUint(v[i+1:i+3], 16, 8); err == nil {
				b.WriteByte(byte(n))
				i += 2
				continue
			}
		}
		b.WriteByte(v[i])
	}
	return b.String()
}

// EncodeTimeout writes d as a grpc-timeout value: the finest unit whose
// count fits in eight digits (a timeout is never rounded down to zero).
func EncodeTimeout(d time.Duration) string {
	if d <= 0 {
		return "1n"
	}
	const maxN = 1e8 - 1
	ceil := func(unit time.Duration) int64 {
		n := d / unit
		if d%unit != 0 {
			n++
		}
		return int64(n)
	}
	for _, u := range []struct {
		unit time.Duration
		name string
	}{{time.Nanosecond, "n"}, {time.Microsecond, "u"}, {time.Millisecond, "m"}, {time.Second, "S"}, {time.Minute, "M"}} {
		if n := ceil(u.unit); n <= maxN {
			return strconv.FormatInt(n, 10) + u.name
		}
	}
	return strconv.FormatInt(min(ceil(time.Hour), maxN), 10) + "H"
}

// RSTCode is the status gRPC gives a stream reset with code.
func RSTCode(code http2.ErrCode) codes.Code {
	switch code {
	case http2.ErrCodeRefusedStream:
		return codes.Unavailable
	case http2.ErrCodeCancel:
		return codes.Canceled
	case http2.ErrCodeEnhanceYourCalm:
		return codes.ResourceExhausted
	case http2.ErrCodeInadequateSecurity:
		return codes.PermissionDenied
	}
	return codes.Internal
}

// HTTPStatusCode is the status gRPC gives an answer whose HTTP status is
// not 200 (no gRPC server answered).
func HTTPStatusCode(httpStatus int) codes.Code {
	switch httpStatus {
	case 400:
		return codes.Internal
	case 401:
		return codes.Unauthenticated
	case 403:
		return codes.PermissionDenied
	case 404:
		return codes.Unimplemented
	case 429, 502, 503, 504:
		return codes.Unavailable
	}
	return codes.Unknown
}

// HTTP/2 limits every hop csibroker speaks itself (front end, the broker's
// proxy connection, the proxy's relay) shares.
const (
	// DefaultWindow is HTTP/2's initial window before SETTINGS say otherwise.
	DefaultWindow = 65535
	// MaxWindow is the largest flow-control window HTTP/2 allows.
	MaxWindow = 1<<31 - 1
	// MaxHeaderList bounds a header block (gRPC metadata) a hop accepts; it
	// is advertised in SETTINGS_MAX_HEADER_LIST_SIZE.
	MaxHeaderList = 1 << 20
	// LastStreamID is the highest stream ID a client may open. A client
	// connection whose IDs come within StreamIDMargin of it takes no new
	// calls, and a fresh connection is dialled.
	LastStreamID   = 1<<31 - 1
	StreamIDMargin = 1 << 20
)

// GrowWindow adds a WINDOW_UPDATE's increment to a send window, unless that
// would take it past MaxWindow (a FLOW_CONTROL_ERROR, of the connection or
// of the stream): then it reports false and leaves win as it was.
func GrowWindow(win *int64, inc uint32) bool {
	if *win+int64(inc) > MaxWindow {
		return false
	}
	*win += int64(inc)
	return true
}

// PeerSettings are what a peer's SETTINGS set for the frames sent to it.
type PeerSettings struct {
	InitialWindow int64  // send window of each new stream
	MaxFrame      uint32 // largest frame payload
	MaxStreams    uint32 // concurrent streams the peer accepts
	// MaxHeaderList is the peer's SETTINGS_MAX_HEADER_LIST_SIZE, 0 while
	// it has announced none (no limit).
	MaxHeaderList uint32
}

// HeaderListSize is a header list's size as SETTINGS_MAX_HEADER_LIST_SIZE
// counts it: each field's name and value, plus 32 (RFC 9113, 6.5.2).
func HeaderListSize(fields []hpack.HeaderField) uint64 {
	var n uint64
	for _, f := range fields {
		n += uint64(len(f.Name)) + uint64(len(f.Value)) + 32
	}
	return n
}

// HeaderListFits reports whether the peer accepts a header list of fields.
func (s *PeerSettings) HeaderListFits(fields []hpack.HeaderField) bool {
	return s.MaxHeaderList == 0 || HeaderListSize(fields) <= uint64(s.MaxHeaderList)
}

// DefaultPeerSettings are HTTP/2's values until the peer's SETTINGS arrive,
// with maxStreams assumed.
func DefaultPeerSettings(maxStreams uint32) PeerSettings {
	return PeerSettings{InitialWindow: DefaultWindow, MaxFrame: 16 << 10, MaxStreams: maxStreams}
}

// Apply reads a SETTINGS frame (not an ACK) into s and the header table
// size into enc. maxStreamWin is the largest send window among the
// connection's open streams (0 if none): an initial window that would take
// it past 2^31-1 is a FLOW_CONTROL_ERROR. It returns by how much every open
// stream's send window changes, or the connection error to send.
func (s *PeerSettings) Apply(fr *http2.SettingsFrame, enc *hpack.Encoder, maxStreamWin int64) (int64, http2.ErrCode, error) {
	var delta int64
	err := fr.ForeachSetting(func(st http2.Setting) error {
		if err := st.Valid(); err != nil {
			return err
		}
		switch st.ID {
		case http2.SettingInitialWindowSize:
			d := int64(st.Val) - s.InitialWindow
			if maxStreamWin+delta+d > MaxWindow {
				return http2.ConnectionError(http2.ErrCodeFlowControl)
			}
			delta += d
			s.InitialWindow = int64(st.Val)
		case http2.SettingMaxFrameSize:
			s.MaxFrame = st.Val
		case http2.SettingMaxConcurrentStreams:
			s.MaxStreams = st.Val
		case http2.SettingMaxHeaderListSize:
			s.MaxHeaderList = st.Val
		case http2.SettingHeaderTableSize:
			enc.SetMaxDynamicTableSizeLimit(st.Val)
		}
		return nil
	})
	if err != nil {
		code := http2.ErrCodeProtocol
		var ce http2.ConnectionError
		if errors.As(err, &ce) {
			code = http2.ErrCode(ce)
		}
		return 0, code, err
	}
	return delta, 0, nil
}

// FieldsCarrier lets OpenTelemetry propagators read and write trace context
// in header fields: Set replaces a field of that name or adds one.
type FieldsCarrier struct{ Fields *[]hpack.HeaderField }

// Get is the value of the first field named key.
func (c FieldsCarrier) Get(key string) string { return HeaderValue(*c.Fields, key) }

// Set replaces the value of the field named key, or adds the field.
func (c FieldsCarrier) Set(key, value string) {
	for i := range *c.Fields {
		if (*c.Fields)[i].Name == key {
			(*c.Fields)[i].Value = value
			return
		}
	}
	*c.Fields = append(*c.Fields, hpack.HeaderField{Name: key, Value: value})
}

// Keys lists the fields' names.
func (c FieldsCarrier) Keys() []string {
	keys := make([]string, 0, len(*c.Fields))
	for _, hf := range *c.Fields {
		keys = append(keys, hf.Name)
	}
	return keys
}
