package intent

import (
	"testing"

	"github.com/csibroker/csibroker/internal/testenv"
)

// The package's tests share one real control plane; each test uses its own
// namespace.
func TestMain(m *testing.M) {
	testenv.Main(m, testenv.Options{ControllerManager: true, Scheduler: true})
}
