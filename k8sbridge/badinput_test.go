package k8sbridge

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
	"github.com/csibroker/csibroker/policy"
)

const canarySecret = "CANARY-secret-value-9d1e"

// TestBadInputGetsClearEvents: each kind of bad input ends as a
// ProvisioningFailed Event that says what is wrong, nothing is created, and
// a good claim next to them is provisioned, its CreateVolume carrying the
// canary secret value to the driver; that value appears in no Event, API
// object, log line (bridge, brokers and proxies logging at every level),
// span or metric.
func TestBadInputGetsClearEvents(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv, down := kubetest.ClusterName(ns, "ok.csi.test"), kubetest.ClusterName(ns, "down.csi.test")
	drivers := &testDrivers{}
	tap := &driverTap{} // what reaches the driver, after broker and proxy
	d := drivers.addDriver(t, sampledriver.Config{Name: drv}, verboseChain, tap.insert(t))
	// A second driver registered with the broker whose process is gone.
	drivers.addDeadDriver(t, down, verboseChain)

	// Secrets: "allowed" is granted to the driver, "forbidden" exists but is not.
	kubetest.CreatePasswordSecrets(t, c, ns, canarySecret, "allowed", "forbidden")
	authz := kubetest.GrantsAuthorizer(t, policy.Grant{Namespace: ns, Name: "grant-ok", Spec: policy.GrantSpec{
		Drivers: []string{drv}, SecretNames: []string{"allowed", "missing"}, Operations: []policy.Operation{policy.OpCreateVolume, policy.OpDeleteVolume, policy.OpNodeStageVolume},
		Requesters: policy.Requesters{Namespaces: []string{ns}}}})
	r := startBridge(t, env, ns, drivers, bridgeOpts{policy: authz, allLogs: true})

	secretParams := func(name string) map[string]string {
		return map[string]string{"csi.storage.k8s.io/provisioner-secret-name": name, "csi.storage.k8s.io/provisioner-secret-namespace": ns}
	}
	imm, del := storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete
	cases := []struct {
		claim, driver string
		params        map[string]string
		want          []string
	}{
		{"unknown-secret", drv, secretParams("missing"), []string{"secret " + ns + "/missing", "not found", "named by csi.storage.k8s.io/provisioner-secret-name"}},
		{"denied-secret", drv, secretParams("forbidden"), []string{"denied by policy", ns + "/forbidden", drv, "CreateVolume"}},
		// A node secret goes into the PV for the kubelet: decided before
		// the volume is made.
		{"denied-node-secret", drv, map[string]string{"csi.storage.k8s.io/node-stage-secret-name": "forbidden", "csi.storage.k8s.io/node-stage-secret-namespace": ns},
			[]string{"denied by policy", ns + "/forbidden", drv, "NodeStageVolume", "into the PV"}},
		{"bad-template", drv, map[string]string{"csi.storage.k8s.io/provisioner-secret-name": "${pvc.annotations['x']}", "csi.storage.k8s.io/provisioner-secret-namespace": ns}, []string{"csi.storage.k8s.io/provisioner-secret-name", "pvc.annotations"}},
		{"unknown-csi-key", drv, map[string]string{"csi.storage.k8s.io/frobnicate": "1"}, []string{"csi.storage.k8s.io/frobnicate"}},
		{"driver-rejects", drv, map[string]string{"colour": "red"}, []string{"InvalidArgument", `unknown parameter "colour"`}},
		{"driver-down", down, nil, []string{"driver " + down + " is not reachable", "Unavailable"}},
	}
	for _, tc := range cases {
		class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, tc.claim), tc.driver, imm, del, tc.params)
		kubetest.MakeClaim(t, c, ns, tc.claim, class.Name, "1Gi")
	}
	goodParams := secretParams("allowed")
	goodParams["csi.storage.k8s.io/node-stage-secret-name"] = "allowed"
	goodParams["csi.storage.k8s.io/node-stage-secret-namespace"] = ns
	goodClass := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "good"), drv, imm, del, goodParams)
	kubetest.MakeClaim(t, c, ns, "good", goodClass.Name, "1Gi")

	for _, tc := range cases {
		t.Run(tc.claim, func(t *testing.T) {
			ev := kubetest.WaitEvent(t, c, ns, tc.claim, "ProvisioningFailed", tc.want[0])
			for _, w := range tc.want[1:] {
				if !strings.Contains(ev.Message, w) {
					t.Errorf("event %q does not say %q", ev.Message, w)
				}
			}
			t.Logf("%s: %s", tc.claim, ev.Message)
		})
	}
	bound := kubetest.WaitBound(t, c, ns, "good", 60*time.Second)
	pv, err := c.CoreV1().PersistentVolumes().Get(ctx, bound.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if ref := pv.Spec.CSI.NodeStageSecretRef; ref == nil || ref.Name != "allowed" || ref.Namespace != ns {
		t.Fatalf("good claim's PV node-stage secret ref %+v, want %s/allowed", ref, ns)
	}
	vols := d.Volumes()
	if len(vols) != 1 || vols[0].Name != bound.Spec.VolumeName {
		t.Fatalf("driver volumes %+v: only the good claim's volume should exist", vols)
	}
	// The good claim used the allowed secret; the forbidden one was never read.
	if got := r.metricValue(t, "csibroker_secret_policy_decisions_total", map[string]string{"decision": "deny"}); got < 1 {
		t.Fatalf("deny decisions counted: %v", got)
	}

	// The canary went all the way: the good claim's CreateVolume reached
	// the driver with the allowed secret's value; no other request that
	// reached it carried a secret.
	carried := false
	for _, secrets := range tap.createSecrets(bound.Spec.VolumeName) {
		carried = carried || secrets["password"] == canarySecret
	}
	if !carried {
		t.Fatalf("no CreateVolume of %s reached the driver with the canary secret (requests seen for %v)", bound.Spec.VolumeName, tap.createNames())
	}
	for _, name := range tap.createNames() {
		if name == bound.Spec.VolumeName {
			continue
		}
		for _, secrets := range tap.createSecrets(name) {
			if len(secrets) != 0 {
				t.Errorf("CreateVolume of %s reached the driver with secrets (keys %v)", name, keys(secrets))
			}
		}
	}
	assertNoCanary(t, c, ns, r, drivers, canarySecret)
}

func keys(m map[string]string) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}
