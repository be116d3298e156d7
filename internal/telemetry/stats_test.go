package telemetry

import (
	"context"
	"errors"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
)

type recordStats struct {
	stats.Handler
	got []stats.RPCStats
}

func (r *recordStats) HandleRPC(_ context.Context, rs stats.RPCStats) { r.got = append(r.got, rs) }

func TestCodeOnlyDropsMessages(t *testing.T) {
	rec := &recordStats{}
	h := CodeOnly(rec)
	begin := &stats.Begin{}
	failed := &stats.End{Error: status.Error(codes.Internal, "bad key s3cr3t")}
	plain := &stats.End{Error: errors.New("transport closed s3cr3t")}
	ok := &stats.End{}
	for _, rs := range []stats.RPCStats{begin, failed, plain, ok} {
		h.HandleRPC(context.Background(), rs)
	}
	if rec.got[0] != begin || rec.got[3] != ok {
		t.Error("stats other than a failed End did not pass through unchanged")
	}
	for i, want := range []codes.Code{codes.Internal, codes.Unknown} {
		e := rec.got[i+1].(*stats.End)
		if st := status.Convert(e.Error); st.Code() != want || st.Message() != want.String() {
			t.Errorf("End %d: status %v %q, want %v with its name only", i, st.Code(), st.Message(), want)
		}
	}
	if failed.Error == nil || status.Convert(failed.Error).Message() != "bad key s3cr3t" {
		t.Error("the caller's End was modified")
	}
}
