package k8sbridge

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
	"github.com/csibroker/csibroker/policy"
)

// TestNodeOfPV: the node of a node-local PV is the one recorded at
// provisioning; for a PV without it (made by external-provisioner), the
// node whose hostname label its affinity names, which may differ from the
// node's name; the hostname itself when no single node carries it.
func TestNodeOfPV(t *testing.T) {
	idx := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
	for _, n := range []struct{ name, hostname string }{{"ip-10-0-0-1.ec2.internal", "ip-10-0-0-1"}, {"plain", "plain"}} {
		idx.Add(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.name, Labels: map[string]string{corev1.LabelHostname: n.hostname}}})
	}
	b := &kube.Env{Nodes: corelisters.NewNodeLister(idx)}
	pv := func(ann, hostname string) *corev1.PersistentVolume {
		p := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pv"}}
		if ann != "" {
			p.Annotations = map[string]string{kube.AnnVolumeNode: ann}
		}
		if hostname != "" {
			p.Spec.NodeAffinity = &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
				MatchExpressions: []corev1.NodeSelectorRequirement{{Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpIn, Values: []string{hostname}}}}}}}
		}
		return p
	}
	for _, tc := range []struct {
		name string
		pv   *corev1.PersistentVolume
		want string
	}{
		{"recorded", pv("recorded-node", "ip-10-0-0-1"), "recorded-node"},
		{"hostname label of a node named otherwise", pv("", "ip-10-0-0-1"), "ip-10-0-0-1.ec2.internal"},
		{"hostname that is the node's name", pv("", "plain"), "plain"},
		{"hostname of no node", pv("", "gone"), "gone"},
		{"nothing said", pv("", ""), ""},
	} {
		if got := b.NodeOfPV(tc.pv); got != tc.want {
			t.Errorf("%s: node %q, want %q", tc.name, got, tc.want)
		}
	}
}

// TestDeleteWhenTheDeletionSecretIsGone: a volume whose deletion secret
// was deleted (as it may go with its namespace) is deleted without
// credentials, as external-provisioner does, and the PV says so in a
// Warning Event, instead of waiting forever for the secret.
func TestDeleteWhenTheDeletionSecretIsGone(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "gone.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	if _, err := c.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "creds", Namespace: ns}, StringData: map[string]string{"k": "v"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	rs, errs := policy.Compile([]policy.Grant{{Namespace: ns, Name: "g", Spec: policy.GrantSpec{
		Drivers: []string{drv}, SecretNames: []string{"creds"}, Operations: []policy.Operation{policy.OpCreateVolume, policy.OpDeleteVolume},
		Requesters: policy.Requesters{Namespaces: []string{ns}}}}})
	if len(errs) != 0 {
		t.Fatal(errs)
	}
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "gone"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete,
		map[string]string{"csi.storage.k8s.io/provisioner-secret-name": "creds", "csi.storage.k8s.io/provisioner-secret-namespace": "${pvc.namespace}"})
	startBridge(t, env, ns, drivers, bridgeOpts{policy: &policy.Authorizer{Rules: policy.NewStore(rs)}})
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second).Spec.VolumeName
	if err := c.CoreV1().Secrets(ns).Delete(ctx, "creds", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "data", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitPVGone(t, c, pvName, 60*time.Second)
	if n := len(d.Volumes()); n != 0 || d.CallCount("DeleteVolume") != 1 {
		t.Fatalf("%d volumes left, %d DeleteVolume calls; want the volume deleted once", n, d.CallCount("DeleteVolume"))
	}
	kubetest.WaitEvent(t, c, "default", pvName, "DeletionSecretNotFound", "secret "+ns+"/creds")
}

