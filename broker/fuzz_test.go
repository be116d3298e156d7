package broker

import (
	"os"
	"testing"
)

// FuzzParseRegistryConfig feeds registry files to the parser: nothing may
// panic, and a file it accepts names each driver once, each with a proxy
// and a valid configuration.
func FuzzParseRegistryConfig(f *testing.F) {
	if data, err := os.ReadFile("../deploy/examples/registry.yaml"); err == nil {
		f.Add(data)
	}
	for _, s := range []string{
		"drivers: []\n",
		"drivers:\n  - {name: a, controller: {address: \"x:1\"}, timeout: 3s, methodTimeouts: {CreateVolume: 1m}}\n",
		"drivers:\n  - name: a\n    nodeLocal: true\n    nodes: [{node: n, address: \"x:1\"}]\n    retry: {maxAttempts: 2, intervalStart: 1ms, intervalMax: 1s}\n",
		"drivers:\n  - &a {name: a, controller: {address: \"x:1\"}}\n  - *a\n",
		"drivers: [{name: \"\\u0000\", controller: {address: \":\"}}]",
		"- [[[[[[[[[[",
		"",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		rc, err := ParseRegistryConfig(data, "fuzz.yaml")
		if err != nil {
			return
		}
		seen := map[string]bool{}
		for _, d := range rc.Drivers {
			if err := d.Validate(); err != nil {
				t.Fatalf("accepted a driver that does not validate: %v", err)
			}
			if seen[d.Name] {
				t.Fatalf("accepted driver %q twice", d.Name)
			}
			seen[d.Name] = true
			if d.Controller == nil && len(d.Nodes) == 0 {
				t.Fatalf("accepted driver %q without a proxy", d.Name)
			}
		}
	})
}
