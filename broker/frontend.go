package broker

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	_ "github.com/container-storage-interface/spec/lib/go/csi" // registers the CSI services for routing and sanitized logging
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	_ "google.golang.org/grpc/encoding/gzip" // callers may compress: the front end's server decompresses
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/csibroker/csibroker/internal/grpcsrv"
	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/rawgrpc"
	"github.com/csibroker/csibroker/internal/telemetry"
)

// Request metadata a front-end caller may set.
const (
	// MetadataDriver names the driver on the shared TCP front end.
	MetadataDriver = "x-csibroker-driver"
	// MetadataNode names the node whose proxy serves a Node call (or a
	// node-local driver's controller call).
	MetadataNode = "x-csibroker-node"
)

// frontEnd serves CSI to ordinary CSI clients: a grpc-go server whose
// UnknownServiceHandler hands every call, undecoded, to the driver's client
// chain (timeout, retry, tracing, metrics, sanitized logging).
type frontEnd struct {
	b      *Broker
	driver string // fixed driver for a per-driver socket; empty: from metadata
	tcp    bool   // the shared mTLS TCP listener: callers are checked per call
	// kinds holds a methodKind per method path the protobuf registry
	// knows (the CSI spec registers its services); other paths, which a
	// caller may make up, are looked up on each call and streamed.
	kinds sync.Map
}

// methodKind is how a method streams.
type methodKind struct{ known, clientStreams, unary bool }

func (fe *frontEnd) kind(path string) methodKind {
	if v, ok := fe.kinds.Load(path); ok {
		return v.(methodKind)
	}
	known, cs, ss := rawgrpc.MethodKind(path)
	k := methodKind{known: known, clientStreams: cs, unary: known && !cs && !ss}
	if known {
		fe.kinds.Store(path, k)
	}
	return k
}

// serve runs the front end's grpc-go server on lis until ctx is done, then
// lets the calls in flight finish (for up to frontEndDrain) and stops.
func (fe *frontEnd) serve(ctx context.Context, lis net.Listener, creds credentials.TransportCredentials) error {
	b := fe.b
	opts := append(grpcsrv.ServerOptions(grpcsrv.Limits{MaxRecvMsgSize: b.opts.MaxMsgSize, MaxSendMsgSize: b.opts.MaxMsgSize}),
		grpc.ForceServerCodecV2(rawgrpc.Codec{}),
		grpc.UnknownServiceHandler(fe.handle),
		// The server span keeps a failed call's code, not the driver's message.
		grpc.StatsHandler(telemetry.CodeOnly(otelgrpc.NewServerHandler(otelgrpc.WithTracerProvider(b.opts.TracerProvider), otelgrpc.WithPropagators(b.opts.Propagator)))),
	)
	if creds != nil {
		opts = append(opts, grpc.Creds(creds), grpc.StatsHandler(grpcsrv.CallTracker()))
	}
	srv := grpc.NewServer(opts...)
	stop := context.AfterFunc(ctx, func() { stopGracefully(srv, frontEndDrain) })
	defer stop()
	if err := srv.Serve(lis); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return err
	}
	return nil
}

// FrontEndShare bounds the calls that front-end callers have in flight to
// one driver at once, over all their connections: half the proxy's
// default stream limit, so that callers of the front ends (slow calls,
// or calls that never finish) always leave room on the broker's
// connection to the proxy for the Kubernetes controllers. A call over
// the bound waits for a slot within its deadline.
const FrontEndShare = 128

// frontEndSlot takes one of driver's front-end call slots, waiting within
// ctx.
func (b *Broker) frontEndSlot(ctx context.Context, driver string) (release func(), err error) {
	v, ok := b.feSlots.Load(driver)
	if !ok {
		v, _ = b.feSlots.LoadOrStore(driver, grpcsrv.NewSlots(FrontEndShare, "csibroker: front ends of driver "+driver))
	}
	return v.(*grpcsrv.Slots).Take(ctx)
}

// frontEndDrain bounds how long a stopping front end waits for its calls.
const frontEndDrain = 10 * time.Second

// stopGracefully lets srv's calls in flight finish, for up to grace, then
// ends what is left.
func stopGracefully(srv *grpc.Server, grace time.Duration) {
	t := time.AfterFunc(grace, srv.Stop)
	srv.GracefulStop()
	t.Stop()
}

// callerID is the SPIFFE ID of a TCP front-end caller ("" if it showed none).
func callerID(ctx context.Context) string {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return ""
	}
	info, ok := p.AuthInfo.(grpcsrv.AuthInfo)
	if !ok || len(info.State.PeerCertificates) == 0 {
		return ""
	}
	id, _ := mtls.PeerID(info.State.PeerCertificates[0])
	return id
}

