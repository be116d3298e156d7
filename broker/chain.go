package broker

import (
	"context"
	"log/slog"
	"strings"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"github.com/kubernetes-csi/csi-lib-utils/protosanitizer"
	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"github.com/csibroker/csibroker/internal/rawgrpc"
)

// The client chain, outermost first: observe (one span per logical call,
// in-flight gauge, latency histograms, sanitized log) → timeout (per driver and
// method) → retry (Unavailable only, jittered exponential backoff, each attempt
// inside the caller's deadline). otelgrpc's stats handler then makes one span
// per attempt and carries W3C trace context to the proxy.
func (b *Broker) unaryChain(p *proxyConn) []grpc.UnaryClientInterceptor {
	r := p.retry
	return []grpc.UnaryClientInterceptor{
		b.observeUnary(p),
		timeoutUnary(p),
		retry.UnaryClientInterceptor(
			retry.WithMax(uint(r.MaxAttempts)),
			retry.WithCodes(codes.Unavailable),
			retry.WithBackoff(retry.BackoffExponentialWithJitterBounded(r.IntervalStart, 0.2, r.IntervalMax)),
			retry.WithOnRetryCallback(func(ctx context.Context, attempt uint, err error) {
				method, _ := ctx.Value(methodKey{}).(string)
				code := status.Code(err).String()
				b.metrics.retries.WithLabelValues(p.driver, method, code).Inc()
				trace.SpanFromContext(ctx).AddEvent("retry", trace.WithAttributes(
					attribute.Int("csi.attempt", int(attempt)+1), attribute.String("rpc.grpc.previous_status_code", code)))
				b.log.Debug("csi call retried", "driver", p.driver, "method", method, "attempt", attempt+1, "code", code)
			}),
		),
	}
}

type methodKey struct{}

func (b *Broker) streamChain(p *proxyConn) []grpc.StreamClientInterceptor {
	return []grpc.StreamClientInterceptor{
		func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			ctx, span := b.tracer.Start(ctx, "broker "+method, trace.WithSpanKind(trace.SpanKindInternal),
				trace.WithAttributes(attribute.String("csi.driver", p.driver), attribute.String("csi.node", p.cfg.Node), attribute.String("rpc.method", shortMethod(method))))
			cs, err := streamer(ctx, desc, cc, method, opts...)
			if err != nil {
				span.SetStatus(otelcodes.Error, status.Code(err).String())
				span.End()
				return nil, err
			}
			// The span covers opening the stream; the per-attempt span from
			// otelgrpc covers the whole stream.
			span.End()
			return cs, nil
		},
	}
}

func timeoutUnary(p *proxyConn) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		cfg := p.driverCfg.Load()
		d := cfg.Timeout
		if md, ok := cfg.MethodTimeouts[shortMethod(method)]; ok {
			d = md
		}
		ctx, cancel := context.WithTimeout(ctx, d)
		defer cancel()
		return invoker(ctx, method, req, reply, cc, opts...)
	}
}

func (b *Broker) observeUnary(p *proxyConn) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		short := shortMethod(method)
		ctx = context.WithValue(ctx, methodKey{}, short)
		ctx, span := b.tracer.Start(ctx, "broker "+method, trace.WithSpanKind(trace.SpanKindInternal),
			trace.WithAttributes(attribute.String("csi.driver", p.driver), attribute.String("csi.node", p.cfg.Node), attribute.String("rpc.method", short), attribute.String("csi.proxy", p.cfg.Address)))
		defer span.End()

		stats := b.driverStats(p.driver)
		inflight := b.metrics.inflight.WithLabelValues(p.driver, short)
		inflight.Inc()
		stats.inflight.Add(1)
		debug := b.log.Enabled(ctx, slog.LevelDebug)
		if debug {
			b.log.Debug("csi request", "driver", p.driver, "node", p.cfg.Node, "method", short, "request", sanitized(method, req, true))
		}
		start := time.Now()
		err := invoker(ctx, method, req, reply, cc, opts...)
		elapsed := time.Since(start)
		inflight.Dec()
		stats.inflight.Add(-1)
		stats.total.Add(1)

		code := status.Code(err)
		b.metrics.calls.WithLabelValues(p.driver, short, code.String()).Observe(elapsed.Seconds())
		b.metrics.sidecar.WithLabelValues(p.driver, method, code.String()).Observe(elapsed.Seconds())
		span.SetAttributes(attribute.String("rpc.grpc.status_code", code.String()))
		if err != nil {
			stats.failed.Add(1)
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