// TestDeleteByTheSecretThePVRecords: a PV made without a deletion secret
// records that (both annotations empty, as external-provisioner writes
// them), and is deleted without one even when its StorageClass, replaced
// since, names a secret (here one the policy refuses).
func TestDeleteByTheSecretThePVRecords(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "rec.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	name := kubetest.ClusterName(ns, "rec")
	class := kubetest.MakeClass(t, c, name, drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	// Enforced, with no grant: any secret named is refused.
	r := startBridge(t, env, ns, drivers, bridgeOpts{policy: &policy.Authorizer{Rules: policy.NewStore(nil)}})
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second).Spec.VolumeName
	pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	n, hasName := pv.Annotations[kube.AnnDeletionSecretName]
	nsAnn, hasNS := pv.Annotations[kube.AnnDeletionSecretNS]
	if !hasName || !hasNS || n != "" || nsAnn != "" {
		t.Fatalf("PV annotations %v: want %s and %s present and empty", pv.Annotations, kube.AnnDeletionSecretName, kube.AnnDeletionSecretNS)
	}
	if err := c.StorageV1().StorageClasses().Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.MakeClass(t, c, name, drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete,
		map[string]string{"csi.storage.k8s.io/provisioner-secret-name": "creds", "csi.storage.k8s.io/provisioner-secret-namespace": ns})
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "data", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitPVGone(t, c, pvName, 60*time.Second)
	if n := len(d.Volumes()); n != 0 {
		t.Fatalf("%d volumes left", n)
	}
	if got := r.metricValue(t, "csibroker_secret_policy_decisions_total", map[string]string{"operation": "DeleteVolume"}); got != 0 {
		t.Fatalf("%v DeleteVolume secret decisions, want none: the PV records that it needs no secret", got)
	}
}

