package proxy

import (
	"encoding/binary"
	"testing"
)

// TestMsgTracker feeds gRPC length-prefixed messages cut at every offset
// and checks where the byte stream ends between messages.
func TestMsgTracker(t *testing.T) {
	msg := func(n int) []byte {
		b := make([]byte, 5+n)
		binary.BigEndian.PutUint32(b[1:], uint32(n))
		return b
	}
	stream := append(append(msg(3), msg(0)...), msg(20)...) // 8 + 5 + 25 bytes
	ends := map[int]bool{0: true, 8: true, 13: true, 38: true}
	for cut := 0; cut <= len(stream); cut++ {
		var m msgTracker
		m.feed(stream[:cut])
		if m.boundary() != ends[cut] {
			t.Errorf("after %d bytes: boundary %v, want %v", cut, m.boundary(), ends[cut])
		}
		// The same bytes in two pieces give the same answer.
		for split := 0; split <= cut; split++ {
			var m2 msgTracker
			m2.feed(stream[:split])
			m2.feed(stream[split:cut])
			if m2.boundary() != ends[cut] {
				t.Fatalf("after %d bytes split at %d: boundary %v, want %v", cut, split, m2.boundary(), ends[cut])
			}
		}
	}
}
