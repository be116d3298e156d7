package broker

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"

	"github.com/csibroker/csibroker/internal/rawgrpc"
)

// A proxy's connection is a grpc-go ClientConn (a generation). It is
// replaced by a new generation, its calls in flight finishing on the old
// one, when the proxy's certificate no longer verifies, when the broker's
// own certificate was reloaded (once the new generation is READY: a proxy
// that refuses the new certificate costs no call), and when the driver is
// reconfigured or removed (drain).

const (
	keepaliveTime    = 30 * time.Second
	keepaliveTimeout = 10 * time.Second
	// renewRetry is how long the broker keeps using a generation made with
	// its previous certificate after the proxy refused one made with the
	// new; renewWait bounds the wait for a new generation to be READY.
	renewRetry = 10 * time.Second
	renewWait  = 10 * time.Second
)

var errBrokerClosed = errors.New("the broker closed the connection")

// errClosedUpstream is a call's error on a connection the broker closed
// because the driver was reconfigured or removed (Unavailable: a retry
// goes to the driver's current proxy, if any).
func errClosedUpstream(addr string) error {
	return status.Errorf(codes.Unavailable, "csibroker: proxy %s: the connection is closed (driver removed or reconfigured)", addr)
}

// generation is one grpc-go ClientConn to a proxy and the calls on it.
type generation struct {
	cc       *grpc.ClientConn
	creds    *checkedCreds
	stop     context.CancelFunc // ends keepConnected
	inflight atomic.Int64
	retired  atomic.Bool
	closed   atomic.Bool
	// onClose, if set before g is retired, runs when g closes.
	onClose func()
}

// release ends a call on g; the last call of a retired generation closes it.
func (g *generation) release() {
	if g.inflight.Add(-1) == 0 && g.retired.Load() {
		g.close()
	}
}

// retire takes g out of use for new calls; it closes after its last call.
func (g *generation) retire() {
	g.retired.Store(true)
	if g.inflight.Load() == 0 {
		g.close()
	}
}

func (g *generation) close() {
	if g.closed.CompareAndSwap(false, true) {
		g.stop()
		g.cc.Close()
		if g.onClose != nil {
			g.onClose()
		}
	}
}

// keepConnected connects g now and again whenever its connection goes idle,
// so its state tells whether the proxy is reachable and the first call
// finds a connection.
func (g *generation) keepConnected(ctx context.Context) {
	for {
		s := g.cc.GetState()
		if s == connectivity.Idle {
			g.cc.Connect()
		}
		if s == connectivity.Shutdown || !g.cc.WaitForStateChange(ctx, s) {
			return
		}
	}
}

// dialGen opens a new generation to p's proxy.
func (p *proxyConn) dialGen() (*generation, error) {
	creds := newCheckedCreds(p.tls, p.log, p.cfg.Address)
	cc, err := grpc.NewClient("passthrough:///"+p.cfg.Address, append(rawgrpc.ClientTransportOptions(),
		grpc.WithTransportCredentials(creds),
		grpc.WithContextDialer(creds.dial),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 2 * time.Second},
			MinConnectTimeout: 5 * time.Second,
		}),
		grpc.WithIdleTimeout(0),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: keepaliveTime, Timeout: keepaliveTimeout, PermitWithoutStream: true}),
		grpc.WithStatsHandler(p.b.stats),
		grpc.WithDefaultCallOptions(
			grpc.ForceCodecV2(rawgrpc.Codec{}),
			grpc.MaxCallRecvMsgSize(p.b.opts.MaxMsgSize),
			grpc.MaxCallSendMsgSize(p.b.opts.MaxMsgSize)),
	)...)
	if err != nil {
		return nil, fmt.Errorf("driver %q: proxy %s: %w", p.driver, p.cfg.Address, err)
	}
	ctx, stop := context.WithCancel(context.Background())
	g := &generation{cc: cc, creds: creds, stop: stop}
	go g.keepConnected(ctx)
	return g, nil
}

// proxyConn is the broker's connection to one proxy.
type proxyConn struct {
	b         *Broker
	cfg       ProxyConfig
	driver    string
	want      string // identity required of the proxy
	retry     RetryConfig
	driverCfg atomic.Pointer[DriverConfig]
	tls       *tls.Config
	log       *slog.Logger
	// descs holds a *callDesc per CSI method called through this proxy.
	descs sync.Map
	unary grpc.UnaryInvoker // the chain (buildChain)

	cur atomic.Pointer[generation] // nil once closed
	// gone: drained or closed; the chain then asks the broker for the
	// driver's current proxy before the next attempt.
	gone atomic.Bool

	mu         sync.Mutex
	old        map[*generation]struct{} // retired, maybe with calls in flight
	renewing   bool
	renewAfter time.Time
}

