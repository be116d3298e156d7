package image

import (
	"os"
	"testing"

	"github.com/csibroker/csibroker/internal/testutil"
)

func TestMain(m *testing.M) {
	testutil.SkipPackageIfShort("builds and inspects the release image")
	os.Exit(m.Run())
}
