package proxy

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/csibroker/csibroker/internal/sampledriver"
)

// TestManyConcurrentCallers is the check for grpc-go issue 9330 (see
// internal/grpcsrv's doc): 512 and 2,048 concurrent unary callers on one
// broker connection, through the proxy, to the sample driver on its unix
// socket, with the proxy's call bound at the number of callers so that the
// driver's leg carries them all at once. Every call must succeed, and all
// of them must be done within a minute; otherwise the test fails with a
// dump of every goroutine (a deadlock shows both transports' readers in
// controlBuffer.throttle).
func TestManyConcurrentCallers(t *testing.T) {
	if testing.Short() {
		t.Skip("slow: thousands of concurrent calls")
	}
	for _, callers := range []int{512, 2048} {
		t.Run(fmt.Sprint(callers), func(t *testing.T) {
			ep, _ := sampledriver.StartTest(t, sampledriver.Config{Name: "sample.csi.test"})
			tp := startProxy(t, ep, Config{MaxConcurrentCalls: callers})
			client := csi.NewIdentityClient(tp.conn)
			const perCaller = 10
			ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
			defer cancel()
			var done, failed atomic.Int64
			var firstErr atomic.Value
			var wg sync.WaitGroup
			start := make(chan struct{})
			for range callers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					for range perCaller {
						var err error
						if done.Load()%2 == 0 {
							_, err = client.Probe(ctx, &csi.ProbeRequest{})
						} else {
							_, err = client.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
						}
						if err != nil {
							failed.Add(1)
							firstErr.CompareAndSwap(nil, err)
							return
						}
						done.Add(1)
					}
				}()
			}
			finished := make(chan struct{})
			go func() { wg.Wait(); close(finished) }()
			// How many calls the driver's leg carried at once (the
			// proxy's slots in use), sampled.
			var peak atomic.Int64
			go func() {
				for {
					select {
					case <-finished:
						return
					case <-time.After(time.Millisecond):
						if n := int64(len(tp.p.slots)); n > peak.Load() {
							peak.Store(n)
						}
					}
				}
			}()
			began := time.Now()
			close(start)
			select {
			case <-finished:
			case <-time.After(60 * time.Second):
				buf := make([]byte, 8<<20)
				buf = buf[:runtime.Stack(buf, true)]
				t.Errorf("%d callers: only %d of %d calls done after 60s; goroutines:\n%s", callers, done.Load(), callers*perCaller, buf[:min(len(buf), 256<<10)])
				cancel()
				<-finished
				return
			}
			if n := failed.Load(); n > 0 {
				t.Errorf("%d callers: %d failed, first: %v", callers, n, firstErr.Load())
			}
			t.Logf("%d callers: %d calls in %v, up to %d at once on the driver's leg (sampled)", callers, done.Load(), time.Since(began).Round(time.Millisecond), peak.Load())
		})
	}
}
