package rawgrpc

import (
	"bytes"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// headerCase is a stream of frames written by a Framer: one or more
// header blocks, optionally split into CONTINUATIONs, or raw bytes.
type headerCase struct {
	name   string
	blocks [][]hpack.HeaderField
	split  int    // fragment size: > 0 splits each block into CONTINUATIONs
	raw    []byte // a raw header block fragment instead of blocks
	limit  uint32 // MaxHeaderListSize
}

func fieldsOf(kv ...string) []hpack.HeaderField {
	var f []hpack.HeaderField
	for i := 0; i < len(kv); i += 2 {
		f = append(f, hpack.HeaderField{Name: kv[i], Value: kv[i+1]})
	}
	return f
}

func (hc headerCase) wire(t *testing.T) []byte {
	t.Helper()
	var out, hbuf bytes.Buffer
	fr := http2.NewFramer(&out, nil)
	enc := hpack.NewEncoder(&hbuf)
	write := func(id uint32, block []byte) {
		n := len(block)
		if hc.split > 0 {
			n = min(n, hc.split)
		}
		if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: block[:n], EndHeaders: n == len(block), EndStream: true}); err != nil {
			t.Fatal(err)
		}
		for rest := block[n:]; len(rest) > 0; {
			m := min(len(rest), hc.split)
			if err := fr.WriteContinuation(id, m == len(rest), rest[:m]); err != nil {
				t.Fatal(err)
			}
			rest = rest[m:]
		}
	}
	if hc.raw != nil {
		write(1, hc.raw)
	}
	for i, b := range hc.blocks {
		hbuf.Reset()
		for _, f := range b {
			if err := enc.WriteField(f); err != nil {
				t.Fatal(err)
			}
		}
		write(uint32(2*i+1), append([]byte(nil), hbuf.Bytes()...))
	}
	// A DATA frame after the blocks: the reader must hand it back as is.
	if err := fr.WriteData(99, true, []byte("after")); err != nil {
		t.Fatal(err)
	}
	return out.Bytes()
}

type readResult struct {
	Fields    [][]hpack.HeaderField
	Truncated []bool
	Data      string
	Errs      []string // stream errors (reading goes on), then a connection error
}

func readAll(next func() (http2.Frame, error)) readResult {
	var r readResult
	for {
		f, err := next()
		if err != nil {
			var se http2.StreamError
			var ce http2.ConnectionError
			switch {
			case errors.As(err, &se):
				r.Errs = append(r.Errs, "stream "+se.Code.String()+": "+se.Cause.Error())
				continue
			case errors.As(err, &ce):
				r.Errs = append(r.Errs, "connection "+http2.ErrCode(ce).String())
			default:
				r.Errs = append(r.Errs, err.Error())
			}
			return r
		}
		switch f := f.(type) {
		case *http2.MetaHeadersFrame:
			r.Fields = append(r.Fields, f.Fields)
			r.Truncated = append(r.Truncated, f.Truncated)
		case *http2.DataFrame:
			r.Data = string(f.Data())
			return r
		}
	}
}

