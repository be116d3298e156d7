//go:build grpc

package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"
)

// The gRPC layer: OpenTelemetry's OTLP/gRPC exporter (made, not used), and
// one call from a gRPC client to a gRPC server over a unix socket (an
// unknown method, answered Unimplemented): what the proxy links for its
// driver probe and for OTEL_EXPORTER_OTLP_PROTOCOL=grpc.
func init() {
	names = append(names, "grpc")
	layers = append(layers, func(_ *http.ServeMux, _ string) error {
		ctx := context.Background()
		if _, err := otlptracegrpc.New(ctx, otlptracegrpc.WithInsecure(), otlptracegrpc.WithEndpoint("127.0.0.1:1")); err != nil {
			return err
		}
		dir, err := os.MkdirTemp("", "floor-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		sock := filepath.Join(dir, "s")
		ln, err := net.Listen("unix", sock)
		if err != nil {
			return err
		}
		s := grpc.NewServer()
		go s.Serve(ln)
		defer s.Stop()
		cc, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return err
		}
		defer cc.Close()
		if err := cc.Invoke(ctx, "/csi.v1.Identity/Probe", &emptypb.Empty{}, &emptypb.Empty{}); status.Code(err) != codes.Unimplemented {
			return fmt.Errorf("gRPC call: want Unimplemented, got %v", err)
		}
		return nil
	})
}
