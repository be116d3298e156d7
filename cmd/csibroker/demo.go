package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"go.yaml.in/yaml/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/testenv"
	brokerstatusv1 "github.com/csibroker/csibroker/proto/brokerstatus/v1"
)

func init() {
	register("demo", "run a local cluster with two sample drivers behind proxies and the broker, and show what it does", runDemo)
}

// DemoConfig holds the demo subcommand's flags.
type DemoConfig struct {
	Dir         string
	Keep        bool
	Wait        bool
	TrustDomain string
	DeployDir   string
	Timeout     time.Duration
}

const (
	demoAlpha  = "alpha.csibroker.io"
	demoBeta   = "beta.csibroker.io"
	demoNS     = "demo"
	brokerNS   = "csibroker-system"
	demoSecret = "demo-secret-value-never-logged"
)

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg := DemoConfig{}
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&cfg.Dir, "dir", "", "work directory for certificates, sockets, state and logs (default: a new temporary directory, removed afterwards)")
	fs.BoolVar(&cfg.Keep, "keep", false, "keep the work directory afterwards")
	fs.BoolVar(&cfg.Wait, "wait", false, "after the demo, keep everything running until Ctrl-C (kubeconfig and sockets are printed)")
	fs.StringVar(&cfg.TrustDomain, "trust-domain", "csibroker.local", "SPIFFE trust domain")
	fs.StringVar(&cfg.DeployDir, "deploy-dir", "deploy", "the repository's deploy/ directory (for the SecretGrant CRD)")
	fs.DurationVar(&cfg.Timeout, "timeout", 3*time.Minute, "how long to wait for the claims and the denial")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if cfg.Timeout <= 0 {
		return fmt.Errorf("--timeout %v: must be positive", cfg.Timeout)
	}
	d := &demo{cfg: cfg, out: stdout}
	defer d.stopAll()
	if err := d.run(ctx); err != nil {
		if ctx.Err() != nil {
			fmt.Fprintf(stdout, "\ninterrupted; stopping everything (Ctrl-C again to exit at once)\n")
			return err
		}
		fmt.Fprintf(stdout, "\ndemo failed: %v\n", err)
		if d.dir != "" {
			fmt.Fprintf(stdout, "logs are in %s\n", filepath.Join(d.dir, "logs"))
			d.cfg.Keep = true
		}
		return printed{err}
	}
	return nil
}

