package deploy

import (
	"net"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/policy"
	"github.com/csibroker/csibroker/proxy"
)

// Flags of the broker and proxy subcommands the manifests may use.
var (
	brokerFlags = []string{
		"driver-registry", "socket-dir", "listen", "status-socket", "http-endpoint", "metrics-path",
		"timeout", "csi-retry-attempts", "csi-retry-interval-start", "csi-retry-interval-max",
		"tls-cert", "tls-key", "tls-ca", "trust-domain", "tls-reload-interval", "v", "log-format",
		"kubernetes", "kubeconfig", "kube-api-qps", "kube-api-burst", "kube-api-content-type", "events-qps", "events-burst",
		"namespace", "identity", "leader-election", "leader-election-namespace", "leader-election-mode",
		"leader-election-lease-duration", "leader-election-renew-deadline", "leader-election-retry-period",
		"volume-name-prefix", "volume-name-uuid-length", "extra-create-metadata", "strict-topology",
		"immediate-topology", "worker-threads", "per-driver-workers", "retry-interval-start",
		"retry-interval-max", "policy-mode", "policy-file", "policy-crds", "policy-opa-url",
		"policy-opa-path", "policy-reload-interval",
		"discover-proxies", "discover-proxies-namespace",
	}
	proxyFlags = []string{
		"driver-endpoint", "listen", "node", "http-endpoint", "metrics-path", "tls-cert", "tls-key",
		"tls-ca", "trust-domain", "tls-reload-interval", "v", "log-format",
		"probe-timeout", "kubelet-registration-path", "plugin-registration-path", "max-concurrent-calls",
	}
	sampleDriverFlags = []string{"endpoint", "name", "node-id", "state-dir", "topology", "capacity", "max-volumes-per-node", "fault", "exit-after", "fault-seed", "disable-publish", "nodes"}
	boolFlags         = []string{"leader-election", "extra-create-metadata", "strict-topology", "immediate-topology", "policy-crds", "disable-publish"}
	pendingFlags      = []string{}
)

// cmdSource is the text of the binary's non-test sources: subcommands and
// flags the manifests use must be registered there.
func cmdSource(t testing.TB) string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(repoRoot(t), "cmd", "csibroker", "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	shared, err := filepath.Glob(filepath.Join(repoRoot(t), "cmd", "internal", "cli", "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	files = append(files, shared...)
	var b strings.Builder
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		b.Write(data)
	}
	return b.String()
}

var (
	registerRE = regexp.MustCompile(`register\("([a-z-]+)"`)
	flagRE     = regexp.MustCompile(`fs\.\w+\((?:[^,()"]+,\s*)?"([a-z0-9-]+)"`)
	envRefRE   = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)
)

// command is a csibroker container's command line: subcommand and flags.
type command struct {
	sub   string
	flags map[string]string
}

// parseCommand checks a csibroker container's args: a subcommand the binary
// has, then only --name=value (or a bare --name for booleans) of allowed
// flags, each once, and every $(VAR) defined in the container's env.
func parseCommand(t *testing.T, where string, c corev1.Container, allowed []string) command {
	t.Helper()
	src := cmdSource(t)
	if c.Image != image {
		t.Errorf("%s: image %q, want %s", where, c.Image, image)
	}
	args := c.Args
	switch {
	case slices.Equal(c.Command, []string{"/csibroker-proxy"}):
		// The proxy binary of the image: the proxy subcommand's flags only.
		args = append([]string{"proxy"}, args...)
	case len(c.Command) > 0:
		t.Errorf("%s: command %v overrides the image's entrypoint /csibroker (only /csibroker-proxy may)", where, c.Command)
	}
	if len(args) == 0 {
		t.Fatalf("%s: no args", where)
	}
	cmd := command{sub: args[0], flags: map[string]string{}}
	var subs []string
	for _, m := range registerRE.FindAllStringSubmatch(src, -1) {
		subs = append(subs, m[1])
	}
	if !slices.Contains(subs, cmd.sub) {
		t.Errorf("%s: subcommand %q is not one of the binary's %v", where, cmd.sub, subs)
	}
	var registered []string
	for _, m := range flagRE.FindAllStringSubmatch(src, -1) {
		registered = append(registered, m[1])
	}
	env := map[string]bool{}
	for _, e := range c.Env {
		env[e.Name] = true
	}
	for _, a := range args[1:] {
		for _, m := range envRefRE.FindAllStringSubmatch(a, -1) {
			if !env[m[1]] {
				t.Errorf("%s: %q refers to $(%s), which the container's env does not define (Kubernetes would pass it literally)", where, a, m[1])
			}
		}
		if !strings.HasPrefix(a, "--") {
			t.Errorf("%s: argument %q is not a --flag", where, a)
			continue
		}
		name, value, hasValue := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !hasValue && !slices.Contains(boolFlags, name) {
			t.Errorf("%s: %q: write --%s=value (only booleans stand alone)", where, a, name)
		}
		if !hasValue {
			value = "true"
		}
		if !slices.Contains(allowed, name) {
			t.Errorf("%s: flag --%s is not a flag of %q", where, name, cmd.sub)
		}
		if !slices.Contains(registered, name) && !slices.Contains(pendingFlags, name) {
			t.Errorf("%s: flag --%s is registered nowhere in cmd/csibroker", where, name)
		}
		if _, dup := cmd.flags[name]; dup {
			t.Errorf("%s: flag --%s given twice", where, name)
		}
		cmd.flags[name] = value
	}
	return cmd
}

