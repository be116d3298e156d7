//go:build linux

package tracing

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/testenv"
)

// Service names the processes export their spans as.
const (
	brokerService = "csibroker-broker"
	proxyService  = "csibroker-proxy"
	driverService = "csibroker-sample-driver"
	trustDomain   = "tracing.csibroker.test"
)

// buildBinary builds ./cmd/csibroker into a temporary directory.
func buildBinary(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "csibroker")
	build := exec.Command("go", "build", "-o", bin, "./cmd/csibroker")
	build.Dir = "../.."
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build csibroker: %v\n%s", err, out)
	}
	return bin
}

// stack is the drivers, their proxies and the broker, each a process of
// the csibroker binary exporting spans to one Jaeger.
type stack struct {
	t      *testing.T
	bin    string
	dir    string
	jaeger *testenv.Jaeger
	// metricsURL is the broker's /metrics.
	metricsURL string
}

// process is one started component.
type process struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{}
	err  error
}

// start runs the binary with args and env (added to the test's), its
// output in dir/logs/<name>.log, stopped at the test's cleanup (SIGTERM,
// then SIGKILL after 10s) and killed by the kernel should the test binary
// die first.
func (s *stack) start(name string, env []string, args ...string) *process {
	s.t.Helper()
	logPath := filepath.Join(s.dir, "logs", name+".log")
	f, err := os.Create(logPath)
	if err != nil {
		s.t.Fatal(err)
	}
	cmd := exec.Command(s.bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		s.t.Fatalf("start %s: %v", name, err)
	}
	p := &process{name: name, cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() { p.err = cmd.Wait(); f.Close(); close(p.done) }()
	s.t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-p.done
		}
		if s.t.Failed() {
			b, _ := os.ReadFile(logPath)
			s.t.Logf("----- %s.log -----\n%s", name, tail(string(b), 40))
		}
	})
	return p
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// wait polls ok until it holds, failing the test when p exits first or
// after 30s.
func (s *stack) wait(p *process, what string, ok func() bool) {
	s.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !ok() {
		select {
		case <-p.done:
			b, _ := os.ReadFile(p.log)
			s.t.Fatalf("%s exited before %s: %v\n%s", p.name, what, p.err, tail(string(b), 40))
		default:
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("%s: no %s after 30s", p.name, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func httpOK(url string) func() bool {
	return func() bool {
		resp, err := http.Get(url)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// driverSpec is one sample driver behind its proxy.
type driverSpec struct {
	name   string
	faults []string // sample-driver --fault values
}

// startStack starts each driver and its proxy, then the broker in
// Kubernetes mode against env, its intent record and Lease in namespace
// ns. The broker exports over OTLP/gRPC, the proxies and drivers over
// OTLP/HTTP: both of Jaeger's receivers are used.
func startStack(t *testing.T, bin string, env *testenv.Env, jaeger *testenv.Jaeger, ns string, drivers []driverSpec) *stack {
	t.Helper()
	s := &stack{t: t, bin: bin, dir: t.TempDir(), jaeger: jaeger}
	for _, sub := range []string{"certs", "sockets", "state", "logs"} {
		if err := os.MkdirAll(filepath.Join(s.dir, sub), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	certs := filepath.Join(s.dir, "certs")
	var names []string
	for _, d := range drivers {
		names = append(names, d.name)
	}
	if _, err := mtls.WriteDevCerts(mtls.DevCertsOptions{Dir: certs, TrustDomain: trustDomain, Drivers: names, Validity: time.Hour}); err != nil {
		t.Fatal(err)
	}
	registry := "drivers:\n"
	for i, d := range drivers {
		short := fmt.Sprintf("d%d", i)
		sock := filepath.Join(s.dir, "sockets", short+".sock")
		args := []string{"sample-driver", "--endpoint", "unix://" + sock, "--name", d.name, "--node-id", "node-a", "--nodes", "*",
			"--state-dir", filepath.Join(s.dir, "state", short), "--capacity", "100Gi"}
		for _, f := range d.faults {
			args = append(args, "--fault", f)
		}
		p := s.start(short+"-driver", jaeger.OTLPEnv(driverService, "http/protobuf"), args...)
		s.wait(p, "its socket", func() bool { _, err := os.Stat(sock); return err == nil })

		addr, health := freeAddr(t), freeAddr(t)
		p = s.start(short+"-proxy", jaeger.OTLPEnv(proxyService, "http/protobuf"), "proxy", "--driver-endpoint", "unix://"+sock,
			"--listen", addr, "--http-endpoint", health, "--trust-domain", trustDomain,
			"--tls-cert", filepath.Join(certs, "proxy-"+d.name+".crt"), "--tls-key", filepath.Join(certs, "proxy-"+d.name+".key"),
			"--tls-ca", filepath.Join(certs, "ca.crt"))
		s.wait(p, "/readyz", httpOK("http://"+health+"/readyz"))
		registry += fmt.Sprintf("  - name: %s\n    controller: {address: %q}\n", d.name, addr)
	}
	regFile := filepath.Join(s.dir, "registry.yaml")
	if err := os.WriteFile(regFile, []byte(registry), 0o644); err != nil {
		t.Fatal(err)
	}
	httpAddr := freeAddr(t)
	s.metricsURL = "http://" + httpAddr + "/metrics"
	p := s.start("broker", jaeger.OTLPEnv(brokerService, "grpc"), "broker",
		"--driver-registry", regFile, "--socket-dir", filepath.Join(s.dir, "sockets", "front"),
		"--status-socket", filepath.Join(s.dir, "sockets", "status.sock"), "--http-endpoint", httpAddr,
		"--trust-domain", trustDomain, "--tls-cert", filepath.Join(certs, "broker.crt"), "--tls-key", filepath.Join(certs, "broker.key"),
		"--tls-ca", filepath.Join(certs, "ca.crt"),
		"--kubernetes", "on", "--kubeconfig", env.Kubeconfig, "--namespace", ns, "--identity", "broker-0",
		"--policy-mode", "off", "--policy-crds=false", "--retry-interval-start", "500ms", "--retry-interval-max", "5s")
	s.wait(p, "/healthz", httpOK("http://"+httpAddr+"/healthz"))
	return s
}

// waitTrace polls Jaeger until trace id holds a span of each of services
// and complete reports it whole (spans reach Jaeger in batches, the
// operation's own span last), and returns it.
func (s *stack) waitTrace(ctx context.Context, id string, complete func(testenv.JaegerTrace) (bool, string)) testenv.JaegerTrace {
	s.t.Helper()
	var got testenv.JaegerTrace
	err := testenv.WaitFor(ctx, 30*time.Second, "trace "+id+" in Jaeger", func(ctx context.Context) (bool, string, error) {
		tr, err := s.jaeger.Trace(ctx, id)
		if err != nil {
			return false, err.Error(), nil
		}
		got = tr
		ok, state := complete(tr)
		return ok, state, nil
	})
	if err != nil {
		s.t.Fatal(err)
	}
	return got
}
