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

// TestAnsweredMarksOnlyTheDriversStatus: through the chain, a status the
// driver (or the proxy) answered is marked as answered, and keeps the mark
// when a secret is redacted from it; a status the broker makes itself (its
// deadline, a driver that is gone) is not, whatever its code.
func TestAnsweredMarksOnlyTheDriversStatus(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, Retry: broker.RetryConfig{MaxAttempts: 1}})
	conn, err := c.Broker.ControllerConn(echoName)
	if err != nil {
		t.Fatal(err)
	}
	client := csi.NewControllerClient(conn)
	call := func(timeout time.Duration, params map[string]string, secrets map[string]string) error {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "v", Parameters: params, Secrets: secrets})
		return err
	}
	err = call(5*time.Second, map[string]string{"code": "8"}, nil)
	if status.Code(err) != codes.ResourceExhausted || !broker.Answered(err) {
		t.Fatalf("the driver's ResourceExhausted: %v, answered %v", err, broker.Answered(err))
	}
	err = call(5*time.Second, map[string]string{"echo-secret": "true"}, map[string]string{"password": "s3cr3t-canary"})
	if status.Code(err) != codes.PermissionDenied || !broker.Answered(err) || !strings.Contains(err.Error(), "***stripped***") {
		t.Fatalf("the driver's PermissionDenied quoting a secret: %v, answered %v", err, broker.Answered(err))
	}
	err = call(200*time.Millisecond, map[string]string{"wait": "true"}, nil)
	if status.Code(err) != codes.DeadlineExceeded || broker.Answered(err) {
		t.Fatalf("the broker's own deadline: %v, answered %v", err, broker.Answered(err))
	}
	c.StopProxy()
	err = call(2*time.Second, nil, nil)
	if status.Code(err) != codes.Unavailable || broker.Answered(err) {
		t.Fatalf("no proxy to answer: %v, answered %v", err, broker.Answered(err))
	}
}