// TestFinalizerRefusalIsReported: when the cluster refuses the
// volume-deletion finalizer on a bound PV that lacks it (an admission
// policy, missing RBAC), the PV gets a Warning Event saying so; once the
// refusal is lifted, the finalizer is added.
func TestFinalizerRefusalIsReported(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "finref.csi.test")
	drivers := &testDrivers{}
	drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "finref"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	// The cluster refuses adding the finalizer to this class's PVs.
	fail := admissionregistrationv1.Fail
	vap := &admissionregistrationv1.ValidatingAdmissionPolicy{ObjectMeta: metav1.ObjectMeta{Name: kubetest.ClusterName(ns, "no-volume-finalizer")},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicySpec{
			FailurePolicy: &fail,
			MatchConstraints: &admissionregistrationv1.MatchResources{ResourceRules: []admissionregistrationv1.NamedRuleWithOperations{{
				RuleWithOperations: admissionregistrationv1.RuleWithOperations{
					Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Update},
					Rule:       admissionregistrationv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"persistentvolumes"}}}}}},
			MatchConditions: []admissionregistrationv1.MatchCondition{{Name: "this-class", Expression: fmt.Sprintf("object.spec.storageClassName == %q", class.Name)}},
			Validations: []admissionregistrationv1.Validation{{
				Expression: fmt.Sprintf("!has(object.metadata.finalizers) || !(%[1]q in object.metadata.finalizers) || (has(oldObject.metadata.finalizers) && %[1]q in oldObject.metadata.finalizers)", kube.FinalizerVolume),
				Message:    "the volume finalizer is refused by the test's policy"}},
		}}
	if _, err := c.AdmissionregistrationV1().ValidatingAdmissionPolicies().Create(ctx, vap, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.AdmissionregistrationV1().ValidatingAdmissionPolicies().Delete(context.Background(), vap.Name, metav1.DeleteOptions{})
	})
	binding := &admissionregistrationv1.ValidatingAdmissionPolicyBinding{ObjectMeta: metav1.ObjectMeta{Name: vap.Name},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicyBindingSpec{PolicyName: vap.Name, ValidationActions: []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny}}}
	if _, err := c.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	unbind := func() {
		err := c.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Delete(context.Background(), binding.Name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			t.Error(err)
		}
	}
	t.Cleanup(unbind)

	startBridge(t, env, ns, drivers, bridgeOpts{})
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second).Spec.VolumeName
	// The PV is created with the finalizer (the policy refuses updates
	// only); it is taken off as an older provisioner would have left it,
	// once the policy is seen in force on this PV.
	err := testenv.WaitFor(ctx, 30*time.Second, "the PV without its finalizer, and the policy refusing it back", func(ctx context.Context) (bool, string, error) {
		pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		if kube.HasFinalizer(pv, kube.FinalizerVolume) {
			pv.Finalizers = kube.RemoveString(pv.Finalizers, kube.FinalizerVolume)
			if _, err := c.CoreV1().PersistentVolumes().Update(ctx, pv, metav1.UpdateOptions{}); err != nil {
				return false, err.Error(), nil
			}
			return false, "finalizer removed; probing the policy", nil
		}
		pv.Finalizers = append(pv.Finalizers, kube.FinalizerVolume)
		_, err = c.CoreV1().PersistentVolumes().Update(ctx, pv, metav1.UpdateOptions{DryRun: []string{metav1.DryRunAll}})
		return err != nil && strings.Contains(err.Error(), "refused by the test's policy"), fmt.Sprint(err), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	kubetest.WaitEvent(t, c, "default", pvName, "FinalizerUpdateFailed", "refused by the test's policy")
	unbind()
	kubetest.WaitPV(t, c, pvName, "finalizer added once allowed", 60*time.Second, func(pv *corev1.PersistentVolume) (bool, string) {
		return pv != nil && kube.HasFinalizer(pv, kube.FinalizerVolume), "no finalizer " + kube.FinalizerVolume
	})
}

// TestCloneWithoutContent: a driver whose answer to
// a clone's CreateVolume names no content source (the volume may be empty)
// gets that volume deleted, the claim an Event saying so, and a retry, as
// external-provisioner does; a source claim being deleted is refused.
func TestCloneWithoutContent(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "nc.csi.test")
	drivers := newCountingDrivers()
	drivers.rewriteReply("CreateVolume", func(n int, reply any) {
		if n == 2 { // the first answer for the clone
			reply.(*csi.CreateVolumeResponse).GetVolume().ContentSource = nil
		}
	})
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "nocontent"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})
	kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "src", class.Name, "1Gi").Name, 60*time.Second)
	cloneOf := func(src string) func(*corev1.PersistentVolumeClaim) {
		return func(p *corev1.PersistentVolumeClaim) {
			p.Spec.DataSource = &corev1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: src}
		}
	}
	kubetest.MakeClaimWith(t, c, ns, "copy", class.Name, cloneOf("src"))
	kubetest.WaitEvent(t, c, ns, "copy", "ProvisioningFailed", "volume content source missing in the driver's answer; the volume was deleted")
	kubetest.WaitBound(t, c, ns, "copy", 60*time.Second)
	if n := len(d.Volumes()); n != 2 || d.CallCount("DeleteVolume") != 1 {
		t.Fatalf("%d volumes, %d DeleteVolume calls; want the source and one clone, the first clone deleted", n, d.CallCount("DeleteVolume"))
	}

	// A source held in deletion (a finalizer of the test's) is refused.
	gone := kubetest.WaitBound(t, c, ns, kubetest.MakeClaimWith(t, c, ns, "going", class.Name, func(p *corev1.PersistentVolumeClaim) {
		p.Finalizers = []string{"csibroker.test/hold"}
	}).Name, 60*time.Second)
	t.Cleanup(func() {
		c.CoreV1().PersistentVolumeClaims(ns).Patch(context.Background(), gone.Name, types.MergePatchType, []byte(`{"metadata":{"finalizers":null}}`), metav1.PatchOptions{})
	})
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, gone.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.MakeClaimWith(t, c, ns, "late", class.Name, cloneOf(gone.Name))
	kubetest.WaitEvent(t, c, ns, "late", "ProvisioningFailed", "is being deleted")
}