func (c command) require(t *testing.T, where, name string) string {
	t.Helper()
	v, ok := c.flags[name]
	if !ok {
		t.Errorf("%s: --%s is required", where, name)
	}
	return v
}

func container(t *testing.T, spec corev1.PodSpec, name string) corev1.Container {
	t.Helper()
	for _, c := range spec.Containers {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no container %q", name)
	return corev1.Container{}
}

func volume(t *testing.T, spec corev1.PodSpec, name string) corev1.Volume {
	t.Helper()
	for _, v := range spec.Volumes {
		if v.Name == name {
			return v
		}
	}
	t.Fatalf("no volume %q", name)
	return corev1.Volume{}
}

// mountOf returns the mount a file path of container c is on (the longest
// mount path that holds it).
func mountOf(c corev1.Container, file string) (corev1.VolumeMount, bool) {
	var best corev1.VolumeMount
	found := false
	for _, m := range c.VolumeMounts {
		if strings.HasPrefix(path.Clean(file), path.Clean(m.MountPath)+"/") && len(m.MountPath) > len(best.MountPath) {
			best, found = m, true
		}
	}
	return best, found
}

// containerPort resolves a probe's or Service's port (number or name).
func containerPort(t *testing.T, c corev1.Container, port string) int32 {
	t.Helper()
	for _, p := range c.Ports {
		if p.Name == port || port == itoa(p.ContainerPort) {
			return p.ContainerPort
		}
	}
	t.Errorf("container %s has no port %q", c.Name, port)
	return 0
}

func itoa(n int32) string { return strconv.Itoa(int(n)) }

func listenPort(t *testing.T, where, addr string) string {
	t.Helper()
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Errorf("%s: address %q: %v", where, addr, err)
	}
	return port
}

// tlsVolume checks that --tls-cert/--tls-key/--tls-ca are files of one
// mounted Secret (or hostPath) volume and returns that volume.
func tlsVolume(t *testing.T, where string, spec corev1.PodSpec, c corev1.Container, cmd command) corev1.Volume {
	t.Helper()
	var vol string
	for flag, key := range map[string]string{"tls-cert": "tls.crt", "tls-key": "tls.key", "tls-ca": "ca.crt"} {
		file := cmd.require(t, where, flag)
		m, ok := mountOf(c, file)
		if !ok {
			t.Errorf("%s: --%s=%s is on no volume", where, flag, file)
			continue
		}
		if !m.ReadOnly {
			t.Errorf("%s: certificate volume %s must be mounted read-only", where, m.Name)
		}
		if vol != "" && vol != m.Name {
			t.Errorf("%s: TLS files on different volumes %s and %s", where, vol, m.Name)
		}
		vol = m.Name
		if path.Base(file) != key {
			t.Errorf("%s: --%s=%s: want the file %s (the key cert-manager writes)", where, flag, file, key)
		}
		v := volume(t, spec, m.Name)
		if v.Secret != nil {
			found := len(v.Secret.Items) == 0
			for _, it := range v.Secret.Items {
				found = found || (it.Key == key && it.Path == path.Base(file))
			}
			if !found {
				t.Errorf("%s: secret volume %s does not project %s as %s", where, v.Name, key, path.Base(file))
			}
		}
	}
	return volume(t, spec, vol)
}

// hardened checks a container's security context (with the pod's).
func hardened(t *testing.T, where string, pod corev1.PodSpec, c corev1.Container, nonRoot bool) {
	t.Helper()
	sc := c.SecurityContext
	if sc == nil {
		t.Errorf("%s: no securityContext", where)
		return
	}
	if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		t.Errorf("%s: allowPrivilegeEscalation must be false", where)
	}
	if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		t.Errorf("%s: readOnlyRootFilesystem must be true", where)
	}
	if sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(sc.Capabilities.Add) > 0 {
		t.Errorf("%s: capabilities must drop ALL and add none", where)
	}
	if sc.Privileged != nil && *sc.Privileged {
		t.Errorf("%s: privileged", where)
	}
	if nonRoot {
		run := sc.RunAsNonRoot
		if run == nil && pod.SecurityContext != nil {
			run = pod.SecurityContext.RunAsNonRoot
		}
		if run == nil || !*run {
			t.Errorf("%s: runAsNonRoot must be true", where)
		}
	}
}

func hasResources(t *testing.T, where string, c corev1.Container) {
	t.Helper()
	for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		if _, ok := c.Resources.Requests[r]; !ok {
			t.Errorf("%s: no %s request", where, r)
		}
		if _, ok := c.Resources.Limits[r]; !ok {
			t.Errorf("%s: no %s limit", where, r)
		}
	}
}

// proxyProbeTimeout is how long the proxy's /healthz and /readyz wait for
// the driver's Probe: the proxy's --probe-timeout, or its default.
func proxyProbeTimeout(t *testing.T, cmd command) time.Duration {
	t.Helper()
	v, ok := cmd.flags["probe-timeout"]
	if !ok {
		return proxy.DefaultProbeTimeout
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		t.Errorf("--probe-timeout=%s: want a positive duration", v)
	}
	return d
}

func selects(t *testing.T, selector map[string]string, podLabels map[string]string) bool {
	t.Helper()
	return len(selector) > 0 && labels.SelectorFromSet(selector).Matches(labels.Set(podLabels))
}

