package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/csibroker/csibroker/internal/mtls"
	brokerstatusv1 "github.com/csibroker/csibroker/proto/brokerstatus/v1"
)

func init() {
	register("demo", "start a local sample driver, proxy and broker and show CSI calls going through", runDemo)
}

// DemoConfig holds the demo subcommand's flags.
type DemoConfig struct {
	Dir         string
	Keep        bool
	Wait        bool
	TrustDomain string
	Driver      string
}

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg := DemoConfig{}
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&cfg.Dir, "dir", "", "work directory for certificates, sockets, state and logs (default: a new temporary directory)")
	fs.BoolVar(&cfg.Keep, "keep", false, "keep the work directory afterwards")
	fs.BoolVar(&cfg.Wait, "wait", false, "after the demo calls, keep everything running until Ctrl-C (point csc or csi-sanity at the front-end socket)")
	fs.StringVar(&cfg.TrustDomain, "trust-domain", "csibroker.local", "SPIFFE trust domain")
	fs.StringVar(&cfg.Driver, "driver", "sample.csibroker.io", "name of the sample driver")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	d := &demo{cfg: cfg, out: stdout}
	defer d.stopAll()
	if err := d.run(ctx); err != nil {
		fmt.Fprintf(stdout, "\ndemo failed: %v\nlogs are in %s\n", err, filepath.Join(d.dir, "logs"))
		d.cfg.Keep = true
		return err
	}
	return nil
}

type demo struct {
	cfg   DemoConfig
	out   io.Writer
	dir   string
	procs []*demoProc
}

type demoProc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

func (d *demo) step(format string, a ...any) {
	fmt.Fprintf(d.out, "==> "+format+"\n", a...)
}

func (d *demo) run(ctx context.Context) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	d.dir = d.cfg.Dir
	if d.dir == "" {
		if d.dir, err = os.MkdirTemp("", "csibroker-demo-"); err != nil {
			return err
		}
	}
	for _, sub := range []string{"certs", "sockets", "state", "logs"} {
		if err := os.MkdirAll(filepath.Join(d.dir, sub), 0o755); err != nil {
			return err
		}
	}
	d.step("work directory %s", d.dir)

	certs := filepath.Join(d.dir, "certs")
	if _, err := mtls.WriteDevCerts(mtls.DevCertsOptions{Dir: certs, TrustDomain: d.cfg.TrustDomain, Drivers: []string{d.cfg.Driver}, Validity: 24 * time.Hour}); err != nil {
		return err
	}
	d.step("minted a dev CA and certificates for %s and %s", mtls.BrokerID(d.cfg.TrustDomain), mtls.DriverID(d.cfg.TrustDomain, d.cfg.Driver))

	driverSock := filepath.Join(d.dir, "sockets", "driver.sock")
	if err := d.start(ctx, exe, "sample-driver", "--endpoint", "unix://"+driverSock, "--name", d.cfg.Driver,
		"--node-id", "demo-node", "--state-dir", filepath.Join(d.dir, "state"), "--capacity", "100Gi",
		"--topology", "topology.kubernetes.io/zone=zone-a"); err != nil {
		return err
	}
	if err := d.waitFile(ctx, driverSock, "sample-driver"); err != nil {
		return err
	}
	proxyAddr, err := freeAddr()
	if err != nil {
		return err
	}
	proxyHTTP, err := freeAddr()
	if err != nil {
		return err
	}
	if err := d.start(ctx, exe, "proxy", "--driver-endpoint", "unix://"+driverSock, "--listen", proxyAddr, "--http-endpoint", proxyHTTP,
		"--trust-domain", d.cfg.TrustDomain, "--tls-cert", filepath.Join(certs, "proxy-"+d.cfg.Driver+".crt"),
		"--tls-key", filepath.Join(certs, "proxy-"+d.cfg.Driver+".key"), "--tls-ca", filepath.Join(certs, "ca.crt")); err != nil {
		return err
	}
	if err := d.waitHTTP(ctx, "http://"+proxyHTTP+"/readyz", "proxy"); err != nil {
		return err
	}
	registry := filepath.Join(d.dir, "registry.yaml")
	if err := os.WriteFile(registry, []byte(fmt.Sprintf("drivers:\n  - name: %s\n    controller: {address: %q}\n", d.cfg.Driver, proxyAddr)), 0o644); err != nil {
		return err
	}
	brokerHTTP, err := freeAddr()
	if err != nil {
		return err
	}
	sockets := filepath.Join(d.dir, "sockets", "front")
	status := filepath.Join(d.dir, "sockets", "status.sock")
	if err := d.start(ctx, exe, "broker", "--driver-registry", registry, "--socket-dir", sockets, "--status-socket", status,
		"--http-endpoint", brokerHTTP, "--trust-domain", d.cfg.TrustDomain, "--v", "4",
		"--tls-cert", filepath.Join(certs, "broker.crt"), "--tls-key", filepath.Join(certs, "broker.key"), "--tls-ca", filepath.Join(certs, "ca.crt")); err != nil {
		return err
	}
	front := filepath.Join(sockets, d.cfg.Driver+".sock")
	if err := d.waitFile(ctx, front, "broker front end"); err != nil {
		return err
	}
	if err := d.waitHTTP(ctx, "http://"+brokerHTTP+"/healthz", "broker"); err != nil {
		return err
	}
	d.step("sample driver → proxy (mTLS on %s) → broker; CSI front end at %s", proxyAddr, front)

	if err := d.calls(ctx, front); err != nil {
		return err
	}
	if err := d.checkNoSecret(); err != nil {
		return err
	}
	if err := d.showStatus(ctx, status); err != nil {
		return err
	}
	if err := d.showMetrics(ctx, "http://"+brokerHTTP+"/metrics"); err != nil {
		return err
	}
	if d.cfg.Wait {
		d.step("running; the front end is %s, status: csibroker status --socket %s; Ctrl-C stops everything", front, status)
		select {
		case <-ctx.Done():
		case <-d.anyExited():
			return errors.New("a component exited; see the logs")
		}
	}
	d.step("done: the CSI calls went through the broker and the proxy; stopping")
	return nil
}

