// Package kubelet registers the sample driver through a node proxy with a
// real kubelet, and reads the result back from the API server: the
// CSINode object the kubelet writes, with the driver's node ID and
// topology keys, and the topology label on the Node; the new node ID after
// the driver restarts with one (the proxy re-creates its registration
// socket and the kubelet registers the driver again); the driver gone
// from the CSINode once the proxy stops.
//
// It needs what the Go module proxy and Debian give, but no project
// script builds yet, so it skips unless both are there:
//
//   - $CSIBROKER_KUBELET (or kubelet next to the control plane's binaries,
//     testenv.DefaultBinDir()): a kubelet v1.36.3, built like the control plane
//     (hack/control-plane.sh's throwaway module, then
//     `go get k8s.io/kubernetes/cmd/kubelet@v1.36.3` and
//     `go build k8s.io/kubernetes/cmd/kubelet`; about 10 minutes cold on
//     2 cores);
//   - containerd on $PATH (Debian's, 1.6.20) and runc; the test runs its
//     own containerd on a private socket and directories. The kubelet
//     logs that containerd 1.6 lacks the RuntimeConfig call, and starts.
//
// The kubelet runs with cgroup v1 allowed (failCgroupV1: false: this
// machine has cgroup v1), swap allowed, and as root. No pod is run:
// plugin registration does not need one, so no pause image is needed.
package kubelet

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/internal/testutil"
	"github.com/csibroker/csibroker/proxy"
)

const (
	driverName = "sample.csibroker.io"
	nodeName   = "node-1"
	topoKey    = "topology.sample.csibroker.io/node"
)