// TestFrameReaderMatchesFramer reads the same frames with the Framer's own
// header decoding and with FrameReader: the same fields and errors (the
// Framer's causes differ only in wording), except that where the Framer
// truncates a block over the budget, FrameReader refuses it with a stream
// error and reads on.
func TestFrameReaderMatchesFramer(t *testing.T) {
	long := strings.Repeat("v", 300)
	cases := []headerCase{
		{name: "request", blocks: [][]hpack.HeaderField{fieldsOf(":method", "POST", ":scheme", "http", ":path", "/csi.v1.Identity/Probe", ":authority", "x", "content-type", "application/grpc", "grpc-timeout", "5S", "traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")}},
		{name: "answer and trailers", blocks: [][]hpack.HeaderField{fieldsOf(":status", "200", "content-type", "application/grpc"), fieldsOf("grpc-status", "0", "grpc-message", "")}},
		{name: "dynamic table across blocks", blocks: [][]hpack.HeaderField{fieldsOf(":status", "200", "x-a", long), fieldsOf(":status", "200", "x-a", long, "x-b", "b")}},
		{name: "continuations", split: 7, blocks: [][]hpack.HeaderField{fieldsOf(":method", "POST", ":path", "/p", "x-a", long, "x-b", "bb"), fieldsOf(":status", "200")}},
		{name: "empty block", blocks: [][]hpack.HeaderField{nil}},
		{name: "invalid value", blocks: [][]hpack.HeaderField{fieldsOf(":status", "200", "x-a", "bad\x00value")}},
		{name: "upper-case name", blocks: [][]hpack.HeaderField{fieldsOf(":status", "200", "X-A", "v")}},
		{name: "pseudo after regular", blocks: [][]hpack.HeaderField{fieldsOf("x-a", "v", ":status", "200")}},
		{name: "unknown pseudo", blocks: [][]hpack.HeaderField{fieldsOf(":nope", "v")}},
		{name: "duplicate pseudo", blocks: [][]hpack.HeaderField{fieldsOf(":path", "/a", ":path", "/b")}},
		{name: "request and response pseudo", blocks: [][]hpack.HeaderField{fieldsOf(":path", "/a", ":status", "200")}},
		{name: "over the list budget, then a block using its table entries", limit: 200, blocks: [][]hpack.HeaderField{
			fieldsOf(":status", "200", "x-a", strings.Repeat("a", 100), "x-b", strings.Repeat("b", 100)),
			fieldsOf(":status", "200", "x-b", strings.Repeat("b", 100))}},
		{name: "trailer announcement over budget", limit: 100, blocks: [][]hpack.HeaderField{fieldsOf(":status", "200", "trailer", "a,b,c,d"), fieldsOf(":status", "204")}},
		{name: "far beyond the budget", limit: 50, blocks: [][]hpack.HeaderField{fieldsOf(":status", "200", "x-a", long)}},
		{name: "hpack garbage", raw: []byte{0xff, 0xff, 0xff, 0xff, 0xff}},
		{name: "truncated hpack", raw: []byte{0x40, 0x05, 'x'}},
	}
	for _, hc := range cases {
		t.Run(hc.name, func(t *testing.T) {
			wire := hc.wire(t)
			framer := func() *http2.Framer {
				fr := http2.NewFramer(nil, bytes.NewReader(wire))
				fr.MaxHeaderListSize = hc.limit
				return fr
			}
			ref := framer()
			ref.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
			want := readAll(ref.ReadFrame)
			got := readAll(NewFrameReader(framer(), 4096).ReadFrame)
			t.Logf("the Framer: truncated %v, errors %q; FrameReader: errors %q", want.Truncated, want.Errs, got.Errs)
			// Where the Framer truncated a block, FrameReader refuses it
			// and reads on (the blocks after it decode: the hpack table
			// stayed in step).
			const refused = "stream FRAME_SIZE_ERROR: header list larger than"
			var wantFields [][]hpack.HeaderField
			wantErrs := append([]string(nil), want.Errs...)
			for i, tr := range want.Truncated {
				if tr {
					wantErrs = append([]string{refused}, wantErrs...)
					continue
				}
				wantFields = append(wantFields, want.Fields[i])
			}
			for i := range got.Truncated {
				if got.Truncated[i] {
					t.Errorf("FrameReader returned a truncated block")
				}
			}
			if !reflect.DeepEqual(got.Fields, wantFields) || got.Data != want.Data {
				t.Errorf("FrameReader read\n%+v\nthe Framer\n%+v", got, want)
			}
			// The causes are worded alike but not identically: compare
			// the kind and code.
			if len(got.Errs) != len(wantErrs) {
				t.Fatalf("FrameReader errors %q, want %q", got.Errs, wantErrs)
			}
			for i := range got.Errs {
				if w := wantErrs[i]; kind(got.Errs[i]) != kind(w) || (w == refused && !strings.HasPrefix(got.Errs[i], refused)) {
					t.Errorf("FrameReader error %q, want %q", got.Errs[i], w)
				}
			}
			if len(want.Errs) == 0 && want.Data != "after" {
				t.Errorf("the frame after the blocks was not read: %+v", want)
			}
		})
	}
}

// kind is an error without its cause's wording.
func kind(e string) string {
	if i := strings.Index(e, ":"); i >= 0 {
		return e[:i]
	}
	return e
}