// handle forwards one call through the chain of the driver it routes to.
func (fe *frontEnd) handle(_ any, ss grpc.ServerStream) error {
	ctx := ss.Context()
	method, _ := grpc.MethodFromServerStream(ss)
	if fe.tcp {
		if err := grpcsrv.CheckPeer(ctx); err != nil {
			return err
		}
		if id := callerID(ctx); id != "" {
			trace.SpanFromContext(ctx).SetAttributes(attribute.String("csibroker.caller", id))
		}
	}
	md, _ := metadata.FromIncomingContext(ctx)
	pc, err := fe.route(method, md)
	if err != nil {
		return err
	}
	// The request first (every CSI method's client sends one message): a
	// call whose request never comes holds no slot and no stream to the
	// proxy.
	kind := fe.kind(method)
	if kind.known && !kind.clientStreams {
		if ss, err = rawgrpc.Prefetch(ss); err != nil {
			return err
		}
	}
	release, err := fe.b.frontEndSlot(ctx, pc.driver)
	if err != nil {
		return err
	}
	defer release()
	out := metadata.NewOutgoingContext(ctx, rawgrpc.ForwardedMetadata(md))
	if kind.unary {
		return forwardUnary(out, chainConn{pc}, method, ss)
	}
	cs, err := chainConn{pc}.NewStream(out, rawgrpc.StreamDesc, method)
	if err != nil {
		return err
	}
	return rawgrpc.Forward(ss, cs)
}

// forwardUnary calls method through conn with ss's request and answers
// ss with the result: headers, the message, trailers and status as the
// driver sent them.
func forwardUnary(ctx context.Context, conn chainConn, method string, ss grpc.ServerStream) error {
	req := &rawgrpc.Frame{}
	if err := ss.RecvMsg(req); errors.Is(err, io.EOF) {
		return status.Error(codes.Internal, "csibroker: the request holds no message")
	} else if err != nil {
		return err
	}
	var hdr, trl metadata.MD
	reply := &rawgrpc.Frame{}
	err := conn.Invoke(ctx, method, req, reply, grpc.Header(&hdr), grpc.Trailer(&trl))
	if len(hdr) > 0 {
		if herr := ss.SetHeader(hdr); herr != nil && err == nil {
			err = herr
		}
	}
	ss.SetTrailer(trl)
	if err != nil {
		return err
	}
	return ss.SendMsg(reply)
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
	// A socket someone answers on is another server's (a second broker
	// sharing the directory): not taken from it. One nobody answers on is
	// stale, left by a process that died.
	if nc, err := net.DialTimeout("unix", path, time.Second); err == nil {
		nc.Close()
		return fmt.Errorf("front end %s: another process serves this socket", path)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("front end %s: remove stale socket: %w", path, err)
	}
	lis, err := net.Listen("unix", path)
	if err != nil {
		return fmt.Errorf("front end for %s: %w", driver, err)
	}
	// On the way out the socket file is removed only if it is still ours:
	// another server may have replaced it since.
	lis.(*net.UnixListener).SetUnlinkOnClose(false)
	// Whoever may call the driver: the socket's owner and group, whatever
	// the process's umask.
	if err := os.Chmod(path, 0o660); err != nil {
		lis.Close()
		return fmt.Errorf("front end for %s: %w", driver, err)
	}
	ours, err := os.Stat(path)
	if err != nil {
		lis.Close()
		return fmt.Errorf("front end for %s: %w", driver, err)
	}
	defer func() {
		if now, err := os.Stat(path); err == nil && os.SameFile(now, ours) {
			os.Remove(path)
		}
	}()
	b.mu.Lock()
	b.sockets[driver] = path
	b.mu.Unlock()
	defer func() {
		b.mu.Lock()
		if b.sockets[driver] == path {
			delete(b.sockets, driver)
		}
		b.mu.Unlock()
	}()
	b.log.Info("CSI front end serving", "driver", driver, "socket", path)
	return (&frontEnd{b: b, driver: driver}).serve(ctx, grpcsrv.UnixListener(lis), nil)
}