func TestRealKubeletRegistersTheDriver(t *testing.T) {
	kubelet := os.Getenv("CSIBROKER_KUBELET")
	if kubelet == "" {
		// Where hack/control-plane.sh would put it, were it built there.
		if p := filepath.Join(testenv.DefaultBinDir(), "kubelet"); fileExists(p) {
			kubelet = p
		}
	}
	containerd, err := exec.LookPath("containerd")
	if kubelet == "" || err != nil {
		t.Skipf("needs $CSIBROKER_KUBELET (a built kubelet) and containerd on $PATH (see the package doc); kubelet=%q, containerd: %v", kubelet, err)
	}
	if os.Geteuid() != 0 {
		t.Skip("the kubelet and containerd run as root")
	}
	env := testenv.New(t, testenv.Options{})
	dir := testutil.ShortTempDir(t)

	// containerd, on its own socket and directories.
	ctdSock := filepath.Join(dir, "ctd.sock")
	ctdConf := write(t, dir, "containerd.toml", fmt.Sprintf(
		"version = 2\nroot = %q\nstate = %q\n[grpc]\n  address = %q\n", filepath.Join(dir, "ctd-root"), filepath.Join(dir, "ctd-state"), ctdSock))
	start(t, dir, "containerd", containerd, "--config", ctdConf)
	waitFile(t, ctdSock)

	// The kubelet, on the test's API server.
	root := filepath.Join(dir, "kubelet")
	port, healthz := freePort(t), freePort(t)
	conf := write(t, dir, "kubelet.yaml", fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failSwapOn: false
failCgroupV1: false
cgroupDriver: cgroupfs
address: 127.0.0.1
port: %d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %d
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
containerRuntimeEndpoint: unix://%s
`, port, healthz, ctdSock))
	// The kubelet bind-mounts its root directory on itself: undone once it
	// has stopped (cleanups run last first), before dir is removed.
	t.Cleanup(func() {
		if err := syscall.Unmount(root, syscall.MNT_DETACH); err != nil && err != syscall.EINVAL && err != syscall.ENOENT {
			t.Errorf("unmount %s: %v", root, err)
		}
	})
	start(t, dir, "kubelet", kubelet, "--config", conf, "--kubeconfig", env.Kubeconfig, "--root-dir", root,
		"--cert-dir", filepath.Join(dir, "kubelet-pki"), "--hostname-override", nodeName, "--v=2")

	// The sample driver and its node proxy, registering with the kubelet
	// through the kubelet's plugin registry.
	sock := filepath.Join(dir, "csi.sock")
	endpoint := "unix://" + sock
	stateDir := filepath.Join(dir, "driver-state")
	stopDriver := startDriver(t, endpoint, stateDir, nodeName)
	regDir := filepath.Join(root, "plugins_registry")
	waitFile(t, regDir) // created by the kubelet's plugin manager
	logs := &testutil.SyncBuffer{}
	p, err := proxy.New(proxy.Config{DriverEndpoint: endpoint, Node: nodeName, TLS: &tls.Config{},
		KubeletRegistrationPath: sock, PluginRegistrationDir: regDir,
		Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	regCtx, stopReg := context.WithCancel(ctx)
	regDone := make(chan struct{})
	go func() { p.RunRegistration(regCtx); close(regDone) }()
	defer func() { stopReg(); <-regDone }()

	client := env.Client()
	waitCSINode := func(nodeID string) {
		t.Helper()
		err := testenv.WaitFor(ctx, 90*time.Second, "the CSINode with the driver of node ID "+nodeID, func(ctx context.Context) (bool, string, error) {
			cn, err := client.StorageV1().CSINodes().Get(ctx, nodeName, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				return false, "no CSINode yet", nil
			}
			if err != nil {
				return false, "", err
			}
			d := driver(cn)
			if d == nil || d.NodeID != nodeID {
				return false, fmt.Sprintf("CSINode drivers %+v", cn.Spec.Drivers), nil
			}
			if !slices.Equal(d.TopologyKeys, []string{topoKey}) {
				return false, "", fmt.Errorf("CSINode driver %+v: want topology key %s", d, topoKey)
			}
			return true, "", nil
		})
		if err != nil {
			t.Fatalf("%v\nproxy log:\n%s\nkubelet log:\n%s", err, logs, tail(t, dir, "kubelet"))
		}
	}
	waitCSINode(nodeName)
	if cn, err := client.StorageV1().CSINodes().Get(ctx, nodeName, metav1.GetOptions{}); err == nil {
		t.Logf("CSINode %s written by the kubelet: drivers %+v", cn.Name, cn.Spec.Drivers)
	}
	node, err := client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if node.Labels[topoKey] != nodeName {
		t.Errorf("Node labels %v: want %s=%s (the kubelet's CSI handler sets it)", node.Labels, topoKey, nodeName)
	}
	if !strings.Contains(logs.String(), "the kubelet registered the driver") {
		t.Errorf("the proxy did not log the kubelet's registration status:\n%s", logs)
	}

	// The driver restarts (a new socket), now with another node ID: the
	// proxy re-creates the registration socket, the kubelet registers the
	// driver again and writes the new node ID.
	stopDriver()
	stopDriver = startDriver(t, endpoint, stateDir, nodeName+"-restarted")
	defer stopDriver()
	waitCSINode(nodeName + "-restarted")
	t.Logf("after the driver's restart the kubelet wrote node ID %s-restarted", nodeName)

	// The proxy stops: the kubelet deregisters the driver.
	stopReg()
	<-regDone
	err = testenv.WaitFor(ctx, 60*time.Second, "the driver gone from the CSINode", func(ctx context.Context) (bool, string, error) {
		cn, err := client.StorageV1().CSINodes().Get(ctx, nodeName, metav1.GetOptions{})
		if err != nil {
			return false, "", err
		}
		return driver(cn) == nil, fmt.Sprintf("CSINode drivers %v", cn.Spec.Drivers), nil
	})
	if err != nil {
		t.Fatalf("%v\nkubelet log:\n%s", err, tail(t, dir, "kubelet"))
	}
}

// startDriver runs the sample driver on endpoint until the returned
// function (also a cleanup) stops it.
func startDriver(t *testing.T, endpoint, stateDir, nodeID string) (stop func()) {
	t.Helper()
	d, err := sampledriver.New(sampledriver.Config{Name: driverName, NodeID: nodeID, Endpoint: endpoint, StateDir: stateDir,
		Topology: map[string]string{topoKey: nodeName}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("sample driver: %v", err)
			}
			d.Close()
		})
	}
	t.Cleanup(stop)
	return stop
}

func driver(cn *storagev1.CSINode) *storagev1.CSINodeDriver {
	for i := range cn.Spec.Drivers {
		if cn.Spec.Drivers[i].Name == driverName {
			return &cn.Spec.Drivers[i]
		}
	}
	return nil
}

func write(t *testing.T, dir, name, data string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// start runs bin in its own process group, its output in dir/<name>.log,
// and stops it (by its pid) at cleanup.
func start(t *testing.T, dir, name, bin string, args ...string) {
	t.Helper()
	log, err := os.Create(filepath.Join(dir, name+".log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); log.Close(); close(done) }()
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-done
		}
	})
}

func tail(t *testing.T, dir, name string) string {
	data, _ := os.ReadFile(filepath.Join(dir, name+".log"))
	lines := strings.Split(string(data), "\n")
	return strings.Join(lines[max(0, len(lines)-40):], "\n")
}

func waitFile(t *testing.T, path string) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(path); err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not appear", path)
		}
	}
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	port, _ := strconv.Atoi(strings.TrimPrefix(l.Addr().String(), "127.0.0.1:"))
	return port
}
