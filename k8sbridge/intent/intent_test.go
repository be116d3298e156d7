package intent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/csibroker/csibroker/internal/testenv"
	"github.com/csibroker/csibroker/k8sbridge/internal/kubetest"
)

func TestIntentStoreBatchesWrites(t *testing.T) {
	env, ns, ctx, s := runIntentStore(t)

	const n = 100
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			errs <- s.Add(ctx, Intent{VolumeName: fmt.Sprintf("pvc-%03d", i), Driver: "d", ClaimNamespace: ns, ClaimName: fmt.Sprintf("c%d", i), Request: []byte{1, 2, 3}, Created: metav1.Now()})
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	adds := s.Writes()
	t.Logf("%d intents made durable in %d API writes", n, adds)
	if adds > n/4 {
		t.Fatalf("%d writes for %d intents: not batched", adds, n)
	}
	// Durable: a fresh store reads them all from the API server.
	got, err := NewStore(env.Client(), ns, "csibroker-intents", nil).List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != n || got[0].VolumeName != "pvc-000" || got[0].ClaimNamespace != ns || string(got[0].Request) != "\x01\x02\x03" {
		t.Fatalf("listed %d intents, first %+v", len(got), got[0])
	}

	for i := 0; i < n; i++ {
		s.Remove(fmt.Sprintf("pvc-%03d", i))
	}
	err = testenv.WaitFor(ctx, 20*time.Second, "intents removed", func(ctx context.Context) (bool, string, error) {
		got, err := NewStore(env.Client(), ns, "csibroker-intents", nil).List(ctx)
		return err == nil && len(got) == 0, fmt.Sprintf("%d left", len(got)), err
	})
	if err != nil {
		t.Fatal(err)
	}
	if rem := s.Writes() - adds; rem > 3 {
		t.Fatalf("%d writes to remove %d intents", rem, n)
	}
}

