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
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
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

// makeResizeClass makes an Immediate, Delete StorageClass that allows
// expansion, with a controller-expand secret when secretName is set.
func makeResizeClass(t *testing.T, c kubernetes.Interface, name, driver, secretNS, secretName string) string {
	t.Helper()
	var params map[string]string
	if secretName != "" {
		params = map[string]string{"csi.storage.k8s.io/controller-expand-secret-name": secretName, "csi.storage.k8s.io/controller-expand-secret-namespace": secretNS}
	}
	mode, reclaim, allow := storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, true
	sc := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Provisioner: driver, VolumeBindingMode: &mode, ReclaimPolicy: &reclaim,
		AllowVolumeExpansion: &allow, Parameters: params}
	if _, err := c.StorageV1().StorageClasses().Create(context.Background(), sc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.StorageV1().StorageClasses().Delete(context.Background(), name, metav1.DeleteOptions{}) })
	return name
}

// TestResizeWaitsForDetachAfterAnInUseRefusal: a driver that expands
// offline only answers FailedPrecondition while the volume is attached; the
// claim is told so and the driver is not asked again until the
// VolumeAttachment is gone, then the expansion goes through (external-
// resizer's --handle-volume-inuse-error).
func TestResizeWaitsForDetachAfterAnInUseRefusal(t *testing.T) {
	s := newAttachSetup(t, "off.csi.test", sampledriver.Config{Faults: sampledriver.Faults{Methods: map[string]sampledriver.Fault{
		"ControllerExpandVolume": {First: 1, Code: codes.FailedPrecondition}}}})
	ctx, c, ns, node, drv, d := s.ctx, s.c, s.ns, s.node, s.drv, s.d
	class := makeResizeClass(t, c, kubetest.ClusterName(ns, "off"), drv, "", "")
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class, "1Gi").Name, 60*time.Second).Spec.VolumeName
	va := createVA(t, c, ns, drv, node, pvName)
	vaFor(t, c, pvName, func(va *storagev1.VolumeAttachment) bool { return va.Status.Attached }, "attached")

	raiseRequest(t, c, ns, "data", "2Gi")
	kubetest.WaitEvent(t, c, ns, "data", "VolumeResizeFailed", "once the volume is detached")
	// A bounded window, no event to wait for: with the test's backoff
	// (100 ms doubling to 2 s) a retry would have come several times.
	time.Sleep(1500 * time.Millisecond)
	if n := d.CallCount("ControllerExpandVolume"); n != 1 {
		t.Fatalf("%d ControllerExpandVolume calls while the volume stayed attached, want only the refused one", n)
	}
	if got := s.r.metricValue(t, "csibroker_resize_operations_total", map[string]string{"driver": drv, "result": "in_use"}); got != 1 {
		t.Errorf("resize results: in_use %v, want 1", got)
	}
	if err := c.StorageV1().VolumeAttachments().Delete(ctx, va.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitClaim(t, c, ns, "data", "expanded after the detach", func(p *corev1.PersistentVolumeClaim) bool {
		q := p.Status.Capacity[corev1.ResourceStorage]
		st := p.Status.AllocatedResourceStatuses[corev1.ResourceStorage]
		return q.Cmp(resource.MustParse("2Gi")) >= 0 || st == corev1.PersistentVolumeClaimNodeResizePending
	})
	if n := d.CallCount("ControllerExpandVolume"); n != 2 {
		t.Fatalf("%d ControllerExpandVolume calls, want 2 (refused while attached, then done)", n)
	}
}

// raiseRequest sets a claim's storage request, as a user does.
func raiseRequest(t *testing.T, c kubernetes.Interface, ns, name, size string) {
	t.Helper()
	patch := []byte(`{"spec":{"resources":{"requests":{"storage":"` + size + `"}}}}`)
	if _, err := c.CoreV1().PersistentVolumeClaims(ns).Patch(context.Background(), name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatalf("set request of claim %s to %s: %v", name, size, err)
	}
}

