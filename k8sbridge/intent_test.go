package k8sbridge

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/internal/testenv"
)

func TestIntentStoreBatchesWrites(t *testing.T) {
	env := testenv.Shared(t)
	ns := env.NewNamespace(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := NewIntentStore(env.Client(), ns, "csibroker-intents", nil)
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	go s.Run(runCtx)

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
	got, err := NewIntentStore(env.Client(), ns, "csibroker-intents", nil).List(ctx)
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
		got, err := NewIntentStore(env.Client(), ns, "csibroker-intents", nil).List(ctx)
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
	env := testenv.Shared(t)
	ns := env.NewNamespace(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := NewIntentStore(env.Client(), ns, "intents", nil)
	s.maxEntries = 2
	go s.Run(ctx)
	for i := 0; i < 2; i++ {
		if err := s.Add(ctx, Intent{VolumeName: fmt.Sprint("v", i)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Add(ctx, Intent{VolumeName: "v3"}); err != ErrIntentStoreFull {
		t.Fatalf("err = %v", err)
	}
	// Re-adding an existing entry is not growth.
	if err := s.Add(ctx, Intent{VolumeName: "v1", Driver: "again"}); err != nil {
		t.Fatal(err)
	}
}

func TestIntentStoreByteBudget(t *testing.T) {
	env := testenv.Shared(t)
	ns := env.NewNamespace(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := NewIntentStore(env.Client(), ns, "intents", nil)
	s.maxBytes = 4000
	go s.Run(ctx)
	big := make([]byte, 1500) // base64 in JSON: ~2 KB per entry
	if err := s.Add(ctx, Intent{VolumeName: "a", Request: big}); err != nil {
		t.Fatal(err)
	}
	if err := s.Add(ctx, Intent{VolumeName: "b", Request: big}); err != ErrIntentStoreFull {
		t.Fatalf("second big entry: %v, want ErrIntentStoreFull", err)
	}
	if err := s.Add(ctx, Intent{VolumeName: "c", Request: []byte{1}}); err != nil {
		t.Fatalf("a small entry that fits: %v", err)
	}
}
