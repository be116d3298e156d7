package chain

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/chaintest"
)

// TestPassthroughFidelity sends a call for every gRPC status code through
// front end → broker → proxy → driver, and through the broker's client as
// the Kubernetes controllers call it (broker → proxy → driver), and checks
// that code, message, details, headers and trailers come back exactly as
// the driver sent them.
func TestPassthroughFidelity(t *testing.T) {
	echo, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: "echo.csi.test", DriverEndpoint: ep,
		Retry: broker.RetryConfig{MaxAttempts: 3, IntervalStart: time.Millisecond, IntervalMax: 5 * time.Millisecond}})
	d, err := c.Broker.Driver("echo.csi.test")
	if err != nil {
		t.Fatal(err)
	}
	bconn, err := d.Controller()
	if err != nil {
		t.Fatal(err)
	}
	for _, via := range []struct {
		name   string
		client csi.ControllerClient
	}{{"front-end", csi.NewControllerClient(chaintest.Dial(t, c.Front))}, {"broker-client", csi.NewControllerClient(bconn)}} {
		t.Run(via.name, func(t *testing.T) { fidelity(t, echo, via.client) })
	}
}

func fidelity(t *testing.T, echo *echoDriver, client csi.ControllerClient) {
	for code := codes.OK; code <= codes.Unauthenticated; code++ {
		t.Run(code.String(), func(t *testing.T) {
			name := "vol-" + strconv.Itoa(int(code))
			before := echo.calls.Load()
			var hdr, trl metadata.MD
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			ctx = metadata.AppendToOutgoingContext(ctx, "x-caller", "c-"+name)
			resp, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, Parameters: map[string]string{"code": strconv.Itoa(int(code))}},
				grpc.Header(&hdr), grpc.Trailer(&trl))
			if got := hdr.Get("x-test-header"); len(got) != 1 || got[0] != "h-"+name {
				t.Errorf("header x-test-header = %v", got)
			}
			if got := trl.Get("x-test-trailer"); len(got) != 1 || got[0] != "t-"+name {
				t.Errorf("trailer x-test-trailer = %v", got)
			}
			echo.mu.Lock()
			gotMD := echo.lastMD.Get("x-caller")
			echo.mu.Unlock()
			if len(gotMD) != 1 || gotMD[0] != "c-"+name {
				t.Errorf("driver saw request metadata x-caller = %v", gotMD)
			}
			calls := echo.calls.Load() - before
			if code == codes.OK {
				if err != nil {
					t.Fatalf("err = %v", err)
				}
				if resp.GetVolume().GetVolumeId() != "id-"+name || resp.GetVolume().GetCapacityBytes() != 42 || resp.GetVolume().GetVolumeContext()["echo"] != "yes" {
					t.Fatalf("response changed on the way: %v", resp)
				}
				if calls != 1 {
					t.Fatalf("driver called %d times", calls)
				}
				return
			}
			st, ok := status.FromError(err)
			if !ok {
				t.Fatalf("not a status: %v", err)
			}
			if st.Code() != code {
				t.Fatalf("code = %s, want %s (message %q)", st.Code(), code, st.Message())
			}
			if want := "driver says " + code.String() + " for " + name; st.Message() != want {
				t.Fatalf("message = %q, want %q", st.Message(), want)
			}
			det := st.Details()
			if len(det) != 1 {
				t.Fatalf("details = %v", det)
			}
			want := &errdetails.ErrorInfo{Reason: "REASON_" + strconv.Itoa(int(code)), Domain: "echo.csi.test", Metadata: map[string]string{"k": "v"}}
			if ei, ok := det[0].(*errdetails.ErrorInfo); !ok || !proto.Equal(ei, want) {
				t.Fatalf("details = %v, want %v", det[0], want)
			}
			// Only Unavailable is retried, and within the budget.
			wantCalls := int64(1)
			if code == codes.Unavailable {
				wantCalls = 3
			}
			if calls != wantCalls {
				t.Fatalf("driver called %d times, want %d", calls, wantCalls)
			}
		})
	}
}

func TestDeadlineAndCancellationPropagate(t *testing.T) {
	echo, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: "echo.csi.test", DriverEndpoint: ep})
	client := csi.NewControllerClient(chaintest.Dial(t, c.Front))

	t.Run("deadline", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
		defer cancel()
		if _, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "d"}); err != nil {
			t.Fatal(err)
		}
		echo.mu.Lock()
		left := echo.deadline
		echo.mu.Unlock()
		if left <= 0 || left > 1500*time.Millisecond {
			t.Fatalf("driver saw %v left of a 1.5s deadline", left)
		}
	})
	t.Run("deadline exceeded", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "w", Parameters: map[string]string{"wait": "true"}})
		if status.Code(err) != codes.DeadlineExceeded {
			t.Fatalf("err = %v", err)
		}
		select {
		case <-echo.cancelled:
		case <-time.After(5 * time.Second):
			t.Fatal("the driver's call never saw its deadline pass")
		}
	})
	t.Run("cancel", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		errc := make(chan error, 1)
		go func() {
			_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "c", Parameters: map[string]string{"wait": "true"}})
			errc <- err
		}()
		// Wait until the call reached the driver, then cancel it at the caller.
		deadline := time.Now().Add(5 * time.Second)
		start := echo.calls.Load()
		for echo.calls.Load() == start && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		cancel()
		select {
		case <-echo.cancelled:
		case <-time.After(5 * time.Second):
			t.Fatal("cancellation did not reach the driver")
		}
		if err := <-errc; status.Code(err) != codes.Canceled && !errors.Is(err, context.Canceled) {
			t.Fatalf("err = %v", err)
		}
	})
}

// TestUndefinedStatusCodes: a driver may answer with a grpc-status gRPC
// does not define. The number passes through unchanged, but in the broker's
// and the proxy's metrics every such code is one label value, "_OTHER", so
// a driver cannot make new series without bound.
func TestUndefinedStatusCodes(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: "echo.csi.test", DriverEndpoint: ep})
	client := csi.NewControllerClient(chaintest.Dial(t, c.Front))
	for _, n := range []int{17, 1000, 1001} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "odd-" + strconv.Itoa(n), Parameters: map[string]string{"code": strconv.Itoa(n)}})
		cancel()
		if got := status.Code(err); got != codes.Code(n) {
			t.Fatalf("code %d came back as %d (%v)", n, got, err)
		}
	}
	mfs, err := c.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]map[string]bool{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "code" || l.GetName() == "grpc_status_code" || l.GetName() == "grpc_code" {
					if seen[mf.GetName()] == nil {
						seen[mf.GetName()] = map[string]bool{}
					}
					seen[mf.GetName()][l.GetValue()] = true
				}
			}
		}
	}
	for _, name := range []string{"csi_sidecar_operations_seconds", "csibroker_csi_call_duration_seconds"} {
		if !seen[name]["_OTHER"] {
			t.Errorf("%s: code labels %v, want _OTHER for the undefined codes", name, seen[name])
		}
	}
	for name, values := range seen {
		for v := range values {
			if strings.HasPrefix(v, "Code(") {
				t.Errorf("%s has a series for code label %q", name, v)
			}
		}
	}
}
