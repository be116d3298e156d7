package broker

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/timeout"
	"github.com/kubernetes-csi/csi-lib-utils/protosanitizer"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"github.com/csibroker/csibroker/internal/rawgrpc"
	"github.com/csibroker/csibroker/internal/telemetry"
)

// The client chain of a call, outermost first, as grpc-go interceptors:
// observe (one span per logical call, in-flight gauge, latency histograms,
// sanitized log, secret redaction, what the status says of where it came
// from) → timeout (per driver and method, go-grpc-middleware's) → retry
// (go-grpc-middleware's: Unavailable only, jittered exponential backoff,
// each attempt inside the caller's deadline; unary calls only) → attempt,
// which picks the proxy's current connection (a driver reconfigured since
// the call began sends the attempt to its new proxy) and calls through
// it: otelgrpc's stats handler makes a client span per attempt and sends
// its W3C trace context to the proxy. The chain is composed here rather
// than installed on the ClientConn, since a proxy's connection is
// replaced (certificate renewal, reconfiguration) while calls retry.

// callState is what the chain learns of one logical call.
type callState struct {
	answered atomic.Bool // the last attempt's status came in the proxy's trailers
	retried  bool        // an attempt was retried after Unavailable
	giveUp   bool        // no further attempt: the last one's error is the call's
	lastErr  error       // the last attempt's error
	desc     *callDesc   // the method's, for the retry's metric and log
}

type callStateKey struct{}

func stateOf(ctx context.Context) *callState {
	st, _ := ctx.Value(callStateKey{}).(*callState)
	return st
}

// unaryChain runs interceptors, outermost first, around final.
func unaryChain(final grpc.UnaryInvoker, ics ...grpc.UnaryClientInterceptor) grpc.UnaryInvoker {
	for i := len(ics) - 1; i >= 0; i-- {
		ic, next := ics[i], final
		final = func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, opts ...grpc.CallOption) error {
			return ic(ctx, method, req, reply, cc, next, opts...)
		}
	}
	return final
}

// buildChain makes p's unary chain.
func (p *proxyConn) buildChain() {
	r := p.retry
	base := retry.BackoffExponentialWithJitterBounded(r.IntervalStart, 0.2, r.IntervalMax)
	p.unary = unaryChain(p.attempt,
		p.observeUnary,
		func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			return timeout.UnaryClientInterceptor(p.methodTimeout(method))(ctx, method, req, reply, cc, invoker, opts...)
		},
		retry.UnaryClientInterceptor(
			retry.WithMax(uint(max(r.MaxAttempts, 1))),
			retry.WithCodes(codes.Unavailable),
			retry.WithBackoff(func(ctx context.Context, attempt uint) time.Duration {
				st := stateOf(ctx)
				if st.giveUp {
					return 0
				}
				wait := base(ctx, attempt)
				if dl, ok := ctx.Deadline(); ok && time.Until(dl) <= wait {
					// No attempt could start in time: the driver's own
					// answer is the call's, not a DeadlineExceeded of ours.
					st.giveUp = true
					return 0
				}
				return wait
			}),
			retry.WithOnRetryCallback(func(ctx context.Context, attempt uint, err error) {
				if st := stateOf(ctx); !st.giveUp {
					st.retried = true
					p.b.onRetry(ctx, p, st.desc, attempt, err)
				}
			}),
		),
	)
}

// observeUnary is the chain's outermost interceptor.
func (p *proxyConn) observeUnary(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	st := &callState{desc: p.b.desc(p, method)}
	ctx = context.WithValue(ctx, callStateKey{}, st)
	return p.b.observe(ctx, p, st.desc, method, req, reply, func(ctx context.Context) error {
		err := invoker(ctx, method, req, reply, cc, opts...)
		if err == nil {
			return nil
		}
		// An attempt ended Unavailable and the call then ended otherwise
		// (its context, during the backoff): that attempt may have
		// reached the driver and acted.
		retried := st.retried || (st.lastErr != nil && err != st.lastErr && status.Code(st.lastErr) == codes.Unavailable)
		return &callError{st: status.Convert(err), answered: err == st.lastErr && st.answered.Load(), retried: retried}
	})
}

