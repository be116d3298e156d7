package kube

import (
	"testing"

	"github.com/csibroker/csibroker/internal/testenv"
)

// TestStripBulkServerObjects needs a real control plane (with
// kube-controller-manager, which binds the claim); the package's other
// tests need none.
func TestMain(m *testing.M) {
	testenv.Main(m, testenv.Options{ControllerManager: true, Scheduler: true})
}