func TestIntentStoreFull(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := NewStore(env.Client(), ns, "intents", nil)
	s.maxEntries = 2
	go s.Run(ctx)
	for i := 0; i < 2; i++ {
		if err := s.Add(ctx, Intent{VolumeName: fmt.Sprint("v", i)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Add(ctx, Intent{VolumeName: "v3"}); err != ErrFull {
		t.Fatalf("err = %v", err)
	}
	// Re-adding an existing entry is not growth.
	if err := s.Add(ctx, Intent{VolumeName: "v1", Driver: "again"}); err != nil {
		t.Fatal(err)
	}
}

func TestIntentStoreByteBudget(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := NewStore(env.Client(), ns, "intents", nil)
	s.maxBytes = 4000
	go s.Run(ctx)
	big := make([]byte, 1500) // base64 in JSON: ~2 KB per entry
	if err := s.Add(ctx, Intent{VolumeName: "a", Request: big}); err != nil {
		t.Fatal(err)
	}
	if err := s.Add(ctx, Intent{VolumeName: "b", Request: big}); err != ErrFull {
		t.Fatalf("second big entry: %v, want ErrFull", err)
	}
	if err := s.Add(ctx, Intent{VolumeName: "c", Request: []byte{1}}); err != nil {
		t.Fatalf("a small entry that fits: %v", err)
	}
	// One that could never fit says so, and costs no API write.
	writes := s.Writes()
	if err := s.Add(ctx, Intent{VolumeName: "huge", Request: make([]byte, 4000)}); !errors.Is(err, ErrTooLarge) || !strings.Contains(err.Error(), "alone is") {
		t.Fatalf("an entry larger than the whole record: %v, want ErrTooLarge saying its size", err)
	}
	if w := s.Writes() - writes; w != 0 {
		t.Errorf("%d API writes for a batch whose only entry was refused, want 0", w)
	}
}

func TestBatchPolicyWriteDue(t *testing.T) {
	t0 := time.Unix(1000, 0)
	ms := func(n int) time.Time { return t0.Add(time.Duration(n) * time.Millisecond) }
	p := batchPolicy{linger: 5 * time.Millisecond, maxLinger: 200 * time.Millisecond, target: 20, gaps: 4}
	for _, tc := range []struct {
		name           string
		pending        int
		oldest, newest time.Time
		rate           float64
		want           time.Time
	}{
		{"lone claim at rest: linger only", 1, t0, t0, 1, ms(5)},
		{"a few claims a second: still linger only", 1, t0, t0, 4.9, ms(5)},
		{"five a second: wait for company, at most maxLinger", 1, t0, t0, 5, ms(200)},
		{"steady 100/s: until 4 gaps after the newest", 3, t0, ms(20), 100, ms(60)},
		{"steady 100/s, newest recent: capped at maxLinger", 15, t0, ms(180), 100, ms(200)},
		{"target reached: linger only", 20, t0, ms(1), 90, ms(5)},
		{"target reached long ago: now", 40, t0, ms(300), 90, ms(5)},
		{"burst: quiet point before linger ends is not earlier than linger", 5, t0, t0, 10000, ms(5)},
		{"previous policy (maxLinger = linger)", 3, t0, ms(3), 90, ms(5)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pp := p
			if strings.HasPrefix(tc.name, "previous") {
				pp = batchPolicy{linger: 5 * time.Millisecond, maxLinger: 5 * time.Millisecond, target: 1, gaps: 4}
			}
			if got := pp.writeDue(tc.pending, tc.oldest, tc.newest, tc.rate); !got.Equal(tc.want) {
				t.Fatalf("writeDue = +%v, want +%v", got.Sub(t0), tc.want.Sub(t0))
			}
		})
	}
}

// TestBatchDueForTheQuietestDriver: a write is due at the earliest of the
// rule over every Add and the rule over each driver's. Driver A's claims
// arrive ten a second and wait for company (maxLinger); driver B's lone
// claim is written after linger, with A's queued Adds along, and the next
// batch of A starts its count anew; target Adds of several drivers are
// written at once.
func TestBatchDueForTheQuietestDriver(t *testing.T) {
	s := NewStore(nil, "ns", "intents", nil)
	t0 := time.Now()
	ms := func(n int) time.Time { return t0.Add(time.Duration(n) * time.Millisecond) }
	add := func(driver, volume string, at time.Time) {
		s.adds[volume] = &pendingAdd[Intent]{intent: Intent{VolumeName: volume, Driver: driver}, done: make(chan error, 1)}
		s.all.arrive(at, s.batch.maxLinger)
		s.arrivalsOf(driver).arrive(at, s.batch.maxLinger)
	}
	due := func() time.Time {
		d, ok := s.nextWriteLocked()
		if !ok {
			t.Fatal("no write due with Adds queued")
		}
		return d
	}
	for i := 0; i <= 10; i++ {
		add("a", fmt.Sprintf("a-%d", i), ms(10*i))
	}
	if got := due(); !got.Equal(ms(200)) {
		t.Fatalf("driver A alone, ten a second: write due at +%v, want +200ms (maxLinger after its oldest)", got.Sub(t0))
	}
	add("b", "b-0", ms(100))
	if got := due(); !got.Equal(ms(105)) {
		t.Fatalf("with driver B's lone Add at +100ms: write due at +%v, want +105ms (B's linger, not A's batch)", got.Sub(t0))
	}
	s.dropAddLocked("b-0")
	if got := due(); !got.Equal(ms(200)) {
		t.Fatalf("B's Add removed: write due at +%v, want +200ms again", got.Sub(t0))
	}
	if _, ok := s.cutBatch(context.Background()); !ok {
		t.Fatal("cutBatch failed")
	}
	if _, ok := s.nextWriteLocked(); ok {
		t.Fatal("a write due right after the batch was cut")
	}
	if a := s.arrivals["a"]; a == nil || a.pending != 0 || a.rate() < 5 {
		t.Fatalf("driver A after the cut: %+v, want no Adds pending and its arrival rate kept", a)
	}
	// Five busy drivers, none with target Adds of its own, twenty-five in
	// all: written after linger, as one driver's twenty-five would be.
	s.arrivals = map[string]*arrivals{}
	t1 := ms(1000)
	for i := range 25 {
		add(fmt.Sprint("d", i%5), fmt.Sprint("v-", i), t1.Add(time.Duration(i)*time.Millisecond))
	}
	if got := due(); !got.Equal(t1.Add(5 * time.Millisecond)) {
		t.Fatalf("25 Adds of five drivers: write due at +%v after the oldest, want +5ms (target reached in all)", got.Sub(t1))
	}
}

// faultyWrites wraps a client's transport: PUTs of the intent record fail or
// block while told to; every other request goes to the real API server.
type faultyWrites struct {
	mu      sync.Mutex
	mode    string // "", "fail" or "block"
	blocked chan struct{}
	puts    int
}

func (f *faultyWrites) set(mode string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.mode = mode
}

func (f *faultyWrites) wrap(rt http.RoundTripper) http.RoundTripper {
	return roundTripFunc(func(req *http.Request) (*http.Response, error) {
		if req.Method == http.MethodPut && strings.HasSuffix(req.URL.Path, "/configmaps/csibroker-intents") {
			f.mu.Lock()
			mode := f.mode
			f.puts++
			f.mu.Unlock()
			switch mode {
			case "fail":
				return nil, errors.New("injected: connection reset by peer")
			case "block":
				select {
				case f.blocked <- struct{}{}:
				default:
				}
				<-req.Context().Done()
				return nil, req.Context().Err()
			}
		}
		return rt.RoundTrip(req)
	})
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// TestIntentAddNeedsASuccessfulWrite: when the record's update fails or
// hangs, Add fails or blocks; it never reports an intent durable that the
// API server does not hold.
func TestIntentAddNeedsASuccessfulWrite(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	faults := &faultyWrites{blocked: make(chan struct{}, 1)}
	cfg := env.RESTConfig()
	cfg.WrapTransport = faults.wrap
	s := NewStore(kubernetes.NewForConfigOrDie(cfg), ns, "csibroker-intents", nil)
	inRecord := func(name string) bool {
		t.Helper()
		cm, err := env.Client().CoreV1().ConfigMaps(ns).Get(ctx, "csibroker-intents", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		_, ok := cm.Data[name]
		return ok
	}
	runCtx, stopRun := context.WithCancel(ctx)
	go s.Run(runCtx)
	if _, err := s.List(ctx); err != nil { // creates the record
		t.Fatal(err)
	}

	// The write fails: every Add of the batch fails.
	faults.set("fail")
	var wg sync.WaitGroup
	errs := make([]error, 10)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = s.Add(ctx, Intent{VolumeName: fmt.Sprint("fail-", i), Request: []byte{1}})
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err == nil || !strings.Contains(err.Error(), "injected") {
			t.Fatalf("Add %d while the write fails: %v, want the write's error", i, err)
		}
		if inRecord(fmt.Sprint("fail-", i)) {
			t.Fatalf("fail-%d is in the record", i)
		}
	}

	// The write hangs: Add waits until its caller gives up, then fails.
	faults.set("block")
	addCtx, addCancel := context.WithTimeout(ctx, 2*time.Second)
	err := s.Add(addCtx, Intent{VolumeName: "hang", Request: []byte{1}})
	addCancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Add while the write hangs: %v, want the caller's deadline", err)
	}
	select {
	case <-faults.blocked:
	default:
		t.Fatal("the write never started")
	}
	// Another Add queued behind the hanging write does not return either.
	done := make(chan error, 1)
	go func() { done <- s.Add(ctx, Intent{VolumeName: "behind", Request: []byte{1}}) }()
	for !s.Has("behind") { // queued
		select {
		case err := <-done:
			t.Fatalf("Add behind a hanging write returned %v", err)
		case <-time.After(5 * time.Millisecond):
		}
	}
	// The store stops (leadership lost): the queued Add fails with the
	// store's end, which only the stop gives it (its own context lives on).
	stopRun()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Add behind a hanging write, after the store stopped: %v, want the store's end (context canceled)", err)
	}
	if inRecord("hang") || inRecord("behind") {
		t.Fatal("an entry whose write never completed is in the record")
	}

	// Writes work again: Add succeeds, and only then is the entry readable.
	faults.set("")
	runCtx, stopRun = context.WithCancel(ctx)
	defer stopRun()
	s.StartTerm() // as the bridge does before the term's workers start
	go s.Run(runCtx)
	if err := s.Add(ctx, Intent{VolumeName: "ok", Request: []byte{1}}); err != nil {
		t.Fatal(err)
	}
	if !inRecord("ok") {
		t.Fatal("Add returned nil but the record does not hold the entry")
	}
}

// TestIntentRemovesRideAlong: Removes cost no write of their own while Adds
// flow, and the store's readers never see an entry it was asked to remove.
func TestIntentRemovesRideAlong(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := NewStore(env.Client(), ns, "csibroker-intents", nil)
	s.removeDelay = 1500 * time.Millisecond
	go s.Run(ctx)
	names := func(ins []Intent) []string {
		var out []string
		for _, in := range ins {
			out = append(out, in.VolumeName)
		}
		return out
	}
	fresh := func() []string {
		t.Helper()
		ins, err := NewStore(env.Client(), ns, "csibroker-intents", nil).List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return names(ins)
	}
	for _, v := range []string{"a", "b"} {
		if err := s.Add(ctx, Intent{VolumeName: v, ClaimNamespace: ns, ClaimName: v}); err != nil {
			t.Fatal(err)
		}
	}
	w0 := s.Writes()
	s.Remove("a")
	// Not written yet, but this store's readers no longer see it.
	if s.Has("a") || !s.Has("b") {
		t.Fatalf("Has(a) = %v, Has(b) = %v after Remove(a)", s.Has("a"), s.Has("b"))
	}
	mine, err := s.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(names(mine)); got != "[b]" {
		t.Fatalf("List after Remove(a) = %s, want [b]", got)
	}
	if got := fmt.Sprint(fresh()); got != "[a b]" {
		t.Fatalf("record right after Remove(a) = %s, want [a b] (Removes wait)", got)
	}
	// The next Add carries the Remove: one write for both.
	if err := s.Add(ctx, Intent{VolumeName: "c", ClaimNamespace: ns, ClaimName: "c"}); err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(fresh()); got != "[b c]" || s.Writes() != w0+1 {
		t.Fatalf("record = %s after %d writes, want [b c] after 1", got, s.Writes()-w0)
	}
	// Removes alone: written once Adds have stopped for removeDelay, in one write.
	s.Remove("b")
	s.Remove("c")
	if got := fmt.Sprint(fresh()); got != "[b c]" {
		t.Fatalf("record right after removing b and c = %s", got)
	}
	err = testenv.WaitFor(ctx, 10*time.Second, "removes written", func(ctx context.Context) (bool, string, error) {
		// The store counts its write once the response is in: after
		// another reader may already see the result.
		got := fresh()
		return len(got) == 0 && s.Writes() >= w0+2, fmt.Sprint(got), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if w := s.Writes() - w0; w != 2 {
		t.Fatalf("%d writes, want 2", w)
	}
}

// provisioningLoad is one simulated provisioning run against the intent store.
type provisioningLoad struct {
	name          string
	batch         batchPolicy
	removeDelay   time.Duration
	claims        int
	workers       int
	createVolume  time.Duration // per call, one at a time, like the sample driver
	writes        int           // successful PUTs of the record seen on the wire
	attempts      int64         // the store's own count
	elapsed       time.Duration // first Add to last Remove
	addP50, addMx time.Duration
	lone          time.Duration // a lone Add once the load has stopped
}

// runProvisioningLoad simulates claims arriving from workers: Add → a
// CreateVolume that holds one driver-wide lock (as the sample driver's does)
// → a real object write standing in for the PV → Remove, on one client with
// the benchmark's QPS 200 / burst 400. It checks, for every tenth claim, that
// the entry is on the API server when Add returns.
func runProvisioningLoad(t *testing.T, env *testenv.Env, l *provisioningLoad) {
	t.Helper()
	ns := env.NewNamespace(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var mu sync.Mutex
	cfg := env.RESTConfig()
	cfg.QPS, cfg.Burst = 200, 400
	cfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		return roundTripFunc(func(req *http.Request) (*http.Response, error) {
			resp, err := rt.RoundTrip(req)
			if err == nil && req.Method == http.MethodPut && strings.HasSuffix(req.URL.Path, "/configmaps/csibroker-intents") && resp.StatusCode < 300 {
				mu.Lock()
				l.writes++
				mu.Unlock()
			}
			return resp, err
		})
	}
	client := kubernetes.NewForConfigOrDie(cfg)
	s := NewStore(client, ns, "csibroker-intents", nil)
	s.batch, s.removeDelay = l.batch, l.removeDelay
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	go s.Run(runCtx)
	if _, err := s.List(ctx); err != nil { // as recovery does when leading starts
		t.Fatal(err)
	}

	var driver sync.Mutex
	claims := make(chan int)
	waits := make([]time.Duration, l.claims)
	errs := make(chan error, l.workers)
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < l.workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range claims {
				name := fmt.Sprintf("pvc-%08d-0000-4000-8000-%012d", i, i)
				req, _ := proto.Marshal(&csi.CreateVolumeRequest{
					Name:               name,
					CapacityRange:      &csi.CapacityRange{RequiredBytes: 1 << 30},
					VolumeCapabilities: []*csi.VolumeCapability{{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}}, AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}},
					Parameters:         map[string]string{"type": "fast"},
					AccessibilityRequirements: &csi.TopologyRequirement{
						Requisite: []*csi.Topology{{Segments: map[string]string{"topology.sample.csi/zone": "zone-a"}}},
						Preferred: []*csi.Topology{{Segments: map[string]string{"topology.sample.csi/zone": "zone-a"}}},
					},
				})
				t0 := time.Now()
				err := s.Add(ctx, Intent{VolumeName: name, Driver: "sample.csi.test", ClaimNamespace: ns, ClaimName: fmt.Sprint("claim-", i),
					ClaimUID: name[4:], StorageClass: "fast", Request: req, NamespaceLabels: map[string]string{"kubernetes.io/metadata.name": ns}, Created: metav1.Now()})
				waits[i] = time.Since(t0)
				if err != nil {
					errs <- fmt.Errorf("claim %d: Add: %w", i, err)
					return
				}
				if i%10 == 0 {
					// A quorum read: the entry must already be there.
					cm, err := env.Client().CoreV1().ConfigMaps(ns).Get(ctx, "csibroker-intents", metav1.GetOptions{})
					if err != nil {
						errs <- err
						return
					}
					if _, ok := cm.Data[name]; !ok {
						errs <- fmt.Errorf("claim %d: Add returned but the record does not hold %s", i, name)
						return
					}
				}
				driver.Lock()
				time.Sleep(l.createVolume)
				driver.Unlock()
				if _, err := client.CoreV1().ConfigMaps(ns).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprint("pv-", i)}}, metav1.CreateOptions{}); err != nil {
					errs <- fmt.Errorf("claim %d: create the stand-in PV: %w", i, err)
					return
				}
				s.Remove(name)
			}
		}()
	}
	go func() {
		defer close(claims)
		for i := 0; i < l.claims; i++ {
			select {
			case claims <- i:
			case <-ctx.Done():
				return
			}
		}
	}()
	wg.Wait()
	l.elapsed = time.Since(start)
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	// Every entry is removed in the end (the last Removes alone, once idle).
	err := testenv.WaitFor(ctx, 30*time.Second, "empty intent record", func(ctx context.Context) (bool, string, error) {
		ins, err := NewStore(env.Client(), ns, "csibroker-intents", nil).List(ctx)
		return err == nil && len(ins) == 0, fmt.Sprintf("%d entries", len(ins)), err
	})
	if err != nil {
		t.Fatal(err)
	}
	// A lone claim once the load has stopped: only the short linger.
	time.Sleep(2 * rateWindow)
	t0 := time.Now()
	if err := s.Add(ctx, Intent{VolumeName: "lone", Request: []byte{1}}); err != nil {
		t.Fatal(err)
	}
	l.lone = time.Since(t0)
	mu.Lock()
	l.writes-- // the lone claim's write
	mu.Unlock()
	l.attempts = s.Writes() - 1
	sort.Slice(waits, func(i, j int) bool { return waits[i] < waits[j] })
	l.addP50, l.addMx = waits[len(waits)/2], waits[len(waits)-1]
}

