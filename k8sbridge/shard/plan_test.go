package shard

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/util/validation"
)

func names(prefix string, n int) []string {
	var out []string
	for i := range n {
		out = append(out, fmt.Sprintf("%s%02d", prefix, i))
	}
	return out
}

func held(me string, ds ...string) map[string]string {
	m := map[string]string{}
	for _, d := range ds {
		m[d] = me
	}
	return m
}

func merge(ms ...map[string]string) map[string]string {
	out := map[string]string{}
	for _, m := range ms {
		for k, v := range m {
			out[k] = v
		}
	}
	return out
}

func TestDecide(t *testing.T) {
	drivers := names("d", 20)
	for _, tc := range []struct {
		name        string
		s           State
		acquire     int // how many
		release     int
		releaseOnly []string // exactly these, if set
	}{
		{name: "alone, nothing held: takes every driver", s: State{Me: "a", Drivers: drivers}, acquire: 20},
		{name: "alone, no drivers: nothing", s: State{Me: "a"}},
		{name: "three members, nothing held: takes hi (7) at most", s: State{Me: "a", Drivers: drivers, Members: []string{"a", "b", "c"}}, acquire: 7},
		{name: "joins two that hold ten each: waits", s: State{Me: "c", Drivers: drivers, Members: []string{"a", "b", "c"},
			Holders: merge(held("a", drivers[:10]...), held("b", drivers[10:]...))}},
		{name: "holds ten of 20 with a third member starving: gives up three", s: State{Me: "a", Drivers: drivers, Members: []string{"a", "b", "c"},
			Holders: merge(held("a", drivers[:10]...), held("b", drivers[10:]...))}, release: 3},
		{name: "balanced 7/7/6: nothing", s: State{Me: "a", Drivers: drivers, Members: []string{"a", "b", "c"},
			Holders: merge(held("a", drivers[:7]...), held("b", drivers[7:14]...), held("c", drivers[14:]...))}},
		{name: "balanced 7/7/6, the one at 6: nothing", s: State{Me: "c", Drivers: drivers, Members: []string{"a", "b", "c"},
			Holders: merge(held("a", drivers[:7]...), held("b", drivers[7:14]...), held("c", drivers[14:]...))}},
		{name: "a member died (not live): its drivers are free, takes up to ten", s: State{Me: "a", Drivers: drivers, Members: []string{"a", "b"},
			Holders: merge(held("a", drivers[:7]...), held("b", drivers[7:14]...), held("c", drivers[14:]...))}, acquire: 3},
		{name: "fourth member joins 7/7/6: the ones over five give up", s: State{Me: "a", Drivers: drivers, Members: []string{"a", "b", "c", "d"},
			Holders: merge(held("a", drivers[:7]...), held("b", drivers[7:14]...), held("c", drivers[14:]...))}, release: 2},
		{name: "free drivers but others starve: the one at lo leaves them", s: State{Me: "a", Drivers: drivers, Members: []string{"a", "b", "c", "d"},
			Holders: merge(held("a", drivers[:5]...), held("b", drivers[5:10]...), held("c", drivers[10:15]...))}},
		{name: "the starving one takes its share", s: State{Me: "d", Drivers: drivers, Members: []string{"a", "b", "c", "d"},
			Holders: merge(held("a", drivers[:5]...), held("b", drivers[5:10]...), held("c", drivers[10:15]...))}, acquire: 5},
		{name: "six members, 4/4/4/4/4/0: one over lo gives one up", s: State{Me: "a", Drivers: drivers, Members: []string{"a", "b", "c", "d", "e", "f"},
			Holders: merge(held("a", drivers[:4]...), held("b", drivers[4:8]...), held("c", drivers[8:12]...), held("d", drivers[12:16]...), held("e", drivers[16:]...))}, release: 1},
		{name: "a driver no longer registered is given up", s: State{Me: "a", Drivers: drivers[:3], Members: []string{"a"},
			Holders: held("a", "d00", "gone")}, acquire: 2, releaseOnly: []string{"gone"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := Decide(tc.s)
			if len(p.Acquire) != tc.acquire {
				t.Errorf("acquire %v (%d), want %d", p.Acquire, len(p.Acquire), tc.acquire)
			}
			if tc.releaseOnly != nil {
				if !slices.Equal(p.Release, tc.releaseOnly) {
					t.Errorf("release %v, want %v", p.Release, tc.releaseOnly)
				}
			} else if len(p.Release) != tc.release {
				t.Errorf("release %v (%d), want %d", p.Release, len(p.Release), tc.release)
			}
			for _, d := range append(slices.Clone(p.Acquire), p.Alternates...) {
				if h := tc.s.Holders[d]; h != "" && slices.Contains(tc.s.Members, h) {
					t.Errorf("acquires %s (or has it as an alternate), held by live member %s", d, h)
				}
			}
			for _, d := range p.Alternates {
				if slices.Contains(p.Acquire, d) {
					t.Errorf("%s both to acquire and an alternate", d)
				}
			}
			if len(p.Acquire) == 0 && len(p.Alternates) > 0 {
				t.Errorf("alternates %v with nothing to acquire", p.Alternates)
			}
			for _, d := range p.Release {
				if tc.s.Holders[d] != tc.s.Me {
					t.Errorf("releases %s, not held by %s", d, tc.s.Me)
				}
			}
		})
	}
}

