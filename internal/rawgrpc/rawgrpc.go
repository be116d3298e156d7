// Package rawgrpc carries gRPC calls on grpc-go without decoding their
// messages: a codec whose frames are a message's bytes (Codec, Frame), a
// stream descriptor for any kind of call (StreamDesc), Forward, which
// relays one call a grpc-go server received to a grpc-go client stream,
// the metadata a forwarded call carries on (ForwardedMetadata), the method
// kinds from the protobuf registry, and bounded metric labels.
//
// The proxy forwards every CSI call with it, and so does the broker's front
// end, so services added to the spec later pass through unchanged.
//
// It must not speak HTTP/2 itself: grpc-go's transport does.
package rawgrpc

import (
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/proto" // registers the proto codec used for non-frame messages
	"google.golang.org/grpc/mem"
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

// reserved metadata keys are set by gRPC itself or by our own interceptors and
// are never copied from one hop to the next.
func reserved(k string) bool {
	switch k {
	case ":authority", "content-type", "user-agent", "te", "traceparent", "tracestate", "baggage":
		return true
	}
	return strings.HasPrefix(k, "grpc-") || strings.HasPrefix(k, ":")
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

// OtherMethod is the metric label of every method MethodKind does not know,
// as OpenTelemetry's RPC conventions name an unrecognized method: a caller
// may name any path, and a label per path would let it add series without
// bound.
const OtherMethod = "_OTHER"

// MetricMethod is fullMethod as a metric label: itself if the protobuf
// registry knows it, else OtherMethod.
func MetricMethod(fullMethod string) string {
	if known, _, _ := MethodKind(fullMethod); known && strings.HasPrefix(fullMethod, "/") {
		return fullMethod
	}
	return OtherMethod
}

// StreamDesc is the descriptor for opening a client stream of any kind.
var StreamDesc = &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}

// CodeLabel names a status code for a metric label. gRPC defines codes 0 to
// 16; a peer may send any number in grpc-status, and each new number would
// otherwise make new series: every other code is "_OTHER".
func CodeLabel(c codes.Code) string {
	if c > codes.Unauthenticated {
		return "_OTHER"
	}
	return c.String()
}
