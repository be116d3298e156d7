package chain

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/mtls"
	proxyinfov1 "github.com/csibroker/csibroker/proto/proxyinfo/v1"
)

// brokerConn dials the chain's proxy directly with a broker certificate.
func brokerConn(t *testing.T, c *chaintest.Chain) *grpc.ClientConn {
	t.Helper()
	now := time.Now()
	m, err := c.CA.IssueMaterial(mtls.Leaf{ID: mtls.BrokerID(chaintest.TrustDomain), NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient("passthrough:///"+c.ProxyAddr, grpc.WithTransportCredentials(credentials.NewTLS(
		mtls.ClientConfig(mtls.StaticSource{M: m}, mtls.AuthorizeOneOf(mtls.DriverID(chaintest.TrustDomain, echoName))))))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func TestProxyInfoHealthAndScope(t *testing.T) {
	e, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	conn := brokerConn(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	info, err := proxyinfov1.NewProxyInfoClient(conn).GetInfo(ctx, &proxyinfov1.GetInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.GetDriverName() != echoName || info.GetDriverVersion() != "1" || !info.GetDriverReady() || info.GetProxyVersion() != "test" ||
		info.GetIdentity() != mtls.DriverID(chaintest.TrustDomain, echoName) {
		t.Fatalf("info = %v", info)
	}
	// The driver upgraded in place: the info follows it.
	v2 := "2"
	e.version.Store(&v2)
	if info, err := proxyinfov1.NewProxyInfoClient(conn).GetInfo(ctx, &proxyinfov1.GetInfoRequest{}); err != nil || info.GetDriverVersion() != "2" {
		t.Fatalf("info after the driver's upgrade: %v, %v; want driver version 2", info, err)
	}

	// Only CSI services are forwarded.
	err = conn.Invoke(ctx, "/grpc.health.v1.Health/Check", &csi.ProbeRequest{}, &csi.ProbeResponse{})
	if status.Code(err) != codes.Unimplemented || !strings.Contains(err.Error(), "not a CSI method") {
		t.Fatalf("non-CSI method: %v", err)
	}
	// A CSI method the driver does not implement: the driver's own answer.
	_, err = csi.NewNodeClient(conn).NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if status.Code(err) != codes.Unimplemented || strings.Contains(err.Error(), "csibroker") {
		t.Fatalf("driver's Unimplemented changed: %v", err)
	}

	h := c.Proxy.HTTPHandler("/metrics")
	get := func(path string) (int, string) {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
		return rec.Code, rec.Body.String()
	}
	if code, _ := get("/healthz"); code != 200 {
		t.Fatalf("/healthz = %d", code)
	}
	if code, body := get("/readyz"); code != 200 {
		t.Fatalf("/readyz = %d %s", code, body)
	}
}

func TestProxyNotReadyWhenDriverGone(t *testing.T) {
	dir := chaintest.ShortTempDir(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: "unix://" + dir + "/missing.sock", Retry: broker.RetryConfig{MaxAttempts: 1}})
	rec := httptest.NewRecorder()
	c.Proxy.HTTPHandler("").ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
	if rec.Code != http.StatusServiceUnavailable || !strings.Contains(rec.Body.String(), "missing.sock") {
		t.Fatalf("/readyz = %d %q", rec.Code, rec.Body.String())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	client := csi.NewIdentityClient(chaintest.Dial(t, c.Front))
	for i := 0; i < 3; i++ {
		_, err := client.Probe(ctx, &csi.ProbeRequest{})
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "csibroker proxy: driver at") {
			t.Fatalf("probe %d with the driver gone: %v", i, err)
		}
	}
	// The proxy says so in its log: at start, and once when calls start
	// failing, not at every call.
	logs := c.Logs.String()
	if n := strings.Count(logs, "the driver's socket is not there yet"); n != 1 {
		t.Errorf("start-up warning logged %d times, want once:\n%s", n, logs)
	}
	if n := strings.Count(logs, "cannot reach the driver's socket"); n != 1 {
		t.Errorf("unreachable driver logged %d times over three calls, want once:\n%s", n, logs)
	}
}

// TestTCPFrontEnd: the shared mTLS front end routes by the driver named in
// metadata, refuses a call that names none or an unknown driver, and refuses
// a driver's certificate as a caller.
func TestTCPFrontEnd(t *testing.T) {
	_, ep := startEcho(t)
	c := chaintest.Start(t, chaintest.Options{Driver: echoName, DriverEndpoint: ep})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	srvMat, err := c.CA.IssueMaterial(mtls.Leaf{ID: mtls.BrokerID(chaintest.TrustDomain), NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	authz := mtls.AuthorizeFrontEndCaller(chaintest.TrustDomain)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.Broker.ServeTCP(ctx, lis, mtls.ServerConfig(mtls.StaticSource{M: srvMat}, authz))
	}()
	t.Cleanup(func() { cancel(); <-done })

	dialUntil := func(id string, notAfter time.Time) *grpc.ClientConn {
		m, err := c.CA.IssueMaterial(mtls.Leaf{ID: id, NotBefore: now.Add(-time.Minute), NotAfter: notAfter})
		if err != nil {
			t.Fatal(err)
		}
		conn, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), grpc.WithTransportCredentials(credentials.NewTLS(
			mtls.ClientConfig(mtls.StaticSource{M: m}, mtls.AuthorizeOneOf(mtls.BrokerID(chaintest.TrustDomain))))))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return conn
	}
	dial := func(id string) *grpc.ClientConn { return dialUntil(id, now.Add(time.Hour)) }
	cctx, ccancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer ccancel()
	// A tool with a client certificate of its own, not the broker's.
	client := mtls.ClientID(chaintest.TrustDomain, "ops-tool")
	co := dial(client)
	ident := csi.NewIdentityClient(co)

	resp, err := ident.GetPluginInfo(metadata.AppendToOutgoingContext(cctx, broker.MetadataDriver, echoName), &csi.GetPluginInfoRequest{})
	if err != nil || resp.GetName() != echoName {
		t.Fatalf("routed call: %v %v", resp, err)
	}
	_, err = ident.GetPluginInfo(cctx, &csi.GetPluginInfoRequest{})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), broker.MetadataDriver) {
		t.Fatalf("no driver named: %v", err)
	}
	_, err = ident.GetPluginInfo(metadata.AppendToOutgoingContext(cctx, broker.MetadataDriver, echoName, broker.MetadataDriver, "other.csi"), &csi.GetPluginInfoRequest{})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "given 2 times") {
		t.Fatalf("the driver named twice: %v, want InvalidArgument", err)
	}
	_, err = ident.GetPluginInfo(metadata.AppendToOutgoingContext(cctx, broker.MetadataDriver, "nope.csi"), &csi.GetPluginInfoRequest{})
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), `unknown driver "nope.csi"`) {
		t.Fatalf("unknown driver: %v", err)
	}
	_, err = csi.NewIdentityClient(dial(mtls.DriverID(chaintest.TrustDomain, "evil.csi"))).GetPluginInfo(
		metadata.AppendToOutgoingContext(cctx, broker.MetadataDriver, echoName), &csi.GetPluginInfoRequest{})
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("driver certificate as caller: %v", err)
	}
	// The broker's own identity is still admitted.
	if _, err := csi.NewIdentityClient(dial(mtls.BrokerID(chaintest.TrustDomain))).GetPluginInfo(
		metadata.AppendToOutgoingContext(cctx, broker.MetadataDriver, echoName), &csi.GetPluginInfoRequest{}); err != nil {
		t.Fatalf("broker certificate as caller: %v", err)
	}
	// The caller's identity is on the front end's span of its call.
	found := false
	for _, sp := range c.Spans.Ended() {
		for _, kv := range sp.Attributes() {
			if kv.Key == "csibroker.caller" && kv.Value.AsString() == client {
				found = true
			}
		}
	}
	if !found {
		t.Errorf("no span names the caller %s", client)
	}
	// A caller whose certificate expires while its connection is open
	// makes no call on it after that.
	expiry := time.Now().Add(1500 * time.Millisecond)
	short := csi.NewIdentityClient(dialUntil(mtls.ClientID(chaintest.TrustDomain, "short-lived"), expiry))
	if _, err := short.GetPluginInfo(metadata.AppendToOutgoingContext(cctx, broker.MetadataDriver, echoName), &csi.GetPluginInfoRequest{}); err != nil {
		t.Fatalf("a call before the caller's certificate expired: %v", err)
	}
	time.Sleep(time.Until(expiry) + 200*time.Millisecond)
	if _, err := short.GetPluginInfo(metadata.AppendToOutgoingContext(cctx, broker.MetadataDriver, echoName), &csi.GetPluginInfoRequest{}); status.Code(err) != codes.Unavailable {
		t.Fatalf("a call after the caller's certificate expired: %v, want Unavailable", err)
	}
	waitLog(t, c, "refusing new calls from a peer whose certificate has expired")
	// A client certificate reaches no proxy directly: the proxy admits the
	// broker only.
	m, err := c.CA.IssueMaterial(mtls.Leaf{ID: client, NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	pconn, err := grpc.NewClient("passthrough:///"+c.ProxyAddr, grpc.WithTransportCredentials(credentials.NewTLS(
		mtls.ClientConfig(mtls.StaticSource{M: m}, mtls.AuthorizeOneOf(mtls.DriverID(chaintest.TrustDomain, echoName))))))
	if err != nil {
		t.Fatal(err)
	}
	defer pconn.Close()
	if _, err := csi.NewIdentityClient(pconn).GetPluginInfo(cctx, &csi.GetPluginInfoRequest{}); status.Code(err) != codes.Unavailable {
		t.Fatalf("client certificate straight to the proxy: %v", err)
	}
}