// The broker Deployment: two leader-elected replicas, existing flags only,
// probes on the http endpoint, the certificate Secret, the registry
// ConfigMap, writable paths where it writes, hardened, and a PDB and a
// metrics Service that select its pods.
func TestBrokerDeployment(t *testing.T) {
	objs := build(t, ".")
	dep := typed[appsv1.Deployment](t, find(t, objs, "Deployment", brokerNamespace, "csibroker"))
	spec := dep.Spec.Template.Spec
	c := container(t, spec, "broker")
	const where = "broker"
	cmd := parseCommand(t, where, c, brokerFlags)
	if cmd.sub != "broker" {
		t.Fatalf("subcommand %q, want broker", cmd.sub)
	}

	if dep.Spec.Replicas == nil || *dep.Spec.Replicas != 2 {
		t.Errorf("replicas %v, want 2", dep.Spec.Replicas)
	}
	if cmd.flags["leader-election"] != "true" {
		t.Error("--leader-election is required with two replicas")
	}
	if cmd.require(t, where, "kubernetes") != "on" {
		t.Error("--kubernetes=on: in a pod the broker must run its controllers (or fail), not guess")
	}
	lease, err1 := time.ParseDuration(cmd.require(t, where, "leader-election-lease-duration"))
	renew, err2 := time.ParseDuration(cmd.require(t, where, "leader-election-renew-deadline"))
	retry, err3 := time.ParseDuration(cmd.require(t, where, "leader-election-retry-period"))
	if err1 != nil || err2 != nil || err3 != nil || !(retry < renew && renew < lease) {
		t.Errorf("leader election: want retry period < renew deadline < lease duration, got %v %v %v", retry, renew, lease)
	}
	if got := cmd.require(t, where, "discover-proxies"); got != proxySelector {
		t.Errorf("--discover-proxies=%q, want %q", got, proxySelector)
	} else if _, err := labels.Parse(got); err != nil {
		t.Errorf("--discover-proxies: %v", err)
	}
	if sel, err := labels.Parse(proxySelector); err == nil && sel.Matches(labels.Set(dep.Spec.Template.Labels)) {
		t.Error("the broker's own pods match the proxy discovery selector")
	}
	if got := cmd.require(t, where, "policy-mode"); got != "enforce" {
		t.Errorf("--policy-mode=%s: the installed default must enforce (deny by default)", got)
	}
	if got := cmd.require(t, where, "trust-domain"); got != trustDomain {
		t.Errorf("--trust-domain=%s, want %s", got, trustDomain)
	}

	t.Run("http endpoint and probes", func(t *testing.T) {
		port := listenPort(t, where, cmd.require(t, where, "http-endpoint"))
		if port != "9808" {
			t.Errorf("--http-endpoint port %s, want 9808", port)
		}
		if cmd.require(t, where, "metrics-path") != "/metrics" {
			t.Error("--metrics-path must be /metrics (the ServiceMonitor scrapes it)")
		}
		for name, p := range map[string]*corev1.Probe{"liveness": c.LivenessProbe, "readiness": c.ReadinessProbe} {
			want := map[string]string{"liveness": "/healthz", "readiness": "/readyz"}[name]
			if p == nil || p.HTTPGet == nil {
				t.Errorf("no HTTP %s probe", name)
				continue
			}
			if p.HTTPGet.Path != want || itoa(containerPort(t, c, p.HTTPGet.Port.String())) != port {
				t.Errorf("%s probe: %s on port %s, want %s on %s", name, p.HTTPGet.Path, p.HTTPGet.Port.String(), want, port)
			}
		}
		svc := typed[corev1.Service](t, find(t, objs, "Service", brokerNamespace, "csibroker-metrics"))
		if !selects(t, svc.Spec.Selector, dep.Spec.Template.Labels) {
			t.Errorf("Service selector %v does not select the broker pods %v", svc.Spec.Selector, dep.Spec.Template.Labels)
		}
		if len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Name != "http-metrics" || svc.Spec.Ports[0].Port != 9808 ||
			itoa(containerPort(t, c, svc.Spec.Ports[0].TargetPort.String())) != port {
			t.Errorf("Service ports %+v: want http-metrics 9808 → the http endpoint", svc.Spec.Ports)
		}
	})

	t.Run("PodDisruptionBudget", func(t *testing.T) {
		pdb := typed[policyv1.PodDisruptionBudget](t, find(t, objs, "PodDisruptionBudget", brokerNamespace, "csibroker"))
		if pdb.Spec.MinAvailable == nil || pdb.Spec.MinAvailable.String() != "1" || pdb.Spec.MaxUnavailable != nil {
			t.Errorf("PDB: minAvailable %v maxUnavailable %v, want minAvailable 1", pdb.Spec.MinAvailable, pdb.Spec.MaxUnavailable)
		}
		if pdb.Spec.Selector == nil || !selects(t, pdb.Spec.Selector.MatchLabels, dep.Spec.Template.Labels) {
			t.Errorf("PDB selector %v does not select the broker pods", pdb.Spec.Selector)
		}
	})

	t.Run("certificate", func(t *testing.T) {
		v := tlsVolume(t, where, spec, c, cmd)
		if v.Secret == nil || v.Secret.SecretName != "csibroker-broker-tls" {
			t.Fatalf("TLS volume %+v: want the Secret csibroker-broker-tls", v.VolumeSource)
		}
		if m, _ := mountOf(c, cmd.flags["tls-cert"]); m.MountPath != "/etc/csibroker/tls" {
			t.Errorf("certificates mounted at %s, want /etc/csibroker/tls", m.MountPath)
		}
		if v.Secret.DefaultMode == nil || *v.Secret.DefaultMode != 0o440 {
			t.Errorf("certificate files mode %v, want 0440 (key readable by the pod's group only)", v.Secret.DefaultMode)
		}
		if spec.SecurityContext == nil || spec.SecurityContext.FSGroup == nil || spec.SecurityContext.RunAsUser == nil ||
			*spec.SecurityContext.FSGroup != *spec.SecurityContext.RunAsUser {
			t.Error("fsGroup must be the user the broker runs as, or it cannot read its 0440 key")
		}
	})

	t.Run("registry", func(t *testing.T) {
		file := cmd.require(t, where, "driver-registry")
		m, ok := mountOf(c, file)
		if !ok {
			t.Fatalf("--driver-registry=%s is on no volume", file)
		}
		v := volume(t, spec, m.Name)
		if v.ConfigMap == nil {
			t.Fatalf("registry volume %s is not a ConfigMap", m.Name)
		}
		cm := typed[corev1.ConfigMap](t, find(t, objs, "ConfigMap", brokerNamespace, v.ConfigMap.Name))
		data, ok := cm.Data[strings.TrimPrefix(file, m.MountPath+"/")]
		if !ok {
			t.Fatalf("ConfigMap %s has no key for %s (keys %v)", cm.Name, file, cm.Data)
		}
		p := filepath.Join(t.TempDir(), "registry.yaml")
		if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		rc, err := broker.LoadRegistryConfig(p)
		if err != nil {
			t.Fatalf("the broker refuses its registry: %v", err)
		}
		if len(rc.Drivers) != 0 {
			t.Errorf("registry lists %d drivers; drivers come from proxy discovery for now", len(rc.Drivers))
		}
	})

	t.Run("writable paths and hardening", func(t *testing.T) {
		for _, flag := range []string{"socket-dir", "status-socket"} {
			p := cmd.require(t, where, flag)
			if flag == "socket-dir" {
				p += "/x"
			}
			m, ok := mountOf(c, p)
			if !ok || m.ReadOnly || volume(t, spec, m.Name).EmptyDir == nil {
				t.Errorf("--%s=%s must be on a writable emptyDir (the root filesystem is read-only)", flag, cmd.flags[flag])
			}
		}
		hardened(t, where, spec, c, true)
		hasResources(t, where, c)
		if spec.SecurityContext == nil || spec.SecurityContext.SeccompProfile == nil || spec.SecurityContext.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
			t.Error("pod seccompProfile must be RuntimeDefault")
		}
		env := map[string]string{}
		for _, e := range c.Env {
			if e.ValueFrom != nil && e.ValueFrom.FieldRef != nil {
				env[e.Name] = e.ValueFrom.FieldRef.FieldPath
			}
		}
		if env["POD_NAME"] != "metadata.name" || env["POD_NAMESPACE"] != "metadata.namespace" {
			t.Errorf("POD_NAME/POD_NAMESPACE from the downward API: got %v", env)
		}
		for _, vm := range c.VolumeMounts {
			volume(t, spec, vm.Name)
		}
	})
}