func (d *demo) calls(ctx context.Context, front string) error {
	conn, err := grpc.NewClient("unix://"+front, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ident, ctrl := csi.NewIdentityClient(conn), csi.NewControllerClient(conn)
	timed := func(what string, f func() (string, error)) error {
		start := time.Now()
		res, err := f()
		if err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		fmt.Fprintf(d.out, "    %-28s %8s  %s\n", what, time.Since(start).Round(10*time.Microsecond), res)
		return nil
	}
	d.step("CSI calls through the broker's front-end socket")
	var volID string
	steps := []struct {
		what string
		f    func() (string, error)
	}{
		{"GetPluginInfo", func() (string, error) {
			r, err := ident.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
			return fmt.Sprintf("name=%s version=%s", r.GetName(), r.GetVendorVersion()), err
		}},
		{"Probe", func() (string, error) {
			r, err := ident.Probe(ctx, &csi.ProbeRequest{})
			return fmt.Sprintf("ready=%v", r.GetReady().GetValue()), err
		}},
		{"CreateVolume (with a secret)", func() (string, error) {
			r, err := ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
				Name:               "demo-volume",
				CapacityRange:      &csi.CapacityRange{RequiredBytes: 1 << 30},
				VolumeCapabilities: []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}}, AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}},
				Secrets:            map[string]string{"password": demoSecret},
			})
			volID = r.GetVolume().GetVolumeId()
			return fmt.Sprintf("id=%s bytes=%d topology=%v", volID, r.GetVolume().GetCapacityBytes(), r.GetVolume().GetAccessibleTopology()), err
		}},
		{"ListVolumes", func() (string, error) {
			r, err := ctrl.ListVolumes(ctx, &csi.ListVolumesRequest{})
			return fmt.Sprintf("%d volume(s)", len(r.GetEntries())), err
		}},
		{"GetCapacity", func() (string, error) {
			r, err := ctrl.GetCapacity(ctx, &csi.GetCapacityRequest{})
			return fmt.Sprintf("available=%d bytes", r.GetAvailableCapacity()), err
		}},
		{"DeleteVolume", func() (string, error) {
			_, err := ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: volID})
			return "deleted " + volID, err
		}},
	}
	for _, s := range steps {
		if err := timed(s.what, s.f); err != nil {
			return err
		}
	}
	return nil
}

