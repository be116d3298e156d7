package chain

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/mtls"
)

const echoName = "echo.csi.test"

func issue(t *testing.T, ca *mtls.CA, trust *mtls.CA, id string, notBefore, notAfter time.Time) *mtls.Material {
	t.Helper()
	c, k, err := ca.Issue(mtls.Leaf{ID: id, NotBefore: notBefore, NotAfter: notAfter})
	if err != nil {
		t.Fatal(err)
	}
	m, err := mtls.ParseMaterial(c, k, trust.CertPEM, notBefore.Add(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestMTLSRefusals checks that each bad certificate is refused with an error
// that says what is wrong, both to the caller and in the proxy's log.
func TestMTLSRefusals(t *testing.T) {
	now := time.Now()
	// One CA for the whole test: chaintest makes its own, so certificates
	// for the chain are minted after it starts, from c.CA.
	other, err := mtls.NewCA("unknown CA", now.Add(-time.Hour), now.Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	noRetry := broker.RetryConfig{MaxAttempts: 1}

	call := func(t *testing.T, c *chaintest.Chain) error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := csi.NewIdentityClient(chaintest.Dial(t, c.Front)).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{}, grpc.WaitForReady(false))
		return err
	}
	// The broker reports a handshake failure as Unavailable; wait for the
	// connection attempt to have failed once so the message is the TLS one.
	waitFailure := func(t *testing.T, c *chaintest.Chain) error {
		var err error
		for i := 0; i < 100; i++ {
			if err = call(t, c); err != nil && strings.Contains(err.Error(), "handshake") {
				return err
			}
			time.Sleep(50 * time.Millisecond)
		}
		return err
	}

	t.Run("proxy certificate from an unknown CA", func(t *testing.T) {
		_, ep := startEcho(t)
		c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, Retry: noRetry, NoWait: true,
			ProxyMaterial: issueFor(t, other, mtls.DriverID(chaintest.TrustDomain, echoName), now.Add(-time.Minute), now.Add(time.Hour))})
		err := waitFailure(t, c)
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "certificate signed by unknown authority") {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("expired proxy certificate", func(t *testing.T) {
		_, ep := startEcho(t)
		c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, Retry: noRetry, NoWait: true,
			ProxyMaterial: issueFor(t, nil, mtls.DriverID(chaintest.TrustDomain, echoName), now.Add(-2*time.Hour), now.Add(-time.Hour))})
		err := waitFailure(t, c)
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "expired") {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("proxy whose identity names another driver", func(t *testing.T) {
		_, ep := startEcho(t)
		c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, Retry: noRetry, NoWait: true,
			ProxyMaterial: issueFor(t, nil, mtls.DriverID(chaintest.TrustDomain, "other.csi.test"), now.Add(-time.Minute), now.Add(time.Hour))})
		err := waitFailure(t, c)
		want := "peer identity spiffe://test.csibroker/csibroker/driver/other.csi.test is not authorized: want spiffe://test.csibroker/csibroker/driver/echo.csi.test"
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), want) {
			t.Fatalf("err = %v", err)
		}
		// The broker says so in its log too, with no call needed.
		waitLog(t, c, "proxy connection failed", echoName, "is not authorized")
	})
	t.Run("expired broker certificate", func(t *testing.T) {
		_, ep := startEcho(t)
		c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, Retry: noRetry, NoWait: true,
			BrokerMaterial: issueFor(t, nil, mtls.BrokerID(chaintest.TrustDomain), now.Add(-2*time.Hour), now.Add(-time.Hour))})
		if err := waitFailureAny(t, func() error { return call(t, c) }); status.Code(err) != codes.Unavailable {
			t.Fatalf("err = %v", err)
		}
		waitLog(t, c, "proxy refused a peer", "expired")
	})
	t.Run("client without a certificate", func(t *testing.T) {
		_, ep := startEcho(t)
		c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
		conn, err := grpc.NewClient("passthrough:///"+c.ProxyAddr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{InsecureSkipVerify: true})))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err = csi.NewIdentityClient(conn).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("a client without a certificate got %v", err)
		}
		waitLog(t, c, "proxy refused a peer", "peer presented no certificate")
	})
	t.Run("a driver's certificate cannot call another proxy", func(t *testing.T) {
		_, ep := startEcho(t)
		c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, Retry: noRetry, NoWait: true,
			BrokerMaterial: issueFor(t, nil, mtls.DriverID(chaintest.TrustDomain, "evil.csi.test"), now.Add(-time.Minute), now.Add(time.Hour))})
		if err := waitFailureAny(t, func() error { return call(t, c) }); status.Code(err) != codes.Unavailable {
			t.Fatalf("err = %v", err)
		}
		waitLog(t, c, "proxy refused a peer", "evil.csi.test is not authorized: want spiffe://test.csibroker/csibroker/broker")
	})
}

