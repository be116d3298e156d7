package broker

import (
	"fmt"
	"sync"
	"testing"

	"github.com/csibroker/csibroker/internal/mtls"
	"github.com/csibroker/csibroker/internal/rawgrpc"
)

// TestCallDescKeptForCSIMethodsOnly: the per-method values of a proxy are
// made once for the CSI services' methods, and not kept for other paths a
// front-end caller may name (which would grow without bound).
const peerTD = "test.csibroker"

func TestCallDescKeptForCSIMethodsOnly(t *testing.T) {
	b, err := New(Options{TrustDomain: peerTD, TLS: mtls.StaticSource{M: &mtls.Material{}}})
	if err != nil {
		t.Fatal(err)
	}
	p := &proxyConn{cfg: ProxyConfig{Address: "proxy-0:7443", Node: "node-0"}, driver: "peer.csi.test"}

	const probe = "/csi.v1.Identity/Probe"
	var wg sync.WaitGroup
	descs := make([]*callDesc, 8)
	for i := range descs {
		wg.Add(1)
		go func() { defer wg.Done(); descs[i] = b.desc(p, probe) }()
	}
	wg.Wait()
	for _, d := range descs[1:] {
		if d != descs[0] {
			t.Fatal("concurrent first calls got different descriptions of one method")
		}
	}
	if d := descs[0]; d.short != "Probe" || d.spanName != "broker "+probe ||
		d.metricShort != "Probe" || d.metricFull != probe {
		t.Errorf("description %+v", d)
	}
	for i := 0; i < 100; i++ {
		// Named in spans and logs, counted as _OTHER in metrics.
		if d := b.desc(p, fmt.Sprintf("/not.csi.Service/M%d", i)); d.short != fmt.Sprintf("M%d", i) ||
			d.metricShort != rawgrpc.OtherMethod || d.metricFull != rawgrpc.OtherMethod {
			t.Fatalf("description of an unknown method: %+v", d)
		}
	}
	n := 0
	p.descs.Range(func(any, any) bool { n++; return true })
	if n != 1 {
		t.Fatalf("%d descriptions kept, want 1 (Probe's)", n)
	}
}
