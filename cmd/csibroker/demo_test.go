package main

import (
	"runtime"
	"sync"
	"testing"
	"time"
)

// TestFirstExit: the demo's channel of "a component exited", made once
// when the components have started, is closed when the first child exits,
// also when two exit at the same moment (a second close would panic; run
// with -race), and not before. It takes one goroutine per child, which
// ends with its child.
func TestFirstExit(t *testing.T) {
	baseline := runtime.NumGoroutine()
	for i := range 20000 {
		a, b := &demoProc{name: "a", done: make(chan struct{})}, &demoProc{name: "b", done: make(chan struct{})}
		exited := firstExit([]*demoProc{a, b})
		select {
		case <-exited:
			t.Fatalf("round %d: closed while every child runs", i)
		default:
		}
		if i == 0 {
			if n := runtime.NumGoroutine() - baseline; n > 2 {
				t.Fatalf("%d goroutines for two children, want one each", n)
			}
		}
		start := make(chan struct{})
		var wg sync.WaitGroup
		for _, p := range []*demoProc{a, b} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				close(p.done)
			}()
		}
		close(start)
		wg.Wait()
		select {
		case <-exited:
		case <-time.After(5 * time.Second):
			t.Fatalf("round %d: not closed after both children exited", i)
		}
	}
	// Every watcher ends with its child.
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > baseline {
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines left after every child exited", runtime.NumGoroutine()-baseline)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
