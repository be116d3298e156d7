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
// driver's leg carries them all at once. Every call must succeed; if no
// call completes for 15 s, or they are not all done within a minute (three
// with the race detector), the test fails with a dump of every goroutine
// (a deadlock shows both transports' readers in controlBuffer.throttle).
func TestManyConcurrentCallers(t *testing.T) {
	if testing.Short() {
		t.Skip("slow: thousands of concurrent calls")
	}
	for _, callers := range []int{512, 2048} {
		t.Run(fmt.Sprint(callers), func(t *testing.T) {
			ep, _ := sampledriver.StartTest(t, sampledriver.Config{Name: "sample.csi.test"})
			tp := startProxy(t, ep, Config{MaxConcurrentCalls: callers})
			client := csi.NewIdentityClient(tp.conn)
			perCaller, bound := 10, time.Minute
			if raceEnabled {
				perCaller, bound = 2, 3*time.Minute
			}
			ctx, cancel := context.WithTimeout(context.Background(), bound+30*time.Second)
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
						if n := int64(tp.p.slots.Taken()); n > peak.Load() {
							peak.Store(n)
						}
					}
				}
			}()
			began := time.Now()
			close(start)
			last, lastAt := int64(-1), time.Now()
		wait:
			for {
				select {
				case <-finished:
					break wait
				case <-time.After(time.Second):
				}
				if n := done.Load(); n != last {
					last, lastAt = n, time.Now()
				}
				stalled := time.Since(lastAt) >= 15*time.Second
				if !stalled && time.Since(began) < bound {
					continue
				}
				buf := make([]byte, 8<<20)
				buf = buf[:runtime.Stack(buf, true)]
				why := fmt.Sprintf("not done after %v", bound)
				if stalled {
					why = "no call completed for 15s"
				}
				t.Errorf("%d callers: %s; %d of %d calls done; goroutines:\n%s", callers, why, done.Load(), callers*perCaller, buf[:min(len(buf), 256<<10)])
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
