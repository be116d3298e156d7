package broker

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	_ "github.com/container-storage-interface/spec/lib/go/csi" // registers the CSI services for routing and sanitized logging
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/csibroker/csibroker/internal/rawgrpc"
)

// Request metadata a front-end caller may set.
const (
	// MetadataDriver names the driver on the shared TCP front end.
	MetadataDriver = "x-csibroker-driver"
	// MetadataNode names the node whose proxy serves a Node call (or a
	// node-local driver's controller call).
	MetadataNode = "x-csibroker-node"
)

// frontEnd serves CSI to ordinary CSI clients and forwards every call, as raw
// frames, through the driver's client chain.
type frontEnd struct {
	b      *Broker
	driver string // fixed driver for a per-driver socket; empty: from metadata
}

func (b *Broker) newFrontEndServer(fe *frontEnd, extra ...grpc.ServerOption) *grpc.Server {
	opts := append([]grpc.ServerOption{
		rawgrpc.ServerOption(),
		grpc.UnknownServiceHandler(fe.handle),
		grpc.StatsHandler(otelgrpc.NewServerHandler(otelgrpc.WithTracerProvider(b.opts.TracerProvider), otelgrpc.WithPropagators(b.opts.Propagator))),
		grpc.MaxRecvMsgSize(b.opts.MaxMsgSize),
		grpc.MaxSendMsgSize(b.opts.MaxMsgSize),
		grpc.NumStreamWorkers(uint32(32 * runtime.GOMAXPROCS(0))),
	}, rawgrpc.ServerTransportOptions()...)
	opts = append(opts, extra...)
	return grpc.NewServer(opts...)
}

// ServeSocket serves driver's CSI front end on a unix socket at path until
// ctx is done. Any CSI client (csc, csi-sanity, a sidecar) can use it as if it
// were the driver's own socket.
func (b *Broker) ServeSocket(ctx context.Context, driver, path string) error {
	if _, err := b.Driver(driver); err != nil {
		return fmt.Errorf("front end %s: %w", path, err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("front end %s: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("front end %s: remove stale socket: %w", path, err)
	}
	lis, err := net.Listen("unix", path)
	if err != nil {
		return fmt.Errorf("front end for %s: %w", driver, err)
	}
	defer os.Remove(path)
	srv := b.newFrontEndServer(&frontEnd{b: b, driver: driver})
	b.log.Info("CSI front end serving", "driver", driver, "socket", path)
	return serveUntil(ctx, srv, lis)
}

// ServeTCP serves the shared mTLS front end on lis: callers name the driver
// with the x-csibroker-driver metadata key.
func (b *Broker) ServeTCP(ctx context.Context, lis net.Listener, tlsCfg *tls.Config) error {
	if tlsCfg == nil {
		return errors.New("TCP front end: TLS is required")
	}
	srv := b.newFrontEndServer(&frontEnd{b: b}, grpc.Creds(credentials.NewTLS(tlsCfg)))
	b.log.Info("CSI TCP front end serving", "listen", lis.Addr().String())
	return serveUntil(ctx, srv, lis)
}

func serveUntil(ctx context.Context, srv *grpc.Server, lis net.Listener) error {
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(lis) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	done := make(chan struct{})
	go func() { srv.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		srv.Stop()
	}
	return nil
}

func firstMD(md metadata.MD, k string) string {
	if v := md.Get(k); len(v) > 0 {
		return v[0]
	}
	return ""
}

func (fe *frontEnd) handle(_ any, srv grpc.ServerStream) error {
	method, ok := grpc.MethodFromServerStream(srv)
	if !ok {
		return status.Error(codes.Internal, "csibroker: no method in stream")
	}
	if !strings.HasPrefix(method, "/csi.") {
		return status.Errorf(codes.Unimplemented, "csibroker: %s is not a CSI method", method)
	}
	md, _ := metadata.FromIncomingContext(srv.Context())
	name := fe.driver
	if name == "" {
		name = firstMD(md, MetadataDriver)
		if name == "" {
			return status.Errorf(codes.InvalidArgument, "csibroker: name the driver with the %s request metadata key", MetadataDriver)
		}
	}
	d, err := fe.b.Driver(name)
	if err != nil {
		return status.Errorf(codes.NotFound, "csibroker: %v", err)
	}
	conn, err := d.Route(method, firstMD(md, MetadataNode))
	if err != nil {
		return status.Errorf(codes.FailedPrecondition, "csibroker: %v", err)
	}
	ctx := rawgrpc.OutgoingContext(srv.Context())
	if known, cs, ss := rawgrpc.MethodKind(method); known && !cs && !ss {
		return rawgrpc.ForwardUnary(ctx, srv, conn, method)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	cs, err := conn.NewStream(ctx, rawgrpc.StreamDesc, method, rawgrpc.CallOption())
	if err != nil {
		return err
	}
	return rawgrpc.ForwardStream(srv, cs)
}

// Route picks the proxy connection for a CSI method. Node-service calls go to
// the named node's proxy; with no node named, to the only node proxy, or to the
// controller proxy when the driver serves both from one process. Node-local
// drivers send CreateVolume, DeleteVolume and GetCapacity to the named node.
// Everything else goes to the controller proxy.
func (d *Driver) Route(method, node string) (grpc.ClientConnInterface, error) {
	pc, err := d.route(method, node)
	if err != nil {
		return nil, err
	}
	return pc.conn, nil
}

func (d *Driver) route(method, node string) (*proxyConn, error) {
	service := strings.TrimPrefix(method, "/")
	if i := strings.IndexByte(service, '/'); i >= 0 {
		service = service[:i]
	}
	short := shortMethod(method)
	nodeCall := strings.HasSuffix(service, ".Node")
	if d.cfg.NodeLocal && (short == "CreateVolume" || short == "DeleteVolume" || short == "GetCapacity") {
		nodeCall = true
	}
	byNode := func() (*proxyConn, error) {
		if pc := d.nodes[node]; pc != nil {
			return pc, nil
		}
		return nil, fmt.Errorf("driver %q: %w: no node proxy registered for node %q", d.name, ErrNoProxy, node)
	}
	if !nodeCall {
		switch {
		case d.controller != nil:
			return d.controller, nil
		case node != "":
			return byNode()
		case len(d.nodes) == 1:
			for _, pc := range d.nodes {
				return pc, nil
			}
		}
		return nil, fmt.Errorf("driver %q: %w: %s needs a controller proxy", d.name, ErrNoProxy, short)
	}
	if node != "" {
		return byNode()
	}
	switch {
	case len(d.nodes) == 1:
		for _, pc := range d.nodes {
			return pc, nil
		}
	case len(d.nodes) == 0 && d.controller != nil:
		return d.controller, nil
	}
	return nil, fmt.Errorf("driver %q: %w: %s must name one of nodes %v with the %s metadata key", d.name, ErrNoProxy, short, d.Nodes(), MetadataNode)
}
