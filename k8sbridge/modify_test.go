package k8sbridge

import (
	"context"
	"fmt"
	"maps"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/csiparams"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
	"github.com/csibroker/csibroker/policy"
)

const modifyCanary = "modify-canary-3c81f0"

// flakyIOPS is a class parameter the test's driver applies, then fails.
const flakyIOPS = "777"

// TestModifyVolumeAttributesClass: a bound claim set to another
// VolumeAttributesClass of its driver has its volume modified with the
// class's parameters and the controller-modify secret its PV records
// (allowed by a grant for ControllerModifyVolume), then the PV names the
// class and the claim's status says it is current. A class the driver
// refuses (InvalidArgument) leaves the claim Infeasible with a
// ModifyVolumeError condition and an Event; set back to its current class,
// the claim's modify status is cleared. A class that does not exist yet
// leaves it Pending until it is created. A denied secret writes nothing
// and calls nothing. The secret's value appears in no Event, object, log
// line, span or metric.
func TestModifyVolumeAttributesClass(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "mod.csi.test")
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv}, verboseChain)
	var mu sync.Mutex
	modifySecrets := map[string][]string{} // volume ID → the "password" of each call
	hooked := &hookedDrivers{testDrivers: drivers, hook: func(_ string, args, _ any, err error) error {
		req, ok := args.(*csi.ControllerModifyVolumeRequest)
		if !ok {
			return err
		}
		mu.Lock()
		modifySecrets[req.GetVolumeId()] = append(modifySecrets[req.GetVolumeId()], req.GetSecrets()["password"])
		mu.Unlock()
		if err == nil && req.GetMutableParameters()[sampledriver.MutableIOPS] == flakyIOPS {
			// Applied, then failed: the driver may have changed the volume.
			return status.Error(codes.Internal, "backend lost the answer")
		}
		return err
	}}
	kubetest.CreatePasswordSecrets(t, c, ns, modifyCanary, "mod-ok", "mod-forbidden")
	authz := kubetest.GrantsAuthorizer(t, policy.Grant{Namespace: ns, Name: "modify", Spec: policy.GrantSpec{
		Drivers: []string{drv}, SecretNames: []string{"mod-ok"}, Operations: []policy.Operation{policy.OpControllerModifyVolume},
		Requesters: policy.Requesters{Namespaces: []string{ns}}}})
	modClass := func(name, secret string) string {
		return kubetest.MakeClass(t, c, kubetest.ClusterName(ns, name), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, map[string]string{
			"csi.storage.k8s.io/controller-modify-secret-name": secret, "csi.storage.k8s.io/controller-modify-secret-namespace": ns}).Name
	}
	classOK, classDenied := modClass("ok", "mod-ok"), modClass("denied", "mod-forbidden")
	vac := func(name string, params map[string]string) string {
		return makeVAC(t, c, kubetest.ClusterName(ns, name), drv, params)
	}
	silver := vac("silver", map[string]string{sampledriver.MutableIOPS: "100", sampledriver.MutableTier: "standard"})
	gold := vac("gold", map[string]string{sampledriver.MutableIOPS: "3000", sampledriver.MutableTier: "premium"})
	bad := vac("bad", map[string]string{sampledriver.MutableIOPS: "-1"})
	r := startBridge(t, env, ns, hooked, bridgeOpts{policy: authz, allLogs: true})

	withVAC := func(v string) func(*corev1.PersistentVolumeClaim) {
		return func(p *corev1.PersistentVolumeClaim) { p.Spec.VolumeAttributesClassName = &v }
	}
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaimWith(t, c, ns, "data", classOK, withVAC(silver)).Name, 60*time.Second).Spec.VolumeName
	deniedPV := kubetest.WaitBound(t, c, ns, kubetest.MakeClaimWith(t, c, ns, "denied", classDenied, withVAC(silver)).Name, 60*time.Second).Spec.VolumeName
	volID, deniedVolID := volumeHandle(t, c, pvName), volumeHandle(t, c, deniedPV)
	mutable := func(id string) map[string]string {
		for _, v := range d.Volumes() {
			if v.ID == id {
				return v.MutableParameters
			}
		}
		t.Fatalf("driver has no volume %s", id)
		return nil
	}

	// To gold: modified, recorded, the secret passed.
	setVAC(t, c, ns, "data", gold)
	claim := waitClaim(t, c, ns, "data", "current class "+gold, func(p *corev1.PersistentVolumeClaim) bool {
		return p.Status.CurrentVolumeAttributesClassName != nil && *p.Status.CurrentVolumeAttributesClassName == gold
	})
	if claim.Status.ModifyVolumeStatus != nil || hasModifyCondition(claim) {
		t.Errorf("claim status after the modification: %+v", claim.Status)
	}
	if got := mutable(volID); got[sampledriver.MutableIOPS] != "3000" || got[sampledriver.MutableTier] != "premium" {
		t.Errorf("driver volume's mutable parameters %v, want gold's", got)
	}
	if pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	} else if pv.Spec.VolumeAttributesClassName == nil || *pv.Spec.VolumeAttributesClassName != gold {
		t.Errorf("PV volumeAttributesClassName %v, want %s", pv.Spec.VolumeAttributesClassName, gold)
	}
	mu.Lock()
	if s := modifySecrets[volID]; len(s) != 1 || s[0] != modifyCanary {
		t.Errorf("ControllerModifyVolume calls for %s: %d, controller-modify secret passed %v; want one, with the secret", volID, len(s), len(s) == 1 && s[0] == modifyCanary)
	}
	mu.Unlock()
	kubetest.WaitEvent(t, c, ns, "data", "VolumeModifySuccessful", "to VolumeAttributesClass "+gold)

	// A class the driver refuses: Infeasible, with the driver's reason.
	setVAC(t, c, ns, "data", bad)
	claim = waitClaim(t, c, ns, "data", "Infeasible", func(p *corev1.PersistentVolumeClaim) bool {
		return p.Status.ModifyVolumeStatus != nil && p.Status.ModifyVolumeStatus.Status == corev1.PersistentVolumeClaimModifyVolumeInfeasible
	})
	if s := claim.Status.ModifyVolumeStatus; s.TargetVolumeAttributesClassName != bad {
		t.Errorf("modifyVolumeStatus %+v, want target %s", s, bad)
	}
	cond := modifyCondition(claim, corev1.PersistentVolumeClaimVolumeModifyVolumeError)
	if cond == nil || !strings.Contains(cond.Message, "InvalidArgument") || !strings.Contains(cond.Message, "iops") {
		t.Errorf("ModifyVolumeError condition %+v: want the driver's InvalidArgument and message", cond)
	}
	kubetest.WaitEvent(t, c, ns, "data", "VolumeModifyFailed", "InvalidArgument")
	if got := mutable(volID); got[sampledriver.MutableIOPS] != "3000" {
		t.Errorf("driver volume's mutable parameters %v after a refused class, want gold's still", got)
	}

	// Set back to gold: nothing pending any more.
	setVAC(t, c, ns, "data", gold)
	waitClaim(t, c, ns, "data", "modify status cleared", func(p *corev1.PersistentVolumeClaim) bool {
		return p.Status.ModifyVolumeStatus == nil && !hasModifyCondition(p) && *p.Status.CurrentVolumeAttributesClassName == gold
	})

	// A class not made yet: Pending, then done once it exists.
	later := kubetest.ClusterName(ns, "later")
	setVAC(t, c, ns, "data", later)
	waitClaim(t, c, ns, "data", "Pending", func(p *corev1.PersistentVolumeClaim) bool {
		return p.Status.ModifyVolumeStatus != nil && p.Status.ModifyVolumeStatus.Status == corev1.PersistentVolumeClaimModifyVolumePending
	})
	kubetest.WaitEvent(t, c, ns, "data", "VolumeModifyFailed", "not found")
	vac("later", map[string]string{sampledriver.MutableIOPS: "500"})
	waitClaim(t, c, ns, "data", "current class "+later, func(p *corev1.PersistentVolumeClaim) bool {
		return p.Status.CurrentVolumeAttributesClassName != nil && *p.Status.CurrentVolumeAttributesClassName == later && p.Status.ModifyVolumeStatus == nil
	})
	if got := mutable(volID); got[sampledriver.MutableIOPS] != "500" {
		t.Errorf("driver volume's mutable parameters %v, want later's iops", got)
	}

	// A failure after which the driver may have applied some of the
	// class: InProgress with the error; set back to the current class
	// (after a class that does not exist), its parameters are applied
	// again, and nothing is pending.
	flaky := vac("flaky", map[string]string{sampledriver.MutableIOPS: flakyIOPS})
	setVAC(t, c, ns, "data", flaky)
	claim = waitClaim(t, c, ns, "data", "InProgress with a ModifyVolumeError", func(p *corev1.PersistentVolumeClaim) bool {
		return p.Status.ModifyVolumeStatus != nil && p.Status.ModifyVolumeStatus.Status == corev1.PersistentVolumeClaimModifyVolumeInProgress &&
			modifyCondition(p, corev1.PersistentVolumeClaimVolumeModifyVolumeError) != nil
	})
	if cond := modifyCondition(claim, corev1.PersistentVolumeClaimVolumeModifyVolumeError); !strings.Contains(cond.Message, "Internal") || cond.Reason != "Internal" {
		t.Errorf("ModifyVolumeError condition %+v: want the driver's Internal", cond)
	}
	// A class that does not exist in between: Pending now, but the
	// driver may still have some of the flaky class.
	setVAC(t, c, ns, "data", kubetest.ClusterName(ns, "nowhere"))
	waitClaim(t, c, ns, "data", "Pending after the failure", func(p *corev1.PersistentVolumeClaim) bool {
		return p.Status.ModifyVolumeStatus != nil && p.Status.ModifyVolumeStatus.Status == corev1.PersistentVolumeClaimModifyVolumePending
	})
	setVAC(t, c, ns, "data", later)
	waitClaim(t, c, ns, "data", "back on "+later, func(p *corev1.PersistentVolumeClaim) bool {
		return p.Status.ModifyVolumeStatus == nil && !hasModifyCondition(p) && *p.Status.CurrentVolumeAttributesClassName == later
	})
	if got := mutable(volID); got[sampledriver.MutableIOPS] != "500" {
		t.Errorf("driver volume's mutable parameters %v after the rollback, want later's iops again", got)
	}

	// A denied secret: an Event, no status, no call.
	setVAC(t, c, ns, "denied", gold)
	ev := kubetest.WaitEvent(t, c, ns, "denied", "VolumeModifyFailed", "denied by policy")
	for _, w := range []string{ns + "/mod-forbidden", "ControllerModifyVolume"} {
		if !strings.Contains(ev.Message, w) {
			t.Errorf("event %q does not say %q", ev.Message, w)
		}
	}
	if denied, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "denied", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	} else if denied.Status.ModifyVolumeStatus != nil || hasModifyCondition(denied) || *denied.Status.CurrentVolumeAttributesClassName != silver {
		t.Errorf("denied claim status %+v: nothing may be recorded before the secret is allowed", denied.Status)
	}
	mu.Lock()
	if n := len(modifySecrets[deniedVolID]); n != 0 {
		t.Errorf("driver called %d times with a denied secret", n)
	}
	mu.Unlock()
	if got := r.metricValue(t, "csibroker_modify_operations_total", map[string]string{"driver": drv, "result": "success"}); got < 3 {
		t.Errorf("successful modifications counted: %v, want 3", got)
	}
	assertNoCanary(t, c, ns, r, drivers, modifyCanary)
}

