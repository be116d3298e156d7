package chain

// Flow-control cases of the proxy's relay found in review; each failed
// before the relay credited connection windows on receipt.

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csibroker/csibroker/internal/chaintest"
)

// Windows are never lost. The driver rejects >4 MiB requests early
// (ResourceExhausted + RST) while the proxy still holds the broker's DATA
// queued for it: later calls on the same connection still go through.
func TestRelayEarlyAnswerToLargeRequests(t *testing.T) {
	path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
	serveDriver(t, path)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: "unix://" + path})
	conn := brokerConn(t, c)
	client := csi.NewControllerClient(conn)
	big := strings.Repeat("x", 5<<20)
	for i := 0; i < 8; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "big", Parameters: map[string]string{"big": big}}, grpc.MaxCallSendMsgSize(64<<20))
		cancel()
		// The driver's own refusal (gRPC's 4 MiB default), not the
		// proxy's: the early answer is what the case is about.
		if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "vs. 4194304)") {
			t.Fatalf("oversized call %d: %v; want the driver's ResourceExhausted", i, err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "small"}); err != nil {
		t.Fatalf("small call after early-answered large requests: %v", err)
	}
}

// Server streams cancelled by the caller while the proxy holds response
// DATA for them: the driver connection's window is not lost with them.
func TestRelayCancelledStreamsFreeTheirWindows(t *testing.T) {
	path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
	echo, _ := serveDriver(t, path)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: "unix://" + path})
	conn := brokerConn(t, c)
	for i := 0; i < 4; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		st, err := csi.NewSnapshotMetadataClient(conn).GetMetadataAllocated(ctx, &csi.GetMetadataAllocatedRequest{SnapshotId: "s"})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Recv(); err != nil {
			t.Fatalf("stream %d: first message: %v", i, err)
		}
		t.Logf("stream %d: first message received", i)
		waitSendsBlocked(t, echo, i+1) // the proxy holds what the broker's window refuses
		cancel()
	}
	// The cancellations reached the driver: each stream's handler ended.
	deadline := time.Now().Add(10 * time.Second)
	for echo.snapshotEnded.Load() < 4 {
		if time.Now().After(deadline) {
			t.Fatalf("%d of 4 cancelled streams ended at the driver", echo.snapshotEnded.Load())
		}
		time.Sleep(5 * time.Millisecond)
	}
	// A second, fresh broker connection.
	conn2 := brokerConn(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := csi.NewControllerClient(conn2).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "small"}); err != nil {
		t.Fatalf("unary call after cancelled streams: %v", err)
	}
}

// The driver answers a call before reading its (large) request, as a stream
// interceptor rejecting a call does: the broker connection keeps working.
func TestRelayEarlyAnswerToLargeStreams(t *testing.T) {
	path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
	serveDriver(t, path, grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		if strings.Contains(info.FullMethod, "GetMetadataAllocated") {
			time.Sleep(200 * time.Millisecond)
			return status.Error(codes.PermissionDenied, "rejected before reading")
		}
		return h(srv, ss)
	}))
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: "unix://" + path})
	conn := brokerConn(t, c)
	big := strings.Repeat("x", 3<<20)
	for i := 0; i < 5; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		st, err := csi.NewSnapshotMetadataClient(conn).GetMetadataAllocated(ctx, &csi.GetMetadataAllocatedRequest{SnapshotId: big}, grpc.MaxCallSendMsgSize(64<<20))
		if err == nil {
			_, err = st.Recv()
		}
		cancel()
		if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "rejected before reading") {
			t.Fatalf("early-answered call %d: %v; want the driver's refusal", i, err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := csi.NewControllerClient(conn).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "small"}); err != nil {
		t.Fatalf("small call on the same broker connection: %v", err)
	}
}

// Four live server streams whose caller reads slowly must not hold back an
// unrelated call.
func TestRelaySlowReaderBlocksNoOtherCall(t *testing.T) {
	path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
	echo, _ := serveDriver(t, path)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: "unix://" + path})
	conn := brokerConn(t, c)
	ctx0, cancel0 := context.WithCancel(context.Background())
	defer cancel0()
	for i := 0; i < 4; i++ {
		st, err := csi.NewSnapshotMetadataClient(conn).GetMetadataAllocated(ctx0, &csi.GetMetadataAllocatedRequest{SnapshotId: "s"})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Recv(); err != nil {
			t.Fatal(err)
		}
	}
	waitSendsBlocked(t, echo, 4) // every window on the way is full
	conn2 := brokerConn(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := csi.NewControllerClient(conn2).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "small"}); err != nil {
		t.Fatalf("unary call while 4 streams are read slowly: %v", err)
	}
}

// The driver allows one stream; six concurrent 3 MiB requests: the calls
// queued behind the limit must not use up the window the call holding the
// driver's only slot needs for the rest of its request.
func TestRelayQueuedLargeRequests(t *testing.T) {
	path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
	serveDriver(t, path, grpc.MaxConcurrentStreams(1))
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: "unix://" + path})
	conn := brokerConn(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := csi.NewControllerClient(conn).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "warm"}); err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 6)
	for i := 0; i < 6; i++ {
		go func() {
			big := strings.Repeat("y", 3<<20)
			_, err := csi.NewControllerClient(conn).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "w", Parameters: map[string]string{"big": big}}, grpc.MaxCallSendMsgSize(64<<20))
			errs <- err
		}()
	}
	for i := 0; i < 6; i++ {
		if err := <-errs; err != nil {
			t.Errorf("call: %v", err)
		}
	}
	ctx2, cancel2 := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel2()
	if _, err := csi.NewControllerClient(conn).CreateVolume(ctx2, &csi.CreateVolumeRequest{Name: "after"}); err != nil {
		t.Errorf("small call afterwards on the same broker connection: %v", err)
	}
}
