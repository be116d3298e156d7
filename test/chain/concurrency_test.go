package chain

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/csibroker/csibroker/internal/chaintest"
)

// TestManyConcurrentCallersOnTheFrontEndSocket: 512 and then 2,048
// goroutines calling at once on one client connection to the front-end
// socket all finish. grpc-go from v1.82.1 can deadlock both peers of a
// unix-socket connection that carries many concurrent unary calls (grpc-go
// issue 9330: both readers throttled behind writers blocked on a full
// socket); the front end's stream limit and socket buffers
// (internal/grpcsrv) keep it from happening, and the chain's client
// connection to the proxy is TCP.
func TestManyConcurrentCallersOnTheFrontEndSocket(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	client := csi.NewControllerClient(chaintest.Dial(t, c.Front))
	for _, callers := range []int{512, 2048} {
		t.Run(fmt.Sprint(callers), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			const perCaller = 4
			var wg sync.WaitGroup
			errs := make(chan error, callers)
			for i := range callers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for j := range perCaller {
						if _, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: fmt.Sprintf("v-%d-%d", i, j), Parameters: map[string]string{"quiet": "true"}}); err != nil {
							errs <- err
							return
						}
					}
				}()
			}
			done := make(chan struct{})
			go func() { wg.Wait(); close(done) }()
			select {
			case <-done:
			case <-ctx.Done():
				buf := make([]byte, 1<<20)
				t.Fatalf("%d callers did not finish in 60 s (deadlocked?):\n%s", callers, buf[:runtime.Stack(buf, true)])
			}
			close(errs)
			for err := range errs {
				t.Fatalf("a call failed: %v", err)
			}
		})
	}
}
