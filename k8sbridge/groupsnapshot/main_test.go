package groupsnapshot

import (
	"os"
	"testing"
)

// TestMain turns client-go's watch-list off: the snapshot API's fake
// clientset (generated before it) never sends the bookmark a watch-list
// waits for, so its informers would not sync.
func TestMain(m *testing.M) {
	os.Setenv("KUBE_FEATURE_WatchListClient", "false")
	os.Exit(m.Run())
}
