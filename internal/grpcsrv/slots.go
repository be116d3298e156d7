package grpcsrv

import (
	"context"

	"google.golang.org/grpc/status"
)

// Slots bounds the calls a server passes on at once (the proxy's calls to
// its driver, the front ends' calls per driver): a call over the bound
// waits for a slot within its context.
type Slots struct {
	ch   chan struct{}
	what string // names the bound in a waiting call's error
}

// NewSlots makes n slots; what names them in errors.
func NewSlots(n int, what string) *Slots { return &Slots{ch: make(chan struct{}, n), what: what} }

// Take takes a slot, waiting within ctx; release gives it back. A call
// whose context ends first gets its context's status (DeadlineExceeded or
// Canceled), saying what it waited for.
func (s *Slots) Take(ctx context.Context) (release func(), err error) {
	select {
	case s.ch <- struct{}{}:
		return s.release, nil
	default:
	}
	select {
	case s.ch <- struct{}{}:
		return s.release, nil
	case <-ctx.Done():
		return nil, status.Errorf(status.FromContextError(ctx.Err()).Code(),
			"%s: the call waited for one of %d call slots until it ended: %v", s.what, cap(s.ch), ctx.Err())
	}
}

func (s *Slots) release() { <-s.ch }

// Taken is the number of slots taken now.
func (s *Slots) Taken() int { return len(s.ch) }
