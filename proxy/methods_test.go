package proxy

import (
	"crypto/tls"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/csibroker/csibroker/internal/rawgrpc"
)

// TestMethodInfoKeptForKnownMethodsOnly: the per-method record is made once
// for methods the protobuf registry knows; any other path (the broker
// forwards whatever /csi.* path its callers name) shares the "_OTHER"
// series and is not kept.
func TestMethodInfoKeptForKnownMethodsOnly(t *testing.T) {
	p, err := New(Config{DriverEndpoint: "unix://" + filepath.Join(t.TempDir(), "none.sock"), TLS: &tls.Config{}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	const probe = "/csi.v1.Identity/Probe"
	if mi := p.methodInfo(probe); mi.typ != "unary" || mi.service != "csi.v1.Identity" || mi.name != "Probe" {
		t.Errorf("Probe: %+v", mi)
	}
	if mi := p.methodInfo(probe); mi != p.methodInfo(probe) {
		t.Error("Probe's record is made again on every call")
	}
	if mi := p.methodInfo(infoMethod); mi.typ != "unary" || mi.name != "GetInfo" {
		t.Errorf("the info method: %+v", mi)
	}
	other := p.methodInfo("/csi.v9.Future/M0")
	for i := range 100 {
		mi := p.methodInfo(fmt.Sprintf("/csi.v9.Future/M%d", i))
		if mi.service != rawgrpc.OtherMethod || mi.name != rawgrpc.OtherMethod || mi.started != other.started || len(mi.spanOpts) == 0 {
			t.Fatalf("unknown method %d: %+v", i, mi)
		}
	}
	for _, path := range []string{"csi.v1.Identity/Probe", "/", "", "/csi.v1.Identity"} {
		if mi := p.methodInfo(path); mi.name != rawgrpc.OtherMethod {
			t.Errorf("malformed path %q: named %q", path, mi.name)
		}
	}
	n := 0
	p.methods.Range(func(any, any) bool { n++; return true })
	if n != 2 {
		t.Errorf("%d method records kept, want 2 (Probe's and GetInfo's)", n)
	}
}