type demo struct {
	cfg DemoConfig
	out io.Writer
	dir string
	exe string
	env *testenv.Env
	// jaeger receives the components' spans when its binary is built
	// (make jaeger); nil otherwise, and they print them instead.
	jaeger *testenv.Jaeger
	procs  []*demoProc
	// exited is closed when the first of procs exits (firstExit), made
	// once every component has started.
	exited <-chan struct{}
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
	var err error
	if d.exe, err = os.Executable(); err != nil {
		return err
	}
	crdPath := filepath.Join(d.cfg.DeployDir, "crds", "policy.csibroker.io_secretgrants.yaml")
	if _, err := os.Stat(crdPath); err != nil {
		return fmt.Errorf("SecretGrant CRD: %w (run the demo from the repository root, or pass --deploy-dir)", err)
	}
	d.dir = d.cfg.Dir
	if d.dir == "" {
		if d.dir, err = os.MkdirTemp("", "csibroker-demo-"); err != nil {
			return err
		}
	}
	// Sockets are named by absolute path (unix:// URLs, the sample driver).
	if d.dir, err = filepath.Abs(d.dir); err != nil {
		return err
	}
	for _, sub := range []string{"certs", "sockets", "state", "logs", "traces"} {
		if err := os.MkdirAll(filepath.Join(d.dir, sub), 0o755); err != nil {
			return err
		}
	}
	d.step("work directory %s", d.dir)

	d.step("starting a local control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler")
	// Ctrl-C stops everything in order (stopAll); a second one exits at once.
	testenv.LeaveSignalsToCaller()
	d.env, err = testenv.Start(ctx, testenv.Options{ControllerManager: true, Scheduler: true,
		Logf: func(f string, a ...any) { fmt.Fprintf(d.out, "    "+f+"\n", a...) }})
	if err != nil {
		return err
	}
	if testenv.JaegerBuilt() {
		d.step("starting Jaeger %s all-in-one (OTLP in, in-memory storage, query API out)", testenv.JaegerVersion)
		if d.jaeger, err = testenv.StartJaeger(ctx, testenv.JaegerOptions{
			Logf: func(f string, a ...any) { fmt.Fprintf(d.out, "    "+f+"\n", a...) }}); err != nil {
			return err
		}
		fmt.Fprintf(d.out, "    started jaeger (pid %d)\n", d.jaeger.PID())
	} else {
		d.step("Jaeger is not built (make jaeger): the components print their spans, and the demo reads them from there")
	}
	c := d.env.Client()
	if err := d.cluster(ctx, c, crdPath); err != nil {
		return err
	}
	// Before the broker, which looks for the snapshot API as it starts.
	snapshots, err := d.snapshotSide(ctx)
	if err != nil {
		return err
	}
	front, status, metricsURL, err := d.components(ctx)
	if err != nil {
		return err
	}
	// Not before: a component started again on other ports (its first
	// process exited) is not one that exited.
	d.exited = firstExit(d.procs)
	if err := d.objects(ctx, c); err != nil {
		return err
	}
	ok, err := d.watch(ctx, c)
	if err != nil {
		return err
	}
	if ok && snapshots {
		if err := d.snapshotAndRestore(ctx, c); err != nil {
			return fmt.Errorf("snapshot and restore: %w", err)
		}
	}
	d.csiCall(ctx, front)
	if err := d.showStatus(ctx, status); err != nil {
		return err
	}
	if err := d.showMetrics(ctx, metricsURL); err != nil {
		return err
	}
	if err := d.showTrace(ctx, c); err != nil {
		fmt.Fprintf(d.out, "    (no trace: %v)\n", err)
	}
	if err := d.checkNoSecret(); err != nil {
		return err
	}
	if !ok {
		return errors.New("not every claim was Bound, or the denial did not happen")
	}
	if d.cfg.Wait {
		if d.jaeger != nil {
			d.step("Jaeger's query API: %s (a Jaeger UI's query service, or Grafana's Jaeger data source URL)", d.jaeger.QueryURL)
		}
		d.step("running; kubeconfig %s; front end %s; status: csibroker status --socket %s; Ctrl-C stops everything", d.env.Kubeconfig, front, status)
		select {
		case <-ctx.Done():
		case <-d.exited:
			return errors.New("a component exited; see the logs")
		}
	}
	d.step("done: every claim is Bound and the forbidden secret was refused; stopping (Ctrl-C again to exit at once)")
	return nil
}

// cluster makes what kubelet and node-driver-registrar would: nodes and their
// CSINodes; and installs the SecretGrant CRD.
func (d *demo) cluster(ctx context.Context, c kubernetes.Interface, crdPath string) error {
	d.step("registering two nodes in zones zone-a and zone-b, with both drivers on each")
	for _, n := range []struct{ name, zone string }{{"node-a", "zone-a"}, {"node-b", "zone-b"}} {
		if _, err := d.env.AddNodes(ctx, testenv.NodeSpec{Name: n.name, Zone: n.zone, Region: "local"}); err != nil {
			return err
		}
		if err := d.env.AddCSINode(ctx, n.name, demoAlpha, n.name, nil); err != nil {
			return err
		}
		if err := d.env.AddCSINode(ctx, n.name, demoBeta, n.name, []string{testenv.LabelZone}); err != nil {
			return err
		}
	}
	d.step("installing the SecretGrant CRD from %s", crdPath)
	raw, err := os.ReadFile(crdPath)
	if err != nil {
		return err
	}
	obj, err := yamlObject(raw)
	if err != nil {
		return fmt.Errorf("%s: %w", crdPath, err)
	}
	dyn, err := dynamic.NewForConfig(d.env.RESTConfig())
	if err != nil {
		return err
	}
	crdRes := schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
	if _, err := dyn.Resource(crdRes).Create(ctx, obj, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create CRD: %w", err)
	}
	return testenv.WaitFor(ctx, 30*time.Second, "SecretGrant CRD established", func(ctx context.Context) (bool, string, error) {
		u, err := dyn.Resource(crdRes).Get(ctx, obj.GetName(), metav1.GetOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
		for _, cd := range conds {
			if m, ok := cd.(map[string]any); ok && m["type"] == "Established" && m["status"] == "True" {
				return true, "", nil
			}
		}
		return false, "not established", nil
	})
}

func yamlObject(raw []byte) (*unstructured.Unstructured, error) {
	var v any
	if err := yaml.Unmarshal(raw, &v); err != nil {
		return nil, err
	}
	b, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, err
	}
	return &unstructured.Unstructured{Object: m}, nil
}

