package k8sbridge

import (
	"context"
	"testing"
	"time"

	"github.com/csibroker/csibroker/internal/testenv"
)

// TestReadyFollowsCacheSync: /readyz's answer is not ready before the
// informers run and ready once their caches synced, on a real apiserver.
func TestReadyFollowsCacheSync(t *testing.T) {
	env := testenv.Shared(t)
	ns := env.NewNamespace(t)
	var before error
	r := startBridge(t, env, ns, &testDrivers{}, bridgeOpts{configure: func(b *Bridge) { before = b.Ready() }})
	if before == nil {
		t.Fatal("Ready() was nil before Run started the informers")
	}
	if err := testenv.WaitFor(context.Background(), 30*time.Second, "caches synced", func(context.Context) (bool, string, error) {
		err := r.b.Ready()
		if err != nil {
			return false, err.Error(), nil
		}
		return true, "", nil
	}); err != nil {
		t.Fatal(err)
	}
}