// The cert-manager chain: self-signed bootstrap → CA → CA issuer → broker and
// proxy certificates with the identities the code expects, short-lived, and
// the Secrets the workloads mount.
func TestCertificates(t *testing.T) {
	objs := build(t, "cert-manager")
	get := func(u *unstructured.Unstructured, fields ...string) string {
		s, _, _ := unstructured.NestedString(u.Object, fields...)
		return s
	}
	issuerOf := func(cert *unstructured.Unstructured) *unstructured.Unstructured {
		if k := get(cert, "spec", "issuerRef", "kind"); k != "Issuer" {
			t.Fatalf("%s: issuerRef kind %q, want the namespaced Issuer", describe(cert), k)
		}
		return find(t, objs, "Issuer", cert.GetNamespace(), get(cert, "spec", "issuerRef", "name"))
	}

	broker := find(t, objs, "Certificate", brokerNamespace, "csibroker-broker")
	caIssuer := issuerOf(broker)
	caSecret := get(caIssuer, "spec", "ca", "secretName")
	if caSecret == "" {
		t.Fatalf("%s is not a CA issuer", describe(caIssuer))
	}
	var caCert *unstructured.Unstructured
	for _, c := range ofKind(objs, "Certificate") {
		if get(c, "spec", "secretName") == caSecret && c.GetNamespace() == caIssuer.GetNamespace() {
			caCert = c
		}
	}
	if caCert == nil {
		t.Fatalf("no Certificate writes the CA issuer's Secret %s", caSecret)
	}
	if isCA, _, _ := unstructured.NestedBool(caCert.Object, "spec", "isCA"); !isCA {
		t.Errorf("%s: isCA must be true", describe(caCert))
	}
	if _, ok, _ := unstructured.NestedMap(issuerOf(caCert).Object, "spec", "selfSigned"); !ok {
		t.Errorf("%s must be issued by the self-signed bootstrap issuer", describe(caCert))
	}
	// Renewed with its key: leaves from the old and the renewed CA verify
	// against either while the Secrets are renewed one by one.
	if rp := get(caCert, "spec", "privateKey", "rotationPolicy"); rp != "Never" {
		t.Errorf("%s: privateKey.rotationPolicy %q: a renewal that changes the CA's key leaves peers trusting different CAs until every leaf is renewed", describe(caCert), rp)
	}

	examples := build(t, "examples")
	proxy := find(t, examples, "Certificate", brokerNamespace, "sample-csibroker-io-proxy")
	if p := find(t, objs, "Issuer", proxy.GetNamespace(), get(proxy, "spec", "issuerRef", "name")); p.GetName() != caIssuer.GetName() {
		t.Errorf("proxy certificate issued by %s, want %s", p.GetName(), caIssuer.GetName())
	}

	for _, tc := range []struct {
		cert       *unstructured.Unstructured
		id         string
		secret     string
		wantUsages []string
	}{
		{broker, mtls.BrokerID(trustDomain), "csibroker-broker-tls", []string{"client auth", "server auth"}},
		{proxy, mtls.DriverID(trustDomain, sampleDriver), "sample-csibroker-io-proxy-tls", []string{"server auth"}},
	} {
		where := describe(tc.cert)
		uris, _, _ := unstructured.NestedStringSlice(tc.cert.Object, "spec", "uris")
		if !slices.Equal(uris, []string{tc.id}) {
			t.Errorf("%s: uris %v, want exactly [%s] (one SPIFFE ID per certificate)", where, uris, tc.id)
		}
		if _, err := mtls.ParseID(tc.id); err != nil {
			t.Error(err)
		}
		if s := get(tc.cert, "spec", "secretName"); s != tc.secret {
			t.Errorf("%s: secretName %s, want %s", where, s, tc.secret)
		}
		d, err1 := time.ParseDuration(get(tc.cert, "spec", "duration"))
		rb, err2 := time.ParseDuration(get(tc.cert, "spec", "renewBefore"))
		if err1 != nil || err2 != nil || d != 24*time.Hour || rb != 8*time.Hour {
			t.Errorf("%s: duration %v renewBefore %v, want 24h and 8h", where, d, rb)
		}
		usages, _, _ := unstructured.NestedStringSlice(tc.cert.Object, "spec", "usages")
		for _, u := range tc.wantUsages {
			if !slices.Contains(usages, u) {
				t.Errorf("%s: usages %v lack %q", where, usages, u)
			}
		}
		if rp := get(tc.cert, "spec", "privateKey", "rotationPolicy"); rp != "Always" {
			t.Errorf("%s: privateKey.rotationPolicy %q: a renewal must also replace the key", where, rp)
		}
	}
}

