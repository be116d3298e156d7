package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
)

const trustDomain = "bench.local"

// driverInst is one running sample CSI driver.
type driverInst struct {
	name string
	sock string
	proc *proc
}

// startDriver starts a sample driver with its own, fresh state directory.
func (h *Harness) startDriver(ctx context.Context, tag, name string) (*driverInst, error) {
	dir, err := os.MkdirTemp(h.work, "drv-")
	if err != nil {
		return nil, err
	}
	sock := filepath.Join(dir, "csi.sock")
	p, err := h.procs.start(tag+"-driver-"+name, h.bins.csibroker, []string{
		"sample-driver", "--endpoint", "unix://" + sock, "--name", name, "--node-id", "node-1",
		"--state-dir", filepath.Join(dir, "state"), "--capacity", "100Ti", "--nodes", "*",
	}, nil)
	if err != nil {
		return nil, err
	}
	if err := waitSocket(ctx, p, sock, 30*time.Second); err != nil {
		return nil, err
	}
	return &driverInst{name: name, sock: sock, proc: p}, nil
}

func (h *Harness) startDrivers(ctx context.Context, tag string, names []string) ([]*driverInst, error) {
	var ds []*driverInst
	for _, n := range names {
		d, err := h.startDriver(ctx, tag, n)
		if err != nil {
			stopDrivers(ds)
			return nil, err
		}
		ds = append(ds, d)
	}
	return ds, nil
}

func stopDrivers(ds []*driverInst) {
	for _, d := range ds {
		d.proc.stop(5 * time.Second)
	}
}

// deployment is one side's processes: external-provisioners (and
// external-attachers), or csibroker's broker(s) and proxies.
type deployment struct {
	side        string
	controllers []*proc // provisioners or brokers: CPU and RSS are measured on these
	helpers     []*proc // attachers or proxies: part of the side's footprint
	identities  []string
	metrics     []string // /metrics URLs of the controllers
}

func (d *deployment) all() []*proc {
	return append(append([]*proc(nil), d.controllers...), d.helpers...)
}

func (d *deployment) stop() {
	var wg sync.WaitGroup
	for _, p := range d.all() {
		wg.Go(func() { p.stop(5 * time.Second) })
	}
	wg.Wait()
}

// died reports the first process of the deployment that has exited.
func (d *deployment) died() error {
	for _, p := range d.all() {
		if err := p.died(); err != nil {
			return err
		}
	}
	return nil
}

// cpu sums the CPU seconds of the controllers, and of the helpers.
func (d *deployment) cpu() (controllers, helpers float64) {
	for _, p := range d.controllers {
		c, _ := p.cpuSeconds()
		controllers += c
	}
	for _, p := range d.helpers {
		c, _ := p.cpuSeconds()
		helpers += c
	}
	return controllers, helpers
}

// switches sums the context switches of the controllers' threads.
func (d *deployment) switches() uint64 {
	var n uint64
	for _, p := range d.controllers {
		c, _ := p.ctxSwitches()
		n += c
	}
	return n
}

// memory sums VmRSS and VmHWM over processes.
func memory(ps []*proc) (rss, hwm int64) {
	for _, p := range ps {
		r, w, _ := p.memory()
		rss += r
		hwm += w
	}
	return rss, hwm
}

// deployOpts says how to deploy a side.
type deployOpts struct {
	tag     string
	drivers []*driverInst
	rate    rate
	attach  bool
	// leaderElection runs len(identities) replicas with leader election in
	// leaseNS; otherwise one replica without it.
	leaderElection bool
	identities     []string
	leaseNS        string
}

func (o deployOpts) replicas() []string {
	if o.leaderElection {
		return o.identities
	}
	return []string{""}
}