// components starts the drivers, their proxies and the broker as processes.
func (d *demo) components(ctx context.Context) (front, status, metricsURL string, err error) {
	certs := filepath.Join(d.dir, "certs")
	if _, err := mtls.WriteDevCerts(mtls.DevCertsOptions{Dir: certs, TrustDomain: d.cfg.TrustDomain, Drivers: []string{demoAlpha, demoBeta}, Validity: 24 * time.Hour}); err != nil {
		return "", "", "", err
	}
	d.step("minted a dev CA and the broker's and proxies' certificates (SPIFFE IDs in trust domain %s)", d.cfg.TrustDomain)
	registry := "drivers:\n"
	for _, drv := range []struct{ name, extra string }{
		{demoAlpha, ""},
		{demoBeta, "--controller-segment=topology.kubernetes.io/zone=zone-a --controller-segment=topology.kubernetes.io/zone=zone-b"},
	} {
		short := strings.SplitN(drv.name, ".", 2)[0]
		sock := filepath.Join(d.dir, "sockets", short+".sock")
		args := []string{"sample-driver", "--endpoint", "unix://" + sock, "--name", drv.name, "--node-id", "node-a", "--nodes", "*",
			"--state-dir", filepath.Join(d.dir, "state", short), "--capacity", "100Gi"}
		if drv.extra != "" {
			args = append(args, strings.Fields(drv.extra)...)
		}
		if err := d.start(short+"-driver", d.traceEnv("csibroker-sample-driver-"+short), args...); err != nil {
			return "", "", "", err
		}
		if err := d.waitFile(ctx, sock, short+" driver"); err != nil {
			return "", "", "", err
		}
		addrs, err := d.startOnFreePorts(ctx, short+" proxy", 2, func(addrs []string) error {
			addr, health := addrs[0], addrs[1]
			if err := d.start(short+"-proxy", d.traceEnv("csibroker-proxy-"+short), "proxy", "--driver-endpoint", "unix://"+sock, "--listen", addr, "--http-endpoint", health,
				"--trust-domain", d.cfg.TrustDomain, "--tls-cert", filepath.Join(certs, "proxy-"+drv.name+".crt"),
				"--tls-key", filepath.Join(certs, "proxy-"+drv.name+".key"), "--tls-ca", filepath.Join(certs, "ca.crt")); err != nil {
				return err
			}
			return d.waitHTTP(ctx, "http://"+health+"/readyz", short+" proxy")
		})
		if err != nil {
			return "", "", "", err
		}
		registry += fmt.Sprintf("  - name: %s\n    controller: {address: %q}\n", drv.name, addrs[0])
	}
	regFile := filepath.Join(d.dir, "registry.yaml")
	if err := os.WriteFile(regFile, []byte(registry), 0o644); err != nil {
		return "", "", "", err
	}
	if _, err := d.env.Client().CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: brokerNS}}, metav1.CreateOptions{}); err != nil {
		return "", "", "", err
	}
	sockets := filepath.Join(d.dir, "sockets", "front")
	status = filepath.Join(d.dir, "sockets", "status.sock")
	front = filepath.Join(sockets, demoAlpha+".sock")
	addrs, err := d.startOnFreePorts(ctx, "broker", 1, func(addrs []string) error {
		if err := d.start("broker", d.traceEnv("csibroker-broker"), "broker", "--driver-registry", regFile, "--socket-dir", sockets, "--status-socket", status,
			"--http-endpoint", addrs[0], "--trust-domain", d.cfg.TrustDomain, "--v", "0",
			"--tls-cert", filepath.Join(certs, "broker.crt"), "--tls-key", filepath.Join(certs, "broker.key"), "--tls-ca", filepath.Join(certs, "ca.crt"),
			"--kubernetes", "on", "--kubeconfig", d.env.Kubeconfig, "--namespace", brokerNS, "--leader-election", "--identity", "broker-0",
			"--policy-mode", "enforce", "--retry-interval-start", "500ms", "--retry-interval-max", "5s"); err != nil {
			return err
		}
		return d.waitHTTP(ctx, "http://"+addrs[0]+"/healthz", "broker")
	})
	if err != nil {
		return "", "", "", err
	}
	httpAddr := addrs[0]
	if err := d.waitFile(ctx, front, "broker front end"); err != nil {
		return "", "", "", err
	}
	d.step("broker running: two drivers, each behind its proxy over mTLS; leader election, secret policy enforced")
	return front, status, "http://" + httpAddr + "/metrics", nil
}