// makeVAC creates a VolumeAttributesClass of driver drv (deleted at the
// test's end) and returns its name.
func makeVAC(t *testing.T, c kubernetes.Interface, name, drv string, params map[string]string) string {
	t.Helper()
	v := &storagev1.VolumeAttributesClass{ObjectMeta: metav1.ObjectMeta{Name: name}, DriverName: drv, Parameters: params}
	if _, err := c.StorageV1().VolumeAttributesClasses().Create(context.Background(), v, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.StorageV1().VolumeAttributesClasses().Delete(context.Background(), v.Name, metav1.DeleteOptions{})
	})
	return v.Name
}

func setVAC(t *testing.T, c kubernetes.Interface, ns, claim, class string) {
	t.Helper()
	patch := []byte(`{"spec":{"volumeAttributesClassName":"` + class + `"}}`)
	if _, err := c.CoreV1().PersistentVolumeClaims(ns).Patch(context.Background(), claim, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatalf("set the VolumeAttributesClass of claim %s to %s: %v", claim, class, err)
	}
}

func modifyCondition(p *corev1.PersistentVolumeClaim, t corev1.PersistentVolumeClaimConditionType) *corev1.PersistentVolumeClaimCondition {
	for i := range p.Status.Conditions {
		if p.Status.Conditions[i].Type == t {
			return &p.Status.Conditions[i]
		}
	}
	return nil
}

