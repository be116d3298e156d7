// Package testenv runs a real, throwaway Kubernetes control plane for tests and
// the local demo: etcd and kube-apiserver, optionally kube-controller-manager
// and kube-scheduler, built at pinned versions by hack/control-plane.sh.
//
// It owns: finding the binaries (CSIBROKER_CONTROL_PLANE_BIN, else the cache
// directory the script builds into), starting each component on free
// 127.0.0.1 ports in a private temporary directory (keys, token file,
// kubeconfig, data and logs), waiting until each is ready, and stopping every
// process it started by its process group, on Stop, on test cleanup, and on
// SIGINT/SIGTERM (with Pdeathsig as a backstop on Linux should the test binary
// die abruptly). When a start fails, the tail of every component's log is part
// of the error.
//
// hack/control-plane.sh builds the binaries (KubernetesVersion,
// EtcdVersion) from the Go module proxy, since no prebuilt ones can be
// downloaded here, into DefaultBinDir: about 15 minutes the first time on
// 2 cores, skipped once built. A start then takes about 3 seconds.
//
// There is no kubelet. Helpers create what a kubelet and node-driver-registrar
// would: Ready, schedulable Node objects managed by the attach/detach
// controller (AddNodes) and CSINode driver entries (AddCSINode). The node
// lifecycle controller is disabled, so nodes stay Ready without heartbeats.
//
// Two ways to use it. One control plane per test:
//
//	env := testenv.New(t, testenv.Options{Scheduler: true})
//
// or one per package run, shared by its tests, each in its own namespace:
//
//	func TestMain(m *testing.M) { testenv.Main(m, testenv.Options{ControllerManager: true}) }
//
//	func TestX(t *testing.T) {
//		env := testenv.Shared(t)
//		ns := env.NewNamespace(t)
//		...
//	}
//
// The snapshot side (snapshots.go, snapshotters.go), the reference that
// csibroker's snapshot controller is compared against:
// Env.InstallSnapshotCRDs installs the six CRDs of external-snapshotter's
// client module at the go.mod version (config/crd in the module cache;
// group snapshots served as v1, the version the v8.7.0 binaries use);
// Env.StartSnapshotController and Env.StartSnapshotter (Run... outside a
// test) start the real snapshot-controller and a csi-snapshotter sidecar
// for one driver socket, built by hack/sidecars.sh at SnapshotterVersion,
// with the Env's admin kubeconfig. Each gets a free --http-endpoint on
// loopback and is ready once its /metrics answers (bounded by a timeout;
// an exit before that is an error with its log's tail); its log is
// <Env.Dir>/<name>.log; it is stopped by its process group at the test's
// cleanup, and by Env.Stop before the control plane. The
// CSIVolumeGroupSnapshot gate is set explicitly, on only when asked. Only
// one snapshot-controller may run on a cluster at a time.
//
// A missing binary is an error that says to run hack/control-plane.sh (or
// hack/sidecars.sh), never a skip: a test that silently does not run is
// worse than a red one.
//
// It must not: bind anything but loopback, leave a process or a temporary
// directory behind, or be imported by non-test code other than the demo.
package testenv
