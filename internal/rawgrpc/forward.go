package rawgrpc

import (
	"context"
	"errors"
	"io"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
)

// Forward relays one call between in, the call a server received, and out,
// the stream opened for it to the backend (with StreamDesc and
// grpc.ForceCodecV2(Codec{}), on a context derived from in's, so that the
// deadline and cancellation reach the backend). Messages are copied as
// frames both ways; the caller's end of sending becomes out.CloseSend; the
// backend's headers are sent on as soon as they arrive, and its trailers
// are set on in. It returns the backend's status error as it came (code,
// message and details), nil for OK, or the error of in itself when the
// caller's side failed (the call cancelled, say). The caller cancels out's
// context when Forward returns: a backend call may still be sending, and
// the caller's messages may still be arriving, when the other side ends.
func Forward(in grpc.ServerStream, out grpc.ClientStream) error {
	upErr := make(chan error, 1)
	go func() { upErr <- forwardRequests(in, out) }()
	downErr := make(chan error, 1)
	go func() { downErr <- forwardResponses(in, out) }()
	for {
		select {
		case err := <-upErr:
			if err != nil {
				// The caller's side failed (cancelled, or a message too
				// large to accept): the backend call ends with it.
				return err
			}
			// The caller has sent everything: the answer decides.
			upErr = nil
		case err := <-downErr:
			return err
		}
	}
}

// forwardRequests copies the caller's messages to the backend until the
// caller ends sending (nil) or its side fails (the error). A backend that
// stops taking messages has ended the call: its status comes from
// forwardResponses, and this returns nil, waiting for nothing.
func forwardRequests(in grpc.ServerStream, out grpc.ClientStream) error {
	f := &Frame{}
	for {
		if err := in.RecvMsg(f); err != nil {
			if errors.Is(err, io.EOF) {
				return out.CloseSend()
			}
			return err
		}
		if err := out.SendMsg(f); err != nil {
			// io.EOF: the backend ended the call; RecvMsg says how.
			return nil
		}
	}
}

// forwardResponses passes the backend's headers, messages and trailers to
// the caller and returns the backend's status (nil for OK).
func forwardResponses(in grpc.ServerStream, out grpc.ClientStream) error {
	// Header blocks until the headers arrive or the call ends; it returns
	// nil metadata when the answer had none (a status alone).
	if md, err := out.Header(); err == nil && md != nil {
		if err := in.SendHeader(md); err != nil {
			return err
		}
	}
	f := &Frame{}
	for {
		err := out.RecvMsg(f)
		if err != nil {
			in.SetTrailer(out.Trailer())
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		if err := in.SendMsg(f); err != nil {
			return err
		}
	}
}

// ForwardedMetadata is a copy of md, a call's incoming metadata, for the
// next hop: without the keys gRPC sets itself (pseudo-headers, :authority,
// content-type, user-agent, te, grpc-*) and without the trace context
// (traceparent, tracestate, baggage), which the forwarder injects for its
// own span.
func ForwardedMetadata(md metadata.MD) metadata.MD {
	out := make(metadata.MD, len(md))
	for k, v := range md {
		if !reserved(k) {
			out[k] = append([]string(nil), v...)
		}
	}
	return out
}

// OutgoingContext is ctx (a call's incoming context) with the call's
// forwarded metadata (ForwardedMetadata) as its outgoing metadata, which
// it returns too, for the caller to add its trace context to.
func OutgoingContext(ctx context.Context) (context.Context, metadata.MD) {
	in, _ := metadata.FromIncomingContext(ctx)
	md := ForwardedMetadata(in)
	return metadata.NewOutgoingContext(ctx, md), md
}

// MDCarrier adapts metadata to OpenTelemetry's TextMapCarrier, so that a
// propagator can inject a span's context into outgoing metadata.
type MDCarrier metadata.MD

// Get returns the first value of key.
func (c MDCarrier) Get(key string) string {
	if v := metadata.MD(c).Get(key); len(v) > 0 {
		return v[0]
	}
	return ""
}

// Set replaces key's values with value.
func (c MDCarrier) Set(key, value string) { metadata.MD(c).Set(key, value) }

// Keys lists the keys.
func (c MDCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, strings.ToLower(k))
	}
	return keys
}

// Prefetch receives in's first message and returns a stream whose first
// RecvMsg gives it again, so that a forwarder can wait for a call's
// request before it opens the backend's stream: a call whose request never
// comes, or that is reset before it is sent, then costs the backend
// nothing. It fails with the error of receiving, unless that is io.EOF (a
// call without a message, which the backend is left to answer). Only for
// methods whose client does not stream: a streaming client may wait for
// the answer's headers before it sends.
func Prefetch(in grpc.ServerStream) (grpc.ServerStream, error) {
	p := &prefetched{ServerStream: in, first: &Frame{}}
	if p.err = in.RecvMsg(p.first); p.err != nil && !errors.Is(p.err, io.EOF) {
		return nil, p.err
	}
	return p, nil
}

type prefetched struct {
	grpc.ServerStream
	first *Frame
	err   error
}

func (p *prefetched) RecvMsg(m any) error {
	if p.first == nil {
		return p.ServerStream.RecvMsg(m)
	}
	f, err := p.first, p.err
	p.first, p.err = nil, nil
	if err != nil {
		return err
	}
	dst, ok := m.(*Frame)
	if !ok {
		return errors.New("rawgrpc: a prefetched stream receives frames only")
	}
	*dst = *f
	return nil
}
