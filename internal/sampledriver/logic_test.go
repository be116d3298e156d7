package sampledriver

import (
	"errors"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

func mountCap(m csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: m},
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
	}
}

func TestCheckCapability(t *testing.T) {
	for _, tc := range []struct {
		name string
		cap  *csi.VolumeCapability
		ok   bool
	}{
		{"nil", nil, false},
		{"mount single writer", mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER), true},
		{"mount multi writer", mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER), true},
		{"mount single node single writer", mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER), true},
		{"unknown mode", mountCap(csi.VolumeCapability_AccessMode_UNKNOWN), false},
		{"undefined mode", mountCap(99), false},
		{"no access mode", &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}}}, false},
		{"no access type", &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}, false},
		{"block", &csi.VolumeCapability{
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
			AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := checkCapability(tc.cap)
			if (err == nil) != tc.ok {
				t.Fatalf("checkCapability = %v, want ok=%v", err, tc.ok)
			}
			if err != nil && !errors.Is(err, errInvalid) {
				t.Fatalf("error %v is not errInvalid", err)
			}
		})
	}
	if err := checkCapabilities(nil); !errors.Is(err, errInvalid) {
		t.Errorf("checkCapabilities(nil) = %v, want errInvalid", err)
	}
}

func TestPickSize(t *testing.T) {
	const gi = int64(1) << 30
	for _, tc := range []struct {
		name    string
		cr      *csi.CapacityRange
		min     int64
		want    int64
		wantErr error
	}{
		{"no range: default", nil, 0, DefaultVolumeSize, nil},
		{"required", &csi.CapacityRange{RequiredBytes: 5 * gi}, 0, 5 * gi, nil},
		{"required equals limit", &csi.CapacityRange{RequiredBytes: 5 * gi, LimitBytes: 5 * gi}, 0, 5 * gi, nil},
		{"limit below default", &csi.CapacityRange{LimitBytes: 1 << 20}, 0, 1 << 20, nil},
		{"limit above default", &csi.CapacityRange{LimitBytes: 10 * gi}, 0, DefaultVolumeSize, nil},
		{"required above limit", &csi.CapacityRange{RequiredBytes: 2 * gi, LimitBytes: gi}, 0, 0, errInvalid},
		{"negative", &csi.CapacityRange{RequiredBytes: -1}, 0, 0, errInvalid},
		{"clone defaults to the source size", nil, 3 * gi, 3 * gi, nil},
		{"small clone source", nil, 1 << 20, 1 << 20, nil},
		{"clone with a bigger size", &csi.CapacityRange{RequiredBytes: 5 * gi}, 3 * gi, 5 * gi, nil},
		{"clone source above limit", &csi.CapacityRange{LimitBytes: 2 * gi}, 3 * gi, 0, errOutOfRange},
		{"required below clone source", &csi.CapacityRange{RequiredBytes: gi}, 3 * gi, 0, errOutOfRange},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := pickSize(tc.cr, tc.min)
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("pickSize = %d, %v; want error %v", got, err, tc.wantErr)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("pickSize = %d, %v; want %d", got, err, tc.want)
			}
		})
	}
}

func TestSizeFits(t *testing.T) {
	for _, tc := range []struct {
		size int64
		cr   *csi.CapacityRange
		want bool
	}{
		{10, nil, true},
		{10, &csi.CapacityRange{RequiredBytes: 10}, true},
		{10, &csi.CapacityRange{RequiredBytes: 11}, false},
		{10, &csi.CapacityRange{LimitBytes: 9}, false},
		{10, &csi.CapacityRange{RequiredBytes: 5, LimitBytes: 10}, true},
	} {
		if got := sizeFits(tc.size, tc.cr); got != tc.want {
			t.Errorf("sizeFits(%d, %v) = %v, want %v", tc.size, tc.cr, got, tc.want)
		}
	}
}