// attempt is one try of a unary call, on the connection that serves the
// driver now.
func (p *proxyConn) attempt(ctx context.Context, method string, req, reply any, _ *grpc.ClientConn, opts ...grpc.CallOption) error {
	st := stateOf(ctx)
	if st.giveUp && st.lastErr != nil {
		return st.lastErr
	}
	ap, err := p.live()
	if err == nil {
		var g *generation
		if g, err = ap.acquire(); err == nil {
			st.answered.Store(false)
			err = g.cc.Invoke(stripAttempt(ctx), method, req, reply, opts...)
			if err != nil && ctx.Err() == nil && g.closed.Load() && status.Code(err) == codes.Canceled {
				// grpc-go's word for its connection closed under the call.
				err = errClosedUpstream(ap.cfg.Address)
			}
			g.release()
		}
	}
	if err != nil && status.Code(err) == codes.Unavailable {
		if ap == nil {
			st.giveUp = true // the driver was removed: no proxy will take a retry
		} else if _, lerr := ap.live(); lerr != nil {
			st.giveUp = true
		}
	}
	st.lastErr = err
	return err
}

// stripAttempt drops the attempt number the retry interceptor adds to a
// retry's metadata: what reaches the driver is what the caller sent.
func stripAttempt(ctx context.Context) context.Context {
	md, ok := metadata.FromOutgoingContext(ctx)
	if !ok || len(md.Get(retry.AttemptMetadataKey)) == 0 {
		return ctx
	}
	md = md.Copy()
	md.Delete(retry.AttemptMetadataKey)
	return metadata.NewOutgoingContext(ctx, md)
}

// newStream opens a stream on the connection that serves the driver now,
// bounded by the driver's timeout for the method, as a unary call is.
func (p *proxyConn) newStream(ctx context.Context, desc *grpc.StreamDesc, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	ap, err := p.live()
	if err != nil {
		return nil, err
	}
	b := ap.b
	ctx, cancel := context.WithTimeout(ctx, ap.methodTimeout(method))
	d := b.desc(ap, method)
	ctx, span := b.tracer.Start(ctx, d.spanName, d.spanOpts...)
	ds := b.began(ap, d)
	start := time.Now()
	fail := func(err error) (grpc.ClientStream, error) {
		span.SetStatus(otelcodes.Error, status.Code(err).String())
		span.End()
		b.streamEnded(ap, d, ds, start, err)
		cancel()
		return nil, err
	}
	g, err := ap.acquire()
	if err != nil {
		return fail(err)
	}
	cs, err := g.cc.NewStream(ctx, desc, method, opts...)
	if err != nil {
		g.release()
		return fail(err)
	}
	// The span covers opening the stream; the per-attempt span from
	// otelgrpc covers the whole stream.
	span.End()
	bs := &boundStream{ClientStream: cs, method: method, done: func(err error) {
		b.streamEnded(ap, d, ds, start, err)
		g.release()
		cancel()
	}}
	// A stream its caller abandons without reading it to the end ends
	// with its context.
	context.AfterFunc(ctx, func() { bs.end(status.FromContextError(ctx.Err()).Err()) })
	return bs, nil
}

// onRetry records a retry: attempt is the retry's number (1 for the
// second try) and err the previous attempt's error.
func (b *Broker) onRetry(ctx context.Context, p *proxyConn, d *callDesc, attempt uint, err error) {
	code := rawgrpc.CodeLabel(status.Code(err))
	b.metrics.retries.WithLabelValues(p.driver, d.metricShort, code).Inc()
	trace.SpanFromContext(ctx).AddEvent("retry", trace.WithAttributes(
		attribute.Int("csi.attempt", int(attempt)+1), attribute.String("rpc.grpc.previous_status_code", code)))
	b.log.Debug("csi call retried", "driver", p.driver, "method", d.short, "attempt", attempt+1, "code", code)
}

// streamEnded records a stream's end as observe records a unary call's.
func (b *Broker) streamEnded(p *proxyConn, d *callDesc, ds *driverStats, start time.Time, err error) {
	if code := b.ended(p, d, ds, time.Since(start), err, trace.SpanContext{}); err != nil {
		b.log.Info("csi stream failed", "driver", p.driver, "node", p.cfg.Node, "method", d.short, "code", code.String())
	}
}

// began counts a call (unary or stream) in flight, in the metrics and in
// its driver's status counts, which it returns for ended.
func (b *Broker) began(p *proxyConn, d *callDesc) *driverStats {
	ds := b.driverStats(p.driver)
	d.inflight.Inc()
	ds.inflight.Add(1)
	return ds
}

