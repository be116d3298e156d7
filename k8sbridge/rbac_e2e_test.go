package k8sbridge

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotclient "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
	"github.com/csibroker/csibroker/k8sbridge/provision"
	"github.com/csibroker/csibroker/policy"
)

// deployedRBAC reads the broker's ClusterRole and Role rules from
// deploy/base/rbac.yaml, the manifests users apply.
func deployedRBAC(t *testing.T) (cluster, namespaced []rbacv1.PolicyRule) {
	t.Helper()
	f, err := os.Open(filepath.Join("..", "deploy", "base", "rbac.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	dec := utilyaml.NewYAMLOrJSONDecoder(f, 4096)
	for {
		var obj map[string]any
		if err := dec.Decode(&obj); err != nil {
			break
		}
		switch obj["kind"] {
		case "ClusterRole":
			var cr rbacv1.ClusterRole
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(obj, &cr); err != nil {
				t.Fatal(err)
			}
			cluster = cr.Rules
		case "Role":
			var r rbacv1.Role
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(obj, &r); err != nil {
				t.Fatal(err)
			}
			namespaced = r.Rules
		}
	}
	if len(cluster) == 0 || len(namespaced) == 0 {
		t.Fatalf("deploy/base/rbac.yaml: ClusterRole rules %d, Role rules %d", len(cluster), len(namespaced))
	}
	return cluster, namespaced
}

// TestBrokerWorksWithTheDeployedRBAC: a broker whose every API request is
// made as a service account holding exactly deploy/base/rbac.yaml's
// ClusterRole and (in its namespace) Role provisions a claim with
// secrets, leads through its Lease, records intents, tracks capacity,
// attaches, expands, modifies, clones, restores a snapshot, detaches and
// deletes, and no request is forbidden (in its log or client-go's).
// The hand-written lists of test/deploy say what the manifests grant; this
// says the broker needs no more.
func TestBrokerWorksWithTheDeployedRBAC(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ctx, c, ns := context.Background(), env.Client(), env.NewNamespace(t)
	clusterRules, nsRules := deployedRBAC(t)
	sa := rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Name: "csibroker", Namespace: ns}
	roleName := kubetest.ClusterName(ns, "broker")
	if _, err := c.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: roleName}, Rules: clusterRules}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.RbacV1().ClusterRoles().Delete(context.Background(), roleName, metav1.DeleteOptions{}) })
	if _, err := c.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: roleName},
		RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: roleName}, Subjects: []rbacv1.Subject{sa}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.RbacV1().ClusterRoleBindings().Delete(context.Background(), roleName, metav1.DeleteOptions{})
	})
	if _, err := c.RbacV1().Roles(ns).Create(ctx, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "csibroker"}, Rules: nsRules}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.RbacV1().RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "csibroker"},
		RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "csibroker"}, Subjects: []rbacv1.Subject{sa}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	asBroker := rest.CopyConfig(env.RESTConfig())
	asBroker.Impersonate = rest.ImpersonationConfig{UserName: "system:serviceaccount:" + ns + ":csibroker",
		Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"}}
	brokerClient, err := kubernetes.NewForConfig(asBroker)
	if err != nil {
		t.Fatal(err)
	}
	// The RBAC objects reach the authorizer through its informers.
	err = testenv.WaitFor(ctx, 30*time.Second, "the broker's RBAC in effect", func(ctx context.Context) (bool, string, error) {
		_, err := brokerClient.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{Limit: 1})
		return err == nil, fmt.Sprint(err), nil
	})
	if err != nil {
		t.Fatal(err)
	}

	if _, err := c.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "creds"}, StringData: map[string]string{"k": "v"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	node := addAttachNode(t, env, ns)
	drv := kubetest.ClusterName(ns, "rbac.csi.test")
	drivers, d := publishingDriver(t, env, drv, node)
	params := map[string]string{}
	for _, kind := range []string{"provisioner", "controller-publish", "controller-expand", "node-stage"} {
		params["csi.storage.k8s.io/"+kind+"-secret-name"] = "creds"
		params["csi.storage.k8s.io/"+kind+"-secret-namespace"] = ns
	}
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "rbac"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, params)
	expand := true
	class.AllowVolumeExpansion = &expand
	if _, err := c.StorageV1().StorageClasses().Update(ctx, class, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	rs, errs := policy.Compile([]policy.Grant{{Namespace: ns, Name: "all", Spec: policy.GrantSpec{Drivers: []string{drv}, SecretNames: []string{"creds"},
		Operations: []policy.Operation{"*"}, Requesters: policy.Requesters{Namespaces: []string{"*"}}}}})
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	installSnapshotCRDs(t, env)
	// client-go's own errors (informers, Events) go to klog: kept to look
	// for refusals there too.
	// klog's settings are changed only through its locked setters (its
	// State.Restore is not safe while other goroutines log); after the
	// test the writer passes lines on to stderr, as klog did before.
	klogged := &teeUntilDone{}
	klog.LogToStderr(false)
	klog.SetOutput(klogged) // each severity's writer: an error line comes three times
	var r *bridgeRun
	t.Cleanup(func() {
		klogged.done()
		// Said even when a step timed out first, since a refusal is
		// usually why.
		logs := map[string]string{"client-go's klog": klogged.String()}
		if r != nil {
			logs["the bridge's log"] = r.logs.String()
		}
		said := map[string]bool{}
		for from, text := range logs {
			for _, line := range strings.Split(text, "\n") {
				if strings.Contains(line, "forbidden") && !said[line] {
					said[line] = true
					t.Errorf("a request was forbidden (%s): %s", from, line)
				}
			}
		}
	})
	r = startBridge(t, env, ns, drivers, bridgeOpts{policy: &policy.Authorizer{Rules: policy.NewStore(rs)}, leader: true, configureCfg: func(cfg *Config) {
		cfg.Client = brokerClient
		cfg.SnapshotClient = snapshotclient.NewForConfigOrDie(asBroker)
		cfg.CapacityForImmediateBinding = true
	}})

	// Provisioning (secret GET, intents ConfigMap, PV create, claim patch,
	// Events) and leadership (Lease).
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second).Spec.VolumeName
	kubetest.WaitEvent(t, c, ns, "data", "ProvisioningSucceeded", pvName)
	if l, err := c.CoordinationV1().Leases(ns).Get(ctx, "csibroker-leader", metav1.GetOptions{}); err != nil || l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity != "broker-0" {
		t.Fatalf("lease: %+v, %v", l, err)
	}
	if _, err := c.CoreV1().ConfigMaps(ns).Get(ctx, "csibroker-intents", metav1.GetOptions{}); err != nil {
		t.Fatalf("intent record: %v", err)
	}
	// Capacity tracking (CSIStorageCapacity in the broker's namespace).
	err = testenv.WaitFor(ctx, 60*time.Second, "a CSIStorageCapacity for the class", func(ctx context.Context) (bool, string, error) {
		l, err := c.StorageV1().CSIStorageCapacities(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		for _, o := range l.Items {
			if o.StorageClassName == class.Name {
				return true, "", nil
			}
		}
		return false, fmt.Sprintf("%d objects", len(l.Items)), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// Attach (VA and PV patches, status).
	va := createVA(t, c, ns, drv, node, pvName)
	vaFor(t, c, pvName, func(va *storagev1.VolumeAttachment) bool { return va.Status.Attached }, "attachment attached")
	// Expansion (PV patch, claim status patch).
	raiseRequest(t, c, ns, "data", "2Gi")
	waitClaim(t, c, ns, "data", "expanded by the driver, the node's part pending", func(pvc *corev1.PersistentVolumeClaim) bool {
		return kubetest.ClaimCondition(pvc, corev1.PersistentVolumeClaimFileSystemResizePending) != nil
	})
	if pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{}); err != nil || pv.Spec.Capacity.Storage().Cmp(resource.MustParse("2Gi")) != 0 {
		t.Fatalf("PV after expansion: %v, %v", pv.Spec.Capacity, err)
	}
	// Volume modification (VolumeAttributesClass get, live claim get, PV
	// patch, claim status patches).
	vac := &storagev1.VolumeAttributesClass{ObjectMeta: metav1.ObjectMeta{Name: kubetest.ClusterName(ns, "fast")}, DriverName: drv,
		Parameters: map[string]string{sampledriver.MutableIOPS: "200"}}
	if _, err := c.StorageV1().VolumeAttributesClasses().Create(ctx, vac, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.StorageV1().VolumeAttributesClasses().Delete(context.Background(), vac.Name, metav1.DeleteOptions{})
	})
	setVAC(t, c, ns, "data", vac.Name)
	waitClaim(t, c, ns, "data", "modified", func(pvc *corev1.PersistentVolumeClaim) bool {
		return pvc.Status.CurrentVolumeAttributesClassName != nil && *pvc.Status.CurrentVolumeAttributesClassName == vac.Name
	})
	// A clone (the source claim's finalizer patch) and a snapshot restore
	// (VolumeSnapshot get and finalizer patches, content get).
	kubetest.MakeClaimWith(t, c, ns, "copy", class.Name, func(p *corev1.PersistentVolumeClaim) {
		p.Spec.DataSource = &corev1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: "data"}
		p.Spec.Resources.Requests[corev1.ResourceStorage] = resource.MustParse("2Gi")
	})
	copyPV := kubetest.WaitBound(t, c, ns, "copy", 60*time.Second).Spec.VolumeName
	conn, err := drivers.ControllerConn(drv)
	if err != nil {
		t.Fatal(err)
	}
	snapResp, err := csi.NewControllerClient(conn).CreateSnapshot(ctx, &csi.CreateSnapshotRequest{SourceVolumeId: volumeHandle(t, c, pvName), Name: kubetest.ClusterName(ns, "snap")})
	if err != nil {
		t.Fatal(err)
	}
	sc := snapshotclient.NewForConfigOrDie(env.RESTConfig())
	readySnapshot(t, sc, ns, "snap", drv, snapResp.GetSnapshot().GetSnapshotId(), resource.MustParse("2Gi"), nil)
	kubetest.MakeClaimWith(t, c, ns, "restored", class.Name, func(p *corev1.PersistentVolumeClaim) {
		group := provision.SnapshotGroup
		p.Spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: &group, Kind: provision.SnapshotKind, Name: "snap"}
		p.Spec.Resources.Requests[corev1.ResourceStorage] = resource.MustParse("2Gi")
	})
	restoredPV := kubetest.WaitBound(t, c, ns, "restored", 60*time.Second).Spec.VolumeName
	waitSnapshotReleased(t, sc, ns, "snap")
	for _, claim := range []string{"copy", "restored"} {
		if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, claim, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	kubetest.WaitPVGone(t, c, copyPV, 60*time.Second)
	kubetest.WaitPVGone(t, c, restoredPV, 60*time.Second)

	// Detach, then deletion (PV delete, finalizer patches).
	if err := c.StorageV1().VolumeAttachments().Delete(ctx, va.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitVAGone(t, c, va.Name, 30*time.Second)
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "data", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitPVGone(t, c, pvName, 60*time.Second)
	if n := len(d.Volumes()); n != 0 {
		t.Fatalf("%d volumes left in the driver", n)
	}
}

// teeUntilDone records what is written until done, and passes it to
// stderr afterwards.
type teeUntilDone struct {
	mu       sync.Mutex
	buf      strings.Builder
	finished bool
}

func (w *teeUntilDone) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.finished {
		return os.Stderr.Write(p)
	}
	return w.buf.Write(p)
}

func (w *teeUntilDone) done() {
	w.mu.Lock()
	w.finished = true
	w.mu.Unlock()
}

func (w *teeUntilDone) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}
