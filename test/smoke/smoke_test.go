package smoke

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/csibroker/csibroker/internal/testenv"
)

// Every wait is bounded by this.
const waitTimeout = 60 * time.Second

const annSelectedNode = "volume.kubernetes.io/selected-node"
const annStorageProvisioner = "volume.kubernetes.io/storage-provisioner"

func TestMain(m *testing.M) {
	testenv.Main(m, testenv.Options{ControllerManager: true, Scheduler: true})
}

// fixture is one test's namespace on the shared control plane, with names for
// cluster-scoped objects derived from it (so parallel tests never collide)
// and their deletion at cleanup.
type fixture struct {
	t   *testing.T
	env *testenv.Env
	c   kubernetes.Interface
	ns  string
}

func newFixture(t *testing.T) *fixture {
	t.Parallel()
	env := testenv.Shared(t)
	return &fixture{t: t, env: env, c: env.Client(), ns: env.NewNamespace(t)}
}

// name returns a cluster-wide unique name for this test.
func (f *fixture) name(kind string) string { return f.ns + "-" + kind }

// driverName returns a unique CSI driver name for this test (at most 63
// bytes, so from the namespace's random suffix rather than its whole name).
func (f *fixture) driverName() string {
	return "d-" + f.ns[strings.LastIndexByte(f.ns, '-')+1:] + ".smoke.csibroker.test"
}

// cleanup deletes a cluster-scoped object when the test ends.
func (f *fixture) cleanup(what string, del func(ctx context.Context) error) {
	f.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := del(ctx); err != nil && !apierrors.IsNotFound(err) {
			f.t.Errorf("cleanup: delete %s: %v", what, err)
		}
	})
}

func (f *fixture) addNode(labels map[string]string) string {
	f.t.Helper()
	name := f.name("node")
	if _, err := f.env.AddNodes(f.t.Context(), testenv.NodeSpec{Name: name, Zone: "zone-a", Region: "region-1", Labels: labels}); err != nil {
		f.t.Fatal(err)
	}
	f.cleanup("node "+name, func(ctx context.Context) error {
		return f.c.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{})
	})
	return name
}

func (f *fixture) createCSIDriver(attachRequired bool) string {
	f.t.Helper()
	name := f.driverName()
	_, err := f.c.StorageV1().CSIDrivers().Create(f.t.Context(), &storagev1.CSIDriver{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       storagev1.CSIDriverSpec{AttachRequired: &attachRequired},
	}, metav1.CreateOptions{})
	if err != nil {
		f.t.Fatalf("create CSIDriver: %v", err)
	}
	f.cleanup("CSIDriver "+name, func(ctx context.Context) error {
		return f.c.StorageV1().CSIDrivers().Delete(ctx, name, metav1.DeleteOptions{})
	})
	return name
}

// createPV creates a 1Gi ReadWriteOnce CSI volume of driver in class.
func (f *fixture) createPV(driver, class string) string {
	f.t.Helper()
	name := f.name("pv")
	_, err := f.c.CoreV1().PersistentVolumes().Create(f.t.Context(), &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			StorageClassName:              class,
			PersistentVolumeSource: corev1.PersistentVolumeSource{
				CSI: &corev1.CSIPersistentVolumeSource{Driver: driver, VolumeHandle: "vol-" + name},
			},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		f.t.Fatalf("create PV: %v", err)
	}
	f.cleanup("PV "+name, func(ctx context.Context) error {
		return f.c.CoreV1().PersistentVolumes().Delete(ctx, name, metav1.DeleteOptions{})
	})
	return name
}

