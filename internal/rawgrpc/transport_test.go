package rawgrpc

import (
	"context"
	"encoding/binary"
	"net"
	"sync"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// frameCounter parses the HTTP/2 frames one side writes (after the client
// preface, if any) and counts them by type.
type frameCounter struct {
	mu      sync.Mutex
	buf     []byte
	preface int // client preface bytes still to skip
	byType  map[byte]int
}

func (c *frameCounter) write(p []byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.preface > 0 {
		n := min(c.preface, len(p))
		c.preface -= n
		p = p[n:]
	}
	c.buf = append(c.buf, p...)
	for len(c.buf) >= 9 {
		length := int(c.buf[0])<<16 | int(binary.BigEndian.Uint16(c.buf[1:3]))
		if len(c.buf) < 9+length {
			return
		}
		c.byType[c.buf[3]]++
		c.buf = c.buf[9+length:]
	}
}

func (c *frameCounter) count(t byte) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.byType[t]
}

type countingConn struct {
	net.Conn
	c *frameCounter
}

func (cc countingConn) Write(p []byte) (int, error) {
	cc.c.write(p)
	return cc.Conn.Write(p)
}

type countingListener struct {
	net.Listener
	c *frameCounter
}

func (l countingListener) Accept() (net.Conn, error) {
	conn, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return countingConn{conn, l.c}, nil
}

const framePing = 0x6

// pings makes 50 unary calls over plaintext HTTP/2 on loopback and returns
// the PING frames the server and the client wrote.
func pings(t *testing.T, serverOpts []grpc.ServerOption, dialOpts []grpc.DialOption) (server, client int) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	sc := &frameCounter{byType: map[byte]int{}}
	cc := &frameCounter{byType: map[byte]int{}, preface: 24}
	srv := grpc.NewServer(serverOpts...)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	go srv.Serve(countingListener{lis, sc})
	defer srv.Stop()
	conn, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), append(dialOpts,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
			if err != nil {
				return nil, err
			}
			return countingConn{c, cc}, nil
		}))...)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	for i := 0; i < 50; i++ {
		if _, err := healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	return sc.count(framePing), cc.count(framePing)
}

// TestStaticWindowsSendNoPings: with the hops' transport options neither
// side answers DATA frames with bandwidth-estimation PINGs; with gRPC's
// defaults (the control, which shows the counter sees them) both do.
func TestStaticWindowsSendNoPings(t *testing.T) {
	ds, dc := pings(t, nil, nil)
	if ds == 0 || dc == 0 {
		t.Fatalf("control: gRPC defaults sent %d server and %d client PINGs over 50 calls; the frame counter sees nothing", ds, dc)
	}
	s, c := pings(t, ServerTransportOptions(), ClientTransportOptions())
	if s != 0 || c != 0 {
		t.Fatalf("with static windows the server sent %d and the client %d PING frames over 50 calls, want 0 (defaults: %d and %d)", s, c, ds, dc)
	}
	t.Logf("PING frames over 50 unary calls: defaults server %d client %d; static windows 0 and 0", ds, dc)
}