// ended records the end of a call that began: the latency histograms (with
// sc's trace ID as exemplar when it is sampled) and the driver's status
// counts.
func (b *Broker) ended(p *proxyConn, d *callDesc, ds *driverStats, elapsed time.Duration, err error, sc trace.SpanContext) codes.Code {
	d.inflight.Dec()
	ds.inflight.Add(-1)
	ds.total.Add(1)
	code := status.Code(err)
	if code == codes.OK {
		telemetry.ObserveTraced(d.okCalls, elapsed.Seconds(), sc)
		telemetry.ObserveTraced(d.okSidecar, elapsed.Seconds(), sc)
	} else {
		ds.failed.Add(1)
		telemetry.ObserveTraced(b.metrics.calls.WithLabelValues(p.driver, d.metricShort, rawgrpc.CodeLabel(code)), elapsed.Seconds(), sc)
		telemetry.ObserveTraced(b.metrics.sidecar.WithLabelValues(p.driver, d.metricFull, rawgrpc.CodeLabel(code)), elapsed.Seconds(), sc)
	}
	return code
}

// boundStream calls done once, when the stream ends (RecvMsg's io.EOF, its
// error, or a failed SendMsg's status read back), and strips from the
// stream's status the secrets its requests carried, as observe does for a
// unary call.
type boundStream struct {
	grpc.ClientStream
	method string
	once   sync.Once
	done   func(error)

	mu      sync.Mutex
	secrets []string // the csi_secret values of the requests sent so far
}

func (s *boundStream) end(err error) { s.once.Do(func() { s.done(err) }) }

func (s *boundStream) SendMsg(m any) error {
	// Noted before the request leaves: the answer may come first.
	if values := secretValues(s.method, m); len(values) > 0 {
		s.mu.Lock()
		for _, v := range values {
			if !slices.Contains(s.secrets, v) {
				s.secrets = append(s.secrets, v)
			}
		}
		s.mu.Unlock()
	}
	return s.ClientStream.SendMsg(m)
}

func (s *boundStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	switch {
	case err == nil:
	case errors.Is(err, io.EOF):
		s.end(nil)
	default:
		s.mu.Lock()
		err = redactValues(err, s.secrets)
		s.mu.Unlock()
		s.end(err)
	}
	return err
}

// methodTimeout is the driver's timeout for method.
func (p *proxyConn) methodTimeout(method string) time.Duration {
	cfg := p.driverCfg.Load()
	if d, ok := cfg.MethodTimeouts[shortMethod(method)]; ok {
		return d
	}
	return cfg.Timeout
}

// callDesc is what the calls of one method through one proxy share, made
// on their first call: span names and start options, metric series.
type callDesc struct {
	short string
	// the method's metric labels, short and full: its names if the
	// protobuf registry knows it, else rawgrpc.OtherMethod
	metricShort, metricFull string
	spanName                string
	spanOpts                []trace.SpanStartOption
	inflight                prometheus.Gauge
	okCalls, okSidecar      prometheus.Observer
}

// desc is method's callDesc for p. Only the methods of the CSI services
// are kept, and only they are named in metric labels (a front-end caller
// may name any path; the others are counted as rawgrpc.OtherMethod).
func (b *Broker) desc(p *proxyConn, method string) *callDesc {
	if d, ok := p.descs.Load(method); ok {
		return d.(*callDesc)
	}
	short := shortMethod(method)
	mFull := rawgrpc.MetricMethod(method)
	mShort := shortMethod(mFull)
	d := &callDesc{
		short:       short,
		metricShort: mShort,
		metricFull:  mFull,
		spanName:    "broker " + method,
		spanOpts: []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindInternal),
			trace.WithAttributes(attribute.String("csi.driver", p.driver), attribute.String("csi.node", p.cfg.Node), attribute.String("rpc.method", short), attribute.String("csi.proxy", p.cfg.Address))},
		inflight:  b.metrics.inflight.WithLabelValues(p.driver, mShort),
		okCalls:   b.metrics.calls.WithLabelValues(p.driver, mShort, codes.OK.String()),
		okSidecar: b.metrics.sidecar.WithLabelValues(p.driver, mFull, codes.OK.String()),
	}
	if mFull == method {
		v, _ := p.descs.LoadOrStore(method, d)
		d = v.(*callDesc)
	}
	return d
}

