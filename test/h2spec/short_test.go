package h2spec

import (
	"os"
	"testing"

	"github.com/csibroker/csibroker/internal/testutil"
)

func TestMain(m *testing.M) {
	testutil.SkipPackageIfShort("h2spec against the running servers")
	os.Exit(m.Run())
}
