package k8sbridge

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
)

// TestFailuresReportedOncePerFailure: a provisioning, an attachment and a
// deletion that the driver refuses on every attempt (with a message that
// differs on every call: the sample driver counts its faults in it) are
// retried with backoff and logged on every attempt, but each is recorded
// as one Warning Event on its object, carrying the driver's code and
// message; the claim is told once that provisioning started.
func TestFailuresReportedOncePerFailure(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	node := addAttachNode(t, env, ns)
	refuse := sampledriver.Fault{Rate: 1, Code: codes.Internal}
	nocreate, stuck := kubetest.ClusterName(ns, "nocreate.csi.test"), kubetest.ClusterName(ns, "stuck.csi.test")
	drivers := &testDrivers{}
	dc := drivers.addDriver(t, sampledriver.Config{Name: nocreate, Faults: sampledriver.Faults{Methods: map[string]sampledriver.Fault{"CreateVolume": refuse}}})
	ds := drivers.addDriver(t, sampledriver.Config{Name: stuck, NodeID: node, Faults: sampledriver.Faults{Methods: map[string]sampledriver.Fault{
		"ControllerPublishVolume": refuse, "DeleteVolume": refuse}}})
	makeCSIDriver(t, c, stuck, true)
	if err := env.AddCSINode(ctx, node, stuck, node, nil); err != nil {
		t.Fatal(err)
	}
	noClass := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "nocreate"), nocreate, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	stuckClass := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "stuck"), stuck, storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete, nil)
	r := startBridge(t, env, ns, drivers, bridgeOpts{})

	kubetest.MakeClaim(t, c, ns, "p", noClass.Name, "1Gi")
	attached := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "a", stuckClass.Name, "1Gi").Name, 60*time.Second)
	deleted := kubetest.WaitBound(t, c, ns, kubetest.MakeClaim(t, c, ns, "d", stuckClass.Name, "1Gi").Name, 60*time.Second)
	pvD := deleted.Spec.VolumeName
	// The PV whose deletion never succeeds keeps the deletion finalizer:
	// dropped once the bridge has stopped (clean-ups run last first).
	t.Cleanup(func() {
		patch := []byte(`{"metadata":{"finalizers":null}}`)
		c.CoreV1().PersistentVolumes().Patch(context.Background(), pvD, types.MergePatchType, patch, metav1.PatchOptions{})
		c.CoreV1().PersistentVolumes().Delete(context.Background(), pvD, metav1.DeleteOptions{})
	})
	va := createVA(t, c, ns, stuck, node, attached.Spec.VolumeName)
	if err := c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "d", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}

	// Four calls each: the first three attempts have recorded all they
	// record once the fourth has reached the driver.
	for _, w := range []struct {
		d      *sampledriver.Driver
		method string
	}{{dc, "CreateVolume"}, {ds, "ControllerPublishVolume"}, {ds, "DeleteVolume"}} {
		err := testenv.WaitFor(ctx, 60*time.Second, "four "+w.method+" calls", func(context.Context) (bool, string, error) {
			n := w.d.CallCount(w.method)
			return n >= 4, fmt.Sprintf("%d calls", n), nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}

	claimP, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "p", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvD, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	vaObj, err := c.StorageV1().VolumeAttachments().Get(ctx, va.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range []struct {
		ref      corev1.ObjectReference
		ns       string
		reasons  map[string]string // reason → what its Event must say
		calls    int64
		logLine  string
		logField string
	}{
		{kube.ClaimRef(claimP), ns, map[string]string{"ProvisioningFailed": "code = Internal", "Provisioning": "is provisioning volume"},
			dc.CallCount("CreateVolume"), `msg="provisioning failed"`, "claim=" + ns + "/p "},
		{kube.VARef(vaObj), "default", map[string]string{"AttachFailed": "code = Internal"},
			ds.CallCount("ControllerPublishVolume"), `msg="attachment failed"`, "volumeattachment=" + va.Name + " "},
		{kube.PVRef(pv), "default", map[string]string{"VolumeFailedDelete": "code = Internal"},
			ds.CallCount("DeleteVolume"), `msg="volume deletion failed"`, "pv=" + pvD + " "},
	} {
		// Events are written in the order recorded: once a marker recorded
		// now is there, so is every Event recorded before it.
		r.b.Event(ctx, o.ref, corev1.EventTypeWarning, "TestFlush", "flush")
		kubetest.WaitEvent(t, c, o.ns, o.ref.Name, "TestFlush", "flush")
		evs, err := c.CoreV1().Events(o.ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + o.ref.Name})
		if err != nil {
			t.Fatal(err)
		}
		for reason, want := range o.reasons {
			n := 0
			for _, e := range evs.Items {
				if e.Reason != reason || e.InvolvedObject.UID != o.ref.UID {
					continue
				}
				if !strings.Contains(e.Message, want) {
					t.Errorf("%s Event on %s says %q, want it to say %q", reason, o.ref.Name, e.Message, want)
				}
				n += int(max(e.Count, 1))
			}
			if n != 1 {
				t.Errorf("%d %s Events on %s %s after %d refused calls, want 1:%s", n, reason, o.ref.Kind, o.ref.Name, o.calls, kubetest.EventsOf(c, o.ns, o.ref.Name))
			}
		}
		logged := 0
		for _, l := range strings.Split(r.logs.String(), "\n") {
			if strings.Contains(l, o.logLine) && strings.Contains(l, o.logField) {
				logged++
			}
		}
		if logged < 3 {
			t.Errorf("%d log lines %s for %s after %d refused calls, want one per attempt", logged, o.logLine, o.ref.Name, o.calls)
		}
	}
}
