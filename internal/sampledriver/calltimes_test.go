package sampledriver

import (
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

// TestCallTimes: each call's arrival is recorded, faulted calls and calls
// under injected latency included, at its arrival (before the latency).
func TestCallTimes(t *testing.T) {
	const latency = 300 * time.Millisecond
	ep, d := StartTest(t, Config{Faults: faults(t, "CreateVolume=first:1,code:Unavailable", "DeleteVolume=latency:300ms")})
	c := dial(t, ep)
	ctx := ctxT(t)
	var before, after []time.Time
	call := func(f func()) {
		before = append(before, time.Now())
		f()
		after = append(after, time.Now())
	}
	call(func() {
		_, err := c.CreateVolume(ctx, createReq("v", 1<<20))
		wantCode(t, "first CreateVolume", err, codes.Unavailable)
	})
	var vol *csi.Volume
	call(func() { vol = mustCreate(t, c, "v", 1<<20) })
	got := d.CallTimes("CreateVolume")
	if len(got) != 2 || int64(len(got)) != d.CallCount("CreateVolume") {
		t.Fatalf("%d CreateVolume times for %d calls, want 2", len(got), d.CallCount("CreateVolume"))
	}
	for i, ts := range got {
		if ts.Before(before[i]) || ts.After(after[i]) {
			t.Errorf("CreateVolume call %d recorded at %v, not between its start %v and end %v", i+1, ts, before[i], after[i])
		}
	}

	start := time.Now()
	if _, err := c.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()}); err != nil {
		t.Fatal(err)
	}
	end := time.Now()
	del := d.CallTimes("DeleteVolume")
	if len(del) != 1 || del[0].Before(start) || !del[0].Before(end.Add(-latency)) {
		t.Fatalf("DeleteVolume times %v for a call from %v to %v: want its arrival, %v before it returned", del, start, end, latency)
	}
	if ts := d.CallTimes("Probe"); len(ts) != 0 {
		t.Errorf("Probe times %v, no call made", ts)
	}
}

// TestCallTimesBounded: the last maxCallTimes arrivals of a method are kept,
// oldest first.
func TestCallTimesBounded(t *testing.T) {
	var c callCounter
	const n = 5*maxCallTimes + 7
	var last time.Time
	for i := 0; i < n; i++ {
		if i == n-maxCallTimes {
			last = time.Now() // the oldest kept arrival comes after this
		}
		c.inc("M")
	}
	ts := c.arrivals("M")
	if len(ts) != maxCallTimes {
		t.Fatalf("%d times kept, want %d", len(ts), maxCallTimes)
	}
	if ts[0].Before(last) {
		t.Errorf("oldest kept time %v is not of the last %d calls (call %d came at %v)", ts[0], maxCallTimes, n-maxCallTimes+1, last)
	}
	for i := 1; i < len(ts); i++ {
		if ts[i].Before(ts[i-1]) {
			t.Fatalf("times out of order at %d: %v before %v", i, ts[i], ts[i-1])
		}
	}
	if got := c.get("M"); got != n {
		t.Errorf("count %d, want %d", got, n)
	}
}
