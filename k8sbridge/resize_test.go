package k8sbridge

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
	"github.com/csibroker/csibroker/k8sbridge/resize"
	"github.com/csibroker/csibroker/policy"
)

const resizeCanary = "CANARY-expand-secret-51c7"

// TestResizeBoundClaimEndToEnd: claims provisioned by the broker are
// expanded when their request grows. The sample driver asks for a node step
// (the claim waits for the kubelet: NodeResizePending); a driver that needs
// none (the same driver behind a shim that clears node_expansion_required)
// finishes the expansion on the controller; a driver without controller
// expansion gets no CSI call. The controller-expand secret
// comes from the PV and goes through policy; a denied secret stops the
// expansion before anything is written or called; the secret's value
// appears in no Event, API object, log line (bridge, brokers and proxies
// logging at every level), span or metric. Each expansion costs three API
// writes, the claim's through the status subresource.
func TestResizeBoundClaimEndToEnd(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drvNode, drvCtrl := kubetest.ClusterName(ns, "node.csi.test"), kubetest.ClusterName(ns, "ctrl.csi.test")
	drvNodeOnly := kubetest.ClusterName(ns, "nodeonly.csi.test")
	spy := &resizeSpy{testDrivers: &testDrivers{}, noNodeStep: map[string]bool{drvCtrl: true}, nodeOnly: map[string]bool{drvNodeOnly: true}}
	dNode := spy.addDriver(t, sampledriver.Config{Name: drvNode}, verboseChain)
	dCtrl := spy.addDriver(t, sampledriver.Config{Name: drvCtrl}, verboseChain)
	dNodeOnly := spy.addDriver(t, sampledriver.Config{Name: drvNodeOnly}, verboseChain)

	kubetest.CreatePasswordSecrets(t, c, ns, resizeCanary, "expand-ok", "expand-forbidden")
	authz := kubetest.GrantsAuthorizer(t, policy.Grant{Namespace: ns, Name: "expand", Spec: policy.GrantSpec{
		Drivers: []string{drvNode, drvCtrl}, SecretNames: []string{"expand-ok"}, Operations: []policy.Operation{policy.OpControllerExpandVolume},
		Requesters: policy.Requesters{Namespaces: []string{ns}}}})
	writes := &resizeWrites{}
	r := startBridge(t, env, ns, spy, bridgeOpts{policy: authz, allLogs: true, configureCfg: func(cfg *Config) {
		cfg.Client = writes.client(t, env)
		cfg.EventClient = c
	}})

	classNode := makeResizeClass(t, c, kubetest.ClusterName(ns, "node"), drvNode, ns, "expand-ok")
	classCtrl := makeResizeClass(t, c, kubetest.ClusterName(ns, "ctrl"), drvCtrl, ns, "expand-ok")
	classDenied := makeResizeClass(t, c, kubetest.ClusterName(ns, "denied"), drvNode, ns, "expand-forbidden")
	classNodeOnly := makeResizeClass(t, c, kubetest.ClusterName(ns, "nodeonly"), drvNodeOnly, "", "")
	kubetest.MakeClaim(t, c, ns, "node", classNode, "1Gi")
	kubetest.MakeClaim(t, c, ns, "ctrl", classCtrl, "1Gi")
	kubetest.MakeClaim(t, c, ns, "denied", classDenied, "1Gi")
	kubetest.MakeClaim(t, c, ns, "nodeonly", classNodeOnly, "1Gi")
	claims := []string{"node", "ctrl", "denied", "nodeonly"}
	pvOf := map[string]string{}
	for _, name := range claims {
		pvOf[name] = kubetest.WaitBound(t, c, ns, name, 60*time.Second).Spec.VolumeName
	}
	pvNode, err := c.CoreV1().PersistentVolumes().Get(ctx, pvOf["node"], metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if ref := pvNode.Spec.CSI.ControllerExpandSecretRef; ref == nil || ref.Name != "expand-ok" || ref.Namespace != ns {
		t.Fatalf("PV controllerExpandSecretRef %+v", ref)
	}
	before := writes.snapshot()
	for _, name := range claims {
		raiseRequest(t, c, ns, name, "2Gi")
	}

	// Node step required: PV and volume grow, the claim waits for the kubelet.
	claim := waitClaim(t, c, ns, "node", "NodeResizePending with FileSystemResizePending", func(pvc *corev1.PersistentVolumeClaim) bool {
		return pvc.Status.AllocatedResourceStatuses[corev1.ResourceStorage] == corev1.PersistentVolumeClaimNodeResizePending &&
			kubetest.HasClaimCondition(pvc, corev1.PersistentVolumeClaimFileSystemResizePending)
	})
	if q := claim.Status.AllocatedResources[corev1.ResourceStorage]; q.Cmp(resource.MustParse("2Gi")) != 0 {
		t.Errorf("allocatedResources %s, want 2Gi", q.String())
	}
	if q := claim.Status.Capacity[corev1.ResourceStorage]; q.Cmp(resource.MustParse("1Gi")) != 0 {
		t.Errorf("status capacity %s: the kubelet, not the controller, finishes a node expansion", q.String())
	}
	if kubetest.HasClaimCondition(claim, corev1.PersistentVolumeClaimControllerResizeError) {
		t.Errorf("conditions %+v", claim.Status.Conditions)
	}
	checkResizedVolume(t, c, pvOf["node"], dNode, 2<<30)
	seen := spy.requests(pvNode.Spec.CSI.VolumeHandle)
	if len(seen) == 0 {
		t.Fatalf("no ControllerExpandVolume call for %s", pvOf["node"])
	}
	for _, s := range seen {
		if s.requiredBytes != 2<<30 || !s.mount || s.mode != csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER || s.secret != resizeCanary || s.code != codes.OK {
			t.Errorf("ControllerExpandVolume request %v (secret passed: %v): want 2Gi, a mount capability, SINGLE_NODE_MULTI_WRITER (RWO on a driver with that capability, as at provisioning) and the controller-expand secret", s, s.secret == resizeCanary)
		}
	}
	ev := kubetest.WaitEvent(t, c, ns, "node", "Resizing", "External resizer is resizing volume "+pvOf["node"])
	if !strings.Contains(ev.Message, "(trace ") {
		t.Errorf("event without trace ID: %s", ev.Message)
	}
	kubetest.WaitEvent(t, c, ns, "node", "FileSystemResizeRequired", "Require file system resize of volume on node")
	// kube-controller-manager's expand controller leaves CSI volumes to us.
	kubetest.WaitEvent(t, c, ns, "node", "ExternalExpanding", "waiting for an external controller")

	// No node step: the controller finishes the expansion.
	claim = waitClaim(t, c, ns, "ctrl", "status capacity 2Gi", func(pvc *corev1.PersistentVolumeClaim) bool {
		q := pvc.Status.Capacity[corev1.ResourceStorage]
		return q.Cmp(resource.MustParse("2Gi")) == 0
	})
	for _, cond := range claim.Status.Conditions {
		if resize.IsCondition(cond.Type) {
			t.Errorf("resize condition left after a finished expansion: %+v", cond)
		}
	}
	if s, ok := claim.Status.AllocatedResourceStatuses[corev1.ResourceStorage]; ok {
		t.Errorf("allocatedResourceStatuses[storage] = %s after a finished expansion", s)
	}
	if claim.Annotations[kube.AnnNodeExpansionNotRequired] != "true" {
		t.Errorf("annotations %v: want %s", claim.Annotations, kube.AnnNodeExpansionNotRequired)
	}
	checkResizedVolume(t, c, pvOf["ctrl"], dCtrl, 2<<30)
	kubetest.WaitEvent(t, c, ns, "ctrl", "VolumeResizeSuccessful", "Resize volume succeeded")

	// A driver that expands on the node only: no controller call, the PV
	// grows, the kubelet does the rest (external-resizer's trivial resizer).
	waitClaim(t, c, ns, "nodeonly", "NodeResizePending", func(pvc *corev1.PersistentVolumeClaim) bool {
		return pvc.Status.AllocatedResourceStatuses[corev1.ResourceStorage] == corev1.PersistentVolumeClaimNodeResizePending
	})
	if pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvOf["nodeonly"], metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	} else if q := pv.Spec.Capacity[corev1.ResourceStorage]; q.Cmp(resource.MustParse("2Gi")) != 0 {
		t.Errorf("node-only PV capacity %s, want 2Gi", q.String())
	}
	if n := dNodeOnly.CallCount("ControllerExpandVolume"); n != 0 {
		t.Errorf("ControllerExpandVolume called %d times on a driver without the capability", n)
	}

	// Denied secret: an Event says which rule denied what, nothing else.
	ev = kubetest.WaitEvent(t, c, ns, "denied", "VolumeResizeFailed", "denied by policy")
	for _, w := range []string{ns + "/expand-forbidden", drvNode, "ControllerExpandVolume", pvOf["denied"]} {
		if !strings.Contains(ev.Message, w) {
			t.Errorf("event %q does not say %q", ev.Message, w)
		}
	}
	denied, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "denied", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(denied.Status.AllocatedResources) != 0 || len(denied.Status.AllocatedResourceStatuses) != 0 || len(denied.Status.Conditions) != 0 {
		t.Errorf("denied claim status %+v: nothing may be recorded before the secret is allowed", denied.Status)
	}
	pvDenied, err := c.CoreV1().PersistentVolumes().Get(ctx, pvOf["denied"], metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if n := len(spy.requests(pvDenied.Spec.CSI.VolumeHandle)); n != 0 {
		t.Errorf("driver called %d times with a denied secret", n)
	}
	checkResizedVolume(t, c, pvOf["denied"], dNode, 1<<30)

	// API writes per expansion, as external-resizer: claim status, PV, claim status.
	after := writes.snapshot()
	for _, name := range claims {
		claimStatus := after.count("/namespaces/"+ns+"/persistentvolumeclaims/"+name+"/status") - before.count("/namespaces/"+ns+"/persistentvolumeclaims/"+name+"/status")
		claimMain := after.count("/namespaces/"+ns+"/persistentvolumeclaims/"+name) - before.count("/namespaces/"+ns+"/persistentvolumeclaims/"+name)
		pv := after.count("/persistentvolumes/"+pvOf[name]) - before.count("/persistentvolumes/"+pvOf[name])
		want := [3]int{2, 0, 1}
		if name == "denied" {
			want = [3]int{}
		}
		if got := [3]int{claimStatus, claimMain, pv}; got != want {
			t.Errorf("claim %s: writes to claim status, claim, PV = %v, want %v", name, got, want)
		}
		t.Logf("claim %s: %d claim status writes, %d claim writes, %d PV writes", name, claimStatus, claimMain, pv)
	}

	if got := r.metricValue(t, "csibroker_resize_operations_total", map[string]string{"driver": drvNode, "result": "node_pending"}); got < 1 {
		t.Errorf("node_pending expansions counted: %v", got)
	}
	if got := r.metricValue(t, "csibroker_resize_operations_total", map[string]string{"driver": drvCtrl, "result": "success"}); got < 1 {
		t.Errorf("successful expansions counted: %v", got)
	}
	assertNoCanary(t, c, ns, r, spy.testDrivers, resizeCanary)
}

// TestResizeDriverErrorOnClaim: a driver error reaches the claim as a
// VolumeResizeFailed Event with the driver's code and message, and in its
// status: an infeasible size (InvalidArgument) marks the expansion
// ControllerResizeInfeasible with a ControllerResizeError condition, and a
// lower request is then tried; an error after which the driver may still be
// working (ResourceExhausted) keeps it ControllerResizeInProgress at the same
// size. Both are retried with backoff, the retries cost no API write, and
// the broker keeps running.
func TestResizeDriverErrorOnClaim(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drvBad, drvSmall := kubetest.ClusterName(ns, "bad.csi.test"), kubetest.ClusterName(ns, "small.csi.test")
	spy := &resizeSpy{testDrivers: &testDrivers{}}
	dBad := spy.addDriver(t, sampledriver.Config{Name: drvBad, Faults: sampledriver.Faults{Methods: map[string]sampledriver.Fault{
		"ControllerExpandVolume": {Rate: 1, Code: codes.InvalidArgument}}}})
	dSmall := spy.addDriver(t, sampledriver.Config{Name: drvSmall, CapacityBytes: 2 << 30})
	writes := &resizeWrites{}
	r := startBridge(t, env, ns, spy, bridgeOpts{configureCfg: func(cfg *Config) {
		cfg.Client = writes.client(t, env)
		cfg.EventClient = c
	}})

	kubetest.MakeClaim(t, c, ns, "bad", makeResizeClass(t, c, kubetest.ClusterName(ns, "bad"), drvBad, "", ""), "1Gi")
	kubetest.MakeClaim(t, c, ns, "small", makeResizeClass(t, c, kubetest.ClusterName(ns, "small"), drvSmall, "", ""), "1Gi")
	pvBad := kubetest.WaitBound(t, c, ns, "bad", 60*time.Second).Spec.VolumeName
	pvSmall := kubetest.WaitBound(t, c, ns, "small", 60*time.Second).Spec.VolumeName
	before := writes.snapshot()
	raiseRequest(t, c, ns, "bad", "2Gi")
	raiseRequest(t, c, ns, "small", "4Gi")

	// Infeasible: Event with the driver's message, status says so.
	ev := kubetest.WaitEvent(t, c, ns, "bad", "VolumeResizeFailed", "InvalidArgument")
	for _, w := range []string{"sample driver: injected fault in ControllerExpandVolume", pvBad, drvBad} {
		if !strings.Contains(ev.Message, w) {
			t.Errorf("event %q does not say %q", ev.Message, w)
		}
	}
	claim := waitClaim(t, c, ns, "bad", "ControllerResizeInfeasible", func(pvc *corev1.PersistentVolumeClaim) bool {
		return pvc.Status.AllocatedResourceStatuses[corev1.ResourceStorage] == corev1.PersistentVolumeClaimControllerResizeInfeasible
	})
	cond := kubetest.ClaimCondition(claim, corev1.PersistentVolumeClaimControllerResizeError)
	if cond == nil || !strings.Contains(cond.Message, "InvalidArgument") || !strings.Contains(cond.Message, "injected fault") {
		t.Errorf("ControllerResizeError condition %+v", cond)
	}
	if q := claim.Status.AllocatedResources[corev1.ResourceStorage]; q.Cmp(resource.MustParse("2Gi")) != 0 {
		t.Errorf("allocatedResources %s, want 2Gi", q.String())
	}
	waitCalls(t, dBad, 3) // retried with backoff
	checkResizedVolume(t, c, pvBad, dBad, 1<<30)
	if n := writes.since(before, "/namespaces/"+ns+"/persistentvolumeclaims/bad/status"); n != 2 {
		t.Errorf("claim bad: %d status writes after %d attempts, want 2 (retrying the same failure writes nothing)", n, dBad.CallCount("ControllerExpandVolume"))
	}

	// Recovery: the user lowers the request; the lower size is tried.
	mid := writes.snapshot()
	raiseRequest(t, c, ns, "bad", "1536Mi")
	err := testenv.WaitFor(context.Background(), 60*time.Second, "ControllerExpandVolume for 1536Mi", func(ctx context.Context) (bool, string, error) {
		for _, s := range spy.requests(volumeHandle(t, c, pvBad)) {
			if s.requiredBytes == 1536<<20 {
				return true, "", nil
			}
		}
		return false, fmt.Sprint(spy.requests(volumeHandle(t, c, pvBad))), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	waitClaim(t, c, ns, "bad", "allocatedResources 1536Mi, infeasible", func(pvc *corev1.PersistentVolumeClaim) bool {
		q := pvc.Status.AllocatedResources[corev1.ResourceStorage]
		return q.Cmp(resource.MustParse("1536Mi")) == 0 &&
			pvc.Status.AllocatedResourceStatuses[corev1.ResourceStorage] == corev1.PersistentVolumeClaimControllerResizeInfeasible
	})
	if n := writes.since(mid, "/namespaces/"+ns+"/persistentvolumeclaims/bad/status"); n != 2 {
		t.Errorf("claim bad: %d status writes for the lowered request, want 2", n)
	}

	// May still be in progress: Event, status stays in progress at 4Gi.
	ev = kubetest.WaitEvent(t, c, ns, "small", "VolumeResizeFailed", "ResourceExhausted")
	if !strings.Contains(ev.Message, "insufficient capacity") {
		t.Errorf("event %q does not carry the driver's message", ev.Message)
	}
	waitCalls(t, dSmall, 2)
	claim, err = c.CoreV1().PersistentVolumeClaims(ns).Get(context.Background(), "small", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if s := claim.Status.AllocatedResourceStatuses[corev1.ResourceStorage]; s != corev1.PersistentVolumeClaimControllerResizeInProgress {
		t.Errorf("allocatedResourceStatuses[storage] = %q, want ControllerResizeInProgress", s)
	}
	if q := claim.Status.AllocatedResources[corev1.ResourceStorage]; q.Cmp(resource.MustParse("4Gi")) != 0 {
		t.Errorf("allocatedResources %s, want 4Gi", q.String())
	}
	if !kubetest.HasClaimCondition(claim, corev1.PersistentVolumeClaimResizing) || kubetest.HasClaimCondition(claim, corev1.PersistentVolumeClaimControllerResizeError) {
		t.Errorf("conditions %+v: want Resizing and no ControllerResizeError", claim.Status.Conditions)
	}
	if n := writes.since(before, "/namespaces/"+ns+"/persistentvolumeclaims/small/status"); n != 1 {
		t.Errorf("claim small: %d status writes, want 1", n)
	}
	checkResizedVolume(t, c, pvSmall, dSmall, 1<<30)

	if early, err := r.exitedEarly(); early {
		t.Fatalf("bridge stopped: %v", err)
	}
	if got := r.metricValue(t, "csibroker_resize_operations_total", map[string]string{"driver": drvBad, "result": "infeasible"}); got < 3 {
		t.Errorf("infeasible attempts counted: %v", got)
	}
	if got := r.metricValue(t, "csibroker_resize_operations_total", map[string]string{"driver": drvSmall, "result": "in_progress"}); got < 2 {
		t.Errorf("in-progress attempts counted: %v", got)
	}
}

// resizeSpy wraps testDrivers: it records every ControllerExpandVolume
// request and, for drivers in noNodeStep, clears node_expansion_required in
// the reply (a driver whose volumes need no node step); drivers in
// nodeOnly do not report the EXPAND_VOLUME controller capability (a driver
// that expands on the node only).
type resizeSpy struct {
	*testDrivers
	noNodeStep map[string]bool
	nodeOnly   map[string]bool

	mu   sync.Mutex
	seen map[string][]resizeSeen // by volume ID
}

type resizeSeen struct {
	requiredBytes int64
	mode          csi.VolumeCapability_AccessMode_Mode
	mount         bool
	secret        string // the "password" key (tests only; never logged)
	code          codes.Code
}

func (s resizeSeen) String() string {
	return fmt.Sprintf("{required %d mode %s mount %v code %s}", s.requiredBytes, s.mode, s.mount, s.code)
}

func (s *resizeSpy) ControllerConn(d string) (grpc.ClientConnInterface, error) {
	c, err := s.testDrivers.ControllerConn(d)
	if err != nil {
		return nil, err
	}
	return &resizeSpyConn{inner: c, spy: s, driver: d}, nil
}

func (s *resizeSpy) NodeConn(d, _ string) (grpc.ClientConnInterface, error) {
	return s.ControllerConn(d)
}

func (s *resizeSpy) requests(volumeID string) []resizeSeen {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]resizeSeen(nil), s.seen[volumeID]...)
}

type resizeSpyConn struct {
	inner  grpc.ClientConnInterface
	spy    *resizeSpy
	driver string
}

func (c *resizeSpyConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	err := c.inner.Invoke(ctx, method, args, reply, opts...)
	if method == csi.Controller_ControllerGetCapabilities_FullMethodName && err == nil && c.spy.nodeOnly[c.driver] {
		resp := reply.(*csi.ControllerGetCapabilitiesResponse)
		var kept []*csi.ControllerServiceCapability
		for _, cp := range resp.GetCapabilities() {
			if cp.GetRpc().GetType() != csi.ControllerServiceCapability_RPC_EXPAND_VOLUME {
				kept = append(kept, cp)
			}
		}
		resp.Capabilities = kept
	}
	if method != csi.Controller_ControllerExpandVolume_FullMethodName {
		return err
	}
	req := args.(*csi.ControllerExpandVolumeRequest)
	seen := resizeSeen{requiredBytes: req.GetCapacityRange().GetRequiredBytes(), mode: req.GetVolumeCapability().GetAccessMode().GetMode(),
		mount: req.GetVolumeCapability().GetMount() != nil, secret: req.GetSecrets()["password"], code: status.Code(err)}
	c.spy.mu.Lock()
	if c.spy.seen == nil {
		c.spy.seen = map[string][]resizeSeen{}
	}
	c.spy.seen[req.GetVolumeId()] = append(c.spy.seen[req.GetVolumeId()], seen)
	c.spy.mu.Unlock()
	if err == nil && c.spy.noNodeStep[c.driver] {
		reply.(*csi.ControllerExpandVolumeResponse).NodeExpansionRequired = false
	}
	return err
}

func (c *resizeSpyConn) NewStream(ctx context.Context, desc *grpc.StreamDesc, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	return c.inner.NewStream(ctx, desc, method, opts...)
}

// resizeWrites counts the successful API writes of the bridge's object client.
type resizeWrites struct {
	mu     sync.Mutex
	writes []string // "METHOD path"
}

type resizeWriteLog []string

func (w *resizeWrites) client(t *testing.T, env *testenv.Env) kubernetes.Interface {
	t.Helper()
	cfg := env.RESTConfig()
	cfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		return resizeRoundTripper(func(req *http.Request) (*http.Response, error) {
			resp, err := rt.RoundTrip(req)
			if err == nil && req.Method != http.MethodGet && resp.StatusCode < 300 {
				w.mu.Lock()
				w.writes = append(w.writes, req.Method+" "+req.URL.Path)
				w.mu.Unlock()
			}
			return resp, err
		})
	}
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func (w *resizeWrites) snapshot() resizeWriteLog {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append(resizeWriteLog(nil), w.writes...)
}

// since counts writes to exactly path made after snapshot was taken.
func (w *resizeWrites) since(snapshot resizeWriteLog, path string) int {
	return w.snapshot().count(path) - snapshot.count(path)
}

// count counts writes whose path is exactly path (after the API prefix).
func (l resizeWriteLog) count(path string) int {
	n := 0
	for _, x := range l {
		if strings.HasSuffix(x, path) {
			n++
		}
	}
	return n
}

type resizeRoundTripper func(*http.Request) (*http.Response, error)

func (f resizeRoundTripper) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