// issueFor mints from ca (nil: the chains' shared CA) a certificate that
// trusts the chains' shared CA.
func issueFor(t *testing.T, ca *mtls.CA, id string, nb, na time.Time) *mtls.Material {
	t.Helper()
	if ca == nil {
		ca = chaintest.SharedCA(t)
	}
	return issue(t, ca, chaintest.SharedCA(t), id, nb, na)
}

func waitFailureAny(t *testing.T, f func() error) error {
	var err error
	for i := 0; i < 100; i++ {
		if err = f(); err != nil {
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
	return err
}

func waitLog(t *testing.T, c *chaintest.Chain, parts ...string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		for _, line := range strings.Split(c.Logs.String(), "\n") {
			ok := true
			for _, p := range parts {
				ok = ok && strings.Contains(line, p)
			}
			if ok {
				return
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("no log line with %q in:\n%s", parts, c.Logs.String())
}

// TestCertificateRotationUnderLoad rotates the broker's certificate files
// while calls flow: no call may fail, and the proxy must see each new
// certificate in a real handshake. The broker opens a new connection for
// new calls after each reload by itself ("rolled"); with "dropped" the
// proxy's connections are also cut after each reload, as a network blip
// would.
func TestCertificateRotationUnderLoad(t *testing.T) {
	t.Run("rolled", func(t *testing.T) { rotateUnderLoad(t, false) })
	t.Run("dropped", func(t *testing.T) { rotateUnderLoad(t, true) })
}

func rotateUnderLoad(t *testing.T, drop bool) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, BrokerReload: 20 * time.Millisecond,
		Retry: broker.RetryConfig{MaxAttempts: 10, IntervalStart: 10 * time.Millisecond, IntervalMax: 200 * time.Millisecond}})
	client := csi.NewControllerClient(chaintest.Dial(t, c.Front))

	var ok, failed atomic.Int64
	var firstErr atomic.Value
	stop := make(chan struct{})
	var stopOnce sync.Once
	var wg sync.WaitGroup
	// Stopped on a failure too (t.Fatal below), not left calling.
	t.Cleanup(func() { stopOnce.Do(func() { close(stop) }); wg.Wait() })
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := 0; i < 100000; i++ {
				select {
				case <-stop:
					return
				default:
				}
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "rot"})
				cancel()
				if err != nil {
					failed.Add(1)
					firstErr.CompareAndSwap(nil, err.Error())
				} else {
					ok.Add(1)
				}
			}
		}(w)
	}
	const rotations = 5
	for r := 0; r < rotations; r++ {
		time.Sleep(100 * time.Millisecond)
		now := time.Now()
		cert, key, err := c.CA.Issue(mtls.Leaf{ID: mtls.BrokerID(chaintest.TrustDomain), NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
		if err != nil {
			t.Fatal(err)
		}
		// Key first, then certificate, as a careless writer would: the
		// mismatched moment in between must be refused, not used.
		refused := c.BrokerSource.Failures()
		if err := mtls.WriteFileAtomic(c.BrokerFiles.Key, key, 0o600); err != nil {
			t.Fatal(err)
		}
		waitUntil(t, 5*time.Second, "the new key with the old certificate refused", func() bool { return c.BrokerSource.Failures() > refused })
		if err := mtls.WriteFileAtomic(c.BrokerFiles.Cert, cert, 0o600); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(5 * time.Second)
		for c.BrokerSource.Reloads() < int64(r+1) && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		if drop {
			c.DropProxyConnections()
		}
	}
	// Calls go on with the last certificate before the load stops.
	okAt := ok.Load()
	waitUntil(t, 10*time.Second, "the proxy to see the last certificate and calls to go on", func() bool {
		return len(c.PeerSerials()) >= rotations+1 && ok.Load() >= okAt+20
	})
	stopOnce.Do(func() { close(stop) })
	wg.Wait()

	serials := c.PeerSerials()
	t.Logf("calls ok=%d failed=%d; reloads=%d refused=%d; broker certificates seen by the proxy: %d", ok.Load(), failed.Load(), c.BrokerSource.Reloads(), c.BrokerSource.Failures(), len(serials))
	if failed.Load() != 0 {
		t.Fatalf("%d calls failed during rotation; first: %v", failed.Load(), firstErr.Load())
	}
	if c.BrokerSource.Reloads() != rotations {
		t.Fatalf("reloads = %d, want %d", c.BrokerSource.Reloads(), rotations)
	}
	if c.BrokerSource.Failures() < rotations {
		t.Fatalf("%d reloads refused, want the mismatched key and certificate of each rotation refused", c.BrokerSource.Failures())
	}
	if len(serials) != rotations+1 {
		t.Fatalf("proxy accepted %d distinct broker certificates, want %d (the first and each rotation)", len(serials), rotations+1)
	}
	if ok.Load() == 0 {
		t.Fatal("no call went through")
	}
}

// TestExpiredPeerOnAnOpenConnection: a certificate that expires while its
// connection is open stops serving new calls on it, on both ends. The
// proxy refuses new calls from a broker connection whose certificate has
// expired (Unavailable, the connection closed once it has no call). The broker
// gives no new call to a connection whose proxy certificate has expired:
// the call makes a new handshake, which the expired certificate fails.
func TestExpiredPeerOnAnOpenConnection(t *testing.T) {
	t.Run("proxy side", func(t *testing.T) {
		_, ep := startEcho(t)
		c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
		expiry := time.Now().Add(1500 * time.Millisecond)
		m, err := c.CA.IssueMaterial(mtls.Leaf{ID: mtls.BrokerID(chaintest.TrustDomain), NotBefore: time.Now().Add(-time.Minute), NotAfter: expiry})
		if err != nil {
			t.Fatal(err)
		}
		// A broker-like client whose certificate expires while its
		// connection is open; it never redials (no new handshake).
		tlsCfg := mtls.ClientConfig(mtls.StaticSource{M: m}, mtls.AuthorizeOneOf(mtls.DriverID(chaintest.TrustDomain, echoName)))
		var dials atomic.Int32
		cc, err := grpc.NewClient("passthrough:///"+c.ProxyAddr, grpc.WithTransportCredentials(credentials.NewTLS(tlsCfg)),
			grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
				if dials.Add(1) > 1 {
					return nil, errors.New("no second connection in this test")
				}
				var d net.Dialer
				return d.DialContext(ctx, "tcp", addr)
			}))
		if err != nil {
			t.Fatal(err)
		}
		defer cc.Close()
		probe := func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, err := csi.NewIdentityClient(cc).Probe(ctx, &csi.ProbeRequest{})
			return err
		}
		if err := probe(); err != nil {
			t.Fatalf("a call before expiry: %v", err)
		}
		time.Sleep(time.Until(expiry) + 200*time.Millisecond)
		if err := probe(); status.Code(err) != codes.Unavailable {
			t.Fatalf("a call after the broker certificate expired: %v, want Unavailable", err)
		}
		// The proxy closes the connection: the client sees it go.
		waitUntil(t, 5*time.Second, "the proxy closing the connection", func() bool {
			s := cc.GetState()
			return s != connectivity.Ready
		})
		// Expiry is what the broker's routine renewal looks like: said
		// at INFO, no warning.
		waitLog(t, c, "INFO", "expired")
		for _, line := range strings.Split(c.Logs.String(), "\n") {
			if strings.Contains(line, "WARN") && strings.Contains(line, "no longer verifies") {
				t.Errorf("an expired broker certificate was warned about: %s", line)
			}
		}
	})
	t.Run("broker side", func(t *testing.T) {
		_, ep := startEcho(t)
		c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, Retry: broker.RetryConfig{MaxAttempts: 1}})
		expiry := time.Now().Add(1500 * time.Millisecond)
		spare := moveToProxyExpiring(t, c, expiry)
		client := csi.NewIdentityClient(chaintest.Dial(t, c.Front))
		call := func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, err := client.Probe(ctx, &csi.ProbeRequest{})
			return err
		}
		if err := call(); err != nil {
			t.Fatalf("a call before the proxy's certificate expired: %v", err)
		}
		time.Sleep(time.Until(expiry) + 200*time.Millisecond)
		// Idle since, the connection is not reported ready: no call
		// would be given it.
		for _, ds := range c.Broker.Status() {
			for _, ps := range ds.Proxies {
				if ps.Address == spare.Addr && ps.State == "READY" {
					t.Errorf("the connection to the proxy whose certificate expired is reported %s", ps.State)
				}
			}
		}
		err := call()
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "expired") {
			t.Fatalf("a call after the proxy's certificate expired: %v; want Unavailable from a new handshake refusing it", err)
		}
		if n := spare.Handled(); n != 1 {
			t.Errorf("the proxy with the expired certificate answered %d calls, want only the one before expiry", n)
		}
		// Expiry is what a routine renewal looks like from here: said
		// at INFO, no warning.
		waitLog(t, c, "INFO", "the certificate the proxy showed at the handshake has expired")
		for _, line := range strings.Split(c.Logs.String(), "\n") {
			if strings.Contains(line, "WARN") && strings.Contains(line, "no longer verifies") {
				t.Errorf("an expired proxy certificate was warned about: %s", line)
			}
		}
	})
}