// TestIntentWritesPerClaim: 1,000 claims from 100 workers, the batching of
// before (a fixed 5 ms linger) and now side by side. The bound: fewer than
// 0.1 record writes per claim, with every Add durable before it returns.
func TestIntentWritesPerClaim(t *testing.T) {
	if testing.Short() {
		t.Skip("a 1,000-claim load (~15 s)")
	}
	env := kubetest.ControlPlane(t)
	loads := []*provisioningLoad{
		{name: "before: fixed 5 ms linger", batch: batchPolicy{linger: 5 * time.Millisecond, maxLinger: 5 * time.Millisecond, target: 1, gaps: 4}, removeDelay: time.Second},
		{name: "now: adaptive (default)", batch: defaultBatch, removeDelay: 2 * time.Second},
	}
	for _, l := range loads {
		l.claims, l.workers, l.createVolume = 1000, 100, 5*time.Millisecond
		runProvisioningLoad(t, env, l)
		t.Logf("%-28s %4d claims, %3d workers, CreateVolume %v one at a time: %4d record writes = %.3f per claim (store attempts %d); %.0f claims/s; Add wait p50 %v, max %v; a lone Add after the load %v",
			l.name, l.claims, l.workers, l.createVolume, l.writes, float64(l.writes)/float64(l.claims), l.attempts,
			float64(l.claims)/l.elapsed.Seconds(), l.addP50.Round(time.Millisecond), l.addMx.Round(time.Millisecond), l.lone.Round(time.Millisecond))
	}
	if now := loads[len(loads)-1]; float64(now.writes)/float64(now.claims) >= 0.1 {
		t.Fatalf("%d record writes for %d claims: want fewer than 0.1 per claim", now.writes, now.claims)
	}
}

