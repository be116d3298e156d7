// Package rawgrpc forwards gRPC calls without decoding their messages: a codec
// that carries raw frames, and helpers that copy a call from a server stream to
// a client stream with its metadata, headers, trailers and status untouched.
//
// The broker's front ends use it to hand every CSI call (so services added
// to the spec later pass through unchanged) to the driver's connection. The
// proxy does not: it relays HTTP/2 frames itself (proxy/relay.go).
package rawgrpc

import (
	"context"
	"errors"
	"io"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/proto" // registers the proto codec used for non-frame messages
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
)

// Frame is one undecoded gRPC message.
type Frame struct{ Payload []byte }

// Codec passes *Frame through as bytes and encodes anything else as protobuf,
// so a server can serve opaque forwarding and typed services side by side.
type Codec struct{}

var protoCodec = encoding.GetCodecV2("proto")

// Marshal returns a frame's bytes, or the protobuf encoding of v.
func (Codec) Marshal(v any) (mem.BufferSlice, error) {
	if f, ok := v.(*Frame); ok {
		// SliceBuffer's Free is a no-op, so a frame can be sent again (retries).
		return mem.BufferSlice{mem.SliceBuffer(f.Payload)}, nil
	}
	return protoCodec.Marshal(v)
}

// Unmarshal keeps a copy of the bytes in a frame, or decodes protobuf.
func (Codec) Unmarshal(data mem.BufferSlice, v any) error {
	if f, ok := v.(*Frame); ok {
		f.Payload = data.Materialize()
		return nil
	}
	return protoCodec.Unmarshal(data, v)
}

// Name is "proto": on the wire the frames are protobuf messages.
func (Codec) Name() string { return "proto" }

// CallOption makes a client call use the frame codec.
func CallOption() grpc.CallOption { return grpc.ForceCodecV2(Codec{}) }

// ServerOption makes a server use the frame codec.
func ServerOption() grpc.ServerOption { return grpc.ForceServerCodecV2(Codec{}) }

// reserved metadata keys are set by gRPC itself or by our own interceptors and
// are never copied from one hop to the next.
func reserved(k string) bool {
	switch k {
	case ":authority", "content-type", "user-agent", "te", "traceparent", "tracestate", "baggage":
		return true
	}
	return strings.HasPrefix(k, "grpc-") || strings.HasPrefix(k, ":")
}

// CleanMD returns a copy of md without the keys gRPC or tracing set per hop.
func CleanMD(md metadata.MD) metadata.MD {
	out := make(metadata.MD, len(md))
	for k, v := range md {
		if !reserved(k) {
			out[k] = append([]string(nil), v...)
		}
	}
	return out
}

// OutgoingContext returns ctx with the caller's request metadata copied for
// the next hop.
func OutgoingContext(ctx context.Context) context.Context {
	md, _ := metadata.FromIncomingContext(ctx)
	return metadata.NewOutgoingContext(ctx, CleanMD(md))
}

// MethodKind says how a method streams, looked up in the protobuf registry
// (the CSI spec package registers its services when imported). Methods of
// unknown services are treated as bidirectional streams.
func MethodKind(fullMethod string) (known, clientStream, serverStream bool) {
	name := strings.ReplaceAll(strings.TrimPrefix(fullMethod, "/"), "/", ".")
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(name))
	if err != nil {
		return false, true, true
	}
	m, ok := d.(protoreflect.MethodDescriptor)
	if !ok {
		return false, true, true
	}
	return true, m.IsStreamingClient(), m.IsStreamingServer()
}

// StreamDesc is the descriptor for opening a client stream of any kind.
var StreamDesc = &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}

// ForwardStream copies a call both ways between srv (the caller) and cs (the
// next hop) until both directions end, then passes the next hop's trailer and
// status back unchanged.
func ForwardStream(srv grpc.ServerStream, cs grpc.ClientStream) error {
	upErr := make(chan error, 1)
	go func() {
		for {
			f := &Frame{}
			if err := srv.RecvMsg(f); err != nil {
				if errors.Is(err, io.EOF) {
					upErr <- cs.CloseSend()
					return
				}
				upErr <- err
				return
			}
			if err := cs.SendMsg(f); err != nil {
				// The next hop ended the call; its status arrives on RecvMsg below.
				upErr <- nil
				return
			}
		}
	}()

	hdr, err := cs.Header()
	if err == nil && hdr != nil {
		if err := srv.SendHeader(CleanMD(hdr)); err != nil {
			return err
		}
	}
	for {
		f := &Frame{}
		if err := cs.RecvMsg(f); err != nil {
			srv.SetTrailer(CleanMD(cs.Trailer()))
			if errors.Is(err, io.EOF) {
				// The next hop finished: its status is final. Collect the
				// request side's error if it is already known, but never
				// wait for a caller that has not half-closed.
				select {
				case uerr := <-upErr:
					if uerr != nil && !errors.Is(uerr, io.EOF) {
						return uerr
					}
				default:
				}
				return nil
			}
			return err
		}
		if err := srv.SendMsg(f); err != nil {
			return err
		}
	}
}

// ForwardUnary receives one request frame from srv, invokes method on conn
// (whose interceptors then apply: retries, timeouts) and passes the
// response, headers, trailers and status back unchanged.
func ForwardUnary(ctx context.Context, srv grpc.ServerStream, conn grpc.ClientConnInterface, method string) error {
	req := &Frame{}
	if err := srv.RecvMsg(req); err != nil {
		return err
	}
	resp := &Frame{}
	var hdr, trl metadata.MD
	err := conn.Invoke(ctx, method, req, resp, CallOption(), grpc.Header(&hdr), grpc.Trailer(&trl))
	if len(hdr) > 0 {
		if herr := srv.SendHeader(CleanMD(hdr)); herr != nil {
			return herr
		}
	}
	if trl != nil {
		srv.SetTrailer(CleanMD(trl))
	}
	if err != nil {
		return err
	}
	return srv.SendMsg(resp)
}