func TestTopologyAllows(t *testing.T) {
	zone := "topology.kubernetes.io/zone"
	ours := map[string]string{zone: "z1", "rack": "r1"}
	topo := func(kv ...string) *csi.Topology {
		m := map[string]string{}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return &csi.Topology{Segments: m}
	}
	for _, tc := range []struct {
		name string
		ours map[string]string
		req  *csi.TopologyRequirement
		want bool
	}{
		{"no requirement", ours, nil, true},
		{"driver without topology", nil, &csi.TopologyRequirement{Requisite: []*csi.Topology{topo(zone, "z2")}}, true},
		{"requisite matches", ours, &csi.TopologyRequirement{Requisite: []*csi.Topology{topo(zone, "z2"), topo(zone, "z1")}}, true},
		{"requisite subset of our keys", ours, &csi.TopologyRequirement{Requisite: []*csi.Topology{topo("rack", "r1")}}, true},
		{"requisite excludes us", ours, &csi.TopologyRequirement{Requisite: []*csi.Topology{topo(zone, "z2")}}, false},
		{"requisite with a key we lack", ours, &csi.TopologyRequirement{Requisite: []*csi.Topology{topo(zone, "z1", "region", "r")}}, false},
		{"preferred only", ours, &csi.TopologyRequirement{Preferred: []*csi.Topology{topo(zone, "z2")}}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := topologyAllows(tc.ours, tc.req); got != tc.want {
				t.Fatalf("topologyAllows = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestCheckMutableParameters(t *testing.T) {
	for _, tc := range []struct {
		p  map[string]string
		ok bool
	}{
		{nil, true},
		{map[string]string{MutableIOPS: "3000", MutableTier: "premium"}, true},
		{map[string]string{MutableIOPS: "0"}, false},
		{map[string]string{MutableIOPS: "many"}, false},
		{map[string]string{MutableTier: "gold"}, false},
		{map[string]string{"XXX_FakeKey": "x"}, false},
	} {
		if err := checkMutableParameters(tc.p); (err == nil) != tc.ok {
			t.Errorf("checkMutableParameters(%v) = %v, want ok=%v", tc.p, err, tc.ok)
		}
	}
}

func TestPage(t *testing.T) {
	keys := []string{"a", "b", "c", "d", "e"}
	var got []string
	tok := ""
	for i := 0; ; i++ {
		page, next, err := page(keys, tok, 2)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, page...)
		if next == "" {
			break
		}
		if i > 5 {
			t.Fatal("paging does not end")
		}
		tok = next
	}
	if len(got) != len(keys) {
		t.Fatalf("paged %v, want %v", got, keys)
	}
	// A token stays valid when its key is deleted.
	_, next, _ := page(keys, "", 2) // next resumes at "c"
	rest, _, err := page([]string{"a", "b", "d", "e"}, next, 0)
	if err != nil || len(rest) != 2 || rest[0] != "d" {
		t.Fatalf("after deleting the token's key: %v, %v", rest, err)
	}
	for _, bad := range []string{"invalid-token", "sd1.", "sd1.!!", "x"} {
		if _, _, err := page(keys, bad, 0); !errors.Is(err, errBadToken) {
			t.Errorf("page(%q) error = %v, want errBadToken", bad, err)
		}
	}
	if _, _, err := page(keys, "", -1); !errors.Is(err, errInvalid) {
		t.Errorf("negative max: %v", err)
	}
	if st := toStatus(errBadToken); codeOf(st) != codes.Aborted {
		t.Errorf("bad token maps to %v, want Aborted", codeOf(st))
	}
}

func TestParseFault(t *testing.T) {
	for _, tc := range []struct {
		spec    string
		method  string
		want    Fault
		wantErr bool
	}{
		{"CreateVolume=latency:50ms,rate:0.5,code:Unavailable", "CreateVolume",
			Fault{Latency: 50 * time.Millisecond, Rate: 0.5, Code: codes.Unavailable}, false},
		{"NodePublishVolume=first:2,code:INTERNAL", "NodePublishVolume", Fault{First: 2, Code: codes.Internal}, false},
		{"DeleteVolume=code:resource_exhausted", "DeleteVolume", Fault{Rate: 1, Code: codes.ResourceExhausted}, false},
		{"DeleteVolume=after,code:4", "DeleteVolume", Fault{Rate: 1, After: true, Code: codes.DeadlineExceeded}, false},
		{"CreateVolume=exit-after:3", "CreateVolume", Fault{ExitAfter: 3, Code: codes.Unavailable}, false},
		{"*=latency:5ms", "*", Fault{Latency: 5 * time.Millisecond, Code: codes.Unavailable}, false},
		{"Probe=rate:1", "Probe", Fault{Rate: 1, Code: codes.Unavailable}, false},
		{"Probe=rate:0,code:Internal", "Probe", Fault{Code: codes.Internal}, false},
		{"NodeStageVolume=first:0,code:Internal", "NodeStageVolume", Fault{Code: codes.Internal}, false},
		{"DeleteVolume=after", "DeleteVolume", Fault{Rate: 1, After: true, Code: codes.Unavailable}, false},
		{"DeleteVolume=after,rate:0", "DeleteVolume", Fault{After: true, Code: codes.Unavailable}, false},
		{"CreateVolume=rate:NaN", "", Fault{}, true},
		{"CreateVolum=rate:1", "", Fault{}, true},
		{"CreateVolume", "", Fault{}, true},
		{"CreateVolume=rate:2", "", Fault{}, true},
		{"CreateVolume=code:Nope", "", Fault{}, true},
		{"CreateVolume=code:OK", "", Fault{}, true},
		{"CreateVolume=latency:soon", "", Fault{}, true},
		{"CreateVolume=color:red", "", Fault{}, true},
	} {
		t.Run(tc.spec, func(t *testing.T) {
			m, f, err := ParseFault(tc.spec)
			if tc.wantErr {
				if err == nil {
					t.Fatalf("ParseFault = %s %+v, want error", m, f)
				}
				return
			}
			if err != nil || m != tc.method || f != tc.want {
				t.Fatalf("ParseFault = %q %+v %v, want %q %+v", m, f, err, tc.method, tc.want)
			}
			// Formatting and parsing again gives the same fault.
			m2, f2, err := ParseFault(FormatFault(m, f))
			if err != nil || m2 != m || f2 != f {
				t.Fatalf("round trip of %q: %q %+v %v", FormatFault(m, f), m2, f2, err)
			}
		})
	}
	var fs Faults
	for _, s := range []string{"CreateVolume=rate:1", "DeleteVolume=latency:1s", "CreateVolume=first:1"} {
		if err := fs.Set(s); err != nil {
			t.Fatal(err)
		}
	}
	if len(fs.Methods) != 2 || fs.Methods["CreateVolume"].First != 1 {
		t.Fatalf("Faults.Set: %+v", fs.Methods)
	}
	if got := fs.String(); got != "CreateVolume=first:1,code:Unavailable DeleteVolume=latency:1s" {
		t.Fatalf("Faults.String() = %q", got)
	}
}

func TestParseSize(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
		ok   bool
	}{
		{"0", 0, true},
		{"1024", 1024, true},
		{"100Gi", 100 << 30, true},
		{"1Ti", 1 << 40, true},
		{"5k", 5000, true},
		{"2G", 2e9, true},
		{"", 0, false},
		{"Gi", 0, false},
		{"1.5Gi", 0, false},
		{"-1", 0, false},
		{"1Xi", 0, false},
		{"99999999999Pi", 0, false},
	} {
		got, err := ParseSize(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

func TestParseTopology(t *testing.T) {
	m, err := ParseTopology("topology.kubernetes.io/zone=z1, rack=r2")
	if err != nil || len(m) != 2 || m["topology.kubernetes.io/zone"] != "z1" || m["rack"] != "r2" {
		t.Fatalf("ParseTopology = %v, %v", m, err)
	}
	if got := FormatTopology(m); got != "rack=r2,topology.kubernetes.io/zone=z1" {
		t.Fatalf("FormatTopology = %q", got)
	}
	if m, err := ParseTopology(""); err != nil || m != nil {
		t.Fatalf("empty: %v, %v", m, err)
	}
	for _, bad := range []string{"zone", "=z1", "a=1,a=2"} {
		if _, err := ParseTopology(bad); err == nil {
			t.Errorf("ParseTopology(%q): want error", bad)
		}
	}
}

func TestSocketPath(t *testing.T) {
	for _, tc := range []struct {
		in, want string
	}{
		{"unix:///run/csi/csi.sock", "/run/csi/csi.sock"},
		{"unix:/run/csi.sock", "/run/csi.sock"},
		{"/run/csi.sock", "/run/csi.sock"},
		{"unix://relative.sock", ""},
		{"tcp://127.0.0.1:1", ""},
		{"unix:///" + string(make([]byte, 120)), ""},
	} {
		got, err := SocketPath(tc.in)
		if (tc.want == "") != (err != nil) || got != tc.want {
			t.Errorf("SocketPath(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	ok := Config{NodeID: "n1", StateDir: "/tmp/x"}
	for _, tc := range []struct {
		name string
		mod  func(*Config)
		ok   bool
	}{
		{"minimal", func(*Config) {}, true},
		{"full", func(c *Config) {
			c.Name = "sample.example.com"
			c.Endpoint = "unix:///tmp/x.sock"
			c.Topology = map[string]string{"topology.kubernetes.io/zone": "z1"}
			c.CapacityBytes = 1 << 30
			c.MaxVolumesPerNode = 3
			c.Nodes = []string{"n2", "*"}
			c.Faults = Faults{Methods: map[string]Fault{"CreateVolume": {Rate: 0.5, Code: codes.Unavailable}}, ExitAfter: 3}
		}, true},
		{"no node", func(c *Config) { c.NodeID = "" }, false},
		{"no state dir", func(c *Config) { c.StateDir = "" }, false},
		{"bad name", func(c *Config) { c.Name = "-bad" }, false},
		{"name ending in digit", func(c *Config) { c.Name = "driver1" }, false},
		{"bad endpoint", func(c *Config) { c.Endpoint = "tcp://x" }, false},
		{"bad topology", func(c *Config) { c.Topology = map[string]string{"": "z"} }, false},
		{"negative capacity", func(c *Config) { c.CapacityBytes = -1 }, false},
		{"negative max volumes", func(c *Config) { c.MaxVolumesPerNode = -1 }, false},
		{"empty node in nodes", func(c *Config) { c.Nodes = []string{""} }, false},
		{"fault for unknown method", func(c *Config) { c.Faults.Methods = map[string]Fault{"Nope": {}} }, false},
		{"fault rate above 1", func(c *Config) {
			c.Faults.Methods = map[string]Fault{"Probe": {Rate: 1.5, Code: codes.Internal}}
		}, false},
		{"fault without a code fails with Unavailable", func(c *Config) { c.Faults.Methods = map[string]Fault{"Probe": {Rate: 1}} }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := ok
			tc.mod(&c)
			if err := c.Validate(); (err == nil) != tc.ok {
				t.Fatalf("Validate = %v, want ok=%v", err, tc.ok)
			}
		})
	}
}

func TestParseMountInfoLine(t *testing.T) {
	line := `36 35 98:0 /vol\040dir /mnt/with\040space rw,noatime master:1 - ext3 /dev/root rw,errors=continue`
	m, err := parseMountInfoLine(line)
	if err != nil {
		t.Fatal(err)
	}
	if m.MountPoint != "/mnt/with space" || m.Root != "/vol dir" || m.readonly() {
		t.Fatalf("parsed %+v", m)
	}
	m, err = parseMountInfoLine(`40 35 0:21 / /ro ro,relatime shared:5 - tmpfs tmpfs ro`)
	if err != nil || !m.readonly() {
		t.Fatalf("parsed %+v, %v", m, err)
	}
	if _, err := parseMountInfoLine("short line"); err == nil {
		t.Fatal("want error for a short line")
	}
	if got := unescapeMountPath(`a\134b\011c\`); got != "a\\b\tc\\" {
		t.Fatalf("unescape = %q", got)
	}
}