// TestRenewalTheProxyRefusesCostsNoCall: the broker's certificate files
// are reloaded with a certificate the proxy does not accept (its issuer
// not yet in the proxy's bundle, say). The broker tries it on a new
// connection in the background, says that the proxy refused it, and keeps
// the calls on the connection made with the previous certificate: no call
// fails, even with no retries.
func TestRenewalTheProxyRefusesCostsNoCall(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep, BrokerReload: 20 * time.Millisecond,
		Retry: broker.RetryConfig{MaxAttempts: 1}})
	client := csi.NewControllerClient(chaintest.Dial(t, c.Front))
	call := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := client.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "renew"})
		return err
	}
	if err := call(); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	other, err := mtls.NewCA("an issuer the proxy does not trust yet", now.Add(-time.Hour), now.Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	cert, key, err := other.Issue(mtls.Leaf{ID: mtls.BrokerID(chaintest.TrustDomain), NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	// Both files in one swap (as a Secret volume does): key, then cert.
	if err := mtls.WriteFileAtomic(c.BrokerFiles.Key, key, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := mtls.WriteFileAtomic(c.BrokerFiles.Cert, cert, 0o600); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); c.BrokerSource.Reloads() < 1; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the broker did not reload its certificate")
		}
	}
	for i := 0; i < 30; i++ {
		if err := call(); err != nil {
			t.Fatalf("call %d after the reload: %v", i, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	waitLog(t, c, "the proxy refused a connection with the broker's reloaded certificate")
}

// waitUntil polls cond until it holds, failing the test after d.
func waitUntil(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestStreamsFollowTheProxysCertificate: streaming calls go over gRPC's
// own connection to the proxy, which must follow the proxy's certificate
// as the unary calls' connection does: once the certificate the proxy
// showed has expired, a new stream is not given the open connection (its
// new handshake fails, naming the expiry), and the proxy sees no stream.
func TestStreamsFollowTheProxysCertificate(t *testing.T) {
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: startStreamDriver(t), Retry: broker.RetryConfig{MaxAttempts: 1}})
	expiry := time.Now().Add(1500 * time.Millisecond)
	spare := moveToProxyExpiring(t, c, expiry)
	client := csi.NewSnapshotMetadataClient(chaintest.Dial(t, c.Front))
	stream := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		st, err := client.GetMetadataAllocated(ctx, &csi.GetMetadataAllocatedRequest{SnapshotId: "abc"})
		if err != nil {
			return err
		}
		_, err = st.Recv()
		return err
	}
	if err := stream(); err != nil {
		t.Fatalf("a stream before the proxy's certificate expired: %v", err)
	}
	time.Sleep(time.Until(expiry) + 200*time.Millisecond)
	err := stream()
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("a stream after the proxy's certificate expired: %v; want Unavailable from a new handshake refusing it", err)
	}
	if n := spare.Handled(); n != 1 {
		t.Errorf("the proxy with the expired certificate was given %d streams, want only the one before expiry", n)
	}
}

// moveToProxyExpiring moves the echo driver to a new proxy whose
// certificate expires at expiry.
func moveToProxyExpiring(t *testing.T, c *chaintest.Chain, expiry time.Time) *chaintest.SpareProxy {
	t.Helper()
	m, err := c.CA.IssueMaterial(mtls.Leaf{ID: mtls.DriverID(chaintest.TrustDomain, echoName), NotBefore: time.Now().Add(-time.Minute), NotAfter: expiry})
	if err != nil {
		t.Fatal(err)
	}
	spare := c.StartSpareProxy(t, m)
	moveDriver(t, c, spare.Addr)
	return spare
}
