package proxy

import (
	"context"
	"encoding/binary"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	otelcodes "go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/csibroker/csibroker/internal/rawgrpc"
	proxyinfov1 "github.com/csibroker/csibroker/proto/proxyinfo/v1"
)

// infoMethod is the proxy's own service, answered here, never forwarded.
const infoMethod = proxyinfov1.ProxyInfo_GetInfo_FullMethodName

// stream is one call: its broker leg and, once forwarded, its driver leg.
type stream struct {
	p        *Proxy
	b        *leg
	d        *leg
	mi       *methodInfo
	start    time.Time
	span     trace.Span
	local    *localCall
	finished atomic.Bool
}

func (s *stream) other(l *leg) *leg {
	if l == s.b {
		return s.d
	}
	return s.b
}

// finish records the call's metrics and ends its span, once.
func (s *stream) finish(code codes.Code) {
	if !s.finished.CompareAndSwap(false, true) {
		return
	}
	if s.mi != nil {
		s.mi.seconds.Observe(time.Since(s.start).Seconds())
		if code == codes.OK {
			s.mi.handledOK.Inc()
		} else {
			s.p.metrics.handled.WithLabelValues(s.mi.typ, s.mi.service, s.mi.name, rawgrpc.CodeLabel(code)).Inc()
		}
	}
	if s.span != nil {
		s.span.SetAttributes(semconv.RPCResponseStatusCode(code.String()))
		switch code {
		case codes.Unknown, codes.DeadlineExceeded, codes.Unimplemented, codes.Internal, codes.Unavailable, codes.DataLoss:
			s.span.SetStatus(otelcodes.Error, code.String())
		}
		s.span.End()
	}
}

// fail ends the call at the broker with a status of the proxy's own, and
// resets its driver leg if it has one.
func (s *stream) fail(code codes.Code, msg string, f *flusher) {
	s.finish(code)
	if d := s.d; d != nil {
		d.c.resetLeg(d, http2.ErrCodeCancel)
		f.mark(d.c)
	}
	b := s.b
	c := b.c
	c.mu.Lock()
	switch {
	case b.done || b.localEnded || c.closed:
	case b.msg.boundary():
		// What the driver sent so far is whole messages: they go first,
		// then the status.
		headersQueued := b.sentHeaders
		for _, o := range b.pending {
			headersQueued = headersQueued || !o.isData
		}
		c.sendLocked(b, out{fields: statusFields(headersQueued, code, msg), end: true}, nil)
	default:
		// The answer stops inside a message: trailers now would make the
		// caller's gRPC see a truncated message (Internal). A stream reset
		// as REFUSED_STREAM reaches it as Unavailable, which is what a
		// driver that went away is; CSI calls are idempotent, so a retry is
		// safe.
		b.pending = nil
		c.writeErr(c.framer().WriteRSTStream(b.id, http2.ErrCodeRefusedStream))
		c.needFlush = true
		b.localEnded, b.remoteEnded = true, true
		c.removeLocked(b)
	}
	c.mu.Unlock()
	f.mark(c)
}

