package chain

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding/gzip"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/chaintest"
)

// TestFrontEndCompressedRequests: a gzip-compressed request is decompressed
// by the front end's server (csibroker registers gzip) and forwarded to
// the driver, whose answer comes back; uncompressed calls on the same
// connection are unaffected.
func TestFrontEndCompressedRequests(t *testing.T) {
	e, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	client := csi.NewControllerClient(chaintest.Dial(t, c.Front))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "gz"}, grpc.UseCompressor(gzip.Name))
	if err != nil || resp.GetVolume().GetVolumeId() != "id-gz" {
		t.Fatalf("compressed request: %v, %v", resp, err)
	}
	resp, err = client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "plain"})
	if err != nil || resp.GetVolume().GetVolumeId() != "id-plain" {
		t.Fatalf("plain request after a compressed one: %v, %v", resp, err)
	}
	if n := e.calls.Load(); n != 2 {
		t.Fatalf("the driver saw %d calls, want 2", n)
	}
}

// TestFrontEndBinaryMetadata: "-bin" metadata crosses the front end as
// bytes both ways (base64 on the wire of each hop, decoded in between), and
// text metadata with it.
func TestFrontEndBinaryMetadata(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	client := csi.NewControllerClient(chaintest.Dial(t, c.Front))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	raw := string([]byte{0, 1, 2, 0xfe, 0xff, ',', '='})
	ctx = metadata.AppendToOutgoingContext(ctx, "x-echo-md-bin", raw, "x-echo-md", "text value")
	var hdr, trl metadata.MD
	if _, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "md"}, grpc.Header(&hdr), grpc.Trailer(&trl)); err != nil {
		t.Fatal(err)
	}
	if got := hdr.Get("x-test-header"); len(got) != 1 || got[0] != "h-md" {
		t.Errorf("header x-test-header = %q", got)
	}
	if got := trl.Get("x-test-trailer"); len(got) != 1 || got[0] != "t-md" {
		t.Errorf("trailer x-test-trailer = %q", got)
	}
	if got := hdr.Get("x-echo-md-bin"); len(got) != 1 || got[0] != raw {
		t.Errorf("binary metadata came back as %q, want %q", got, raw)
	}
	if got := hdr.Get("x-echo-md"); len(got) != 1 || got[0] != "text value" {
		t.Errorf("text metadata came back as %q", got)
	}
}

// TestFrontEndDrainsOnStop: stopping the broker's front end lets a call in
// flight finish with its answer, and the socket then refuses new callers.
func TestFrontEndDrainsOnStop(t *testing.T) {
	echo, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	client := csi.NewControllerClient(chaintest.Dial(t, c.Front))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "warm"}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "slow", Parameters: map[string]string{"sleep-ms": "500"}})
		done <- err
	}()
	echo.waitCreateCalls(t, 2) // the slow call is at the driver
	stopped := make(chan struct{})
	go func() { c.Stop(); close(stopped) }()
	if err := <-done; err != nil {
		t.Fatalf("call in flight while the front end stopped: %v", err)
	}
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("the chain did not stop after its last call")
	}
	fresh := csi.NewControllerClient(chaintest.Dial(t, c.Front))
	cctx, ccancel := context.WithTimeout(context.Background(), time.Second)
	defer ccancel()
	if _, err := fresh.CreateVolume(cctx, &csi.CreateVolumeRequest{Name: "late"}); err == nil {
		t.Fatal("a call after the front end stopped succeeded")
	}
}

// TestUnknownMethodsShareOneMetricLabel: the front end forwards any /csi.*
// path, so a caller naming many methods no CSI service has must not add a
// metric series per name. They are counted under "_OTHER" (OpenTelemetry's
// label for an unrecognized method); CSI methods keep their names.
func TestUnknownMethodsShareOneMetricLabel(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	conn := chaintest.Dial(t, c.Front)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const n = 40
	for i := range n {
		method := fmt.Sprintf("/csi.v9.Future%d/Method%d", i, i)
		cs, err := conn.NewStream(ctx, &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}, method)
		if err != nil {
			t.Fatal(err)
		}
		// The driver may answer (Unimplemented) before the message is
		// sent: SendMsg then returns io.EOF and RecvMsg has the status.
		if err := cs.SendMsg(&emptypb.Empty{}); err != nil && !errors.Is(err, io.EOF) {
			t.Fatal(err)
		}
		cs.CloseSend()
		if err := cs.RecvMsg(&emptypb.Empty{}); status.Code(err) != codes.Unimplemented {
			t.Fatalf("%s: %v, want the driver's Unimplemented", method, err)
		}
	}
	if _, err := csi.NewIdentityClient(conn).Probe(ctx, &csi.ProbeRequest{}); err != nil {
		t.Fatal(err)
	}

	mfs, err := c.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	otherStarted, probeStarted := -1.0, -1.0
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if strings.Contains(l.GetValue(), "Future") || strings.Contains(l.GetValue(), "Method") {
					t.Errorf("%s has a series labelled %s=%q", mf.GetName(), l.GetName(), l.GetValue())
				}
			}
			if mf.GetName() != "grpc_server_started_total" {
				continue
			}
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			switch {
			case labels["grpc_service"] == "_OTHER" && labels["grpc_method"] == "_OTHER":
				otherStarted = m.GetCounter().GetValue()
			case labels["grpc_service"] == "csi.v1.Identity" && labels["grpc_method"] == "Probe":
				probeStarted = m.GetCounter().GetValue()
			}
		}
	}
	if otherStarted != n {
		t.Errorf("the proxy counted %v calls of unknown methods under _OTHER, want %d", otherStarted, n)
	}
	if probeStarted < 1 {
		t.Errorf("the proxy counted %v Probe calls under csi.v1.Identity/Probe, want at least 1", probeStarted)
	}
}

// TestFrontEndNodeNamedTwice: the node metadata key given twice is the
// caller's error (which node it meant is not for the broker to guess),
// for unary and streaming calls alike.
func TestFrontEndNodeNamedTwice(t *testing.T) {
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: startStreamDriver(t)})
	conn := chaintest.Dial(t, c.Front)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	twice := metadata.AppendToOutgoingContext(ctx, broker.MetadataNode, "node-a", broker.MetadataNode, "node-b")
	check := func(what string, err error) {
		t.Helper()
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), broker.MetadataNode) || !strings.Contains(err.Error(), "given 2 times") {
			t.Fatalf("%s with the node named twice: %v, want InvalidArgument naming %s", what, err, broker.MetadataNode)
		}
	}
	_, err := csi.NewControllerClient(conn).CreateVolume(twice, &csi.CreateVolumeRequest{Name: "twice"})
	check("CreateVolume", err)
	st, err := csi.NewSnapshotMetadataClient(conn).GetMetadataAllocated(twice, &csi.GetMetadataAllocatedRequest{SnapshotId: "s"})
	if err == nil {
		_, err = st.Recv()
	}
	check("GetMetadataAllocated", err)
	// Once is fine.
	once := metadata.AppendToOutgoingContext(ctx, broker.MetadataNode, "node-a")
	if _, err := csi.NewControllerClient(conn).CreateVolume(once, &csi.CreateVolumeRequest{Name: "once"}); err != nil {
		t.Fatalf("CreateVolume with the node named once: %v", err)
	}
}
