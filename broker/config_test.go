package broker

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestLoadRegistryConfigExample(t *testing.T) {
	rc, err := LoadRegistryConfig("../deploy/examples/registry.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if len(rc.Drivers) != 2 || rc.Drivers[0].MethodTimeouts["CreateVolume"] != 2*time.Minute || !rc.Drivers[1].NodeLocal {
		t.Fatalf("parsed %+v", rc)
	}
}

func TestLoadRegistryConfigErrors(t *testing.T) {
	cases := []struct{ name, yaml, want string }{
		{"unknown field", "drivers:\n  - name: a\n    controler: {address: \"x:1\"}\n", "field controler not found"},
		{"no proxy", "drivers:\n  - name: a\n", `driver "a": needs a controller proxy or at least one node proxy`},
		{"no name", "drivers:\n  - controller: {address: \"x:1\"}\n", "name is required"},
		{"duplicate driver", "drivers:\n  - {name: a, controller: {address: \"x:1\"}}\n  - {name: a, controller: {address: \"y:1\"}}\n", `driver "a" listed twice`},
		{"duplicate node", "drivers:\n  - name: a\n    nodes: [{node: n, address: \"x:1\"}, {node: n, address: \"y:1\"}]\n", `node "n" listed twice`},
		{"bad duration", "drivers:\n  - name: a\n    controller: {address: \"x:1\"}\n    timeout: soon\n", "soon"},
		{"negative method timeout", "drivers:\n  - name: a\n    controller: {address: \"x:1\"}\n    methodTimeouts: {CreateVolume: -1s}\n", "methodTimeouts[CreateVolume] must be positive"},
		{"controller address without a port", "drivers:\n  - name: a\n    controller: {address: 127.0.0.1}\n", `controller.address: "127.0.0.1": want host:port`},
		{"node address without a port", "drivers:\n  - name: a\n    nodes: [{node: n, address: proxy.local}]\n", `nodes[0].address: "proxy.local": want host:port`},
		{"slash in name", "drivers:\n  - name: a/b\n    controller: {address: \"x:1\"}\n", `driver name "a/b" has '/' at 1; CSI allows letters, digits, '-' and '.' only`},
		{"underscore in name", "drivers:\n  - name: my_driver\n    controller: {address: \"x:1\"}\n", `driver name "my_driver" has '_'`},
		{"name too long", "drivers:\n  - name: " + strings.Repeat("d", 64) + "\n    controller: {address: \"x:1\"}\n", "CSI allows at most 63"},
		{"unknown method timeout", "drivers:\n  - name: a\n    controller: {address: \"x:1\"}\n    methodTimeouts: {createVolume: 2m}\n", "methodTimeouts[createVolume]: not the name of a CSI method"},
		{"backoff start above its max", "drivers:\n  - name: a\n    controller: {address: \"x:1\"}\n    retry: {intervalStart: 5s, intervalMax: 1s}\n", "retry.intervalStart 5s is above retry.intervalMax 1s"},
		{"empty file", "", `is empty: list the drivers under "drivers:"`},
		{"comments only", "# nothing yet\n", `is empty`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "r.yaml")
			if err := os.WriteFile(p, []byte(c.yaml), 0o644); err != nil {
				t.Fatal(err)
			}
			_, err := LoadRegistryConfig(p)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want it to contain %q", err, c.want)
			}
			if !strings.Contains(err.Error(), p) {
				t.Fatalf("err = %v does not say which file", err)
			}
		})
	}
}

func TestRoute(t *testing.T) {
	mk := func(ctrl bool, nodes []string, nodeLocal bool) *Driver {
		d := &Driver{name: "d", nodes: map[string]*proxyConn{}, cfg: DriverConfig{NodeLocal: nodeLocal}}
		if ctrl {
			d.controller = &proxyConn{cfg: ProxyConfig{Address: "ctrl"}}
		}
		for _, n := range nodes {
			d.nodes[n] = &proxyConn{cfg: ProxyConfig{Address: "addr-" + n, Node: n}}
		}
		d.nodesSet()
		return d
	}
	cases := []struct {
		name    string
		d       *Driver
		method  string
		node    string
		want    string // proxy address, or "" for an error
		wantErr string
	}{
		{"controller call", mk(true, []string{"n1", "n2"}, false), "/csi.v1.Controller/CreateVolume", "", "ctrl", ""},
		{"identity call", mk(true, nil, false), "/csi.v1.Identity/Probe", "", "ctrl", ""},
		{"node call to named node", mk(true, []string{"n1", "n2"}, false), "/csi.v1.Node/NodePublishVolume", "n2", "addr-n2", ""},
		{"node call, one node proxy", mk(true, []string{"n1"}, false), "/csi.v1.Node/NodeGetInfo", "", "addr-n1", ""},
		{"node call, controller serves node too", mk(true, nil, false), "/csi.v1.Node/NodeGetInfo", "", "ctrl", ""},
		{"node call, ambiguous", mk(true, []string{"n1", "n2"}, false), "/csi.v1.Node/NodeGetInfo", "", "", "must name one of nodes [n1 n2]"},
		{"node call, unknown node", mk(true, []string{"n1"}, false), "/csi.v1.Node/NodeGetInfo", "n9", "", `no node proxy registered for node "n9"`},
		{"node-local create to node", mk(false, []string{"n1", "n2"}, true), "/csi.v1.Controller/CreateVolume", "n1", "addr-n1", ""},
		{"node-local create needs node", mk(false, []string{"n1", "n2"}, true), "/csi.v1.Controller/CreateVolume", "", "", "must name one of nodes"},
		{"node-local publish goes to controller", mk(true, []string{"n1"}, true), "/csi.v1.Controller/ControllerPublishVolume", "", "ctrl", ""},
		{"no controller", mk(false, []string{"n1", "n2"}, false), "/csi.v1.Controller/ListVolumes", "", "", "needs a controller proxy"},
		// A controller proxy missing for a while (its pod restarting) does
		// not send controller calls to a node plugin, which knows nothing
		// of publications.
		{"no controller, one node proxy", mk(false, []string{"n1"}, false), "/csi.v1.Controller/ControllerUnpublishVolume", "", "", "needs a controller proxy"},
		{"node-local, no controller, one node proxy", mk(false, []string{"n1"}, true), "/csi.v1.Controller/ControllerGetCapabilities", "", "addr-n1", ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			pc, err := c.d.route(c.method, c.node)
			if c.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("err = %v, want %q", err, c.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if pc.cfg.Address != c.want {
				t.Fatalf("routed to %s, want %s", pc.cfg.Address, c.want)
			}
		})
	}
}