// observe wraps one logical call (all its attempts): a span, the in-flight
// gauge, latency histograms, and the sanitized request and response logs.
// reply is read once call has returned.
func (b *Broker) observe(ctx context.Context, p *proxyConn, d *callDesc, method string, req, reply any, call func(context.Context) error) error {
	short := d.short
	ctx, span := b.tracer.Start(ctx, d.spanName, d.spanOpts...)
	defer span.End()

	ds := b.began(p, d)
	debug := b.log.Enabled(ctx, slog.LevelDebug)
	if debug {
		b.log.Debug("csi request", "driver", p.driver, "node", p.cfg.Node, "method", short, "request", sanitized(method, req, true))
	}
	start := time.Now()
	err := call(ctx)
	elapsed := time.Since(start)
	if err != nil {
		// A driver may echo a credential in its error (a bad key, say):
		// the request's secret values never leave in an error message.
		err = redactSecrets(err, method, req)
	}
	code := b.ended(p, d, ds, elapsed, err, span.SpanContext())
	span.SetAttributes(attribute.String("rpc.grpc.status_code", code.String()))
	if err != nil {
		span.SetStatus(otelcodes.Error, code.String())
		// The driver's message passes through unchanged (design.md); it is
		// logged as the driver sent it, never with request contents.
		b.log.Info("csi call failed", "driver", p.driver, "node", p.cfg.Node, "method", short, "code", code.String(),
			"message", status.Convert(err).Message(), "duration", elapsed, "trace_id", span.SpanContext().TraceID().String())
	} else if debug {
		b.log.Debug("csi response", "driver", p.driver, "node", p.cfg.Node, "method", short, "duration", elapsed, "response", sanitized(method, reply, false))
	}
	return err
}

func (b *Broker) driverStats(name string) *driverStats {
	b.mu.RLock()
	d := b.drivers[name]
	b.mu.RUnlock()
	if d == nil {
		return &driverStats{}
	}
	return d.stats
}

// redactSecrets replaces, in err's status message, every value of the
// request's csi_secret fields, as sent or as a driver may have escaped or
// encoded it (Go quoting, JSON, URL encoding, base64, hex), and drops any
// status detail that holds one in any of those forms; everything else about the status (code, the rest of the message,
// the other details) passes through unchanged.
func redactSecrets(err error, method string, req any) error {
	return redactValues(err, secretValues(method, req))
}

// secretValues returns the values of req's csi_secret fields; req is a
// message or a raw frame of method's request type (nil if the method is
// not known).
func secretValues(method string, req any) []string {
	var m proto.Message
	switch r := req.(type) {
	case *rawgrpc.Frame:
		if m = newMessage(method, true); m == nil || proto.Unmarshal(r.Payload, m) != nil {
			return nil
		}
	case proto.Message:
		m = r
	default:
		return nil
	}
	var values []string
	collectSecrets(m.ProtoReflect(), &values)
	return values
}

// redactValues is redactSecrets with the secret values given.
func redactValues(err error, values []string) error {
	st, ok := status.FromError(err)
	if len(values) == 0 || !ok {
		return err
	}
	var forms []string
	for _, v := range values {
		forms = append(forms, secretForms(v)...)
	}
	// Longest first: a form that contains another is replaced whole.
	slices.SortFunc(forms, func(a, b string) int { return len(b) - len(a) })
	pb := st.Proto()
	changed := false
	for _, f := range forms {
		if strings.Contains(pb.Message, f) {
			pb.Message, changed = strings.ReplaceAll(pb.Message, f, "***stripped***"), true
		}
	}
	details := pb.Details[:0:0]
	for _, d := range pb.Details {
		if slices.ContainsFunc(forms, func(f string) bool { return bytes.Contains(d.GetValue(), []byte(f)) }) {
			changed = true
			continue
		}
		details = append(details, d)
	}
	if !changed {
		return err
	}
	pb.Details = details
	out := status.FromProto(pb)
	if ce, ok := errors.AsType[*callError](err); ok {
		// What the status said of where it came from stays.
		return &callError{st: out, answered: ce.answered, retried: ce.retried}
	}
	return out.Err()
}

