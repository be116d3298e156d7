package chain

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/chaintest"
)

// The proxy relays HTTP/2 frames with flow control of its own on each side.
// These tests drive the cases an ordinary small unary call never reaches.

// snapshotDriver streams GetMetadataAllocated answers of blocksPer blocks each.
type snapshotDriver struct {
	csi.UnimplementedSnapshotMetadataServer
	messages, blocksPer int
	sent                *atomic.Int64 // messages sent, over all streams
	ended               *atomic.Int64 // handlers returned
}

func (d *snapshotDriver) GetMetadataAllocated(req *csi.GetMetadataAllocatedRequest, srv csi.SnapshotMetadata_GetMetadataAllocatedServer) error {
	defer d.ended.Add(1)
	for i := 0; i < d.messages; i++ {
		blocks := make([]*csi.BlockMetadata, d.blocksPer)
		for j := range blocks {
			blocks[j] = &csi.BlockMetadata{ByteOffset: int64(i*d.blocksPer + j), SizeBytes: 4096}
		}
		if err := srv.Send(&csi.GetMetadataAllocatedResponse{BlockMetadata: blocks, VolumeCapacityBytes: int64(i)}); err != nil {
			return err
		}
		d.sent.Add(1)
	}
	return nil
}

// waitSendsBlocked waits until the driver's snapshot streams have sent
// fewer than 300 messages per stream (of streams opened) and sent nothing
// more for a while: what is left is held back by flow control on the way.
func waitSendsBlocked(t *testing.T, e *echoDriver, streams int) {
	t.Helper()
	last, still := int64(-1), 0
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		n := e.snapshotSent.Load()
		if n == last && n < int64(300*streams) {
			if still++; still == 6 {
				return
			}
			continue
		}
		last, still = n, 0
	}
	t.Fatalf("the driver's streams never stalled (%d messages sent): nothing is held back", e.snapshotSent.Load())
}

// serveDriver serves an echo driver (and the snapshot metadata service) on
// path with gRPC's default windows and the given options.
func serveDriver(t *testing.T, path string, opts ...grpc.ServerOption) (*echoDriver, *grpc.Server) {
	t.Helper()
	lis, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	e := &echoDriver{cancelled: make(chan struct{}, 16)}
	srv := grpc.NewServer(opts...)
	csi.RegisterIdentityServer(srv, e)
	csi.RegisterControllerServer(srv, e)
	csi.RegisterSnapshotMetadataServer(srv, &snapshotDriver{messages: 300, blocksPer: 2000, sent: &e.snapshotSent, ended: &e.snapshotEnded})
	go srv.Serve(lis)
	t.Cleanup(func() { srv.Stop(); os.Remove(path) })
	return e, srv
}

// TestRelayLargeMessagesAndStreams sends messages larger than every window
// on the way (the driver's 64 KiB default, the hops' 1 MiB per stream and
// 4 MiB per connection) both ways, several at once, and a server stream of
// about 7 MB read slowly, through front end → broker → proxy → driver.
func TestRelayLargeMessagesAndStreams(t *testing.T) {
	path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
	serveDriver(t, path)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: "unix://" + path})
	conn := chaintest.Dial(t, c.Front, grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20), grpc.MaxCallSendMsgSize(64<<20)))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			big := strings.Repeat(fmt.Sprintf("%x", i), 3<<20) // under the driver's 4 MiB limit
			resp, err := csi.NewControllerClient(conn).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: fmt.Sprint("big-", i),
				Parameters: map[string]string{"big": big, "reply-bytes": fmt.Sprint(3 << 19)}})
			if err != nil {
				errs <- err
				return
			}
			vc := resp.GetVolume().GetVolumeContext()
			if vc["big"] != big || len(vc["pad"]) != 3<<19 {
				errs <- fmt.Errorf("call %d: answer changed on the way (%d and %d bytes)", i, len(vc["big"]), len(vc["pad"]))
			}
		}()
	}

	stream, err := csi.NewSnapshotMetadataClient(conn).GetMetadataAllocated(ctx, &csi.GetMetadataAllocatedRequest{SnapshotId: "s"})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for {
		m, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("stream message %d: %v", n, err)
		}
		if m.GetVolumeCapacityBytes() != int64(n) || len(m.GetBlockMetadata()) != 2000 || m.GetBlockMetadata()[1999].GetByteOffset() != int64(n*2000+1999) {
			t.Fatalf("stream message %d changed on the way", n)
		}
		n++
		if n%50 == 0 {
			time.Sleep(50 * time.Millisecond) // a slow reader: the hops must hold back, not drop
		}
	}
	if n != 300 {
		t.Fatalf("%d stream messages, want 300", n)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestRelayDriverStreamLimit: a driver that allows 2 concurrent streams gets
// 16 concurrent calls from the broker; the proxy queues them, none fails.
func TestRelayDriverStreamLimit(t *testing.T) {
	path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
	echo, _ := serveDriver(t, path, grpc.MaxConcurrentStreams(2))
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: "unix://" + path})
	conn := brokerConn(t, c) // straight to the proxy: no broker retry hides a failure
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for i := 0; i < 16; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := csi.NewControllerClient(conn).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: fmt.Sprint("q-", i), Parameters: map[string]string{"sleep-ms": "50"}})
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	// 16 calls of 50 ms: never more than 2 at once at the driver.
	if most := echo.maxSleeping.Load(); most > 2 || most < 1 {
		t.Errorf("at most %d calls at once at the driver, want its limit of 2 respected", most)
	}
	if got := echo.calls.Load(); got != 16 {
		t.Errorf("driver saw %d calls, want 16", got)
	}
}