// acquire returns the generation a new call goes on, counted in flight
// (release it when the call ends). Certificates are checked first: a
// generation whose proxy no longer verifies is replaced at once; one made
// before the broker's certificate was reloaded is renewed in the background.
func (p *proxyConn) acquire() (*generation, error) {
	for {
		g := p.cur.Load()
		if g == nil || p.gone.Load() && g.retired.Load() {
			return nil, errClosedUpstream(p.cfg.Address)
		}
		g.inflight.Add(1)
		if g.retired.Load() {
			g.release()
			if p.gone.Load() {
				return nil, errClosedUpstream(p.cfg.Address)
			}
			continue
		}
		if v := g.creds.check(); v.noLonger || v.ownExpired {
			g.release()
			if !p.replace(g, false) && p.cur.Load() == g {
				return nil, status.Errorf(codes.Unavailable, "csibroker: proxy %s: the connection's certificates no longer verify and no new connection could be made", p.cfg.Address)
			}
			continue
		} else if v.renewed {
			p.renew(g)
		}
		return g, nil
	}
}

// replace puts a new generation in g's place (if g is still current) and
// retires g; with ready, only once the new one is READY (a renewal). It
// reports whether it did.
func (p *proxyConn) replace(g *generation, ready bool) bool {
	if p.gone.Load() {
		return false
	}
	ng, err := p.dialGen()
	if err != nil {
		p.log.Warn("proxy connection: cannot make a new connection", "err", err)
		return false
	}
	if ready {
		ctx, cancel := context.WithTimeout(context.Background(), renewWait)
		defer cancel()
		for s := ng.cc.GetState(); s != connectivity.Ready; s = ng.cc.GetState() {
			if s == connectivity.TransientFailure || !ng.cc.WaitForStateChange(ctx, s) {
				ng.close()
				p.mu.Lock()
				p.renewAfter = time.Now().Add(renewRetry)
				p.mu.Unlock()
				p.log.Warn("the proxy refused a connection with the broker's reloaded certificate; calls stay on the connection made with the previous one until it expires", "retry_in", renewRetry)
				return false
			}
		}
	}
	p.mu.Lock()
	if p.gone.Load() || !p.cur.CompareAndSwap(g, ng) {
		p.mu.Unlock()
		ng.close()
		return false
	}
	p.keepOldLocked(g)
	p.mu.Unlock()
	g.retire()
	if ready {
		p.log.Info("proxy connection renewed with the broker's reloaded certificate")
	}
	return true
}

// renew replaces g in the background once a generation with the broker's
// reloaded certificate is READY.
func (p *proxyConn) renew(g *generation) {
	p.mu.Lock()
	if p.renewing || time.Now().Before(p.renewAfter) {
		p.mu.Unlock()
		return
	}
	p.renewing = true
	p.mu.Unlock()
	go func() {
		p.replace(g, true)
		p.mu.Lock()
		p.renewing = false
		p.mu.Unlock()
	}()
}

// keepOldLocked remembers a retired generation until it has closed.
func (p *proxyConn) keepOldLocked(g *generation) {
	if p.old == nil {
		p.old = map[*generation]struct{}{}
	}
	for x := range p.old {
		if x.closed.Load() {
			delete(p.old, x)
		}
	}
	p.old[g] = struct{}{}
}

// state names the connection's state as gRPC's connectivity states do.
// A generation whose proxy's certificate no longer verifies is replaced
// here as the next call would replace it, so the state does not stay READY
// for a connection no call will be given.
func (p *proxyConn) state() string {
	if g, err := p.acquire(); err == nil {
		g.release()
	}
	g := p.cur.Load()
	if g == nil || p.gone.Load() {
		return connectivity.Shutdown.String()
	}
	return g.cc.GetState().String()
}

// retireCurrent takes the current generation out of use; calls in flight
// finish on it.
func (p *proxyConn) retireCurrent() {
	p.gone.Store(true)
	p.mu.Lock()
	g := p.cur.Load()
	if g != nil {
		p.keepOldLocked(g)
		if !g.retired.Load() {
			g.onClose = func() { p.log.Info("proxy connection closed: the driver was reconfigured or removed") }
		}
	}
	p.mu.Unlock()
	if g != nil {
		g.retire()
	}
}

// failOld closes every retired generation, calls in flight failing.
func (p *proxyConn) failOld() {
	p.mu.Lock()
	old := p.old
	p.old = nil
	p.mu.Unlock()
	for g := range old {
		g.close()
	}
}

// close closes every generation; calls in flight fail with Unavailable.
func (p *proxyConn) close() {
	p.gone.Store(true)
	if g := p.cur.Swap(nil); g != nil {
		g.close()
	}
	p.failOld()
}

// live is p, or, once p is drained, the connection that replaced it; an
// error if nothing replaced it (the driver, or its node, was removed).
func (p *proxyConn) live() (*proxyConn, error) {
	if !p.gone.Load() {
		return p, nil
	}
	if n := p.b.current(p); n != p {
		return n, nil
	}
	return nil, errClosedUpstream(p.cfg.Address)
}

// drain closes p once its calls in flight have ended, and at the latest
// when the driver's longest method timeout, which bounds every call, has
// passed.
func (p *proxyConn) drain() {
	cfg := p.driverCfg.Load()
	grace := cfg.Timeout
	for _, t := range cfg.MethodTimeouts {
		grace = max(grace, t)
	}
	grace += time.Second
	b := p.b
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		p.close()
		return
	}
	b.draining[p] = struct{}{}
	b.mu.Unlock()
	p.retireCurrent()
	time.AfterFunc(grace, func() {
		p.close()
		b.mu.Lock()
		delete(b.draining, p)
		b.mu.Unlock()
	})
}