// traceEnv makes a component export its spans to Jaeger over OTLP, or
// without Jaeger print them (JSON) to standard output; the demo reads them
// back from there to show a trace. Only standard OTEL_* variables.
func (d *demo) traceEnv(service string) []string {
	if d.jaeger != nil {
		return d.jaeger.OTLPEnv(service, "http/protobuf")
	}
	return []string{"OTEL_TRACES_EXPORTER=console", "OTEL_SERVICE_NAME=" + service, "OTEL_BSP_SCHEDULE_DELAY=200"}
}

// objects applies what a cluster admin and a user would.
func (d *demo) objects(ctx context.Context, c kubernetes.Interface) error {
	d.step("applying: namespace %s, a secret, a SecretGrant for %s only, three StorageClasses, four claims and a pod", demoNS, demoAlpha)
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: demoNS}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	if _, err := c.CoreV1().ServiceAccounts(demoNS).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{}); err != nil && !strings.Contains(err.Error(), "already exists") {
		return err
	}
	if _, err := c.CoreV1().Secrets(demoNS).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "alpha-creds"},
		StringData: map[string]string{"password": demoSecret}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	dyn, err := dynamic.NewForConfig(d.env.RESTConfig())
	if err != nil {
		return err
	}
	grant := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "policy.csibroker.io/v1alpha1", "kind": "SecretGrant",
		"metadata": map[string]any{"name": "alpha-may-use-alpha-creds", "namespace": demoNS},
		"spec": map[string]any{"drivers": []any{demoAlpha}, "secretNames": []any{"alpha-creds"},
			"operations": []any{"CreateVolume", "DeleteVolume"}, "requesters": map[string]any{"namespaces": []any{demoNS}}},
	}}
	if _, err := dyn.Resource(schema.GroupVersionResource{Group: "policy.csibroker.io", Version: "v1alpha1", Resource: "secretgrants"}).Namespace(demoNS).Create(ctx, grant, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create SecretGrant: %w", err)
	}
	imm, wffc, del := storagev1.VolumeBindingImmediate, storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete
	creds := map[string]string{"csi.storage.k8s.io/provisioner-secret-name": "alpha-creds", "csi.storage.k8s.io/provisioner-secret-namespace": demoNS}
	for _, sc := range []storagev1.StorageClass{
		{ObjectMeta: metav1.ObjectMeta{Name: "alpha-fast"}, Provisioner: demoAlpha, VolumeBindingMode: &imm, ReclaimPolicy: &del, Parameters: creds},
		{ObjectMeta: metav1.ObjectMeta{Name: "beta-zonal"}, Provisioner: demoBeta, VolumeBindingMode: &wffc, ReclaimPolicy: &del, Parameters: map[string]string{"tier": "premium"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "beta-borrows-alpha-creds"}, Provisioner: demoBeta, VolumeBindingMode: &imm, ReclaimPolicy: &del, Parameters: creds},
	} {
		if _, err := c.StorageV1().StorageClasses().Create(ctx, &sc, metav1.CreateOptions{}); err != nil {
			return err
		}
	}
	for _, cl := range []struct{ name, class string }{{"alpha-1", "alpha-fast"}, {"alpha-2", "alpha-fast"}, {"beta-1", "beta-zonal"}, {"beta-denied", "beta-borrows-alpha-creds"}} {
		class := cl.class
		pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: cl.name, Namespace: demoNS}, Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}, StorageClassName: &class,
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}}}}
		if _, err := c.CoreV1().PersistentVolumeClaims(demoNS).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
			return err
		}
	}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "app", Namespace: demoNS}, Spec: corev1.PodSpec{
		Containers: []corev1.Container{{Name: "app", Image: "busybox", Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("10m")}}}},
		Volumes:    []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "beta-1"}}}}}}
	_, err = c.CoreV1().Pods(demoNS).Create(ctx, pod, metav1.CreateOptions{})
	return err
}