// startSidecars starts one external-provisioner per driver (per replica),
// talking to the driver's socket directly, plus one external-attacher per
// driver with attach. With leader election, each replica runs in its own UTS
// namespace with its identity as hostname: external-provisioner takes its
// leader-election identity from the hostname, and two replicas on one host
// would otherwise share it.
func (h *Harness) startSidecars(ctx context.Context, o deployOpts) (*deployment, error) {
	d := &deployment{side: sideSidecar, identities: o.identities}
	fail := func(err error) (*deployment, error) { d.stop(); return nil, err }
	common := func(drv *driverInst, port int) []string {
		a := []string{
			"--csi-address=" + drv.sock,
			"--kubeconfig=" + h.env.Kubeconfig,
			"--kube-api-qps=" + strconv.FormatFloat(o.rate.QPS, 'f', -1, 64),
			"--kube-api-burst=" + strconv.Itoa(o.rate.Burst),
			"--worker-threads=" + strconv.Itoa(h.cfg.WorkerThreads),
			"--http-endpoint=127.0.0.1:" + strconv.Itoa(port),
			"--leader-election=" + strconv.FormatBool(o.leaderElection),
		}
		if o.leaderElection {
			a = append(a, "--leader-election-namespace="+o.leaseNS)
		}
		return a
	}
	for i, drv := range o.drivers {
		for _, id := range o.replicas() {
			port, err := freePort()
			if err != nil {
				return fail(err)
			}
			name := fmt.Sprintf("%s-provisioner-%d%s", o.tag, i, suffix(id))
			bin, args := h.bins.provisioner, common(drv, port)
			if id != "" {
				bin, args = withHostname(id, bin, args)
			}
			p, err := h.procs.start(name, bin, args, nil)
			if err != nil {
				return fail(err)
			}
			d.controllers = append(d.controllers, p)
			d.metrics = append(d.metrics, fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
		}
		if o.attach {
			port, err := freePort()
			if err != nil {
				return fail(err)
			}
			p, err := h.procs.start(fmt.Sprintf("%s-attacher-%d", o.tag, i), h.bins.attacher, common(drv, port), nil)
			if err != nil {
				return fail(err)
			}
			d.helpers = append(d.helpers, p)
		}
	}
	return d, nil
}

func suffix(id string) string {
	if id == "" {
		return ""
	}
	return "-" + id
}

// withHostname wraps a command so that it runs in a new UTS namespace with
// the given hostname; the PID stays the command's (unshare and sh exec it).
func withHostname(host, bin string, args []string) (string, []string) {
	return "unshare", append([]string{"--uts", "sh", "-c", `hostname "$0" && exec "$@"`, host, bin}, args...)
}

// certs mints (once per harness) a CA, the broker's certificate and one proxy
// certificate per driver name.
func (h *Harness) certs(ctx context.Context, drivers []string) (string, error) {
	dir := filepath.Join(h.work, "certs")
	var missing []string
	for _, n := range drivers {
		if _, err := os.Stat(filepath.Join(dir, "proxy-"+n+".crt")); err != nil {
			missing = append(missing, n)
		}
	}
	if len(missing) == 0 {
		return dir, nil
	}
	p, err := h.procs.start("certs", h.bins.csibroker, []string{"certs", "--dir", dir, "--trust-domain", trustDomain, "--driver", strings.Join(missing, ",")}, nil)
	if err != nil {
		return "", err
	}
	select {
	case <-p.done:
	case <-ctx.Done():
		p.kill()
		return "", ctx.Err()
	}
	if p.waitErr != nil {
		return "", fmt.Errorf("csibroker certs: %v: %s", p.waitErr, p.logTail(10))
	}
	return dir, nil
}

// startProxies starts one proxy per driver on 127.0.0.1 and waits until each
// is ready; it returns the processes and the registry file naming them.
func (h *Harness) startProxies(ctx context.Context, tag string, drivers []*driverInst) ([]*proc, string, error) {
	names := make([]string, len(drivers))
	for i, d := range drivers {
		names[i] = d.name
	}
	certs, err := h.certs(ctx, names)
	if err != nil {
		return nil, "", err
	}
	var ps []*proc
	fail := func(err error) ([]*proc, string, error) {
		for _, p := range ps {
			p.stop(5 * time.Second)
		}
		return nil, "", err
	}
	var reg strings.Builder
	reg.WriteString("drivers:\n")
	for i, d := range drivers {
		port, err1 := freePort()
		hport, err2 := freePort()
		if err := errors.Join(err1, err2); err != nil {
			return fail(err)
		}
		bin, args := h.bins.proxy, []string{}
		if bin == "" {
			bin, args = h.bins.csibroker, []string{"proxy"}
		}
		p, err := h.procs.start(fmt.Sprintf("%s-proxy-%d", tag, i), bin, append(args,
			"--driver-endpoint", "unix://"+d.sock, "--listen", "127.0.0.1:"+strconv.Itoa(port),
			"--tls-cert", filepath.Join(certs, "proxy-"+d.name+".crt"), "--tls-key", filepath.Join(certs, "proxy-"+d.name+".key"),
			"--tls-ca", filepath.Join(certs, "ca.crt"), "--trust-domain", trustDomain,
			"--http-endpoint", "127.0.0.1:"+strconv.Itoa(hport),
		), h.otelEnv("csibroker-proxy"))
		if err != nil {
			return fail(err)
		}
		ps = append(ps, p)
		if err := waitHTTP(ctx, p, fmt.Sprintf("http://127.0.0.1:%d/readyz", hport), 30*time.Second); err != nil {
			return fail(err)
		}
		fmt.Fprintf(&reg, "  - name: %s\n    controller: {address: 127.0.0.1:%d}\n", d.name, port)
	}
	f, err := os.CreateTemp(h.work, tag+"-registry-*.yaml")
	if err != nil {
		return fail(err)
	}
	_, err = f.WriteString(reg.String())
	if err := errors.Join(err, f.Close()); err != nil {
		return fail(err)
	}
	return ps, f.Name(), nil
}

// startBroker starts the proxies (ready before the clock starts, as the
// driver is), then the broker(s): --kubernetes on, the same client QPS, burst
// and worker threads as the sidecars, policy and tracing as configured.
func (h *Harness) startBroker(ctx context.Context, o deployOpts) (*deployment, error) {
	d := &deployment{side: sideBroker, identities: o.identities}
	proxies, registry, err := h.startProxies(ctx, o.tag, o.drivers)
	if err != nil {
		return nil, err
	}
	d.helpers = proxies
	if err := h.startBrokerReplicas(ctx, d, o, registry); err != nil {
		d.stop()
		return nil, err
	}
	return d, nil
}

// brokerEventsQPS is the broker's default --events-qps.
const brokerEventsQPS = 20

func (h *Harness) startBrokerReplicas(_ context.Context, d *deployment, o deployOpts, registry string) error {
	certs := filepath.Join(h.work, "certs")
	for _, id := range o.replicas() {
		port, err := freePort()
		if err != nil {
			return err
		}
		sockDir, err := os.MkdirTemp(h.work, "fe-")
		if err != nil {
			return err
		}
		args := []string{
			"broker", "--driver-registry", registry, "--kubeconfig", h.env.Kubeconfig, "--kubernetes", "on",
			"--namespace", brokerNamespace, "--http-endpoint", "127.0.0.1:" + strconv.Itoa(port),
			"--kube-api-qps", strconv.FormatFloat(o.rate.QPS, 'f', -1, 64), "--kube-api-burst", strconv.Itoa(o.rate.Burst),
			"--worker-threads", strconv.Itoa(h.cfg.WorkerThreads), "--policy-mode", h.cfg.PolicyMode,
			"--tls-cert", filepath.Join(certs, "broker.crt"), "--tls-key", filepath.Join(certs, "broker.key"),
			"--tls-ca", filepath.Join(certs, "ca.crt"), "--trust-domain", trustDomain, "--socket-dir", sockDir,
		}
		if o.rate.QPS > brokerEventsQPS {
			// The sidecar sends its Events through its one client, at the
			// setting's budget. The broker's separate Events client would
			// keep its own, smaller one (--events-qps 20) and send most
			// of them after the measured window, so their CPU would not
			// be counted: both sides get the same budget instead.
			args = append(args, "--events-qps", strconv.FormatFloat(o.rate.QPS, 'f', -1, 64), "--events-burst", strconv.Itoa(o.rate.Burst))
		}
		if o.leaderElection {
			args = append(args, "--leader-election", "--identity", id, "--leader-election-namespace", o.leaseNS)
		} else {
			args = append(args, "--identity", o.tag)
		}
		args = append(args, h.cfg.BrokerFlags...)
		p, err := h.procs.start(o.tag+"-broker"+suffix(id), h.bins.csibroker, args, h.otelEnv("csibroker"))
		if err != nil {
			return err
		}
		d.controllers = append(d.controllers, p)
		d.metrics = append(d.metrics, fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
	}
	return nil
}

// startFloor starts one minprov per driver, at the sides' client rate and
// worker threads.
func (h *Harness) startFloor(o deployOpts) (*deployment, error) {
	d := &deployment{side: sideFloor}
	for i, drv := range o.drivers {
		p, err := h.procs.start(fmt.Sprintf("%s-minprov-%d", o.tag, i), h.bins.minprov, []string{
			"--kubeconfig=" + h.env.Kubeconfig, "--driver=" + drv.name,
			"--kube-api-qps=" + strconv.FormatFloat(o.rate.QPS, 'f', -1, 64), "--kube-api-burst=" + strconv.Itoa(o.rate.Burst),
			"--worker-threads=" + strconv.Itoa(h.cfg.WorkerThreads),
		}, nil)
		if err != nil {
			d.stop()
			return nil, err
		}
		d.controllers = append(d.controllers, p)
	}
	return d, nil
}

// deploy starts one side.
func (h *Harness) deploy(ctx context.Context, side string, o deployOpts) (*deployment, error) {
	switch side {
	case sideSidecar:
		return h.startSidecars(ctx, o)
	case sideFloor:
		return h.startFloor(o)
	}
	return h.startBroker(ctx, o)
}
