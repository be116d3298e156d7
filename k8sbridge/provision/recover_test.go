package provision

import (
	"context"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/k8sbridge/intent"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
)

func TestRecoveryBackoff(t *testing.T) {
	const s = time.Second
	for _, tc := range []struct {
		name     string
		n        int
		interval time.Duration
		want     time.Duration
	}{
		{"first failure waits one interval", 1, 2 * s, 2 * s},
		{"second failure doubles", 2, 2 * s, 4 * s},
		{"sixth failure reaches 32 intervals", 6, 2 * s, 64 * s},
		{"stays at 32 intervals", 7, 2 * s, 64 * s},
		{"no overflow after many failures", 1000, 2 * s, 64 * s},
		{"default interval doubles up to the cap", 4, time.Minute, 8 * time.Minute},
		{"default interval capped at 10 minutes", 5, time.Minute, 10 * time.Minute},
		{"an interval above the cap is kept", 3, 20 * time.Minute, 20 * time.Minute},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := recoveryBackoff(tc.n, tc.interval); got != tc.want {
				t.Errorf("recoveryBackoff(%d, %v) = %v, want %v", tc.n, tc.interval, got, tc.want)
			}
		})
	}
}

// TestLearnVolumeIDFromAnEarlierRequest: recovery re-issues the entry's
// latest request to learn the volume's ID; a driver that made the volume
// for an earlier, different request answers AlreadyExists to it, and the
// earlier request, re-issued next, gets the ID.
func TestLearnVolumeIDFromAnEarlierRequest(t *testing.T) {
	drivers := &chainDrivers{}
	drv := "strict.csi.test"
	drivers.add(t, sampledriver.Config{Name: drv})
	made := createRequest("pvc-strict")
	madeID := createDriverVolume(t, drivers, drv, made)
	later := createRequest("pvc-strict")
	later.CapacityRange.RequiredBytes *= 2
	p := &Provisioner{b: &kube.Env{Cfg: kube.Config{Drivers: drivers, Timeout: 10 * time.Second}}}
	in := intent.Intent{VolumeName: "pvc-strict", Driver: drv, Request: marshalRequest(t, later)}
	if _, _, _, err := p.learnVolumeID(context.Background(), in); status.Code(err) != codes.AlreadyExists {
		t.Fatalf("the later request alone: %v, want AlreadyExists (the driver checks the request)", err)
	}
	in.EarlierRequests = [][]byte{marshalRequest(t, made)}
	id, _, _, err := p.learnVolumeID(context.Background(), in)
	if err != nil || id != madeID {
		t.Fatalf("with the earlier request: ID %q, %v; want %q", id, err, madeID)
	}
}

// TestLearnVolumeIDPastANoRoomAnswer: "no room" proves there is no volume
// only when every recorded request gets it. A driver that checks topology
// before the name (played here by the sample driver behind a hook that
// turns its answer for zone z9 into ResourceExhausted; the sample driver
// itself looks the name up first, as the spec asks) answers the latest
// request ResourceExhausted; the earlier one, which made the volume, still
// gets its ID. With no earlier request, or after an AlreadyExists, there
// is no proof of absence.
func TestLearnVolumeIDPastANoRoomAnswer(t *testing.T) {
	plain := &chainDrivers{}
	drv := "zoned.csi.test"
	plain.add(t, sampledriver.Config{Name: drv, ControllerSegments: []map[string]string{{"zone": "z1"}}, CapacityBytes: 4 << 30})
	drivers := plain.hooked(func(_ string, args, _ any, err error) error {
		if req, ok := args.(*csi.CreateVolumeRequest); ok {
			for _, t := range req.GetAccessibilityRequirements().GetRequisite() {
				if t.GetSegments()["zone"] == "z9" {
					return driverAnswer{status.New(codes.ResourceExhausted, "cannot provision in zone z9")}
				}
			}
		}
		return err
	})
	made := createRequest("pvc-zoned")
	made.AccessibilityRequirements = &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{"zone": "z1"}}}}
	madeID := createDriverVolume(t, plain, drv, made)
	elsewhere := createRequest("pvc-zoned")
	elsewhere.AccessibilityRequirements = &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{"zone": "z9"}}}}
	tooBig := createRequest("pvc-zoned")
	tooBig.CapacityRange.RequiredBytes = 8 << 30
	p := &Provisioner{b: &kube.Env{Cfg: kube.Config{Drivers: drivers, Timeout: 10 * time.Second}}}
	in := intent.Intent{VolumeName: "pvc-zoned", Driver: drv, Request: marshalRequest(t, elsewhere), EarlierRequests: [][]byte{marshalRequest(t, made)}}
	id, _, stage, err := p.learnVolumeID(context.Background(), in)
	if err != nil || id != madeID {
		t.Fatalf("no room for the latest request, the earlier made the volume: ID %q, stage %v, %v; want %q", id, stage, err, madeID)
	}
	in = intent.Intent{VolumeName: "pvc-zoned", Driver: drv, Request: marshalRequest(t, elsewhere)}
	if _, _, stage, err := p.learnVolumeID(context.Background(), in); stage != stageAbsent || status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("the no-room request alone: stage %v, %v; want absent", stage, err)
	}
	in = intent.Intent{VolumeName: "pvc-zoned", Driver: drv, Request: marshalRequest(t, tooBig), EarlierRequests: [][]byte{marshalRequest(t, elsewhere)}}
	if _, _, stage, err := p.learnVolumeID(context.Background(), in); stage == stageAbsent {
		t.Fatalf("after AlreadyExists (%v), a no-room answer was taken as absence", err)
	}
	// The broker's own ResourceExhausted (an answer over its message
	// limit), whatever its message says, proves nothing.
	if driversNoRoom(status.Error(codes.ResourceExhausted, "received message larger than max (4 bytes)")) {
		t.Error("the broker's own ResourceExhausted taken as the driver's")
	}
}
