package chain

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/csibroker/csibroker/internal/chaintest"
)

// echoDriver is a real CSI gRPC server on a unix socket whose CreateVolume
// does what the request's parameters say: fail with a given code, message and
// details, set headers and trailers, or wait until its context ends. It makes
// passthrough fidelity observable end to end.
type echoDriver struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer

	calls     atomic.Int64
	version   atomic.Pointer[string] // GetPluginInfo's vendor version ("1" if nil)
	mu        sync.Mutex
	lastMD    metadata.MD
	deadline  time.Duration // remaining time seen by the last call, 0 if none
	cancelled chan struct{} // receives when a waiting call sees its context end
	// snapshotSent counts the messages of the snapshot metadata streams
	// (serveDriver's snapshotDriver) sent so far.
	snapshotSent atomic.Int64
	// snapshotEnded counts the snapshot metadata streams whose handler
	// has returned.
	snapshotEnded atomic.Int64
	// sleeping and maxSleeping: calls in their sleep-ms now, and the most
	// at once.
	sleeping, maxSleeping atomic.Int64
	// seen counts the CreateVolume calls per volume name (first-code).
	seen map[string]int
}

func (e *echoDriver) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	v := "1"
	if p := e.version.Load(); p != nil {
		v = *p
	}
	return &csi.GetPluginInfoResponse{Name: "echo.csi.test", VendorVersion: v}, nil
}

// waitCreateCalls waits until the driver has received n CreateVolume calls.
func (e *echoDriver) waitCreateCalls(t *testing.T, n int64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for e.calls.Load() < n {
		if time.Now().After(deadline) {
			t.Fatalf("the driver received %d CreateVolume calls, want %d", e.calls.Load(), n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (e *echoDriver) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{}, nil
}

func (e *echoDriver) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	e.calls.Add(1)
	md, _ := metadata.FromIncomingContext(ctx)
	e.mu.Lock()
	e.lastMD = md
	if dl, ok := ctx.Deadline(); ok {
		e.deadline = time.Until(dl)
	} else {
		e.deadline = 0
	}
	e.mu.Unlock()
	p := req.GetParameters()
	if p["quiet"] != "true" { // no metadata naming the volume
		grpc.SetHeader(ctx, metadata.Pairs("x-test-header", "h-"+req.GetName()))
		grpc.SetTrailer(ctx, metadata.Pairs("x-test-trailer", "t-"+req.GetName()))
	}
	// Request metadata named x-echo-md* comes back in the response headers.
	if in, ok := metadata.FromIncomingContext(ctx); ok {
		for k, v := range in {
			if strings.HasPrefix(k, "x-echo-md") {
				grpc.SetHeader(ctx, metadata.MD{k: v})
			}
		}
	}
	switch pw := req.GetSecrets()["password"]; p["echo-secret"] {
	case "true":
		// A careless driver quoting its credentials in an error.
		return nil, status.Errorf(codes.PermissionDenied, "login refused for password %q", pw)
	case "json":
		j, _ := json.Marshal(map[string]string{"password": pw})
		return nil, status.Errorf(codes.PermissionDenied, "login refused: %s", j)
	case "url":
		return nil, status.Errorf(codes.PermissionDenied, "GET https://array.example/login?user=admin&password=%s: 401", url.QueryEscape(pw))
	case "base64":
		return nil, status.Errorf(codes.PermissionDenied, "login refused; Authorization: Bearer %s", base64.StdEncoding.EncodeToString([]byte(pw)))
	case "hex":
		return nil, status.Errorf(codes.PermissionDenied, "login refused for key 0x%x", pw)
	case "details-url":
		st, _ := status.New(codes.PermissionDenied, "login refused").WithDetails(
			&errdetails.ErrorInfo{Reason: "LOGIN", Domain: "echo.csi.test", Metadata: map[string]string{"request": "https://array.example/login?password=" + url.QueryEscape(pw)}},
			&errdetails.ErrorInfo{Reason: "HINT", Domain: "echo.csi.test"})
		return nil, st.Err()
	case "details":
		st, _ := status.New(codes.PermissionDenied, "login refused").WithDetails(
			&errdetails.ErrorInfo{Reason: "LOGIN", Domain: "echo.csi.test", Metadata: map[string]string{"tried": pw}},
			&errdetails.ErrorInfo{Reason: "HINT", Domain: "echo.csi.test"})
		return nil, st.Err()
	}
	if ms, err := strconv.Atoi(p["sleep-ms"]); err == nil {
		n := e.sleeping.Add(1)
		for m := e.maxSleeping.Load(); n > m && !e.maxSleeping.CompareAndSwap(m, n); m = e.maxSleeping.Load() {
		}
		time.Sleep(time.Duration(ms) * time.Millisecond)
		e.sleeping.Add(-1)
	}
	if n, err := strconv.Atoi(p["reply-bytes"]); err == nil {
		// A large answer that repeats the request's own large parameter.
		return &csi.CreateVolumeResponse{Volume: &csi.Volume{VolumeId: "id-" + req.GetName(),
			VolumeContext: map[string]string{"big": p["big"], "pad": strings.Repeat("r", n)}}}, nil
	}
	if p["wait"] == "true" {
		<-ctx.Done()
		e.cancelled <- struct{}{}
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	c, ok := p["code"]
	if fc, has := p["first-code"]; has {
		// The first call for this name fails with first-code, later ones
		// as code says.
		e.mu.Lock()
		if e.seen == nil {
			e.seen = map[string]int{}
		}
		e.seen[req.GetName()]++
		if e.seen[req.GetName()] == 1 {
			c, ok = fc, true
		}
		e.mu.Unlock()
	}
	if ok {
		n, _ := strconv.Atoi(c)
		if n != 0 {
			st, err := status.New(codes.Code(n), "driver says "+codes.Code(n).String()+" for "+req.GetName()).
				WithDetails(&errdetails.ErrorInfo{Reason: "REASON_" + c, Domain: "echo.csi.test", Metadata: map[string]string{"k": "v"}})
			if err != nil {
				return nil, err
			}
			return nil, st.Err()
		}
	}
	return &csi.CreateVolumeResponse{Volume: &csi.Volume{VolumeId: "id-" + req.GetName(), CapacityBytes: 42, VolumeContext: map[string]string{"echo": "yes"}}}, nil
}

// startEcho serves an echoDriver on a temp unix socket.
func startEcho(t testing.TB) (*echoDriver, string) {
	t.Helper()
	dir := chaintest.ShortTempDir(t)
	path := filepath.Join(dir, "echo.sock")
	lis, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	e := &echoDriver{cancelled: make(chan struct{}, 16)}
	srv := grpc.NewServer()
	csi.RegisterIdentityServer(srv, e)
	csi.RegisterControllerServer(srv, e)
	go srv.Serve(lis)
	t.Cleanup(func() { srv.Stop(); os.Remove(path) })
	return e, "unix://" + path
}
