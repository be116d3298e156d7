package k8sbridge

import "testing"

// TestDriverSlots: each driver has PerDriverWorkers slots of its own; a
// slot given back can be taken again, and a driver with none taken leaves
// nothing behind.
func TestDriverSlots(t *testing.T) {
	s := newDriverSlots(2)
	steps := []struct {
		name    string
		driver  string
		release bool
		want    bool
	}{
		{"first of a", "a", false, true},
		{"second of a", "a", false, true},
		{"a at its limit", "a", false, false},
		{"b has its own", "b", false, true},
		{"a gives one back", "a", true, false},
		{"a takes it again", "a", false, true},
		{"a at its limit again", "a", false, false},
	}
	for _, st := range steps {
		if st.release {
			s.release(st.driver)
			continue
		}
		if got := s.acquire(st.driver); got != st.want {
			t.Errorf("%s: acquire %v, want %v", st.name, got, st.want)
		}
	}
	s.release("a")
	s.release("a")
	s.release("b")
	if len(s.busy) != 0 {
		t.Errorf("slots left after every one was given back: %v", s.busy)
	}
}