// watch shows the claims' progress until all expected outcomes happened.
func (d *demo) watch(ctx context.Context, c kubernetes.Interface) (bool, error) {
	d.step("waiting for the claims (alpha-1, alpha-2 Immediate; beta-1 WaitForFirstConsumer, used by pod app) and for the refusal of beta-denied")
	deadline := time.Now().Add(d.cfg.Timeout)
	last := ""
	for {
		pvcs, err := c.CoreV1().PersistentVolumeClaims(demoNS).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		bound := 0
		var line []string
		for _, p := range pvcs.Items {
			line = append(line, fmt.Sprintf("%s=%s", p.Name, p.Status.Phase))
			if p.Status.Phase == corev1.ClaimBound {
				bound++
			}
		}
		sort.Strings(line)
		denial := d.denialEvent(ctx, c)
		state := strings.Join(line, " ")
		if denial != "" {
			state += " beta-denied:refused"
		}
		if state != last {
			fmt.Fprintf(d.out, "    %s  %s\n", time.Now().Format("15:04:05"), state)
			last = state
		}
		if bound == 3 && denial != "" {
			d.step("claims")
			d.printClaims(ctx, c, pvcs.Items)
			d.step("the refused claim's Event")
			fmt.Fprintf(d.out, "    %s\n", denial)
			return true, nil
		}
		if time.Now().After(deadline) {
			d.printClaims(ctx, c, pvcs.Items)
			return false, nil
		}
		select {
		case <-ctx.Done():
			return false, ctx.Err()
		case <-d.exited:
			return false, errors.New("a component exited; see the logs")
		case <-time.After(250 * time.Millisecond):
		}
	}
}

func (d *demo) denialEvent(ctx context.Context, c kubernetes.Interface) string {
	evs, err := c.CoreV1().Events(demoNS).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=beta-denied"})
	if err != nil {
		return ""
	}
	for _, e := range evs.Items {
		if e.Reason == "ProvisioningFailed" && strings.Contains(e.Message, "denied by policy") {
			return e.Type + " " + e.Reason + ": " + e.Message
		}
	}
	return ""
}

func (d *demo) printClaims(ctx context.Context, c kubernetes.Interface, claims []corev1.PersistentVolumeClaim) {
	tw := tabwriter.NewWriter(d.out, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "    CLAIM\tSTATUS\tVOLUME\tDRIVER\tVOLUME ID\tNODE AFFINITY")
	for _, p := range claims {
		drv, id, aff := "", "", ""
		if p.Spec.VolumeName != "" {
			if pv, err := c.CoreV1().PersistentVolumes().Get(ctx, p.Spec.VolumeName, metav1.GetOptions{}); err == nil && pv.Spec.CSI != nil {
				drv, id = pv.Spec.CSI.Driver, pv.Spec.CSI.VolumeHandle
				if na := pv.Spec.NodeAffinity; na != nil && na.Required != nil {
					for _, t := range na.Required.NodeSelectorTerms {
						for _, e := range t.MatchExpressions {
							aff += e.Key + "=" + strings.Join(e.Values, ",") + " "
						}
					}
				}
			}
		}
		fmt.Fprintf(tw, "    %s\t%s\t%s\t%s\t%s\t%s\n", p.Name, p.Status.Phase, p.Spec.VolumeName, drv, id, strings.TrimSpace(aff))
	}
	tw.Flush()
}