// ServeSocketDir serves a front end <dir>/<driver>.sock for every
// registered driver until ctx is done, following the registry: a driver
// registered later (found by discovery, say) gets its socket then, and a
// removed driver's socket takes no new caller, lets the calls in flight
// finish (as on shutdown) and goes. No driver socket takes one of the
// reserved paths (the status socket's): such a driver is served none, and
// an error says so. A socket that fails is logged and tried again after a
// backoff (1 s, doubling up to a minute).
func (b *Broker) ServeSocketDir(ctx context.Context, dir string, reserved ...string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("front ends: %w", err)
	}
	abs := func(p string) string {
		if a, err := filepath.Abs(p); err == nil {
			return a
		}
		return filepath.Clean(p)
	}
	reserved = slices.Clone(reserved)
	for i, r := range reserved {
		reserved[i] = abs(r)
	}
	type socket struct {
		stop     context.CancelFunc
		stopping bool // its driver was removed: started again once it has stopped
	}
	serving := map[string]*socket{}
	exited := make(chan string)
	refused := map[string]bool{} // reserved paths, logged once
	for ctx.Err() == nil {
		changed := b.registryChanged() // before the names: no change is missed
		want := b.DriverNames()
		for name, s := range serving {
			if !s.stopping && !slices.Contains(want, name) {
				s.stop()
				s.stopping = true
			}
		}
		for _, name := range want {
			if serving[name] != nil {
				continue
			}
			path := filepath.Join(dir, name+".sock")
			if slices.Contains(reserved, abs(path)) {
				if !refused[name] {
					refused[name] = true
					b.log.Error("CSI front end: no socket for this driver: its path is reserved (set --status-socket to another path)", "driver", name, "socket", path)
				}
				continue
			}
			sctx, stop := context.WithCancel(ctx)
			serving[name] = &socket{stop: stop}
			go func() {
				b.serveSocketRetrying(sctx, name, path)
				stop()
				exited <- name
			}()
		}
		select {
		case <-changed:
		case name := <-exited:
			delete(serving, name)
		case <-ctx.Done():
		}
	}
	// Stopping: wait for the sockets still serving (their calls in flight
	// finish, as on shutdown) to go.
	for len(serving) > 0 {
		delete(serving, <-exited)
	}
	return nil
}

// serveSocketRetrying serves driver's front end at path until ctx is done
// (or the driver is gone): a socket that fails is logged and tried again
// after a backoff, 1 s doubling up to a minute, from 1 s again after one
// that served a minute.
func (b *Broker) serveSocketRetrying(ctx context.Context, driver, path string) {
	wait := time.Second
	for {
		started := time.Now()
		err := b.ServeSocket(ctx, driver, path)
		if ctx.Err() != nil || !b.HasDriver(driver) {
			return // stopped, or removed just before it started: no failure
		}
		if time.Since(started) > time.Minute {
			wait = time.Second
		}
		b.log.Error("CSI front end: socket failed; tried again after a backoff", "driver", driver, "socket", path, "retry_in", wait, "err", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, time.Minute)
	}
}

// ServeTCP serves the shared mTLS front end on lis: callers name the driver
// with the x-csibroker-driver metadata key.
func (b *Broker) ServeTCP(ctx context.Context, lis net.Listener, tlsCfg *tls.Config) error {
	if tlsCfg == nil {
		return errors.New("TCP front end: TLS is required")
	}
	b.log.Info("CSI TCP front end serving", "listen", lis.Addr().String())
	return (&frontEnd{b: b, tcp: true}).serve(ctx, lis, grpcsrv.Credentials(tlsCfg, b.log))
}

// onlyMD is the value of metadata key k ("" if absent); given more than
// once it is the caller's error (which one it meant is not for the broker
// to guess).
func onlyMD(md metadata.MD, k string) (string, error) {
	switch v := md.Get(k); len(v) {
	case 0:
		return "", nil
	case 1:
		return v[0], nil
	default:
		return "", status.Errorf(codes.InvalidArgument, "csibroker: the %s request metadata key is given %d times; give it once", k, len(v))
	}
}

// route picks the connection for a call from its method and the caller's
// metadata; its errors are the statuses the caller gets.
func (fe *frontEnd) route(method string, md metadata.MD) (*proxyConn, error) {
	if !strings.HasPrefix(method, "/csi.") {
		return nil, status.Errorf(codes.Unimplemented, "csibroker: %s is not a CSI method", method)
	}
	name := fe.driver
	if name == "" {
		var err error
		if name, err = onlyMD(md, MetadataDriver); err != nil {
			return nil, err
		}
		if name == "" {
			return nil, status.Errorf(codes.InvalidArgument, "csibroker: name the driver with the %s request metadata key", MetadataDriver)
		}
	}
	d, err := fe.b.Driver(name)
	if err != nil {
		// Unavailable, not NotFound: to a CSI caller NotFound says the
		// volume does not exist (an unpublish would be taken as done),
		// and a driver found by discovery may be registered again soon.
		return nil, status.Errorf(codes.Unavailable, "csibroker: %v", err)
	}
	node, err := onlyMD(md, MetadataNode)
	if err != nil {
		return nil, err
	}
	pc, err := d.route(method, node)
	if err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "csibroker: %v", err)
	}
	return pc, nil
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
	return chainConn{pc}, nil
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
		case d.cfg.NodeLocal && d.firstNode != nil:
			// A node-local driver's node plugins are its controllers:
			// any of them answers (capabilities, say). Any other driver
			// waits for its controller proxy (a controller pod
			// restarting): its node plugins know nothing of publications.
			return d.firstNode, nil
		}
		return nil, fmt.Errorf("driver %q: %w: %s needs a controller proxy (none is registered now)", d.name, ErrNoProxy, short)
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