func waitClaim(t *testing.T, c kubernetes.Interface, ns, name, what string, cond func(*corev1.PersistentVolumeClaim) bool) *corev1.PersistentVolumeClaim {
	t.Helper()
	var pvc *corev1.PersistentVolumeClaim
	err := testenv.WaitFor(context.Background(), 60*time.Second, "claim "+name+": "+what, func(ctx context.Context) (bool, string, error) {
		var err error
		pvc, err = c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		return cond(pvc), fmt.Sprintf("status %+v", pvc.Status), nil
	})
	if err != nil {
		t.Fatalf("%v\nevents: %s", err, kubetest.EventsOf(c, ns, name))
	}
	return pvc
}

func waitCalls(t *testing.T, d *sampledriver.Driver, n int64) {
	t.Helper()
	err := testenv.WaitFor(context.Background(), 60*time.Second, fmt.Sprintf("%d ControllerExpandVolume calls", n), func(ctx context.Context) (bool, string, error) {
		got := d.CallCount("ControllerExpandVolume")
		return got >= n, fmt.Sprintf("%d calls", got), nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// checkResizedVolume checks the PV's capacity and the driver's volume size.
func checkResizedVolume(t *testing.T, c kubernetes.Interface, pvName string, d *sampledriver.Driver, want int64) {
	t.Helper()
	pv, err := c.CoreV1().PersistentVolumes().Get(context.Background(), pvName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if q := pv.Spec.Capacity[corev1.ResourceStorage]; q.Value() != want {
		t.Errorf("PV %s capacity %s, want %d bytes", pvName, q.String(), want)
	}
	for _, v := range d.Volumes() {
		if v.ID == pv.Spec.CSI.VolumeHandle {
			if v.CapacityBytes != want {
				t.Errorf("driver volume %s has %d bytes, want %d", v.ID, v.CapacityBytes, want)
			}
			return
		}
	}
	t.Errorf("driver has no volume %s", pv.Spec.CSI.VolumeHandle)
}

func volumeHandle(t *testing.T, c kubernetes.Interface, pvName string) string {
	t.Helper()
	pv, err := c.CoreV1().PersistentVolumes().Get(context.Background(), pvName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pv.Spec.CSI.VolumeHandle
}

// TestResizeKeepsToPerDriverWorkers: expansions of one driver run at most
// PerDriverWorkers at a time, so a slow driver cannot take every worker;
// the others wait their turn and are all done.
func TestResizeKeepsToPerDriverWorkers(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "slowexpand.csi.test")
	drivers := newCountingDrivers()
	drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := makeResizeClass(t, c, kubetest.ClusterName(ns, "slow"), drv, "", "")
	r := startBridge(t, env, ns, drivers, bridgeOpts{configureCfg: func(cfg *Config) { cfg.PerDriverWorkers = 1 }})
	names := []string{"a", "b", "c"}
	for _, name := range names {
		kubetest.MakeClaim(t, c, ns, name, class, "1Gi")
	}
	for _, name := range names {
		kubetest.WaitBound(t, c, ns, name, 60*time.Second)
	}
	// The first expansion is held at the driver until the other two wait
	// for its slot: they contend for it.
	letGo := drivers.hold("ControllerExpandVolume")
	defer letGo()
	for _, name := range names {
		raiseRequest(t, c, ns, name, "2Gi")
	}
	rs := extraOf[*resize.Controller](t, r.b)
	err := testenv.WaitFor(context.Background(), 30*time.Second, "two expansions waiting for the driver's slot", func(context.Context) (bool, string, error) {
		n := rs.QueueLen()
		return n == 2, fmt.Sprintf("%d claims waiting", n), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	letGo()
	for _, name := range names {
		waitClaim(t, c, ns, name, "expanded on the controller", func(pvc *corev1.PersistentVolumeClaim) bool {
			return pvc.Status.AllocatedResourceStatuses[corev1.ResourceStorage] == corev1.PersistentVolumeClaimNodeResizePending
		})
	}
	if most := drivers.most("ControllerExpandVolume"); most != 1 {
		t.Errorf("%d ControllerExpandVolume calls of one driver at once, want at most PerDriverWorkers = 1", most)
	}
}

// TestResizeFailureReportedOncePerRequest: an expansion the driver refuses
// with FailedPrecondition (an offline-only driver while a pod uses the
// volume) is retried with backoff and logged on every attempt, but its
// VolumeResizeFailed Event is recorded once per requested size, although
// the driver's message differs on every call (the sample driver counts
// them in it): a raised request is reported again, and so is the first
// failure of a new term of leadership.
func TestResizeFailureReportedOncePerRequest(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "offline.csi.test")
	spy := &resizeSpy{testDrivers: &testDrivers{}}
	spy.addDriver(t, sampledriver.Config{Name: drv, Faults: sampledriver.Faults{Methods: map[string]sampledriver.Fault{
		"ControllerExpandVolume": {Rate: 1, Code: codes.FailedPrecondition}}}})
	r := startBridge(t, env, ns, spy, bridgeOpts{leader: true})
	kubetest.MakeClaim(t, c, ns, "busy", makeResizeClass(t, c, kubetest.ClusterName(ns, "offline"), drv, "", ""), "1Gi")
	claim := kubetest.WaitBound(t, c, ns, "busy", 60*time.Second)
	vol := volumeHandle(t, c, claim.Spec.VolumeName)

	// refused counts the driver's FailedPrecondition answers for size.
	refused := func(size int64) int {
		n := 0
		for _, s := range spy.requests(vol) {
			if s.code == codes.FailedPrecondition && (size == 0 || s.requiredBytes == size) {
				n++
			}
		}
		return n
	}
	waitRefused := func(size int64, n int) {
		t.Helper()
		err := testenv.WaitFor(ctx, 60*time.Second, fmt.Sprintf("%d refused expansions to %d bytes", n, size), func(context.Context) (bool, string, error) {
			return refused(size) >= n, fmt.Sprint(spy.requests(vol)), nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	// settle waits until the resizer has started another attempt, so every
	// attempt before it has recorded what it records, then until the
	// bridge's Events recorded so far are written (they are written in
	// order); it returns how many calls the driver had answered before.
	flushes := 0
	settle := func() int {
		t.Helper()
		n := len(spy.requests(vol))
		err := testenv.WaitFor(ctx, 60*time.Second, "another expansion attempt", func(context.Context) (bool, string, error) {
			return len(spy.requests(vol)) > n, fmt.Sprintf("%d calls", len(spy.requests(vol))), nil
		})
		if err != nil {
			t.Fatal(err)
		}
		flushes++
		marker := fmt.Sprintf("flush %d", flushes)
		// A Warning: the claim's Normal Events (provisioning, Resizing)
		// must not use up the recorder's per-object budget for markers.
		r.b.Event(ctx, kube.ClaimRef(claim), corev1.EventTypeWarning, "TestFlush", "%s", marker)
		kubetest.WaitEvent(t, c, ns, "busy", "TestFlush", marker)
		return n
	}
	// events counts the Events with reason recorded on the claim (an Event
	// the recorder repeated counts as often as it was recorded).
	events := func(reason string) int {
		t.Helper()
		evs, err := c.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=busy"})
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, e := range evs.Items {
			if e.Reason != reason || e.InvolvedObject.UID != claim.UID {
				continue
			}
			if reason == "VolumeResizeFailed" && (!strings.Contains(e.Message, "FailedPrecondition") || !strings.Contains(e.Message, "injected fault in ControllerExpandVolume")) {
				t.Errorf("event %q does not carry the driver's code and message", e.Message)
			}
			n += int(max(e.Count, 1))
		}
		return n
	}
	// warnings counts the VolumeResizeFailed Events; announced the Resizing
	// ones: one per request too, not one per attempt.
	warnings := func() int { return events("VolumeResizeFailed") }
	announced := func() int { return events("Resizing") }
	// logged counts the bridge's log lines of refused expansions of the claim.
	logged := func() int {
		n := 0
		for _, l := range strings.Split(r.logs.String(), "\n") {
			if strings.Contains(l, `msg="ControllerExpandVolume failed"`) && strings.Contains(l, "claim="+ns+"/busy ") {
				n++
			}
		}
		return n
	}

	// Several refusals of one request: one Event, a log line each.
	raiseRequest(t, c, ns, "busy", "2Gi")
	waitRefused(2<<30, 3)
	answered := settle()
	if n := warnings(); n != 1 {
		t.Errorf("%d VolumeResizeFailed Events after %d refusals of the same request, want 1:%s", n, refused(2<<30), kubetest.EventsOf(c, ns, "busy"))
	}
	if n := announced(); n != 1 {
		t.Errorf("%d Resizing Events after %d attempts at the same request, want 1:%s", n, refused(2<<30), kubetest.EventsOf(c, ns, "busy"))
	}
	if n := logged(); n < answered {
		t.Errorf("%d log lines of refused expansions after %d refusals, want one per refusal", n, answered)
	}

	// A new request is reported again, once.
	raiseRequest(t, c, ns, "busy", "3Gi")
	waitRefused(3<<30, 3)
	settle()
	if n := warnings(); n != 2 {
		t.Errorf("%d VolumeResizeFailed Events after %d refusals of 2Gi and %d of 3Gi, want 2 (one per request):%s", n, refused(2<<30), refused(3<<30), kubetest.EventsOf(c, ns, "busy"))
	}
	if n := announced(); n != 2 {
		t.Errorf("%d Resizing Events after attempts at 2Gi and 3Gi, want 2 (one per request):%s", n, kubetest.EventsOf(c, ns, "busy"))
	}

	// Another holder takes the Lease for a moment: the first refusal of
	// the broker's next term is reported again, and only the first.
	takeLease(t, c, ns, "intruder", 3)
	for _, want := range []bool{false, true} {
		if err := testenv.WaitFor(ctx, 30*time.Second, fmt.Sprintf("the broker leading: %v", want), func(context.Context) (bool, string, error) {
			ok, _ := r.b.Leader()
			return ok == want, "", nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	before := refused(0)
	err := testenv.WaitFor(ctx, 30*time.Second, "a VolumeResizeFailed Event in the new term", func(context.Context) (bool, string, error) {
		return warnings() >= 3, kubetest.EventsOf(c, ns, "busy"), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	waitRefused(0, before+3)
	settle()
	if n := warnings(); n != 3 {
		t.Errorf("%d VolumeResizeFailed Events after %d refusals in the new term, want 3 (one more):%s", n, refused(0)-before, kubetest.EventsOf(c, ns, "busy"))
	}
}

// TestResizeClaimWaitingForTheKubeletAsksNoDriver: a claim whose expansion
// waits for the kubelet (NodeResizePending) has nothing for the driver, so
// a new term does not ask its driver anything for it: with the driver
// unreachable, only a claim that does need the driver is told so.
func TestResizeClaimWaitingForTheKubeletAsksNoDriver(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "gone.csi.test")
	live := &testDrivers{}
	live.addDriver(t, sampledriver.Config{Name: drv})
	class := makeResizeClass(t, c, kubetest.ClusterName(ns, "gone"), drv, "", "")
	first := startBridge(t, env, ns, live, bridgeOpts{})
	kubetest.MakeClaim(t, c, ns, "waiting", class, "1Gi")
	kubetest.MakeClaim(t, c, ns, "other", class, "1Gi")
	kubetest.WaitBound(t, c, ns, "other", 60*time.Second)
	kubetest.WaitBound(t, c, ns, "waiting", 60*time.Second)
	raiseRequest(t, c, ns, "waiting", "2Gi")
	waitClaim(t, c, ns, "waiting", "NodeResizePending", func(pvc *corev1.PersistentVolumeClaim) bool {
		return pvc.Status.AllocatedResourceStatuses[corev1.ResourceStorage] == corev1.PersistentVolumeClaimNodeResizePending
	})
	first.stop()

	// The driver is gone; "other" now needs it.
	raiseRequest(t, c, ns, "other", "2Gi")
	dead := &testDrivers{}
	dead.addDeadDriver(t, drv)
	second := startBridge(t, env, ns, dead, bridgeOpts{})
	kubetest.WaitEvent(t, c, ns, "other", "VolumeResizeFailed", "not reachable")
	// Handled, and found to have nothing for the driver.
	handled := "nothing for the driver now"
	err := testenv.WaitFor(context.Background(), 30*time.Second, "the waiting claim handled", func(context.Context) (bool, string, error) {
		for _, line := range strings.Split(second.logs.String(), "\n") {
			if strings.Contains(line, handled) && strings.Contains(line, "claim="+ns+"/waiting") {
				return true, "", nil
			}
		}
		return false, "no log line of it", nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if evs := kubetest.EventsOf(c, ns, "waiting"); strings.Contains(evs, "VolumeResizeFailed") {
		t.Fatalf("a claim waiting for the kubelet was reported as failed:%s", evs)
	}
}

// TestResizeExpandsAMigratedInTreeVolume: kube-controller-manager names, in
// volume.kubernetes.io/storage-resizer, the CSI driver that CSI migration
// moves an in-tree claim's volume to; the broker expands the volume through
// its CSI translation, as external-resizer does. The driver's own volume
// grows (asked with the translated handle and filesystem), and so does the
// PV, which keeps its in-tree source.
func TestResizeExpandsAMigratedInTreeVolume(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ctx, c, ns := context.Background(), env.Client(), env.NewNamespace(t)
	// The driver CSI migration moves in-tree Cinder volumes to (a name the
	// translation fixes, shared with TestAttachesAMigratedInTreeVolume).
	const drv = "cinder.csi.openstack.org"
	spy := &resizeSpy{testDrivers: &testDrivers{}}
	d := spy.addDriver(t, sampledriver.Config{Name: drv})
	volID := createDriverVolume(t, spy.testDrivers, drv, kubetest.ClusterName(ns, "in-tree"))
	class := makeResizeClass(t, c, kubetest.ClusterName(ns, "cinder"), "kubernetes.io/cinder", "", "")
	pv := createStaticPV(t, c, kubetest.ClusterName(ns, "pv"), corev1.PersistentVolumeSource{Cinder: &corev1.CinderPersistentVolumeSource{VolumeID: volID, FSType: "ext4"}},
		func(pv *corev1.PersistentVolume) {
			pv.Spec.StorageClassName, pv.Spec.ClaimRef = class, &corev1.ObjectReference{Namespace: ns, Name: "data"}
		})
	kubetest.MakeClaimWith(t, c, ns, "data", class, func(p *corev1.PersistentVolumeClaim) { p.Spec.VolumeName = pv.Name })
	kubetest.WaitBound(t, c, ns, "data", 60*time.Second)
	startBridge(t, env, ns, spy, bridgeOpts{})

	raiseRequest(t, c, ns, "data", "2Gi")
	claim := waitClaim(t, c, ns, "data", "NodeResizePending", func(pvc *corev1.PersistentVolumeClaim) bool {
		return pvc.Status.AllocatedResourceStatuses[corev1.ResourceStorage] == corev1.PersistentVolumeClaimNodeResizePending
	})
	if got := claim.Annotations[kube.AnnStorageResizer]; got != drv {
		t.Errorf("claim annotation %s = %q, want kube-controller-manager's %q", kube.AnnStorageResizer, got, drv)
	}
	seen := spy.requests(volID)
	if len(seen) == 0 {
		t.Fatalf("no ControllerExpandVolume call for volume %s", volID)
	}
	for _, s := range seen {
		if s.requiredBytes != 2<<30 || !s.mount || s.code != codes.OK {
			t.Errorf("ControllerExpandVolume request %v: want 2Gi and a mount capability", s)
		}
	}
	got, err := c.CoreV1().PersistentVolumes().Get(ctx, pv.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if q := got.Spec.Capacity[corev1.ResourceStorage]; q.Cmp(resource.MustParse("2Gi")) != 0 || got.Spec.Cinder == nil || got.Spec.CSI != nil {
		t.Errorf("PV after the expansion: capacity %s, source %+v; want 2Gi and the in-tree source kept", q.String(), got.Spec.PersistentVolumeSource)
	}
	for _, v := range d.Volumes() {
		if v.ID == volID && v.CapacityBytes != 2<<30 {
			t.Errorf("driver volume %s has %d bytes, want %d", v.ID, v.CapacityBytes, int64(2<<30))
		}
	}
	kubetest.WaitEvent(t, c, ns, "data", "FileSystemResizeRequired", "Require file system resize of volume on node")
}
