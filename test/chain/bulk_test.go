package chain

import (
	"context"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/csibroker/csibroker/internal/chaintest"
)

// Large requests and large answers at once, both ways on every connection
// of the chain: no hop may stop reading while it waits to write. A hop that
// did would hold the calls until a write deadline (15 s) broke the
// connection; each call here must be done before that.
func TestLargeRequestsAndAnswersBothWays(t *testing.T) {
	path := filepath.Join(chaintest.ShortTempDir(t), "d.sock")
	serveDriver(t, path)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: "unix://" + path})
	conn := brokerConn(t, c)
	client := csi.NewControllerClient(conn)
	big := strings.Repeat("x", 2<<20)
	const calls = 16
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, calls)
	for i := 0; i < calls; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 14*time.Second)
			defer cancel()
			resp, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "bulk", Parameters: map[string]string{"big": big, "reply-bytes": "1", "quiet": "true"}})
			if err == nil && len(resp.GetVolume().GetVolumeContext()["big"]) != len(big) {
				t.Errorf("answer of %d bytes, want the %d-byte parameter echoed", len(resp.GetVolume().GetVolumeContext()["big"]), len(big))
			}
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("call: %v", err)
		}
	}
	t.Logf("%d calls of 2 MiB each way in %v", calls, time.Since(start))
}