func hasModifyCondition(p *corev1.PersistentVolumeClaim) bool {
	return modifyCondition(p, corev1.PersistentVolumeClaimVolumeModifyingVolume) != nil ||
		modifyCondition(p, corev1.PersistentVolumeClaimVolumeModifyVolumeError) != nil
}

// TestModifyPassesExtraMetadata: with ExtraModifyMetadata
// (--extra-modify-metadata) ControllerModifyVolume's mutable parameters
// carry the claim's name and namespace and the PV's name besides the
// class's, as external-resizer's flag adds them.
func TestModifyPassesExtraMetadata(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "meta.csi.test")
	drivers := &testDrivers{}
	drivers.addDriver(t, sampledriver.Config{Name: drv})
	var mu sync.Mutex
	var seen []map[string]string
	hooked := &hookedDrivers{testDrivers: drivers, hook: func(_ string, args, _ any, err error) error {
		if req, ok := args.(*csi.ControllerModifyVolumeRequest); ok {
			mu.Lock()
			seen = append(seen, req.GetMutableParameters())
			mu.Unlock()
		}
		return err
	}}
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "meta"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	vName := makeVAC(t, c, kubetest.ClusterName(ns, "fast"), drv, map[string]string{sampledriver.MutableIOPS: "900"})
	startBridge(t, env, ns, hooked, bridgeOpts{configureCfg: func(cfg *Config) { cfg.ExtraModifyMetadata = true }})
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second).Spec.VolumeName
	setVAC(t, c, ns, "data", vName)
	waitClaim(t, c, ns, "data", "current class "+vName, func(p *corev1.PersistentVolumeClaim) bool {
		return p.Status.CurrentVolumeAttributesClassName != nil && *p.Status.CurrentVolumeAttributesClassName == vName
	})
	mu.Lock()
	defer mu.Unlock()
	want := map[string]string{sampledriver.MutableIOPS: "900", csiparams.ParamPVCName: "data", csiparams.ParamPVCNamespace: ns, csiparams.ParamPVName: pvName}
	if len(seen) != 1 || !maps.Equal(seen[0], want) {
		t.Fatalf("ControllerModifyVolume mutable parameters %v, want one call with %v", seen, want)
	}
}

