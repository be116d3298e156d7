// Command minprov is the floor of the provisioning benchmark: the least a
// client-go provisioner does per claim when it makes the same API calls as
// external-provisioner. It watches claims, PVs and StorageClasses through
// shared informers, hands claims to workers through a rate-limited
// workqueue, records the two Events (Provisioning, ProvisioningSucceeded)
// through client-go's event broadcaster and creates the PV, all over
// protobuf. It makes no CSI call, records no intent, checks no policy, makes
// no span and keeps no metric: whatever CPU it spends per volume, any
// client-go provisioner making those calls spends too.
//
// It deletes Released PVs of its driver whose reclaim policy is Delete (no
// CSI call either) so that the benchmark's deletion phase ends; that phase
// is not its floor.
//
// It is a benchmark tool (test/benchk8s -floor), never part of csibroker.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "minprov:", err)
		os.Exit(1)
	}
}

type provisioner struct {
	driver   string
	client   kubernetes.Interface
	claims   corelisters.PersistentVolumeClaimLister
	pvs      corelisters.PersistentVolumeLister
	classes  storagelisters.StorageClassLister
	recorder record.EventRecorder
	queue    workqueue.TypedRateLimitingInterface[string]
}

func run() error {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig file")
	driver := flag.String("driver", "", "provisioner name in StorageClasses")
	qps := flag.Float64("kube-api-qps", 5, "client QPS")
	burst := flag.Int("kube-api-burst", 10, "client burst")
	workers := flag.Int("worker-threads", 100, "workers")
	flag.Parse()
	if *driver == "" {
		return errors.New("--driver is required")
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		return err
	}
	cfg.QPS, cfg.Burst = float32(*qps), *burst
	cfg.UserAgent = "minprov/bench"
	cfg.ContentType = runtime.ContentTypeProtobuf
	cfg.AcceptContentTypes = runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	// One client for everything, Events included, as external-provisioner.
	broadcaster := record.NewBroadcaster(record.WithContext(ctx))
	broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	defer broadcaster.Shutdown()

	f := informers.NewSharedInformerFactory(client, 0)
	claimInf, pvInf, classInf := f.Core().V1().PersistentVolumeClaims(), f.Core().V1().PersistentVolumes(), f.Storage().V1().StorageClasses()
	p := &provisioner{
		driver: *driver, client: client,
		claims: claimInf.Lister(), pvs: pvInf.Lister(), classes: classInf.Lister(),
		recorder: broadcaster.NewRecorder(scheme.Scheme, corev1.EventSource{Component: *driver}),
		queue:    workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[string]()),
	}
	defer p.queue.ShutDown()
	claimHandler := func(o any) {
		if c, ok := o.(*corev1.PersistentVolumeClaim); ok && c.Spec.VolumeName == "" {
			if key, err := cache.MetaNamespaceKeyFunc(c); err == nil {
				p.queue.Add("claim/" + key)
			}
		}
	}
	pvHandler := func(o any) {
		if pv, ok := o.(*corev1.PersistentVolume); ok && pv.Status.Phase == corev1.VolumeReleased {
			p.queue.Add("pv/" + pv.Name)
		}
	}
	if _, err := claimInf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: claimHandler, UpdateFunc: func(_, o any) { claimHandler(o) }}); err != nil {
		return err
	}
	if _, err := pvInf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: pvHandler, UpdateFunc: func(_, o any) { pvHandler(o) }}); err != nil {
		return err
	}
	_ = classInf.Informer()
	f.Start(ctx.Done())
	defer f.Shutdown()
	for typ, ok := range f.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return fmt.Errorf("cache of %v not synced", typ)
		}
	}
	var wg sync.WaitGroup
	for range *workers {
		wg.Go(func() {
			for p.next(ctx) {
			}
		})
	}
	<-ctx.Done()
	p.queue.ShutDown()
	wg.Wait()
	return nil
}

func (p *provisioner) next(ctx context.Context) bool {
	key, quit := p.queue.Get()
	if quit {
		return false
	}
	defer p.queue.Done(key)
	var err error
	if name, ok := strings.CutPrefix(key, "pv/"); ok {
		err = p.deletePV(ctx, name)
	} else if k, ok := strings.CutPrefix(key, "claim/"); ok {
		err = p.provision(ctx, k)
	}
	if err != nil {
		p.queue.AddRateLimited(key)
		return true
	}
	p.queue.Forget(key)
	return true
}

func (p *provisioner) provision(ctx context.Context, key string) error {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return nil
	}
	claim, err := p.claims.PersistentVolumeClaims(ns).Get(name)
	if err != nil || claim.Spec.VolumeName != "" || claim.Spec.StorageClassName == nil {
		return nil
	}
	class, err := p.classes.Get(*claim.Spec.StorageClassName)
	if err != nil || class.Provisioner != p.driver {
		return nil
	}
	pvName := "pvc-" + string(claim.UID)
	if _, err := p.pvs.Get(pvName); err == nil {
		return nil
	}
	p.recorder.Eventf(claim, corev1.EventTypeNormal, "Provisioning", "External provisioner is provisioning volume for claim %q", key)
	reclaim := corev1.PersistentVolumeReclaimDelete
	if class.ReclaimPolicy != nil {
		reclaim = *class.ReclaimPolicy
	}
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: pvName, Annotations: map[string]string{"pv.kubernetes.io/provisioned-by": p.driver}},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: claim.Spec.Resources.Requests[corev1.ResourceStorage]},
			AccessModes:                   claim.Spec.AccessModes,
			VolumeMode:                    claim.Spec.VolumeMode,
			StorageClassName:              class.Name,
			PersistentVolumeReclaimPolicy: reclaim,
			MountOptions:                  class.MountOptions,
			ClaimRef: &corev1.ObjectReference{
				Kind: "PersistentVolumeClaim", APIVersion: "v1",
				Namespace: claim.Namespace, Name: claim.Name, UID: claim.UID,
			},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: p.driver, VolumeHandle: pvName, FSType: "ext4",
			}},
		},
	}
	if _, err := p.client.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		p.recorder.Eventf(claim, corev1.EventTypeWarning, "ProvisioningFailed", "failed to create PV: %v", err)
		return err
	}
	p.recorder.Eventf(claim, corev1.EventTypeNormal, "ProvisioningSucceeded", "Successfully provisioned volume %s", pvName)
	return nil
}

func (p *provisioner) deletePV(ctx context.Context, name string) error {
	pv, err := p.pvs.Get(name)
	if err != nil || pv.Status.Phase != corev1.VolumeReleased || pv.Spec.PersistentVolumeReclaimPolicy != corev1.PersistentVolumeReclaimDelete ||
		pv.Annotations["pv.kubernetes.io/provisioned-by"] != p.driver {
		return nil
	}
	err = p.client.CoreV1().PersistentVolumes().Delete(ctx, name, metav1.DeleteOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}
