package telemetry

import (
	"context"

	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
)

// CodeOnly wraps a gRPC stats handler (OpenTelemetry's, which sets an
// ended call's span status from its error) so that it sees a failed
// call's status code and never its message: a driver's message may quote
// its request's secrets, and spans must not carry them. Everything else
// passes through unchanged.
func CodeOnly(h stats.Handler) stats.Handler { return codeOnly{h} }

type codeOnly struct{ stats.Handler }

func (h codeOnly) HandleRPC(ctx context.Context, rs stats.RPCStats) {
	if e, ok := rs.(*stats.End); ok && e.Error != nil {
		code := status.Code(e.Error)
		ended := *e
		ended.Error = status.Error(code, code.String())
		rs = &ended
	}
	h.Handler.HandleRPC(ctx, rs)
}