// csiCall shows that the broker's front end serves ordinary CSI clients too.
func (d *demo) csiCall(ctx context.Context, front string) {
	conn, err := grpc.NewClient("unix://"+front, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	start := time.Now()
	r, err := csi.NewControllerClient(conn).ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil {
		fmt.Fprintf(d.out, "==> ListVolumes through the front end failed: %v\n", err)
		return
	}
	d.step("an ordinary CSI client on the broker's front-end socket %s: ListVolumes → %d volume(s) of %s in %v", front, len(r.GetEntries()), demoAlpha, time.Since(start).Round(10*time.Microsecond))
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
	d.step("broker metrics (%s, selected)", url)
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		for _, p := range []string{"csibroker_provision_operations_total{", "csibroker_secret_policy_decisions_total{", "csibroker_leader ", "csi_sidecar_operations_seconds_count{"} {
			if strings.HasPrefix(line, p) {
				fmt.Fprintln(d.out, "    "+line)
			}
		}
	}
	return sc.Err()
}

// span is the part of the console exporter's JSON the demo reads (or a
// span read from Jaeger, then with svc and kind set).
type span struct {
	svc         string
	Name        string
	SpanContext struct{ TraceID, SpanID string }
	Parent      struct{ SpanID string }
	SpanKind    int
	StartTime   time.Time
	EndTime     time.Time
	Resource    []struct {
		Key   string
		Value struct{ Value any }
	}
}

func (s span) service() string {
	if s.svc != "" {
		return s.svc
	}
	for _, r := range s.Resource {
		if r.Key == "service.name" {
			return fmt.Sprint(r.Value.Value)
		}
	}
	return "?"
}

