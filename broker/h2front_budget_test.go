package broker

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"sync"
	"testing"

	"golang.org/x/net/http2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The bookkeeping of a front-end connection's memory budget (feConn.held),
// on every path a call can take, including those a test through the
// chain can only hit by chance (a call reset while its message is being
// sent on). The connection is a real unix socket whose caller end reads
// and drops what the front end writes; calls are driven as the reader
// and a streaming call's goroutines drive them.

type budgetConn struct {
	t    *testing.T
	c    *feConn
	max  int
	fw   *http2.Framer // makes DATA frames
	fbuf bytes.Buffer
}

func newBudgetConn(t *testing.T, maxMsg int) *budgetConn {
	t.Helper()
	lis, err := net.Listen("unix", filepath.Join(t.TempDir(), "s"))
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	caller, err := net.Dial("unix", lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	nc, err := lis.Accept()
	if err != nil {
		t.Fatal(err)
	}
	go io.Copy(io.Discard, caller)
	t.Cleanup(func() { caller.Close(); nc.Close() })
	b := &Broker{opts: Options{MaxMsgSize: maxMsg}, log: slog.New(slog.DiscardHandler)}
	bc := &budgetConn{t: t, c: newFEConn(newFEServer(&frontEnd{b: b}, nil), nc), max: maxMsg}
	bc.c.started = true
	bc.fw = http2.NewFramer(&bc.fbuf, &bc.fbuf)
	return bc
}

// stream opens a streaming call as onHeadersLocked does, without its
// goroutine.
func (b *budgetConn) stream(id uint32) *feStream {
	st := &feStream{id: id, sendWin: feStreamWindow, recvWin: feStreamWindow, contentType: "application/grpc",
		in: &feInput{max: b.max}}
	st.in.cond = sync.NewCond(&st.in.mu)
	b.c.mu.Lock()
	b.c.streams[id] = st
	b.c.mu.Unlock()
	return st
}

func (b *budgetConn) unary(id uint32) *feStream {
	st := &feStream{id: id, unary: true, sendWin: feStreamWindow, recvWin: feStreamWindow, contentType: "application/grpc"}
	b.c.mu.Lock()
	b.c.streams[id] = st
	b.c.mu.Unlock()
	return st
}

// data delivers p on st as DATA frames of at most 16 KiB, the last ending
// the stream if end.
func (b *budgetConn) data(st *feStream, p []byte, end bool) {
	b.t.Helper()
	for {
		n := min(len(p), 16<<10)
		last := n == len(p)
		b.fbuf.Reset()
		if err := b.fw.WriteData(st.id, end && last, p[:n]); err != nil {
			b.t.Fatal(err)
		}
		f, err := b.fw.ReadFrame()
		if err != nil {
			b.t.Fatal(err)
		}
		b.c.mu.Lock()
		b.c.onDataLocked(f.(*http2.DataFrame))
		b.c.mu.Unlock()
		if p = p[n:]; last {
			return
		}
	}
}

// take is a streaming call's goroutine taking a whole message to send it
// on: it returns what the message holds of the budget until release.
func (b *budgetConn) take(st *feStream) int {
	b.t.Helper()
	_, n, held, err := st.in.next()
	if err != nil {
		b.t.Fatal(err)
	}
	b.c.credit(st, n)
	return held
}

func (b *budgetConn) locked(f func()) {
	b.c.mu.Lock()
	defer b.c.mu.Unlock()
	f()
}

// check fails unless the connection counts held bytes, the sum of what its
// calls count, and has waiting calls waiting.
func (b *budgetConn) check(what string, held, waiting int) {
	b.t.Helper()
	b.c.mu.Lock()
	defer b.c.mu.Unlock()
	sum := 0
	for _, st := range b.c.streams {
		sum += st.held
	}
	if b.c.held != held || sum != held || len(b.c.waiting) != waiting {
		b.t.Fatalf("%s: the connection counts %d bytes, its calls %d, %d calls wait; want %d bytes, %d waiting",
			what, b.c.held, sum, len(b.c.waiting), held, waiting)
	}
}

func message(size int) []byte {
	m := make([]byte, size)
	binary.BigEndian.PutUint32(m[1:], uint32(size-5))
	return m
}

func TestFrontEndBudgetBookkeeping(t *testing.T) {
	const maxMsg = 2 << 20 // larger than the stream window
	const size = 5 + maxMsg
	msg := message(size)

	t.Run("sent on", func(t *testing.T) {
		b := newBudgetConn(t, maxMsg)
		a := b.stream(1)
		b.data(a, msg[:5], false)
		b.check("a large message let in at its prefix", size, 0)
		b.data(a, msg[5:], false)
		held := b.take(a)
		b.check("taken, being sent on", size, 0)
		b.c.release(a, held)
		b.check("sent on", 0, 0)
	})

	t.Run("reset while being sent on", func(t *testing.T) {
		b := newBudgetConn(t, maxMsg)
		a := b.stream(1)
		b.data(a, msg, false)
		held := b.take(a)
		b.locked(func() { b.c.resetLocked(a) })
		b.check("reset by the caller while being sent on", 0, 0)
		b.c.release(a, held) // the send ends with the call
		b.check("its send ended", 0, 0)
	})

	t.Run("waiting", func(t *testing.T) {
		b := newBudgetConn(t, maxMsg)
		c1, c3, c5, c7, c9 := b.stream(1), b.stream(3), b.stream(5), b.stream(7), b.stream(9)
		b.data(c1, msg[:size-1], false)
		b.data(c3, msg[:size-1], false)
		b.check("two large messages arriving", 2*size, 0)
		b.data(c5, msg[:feStreamWindow], false)
		b.data(c7, msg[:5], false)
		b.check("two more waiting", 2*size, 2)
		if c5.recvWin != 0 || c5.unacked != 0 {
			t.Fatalf("a waiting call was credited: window %d, %d bytes to credit", c5.recvWin, c5.unacked)
		}
		b.data(c9, message(100), false)
		b.check("a small message does not wait", 2*size, 2)
		b.locked(func() { b.c.endRequestLocked(c7) })
		b.check("a waiting call's request ended inside its message", 2*size, 1)
		b.locked(func() { b.c.resetLocked(c1) })
		b.check("one reset, the waiting one let in", 2*size, 0)
		if c5.held != size || c5.recvWin == 0 {
			t.Fatalf("the call let in counts %d bytes, window %d", c5.held, c5.recvWin)
		}
		b.locked(func() {
			b.c.endLocked(c3, false, status.Error(codes.Internal, "ended before its request"), nil)
		})
		b.check("one ended by the front end before its request was whole", size, 0)
		b.data(c3, msg[:5], false) // late DATA of an ended call
		b.check("late DATA of an ended call", size, 0)
		b.locked(func() { b.c.closeLocked(errors.New("test")) })
		b.check("connection closed", 0, 0)
		if b.c.hdrHeld != 0 {
			t.Fatalf("header lists counted on a closed connection: %d", b.c.hdrHeld)
		}
	})

	t.Run("shared with unary requests", func(t *testing.T) {
		b := newBudgetConn(t, maxMsg)
		a := b.stream(1)
		b.data(a, msg[:size-1], false)
		u := b.unary(3)
		b.data(u, msg[:size-1], false)
		b.check("a stream's message and a unary request", 2*size-1, 0)
		w := b.stream(5)
		b.data(w, msg[:5], false)
		b.check("a large message waits for a unary request", 2*size-1, 1)
		v := b.unary(7)
		b.data(v, msg[:2], false)
		b.check("a unary request over the budget is refused", 2*size-1, 1)
		if !v.reset {
			t.Fatal("the unary request over the budget was not refused")
		}
		b.locked(func() { b.c.resetLocked(u) })
		b.check("the unary call reset: the waiting one let in", 2*size, 0)
		b.locked(func() { b.c.resetLocked(a) })
		b.locked(func() { b.c.resetLocked(w) })
		b.check("all reset", 0, 0)
	})
}
