package rawgrpc_test

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/csibroker/csibroker/internal/rawgrpc"
)

// A forwarding server: every method it does not serve itself goes, as
// frames, to the backend, whatever its kind.
func ExampleForward() {
	backend, err := grpc.NewClient("unix:///run/csi/csi.sock", grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		panic(err)
	}
	forward := func(_ any, in grpc.ServerStream) error {
		method, _ := grpc.MethodFromServerStream(in)
		ctx, cancel := context.WithCancel(in.Context()) // the caller's deadline and cancellation
		defer cancel()
		ctx, _ = rawgrpc.OutgoingContext(ctx) // the caller's metadata, less gRPC's own keys
		out, err := backend.NewStream(ctx, rawgrpc.StreamDesc, method, grpc.ForceCodecV2(rawgrpc.Codec{}))
		if err != nil {
			return err
		}
		return rawgrpc.Forward(in, out)
	}
	srv := grpc.NewServer(grpc.ForceServerCodecV2(rawgrpc.Codec{}), grpc.UnknownServiceHandler(forward))
	_ = srv // srv.Serve(listener)
}