// TestIntentBatchCutWhenTokenGranted: with the objects' budget exhausted (no
// token for now), a write waits for its token before it decides what it
// holds, so the claims that arrive while it waits go in that one write; and
// every request of the record takes a token.
func TestIntentBatchCutWhenTokenGranted(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tokens := make(chan struct{}, 10)
	waits := make(chan struct{}, 100) // one per request that asked for a token
	s := NewStore(env.Client(), ns, "csibroker-intents", nil)
	s.UseBudget(env.Client(), func(ctx context.Context) error {
		waits <- struct{}{}
		select {
		case <-tokens:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	go s.Run(runCtx)

	add := func(name string, errs chan<- error) {
		errs <- s.Add(ctx, Intent{VolumeName: name, Driver: "d", ClaimNamespace: ns, ClaimName: name, Request: []byte{1}, Created: metav1.Now()})
	}
	errs := make(chan error, 4)
	go add("pvc-first", errs)
	<-waits // the first write waits for its token
	for _, n := range []string{"pvc-b", "pvc-c", "pvc-d"} {
		go add(n, errs)
	}
	// The three are queued (Has sees queued Adds) before tokens come.
	deadline := time.Now().Add(10 * time.Second)
	for !(s.Has("pvc-b") && s.Has("pvc-c") && s.Has("pvc-d")) {
		if time.Now().After(deadline) {
			t.Fatal("the Adds never queued")
		}
		time.Sleep(5 * time.Millisecond)
	}
	// The record does not exist yet: GET (404), create, update take three;
	// spares, so a store that writes twice ends too (and fails below).
	for i := 0; i < 6; i++ {
		tokens <- struct{}{}
	}
	for i := 0; i < 4; i++ {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if w := s.Writes(); w != 1 {
		t.Fatalf("%d writes for four claims that arrived while the first write waited for its token, want 1", w)
	}
	if n := 1 + len(waits); n != 3 {
		t.Fatalf("%d requests asked for a token, want 3 (GET, create, update)", n)
	}
	got, err := NewStore(env.Client(), ns, "csibroker-intents", nil).List(ctx)
	if err != nil || len(got) != 4 {
		t.Fatalf("record holds %d intents (%v), want 4", len(got), err)
	}

	// With a reader, the recovery loop's reads take no token of the
	// objects' budget; without one they do.
	s.UseReader(env.Client())
	if got, err := s.List(ctx); err != nil || len(got) != 4 {
		t.Fatalf("List through the reader: %d intents (%v), want 4", len(got), err)
	}
	if n := len(waits); n != 2 {
		t.Fatalf("List through the reader asked for %d tokens, want none", n-2)
	}
	s.UseReader(nil)
	tokens <- struct{}{}
	if got, err := s.List(ctx); err != nil || len(got) != 4 {
		t.Fatalf("List without a reader: %d intents (%v), want 4", len(got), err)
	}
	if n := len(waits); n != 3 {
		t.Fatalf("List without a reader asked for %d tokens, want 1", n-2)
	}
}

// TestIntentReaderCreatesMissingRecordOnBudget: a List through the reader
// that finds no record creates it as a write does, on the objects' budget.
func TestIntentReaderCreatesMissingRecordOnBudget(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var tokens int
	s := NewStore(env.Client(), ns, "csibroker-intents", nil)
	s.UseBudget(env.Client(), func(context.Context) error { tokens++; return nil })
	s.UseReader(env.Client())
	got, err := s.List(ctx)
	if err != nil || len(got) != 0 {
		t.Fatalf("List of a missing record: %d intents (%v), want 0 and no error", len(got), err)
	}
	if _, err := env.Client().CoreV1().ConfigMaps(ns).Get(ctx, "csibroker-intents", metav1.GetOptions{}); err != nil {
		t.Fatalf("the record was not created: %v", err)
	}
	if tokens != 2 {
		t.Fatalf("%d tokens taken, want 2 (the budgeted GET that found no record, and the create)", tokens)
	}
}

// TestIntentTermEndForgetsItsRemoves: a Remove queued when a leadership
// term ends, or asked by a worker still finishing after its end, is not
// carried into this replica's next term: meanwhile another leader may have
// added the entry again (a create in flight), and the next term must see
// it and keep it. An Add after the end is refused.
func TestIntentTermEndForgetsItsRemoves(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := NewStore(env.Client(), ns, "csibroker-intents", nil)
	s.removeDelay = time.Hour // queued Removes wait for an Add
	term1, end1 := context.WithCancel(ctx)
	done1 := make(chan struct{})
	go func() { s.Run(term1); close(done1) }()
	if err := s.Add(ctx, Intent{VolumeName: "v", ClaimNamespace: ns, ClaimName: "v"}); err != nil {
		t.Fatal(err)
	}
	s.Remove("v") // queued, never written: the term ends
	end1()
	<-done1
	// A worker of the ended term finishes after the store's Run stopped.
	s.Remove("v")
	if err := s.Add(ctx, Intent{VolumeName: "late", ClaimNamespace: ns, ClaimName: "late"}); !errors.Is(err, errTermEnded) {
		t.Fatalf("Add after the term's end: %v, want errTermEnded", err)
	}

	// Another leader, meanwhile, records "v" again.
	other := NewStore(env.Client(), ns, "csibroker-intents", nil)
	term, endOther := context.WithCancel(ctx)
	go other.Run(term)
	if err := other.Add(ctx, Intent{VolumeName: "v", ClaimNamespace: ns, ClaimName: "v", Node: "other-leaders"}); err != nil {
		t.Fatal(err)
	}
	endOther()

	// This replica leads again.
	s.StartTerm()
	go s.Run(ctx)
	ins, err := s.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(ins) != 1 || ins[0].VolumeName != "v" {
		t.Fatalf("next term lists %+v, want the entry the other leader wrote", ins)
	}
	if in, ok := s.Get("v"); !ok || in.Node != "other-leaders" {
		t.Fatalf("next term's Get(v) = %+v, %v; want the other leader's entry", in, ok)
	}
	if err := s.Add(ctx, Intent{VolumeName: "w", ClaimNamespace: ns, ClaimName: "w"}); err != nil {
		t.Fatal(err)
	}
	ins, err = NewStore(env.Client(), ns, "csibroker-intents", nil).List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(ins) != 2 {
		t.Fatalf("record after the next term's first write: %+v, want v kept and w added", ins)
	}
}

// TestIntentLookupReadsEachTermOnce: the first lookups of a term read the
// record from the API server once however many ask at once, and a new term
// reads it again: an entry another leader wrote in between is seen.
func TestIntentLookupReadsEachTermOnce(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var mu sync.Mutex
	gets := 0
	cfg := env.RESTConfig()
	cfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		return roundTripFunc(func(req *http.Request) (*http.Response, error) {
			if req.Method == http.MethodGet && strings.HasSuffix(req.URL.Path, "/configmaps/csibroker-intents") {
				mu.Lock()
				gets++
				mu.Unlock()
			}
			return rt.RoundTrip(req)
		})
	}
	s := NewStore(kubernetes.NewForConfigOrDie(cfg), ns, "csibroker-intents", nil)
	readsOf := func() int {
		mu.Lock()
		defer mu.Unlock()
		return gets
	}
	other := NewStore(env.Client(), ns, "csibroker-intents", nil) // another leader
	otherCtx, otherStop := context.WithCancel(ctx)
	go other.Run(otherCtx)
	if err := other.Add(ctx, Intent{VolumeName: "pvc-first", Driver: "d", Node: "n1", Created: metav1.Now()}); err != nil {
		t.Fatal(err)
	}

	term1, end1 := context.WithCancel(ctx)
	go s.Run(term1)
	var wg sync.WaitGroup
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if in, ok, err := s.Lookup(ctx, "pvc-first"); err != nil || !ok || in.Node != "n1" {
				t.Errorf("lookup in term 1: %+v %v %v", in, ok, err)
			}
		}()
	}
	wg.Wait()
	if n := readsOf(); n != 1 {
		t.Errorf("20 first lookups of a term read the record %d times, want 1", n)
	}
	end1()

	if err := other.Add(ctx, Intent{VolumeName: "pvc-second", Driver: "d", Node: "n2", Created: metav1.Now()}); err != nil {
		t.Fatal(err)
	}
	otherStop()
	term2, end2 := context.WithCancel(ctx)
	defer end2()
	go s.Run(term2)
	err := testenv.WaitFor(ctx, 10*time.Second, "the second term's lookup to see the other leader's entry", func(ctx context.Context) (bool, string, error) {
		in, ok, err := s.Lookup(ctx, "pvc-second")
		return ok && in.Node == "n2", fmt.Sprintf("%+v %v", in, ok), err
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestIntentRecordDeletedKeepsItsEntries: an administrator deletes the
// intent record while entries stand (a volume being made, say); the next
// write finds it gone, makes it again, and writes back the entries this
// store had acknowledged with its own: none is lost, or its volume could
// leak.
func TestIntentRecordDeletedKeepsItsEntries(t *testing.T) {
	env, ns, ctx, s := runIntentStore(t)
	add := func(name string) {
		t.Helper()
		if err := s.Add(ctx, Intent{VolumeName: name, Driver: "d", ClaimNamespace: ns, ClaimName: name, Request: []byte{1}, Created: metav1.Now()}); err != nil {
			t.Fatal(err)
		}
	}
	add("pvc-first")
	if err := env.Client().CoreV1().ConfigMaps(ns).Delete(ctx, "csibroker-intents", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	add("pvc-second")
	names := recordedVolumes(ctx, t, env, ns)
	if !slices.Equal(names, []string{"pvc-first", "pvc-second"}) {
		t.Fatalf("after the record was deleted and a new entry added, it holds %v, want [pvc-first pvc-second]", names)
	}
}

// runIntentStore runs an intent store on a fresh namespace's
// csibroker-intents for the test's length (a minute at most).
func runIntentStore(t *testing.T) (*testenv.Env, string, context.Context, *Store) {
	t.Helper()
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	s := NewStore(env.Client(), ns, "csibroker-intents", nil)
	runCtx, stop := context.WithCancel(ctx)
	t.Cleanup(stop)
	go s.Run(runCtx)
	return env, ns, ctx, s
}

// TestIntentRecordDeletedKeepsItsEntriesAcrossAFailedWrite: the write
// that finds the record deleted fails to make it again (the API server
// refuses the create once); the next write still carries the entries the
// deleted record held.
func TestIntentRecordDeletedKeepsItsEntriesAcrossAFailedWrite(t *testing.T) {
	env, ns, ctx, add, refuseCreate := intentStoreRefusingOnce(t, func(req *http.Request) bool {
		return req.Method == http.MethodPost && strings.HasSuffix(req.URL.Path, "/configmaps")
	})
	if err := add("pvc-first"); err != nil {
		t.Fatal(err)
	}
	if err := env.Client().CoreV1().ConfigMaps(ns).Delete(ctx, "csibroker-intents", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	refuseCreate.Store(true)
	if err := add("pvc-second"); err == nil {
		t.Fatal("an Add whose write could not make the record again succeeded")
	}
	if err := add("pvc-third"); err != nil {
		t.Fatal(err)
	}
	names := recordedVolumes(ctx, t, env, ns)
	if !slices.Equal(names, []string{"pvc-first", "pvc-third"}) {
		t.Fatalf("the record holds %v, want [pvc-first pvc-third]", names)
	}
}

// recordedVolumes lists the volume names of ns's intent record, as a fresh
// store reads it from the API server.
func recordedVolumes(ctx context.Context, t *testing.T, env *testenv.Env, ns string) []string {
	t.Helper()
	got, err := NewStore(env.Client(), ns, "csibroker-intents", nil).List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, in := range got {
		names = append(names, in.VolumeName)
	}
	return names
}

// TestIntentRecordDeletedAfterAnyFailedWrite: a write fails for a reason
// other than a conflict (the API server errs once), then the record is
// deleted; the next write, which finds another object, still writes back
// the entries the store had acknowledged before the failure.
func TestIntentRecordDeletedAfterAnyFailedWrite(t *testing.T) {
	env, ns, ctx, add, refusePut := intentStoreRefusingOnce(t, func(req *http.Request) bool {
		return req.Method == http.MethodPut && strings.Contains(req.URL.Path, "/configmaps/")
	})
	if err := add("pvc-first"); err != nil {
		t.Fatal(err)
	}
	refusePut.Store(true)
	if err := add("pvc-second"); err == nil {
		t.Fatal("an Add whose write was refused succeeded")
	}
	if err := env.Client().CoreV1().ConfigMaps(ns).Delete(ctx, "csibroker-intents", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := add("pvc-third"); err != nil {
		t.Fatal(err)
	}
	if names := recordedVolumes(ctx, t, env, ns); !slices.Equal(names, []string{"pvc-first", "pvc-third"}) {
		t.Fatalf("the record holds %v, want [pvc-first pvc-third]", names)
	}
}

// TestIntentRecordDeletedFoundByARead: the record is deleted while no
// write is due; recovery's List, which finds another object, still
// reports the entries the store knew, Lookup finds them (a retried
// CreateVolume must know of its earlier attempt), and they are written
// back without waiting for another Add.
func TestIntentRecordDeletedFoundByARead(t *testing.T) {
	env, ns, ctx, s := runIntentStore(t)
	if err := s.Add(ctx, Intent{VolumeName: "pvc-first", Driver: "d", ClaimNamespace: ns, ClaimName: "first", Request: []byte{1}, Created: metav1.Now()}); err != nil {
		t.Fatal(err)
	}
	if err := env.Client().CoreV1().ConfigMaps(ns).Delete(ctx, "csibroker-intents", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	got, err := s.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].VolumeName != "pvc-first" {
		t.Fatalf("List after the record was deleted: %+v, want pvc-first's entry", got)
	}
	if in, ok, err := s.Lookup(ctx, "pvc-first"); err != nil || !ok || in.ClaimName != "first" {
		t.Fatalf("Lookup after the record was deleted: %+v, %v, %v", in, ok, err)
	}
	err = testenv.WaitFor(ctx, 20*time.Second, "the entry written back", func(ctx context.Context) (bool, string, error) {
		names := recordedVolumes(ctx, t, env, ns)
		return slices.Equal(names, []string{"pvc-first"}), fmt.Sprintf("the record holds %v", names), nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// intentStoreRefusingOnce runs an intent store on a fresh namespace's
// csibroker-intents whose client fails the next request that matches, once
// the returned flag is set; add adds the intent of a volume of that name.
func intentStoreRefusingOnce(t *testing.T, matches func(*http.Request) bool) (env *testenv.Env, ns string, ctx context.Context, add func(string) error, refuse *atomic.Bool) {
	t.Helper()
	env = kubetest.ControlPlane(t)
	ns = env.NewNamespace(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	refuse = new(atomic.Bool)
	rc := rest.CopyConfig(env.RESTConfig())
	rc.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		return roundTripFunc(func(req *http.Request) (*http.Response, error) {
			if matches(req) && refuse.CompareAndSwap(true, false) {
				return nil, fmt.Errorf("test: %s refused once", req.Method)
			}
			return rt.RoundTrip(req)
		})
	}
	s := NewStore(kubernetes.NewForConfigOrDie(rc), ns, "csibroker-intents", nil)
	runCtx, stop := context.WithCancel(ctx)
	t.Cleanup(stop)
	go s.Run(runCtx)
	add = func(name string) error {
		return s.Add(ctx, Intent{VolumeName: name, Driver: "d", ClaimNamespace: ns, ClaimName: name, Request: []byte{1}, Created: metav1.Now()})
	}
	return env, ns, ctx, add, refuse
}

// TestWithEarlier: an attempt's entry keeps the differing requests of the
// earlier attempts for the same volume, oldest first, each once, at most
// maxEarlierRequests of them.
func TestWithEarlier(t *testing.T) {
	r := func(s string) []byte { return []byte(s) }
	prev := Intent{Request: r("b"), EarlierRequests: [][]byte{r("a")}}
	got := WithEarlier(Intent{Request: r("c")}, prev)
	if want := [][]byte{r("a"), r("b")}; !slices.EqualFunc(got.EarlierRequests, want, bytes.Equal) {
		t.Errorf("earlier requests %q, want %q", got.EarlierRequests, want)
	}
	if got := WithEarlier(Intent{Request: r("b")}, prev); !slices.EqualFunc(got.EarlierRequests, [][]byte{r("a")}, bytes.Equal) {
		t.Errorf("the same request again: earlier requests %q, want only a", got.EarlierRequests)
	}
	long := Intent{Request: r("e"), EarlierRequests: [][]byte{r("a"), r("b"), r("c"), r("a")}}
	if got := WithEarlier(Intent{Request: r("f")}, long); !slices.EqualFunc(got.EarlierRequests, [][]byte{r("a"), r("b"), r("e")}, bytes.Equal) {
		t.Errorf("bounded: earlier requests %q, want the oldest %d and the newest", got.EarlierRequests, maxEarlierRequests-1)
	}
	// Folding a second entry in keeps what the first folded.
	got = WithEarlier(WithEarlier(Intent{Request: r("c")}, prev), Intent{Request: r("x")})
	if want := [][]byte{r("a"), r("b"), r("x")}; !slices.EqualFunc(got.EarlierRequests, want, bytes.Equal) {
		t.Errorf("two entries folded: earlier requests %q, want %q", got.EarlierRequests, want)
	}
}

// TestSupersededKey: a superseded entry's key names its node, by hash when
// the key would be longer than a ConfigMap key may be.
func TestSupersededKey(t *testing.T) {
	short := Intent{VolumeName: "pvc-1", Node: "n1", Superseded: true}
	if k := short.Key(); k != "pvc-1_n1" {
		t.Errorf("key %q, want pvc-1_n1", k)
	}
	long := Intent{VolumeName: "pvc-" + strings.Repeat("u", 36), Node: strings.Repeat("n", 240), Superseded: true}
	other := long
	other.Node = strings.Repeat("n", 239) + "m"
	if k := long.Key(); len(k) > maxIntentKey || k == other.Key() || !strings.HasPrefix(k, long.VolumeName+"_") {
		t.Errorf("long node name: key %q (%d characters), other node's %q", k, len(k), other.Key())
	}
	if k := (Intent{VolumeName: "pvc-1", Node: "n1"}).Key(); k != "pvc-1" {
		t.Errorf("an entry that is not superseded has key %q, want its volume name", k)
	}
}

// TestIntentSharedByDriver: two replicas lead different drivers over one
// record (per-driver leader election). Both write at once and neither
// replaces the other's entries; neither adds or removes the other's; a
// driver handed over is read again by its new leader, and a late Remove
// by the old one does not delete the entry the new leader wrote again;
// an Add queued for a driver handed over fails.
func TestIntentSharedByDriver(t *testing.T) {
	env := kubetest.ControlPlane(t)
	ns := env.NewNamespace(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var mu sync.Mutex
	leads := map[string]string{"d1": "a", "d2": "b"}
	store := func(me string) *Store {
		s := NewStore(env.Client(), ns, "csibroker-intents", nil)
		s.Share(func(d string) bool { mu.Lock(); defer mu.Unlock(); return leads[d] == me })
		go s.Run(ctx)
		return s
	}
	a, b := store("a"), store("b")
	entry := func(v, d, node string) Intent {
		return Intent{VolumeName: v, Driver: d, ClaimNamespace: ns, ClaimName: v, Node: node}
	}
	var wg sync.WaitGroup
	errs := make(chan error, 20)
	for i := range 10 {
		wg.Add(2)
		go func() { defer wg.Done(); errs <- a.Add(ctx, entry(fmt.Sprintf("a%d", i), "d1", "")) }()
		go func() { defer wg.Done(); errs <- b.Add(ctx, entry(fmt.Sprintf("b%d", i), "d2", "")) }()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if got := recordedVolumes(ctx, t, env, ns); len(got) != 20 {
		t.Fatalf("record holds %v, want the 20 entries of both replicas", got)
	}
	if err := a.Add(ctx, entry("x", "d2", "")); !errors.Is(err, errTermEnded) {
		t.Fatalf("an Add of another replica's driver: %v, want errTermEnded", err)
	}
	b.Remove("a0") // a's entry: dropped

	// d1 moves from a to b; b writes a0 again, then a's late Remove.
	mu.Lock()
	leads["d1"] = "b"
	mu.Unlock()
	a.Handover("d1")
	b.Handover("d1")
	if in, ok, err := b.Lookup(ctx, "a1"); err != nil || !ok || in.Driver != "d1" {
		t.Fatalf("new leader's Lookup(a1) = %+v, %v, %v; want a's entry, read again", in, ok, err)
	}
	if err := b.Add(ctx, entry("a0", "d1", "again")); err != nil {
		t.Fatal(err)
	}
	a.Remove("a0")
	b.Remove("a2")                                                 // its leader now: written
	if err := b.Add(ctx, entry("b9", "d2", "flush")); err != nil { // a write that carries b's Remove
		t.Fatal(err)
	}
	// a's Remove would ride on a's next write: give it one.
	mu.Lock()
	leads["d3"] = "a"
	mu.Unlock()
	if err := a.Add(ctx, entry("c0", "d3", "")); err != nil {
		t.Fatal(err)
	}
	got := recordedVolumes(ctx, t, env, ns)
	if !slices.Contains(got, "a0") || slices.Contains(got, "a2") || !slices.Contains(got, "c0") {
		t.Fatalf("record %v: want a0 kept (a's late Remove dropped), a2 removed by its new leader, c0 added", got)
	}
	ins, err := NewStore(env.Client(), ns, "csibroker-intents", nil).List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range ins {
		if in.VolumeName == "a0" && in.Node != "again" {
			t.Fatalf("a0 is %+v, want the new leader's entry", in)
		}
	}

	// An Add queued (the store's Run is not running) when its driver
	// changes hands fails.
	idle := NewStore(env.Client(), ns, "csibroker-intents", nil)
	idle.Share(func(string) bool { return true })
	res := make(chan error, 1)
	go func() { res <- idle.Add(ctx, entry("q", "d4", "")) }()
	if err := testenvWait(ctx, func() bool { idle.mu.Lock(); defer idle.mu.Unlock(); return len(idle.adds) == 1 }); err != nil {
		t.Fatal(err)
	}
	idle.Handover("d4")
	if err := <-res; !errors.Is(err, errTermEnded) {
		t.Fatalf("queued Add of a driver handed over: %v, want errTermEnded", err)
	}
}

func testenvWait(ctx context.Context, cond func() bool) error {
	return testenv.WaitFor(ctx, 10*time.Second, "condition", func(context.Context) (bool, string, error) { return cond(), "", nil })
}