func (f *fixture) createPVC(name, class, volumeName string) {
	f.t.Helper()
	_, err := f.c.CoreV1().PersistentVolumeClaims(f.ns).Create(f.t.Context(), &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			StorageClassName: &class,
			VolumeName:       volumeName,
			Resources: corev1.VolumeResourceRequirements{
				Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		f.t.Fatalf("create PVC %s/%s: %v", f.ns, name, err)
	}
}

// createPod creates a pod using claim, either placed on nodeName directly
// (no scheduler involved) or left to the scheduler with nodeSelector.
func (f *fixture) createPod(name, claim, nodeName string, nodeSelector map[string]string) {
	f.t.Helper()
	_, err := f.c.CoreV1().Pods(f.ns).Create(f.t.Context(), &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PodSpec{
			NodeName:     nodeName,
			NodeSelector: nodeSelector,
			Containers: []corev1.Container{{
				Name: "app", Image: "registry.k8s.io/pause:3.10",
				VolumeMounts: []corev1.VolumeMount{{Name: "data", MountPath: "/data"}},
			}},
			Volumes: []corev1.Volume{{
				Name:         "data",
				VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}},
			}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		f.t.Fatalf("create pod %s/%s: %v", f.ns, name, err)
	}
}

// waitBound waits until claim and PV are bound to each other.
func (f *fixture) waitBound(claim, pv string) {
	f.t.Helper()
	err := testenv.WaitFor(f.t.Context(), waitTimeout, fmt.Sprintf("PVC %s/%s to bind to PV %s (PV controller)", f.ns, claim, pv),
		func(ctx context.Context) (bool, string, error) {
			pvc, err := f.c.CoreV1().PersistentVolumeClaims(f.ns).Get(ctx, claim, metav1.GetOptions{})
			if err != nil {
				return false, "", err
			}
			vol, err := f.c.CoreV1().PersistentVolumes().Get(ctx, pv, metav1.GetOptions{})
			if err != nil {
				return false, "", err
			}
			state := fmt.Sprintf("PVC phase %s volumeName %q; PV phase %s claimRef %v", pvc.Status.Phase, pvc.Spec.VolumeName, vol.Status.Phase, vol.Spec.ClaimRef)
			ok := pvc.Status.Phase == corev1.ClaimBound && pvc.Spec.VolumeName == pv &&
				vol.Status.Phase == corev1.VolumeBound && vol.Spec.ClaimRef != nil &&
				vol.Spec.ClaimRef.Namespace == f.ns && vol.Spec.ClaimRef.Name == claim && vol.Spec.ClaimRef.UID == pvc.UID
			return ok, state, nil
		})
	if err != nil {
		f.t.Fatal(err)
	}
}

// (a) The PV controller binds a claim to a matching pre-provisioned volume.
func TestStaticPVBindsToClaim(t *testing.T) {
	f := newFixture(t)
	// A class name no other test uses keeps this PV from matching their claims;
	// the StorageClass object itself need not exist for static binding.
	class := f.name("static")
	pv := f.createPV("static.smoke.csibroker.test", class)
	f.createPVC("data", class, "")
	f.waitBound("data", pv)
}

// (b) The attach/detach controller creates a VolumeAttachment for a pod's CSI
// volume on a node, and deletes it once the pod is gone.
func TestAttachDetachControllerCreatesVolumeAttachment(t *testing.T) {
	f := newFixture(t)
	ctx := t.Context()
	node := f.addNode(nil)
	driver := f.createCSIDriver(true)
	if err := f.env.AddCSINode(ctx, node, driver, "id-"+node, nil); err != nil {
		t.Fatal(err)
	}
	pv := f.createPV(driver, "")
	f.createPVC("data", "", pv)
	f.waitBound("data", pv)
	f.createPod("app", "data", node, nil)

	var vaName string
	err := testenv.WaitFor(ctx, waitTimeout, fmt.Sprintf("a VolumeAttachment of PV %s by %s on node %s (attach/detach controller)", pv, driver, node),
		func(ctx context.Context) (bool, string, error) {
			vas, err := f.c.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, "", err
			}
			for _, va := range vas.Items {
				if va.Spec.Source.PersistentVolumeName != nil && *va.Spec.Source.PersistentVolumeName == pv {
					if va.Spec.Attacher != driver || va.Spec.NodeName != node {
						return false, "", fmt.Errorf("VolumeAttachment %s has attacher %q node %q, want %q %q", va.Name, va.Spec.Attacher, va.Spec.NodeName, driver, node)
					}
					vaName = va.Name
					return true, "", nil
				}
			}
			return false, fmt.Sprintf("%d VolumeAttachments, none for %s", len(vas.Items), pv), nil
		})
	if err != nil {
		t.Fatal(err)
	}

	// Play the external-attacher: report the volume attached.
	va, err := f.c.StorageV1().VolumeAttachments().Get(ctx, vaName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	va.Status.Attached = true
	if _, err := f.c.StorageV1().VolumeAttachments().UpdateStatus(ctx, va, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("mark %s attached: %v", vaName, err)
	}
	err = testenv.WaitFor(ctx, waitTimeout, fmt.Sprintf("node %s to list volume of PV %s as attached", node, pv),
		func(ctx context.Context) (bool, string, error) {
			n, err := f.c.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
			if err != nil {
				return false, "", err
			}
			return len(n.Status.VolumesAttached) > 0, fmt.Sprintf("volumesAttached %v", n.Status.VolumesAttached), nil
		})
	if err != nil {
		t.Fatal(err)
	}

	// Without a kubelet nothing confirms a graceful deletion: force it.
	zero := int64(0)
	if err := f.c.CoreV1().Pods(f.ns).Delete(ctx, "app", metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
	err = testenv.WaitFor(ctx, waitTimeout, fmt.Sprintf("VolumeAttachment %s to be deleted after its pod (attach/detach controller)", vaName),
		func(ctx context.Context) (bool, string, error) {
			va, err := f.c.StorageV1().VolumeAttachments().Get(ctx, vaName, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				return true, "", nil
			}
			if err != nil {
				return false, "", err
			}
			return false, fmt.Sprintf("still there (deletionTimestamp %v)", va.DeletionTimestamp), nil
		})
	if err != nil {
		t.Fatal(err)
	}
}

// (c) For a WaitForFirstConsumer class, the scheduler picks a node for the
// pod and writes it on the claim, and the PV controller hands the claim to the
// class's provisioner: what a provisioner (the broker) waits for.
func TestWaitForFirstConsumerSelectsNode(t *testing.T) {
	for _, tc := range []struct {
		name      string
		csiObject bool // a CSIDriver and the node's CSINode entry exist
	}{
		{name: "with CSIDriver and CSINode", csiObject: true},
		{name: "nodes only", csiObject: false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			ctx := t.Context()
			// Pods are kept to this test's node by a label only it carries.
			sel := map[string]string{"smoke.csibroker.test/for": f.ns}
			node := f.addNode(sel)
			driver := f.driverName()
			if tc.csiObject {
				f.createCSIDriver(false)
				if err := f.env.AddCSINode(ctx, node, driver, "id-"+node, []string{testenv.LabelZone}); err != nil {
					t.Fatal(err)
				}
			}
			class := f.name("wffc")
			wffc := storagev1.VolumeBindingWaitForFirstConsumer
			_, err := f.c.StorageV1().StorageClasses().Create(ctx, &storagev1.StorageClass{
				ObjectMeta:        metav1.ObjectMeta{Name: class},
				Provisioner:       driver,
				VolumeBindingMode: &wffc,
			}, metav1.CreateOptions{})
			if err != nil {
				t.Fatal(err)
			}
			f.cleanup("StorageClass "+class, func(ctx context.Context) error {
				return f.c.StorageV1().StorageClasses().Delete(ctx, class, metav1.DeleteOptions{})
			})
			f.createPVC("data", class, "")
			f.createPod("app", "data", "", sel)

			err = testenv.WaitFor(ctx, waitTimeout, fmt.Sprintf("the scheduler to set %s=%s and the PV controller %s=%s on PVC %s/data", annSelectedNode, node, annStorageProvisioner, driver, f.ns),
				func(ctx context.Context) (bool, string, error) {
					pvc, err := f.c.CoreV1().PersistentVolumeClaims(f.ns).Get(ctx, "data", metav1.GetOptions{})
					if err != nil {
						return false, "", err
					}
					if got := pvc.Annotations[annSelectedNode]; got != "" && got != node {
						return false, "", fmt.Errorf("scheduler selected node %q, want %q", got, node)
					}
					state := fmt.Sprintf("PVC annotations %v", pvc.Annotations)
					if pod, err := f.c.CoreV1().Pods(f.ns).Get(ctx, "app", metav1.GetOptions{}); err == nil {
						state += fmt.Sprintf("; pod conditions %v", pod.Status.Conditions)
					}
					return pvc.Annotations[annSelectedNode] == node && pvc.Annotations[annStorageProvisioner] == driver, state, nil
				})
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}
