package rawgrpc

import (
	"bytes"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

func TestParseTimeout(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want time.Duration
		bad  bool
	}{
		{in: "1S", want: time.Second},
		{in: "250m", want: 250 * time.Millisecond},
		{in: "99999999u", want: 99999999 * time.Microsecond},
		{in: "7n", want: 7},
		{in: "2M", want: 2 * time.Minute},
		{in: "99999999H", want: 1<<63 - 1}, // beyond a Duration: as long as one can be
		{in: "S", bad: true},
		{in: "123456789S", bad: true}, // nine digits
		{in: "10x", bad: true},
		{in: "-1S", bad: true},
		{in: "1.5S", bad: true},
	} {
		got, err := ParseTimeout(tc.in)
		if tc.bad {
			if err == nil {
				t.Errorf("ParseTimeout(%q) = %v, want an error", tc.in, got)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("ParseTimeout(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
}

func TestIsGRPCContentType(t *testing.T) {
	for ct, want := range map[string]bool{
		"application/grpc":              true,
		"application/grpc+proto":        true,
		"application/grpc;charset=utf8": true,
		"application/grpc-web":          false,
		"application/grpc-web+proto":    false,
		"application/grpcx":             false,
		"application/json":              false,
		"":                              false,
	} {
		if got := IsGRPCContentType(ct); got != want {
			t.Errorf("IsGRPCContentType(%q) = %v, want %v", ct, got, want)
		}
	}
}

func TestBinaryHeaderRoundTrip(t *testing.T) {
	for _, v := range []string{"", "a", "ab", "abc", "\x00\xff,=", string(make([]byte, 100))} {
		got, err := DecodeBinaryHeader(EncodeBinaryHeader(v))
		if err != nil || len(got) != 1 || got[0] != v {
			t.Errorf("round trip of %q = %q, %v", v, got, err)
		}
	}
	// Padded values and comma-joined values, as other gRPC stacks send.
	got, err := DecodeBinaryHeader("YQ==,YmM")
	if err != nil || len(got) != 2 || got[0] != "a" || got[1] != "bc" {
		t.Errorf(`DecodeBinaryHeader("YQ==,YmM") = %q, %v`, got, err)
	}
	if _, err := DecodeBinaryHeader("!!"); err == nil {
		t.Error("DecodeBinaryHeader accepted a value that is not base64")
	}
}

func TestEncodeStatusMessage(t *testing.T) {
	for in, want := range map[string]string{
		"plain words": "plain words",
		"50% done":    "50%25 done",
		"line\nbreak": "line%0Abreak",
		"naïve":       "na%C3%AFve",
		"":            "",
	} {
		if got := EncodeStatusMessage(in); got != want {
			t.Errorf("EncodeStatusMessage(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestEncodeTimeout(t *testing.T) {
	for _, tc := range []struct {
		in   time.Duration
		want string
	}{
		{time.Second, "1000000u"},
		{7, "7n"},
		{99999999, "99999999n"},
		{100000000, "100000u"},
		{30 * time.Second, "30000000u"},
		{time.Hour, "3600000m"},
		{0, "1n"},
		{1<<63 - 1, "2562048H"},
	} {
		got := EncodeTimeout(tc.in)
		if got != tc.want {
			t.Errorf("EncodeTimeout(%v) = %q, want %q", tc.in, got, tc.want)
		}
		back, err := ParseTimeout(got)
		if err != nil || (tc.in > 0 && back < tc.in) {
			t.Errorf("ParseTimeout(EncodeTimeout(%v)) = %v, %v: never shorter than the deadline", tc.in, back, err)
		}
	}
}

func TestStatusMessageRoundTrip(t *testing.T) {
	for _, msg := range []string{"", "plain", "100% sure", "line\nbreak", "naïve ☃", "%zz kept"} {
		if got := DecodeStatusMessage(EncodeStatusMessage(msg)); got != msg {
			t.Errorf("round trip of %q gave %q", msg, got)
		}
	}
	if got := DecodeStatusMessage("bad %zz and %4"); got != "bad %zz and %4" {
		t.Errorf("malformed escapes: %q, want them kept", got)
	}
}

func settingsFrame(t *testing.T, settings ...http2.Setting) *http2.SettingsFrame {
	t.Helper()
	var buf bytes.Buffer
	if err := http2.NewFramer(&buf, nil).WriteSettings(settings...); err != nil {
		t.Fatal(err)
	}
	f, err := http2.NewFramer(nil, &buf).ReadFrame()
	if err != nil {
		t.Fatal(err)
	}
	return f.(*http2.SettingsFrame)
}

func TestPeerSettingsApply(t *testing.T) {
	enc := hpack.NewEncoder(&bytes.Buffer{})
	for _, tc := range []struct {
		name     string
		settings []http2.Setting
		maxWin   int64
		delta    int64
		code     http2.ErrCode
		want     PeerSettings
	}{
		{"window grows", []http2.Setting{{ID: http2.SettingInitialWindowSize, Val: 1 << 20}}, 100, 1<<20 - 65535, 0,
			PeerSettings{InitialWindow: 1 << 20, MaxFrame: 16 << 10, MaxStreams: 100}},
		{"frame and streams", []http2.Setting{{ID: http2.SettingMaxFrameSize, Val: 1 << 20}, {ID: http2.SettingMaxConcurrentStreams, Val: 7}}, 0, 0, 0,
			PeerSettings{InitialWindow: 65535, MaxFrame: 1 << 20, MaxStreams: 7}},
		{"a stream's window would overflow", []http2.Setting{{ID: http2.SettingInitialWindowSize, Val: 1<<31 - 1}}, 1 << 30, 0, http2.ErrCodeFlowControl, PeerSettings{}},
		{"frame size too small", []http2.Setting{{ID: http2.SettingMaxFrameSize, Val: 100}}, 0, 0, http2.ErrCodeProtocol, PeerSettings{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := DefaultPeerSettings(100)
			delta, code, err := s.Apply(settingsFrame(t, tc.settings...), enc, tc.maxWin)
			if tc.code != 0 {
				if err == nil || code != tc.code {
					t.Fatalf("Apply = %v, %v; want connection error %v", code, err, tc.code)
				}
				return
			}
			if err != nil || delta != tc.delta || s != tc.want {
				t.Fatalf("Apply: delta %d, %+v, %v; want %d, %+v", delta, s, err, tc.delta, tc.want)
			}
		})
	}
}

func TestGrowWindow(t *testing.T) {
	for _, c := range []struct {
		win  int64
		inc  uint32
		ok   bool
		want int64
	}{
		{DefaultWindow, 1000, true, DefaultWindow + 1000},
		{0, MaxWindow, true, MaxWindow},
		{MaxWindow - 10, 10, true, MaxWindow},
		{MaxWindow - 10, 11, false, MaxWindow - 10},
		{-5000, 5000, true, 0}, // a window SETTINGS shrank below zero
	} {
		win := c.win
		if ok := GrowWindow(&win, c.inc); ok != c.ok || win != c.want {
			t.Errorf("GrowWindow(%d, %d) = %v, window %d; want %v, %d", c.win, c.inc, ok, win, c.ok, c.want)
		}
	}
}
