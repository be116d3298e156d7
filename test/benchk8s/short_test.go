package main

import (
	"os"
	"testing"

	"github.com/csibroker/csibroker/internal/testutil"
)

func TestMain(m *testing.M) {
	testutil.SkipPackageIfShort("the side-by-side harness on a real control plane")
	os.Exit(m.Run())
}