// simulate lets every member plan and act in turn (a take succeeds only
// if the driver is still free, as a Lease update with its resource version
// does) until a round changes nothing; it returns the holders and how
// many rounds that took.
func simulate(t *testing.T, drivers, members []string, holders map[string]string) (map[string]string, int) {
	t.Helper()
	holders = merge(holders)
	for round := 1; round <= 50; round++ {
		changed := false
		for _, me := range members {
			p := Decide(State{Me: me, Drivers: drivers, Members: members, Holders: holders})
			for _, d := range p.Release {
				delete(holders, d)
				changed = true
			}
			// As the manager does: an alternate stands in for a driver
			// another member took first.
			taken := 0
			for _, d := range append(slices.Clone(p.Acquire), p.Alternates...) {
				if taken == len(p.Acquire) {
					break
				}
				if h := holders[d]; h == "" || !slices.Contains(members, h) {
					holders[d] = me
					changed = true
					taken++
				}
			}
		}
		if !changed {
			return holders, round
		}
	}
	t.Fatalf("no fixed point after 50 rounds: %v", holders)
	return nil, 0
}

func countsOf(members []string, holders map[string]string) map[string]int {
	c := map[string]int{}
	for _, m := range members {
		c[m] = 0
	}
	for _, h := range holders {
		c[h]++
	}
	return c
}

// TestDecideConverges: from nothing, after a member dies and after one
// joins, every driver ends up held by one live member, each holding lo or
// hi, and the state reached is a fixed point.
func TestDecideConverges(t *testing.T) {
	for _, tc := range []struct{ drivers, members int }{{20, 1}, {20, 3}, {20, 4}, {20, 6}, {5, 3}, {3, 5}, {1, 2}, {0, 3}, {40, 7}} {
		t.Run(fmt.Sprintf("%d drivers %d members", tc.drivers, tc.members), func(t *testing.T) {
			drivers, members := names("drv", tc.drivers), names("m", tc.members)
			check := func(what string, members []string, holders map[string]string) {
				t.Helper()
				n := len(members)
				lo, hi := tc.drivers/n, (tc.drivers+n-1)/n
				if len(holders) != tc.drivers {
					t.Errorf("%s: %d of %d drivers held: %v", what, len(holders), tc.drivers, holders)
				}
				for m, k := range countsOf(members, holders) {
					if !slices.Contains(members, m) {
						t.Errorf("%s: %s holds %d drivers but is no member", what, m, k)
					}
					if k < lo || k > hi {
						t.Errorf("%s: %s holds %d drivers, want %d..%d", what, m, k, lo, hi)
					}
				}
			}
			holders, rounds := simulate(t, drivers, members, nil)
			check("from nothing", members, holders)
			t.Logf("from nothing: %d rounds, %v", rounds, countsOf(members, holders))
			// Joining one by one, as replicas start.
			var grown map[string]string
			for i := 1; i <= len(members); i++ {
				grown, _ = simulate(t, drivers, members[:i], grown)
			}
			check("joined one by one", members, grown)
			kept := map[string]string{}
			for d, h := range grown {
				kept[d] = h
			}
			// Stable: the same state again changes nothing.
			if again, r := simulate(t, drivers, members, grown); r != 1 || len(again) != len(grown) {
				t.Errorf("a balanced state moved: %d rounds", r)
			}
			if len(members) > 1 {
				left := members[1:]
				after, _ := simulate(t, drivers, left, grown)
				check("after "+members[0]+" died", left, after)
				moved := 0
				for d, h := range after {
					if kept[d] != members[0] && kept[d] != h {
						moved++
					}
				}
				t.Logf("after a death: %d drivers of live members moved", moved)
			}
			joined := append(slices.Clone(members), "newcomer")
			after, _ := simulate(t, drivers, joined, grown)
			check("after a member joined", joined, after)
		})
	}
}

// Lease names are valid object names, the same for the same input, and
// different for inputs that differ only in what a name cannot hold.
func TestLeaseNames(t *testing.T) {
	seen := map[string]string{}
	for _, s := range []string{"sample.csi.example.com", "Sample.CSI.example.com", "sample.csi.example.com_", "broker-0", "a..b", "a.-b", "-", "",
		strings.Repeat("x", 300), strings.Repeat("x", 299) + "y", "ünïcode.example"} {
		n := DriverLease("csibroker-leader", s)
		if errs := validation.IsDNS1123Subdomain(n); len(errs) > 0 {
			t.Errorf("%q: %q is no valid name: %v", s, n, errs)
		}
		if n != DriverLease("csibroker-leader", s) {
			t.Errorf("%q: two names", s)
		}
		if o, ok := seen[n]; ok {
			t.Errorf("%q and %q share the name %q", s, o, n)
		}
		seen[n] = s
	}
	if got := DriverLease("csibroker-leader", "sample.csi.example.com"); got != "csibroker-leader-driver-sample.csi.example.com" {
		t.Errorf("a driver name that is a valid name is kept: %q", got)
	}
}