// TestModifyCancelledBackToNoClass: a claim whose volume has no
// VolumeAttributesClass, set to one and then back to none (null or ""),
// has its modify status and conditions cleared, with no driver call: else
// the class its status names stays in use, and its deletion waits for
// ever. Both a class that does not exist (Pending) and one the driver
// failed (InProgress, with both modify conditions).
func TestModifyCancelledBackToNoClass(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "none.csi.test")
	hooked, calls := modifyCountingDriver(t, drv, status.Error(codes.Internal, "backend unavailable"))
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "none"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	failingName := makeVAC(t, c, kubetest.ClusterName(ns, "failing"), drv, map[string]string{sampledriver.MutableIOPS: "900"})
	// The queue's retries wait on a fake clock, stepped below: the
	// failed class's retry stays queued until then.
	fake := testingclock.NewFakeClock(time.Now())
	r := startBridge(t, env, ns, hooked, bridgeOpts{configureCfg: func(cfg *Config) { cfg.Clock = fake }})
	kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "pending", class.Name, "1Gi").Name, 60*time.Second)
	kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "failed", class.Name, "1Gi").Name, 60*time.Second)

	setVAC(t, c, ns, "pending", kubetest.ClusterName(ns, "nowhere"))
	waitClaim(t, c, ns, "pending", "Pending", func(p *corev1.PersistentVolumeClaim) bool {
		return p.Status.ModifyVolumeStatus != nil && p.Status.ModifyVolumeStatus.Status == corev1.PersistentVolumeClaimModifyVolumePending
	})
	setVAC(t, c, ns, "failed", failingName)
	waitClaim(t, c, ns, "failed", "InProgress with both modify conditions", func(p *corev1.PersistentVolumeClaim) bool {
		return p.Status.ModifyVolumeStatus != nil && p.Status.ModifyVolumeStatus.Status == corev1.PersistentVolumeClaimModifyVolumeInProgress &&
			modifyCondition(p, corev1.PersistentVolumeClaimVolumeModifyingVolume) != nil &&
			modifyCondition(p, corev1.PersistentVolumeClaimVolumeModifyVolumeError) != nil
	})

	for name, none := range map[string]string{"pending": `null`, "failed": `""`} {
		patch := []byte(`{"spec":{"volumeAttributesClassName":` + none + `}}`)
		if _, err := c.CoreV1().PersistentVolumeClaims(ns).Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			t.Fatalf("set the VolumeAttributesClass of claim %s back to %s: %v", name, none, err)
		}
	}
	for _, name := range []string{"pending", "failed"} {
		err := testenv.WaitFor(ctx, 10*time.Second, "claim "+name+": modify status cleared", func(ctx context.Context) (bool, string, error) {
			p, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, err.Error(), nil
			}
			return p.Status.ModifyVolumeStatus == nil && !hasModifyCondition(p) && p.Status.CurrentVolumeAttributesClassName == nil,
				fmt.Sprintf("status %+v", p.Status), nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	// The failed class's retry, queued with its backoff, comes due: it
	// is handled and asks the driver nothing.
	n, handled := calls.Load(), r.metricValue(t, "csibroker_work_items_total", map[string]string{"controller": "modify"})
	fake.Step(3 * time.Second) // past the longest backoff (2 s)
	err := testenv.WaitFor(ctx, 30*time.Second, "the queued retry handled", func(context.Context) (bool, string, error) {
		now := r.metricValue(t, "csibroker_work_items_total", map[string]string{"controller": "modify"})
		return now > handled, fmt.Sprintf("%v work items handled since the step", now-handled), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := calls.Load(); got != n {
		t.Errorf("%d ControllerModifyVolume calls after the modification was cancelled, want none", got-n)
	}
}

// TestModifyReportsRefusedWrites: API writes of a modification that the
// cluster refuses (admission policies here: the PV may not take the
// class, then the claim's status may not say it is current) are each a
// VolumeModifyFailed Warning Event on the claim, once however often the
// modification is retried; with the refusals lifted, it completes.
func TestModifyReportsRefusedWrites(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "refused.csi.test")
	hooked, calls := modifyCountingDriver(t, drv, nil)
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "refused"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	goldName := makeVAC(t, c, kubetest.ClusterName(ns, "gold"), drv, map[string]string{sampledriver.MutableIOPS: "3000"})
	startBridge(t, env, ns, hooked, bridgeOpts{})
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "data", class.Name, "1Gi").Name, 60*time.Second).Spec.VolumeName

	const pvRefused, claimRefused = "PV classes are refused by the test's policy", "current classes are refused by the test's policy"
	allowPV := denyUpdates(t, c, kubetest.ClusterName(ns, "no-pv-class"), admissionregistrationv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"persistentvolumes"}},
		fmt.Sprintf("object.spec.storageClassName == %q", class.Name),
		"!has(object.spec.volumeAttributesClassName) || (has(oldObject.spec.volumeAttributesClassName) && object.spec.volumeAttributesClassName == oldObject.spec.volumeAttributesClassName)",
		pvRefused, func(ctx context.Context) error {
			pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{})
			if err != nil {
				return err
			}
			pv.Spec.VolumeAttributesClassName = &goldName
			_, err = c.CoreV1().PersistentVolumes().Update(ctx, pv, metav1.UpdateOptions{DryRun: []string{metav1.DryRunAll}})
			return err
		})
	allowClaim := denyUpdates(t, c, kubetest.ClusterName(ns, "no-current-class"), admissionregistrationv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"persistentvolumeclaims/status"}},
		fmt.Sprintf("object.metadata.namespace == %q && object.metadata.name == 'data'", ns),
		"!has(object.status.currentVolumeAttributesClassName) || (has(oldObject.status.currentVolumeAttributesClassName) && object.status.currentVolumeAttributesClassName == oldObject.status.currentVolumeAttributesClassName)",
		claimRefused, func(ctx context.Context) error {
			p, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "data", metav1.GetOptions{})
			if err != nil {
				return err
			}
			p.Status.CurrentVolumeAttributesClassName = &goldName
			_, err = c.CoreV1().PersistentVolumeClaims(ns).UpdateStatus(ctx, p, metav1.UpdateOptions{DryRun: []string{metav1.DryRunAll}})
			return err
		})

	// The driver modifies the volume; the PV may not say so.
	setVAC(t, c, ns, "data", goldName)
	kubetest.WaitEvent(t, c, ns, "data", "VolumeModifyFailed", pvRefused)
	// Retried (the driver asked again each time), reported once.
	err := testenv.WaitFor(ctx, 30*time.Second, "retries", func(context.Context) (bool, string, error) {
		n := calls.Load()
		return n >= 4, fmt.Sprintf("%d ControllerModifyVolume calls", n), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := countEvents(t, c, ns, "data", "VolumeModifyFailed", pvRefused); n != 1 {
		t.Errorf("%d VolumeModifyFailed Events for the refused PV write over %d attempts, want 1:\n%s", n, calls.Load(), kubetest.EventsOf(c, ns, "data"))
	}

	// The PV may; the claim's status may not say the class is current.
	allowPV()
	kubetest.WaitEvent(t, c, ns, "data", "VolumeModifyFailed", claimRefused)
	kubetest.WaitPV(t, c, pvName, "class "+goldName, 30*time.Second, func(pv *corev1.PersistentVolume) (bool, string) {
		if pv == nil {
			return false, "no PV"
		}
		return pv.Spec.VolumeAttributesClassName != nil && *pv.Spec.VolumeAttributesClassName == goldName,
			fmt.Sprintf("volumeAttributesClassName %v", pv.Spec.VolumeAttributesClassName)
	})

	allowClaim()
	waitClaim(t, c, ns, "data", "current class "+goldName, func(p *corev1.PersistentVolumeClaim) bool {
		return p.Status.CurrentVolumeAttributesClassName != nil && *p.Status.CurrentVolumeAttributesClassName == goldName &&
			p.Status.ModifyVolumeStatus == nil && !hasModifyCondition(p)
	})
	if n := countEvents(t, c, ns, "data", "VolumeModifyFailed", claimRefused); n != 1 {
		t.Errorf("%d VolumeModifyFailed Events for the refused claim status write, want 1:\n%s", n, kubetest.EventsOf(c, ns, "data"))
	}
}

// denyUpdates binds a ValidatingAdmissionPolicy that refuses, with
// message, the updates of rule's objects that match and fail validation,
// and waits until probe (a dry run of such an update) is refused; the
// returned func unbinds it.
func denyUpdates(t *testing.T, c kubernetes.Interface, name string, rule admissionregistrationv1.Rule, match, validation, message string, probe func(context.Context) error) func() {
	t.Helper()
	ctx := context.Background()
	fail := admissionregistrationv1.Fail
	vap := &admissionregistrationv1.ValidatingAdmissionPolicy{ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicySpec{
			FailurePolicy: &fail,
			MatchConstraints: &admissionregistrationv1.MatchResources{ResourceRules: []admissionregistrationv1.NamedRuleWithOperations{{
				RuleWithOperations: admissionregistrationv1.RuleWithOperations{Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Update}, Rule: rule}}}},
			MatchConditions: []admissionregistrationv1.MatchCondition{{Name: "this-test", Expression: match}},
			Validations:     []admissionregistrationv1.Validation{{Expression: validation, Message: message}},
		}}
	if _, err := c.AdmissionregistrationV1().ValidatingAdmissionPolicies().Create(ctx, vap, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.AdmissionregistrationV1().ValidatingAdmissionPolicies().Delete(context.Background(), name, metav1.DeleteOptions{})
	})
	binding := &admissionregistrationv1.ValidatingAdmissionPolicyBinding{ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicyBindingSpec{PolicyName: name, ValidationActions: []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny}}}
	if _, err := c.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	unbind := func() {
		err := c.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Delete(context.Background(), name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			t.Error(err)
		}
	}
	t.Cleanup(unbind)
	err := testenv.WaitFor(ctx, 30*time.Second, "policy "+name+" in force", func(ctx context.Context) (bool, string, error) {
		err := probe(ctx)
		return err != nil && strings.Contains(err.Error(), message), fmt.Sprint(err), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return unbind
}

// countEvents counts the Events of reason on name whose message contains
// want, repeats included.
func countEvents(t *testing.T, c kubernetes.Interface, ns, name, reason, want string) int {
	t.Helper()
	evs, err := c.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + name})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range evs.Items {
		if e.Reason == reason && strings.Contains(e.Message, want) {
			n += max(int(e.Count), 1)
		}
	}
	return n
}

