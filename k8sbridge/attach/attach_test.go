package attach

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"

	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
)

// TestAttachCapabilityFromAllAccessModes: ControllerPublishVolume's access
// mode comes from all of the volume's access modes, as external-attacher
// maps them (and as CreateVolume and expansion do here): RWX wins over RWO,
// RWO is SINGLE_NODE_MULTI_WRITER for a driver that has that capability,
// and a combination CSI cannot express is an error, not a guess.
func TestAttachCapabilityFromAllAccessModes(t *testing.T) {
	rwo, rox, rwx, rwop := corev1.ReadWriteOnce, corev1.ReadOnlyMany, corev1.ReadWriteMany, corev1.ReadWriteOncePod
	for _, tc := range []struct {
		modes []corev1.PersistentVolumeAccessMode
		snmw  bool
		want  csi.VolumeCapability_AccessMode_Mode
		bad   bool
	}{
		{nil, false, csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, false},
		{[]corev1.PersistentVolumeAccessMode{rwo}, false, csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, false},
		{[]corev1.PersistentVolumeAccessMode{rwo}, true, csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER, false},
		{[]corev1.PersistentVolumeAccessMode{rwo, rwx}, false, csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, false},
		{[]corev1.PersistentVolumeAccessMode{rox}, false, csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY, false},
		{[]corev1.PersistentVolumeAccessMode{rwop}, true, csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER, false},
		{[]corev1.PersistentVolumeAccessMode{rwop}, false, csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, false},
		{[]corev1.PersistentVolumeAccessMode{rox, rwo}, false, 0, true},
	} {
		c, err := capability(&attachSource{csi: &corev1.CSIPersistentVolumeSource{Driver: "d", VolumeHandle: "v"}, accessModes: tc.modes}, tc.snmw)
		switch {
		case tc.bad && err == nil:
			t.Errorf("%v (snmw %v): %v, want an error", tc.modes, tc.snmw, c.GetAccessMode().GetMode())
		case !tc.bad && (err != nil || c.GetAccessMode().GetMode() != tc.want):
			t.Errorf("%v (snmw %v): %v, %v; want %v", tc.modes, tc.snmw, c.GetAccessMode().GetMode(), err, tc.want)
		}
	}
}

// TestEarlierBrokerFinalizerStillDetaches: attachments made by earlier
// csibroker releases carry "external-attacher/<driver>" with only '/'
// replaced; detach still recognises and removes that name.
func TestEarlierBrokerFinalizerStillDetaches(t *testing.T) {
	const drv = "old.csi.example.com"
	legacy := "external-attacher/old.csi.example.com"
	fins := []string{"other", legacy}
	if !kube.HasAttacherFinalizer(fins, drv) {
		t.Fatalf("%v: the earlier release's finalizer is not recognised", fins)
	}
	if got := kube.WithoutAttacherFinalizers(append(fins, kube.AttacherFinalizer(drv)), drv); len(got) != 1 || got[0] != "other" {
		t.Fatalf("finalizers left after detach: %v, want [other]", got)
	}
}

// TestListPublishedStopsOnARepeatedToken: a driver whose ListVolumes paging
// never ends (the same token again) is an error after the repeat, not a
// loop of calls for the rest of the term.
func TestListPublishedStopsOnARepeatedToken(t *testing.T) {
	d := &loopingLister{}
	a := &Controller{b: &kube.Env{Cfg: kube.Config{Drivers: d, Timeout: time.Second}}}
	_, err := a.listPublished(context.Background(), "loop.csi.test", "")
	if err == nil || !strings.Contains(err.Error(), "twice") || d.calls != 2 {
		t.Fatalf("after %d ListVolumes calls: %v; want an error about the repeated token after 2", d.calls, err)
	}
}

// loopingLister answers every ListVolumes with the same next page token.
type loopingLister struct {
	drivers.Drivers // nil: only ControllerConn, NodeLocal and CallTimeout are used
	calls           int
}

func (d *loopingLister) ControllerConn(string) (grpc.ClientConnInterface, error) { return d, nil }
func (d *loopingLister) NodeLocal(string) bool                                   { return false }
func (d *loopingLister) CallTimeout(string, string) time.Duration                { return 0 }

func (d *loopingLister) Invoke(_ context.Context, method string, _, reply any, _ ...grpc.CallOption) error {
	d.calls++
	if d.calls > 100 {
		return errors.New("still paging after 100 pages")
	}
	reply.(*csi.ListVolumesResponse).NextToken = "again"
	return nil
}

func (d *loopingLister) NewStream(context.Context, *grpc.StreamDesc, string, ...grpc.CallOption) (grpc.ClientStream, error) {
	return nil, errors.New("no streams")
}
