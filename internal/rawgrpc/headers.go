package rawgrpc

import (
	"errors"
	"fmt"
	"strings"

	"golang.org/x/net/http/httpguts"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// FrameReader reads frames from an http2.Framer as the Framer does with
// ReadMetaHeaders set: a HEADERS frame and its CONTINUATION frames come
// back as one *http2.MetaHeadersFrame holding the decoded fields, checked
// the same way (field names and values, pseudo-header order and kinds,
// the header list budget, the hpack state) with the same errors. It
// allocates less per header block (one decoder callback for the
// connection's life, one exactly sized field slice per block), which
// counts on the hops that read six header blocks per call.
//
// One difference: a block over the header list budget is a stream error
// (FRAME_SIZE_ERROR, as gRPC answers it), not a block with its last fields
// dropped (the Framer's Truncated), so no hop forwards a call without
// some of its metadata. The connection stays usable.
//
// The Framer must not have ReadMetaHeaders set; its MaxHeaderListSize is
// the budget. A FrameReader is used by one goroutine.
type FrameReader struct {
	fr  *http2.Framer
	dec *hpack.Decoder

	// the block being decoded
	fields                   []hpack.HeaderField // scratch, copied out at the end
	headersLeft, trailerLeft uint32
	sawRegular, truncated    bool
	invalid                  error
}

// NewFrameReader reads fr's frames; tableSize is the hpack decoder's
// dynamic table size (4096 unless SETTINGS said otherwise).
func NewFrameReader(fr *http2.Framer, tableSize uint32) *FrameReader {
	r := &FrameReader{fr: fr, fields: make([]hpack.HeaderField, 0, 16)}
	r.dec = hpack.NewDecoder(tableSize, r.emit)
	return r
}

func (r *FrameReader) listSize() uint32 {
	if r.fr.MaxHeaderListSize == 0 {
		return 16 << 20 // the Framer's default
	}
	return r.fr.MaxHeaderListSize
}

// emit takes one decoded field, as the Framer's callback does.
func (r *FrameReader) emit(hf hpack.HeaderField) {
	if !httpguts.ValidHeaderFieldValue(hf.Value) {
		// The value may be secret: it is not in the error.
		r.invalid = fmt.Errorf("invalid header field value for %q", hf.Name)
	}
	if strings.HasPrefix(hf.Name, ":") {
		if r.sawRegular {
			r.invalid = errors.New("pseudo header field after regular")
		}
	} else {
		r.sawRegular = true
		if !validFieldName(hf.Name) {
			r.invalid = fmt.Errorf("invalid header field name %q", hf.Name)
		}
	}
	if r.invalid != nil {
		r.dec.SetEmitEnabled(false)
		return
	}
	left, size := &r.headersLeft, hf.Size()
	if hf.Name == "trailer" {
		// As the Framer counts it: each announced trailer as an empty field.
		n := uint32(strings.Count(hf.Value, ",") + 1)
		left, size = &r.trailerLeft, uint32(len(hf.Value))-n+1+n*hpack.HeaderField{}.Size()
	}
	if size > *left {
		r.dec.SetEmitEnabled(false)
		r.truncated = true
		r.headersLeft, r.trailerLeft = 0, 0
		return
	}
	*left -= size
	r.fields = append(r.fields, hf)
}

// validFieldName is a lower-case HTTP token.
func validFieldName(v string) bool {
	if v == "" {
		return false
	}
	for _, c := range v {
		if !httpguts.IsTokenRune(c) || ('A' <= c && c <= 'Z') {
			return false
		}
	}
	return true
}

// ReadFrame returns the next frame; header blocks come back decoded.
//
// The Framer's stream errors (a HEADERS frame whose padding is as long as
// its payload, a WINDOW_UPDATE of 0 on a stream) come back as connection
// errors: a HEADERS frame refused so goes undecoded, and every later block
// would be decoded against a table out of step with the peer's encoder
// (RFC 9113 makes the padding a connection error; the zero increment is
// taken as one too, as the Framer cannot tell the two apart).
func (r *FrameReader) ReadFrame() (http2.Frame, error) {
	f, err := r.fr.ReadFrame()
	if err != nil {
		var se http2.StreamError
		if errors.As(err, &se) {
			return nil, http2.ConnectionError(se.Code)
		}
		return nil, err
	}
	hf, ok := f.(*http2.HeadersFrame)
	if !ok {
		return f, nil
	}
	return r.readBlock(hf)
}

func (r *FrameReader) readBlock(hf *http2.HeadersFrame) (http2.Frame, error) {
	r.fields = r.fields[:0]
	r.headersLeft, r.trailerLeft = r.listSize(), r.listSize()
	r.sawRegular, r.truncated, r.invalid = false, false, nil
	r.dec.SetEmitEnabled(true)
	r.dec.SetMaxStringLength(int(min(r.listSize(), 1<<30)))

	frag := hf.HeaderBlockFragment()
	ended := hf.HeadersEnded()
	for {
		// Refuse a block far beyond the budget before decoding it, and
		// any continuation once a field was invalid, as the Framer does.
		if int64(len(frag)) > 2*int64(r.headersLeft+r.trailerLeft) || r.invalid != nil {
			return nil, http2.ConnectionError(http2.ErrCodeProtocol)
		}
		if _, err := r.dec.Write(frag); err != nil {
			return nil, http2.ConnectionError(http2.ErrCodeCompression)
		}
		if ended {
			break
		}
		f, err := r.fr.ReadFrame() // the Framer's order check makes it our CONTINUATION
		if err != nil {
			return nil, err
		}
		cf := f.(*http2.ContinuationFrame)
		frag, ended = cf.HeaderBlockFragment(), cf.HeadersEnded()
	}
	if err := r.dec.Close(); err != nil {
		return nil, http2.ConnectionError(http2.ErrCodeCompression)
	}
	if r.invalid != nil {
		return nil, http2.StreamError{StreamID: hf.StreamID, Code: http2.ErrCodeProtocol, Cause: r.invalid}
	}
	if r.truncated {
		return nil, http2.StreamError{StreamID: hf.StreamID, Code: http2.ErrCodeFrameSize,
			Cause: fmt.Errorf("header list larger than %d bytes", r.listSize())}
	}
	mh := &http2.MetaHeadersFrame{HeadersFrame: hf}
	if len(r.fields) > 0 {
		mh.Fields = append(make([]hpack.HeaderField, 0, len(r.fields)), r.fields...)
	}
	if err := checkPseudos(mh.PseudoFields()); err != nil {
		return nil, http2.StreamError{StreamID: hf.StreamID, Code: http2.ErrCodeProtocol, Cause: err}
	}
	return mh, nil
}

// checkPseudos allows the request or the response pseudo-headers, each
// once, not both kinds.
func checkPseudos(pf []hpack.HeaderField) error {
	var request, response bool
	for i, hf := range pf {
		switch hf.Name {
		case ":method", ":path", ":scheme", ":authority", ":protocol":
			request = true
		case ":status":
			response = true
		default:
			return fmt.Errorf("invalid pseudo-header %q", hf.Name)
		}
		for _, prev := range pf[:i] {
			if prev.Name == hf.Name {
				return fmt.Errorf("duplicate pseudo-header %q", hf.Name)
			}
		}
	}
	if request && response {
		return errors.New("mix of request and response pseudo headers")
	}
	return nil
}