// The examples: discovery labels and annotations the broker looks for, the
// proxy sharing the driver's socket, no Kubernetes credentials in driver
// pods, and a StorageClass whose secret the SecretGrant admits for the
// tenant and nobody else.
func TestExamples(t *testing.T) {
	objs := build(t, "examples")
	selector, err := labels.Parse(proxySelector)
	if err != nil {
		t.Fatal(err)
	}

	type workload struct {
		name      string
		namespace string
		template  corev1.PodTemplateSpec
		selector  map[string]string
		nodeSide  bool
	}
	ctrl := typed[appsv1.Deployment](t, find(t, objs, "Deployment", brokerNamespace, "sample-csi-controller"))
	node := typed[appsv1.DaemonSet](t, find(t, objs, "DaemonSet", "sample-csi", "sample-csi-node"))
	if ctrl.Spec.Strategy.Type != appsv1.RecreateDeploymentStrategyType {
		t.Errorf("controller Deployment strategy %q, want Recreate: a rolling update runs two controllers of a single-instance driver at once", ctrl.Spec.Strategy.Type)
	}
	for _, w := range []workload{
		{"controller Deployment", ctrl.Namespace, ctrl.Spec.Template, ctrl.Spec.Selector.MatchLabels, false},
		{"node DaemonSet", node.Namespace, node.Spec.Template, node.Spec.Selector.MatchLabels, true},
	} {
		t.Run(w.name, func(t *testing.T) {
			pod := w.template
			spec := pod.Spec
			if !selector.Matches(labels.Set(pod.Labels)) {
				t.Errorf("pod labels %v do not match the broker's --discover-proxies=%s", pod.Labels, proxySelector)
			}
			// The discovery label is added to the template only: a
			// driver's existing workload keeps its immutable selector.
			reqs, _ := selector.Requirements()
			for _, r := range reqs {
				if _, ok := w.selector[r.Key()]; ok {
					t.Errorf("the workload's selector uses the discovery label %s; an existing driver's could not take it", r.Key())
				}
			}
			if pod.Annotations["csibroker.io/driver"] != sampleDriver {
				t.Errorf("annotation csibroker.io/driver=%q, want %s", pod.Annotations["csibroker.io/driver"], sampleDriver)
			}
			if got := pod.Annotations["csibroker.io/node-proxy"]; (got == "true") != w.nodeSide {
				t.Errorf("annotation csibroker.io/node-proxy=%q", got)
			}
			if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
				t.Error("driver pods must not get a service account token: driver code needs no Kubernetes credentials")
			}
			sa := typed[corev1.ServiceAccount](t, find(t, objs, "ServiceAccount", w.namespace, spec.ServiceAccountName))
			if sa.AutomountServiceAccountToken == nil || *sa.AutomountServiceAccountToken {
				t.Errorf("ServiceAccount %s must disable token automounting", sa.Name)
			}

			p := container(t, spec, "csibroker-proxy")
			cmd := parseCommand(t, w.name+" proxy", p, proxyFlags)
			if cmd.sub != "proxy" {
				t.Fatalf("subcommand %q, want proxy", cmd.sub)
			}
			port := listenPort(t, "proxy", cmd.require(t, "proxy", "listen"))
			if pod.Annotations["csibroker.io/proxy-port"] != port || port != "7443" {
				t.Errorf("annotation csibroker.io/proxy-port=%q, --listen port %s: want both 7443", pod.Annotations["csibroker.io/proxy-port"], port)
			}
			if itoa(containerPort(t, p, "csi-proxy")) != port {
				t.Errorf("container port csi-proxy is not the --listen port %s", port)
			}
			if listenPort(t, "proxy", cmd.require(t, "proxy", "http-endpoint")) != "9809" || itoa(containerPort(t, p, "proxy-metrics")) != "9809" {
				t.Error("proxy http endpoint and port proxy-metrics must be 9809")
			}
			if cmd.require(t, "proxy", "trust-domain") != trustDomain {
				t.Errorf("--trust-domain=%s, want %s", cmd.flags["trust-domain"], trustDomain)
			}
			// The proxy's liveness is its own (/livez); the driver's is
			// /healthz/driver (below): a hung driver must not restart
			// the proxy, nor a lost registration the driver.
			for name, probe := range map[string]*corev1.Probe{"/livez": p.LivenessProbe, "/readyz": p.ReadinessProbe} {
				if probe == nil || probe.HTTPGet == nil || probe.HTTPGet.Path != name || probe.HTTPGet.Port.String() != "proxy-metrics" {
					t.Errorf("proxy probe %s on proxy-metrics missing", name)
				}
			}
			// /readyz answers once the driver's Probe has, or after the
			// proxy's probe timeout: the kubelet must wait longer, or a
			// slow Probe reads as a failed one (the kubelet's default
			// timeout is 1s).
			if rp := p.ReadinessProbe; rp != nil {
				if got, want := time.Duration(rp.TimeoutSeconds)*time.Second, proxyProbeTimeout(t, cmd); got <= want {
					t.Errorf("proxy readinessProbe timeoutSeconds %d: want more than /readyz's %v", rp.TimeoutSeconds, want)
				}
			}
			nodeFlag, hasNode := cmd.flags["node"]
			if w.nodeSide {
				if nodeFlag != "$(NODE_NAME)" {
					t.Errorf("--node=%q, want $(NODE_NAME)", nodeFlag)
				}
				for _, e := range p.Env {
					if e.Name == "NODE_NAME" && (e.ValueFrom == nil || e.ValueFrom.FieldRef == nil || e.ValueFrom.FieldRef.FieldPath != "spec.nodeName") {
						t.Error("NODE_NAME must come from spec.nodeName")
					}
				}
			} else if hasNode {
				t.Error("a controller proxy takes no --node")
			}
			hardened(t, w.name+" proxy", spec, p, !w.nodeSide)
			hasResources(t, w.name+" proxy", p)

			// The driver listens where the proxy dials, on a shared volume.
			d := container(t, spec, "driver")
			dcmd := parseCommand(t, w.name+" driver", d, sampleDriverFlags)
			endpoint := dcmd.require(t, "driver", "endpoint")
			if cmd.require(t, "proxy", "driver-endpoint") != endpoint || !strings.HasPrefix(endpoint, "unix:///") {
				t.Errorf("proxy --driver-endpoint=%s, driver --endpoint=%s: want the same unix socket", cmd.flags["driver-endpoint"], endpoint)
			}
			sock := strings.TrimPrefix(endpoint, "unix://")
			dm, ok1 := mountOf(d, sock)
			pm, ok2 := mountOf(p, sock)
			if !ok1 || !ok2 || dm.Name != pm.Name || dm.MountPath != pm.MountPath {
				t.Errorf("socket %s is not on one volume shared by driver and proxy (%v %v)", sock, dm, pm)
			}
			if dcmd.require(t, "driver", "name") != sampleDriver {
				t.Errorf("driver --name=%s, want %s", dcmd.flags["name"], sampleDriver)
			}
			hasResources(t, w.name+" driver", d)

			// Only the driver and the proxy: no sidecar is left.
			var names []string
			for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
				names = append(names, c.Name)
				for _, gone := range []string{"node-driver-registrar", "livenessprobe", "csi-provisioner", "csi-attacher", "csi-resizer", "csi-snapshotter", "health-monitor"} {
					if strings.Contains(c.Image, gone) || strings.Contains(c.Name, gone) {
						t.Errorf("container %s (%s): the proxy replaces %s", c.Name, c.Image, gone)
					}
				}
			}
			if !slices.Equal(names, []string{"driver", "csibroker-proxy"}) {
				t.Errorf("containers %v, want only driver and csibroker-proxy", names)
			}

			// The driver's liveness comes from the proxy, which probes it.
			timeout := proxyProbeTimeout(t, cmd)
			if lp := d.LivenessProbe; lp == nil || lp.HTTPGet == nil || lp.HTTPGet.Path != "/healthz/driver" ||
				lp.HTTPGet.Port.String() != listenPort(t, "proxy", cmd.flags["http-endpoint"]) {
				t.Errorf("driver livenessProbe %+v: want /healthz/driver on the proxy's http endpoint port (a number: a name is looked up in the driver's own ports)", lp)
			} else if got := time.Duration(lp.TimeoutSeconds) * time.Second; got <= timeout {
				t.Errorf("driver livenessProbe timeoutSeconds %d: want more than the proxy's --probe-timeout %v", lp.TimeoutSeconds, timeout)
			}

			// Node plugins register with the kubelet through the proxy:
			// the driver's socket as the kubelet sees it, and the
			// kubelet's registry, writable.
			regPath, hasReg := cmd.flags["kubelet-registration-path"]
			switch {
			case !w.nodeSide && hasReg:
				t.Error("a controller proxy does not register with the kubelet")
			case w.nodeSide && !hasReg:
				t.Error("a node proxy needs --kubelet-registration-path, or the kubelet never finds the driver")
			case w.nodeSide:
				if hv := volume(t, spec, dm.Name).HostPath; hv == nil || path.Join(hv.Path, strings.TrimPrefix(sock, dm.MountPath)) != regPath {
					t.Errorf("--kubelet-registration-path=%s is not the host path of the driver's socket %s (volume %s)", regPath, sock, dm.Name)
				}
				dir := cmd.require(t, "proxy", "plugin-registration-path")
				var m *corev1.VolumeMount
				for i := range p.VolumeMounts {
					if p.VolumeMounts[i].MountPath == dir {
						m = &p.VolumeMounts[i]
					}
				}
				if m == nil || m.ReadOnly {
					t.Fatalf("--plugin-registration-path=%s: want a writable mount there, got %+v", dir, m)
				}
				if hv := volume(t, spec, m.Name).HostPath; hv == nil || hv.Path != proxy.DefaultPluginRegistrationDir {
					t.Errorf("registration volume %s: want the hostPath %s", m.Name, proxy.DefaultPluginRegistrationDir)
				}
			}

			v := tlsVolume(t, w.name+" proxy", spec, p, cmd)
			if w.nodeSide {
				if v.HostPath == nil {
					t.Errorf("node proxy certificates: want a hostPath (one identity per node), got %+v", v.VolumeSource)
				}
			} else if v.Secret == nil || v.Secret.SecretName != "sample-csibroker-io-proxy-tls" {
				t.Errorf("controller proxy certificates: want the Secret sample-csibroker-io-proxy-tls, got %+v", v.VolumeSource)
			}
		})
	}

	t.Run("CSIDriver", func(t *testing.T) {
		find(t, objs, "CSIDriver", "", sampleDriver)
	})

	t.Run("StorageClass secret and SecretGrant", func(t *testing.T) {
		sc := typed[storagev1.StorageClass](t, find(t, objs, "StorageClass", "", "csibroker-sample"))
		if sc.Provisioner != sampleDriver {
			t.Errorf("provisioner %s, want %s", sc.Provisioner, sampleDriver)
		}
		secretName := sc.Parameters["csi.storage.k8s.io/provisioner-secret-name"]
		secretNS := sc.Parameters["csi.storage.k8s.io/provisioner-secret-namespace"]
		find(t, objs, "Secret", secretNS, secretName)
		pvc := typed[corev1.PersistentVolumeClaim](t, find(t, objs, "PersistentVolumeClaim", "sample-app", "data"))
		if pvc.Spec.StorageClassName == nil || *pvc.Spec.StorageClassName != sc.Name {
			t.Errorf("claim uses StorageClass %v, want %s", pvc.Spec.StorageClassName, sc.Name)
		}

		grantObj := find(t, objs, "SecretGrant", secretNS, "sample-provisioner")
		data, err := yaml.Marshal(grantObj.Object)
		if err != nil {
			t.Fatal(err)
		}
		grants, err := policy.ParseGrants(data)
		if err != nil {
			t.Fatalf("the broker's policy loader refuses the example grant: %v", err)
		}
		rules, errs := policy.Compile(grants)
		if len(errs) > 0 {
			t.Fatalf("the example grant does not compile: %v", errs)
		}
		base := policy.Request{
			Driver: sampleDriver,
			Secret: policy.SecretRef{Namespace: secretNS, Name: secretName},
			Source: policy.Source{Kind: policy.SourceStorageClassParameter, Key: "csi.storage.k8s.io/provisioner-secret-name"},
			Requester: policy.Requester{
				Kind: policy.KindPersistentVolumeClaim, Namespace: pvc.Namespace, Name: pvc.Name,
				NamespaceLabels: map[string]string{}, StorageClass: sc.Name,
			},
		}
		for _, tc := range []struct {
			name  string
			edit  func(r *policy.Request)
			allow bool
		}{
			{"CreateVolume for the tenant's claim", func(r *policy.Request) { r.Operation = policy.OpCreateVolume }, true},
			{"DeleteVolume of the tenant's volume", func(r *policy.Request) {
				r.Operation = policy.OpDeleteVolume
				r.Requester.Kind, r.Requester.Name = policy.KindPersistentVolume, "pvc-1234"
			}, true},
			{"another namespace", func(r *policy.Request) { r.Operation, r.Requester.Namespace = policy.OpCreateVolume, "other-team" }, false},
			{"another driver", func(r *policy.Request) { r.Operation, r.Driver = policy.OpCreateVolume, "other.csi.example.com" }, false},
			{"another operation", func(r *policy.Request) { r.Operation = policy.OpNodeStageVolume }, false},
			{"another StorageClass", func(r *policy.Request) { r.Operation, r.Requester.StorageClass = policy.OpCreateVolume, "other" }, false},
			{"another secret", func(r *policy.Request) { r.Operation, r.Secret.Name = policy.OpCreateVolume, "other-creds" }, false},
		} {
			req := base
			tc.edit(&req)
			if d := rules.Decide(req); d.Allowed != tc.allow {
				t.Errorf("%s: allowed=%v, want %v (%s)", tc.name, d.Allowed, tc.allow, d.Reason)
			}
		}
	})
}