// onBrokerHeaders starts a call (or passes on a caller's trailers).
func (p *Proxy) onBrokerHeaders(c *conn, fr *http2.MetaHeadersFrame, f *flusher) {
	id := fr.StreamID
	end := fr.StreamEnded()
	c.mu.Lock()
	if c.closed {
		// Closed under the reader (a failed write, the proxy stopping):
		// the connection's streams fail, and nothing new starts.
		c.mu.Unlock()
		return
	}
	if l := c.streams[id]; l != nil {
		// Trailers from the caller: gRPC clients do not send them, but
		// HTTP/2 allows them; pass them on.
		if end {
			c.remoteEndedLocked(l)
		}
		s := l.s
		c.mu.Unlock()
		if other := s.other(l); other != nil && s.local == nil {
			other.c.mu.Lock()
			other.c.sendLocked(other, out{fields: fr.RegularFields(), end: end}, nil)
			other.c.mu.Unlock()
			f.mark(other.c)
		} else if s.local != nil && end {
			s.local.add(nil, true)
		}
		return
	}
	if id%2 == 0 || id <= c.lastID {
		c.mu.Unlock()
		return
	}
	prevID := c.lastID
	c.lastID = id
	if c.peerCheck != nil && !c.goingAway {
		if err := c.peerCheck.Verify(); err != nil {
			// The broker's certificate expired, or its CA left the bundle,
			// since the handshake: no new call on this connection; those
			// in flight end as they would. Expiry is what the broker's
			// routine renewal looks like from here (gRPC's streams keep
			// their connection until the proxy says so): no warning.
			if c.peerCheck.PeerExpired(time.Now()) {
				p.log.Info("proxy refuses new calls from a broker connection whose certificate has expired since the handshake; closing it (the broker opens a new one)", "peer", c.desc)
			} else {
				p.log.Warn("proxy refuses new calls from a broker connection whose certificate no longer verifies; closing it", "peer", c.desc, "err", err)
			}
			c.goAwayLocked(prevID, id, err)
			c.mu.Unlock()
			return
		}
	}
	if c.goingAway || len(c.streams) >= maxStreams {
		// Draining, or a broker over the stream limit we announced (which
		// bounds what the proxy holds per connection): not processed, so
		// safe for the broker to retry.
		c.writeErr(c.framer().WriteRSTStream(id, http2.ErrCodeRefusedStream))
		c.needFlush = true
		c.mu.Unlock()
		f.mark(c)
		return
	}
	l := &leg{c: c, id: id, sendWin: c.peer.InitialWindow, recvWin: streamWindow, remoteEnded: end}
	c.streams[id] = l
	s := &stream{p: p, b: l, start: time.Now()}
	l.s = s
	c.mu.Unlock()

	path := fr.PseudoValue("path")
	s.mi = p.methodInfo(path)
	s.mi.started.Inc()
	switch {
	case path == infoMethod:
		s.local = &localCall{s: s}
		s.local.ctx, s.local.cancel = context.WithCancel(context.Background())
		if end {
			s.local.add(nil, true)
		}
		return
	case !strings.HasPrefix(path, "/csi."):
		s.fail(codes.Unimplemented, fmt.Sprintf("csibroker proxy: %s is not a CSI method; this proxy forwards CSI services only", path), f)
		return
	}

	// The request's fields go on unchanged but for the pseudo-headers of
	// the driver's connection and the trace context of the proxy's span.
	fields := make([]hpack.HeaderField, 0, len(fr.Fields)+2)
	fields = append(fields,
		hpack.HeaderField{Name: ":method", Value: "POST"},
		hpack.HeaderField{Name: ":scheme", Value: "http"},
		hpack.HeaderField{Name: ":path", Value: path},
		hpack.HeaderField{Name: ":authority", Value: "localhost"})
	for _, hf := range fr.Fields {
		if !strings.HasPrefix(hf.Name, ":") {
			fields = append(fields, hf)
		}
	}
	carrier := rawgrpc.FieldsCarrier{Fields: &fields}
	ctx := p.cfg.Propagator.Extract(context.Background(), carrier)
	_, s.span = p.tracer.Start(ctx, path[1:], s.mi.spanOpts...)
	p.cfg.Propagator.Inject(trace.ContextWithSpan(context.Background(), s.span), carrier)

	d, err := p.driverConn(c)
	if err != nil {
		s.fail(codes.Unavailable, fmt.Sprintf("csibroker proxy: driver at %s: connection error: %v", p.target, err), f)
		return
	}
	dl := &leg{c: d, s: s}
	s.d = dl
	d.mu.Lock()
	if d.closed || d.goingAway {
		d.mu.Unlock()
		s.d = nil
		s.fail(codes.Unavailable, fmt.Sprintf("csibroker proxy: driver at %s: connection lost before the call was sent", p.target), f)
		return
	}
	if !d.peer.HeaderListFits(fields) {
		// The driver would refuse it:
		// said here, with the sizes.
		n, lim := rawgrpc.HeaderListSize(fields), d.peer.MaxHeaderList
		d.mu.Unlock()
		s.d = nil
		s.fail(codes.Internal, fmt.Sprintf("csibroker proxy: the call's metadata is %d bytes, over the %d bytes the driver at %s accepts (its SETTINGS_MAX_HEADER_LIST_SIZE)", n, lim, p.target), f)
		return
	}
	o := out{fields: fields, end: end}
	if d.openLocked(dl) {
		d.writeLocked(dl, o, nil)
	} else {
		// Its grpc-timeout is shortened when it opens, by the time since
		// the call arrived (a dial of the driver included).
		dl.pending = append(dl.pending, o)
	}
	d.mu.Unlock()
	f.mark(d)
}