// TestRelayDriverStreamLimitOnAFreshConnection: a burst of calls on a new
// chain, whose proxy serves it on a new driver connection, waits for the
// driver's SETTINGS before opening streams, so the driver's stream limit
// is known: none of the calls is refused. Retries are off, so none is
// hidden; each round is a new chain.
func TestRelayDriverStreamLimitOnAFreshConnection(t *testing.T) {
	const rounds, calls = 4, 30
	for r := range rounds {
		path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
		echo, _ := serveDriver(t, path, grpc.MaxConcurrentStreams(3))
		c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: "unix://" + path, Retry: broker.RetryConfig{MaxAttempts: 1}})
		client := csi.NewControllerClient(chaintest.Dial(t, c.Front))
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		var wg sync.WaitGroup
		errs := make(chan error, calls)
		for i := range calls {
			wg.Go(func() {
				_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: fmt.Sprint("burst-", i), Parameters: map[string]string{"sleep-ms": "5"}})
				errs <- err
			})
		}
		wg.Wait()
		cancel()
		close(errs)
		var failed []string
		for err := range errs {
			if err != nil {
				failed = append(failed, err.Error())
			}
		}
		if len(failed) > 0 {
			t.Fatalf("round %d: %d of %d calls failed on a new driver connection, e.g. %s", r, len(failed), calls, failed[0])
		}
		if got := echo.calls.Load(); got != calls {
			t.Errorf("round %d: the driver saw %d calls, want %d", r, got, calls)
		}
	}
}

// TestRelayDriverGracefulRestart: a driver stopping gracefully (GOAWAY)
// finishes the call in flight, and the next call reaches the new driver
// process on the same socket.
func TestRelayDriverGracefulRestart(t *testing.T) {
	path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
	echo, srv := serveDriver(t, path)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: "unix://" + path})
	conn := brokerConn(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	client := csi.NewControllerClient(conn)
	if _, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "warm"}); err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() {
		_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "inflight", Parameters: map[string]string{"sleep-ms": "300"}})
		errc <- err
	}()
	echo.waitCreateCalls(t, 2) // the call is at the driver
	stopped := make(chan struct{})
	go func() { srv.GracefulStop(); close(stopped) }()
	if err := <-errc; err != nil {
		t.Fatalf("call in flight during a graceful stop: %v", err)
	}
	<-stopped
	os.Remove(path)
	echo2, _ := serveDriver(t, path)
	if _, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "after"}); err != nil {
		t.Fatalf("call to the restarted driver: %v", err)
	}
	if echo2.calls.Load() != 1 {
		t.Fatalf("the restarted driver saw %d calls, want 1", echo2.calls.Load())
	}
}

// TestRelayQueuedCallKeepsItsDeadline: a call the proxy queues behind the
// driver's stream limit ends at its caller's deadline, not when the slot
// frees. (grpc-go's client writes grpc-timeout when it opens the stream,
// so a queued call's driver may be told more time than is left; the
// proxy's call carries the caller's deadline and is reset when it passes,
// as any grpc-go client's is.)
func TestRelayQueuedCallKeepsItsDeadline(t *testing.T) {
	path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
	echo, _ := serveDriver(t, path, grpc.MaxConcurrentStreams(1))
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: "unix://" + path, Retry: broker.RetryConfig{MaxAttempts: 1}})
	conn := brokerConn(t, c)
	client := csi.NewControllerClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	first := make(chan error, 1)
	go func() {
		_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "holds-the-slot", Parameters: map[string]string{"sleep-ms": "3000", "quiet": "true"}})
		first <- err
	}()
	echo.waitCreateCalls(t, 1)
	queued, cancelQueued := context.WithTimeout(ctx, time.Second)
	defer cancelQueued()
	start := time.Now()
	_, err := client.CreateVolume(queued, &csi.CreateVolumeRequest{Name: "queued", Parameters: map[string]string{"quiet": "true"}})
	if took := time.Since(start); status.Code(err) != codes.DeadlineExceeded || took > 1500*time.Millisecond {
		t.Fatalf("the queued call ended after %v with %v; want DeadlineExceeded at its 1 s deadline", took, err)
	}
	if err := <-first; err != nil {
		t.Fatal(err)
	}
}