// The monitoring objects scrape what the base and the examples expose.
func TestMonitoringWiring(t *testing.T) {
	mon := build(t, "monitoring")
	base := build(t, "base")
	examples := build(t, "examples")

	sm := find(t, mon, "ServiceMonitor", brokerNamespace, "csibroker")
	svc := typed[corev1.Service](t, find(t, base, "Service", brokerNamespace, "csibroker-metrics"))
	sel, _, _ := unstructured.NestedStringMap(sm.Object, "spec", "selector", "matchLabels")
	if !selects(t, sel, svc.Labels) {
		t.Errorf("ServiceMonitor selector %v does not select Service labels %v", sel, svc.Labels)
	}
	nsNames, _, _ := unstructured.NestedStringSlice(sm.Object, "spec", "namespaceSelector", "matchNames")
	if !slices.Contains(nsNames, svc.Namespace) {
		t.Errorf("ServiceMonitor namespaces %v lack %s", nsNames, svc.Namespace)
	}
	eps, _, _ := unstructured.NestedSlice(sm.Object, "spec", "endpoints")
	if len(eps) != 1 || eps[0].(map[string]any)["port"] != svc.Spec.Ports[0].Name || eps[0].(map[string]any)["path"] != "/metrics" {
		t.Errorf("ServiceMonitor endpoints %v: want port %s path /metrics", eps, svc.Spec.Ports[0].Name)
	}

	pm := find(t, mon, "PodMonitor", brokerNamespace, "csibroker-proxies")
	psel, _, _ := unstructured.NestedStringMap(pm.Object, "spec", "selector", "matchLabels")
	// Only where the broker discovers proxies: a labelled pod elsewhere is
	// trusted by neither.
	full := build(t, ".")
	dep := typed[appsv1.Deployment](t, find(t, full, "Deployment", brokerNamespace, "csibroker"))
	discovered := strings.Split(parseCommand(t, "broker", container(t, dep.Spec.Template.Spec, "broker"), brokerFlags).flags["discover-proxies-namespace"], ",")
	pmNS, _, _ := unstructured.NestedStringSlice(pm.Object, "spec", "namespaceSelector", "matchNames")
	if any, _, _ := unstructured.NestedBool(pm.Object, "spec", "namespaceSelector", "any"); any || !slices.Equal(slices.Sorted(slices.Values(pmNS)), slices.Sorted(slices.Values(discovered))) {
		t.Errorf("PodMonitor namespaces %v (any: %v), want the broker's --discover-proxies-namespace %v", pmNS, any, discovered)
	}
	pes, _, _ := unstructured.NestedSlice(pm.Object, "spec", "podMetricsEndpoints")
	if len(pes) != 1 {
		t.Fatalf("PodMonitor endpoints %v", pes)
	}
	port := pes[0].(map[string]any)["port"]
	targets := map[string]bool{}
	rels, _ := pes[0].(map[string]any)["relabelings"].([]any)
	for _, r := range rels {
		targets[r.(map[string]any)["targetLabel"].(string)] = true
	}
	for _, l := range proxyTargetLabels {
		if !targets[l] {
			t.Errorf("PodMonitor relabelings do not set %q, which the dashboard groups proxy metrics by", l)
		}
	}
	templates := []corev1.PodTemplateSpec{
		typed[appsv1.Deployment](t, find(t, examples, "Deployment", brokerNamespace, "sample-csi-controller")).Spec.Template,
		typed[appsv1.DaemonSet](t, find(t, examples, "DaemonSet", "sample-csi", "sample-csi-node")).Spec.Template,
	}
	for _, tpl := range templates {
		if !selects(t, psel, tpl.Labels) {
			t.Errorf("PodMonitor selector %v does not select proxy pods %v", psel, tpl.Labels)
		}
		p := container(t, tpl.Spec, "csibroker-proxy")
		if containerPort(t, p, port.(string)) == 0 {
			t.Errorf("proxy container has no port %v", port)
		}
	}

	cm := typed[corev1.ConfigMap](t, find(t, mon, "ConfigMap", brokerNamespace, "csibroker-grafana-dashboard"))
	file, err := os.ReadFile(deployDir(t, filepath.Join("monitoring", "grafana-dashboard.json")))
	if err != nil {
		t.Fatal(err)
	}
	if cm.Data["grafana-dashboard.json"] != string(file) || cm.Labels["grafana_dashboard"] != "1" {
		t.Error("dashboard ConfigMap must carry grafana-dashboard.json unchanged, labelled grafana_dashboard=1")
	}
	// kubectl's client-side apply copies the object into an annotation,
	// and annotations are limited to 256 KiB in all.
	if len(file) > 200<<10 {
		t.Errorf("dashboard is %d bytes: too big for kubectl apply's last-applied annotation", len(file))
	}
}
