package k8sbridge

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
)

// TestUnusableCreateVolumeAnswers: a driver's CreateVolume answer is
// checked before use. The first answer for each claim is spoilt after the
// driver made the volume (the class's label parameter says how): one names
// no volume, one has a topology that is no valid label. Each is a ProvisioningFailed Event saying what is wrong;
// the one without an ID is asked again under the same name (the driver
// answers with the volume it made), the one with a bad topology has its
// volume deleted and made again. Both claims end Bound and the driver
// holds exactly their two volumes: nothing is lost and nothing leaks.
func TestUnusableCreateVolumeAnswers(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	c := env.Client()
	drv := kubetest.ClusterName(ns, "spoilt.csi.test")
	var mu sync.Mutex
	spoilt := map[string]bool{}
	spoil := grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		resp, err := h(ctx, req)
		cv, ok := resp.(*csi.CreateVolumeResponse)
		if !ok || err != nil {
			return resp, err
		}
		params := req.(*csi.CreateVolumeRequest).GetParameters()
		mu.Lock()
		defer mu.Unlock()
		if spoilt[params["label"]] {
			return resp, err
		}
		spoilt[params["label"]] = true
		switch params["label"] {
		case "id":
			return &csi.CreateVolumeResponse{Volume: &csi.Volume{CapacityBytes: cv.GetVolume().GetCapacityBytes()}}, nil
		case "topology":
			v := *cv.GetVolume()
			v.AccessibleTopology = []*csi.Topology{{Segments: map[string]string{"not a label key": "x"}}}
			return &csi.CreateVolumeResponse{Volume: &v}, nil
		}
		return resp, err
	})
	drivers := &testDrivers{}
	d := drivers.addDriver(t, sampledriver.Config{Name: drv, ServerOptions: []grpc.ServerOption{spoil}})
	startBridge(t, env, ns, drivers, bridgeOpts{})
	imm, del := storagev1.VolumeBindingImmediate, corev1.PersistentVolumeReclaimDelete
	for _, tc := range []struct{ claim, want string }{
		{"no-id", "holds no volume ID"},
		{"bad-topology", `"not a label key" is not a label key`},
	} {
		spoilWhat := map[string]string{"no-id": "id", "bad-topology": "topology"}[tc.claim]
		class := kubetest.MakeClass(t, c, kubetest.ClusterName(ns, tc.claim), drv, imm, del, map[string]string{"label": spoilWhat})
		kubetest.MakeClaim(t, c, ns, tc.claim, class.Name, "1Gi")
		ev := kubetest.WaitEvent(t, c, ns, tc.claim, "ProvisioningFailed", tc.want)
		if !strings.Contains(ev.Message, "CreateVolume") {
			t.Errorf("%s: event %q does not name CreateVolume", tc.claim, ev.Message)
		}
		kubetest.WaitBound(t, c, ns, tc.claim, 60*time.Second)
	}
	if n := len(d.Volumes()); n != 2 {
		t.Fatalf("the driver holds %d volumes, want the two claims' (none lost, none leaked)", n)
	}
}
