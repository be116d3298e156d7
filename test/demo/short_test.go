package demo

import (
	"os"
	"testing"

	"github.com/csibroker/csibroker/internal/testutil"
)

func TestMain(m *testing.M) {
	testutil.SkipPackageIfShort("the demo on a real control plane")
	os.Exit(m.Run())
}
