package chain

import (
	"bytes"
	"crypto/tls"
	"net"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"

	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/mtls"
)

// Peers that break HTTP/2's rules, played by a raw HTTP/2 client holding a
// broker certificate: the proxy must refuse them without growing or
// hanging, and without affecting other connections.

// rawBroker is an HTTP/2 client over mTLS that writes frames as told and
// reports what the proxy sends.
type rawBroker struct {
	fr     *http2.Framer
	enc    *hpack.Encoder
	hbuf   bytes.Buffer
	frames chan http2.Frame // RST_STREAM, GOAWAY and HEADERS frames received
	closed chan struct{}
}

func dialRawBroker(t *testing.T, c *chaintest.Chain, read bool, settings ...http2.Setting) *rawBroker {
	t.Helper()
	return dialRawBrokerUntil(t, c, time.Now().Add(time.Hour), read, settings...)
}

// dialRawFront speaks HTTP/2 to c's front end socket, frame by frame,
// reading what comes back.
func dialRawFront(t *testing.T, c *chaintest.Chain, settings ...http2.Setting) *rawBroker {
	t.Helper()
	nc, err := net.Dial("unix", c.Front)
	if err != nil {
		t.Fatal(err)
	}
	return rawPeer(t, nc, true, settings...)
}

// dialRawBrokerUntil is dialRawBroker with a broker certificate that
// expires at notAfter.
func dialRawBrokerUntil(t *testing.T, c *chaintest.Chain, notAfter time.Time, read bool, settings ...http2.Setting) *rawBroker {
	t.Helper()
	now := time.Now()
	m, err := c.CA.IssueMaterial(mtls.Leaf{ID: mtls.BrokerID(chaintest.TrustDomain), NotBefore: now.Add(-time.Minute), NotAfter: notAfter})
	if err != nil {
		t.Fatal(err)
	}
	tc, err := tls.Dial("tcp", c.ProxyAddr, mtls.ClientConfig(mtls.StaticSource{M: m}, mtls.AuthorizeOneOf(mtls.DriverID(chaintest.TrustDomain, echoName))))
	if err != nil {
		t.Fatal(err)
	}
	return rawPeer(t, tc, read, settings...)
}

// rawPeer speaks HTTP/2 as a client on nc, frame by frame.
func rawPeer(t *testing.T, nc net.Conn, read bool, settings ...http2.Setting) *rawBroker {
	t.Helper()
	t.Cleanup(func() { nc.Close() })
	if _, err := nc.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	r := &rawBroker{fr: http2.NewFramer(nc, nc), frames: make(chan http2.Frame, 64), closed: make(chan struct{})}
	r.enc = hpack.NewEncoder(&r.hbuf)
	r.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	if err := r.fr.WriteSettings(settings...); err != nil {
		t.Fatal(err)
	}
	if read {
		go func() {
			defer close(r.closed)
			for {
				f, err := r.fr.ReadFrame()
				if err != nil {
					return
				}
				switch f.(type) {
				case *http2.RSTStreamFrame, *http2.GoAwayFrame, *http2.MetaHeadersFrame, *http2.PingFrame:
					select {
					case r.frames <- f:
					default:
					}
				}
			}
		}()
	}
	return r
}

func (r *rawBroker) headers(id uint32, path string, end bool) {
	r.hbuf.Reset()
	for _, f := range []hpack.HeaderField{{Name: ":method", Value: "POST"}, {Name: ":scheme", Value: "https"}, {Name: ":path", Value: path},
		{Name: ":authority", Value: "proxy"}, {Name: "content-type", Value: "application/grpc"}, {Name: "te", Value: "trailers"}} {
		r.enc.WriteField(f)
	}
	r.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: r.hbuf.Bytes(), EndHeaders: true, EndStream: end})
}

// wait returns the first received frame ok accepts, or fails after 5 s.
func (r *rawBroker) wait(t *testing.T, what string, ok func(http2.Frame) bool) http2.Frame {
	t.Helper()
	timeout := time.After(5 * time.Second)
	for {
		select {
		case f := <-r.frames:
			if ok(f) {
				return f
			}
		case <-timeout:
			t.Fatalf("the proxy never sent %s", what)
			return nil
		}
	}
}

// serveNonReadingDriver serves the echo driver with streaming calls that
// never read their requests (they end with their call, or after 20 s),
// and returns its endpoint.
func serveNonReadingDriver(t *testing.T) string {
	t.Helper()
	path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
	serveDriver(t, path, grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		select { // never reads; ends with its call
		case <-time.After(20 * time.Second):
		case <-ss.Context().Done():
		}
		return h(srv, ss)
	}))
	return "unix://" + path
}

func heapMiB() int64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc >> 20)
}
