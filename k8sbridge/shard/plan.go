package shard

import (
	"cmp"
	"hash/fnv"
	"slices"
)

// State is what one replica knows when it plans: the drivers registered
// here, the live members (replicas whose member Lease is renewed; Me is one
// of them) and which live member holds each driver's Lease.
type State struct {
	Me      string
	Drivers []string
	Members []string
	// Holders maps a driver to the live member holding its Lease; a driver
	// absent (or held by one not in Members) is free.
	Holders map[string]string
}

// Plan is what Me does next: Leases to take and Leases to give up.
type Plan struct {
	Acquire []string
	Release []string
	// Alternates are the other free drivers, ranked: one of them is taken
	// in place of a driver of Acquire another member took first.
	Alternates []string
}

// Decide is the balancing rule, a pure function of State. With D drivers
// and N live members, every member is meant to lead lo = D/N or hi =
// ceil(D/N) of them:
//
//   - a member over hi gives up what is over; one over lo gives up one
//     when another member is under lo and the free drivers do not make
//     up for it (the starving one takes it);
//   - a member under lo takes free drivers up to lo; one at lo or above
//     takes up to hi only from the free drivers left once every member
//     under lo could have its share;
//   - a driver held here but no longer registered here is given up.
//
// Which drivers: each member ranks drivers by a rendezvous hash of its
// identity and the driver's name, takes the free ones it ranks highest and
// gives up the ones it ranks lowest, so members racing for free drivers
// mostly want different ones, and an assignment once made stays (a
// balanced state has nothing to do: no flapping).
func Decide(s State) Plan {
	registered := map[string]bool{}
	for _, d := range s.Drivers {
		registered[d] = true
	}
	members := map[string]bool{s.Me: true}
	for _, m := range s.Members {
		members[m] = true
	}
	var p Plan
	counts := map[string]int{}
	var mine, free []string
	for d := range registered {
		h := s.Holders[d]
		switch {
		case h == s.Me:
			mine = append(mine, d)
		case h != "" && members[h]:
			counts[h]++
		default:
			free = append(free, d)
		}
	}
	for d, h := range s.Holders {
		if h == s.Me && !registered[d] {
			p.Release = append(p.Release, d)
		}
	}
	slices.Sort(p.Release)
	n, total := len(members), len(registered)
	lo, hi := total/n, (total+n-1)/n
	deficit := 0 // what the other members under lo miss
	for m := range members {
		if m != s.Me && counts[m] < lo {
			deficit += lo - counts[m]
		}
	}
	rank(s.Me, mine)
	rank(s.Me, free)
	switch {
	case len(mine) > hi:
		p.Release = append(p.Release, mine[hi:]...)
	case len(mine) > lo && deficit > len(free):
		p.Release = append(p.Release, mine[len(mine)-1])
	default:
		room := 0
		if len(mine) < lo {
			room = lo - len(mine)
		}
		// Left once every member under lo (this one included) has
		// its share: up to hi, first come first served.
		if extra := len(free) - deficit - room; extra > 0 {
			room += min(extra, hi-max(len(mine), lo))
		}
		k := min(max(room, 0), len(free))
		p.Acquire, p.Alternates = free[:k], free[k:]
		if k == 0 {
			p.Alternates = nil
		}
	}
	return p
}

// rank sorts drivers by me's preference, highest first.
func rank(me string, drivers []string) {
	slices.SortFunc(drivers, func(a, b string) int {
		if c := cmp.Compare(score(me, b), score(me, a)); c != 0 {
			return c
		}
		return cmp.Compare(a, b)
	})
}

func score(member, driver string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(member))
	h.Write([]byte{0})
	h.Write([]byte(driver))
	// FNV alone ranks names that differ in one character alike; the
	// finalizer of MurmurHash3 spreads them.
	x := h.Sum64()
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	x ^= x >> 33
	return x
}