// secretForms are a secret value as sent and as a driver's error message
// may carry it escaped or encoded whole; empty values have none.
func secretForms(v string) []string {
	if v == "" {
		return nil
	}
	forms := []string{v}
	add := func(f string) {
		if f != "" && !slices.Contains(forms, f) {
			forms = append(forms, f)
		}
	}
	if q := strconv.Quote(v); len(q) >= 2 {
		add(q[1 : len(q)-1])
	}
	if q := strconv.QuoteToASCII(v); len(q) >= 2 {
		add(q[1 : len(q)-1])
	}
	if j, err := json.Marshal(v); err == nil && len(j) >= 2 {
		add(string(j[1 : len(j)-1]))
	}
	add(url.QueryEscape(v))
	add(url.PathEscape(v))
	for _, enc := range []*base64.Encoding{base64.StdEncoding, base64.URLEncoding, base64.RawStdEncoding, base64.RawURLEncoding} {
		add(enc.EncodeToString([]byte(v)))
	}
	add(hex.EncodeToString([]byte(v)))
	add(strings.ToUpper(hex.EncodeToString([]byte(v))))
	return forms
}

// collectSecrets appends the values of m's csi_secret fields (at any depth).
func collectSecrets(m protoreflect.Message, into *[]string) {
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if proto.GetExtension(fd.Options(), csi.E_CsiSecret).(bool) {
			switch {
			case fd.IsMap():
				v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
					*into = append(*into, mv.String())
					return true
				})
			case fd.Kind() == protoreflect.StringKind && !fd.IsList():
				*into = append(*into, v.String())
			}
			return true
		}
		if fd.Kind() == protoreflect.MessageKind || fd.Kind() == protoreflect.GroupKind {
			switch {
			case fd.IsList():
				for i := 0; i < v.List().Len(); i++ {
					collectSecrets(v.List().Get(i).Message(), into)
				}
			case fd.IsMap():
				if fd.MapValue().Kind() == protoreflect.MessageKind {
					v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
						collectSecrets(mv.Message(), into)
						return true
					})
				}
			default:
				collectSecrets(v.Message(), into)
			}
		}
		return true
	})
}

// sanitized renders a CSI message with every csi_secret field replaced by
// "***stripped***". A raw frame is decoded first, by the method's type in the
// protobuf registry; what cannot be decoded is described, never printed.
func sanitized(method string, msg any, request bool) string {
	if f, ok := msg.(*rawgrpc.Frame); ok {
		m := newMessage(method, request)
		if m == nil {
			return "<undecoded message>"
		}
		if err := proto.Unmarshal(f.Payload, m); err != nil {
			return "<undecodable message>"
		}
		msg = m
	}
	return protosanitizer.StripSecrets(msg).String()
}

func newMessage(fullMethod string, request bool) proto.Message {
	name := strings.ReplaceAll(strings.TrimPrefix(fullMethod, "/"), "/", ".")
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(name))
	if err != nil {
		return nil
	}
	md, ok := d.(protoreflect.MethodDescriptor)
	if !ok {
		return nil
	}
	desc := md.Output()
	if request {
		desc = md.Input()
	}
	mt, err := protoregistry.GlobalTypes.FindMessageByName(desc.FullName())
	if err != nil {
		return nil
	}
	return mt.New().Interface()
}

// chainConn is a proxy connection as gRPC client code sees it (the
// Kubernetes controllers' typed CSI clients, the front end): every call
// goes through the chain.
type chainConn struct{ p *proxyConn }

// Invoke runs a unary call through the chain. args and reply are protobuf
// messages or, where a call is only forwarded, *rawgrpc.Frame.
func (c chainConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	return c.p.unary(ctx, method, args, reply, nil, opts...)
}

// NewStream opens a stream through the stream chain.
func (c chainConn) NewStream(ctx context.Context, desc *grpc.StreamDesc, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	return c.p.newStream(ctx, desc, method, opts...)
}

// brokerStats is every proxy connection's stats handler: otelgrpc's, with
// an ended call's status reduced to its code (telemetry.CodeOnly: a
// driver's message may quote its request's secrets), and a note on the
// call's state that its status came in the proxy's trailers.
type brokerStats struct{ stats.Handler }

func (h brokerStats) HandleRPC(ctx context.Context, rs stats.RPCStats) {
	if _, ok := rs.(*stats.InTrailer); ok {
		if st := stateOf(ctx); st != nil {
			st.answered.Store(true)
		}
	}
	h.Handler.HandleRPC(ctx, rs)
}