// onDriverHeaders passes the driver's response headers or trailers back.
func (p *Proxy) onDriverHeaders(c *conn, fr *http2.MetaHeadersFrame, f *flusher) {
	end := fr.StreamEnded()
	c.mu.Lock()
	l := c.streams[fr.StreamID]
	if l == nil {
		c.mu.Unlock()
		return
	}
	if !end {
		if l.gotHeaders {
			// A second header block before the trailers is a malformed
			// answer (gRPC's client fails it so): not passed on, and not
			// queued, however many a misbehaving driver sends.
			c.mu.Unlock()
			l.s.fail(codes.Internal, fmt.Sprintf("csibroker proxy: driver at %s sent a second header block before its trailers", p.target), f)
			return
		}
		l.gotHeaders = true
	}
	if end {
		l.remoteEnded = true
		if !l.localEnded {
			// The driver ended the call while the caller still sends: the
			// call is over (as a gRPC server would, reset our side).
			c.writeErr(c.framer().WriteRSTStream(l.id, http2.ErrCodeCancel))
			c.needFlush = true
			l.localEnded = true
			f.mark(c)
		}
		c.removeLocked(l)
	}
	s := l.s
	c.mu.Unlock()
	if end {
		code := codes.Unknown
		if v := rawgrpc.HeaderValue(fr.Fields, "grpc-status"); v != "" {
			if n, err := strconv.Atoi(v); err == nil {
				code = codes.Code(n)
			}
		}
		s.finish(code)
	}
	b := s.b
	b.c.mu.Lock()
	cr := b.c.sendLocked(b, out{fields: fr.Fields, end: end}, nil)
	b.c.mu.Unlock()
	applyCredits(cr, f)
	f.mark(b.c)
}

// maxLocalRequest bounds what the proxy keeps of a request it answers
// itself (GetInfoRequest is empty).
const maxLocalRequest = 64 << 10

// localCall is a call the proxy answers itself (GetInfo).
type localCall struct {
	s      *stream
	req    []byte
	ctx    context.Context
	cancel context.CancelFunc
	began  bool
}

// add collects the request; at its end the answer is made on a goroutine of
// its own (it calls the driver).
func (lc *localCall) add(data []byte, end bool) {
	if len(lc.req)+len(data) > maxLocalRequest {
		if !lc.began {
			lc.began = true
			lc.cancel()
			var f flusher
			lc.s.fail(codes.ResourceExhausted, fmt.Sprintf("csibroker proxy: %s request larger than %d bytes", infoMethod, maxLocalRequest), &f)
			f.flush()
		}
		return
	}
	lc.req = append(lc.req, data...)
	if end && !lc.began {
		lc.began = true
		go lc.answer()
	}
}

func (lc *localCall) answer() {
	defer lc.cancel()
	s := lc.s
	msg, err := proto.Marshal(s.p.getInfo(lc.ctx))
	var f flusher
	if err != nil {
		s.fail(codes.Internal, "csibroker proxy: "+err.Error(), &f)
		f.flush()
		return
	}
	frame := make([]byte, 5+len(msg))
	binary.BigEndian.PutUint32(frame[1:], uint32(len(msg)))
	copy(frame[5:], msg)
	s.finish(codes.OK)
	b := s.b
	c := b.c
	c.mu.Lock()
	c.sendLocked(b, out{fields: []hpack.HeaderField{{Name: ":status", Value: "200"}, {Name: "content-type", Value: "application/grpc"}}}, nil)
	c.sendLocked(b, out{isData: true, data: frame}, nil)
	c.sendLocked(b, out{fields: []hpack.HeaderField{{Name: "grpc-status", Value: "0"}}, end: true}, nil)
	c.flushLocked()
	c.mu.Unlock()
}