// TestFrameReaderAllocations: a five-field answer block and its trailers
// cost few allocations (the Framer's own decoding took about ten per block).
func TestFrameReaderAllocations(t *testing.T) {
	var hbuf, out bytes.Buffer
	enc := hpack.NewEncoder(&hbuf)
	wr := http2.NewFramer(&out, nil)
	for i := 0; i < 200; i++ {
		hbuf.Reset()
		for _, f := range fieldsOf(":status", "200", "content-type", "application/grpc", "x-a", "a", "x-b", "b", "x-c", "c") {
			enc.WriteField(f)
		}
		wr.WriteHeaders(http2.HeadersFrameParam{StreamID: uint32(2*i + 1), BlockFragment: hbuf.Bytes(), EndHeaders: true})
	}
	rd := NewFrameReader(http2.NewFramer(nil, bytes.NewReader(out.Bytes())), 4096)
	allocs := testing.AllocsPerRun(100, func() {
		f, err := rd.ReadFrame()
		if err != nil {
			t.Fatal(err)
		}
		if n := len(f.(*http2.MetaHeadersFrame).Fields); n != 5 {
			t.Fatalf("%d fields", n)
		}
	})
	// The HEADERS frame, the MetaHeadersFrame and the field slice.
	if allocs > 3 {
		t.Errorf("%.1f allocations per header block, want at most 3", allocs)
	}
}

// TestWriteHeaderBlockKeepsRepeatingFieldsIndexed: the trace context and
// the deadline, new on every call, do not push the repeating fields out of
// the hpack table, so every block after the first stays as small as the
// second (within the Huffman coding's byte or two); the receiver reads the fields as sent.
func TestWriteHeaderBlockKeepsRepeatingFieldsIndexed(t *testing.T) {
	var out, hbuf bytes.Buffer
	fr := http2.NewFramer(&out, nil)
	enc := hpack.NewEncoder(&hbuf)
	rd := NewFrameReader(http2.NewFramer(nil, &out), 4096)
	var sizes []int
	for i := 0; i < 200; i++ {
		fields := fieldsOf(":method", "POST", ":scheme", "https", ":path", "/csi.v1.Controller/CreateVolume", ":authority", "proxy-0.example:7443",
			"content-type", "application/grpc", "te", "trailers", "user-agent", "csibroker",
			"grpc-timeout", fmt.Sprintf("%08du", 10000000+i*7919),
			"traceparent", fmt.Sprintf("00-%032x-%016x-01", 1000000+i*104729, 1000000+i*7),
			"x-csibroker-driver", "sample.csi.csibroker.io")
		if err := WriteHeaderBlock(fr, enc, &hbuf, uint32(2*i+1), fields, false, 16384); err != nil {
			t.Fatal(err)
		}
		sizes = append(sizes, hbuf.Len())
		f, err := rd.ReadFrame()
		if err != nil {
			t.Fatal(err)
		}
		got := f.(*http2.MetaHeadersFrame).Fields
		for j := range got {
			got[j].Sensitive = false
		}
		if !reflect.DeepEqual(got, fields) {
			t.Fatalf("block %d read back as %v", i, got)
		}
	}
	// The new values' literals differ by a byte or two in their Huffman
	// coding; a repeating field sent again as a literal adds 10 or more.
	for i, n := range sizes[2:] {
		if n > sizes[1]+4 {
			t.Fatalf("block %d is %d bytes, the second %d: repeating fields were sent as literals again", i+2, n, sizes[1])
		}
	}
}

// TestFrameReaderHeadersPaddingIsAConnectionError: a HEADERS frame whose
// padding is as long as its payload cannot be decoded, so the peer's HPACK
// table and ours part ways: the reader says it is a connection error
// (PROTOCOL_ERROR, RFC 9113 6.2), not a stream error after which the
// connection would go on with the next block misread.
func TestFrameReaderHeadersPaddingIsAConnectionError(t *testing.T) {
	var wire bytes.Buffer
	// Payload: pad length 5, then 2 bytes of block; 5 > 2.
	payload := []byte{5, 0x82, 0x86}
	wire.Write([]byte{0, 0, byte(len(payload)), byte(http2.FrameHeaders), byte(http2.FlagHeadersEndHeaders | http2.FlagHeadersEndStream | http2.FlagHeadersPadded), 0, 0, 0, 1})
	wire.Write(payload)
	r := NewFrameReader(http2.NewFramer(nil, &wire), 4096)
	_, err := r.ReadFrame()
	var ce http2.ConnectionError
	if !errors.As(err, &ce) || http2.ErrCode(ce) != http2.ErrCodeProtocol {
		t.Fatalf("err %v (%T), want ConnectionError(PROTOCOL_ERROR)", err, err)
	}
}
