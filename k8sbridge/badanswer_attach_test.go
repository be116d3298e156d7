package k8sbridge

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/wrapperspb"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/csiparams"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
)

// spoilAnswers is a sample driver's server option that hands each answer
// of type T (after the driver made it) to spoil, which may replace it.
func spoilAnswers[T any](spoil func(req any, resp T) (T, bool)) grpc.ServerOption {
	return grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		resp, err := h(ctx, req)
		if r, ok := resp.(T); ok && err == nil {
			if bad, ok := spoil(req, r); ok {
				return bad, nil
			}
		}
		return resp, err
	})
}

// TestUnusablePublishAnswers: a driver's ControllerPublishVolume answer is
// checked before its publish context is written into the attachment. The
// first answer is spoilt (a publish context bigger than the API server
// takes as attachmentMetadata): it is an AttachFailed Event and an attach
// error on the attachment saying so, quoting none of it, and the
// attachment is never marked attached with it; the retry's good answer
// attaches it with the driver's real publish context.
func TestUnusablePublishAnswers(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	node := addAttachNode(t, env, ns)
	drv := kubetest.ClusterName(ns, "spoilt-publish.csi.test")
	var publishes atomic.Int32
	const marker = "spoilt-context-"
	spoil := spoilAnswers(func(_ any, r *csi.ControllerPublishVolumeResponse) (*csi.ControllerPublishVolumeResponse, bool) {
		if publishes.Add(1) > 1 {
			return nil, false
		}
		huge := map[string]string{}
		for i := range 300 {
			huge[fmt.Sprintf("%s%d", marker, i)] = strings.Repeat("x", 1024)
		}
		return &csi.ControllerPublishVolumeResponse{PublishContext: huge}, true
	})
	drivers := &testDrivers{}
	drivers.addDriver(t, sampledriver.Config{Name: drv, NodeID: node, ServerOptions: []grpc.ServerOption{spoil}})
	makeCSIDriver(t, c, drv, true)
	if err := env.AddCSINode(ctx, node, drv, node, nil); err != nil {
		t.Fatal(err)
	}
	imm, del := storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete
	class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, "class"), drv, imm, del, nil)
	startBridge(t, env, ns, drivers, bridgeOpts{})
	kubetest.MakeClaim(t, c, ns, "claim", class.Name, "1Gi")
	pv := kubetest.WaitBound(t, c, ns, "claim", 60*time.Second).Spec.VolumeName
	va := createVA(t, c, ns, drv, node, pv)

	ev := kubetest.WaitEvent(t, c, "default", va.Name, "AttachFailed", fmt.Sprintf("more than the %d", csiparams.MaxPublishContextBytes))
	if !strings.Contains(ev.Message, "ControllerPublishVolume") || strings.Contains(ev.Message, marker) {
		t.Errorf("event %q: want one naming ControllerPublishVolume and quoting no key", ev.Message)
	}
	got := vaFor(t, c, pv, func(va *storagev1.VolumeAttachment) bool { return va.Status.Attached }, "attached by the retry")
	md := got.Status.AttachmentMetadata
	if md[sampledriver.PublishContextDevicePath] == "" || len(md) > 4 {
		t.Fatalf("attachment metadata %v: want the driver's real publish context", md)
	}
	if n := publishes.Load(); n < 2 {
		t.Fatalf("%d publishes, want the spoilt one and its retry", n)
	}
}

// TestUnusableCapacityAnswers: a driver's GetCapacity answer is checked
// before it is written into a CSIStorageCapacity. While the driver
// answers each class with a spoilt answer (negative capacity, negative
// maximum volume size, a minimum above the maximum), each is a
// CapacityRefreshFailed Event on the class saying what is wrong, and no
// object is written for any of them; once the driver answers well again,
// every class gets its object with the driver's real numbers.
func TestUnusableCapacityAnswers(t *testing.T) {
	fastCapacityPolls(t)
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	ctx := context.Background()
	drv := kubetest.ClusterName(ns, "spoilt-capacity.csi.test")
	node := kubetest.ClusterName(ns, "node-z1")
	addNode(t, env, testenv.NodeSpec{Name: node, Zone: "z1"}, drv, []string{testenv.LabelZone})
	var spoiling atomic.Bool
	spoiling.Store(true)
	spoil := spoilAnswers(func(req any, r *csi.GetCapacityResponse) (*csi.GetCapacityResponse, bool) {
		if !spoiling.Load() {
			return nil, false
		}
		switch req.(*csi.GetCapacityRequest).GetParameters()["label"] {
		case "negative-capacity":
			return &csi.GetCapacityResponse{AvailableCapacity: -1}, true
		case "negative-max":
			return &csi.GetCapacityResponse{AvailableCapacity: r.GetAvailableCapacity(), MaximumVolumeSize: wrapperspb.Int64(-4096)}, true
		case "min-above-max":
			return &csi.GetCapacityResponse{AvailableCapacity: r.GetAvailableCapacity(), MaximumVolumeSize: wrapperspb.Int64(1 << 20), MinimumVolumeSize: wrapperspb.Int64(1 << 30)}, true
		}
		return nil, false
	})
	drivers := &testDrivers{}
	drivers.addDriver(t, sampledriver.Config{Name: drv, ControllerSegments: []map[string]string{{testenv.LabelZone: "z1"}},
		CapacityBytes: 10 * gib, ServerOptions: []grpc.ServerOption{spoil}})
	wffc, del := storagev1.VolumeBindingWaitForFirstConsumer, corev1.PersistentVolumeReclaimDelete
	cases := []struct{ label, want string }{
		{"negative-capacity", "negative available_capacity (-1 bytes)"},
		{"negative-max", "negative maximum_volume_size (-4096 bytes)"},
		{"min-above-max", "minimum_volume_size (1073741824 bytes) above its maximum_volume_size (1048576 bytes)"},
	}
	want := map[string]int64{}
	for _, tc := range cases {
		class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, tc.label), drv, wffc, del, map[string]string{"label": tc.label})
		want[segmentKey(class.Name, testenv.LabelZone, "z1")] = 10 * gib
	}
	startBridge(t, env, ns, drivers, bridgeOpts{})
	for _, tc := range cases {
		ev := kubetest.WaitEvent(t, c, "default", kubetest.ClusterName(ns, tc.label), "CapacityRefreshFailed", tc.want)
		if !strings.Contains(ev.Message, "GetCapacity") || ev.InvolvedObject.Kind != "StorageClass" {
			t.Errorf("%s: event on %s %q does not name GetCapacity", tc.label, ev.InvolvedObject.Kind, ev.Message)
		}
	}
	// Every class's answer was refused at least once by now, and its
	// object never written: none exists.
	objs, err := capacityObjects(ctx, c, ns, drv)
	if err != nil {
		t.Fatal(err)
	}
	if len(objs) != 0 {
		t.Fatalf("objects written from spoilt answers: %s", describeCapacities(objs))
	}
	spoiling.Store(false)
	waitCapacities(t, c, ns, drv, want)
}