// showTrace prints the trace of alpha-1's provisioning (its ID is in the
// claim's Events) as a tree, from the spans the broker and proxies printed.
func (d *demo) showTrace(ctx context.Context, c kubernetes.Interface) error {
	evs, err := c.CoreV1().Events(demoNS).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=alpha-1"})
	if err != nil {
		return err
	}
	traceID := ""
	for _, e := range evs.Items {
		if e.Reason == "ProvisioningSucceeded" {
			if i := strings.LastIndex(e.Message, "(trace "); i >= 0 {
				traceID = strings.TrimSuffix(e.Message[i+len("(trace "):], ")")
			}
		}
	}
	if traceID == "" {
		return errors.New("no trace ID in alpha-1's Events")
	}
	// The provisioning's own span ends last (after the PV exists), so it
	// may reach the log or Jaeger a batch after its children: wait for it.
	root := "provision " + demoNS + "/alpha-1"
	var spans []span
	from := "the broker's, proxies' and drivers' output"
	if d.jaeger != nil {
		var err error
		if spans, err = d.jaegerSpans(ctx, traceID, root); err != nil {
			return err
		}
		from = "Jaeger's query API (" + d.jaeger.QueryURL + "/api/traces/" + traceID + ")"
	}
	for end := time.Now().Add(15 * time.Second); d.jaeger == nil; {
		spans = spans[:0]
		haveRoot := false
		files, _ := filepath.Glob(filepath.Join(d.dir, "logs", "*.stdout"))
		for _, f := range files {
			fh, err := os.Open(f)
			if err != nil {
				continue
			}
			dec := json.NewDecoder(fh)
			for {
				var s span
				if err := dec.Decode(&s); err != nil {
					break
				}
				if s.SpanContext.TraceID == traceID {
					spans = append(spans, s)
					haveRoot = haveRoot || s.Name == root
				}
			}
			fh.Close()
		}
		if haveRoot && len(spans) >= 5 || time.Now().After(end) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if len(spans) == 0 {
		return fmt.Errorf("no span of trace %s was exported", traceID)
	}
	d.step("trace %s: provisioning of %s/alpha-1, %d spans from %s", traceID, demoNS, len(spans), from)
	children := map[string][]span{}
	ids := map[string]bool{}
	for _, s := range spans {
		ids[s.SpanContext.SpanID] = true
	}
	var roots []span
	for _, s := range spans {
		if s.Parent.SpanID == "" || s.Parent.SpanID == "0000000000000000" || !ids[s.Parent.SpanID] {
			roots = append(roots, s)
		} else {
			children[s.Parent.SpanID] = append(children[s.Parent.SpanID], s)
		}
	}
	kinds := map[int]string{1: "internal", 2: "server", 3: "client"}
	var walk func(s span, depth int)
	walk = func(s span, depth int) {
		fmt.Fprintf(d.out, "    %s%-*s %-30s %-8s %9s\n", strings.Repeat("  ", depth), 52-2*depth, s.Name, s.service(), kinds[s.SpanKind], s.EndTime.Sub(s.StartTime).Round(10*time.Microsecond))
		kids := children[s.SpanContext.SpanID]
		sort.Slice(kids, func(i, j int) bool { return kids[i].StartTime.Before(kids[j].StartTime) })
		for _, k := range kids {
			walk(k, depth+1)
		}
	}
	sort.Slice(roots, func(i, j int) bool { return roots[i].StartTime.Before(roots[j].StartTime) })
	for _, r := range roots {
		walk(r, 0)
	}
	if d.jaeger != nil {
		fmt.Fprintf(d.out, "    to browse it: point a Jaeger UI's query service, or a Grafana Jaeger data source (URL %s), at Jaeger's query API; search service csibroker-broker, or open trace %s\n", d.jaeger.QueryURL, traceID)
	}
	return nil
}

// jaegerSpans reads trace traceID from Jaeger, waiting up to 15s for its
// root span and a driver's span to arrive.
func (d *demo) jaegerSpans(ctx context.Context, traceID, root string) ([]span, error) {
	var tr testenv.JaegerTrace
	var err error
	for end := time.Now().Add(15 * time.Second); ; {
		tr, err = d.jaeger.Trace(ctx, traceID)
		if err == nil && slices.ContainsFunc(tr.Spans, func(s testenv.JaegerSpan) bool { return s.OperationName == root }) &&
			slices.ContainsFunc(tr.Spans, func(s testenv.JaegerSpan) bool { return strings.HasPrefix(tr.Service(s), "csibroker-sample-driver") }) {
			break
		}
		if time.Now().After(end) || ctx.Err() != nil {
			if err != nil {
				return nil, fmt.Errorf("trace %s from Jaeger: %w", traceID, err)
			}
			break // show what came
		}
		time.Sleep(200 * time.Millisecond)
	}
	kinds := map[string]int{"internal": 1, "server": 2, "client": 3}
	out := make([]span, 0, len(tr.Spans))
	for _, js := range tr.Spans {
		s := span{Name: js.OperationName, svc: tr.Service(js), StartTime: time.UnixMicro(js.StartTime)}
		s.SpanContext.TraceID, s.SpanContext.SpanID, s.Parent.SpanID = js.TraceID, js.SpanID, js.Parent()
		s.EndTime = s.StartTime.Add(time.Duration(js.Duration) * time.Microsecond)
		if k, ok := js.Tag("span.kind"); ok {
			s.SpanKind = kinds[k]
		} else {
			s.SpanKind = 1
		}
		out = append(out, s)
	}
	return out, nil
}

func (d *demo) checkNoSecret() error {
	files, err := filepath.Glob(filepath.Join(d.dir, "logs", "*"))
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
			return fmt.Errorf("the secret's value appears in %s", f)
		}
		lines += strings.Count(string(b), "\n")
	}
	if d.jaeger == nil {
		d.step("the secret's value appears in none of the %d lines of logs and exported spans", lines)
		return nil
	}
	spans, err := d.jaegerSecretFree(context.Background())
	if err != nil {
		return err
	}
	d.step("the secret's value appears in none of the %d lines of logs and the %d spans in Jaeger", lines, spans)
	return nil
}