// TestNamespaceLabelsRecordedWhenTheCacheLags: a claim whose namespace the
// broker's cache has not got yet is decided with the labels read from the
// API server, and those same labels are recorded on its PV, for the
// decisions after the namespace is gone (recorded from the cache alone,
// they were missing, and the volume's deletion was refused).
func TestNamespaceLabelsRecordedWhenTheCacheLags(t *testing.T) {
	env := kubetest.ControlPlane(t)
	storageNS := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	tenant := makeTenant(t, c, storageNS)
	drv := kubetest.ClusterName(storageNS, "lag.csi.test")
	drivers := &testDrivers{}
	drivers.addDriver(t, sampledriver.Config{Name: drv})
	rs, errs := policy.Compile([]policy.Grant{{Namespace: storageNS, Name: "team-a", Spec: policy.GrantSpec{Drivers: []string{drv}, SecretNames: []string{"creds"},
		Operations: []policy.Operation{policy.OpCreateVolume, policy.OpDeleteVolume},
		Requesters: policy.Requesters{NamespaceSelector: &policy.LabelSelector{MatchLabels: map[string]string{"team": "a"}}}}}})
	if len(errs) > 0 {
		t.Fatal(errs)
	}
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(storageNS, "lag"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, map[string]string{
		"csi.storage.k8s.io/provisioner-secret-name": "creds", "csi.storage.k8s.io/provisioner-secret-namespace": storageNS})
	startBridge(t, env, storageNS, drivers, bridgeOpts{policy: &policy.Authorizer{Rules: policy.NewStore(rs)}, configure: func(b *Bridge) {
		// A namespace cache that never has the namespace.
		b.Namespaces = corelisters.NewNamespaceLister(cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{}))
	}})
	pv, err := c.CoreV1().PersistentVolumes().Get(ctx, kubetest.WaitBound(t, c, tenant, kubetest.MakeClaim(t, c, tenant, "data", class.Name, "1Gi").Name, 60*time.Second).Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := kube.RecordedNamespaceLabels(pv); got["team"] != "a" || got[corev1.LabelMetadataName] != tenant {
		t.Fatalf("recorded namespace labels %v (annotation %q), want the namespace's", got, pv.Annotations[kube.AnnNamespaceLabels])
	}
}

// TestDeleteWithHalfADeletionSecret: a PV whose deletion-secret
// annotations name half a secret (a hand edit) has its volume deleted
// without one, and says so in an Event, not only in the log.
func TestDeleteWithHalfADeletionSecret(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "half.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "half"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second).Spec.VolumeName
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:"creds",%q:""}}}`, kube.AnnDeletionSecretName, kube.AnnDeletionSecretNS)
	if _, err := c.CoreV1().PersistentVolumes().Patch(ctx, pvName, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "data", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitPVGone(t, c, pvName, 60*time.Second)
	if n := len(d.Volumes()); n != 0 {
		t.Fatalf("%d volumes left", n)
	}
	kubetest.WaitEvent(t, c, "default", pvName, "DeletionSecretIncomplete", "half a deletion secret")
}

// makeTenant makes namespace <storageNS>-tenant labelled team=a (deleted
// at cleanup), whose claims use secret "creds" of storageNS (made here).
func makeTenant(t *testing.T, c kubernetes.Interface, storageNS string) string {
	t.Helper()
	ctx := context.Background()
	tenant := storageNS + "-tenant"
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: tenant, Labels: map[string]string{"team": "a"}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.CoreV1().Namespaces().Delete(context.Background(), tenant, metav1.DeleteOptions{}) })
	if _, err := c.CoreV1().Secrets(storageNS).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "creds"}, StringData: map[string]string{"k": "v"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return tenant
}

// TestDeleteVolumeNotFoundIsNotDeleted: a driver answering DeleteVolume
// NotFound (the CSI spec has it answer OK for a volume it does not have,
// so NotFound may be about something else) keeps the PV, with a Warning
// Event naming the answer, as external-provisioner does; the deletion goes
// on once the driver answers OK, and the volume is gone.
func TestDeleteVolumeNotFoundIsNotDeleted(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "nf.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv, Faults: sampledriver.Faults{Methods: map[string]sampledriver.Fault{
		"DeleteVolume": {First: 2, Code: codes.NotFound}}}})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "nf"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second).Spec.VolumeName
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "data", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.WaitEvent(t, c, "default", pvName, "VolumeFailedDelete", "NotFound")
	kubetest.WaitPVGone(t, c, pvName, 60*time.Second)
	if n := len(d.Volumes()); n != 0 || d.CallCount("DeleteVolume") != 3 {
		t.Fatalf("%d volumes left, %d DeleteVolume calls; want the volume deleted at the third", n, d.CallCount("DeleteVolume"))
	}
}