// serverMetrics keeps the names and labels of go-grpc-middleware's server
// metrics, which the dashboards read for the proxy hop.
type serverMetrics struct {
	started *prometheus.CounterVec
	handled *prometheus.CounterVec
	seconds *prometheus.HistogramVec
}

func newServerMetrics() *serverMetrics {
	return &serverMetrics{
		started: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "grpc_server_started_total",
			Help: "Total number of RPCs started on the server."}, []string{"grpc_type", "grpc_service", "grpc_method"}),
		handled: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "grpc_server_handled_total",
			Help: "Total number of RPCs completed on the server, regardless of success or failure."}, []string{"grpc_type", "grpc_service", "grpc_method", "grpc_code"}),
		seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "grpc_server_handling_seconds",
			Help:    "Histogram of response latency (seconds) of gRPC that had been application-level handled by the server.",
			Buckets: prometheus.ExponentialBucketsRange(10e-6, 120, 24)}, []string{"grpc_type", "grpc_service", "grpc_method"}),
	}
}

func (m *serverMetrics) Describe(ch chan<- *prometheus.Desc) {
	m.started.Describe(ch)
	m.handled.Describe(ch)
	m.seconds.Describe(ch)
}

func (m *serverMetrics) Collect(ch chan<- prometheus.Metric) {
	m.started.Collect(ch)
	m.handled.Collect(ch)
	m.seconds.Collect(ch)
}

// methodInfo is a method's labels and metric children, made once.
type methodInfo struct {
	typ, service, name string
	started            prometheus.Counter
	seconds            prometheus.Observer
	handledOK          prometheus.Counter
	// the server span's start options, named and described as otelgrpc
	// does for the other hops
	spanOpts []trace.SpanStartOption
}

func (p *Proxy) methodInfo(path string) *methodInfo {
	if mi, ok := p.methods.Load(path); ok {
		return mi.(*methodInfo)
	}
	spanOpts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindServer),
		trace.WithAttributes(semconv.RPCSystemNameGRPC, semconv.RPCMethod(strings.TrimPrefix(path, "/")))}
	known, cs, ss := rawgrpc.MethodKind(path)
	i := strings.LastIndexByte(path, '/')
	if !strings.HasPrefix(path, "/") || i <= 0 || !known && path != infoMethod {
		// Counted under one label and not kept: the broker forwards any
		// /csi.* path its front end's callers name.
		mi := *p.otherMethod()
		mi.spanOpts = spanOpts
		return &mi
	}
	svc, name := path[1:i], path[i+1:]
	typ := "unary"
	switch {
	case !known: // the info method, answered by the proxy itself
	case cs && ss:
		typ = "bidi_stream"
	case cs:
		typ = "client_stream"
	case ss:
		typ = "server_stream"
	}
	v, _ := p.methods.LoadOrStore(path, p.newMethodInfo(typ, svc, name, spanOpts))
	return v.(*methodInfo)
}

// otherMethod is the metric series of every method the registry does not
// know (rawgrpc.OtherMethod).
func (p *Proxy) otherMethod() *methodInfo {
	p.otherOnce.Do(func() {
		p.other = p.newMethodInfo("bidi_stream", rawgrpc.OtherMethod, rawgrpc.OtherMethod, nil)
	})
	return p.other
}

func (p *Proxy) newMethodInfo(typ, svc, name string, spanOpts []trace.SpanStartOption) *methodInfo {
	return &methodInfo{typ: typ, service: svc, name: name,
		started:   p.metrics.started.WithLabelValues(typ, svc, name),
		seconds:   p.metrics.seconds.WithLabelValues(typ, svc, name),
		handledOK: p.metrics.handled.WithLabelValues(typ, svc, name, codes.OK.String()),
		spanOpts:  spanOpts}
}