// demoSecret is sent in CreateVolume; it must appear in no log file, though the
// broker runs at debug verbosity and logs every request.
const demoSecret = "demo-secret-never-logged"

func (d *demo) checkNoSecret() error {
	files, err := filepath.Glob(filepath.Join(d.dir, "logs", "*.log"))
	if err != nil {
		return err
	}
	lines := 0
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return err
		}
		if strings.Contains(string(b), demoSecret) {
			return fmt.Errorf("the secret sent in CreateVolume appears in %s", f)
		}
		lines += strings.Count(string(b), "\n")
	}
	d.step("the secret sent in CreateVolume appears in none of the %d log lines (the broker logs at debug verbosity)", lines)
	return nil
}

func (d *demo) showStatus(ctx context.Context, socket string) error {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	st, err := brokerstatusv1.NewBrokerStatusClient(conn).GetStatus(ctx, &brokerstatusv1.GetStatusRequest{})
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	d.step("csibroker status --socket %s", socket)
	return printStatus(d.out, st)
}

func (d *demo) showMetrics(ctx context.Context, url string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("metrics: %w", err)
	}
	defer resp.Body.Close()
	d.step("broker metrics (csi_sidecar_operations_seconds_count)")
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if line := sc.Text(); strings.HasPrefix(line, "csi_sidecar_operations_seconds_count") {
			fmt.Fprintln(d.out, "    "+line)
		}
	}
	return sc.Err()
}

func (d *demo) start(ctx context.Context, exe string, args ...string) error {
	name := args[0]
	logf, err := os.Create(filepath.Join(d.dir, "logs", name+".log"))
	if err != nil {
		return err
	}
	cmd := exec.Command(exe, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start %s: %w", name, err)
	}
	p := &demoProc{name: name, cmd: cmd, done: make(chan struct{})}
	go func() { p.err = cmd.Wait(); logf.Close(); close(p.done) }()
	d.procs = append(d.procs, p)
	d.step("started %s (pid %d), log %s", name, cmd.Process.Pid, logf.Name())
	return nil
}

func (d *demo) anyExited() <-chan struct{} {
	ch := make(chan struct{})
	for _, p := range d.procs {
		go func(p *demoProc) {
			<-p.done
			select {
			case <-ch:
			default:
				close(ch)
			}
		}(p)
	}
	return ch
}

// stopAll stops the children in reverse order: SIGTERM, then SIGKILL after 10s.
func (d *demo) stopAll() {
	for i := len(d.procs) - 1; i >= 0; i-- {
		p := d.procs[i]
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
			<-p.done
		}
	}
	if !d.cfg.Keep && d.cfg.Dir == "" && d.dir != "" {
		os.RemoveAll(d.dir)
	}
}

func (d *demo) waitFile(ctx context.Context, path, what string) error {
	return d.waitFor(ctx, what, func() bool { _, err := os.Stat(path); return err == nil })
}

func (d *demo) waitHTTP(ctx context.Context, url, what string) error {
	return d.waitFor(ctx, what, func() bool {
		resp, err := http.Get(url)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}

func (d *demo) waitFor(ctx context.Context, what string, ok func() bool) error {
	deadline := time.Now().Add(20 * time.Second)
	for !ok() {
		for _, p := range d.procs {
			select {
			case <-p.done:
				return fmt.Errorf("%s exited: %v (log: %s)", p.name, p.err, filepath.Join(d.dir, "logs", p.name+".log"))
			default:
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready after 20s", what)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	return nil
}

func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}
