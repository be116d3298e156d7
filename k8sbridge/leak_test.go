package k8sbridge

import (
	"context"
	"fmt"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/intent"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
	"github.com/csibroker/csibroker/policy"
)

// noLeaks waits until every volume of the driver is referenced by a PV and
// the intent record is empty.
func noLeaks(t *testing.T, env *testenv.Env, ns string, d *sampledriver.Driver, driver string) {
	t.Helper()
	c := env.Client()
	err := testenv.WaitFor(context.Background(), 60*time.Second, "no leaked volume of "+driver, func(ctx context.Context) (bool, string, error) {
		pvs, err := c.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		used := map[string]bool{}
		for _, pv := range pvs.Items {
			if pv.Spec.CSI != nil && pv.Spec.CSI.Driver == driver {
				used[pv.Spec.CSI.VolumeHandle] = true
			}
		}
		var leaked []string
		for _, v := range d.Volumes() {
			if !used[v.ID] {
				leaked = append(leaked, v.ID+" ("+v.Name+")")
			}
		}
		intents, err := intent.NewStore(c, ns, "csibroker-intents", nil).List(ctx)
		if err != nil {
			return false, err.Error(), nil
		}
		return len(leaked) == 0 && len(intents) == 0, fmt.Sprintf("leaked %v, %d intents", leaked, len(intents)), nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// crashAfterCreate runs a leader (opts, identity doomed-broker) that dies
// right after each CreateVolume returns, before the PV is written; once
// the claims makeClaims makes have had n CreateVolume answers, it is
// stopped (its lease is released; a SIGKILL only adds the lease timeout).
func crashAfterCreate(t *testing.T, env *testenv.Env, ns string, drivers *testDrivers, opts bridgeOpts, n int, makeClaims func()) {
	t.Helper()
	died := make(chan string, n)
	opts.identity, opts.leader = "doomed-broker", true
	opts.configure = func(b *Bridge) {
		b.prov.AfterCreate = func(ctx context.Context, vol string) {
			died <- vol
			<-ctx.Done() // the process is gone: nothing after this point runs
		}
	}
	first := startBridge(t, env, ns, drivers, opts)
	makeClaims()
	for i := 0; i < n; i++ {
		select {
		case <-died:
		case <-time.After(30 * time.Second):
			t.Fatal("CreateVolume never returned")
		}
	}
	first.stop()
}

// TestClaimDeletedWhileCreateVolumeIsSlow: the driver takes 2s to create;
// the claim is deleted meanwhile; the volume it then makes is deleted.
func TestClaimDeletedWhileCreateVolumeIsSlow(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "slow.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv, Faults: sampledriver.Faults{Methods: map[string]sampledriver.Fault{"CreateVolume": {Latency: 2 * time.Second}}}})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "slow"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})

	kubetest.MakeClaim(t, c, ns, "doomed", class.Name, "1Gi")
	err := testenv.WaitFor(ctx, 30*time.Second, "CreateVolume in flight", func(context.Context) (bool, string, error) {
		return d.CallCount("CreateVolume") > 0, "", nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "doomed", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	// The driver finishes the volume after the claim is gone...
	err = testenv.WaitFor(ctx, 30*time.Second, "the slow CreateVolume to finish", func(context.Context) (bool, string, error) {
		return d.CallCount("DeleteVolume") > 0, fmt.Sprint(d.Calls()), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// ...and nothing is left behind: no volume, no PV, no intent.
	noLeaks(t, env, ns, d, drv)
	pvs, err := c.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, pv := range pvs.Items {
		if pv.Spec.CSI != nil && pv.Spec.CSI.Driver == drv {
			t.Fatalf("PV %s made for a deleted claim", pv.Name)
		}
	}
}

// TestBrokerKilledAfterCreateVolume: the broker dies right after
// CreateVolume returned, before the PV is written. A new leader finds the
// intent: for a claim that still exists it finishes the job (same volume,
// no duplicate); for a claim deleted meanwhile it deletes the volume.
func TestBrokerKilledAfterCreateVolume(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "crash.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "crash"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)

	crashAfterCreate(t, env, ns, drivers, bridgeOpts{}, 2, func() {
		kubetest.MakeClaim(t, c, ns, "keep", class.Name, "1Gi")
		kubetest.MakeClaim(t, c, ns, "gone", class.Name, "1Gi")
	})
	if n := len(d.Volumes()); n != 2 {
		t.Fatalf("driver has %d volumes, want 2 made before the crash", n)
	}
	intents, err := intent.NewStore(c, ns, "csibroker-intents", nil).List(ctx)
	if err != nil || len(intents) != 2 {
		t.Fatalf("intent record holds %d entries (%v), want 2", len(intents), err)
	}
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "gone", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}

	startBridge(t, env, ns, drivers, bridgeOpts{identity: "new-leader", leader: true})
	bound := kubetest.WaitBound(t, c, ns, "keep", 60*time.Second)
	noLeaks(t, env, ns, d, drv)
	vols := d.Volumes()
	if len(vols) != 1 || vols[0].Name != bound.Spec.VolumeName {
		t.Fatalf("driver volumes %+v, want only %s", vols, bound.Spec.VolumeName)
	}
}

// TestRecoveryDecidesAsTheAttemptDid: a claim deleted while the broker was
// down leaves a volume made with a provisioner secret that a grant allows
// on the claim's own labels. Recovery decides the secret on the same
// requester (its labels, recorded in the intent) and deletes the volume;
// deciding on less, it was refused and the volume leaked.
func TestRecoveryDecidesAsTheAttemptDid(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "labels.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	if _, err := c.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "creds", Namespace: ns}, StringData: map[string]string{"k": "v"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	rs, errs := policy.Compile([]policy.Grant{
		{Namespace: ns, Name: "create-for-test-apps", Spec: policy.GrantSpec{Drivers: []string{drv}, SecretNames: []string{"creds"},
			Operations: []policy.Operation{policy.OpCreateVolume}, Requesters: policy.Requesters{Namespaces: []string{ns}},
			Condition: `request.requester.labels["app"] == "test" && request.source.kind == "Template"`}},
		{Namespace: ns, Name: "delete", Spec: policy.GrantSpec{Drivers: []string{drv}, SecretNames: []string{"creds"},
			Operations: []policy.Operation{policy.OpDeleteVolume}, Requesters: policy.Requesters{Namespaces: []string{ns}}}},
	})
	if len(errs) != 0 {
		t.Fatal(errs)
	}
	authz := &policy.Authorizer{Rules: policy.NewStore(rs)}
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "labels"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete,
		map[string]string{"csi.storage.k8s.io/provisioner-secret-name": "creds", "csi.storage.k8s.io/provisioner-secret-namespace": "${pvc.namespace}"})

	crashAfterCreate(t, env, ns, drivers, bridgeOpts{policy: authz}, 1, func() {
		kubetest.MakeClaim(t, c, ns, "gone", class.Name, "1Gi") // labelled app=test
	})
	if n := len(d.Volumes()); n != 1 {
		t.Fatalf("driver has %d volumes, want 1 made before the crash", n)
	}
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "gone", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	startBridge(t, env, ns, drivers, bridgeOpts{identity: "new-leader", leader: true, policy: authz})
	noLeaks(t, env, ns, d, drv)
	if n := len(d.Volumes()); n != 0 {
		t.Fatalf("driver has %d volumes, want the deleted claim's deleted", n)
	}
}

// TestRecoveryAfterTheSecretIsGone: the broker dies right after
// CreateVolume; the claim and its provisioner secret are then deleted (as
// with the claim's namespace). Recovery learns the volume's ID without
// credentials, as the volume's deletion goes, and deletes it: asking for
// the secret first, it failed on every pass and the volume leaked.
func TestRecoveryAfterTheSecretIsGone(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	if _, err := c.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "creds"}, StringData: map[string]string{"k": "v"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	drv := kubetest.ClusterName(ns, "nosec.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "nosec"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, map[string]string{
		"csi.storage.k8s.io/provisioner-secret-name": "creds", "csi.storage.k8s.io/provisioner-secret-namespace": "${pvc.namespace}"})
	crashAfterCreate(t, env, ns, drivers, bridgeOpts{}, 1, func() {
		kubetest.MakeClaim(t, c, ns, "gone", class.Name, "1Gi")
	})
	if n := len(d.Volumes()); n != 1 {
		t.Fatalf("driver has %d volumes, want the one made before the crash", n)
	}
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "gone", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := c.CoreV1().Secrets(ns).Delete(ctx, "creds", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	startBridge(t, env, ns, drivers, bridgeOpts{identity: "new-leader", leader: true})
	noLeaks(t, env, ns, d, drv)
}