// TestModifyAppliedBeforeTheClaimWasSetBackToNone: the driver applied a
// class and the PV names it, but the claim's last status write was lost
// (here: written by the test while no broker led), and the claim asks for
// no class. The volume has that class: it is recorded as the claim's
// current one, with a Warning Event, not dropped (the PV would keep the
// class in use with nothing saying so).
func TestModifyAppliedBeforeTheClaimWasSetBackToNone(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "applied.csi.test")
	drivers := &testDrivers{}
	drivers.addDriver(t, sampledriver.Config{Name: drv})
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "applied"), drv, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	goldName := makeVAC(t, c, kubetest.ClusterName(ns, "gold"), drv, map[string]string{sampledriver.MutableIOPS: "3000"})
	run := startBridge(t, env, ns, drivers, bridgeOpts{})
	pvName := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "applied", class.Name, "1Gi").Name, 60*time.Second).Spec.VolumeName
	run.stop()

	pvPatch := []byte(`{"spec":{"volumeAttributesClassName":"` + goldName + `"}}`)
	if _, err := c.CoreV1().PersistentVolumes().Patch(ctx, pvName, types.MergePatchType, pvPatch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	statusPatch := []byte(`{"status":{"modifyVolumeStatus":{"targetVolumeAttributesClassName":"` + goldName + `","status":"InProgress"},` +
		`"conditions":[{"type":"ModifyingVolume","status":"True","reason":"InProgress"}]}}`)
	if _, err := c.CoreV1().PersistentVolumeClaims(ns).Patch(ctx, "applied", types.MergePatchType, statusPatch, metav1.PatchOptions{}, "status"); err != nil {
		t.Fatal(err)
	}
	startBridge(t, env, ns, drivers, bridgeOpts{})
	waitClaim(t, c, ns, "applied", "the applied class recorded as current", func(p *corev1.PersistentVolumeClaim) bool {
		cur := p.Status.CurrentVolumeAttributesClassName
		return cur != nil && *cur == goldName && p.Status.ModifyVolumeStatus == nil && !hasModifyCondition(p)
	})
	kubetest.WaitEvent(t, c, ns, "applied", "VolumeModifyFailed", "was modified to VolumeAttributesClass "+goldName+" already")
}

// modifyCountingDriver is a sample driver named drv that counts its
// ControllerModifyVolume calls, each answered answer if that is set.
func modifyCountingDriver(t *testing.T, drv string, answer error) (*hookedDrivers, *atomic.Int64) {
	t.Helper()
	drivers := &testDrivers{}
	drivers.addDriver(t, sampledriver.Config{Name: drv})
	calls := &atomic.Int64{}
	return &hookedDrivers{testDrivers: drivers, hook: func(_ string, args, _ any, err error) error {
		if _, ok := args.(*csi.ControllerModifyVolumeRequest); ok {
			calls.Add(1)
			if answer != nil {
				return answer
			}
		}
		return err
	}}, calls
}
