package chain

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/chaintest"
)

// TestPerMethodTimeout: a driver's registry entry bounds CreateVolume with its
// own timeout even when the caller sets none, and other methods keep the
// driver's default.
func TestPerMethodTimeout(t *testing.T) {
	echo, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, Timeout: time.Minute,
		MethodTimeouts: map[string]time.Duration{"CreateVolume": 300 * time.Millisecond}})
	client := csi.NewControllerClient(chaintest.Dial(t, c.Front))
	start := time.Now()
	_, err := client.CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: "slow", Parameters: map[string]string{"wait": "true"}})
	took := time.Since(start)
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("err = %v", err)
	}
	if took < 300*time.Millisecond {
		t.Fatalf("call took %v with a 300ms method timeout", took)
	}
	select {
	case <-echo.cancelled:
	case <-time.After(5 * time.Second):
		t.Fatal("the driver never saw the timeout")
	}
	echo.mu.Lock()
	seen := echo.deadline
	echo.mu.Unlock()
	if seen <= 0 || seen > 300*time.Millisecond {
		t.Fatalf("driver saw deadline %v, want ≤300ms", seen)
	}
}

// TestRetriesStayInsideCallerDeadline: a driver that is always Unavailable,
// a generous retry budget, and a caller with 400ms: the call ends by the
// caller's deadline, not after the budget.
func TestRetriesStayInsideCallerDeadline(t *testing.T) {
	echo, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep,
		Retry: broker.RetryConfig{MaxAttempts: 100, IntervalStart: 100 * time.Millisecond, IntervalMax: 100 * time.Millisecond}})
	client := csi.NewControllerClient(chaintest.Dial(t, c.Front))
	ctx, cancel := context.WithTimeout(context.Background(), 400*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "u", Parameters: map[string]string{"code": "14"}})
	took := time.Since(start)
	if c := status.Code(err); c != codes.DeadlineExceeded && c != codes.Unavailable {
		t.Fatalf("err = %v", err)
	}
	if took > 2*time.Second {
		t.Fatalf("call took %v with a 400ms deadline", took)
	}
	if n := echo.calls.Load(); n < 2 || n > 6 {
		t.Fatalf("driver called %d times in 400ms with 100ms backoff", n)
	}
	t.Logf("%d attempts in %v", echo.calls.Load(), took.Round(time.Millisecond))
}

// TestNoRetryWaitBeyondTheDeadline: when the next backoff would outlast the
// caller's deadline, the call ends at once with the driver's own answer
// (Unavailable and its message), not with a DeadlineExceeded after waiting.
func TestNoRetryWaitBeyondTheDeadline(t *testing.T) {
	echo, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep,
		Retry: broker.RetryConfig{MaxAttempts: 5, IntervalStart: 2 * time.Second, IntervalMax: 2 * time.Second}})
	client := csi.NewControllerClient(chaintest.Dial(t, c.Front))
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	start := time.Now()
	_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "u", Parameters: map[string]string{"code": "14"}})
	took := time.Since(start)
	if status.Code(err) != codes.Unavailable || !strings.Contains(status.Convert(err).Message(), "driver says Unavailable") {
		t.Fatalf("err = %v, want the driver's Unavailable", err)
	}
	// The driver's own answer, not DeadlineExceeded: the call did not
	// wait for the deadline, nor for a retry that could not start in time.
	if echo.calls.Load() != 1 {
		t.Fatalf("%d attempts in %v: the call waited for a retry that could not start in time", echo.calls.Load(), took)
	}
}

// TestRetriedAfterUnavailableSaysSo: a call whose first attempt ended
// Unavailable (which may have reached the driver) and whose retry failed
// otherwise ends with the retry's status, unchanged for a CSI caller, and
// says it was retried after Unavailable (broker.EarlierAttemptUnavailable),
// so a provisioner keeps what it asked for (and recovery does not take a
// no-room answer as proof of absence), while still marked as the driver's
// answer (broker.Answered); a call that failed at once does not say it.
func TestRetriedAfterUnavailableSaysSo(t *testing.T) {
	echo, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep,
		Retry: broker.RetryConfig{MaxAttempts: 3, IntervalStart: 10 * time.Millisecond, IntervalMax: 20 * time.Millisecond}})
	conn, err := c.Broker.ControllerConn(echoName)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	inProcess := csi.NewControllerClient(conn)
	front := csi.NewControllerClient(chaintest.Dial(t, c.Front))
	for _, tc := range []struct {
		name    string
		client  csi.ControllerClient
		params  map[string]string
		retried bool
	}{
		{"retried", inProcess, map[string]string{"first-code": "14", "code": "3"}, true},
		{"at-once", inProcess, map[string]string{"code": "3"}, false},
		{"front", front, map[string]string{"first-code": "14", "code": "3"}, false},
	} {
		before := echo.calls.Load()
		_, err := tc.client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: tc.name, Parameters: tc.params})
		st := status.Convert(err)
		if st.Code() != codes.InvalidArgument || st.Message() != "driver says InvalidArgument for "+tc.name || len(st.Details()) != 1 {
			t.Errorf("%s: status %v (%d details), want the driver's InvalidArgument, message and details unchanged", tc.name, st, len(st.Details()))
		}
		if got := broker.EarlierAttemptUnavailable(err); got != tc.retried {
			t.Errorf("%s: EarlierAttemptUnavailable %v, want %v", tc.name, got, tc.retried)
		}
		if tc.client == inProcess && !broker.Answered(err) {
			t.Errorf("%s: the driver's answer is not marked Answered: %v", tc.name, err)
		}
		if n, want := echo.calls.Load()-before, int64(1+len(tc.params)-1); n != want {
			t.Errorf("%s: %d driver calls, want %d", tc.name, n, want)
		}
	}
}