// jaegerSecretFree checks every span Jaeger holds for the secret's value,
// and returns how many it read.
func (d *demo) jaegerSecretFree(ctx context.Context) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	services, err := d.jaeger.Services(ctx)
	if err != nil {
		return 0, fmt.Errorf("services in Jaeger: %w", err)
	}
	n, seen := 0, map[string]bool{}
	for _, svc := range services {
		traces, err := d.jaeger.Traces(ctx, svc, url.Values{"limit": {"1000"}})
		if err != nil {
			return n, fmt.Errorf("traces of %s in Jaeger: %w", svc, err)
		}
		for _, tr := range traces {
			if seen[tr.TraceID] {
				continue
			}
			seen[tr.TraceID] = true
			b, err := json.Marshal(tr)
			if err != nil {
				return n, err
			}
			if strings.Contains(string(b), demoSecret) {
				return n, fmt.Errorf("the secret's value appears in trace %s in Jaeger", tr.TraceID)
			}
			n += len(tr.Spans)
		}
	}
	return n, nil
}

// start runs a subcommand of this binary; stderr goes to logs/<name>.log and
// stdout (exported spans) to logs/<name>.stdout.
func (d *demo) start(name string, env []string, args ...string) error {
	logf, err := os.Create(filepath.Join(d.dir, "logs", name+".log"))
	if err != nil {
		return err
	}
	outf, err := os.Create(filepath.Join(d.dir, "logs", name+".stdout"))
	if err != nil {
		logf.Close()
		return err
	}
	cmd := exec.Command(d.exe, args...)
	cmd.Stdout, cmd.Stderr = outf, logf
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		outf.Close()
		return fmt.Errorf("start %s: %w", name, err)
	}
	p := &demoProc{name: name, cmd: cmd, done: make(chan struct{})}
	go func() { p.err = cmd.Wait(); logf.Close(); outf.Close(); close(p.done) }()
	d.procs = append(d.procs, p)
	fmt.Fprintf(d.out, "    started %s (pid %d)\n", name, cmd.Process.Pid)
	return nil
}

// firstExit returns a channel closed when the first of procs exits: one
// goroutine per process, each ending when its process does.
func firstExit(procs []*demoProc) <-chan struct{} {
	ch := make(chan struct{})
	var once sync.Once
	for _, p := range procs {
		go func() {
			<-p.done
			once.Do(func() { close(ch) })
		}()
	}
	return ch
}

// stopAll stops the children in reverse order (SIGTERM, then SIGKILL after
// 10s), then the control plane.
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
	if d.jaeger != nil {
		d.jaeger.Stop()
	}
	if d.env != nil {
		d.env.Stop()
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
	deadline := time.Now().Add(30 * time.Second)
	for !ok() {
		for _, p := range d.procs {
			select {
			case <-p.done:
				return fmt.Errorf("%s exited: %v (log: %s)", p.name, p.err, filepath.Join(d.dir, "logs", p.name+".log"))
			default:
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready after 30s", what)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	return nil
}

// startOnFreePorts picks n free loopback addresses and calls start with
// them. A port is free when picked, not necessarily when the component
// binds it: should another process take one meanwhile (the component then
// exits, saying the address is in use), the component is started again on
// new ports, up to three times.
func (d *demo) startOnFreePorts(ctx context.Context, what string, n int, start func(addrs []string) error) ([]string, error) {
	for try := 1; ; try++ {
		addrs := make([]string, n)
		for i := range addrs {
			a, err := freeAddr()
			if err != nil {
				return nil, err
			}
			addrs[i] = a
		}
		err := start(addrs)
		if err == nil || try == 3 || ctx.Err() != nil || len(d.procs) == 0 {
			return addrs, err
		}
		last := d.procs[len(d.procs)-1]
		select {
		case <-last.done:
		default:
			return addrs, err // still running: not a port taken
		}
		logged, _ := os.ReadFile(filepath.Join(d.dir, "logs", last.name+".log"))
		if !strings.Contains(string(logged), "address already in use") {
			return addrs, err
		}
		fmt.Fprintf(d.out, "    %s: a port was taken before it could bind it; starting it again on other ports\n", what)
		d.procs = d.procs[:len(d.procs)-1]
	}
}

func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}
