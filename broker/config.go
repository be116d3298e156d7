package broker

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"go.yaml.in/yaml/v3"

	"github.com/csibroker/csibroker/internal/csiname"
)

// RegistryConfig is the static driver registry file of a standalone broker.
//
//	drivers:
//	  - name: sample.csi.example.org
//	    controller: {address: 127.0.0.1:7001}
//	    nodes:
//	      - {node: node-1, address: 10.0.0.5:7002}
//	    timeout: 30s
//	    methodTimeouts: {CreateVolume: 2m}
//	    retry: {maxAttempts: 4, intervalStart: 100ms, intervalMax: 2s}
type RegistryConfig struct {
	Drivers []DriverConfig `yaml:"drivers"`
}

// DriverConfig says where one driver's proxies are and how to call it.
type DriverConfig struct {
	Name       string        `yaml:"name"`
	Controller *ProxyConfig  `yaml:"controller,omitempty"`
	Nodes      []ProxyConfig `yaml:"nodes,omitempty"`
	// NodeLocal drivers keep volumes on one node: CreateVolume, DeleteVolume
	// and GetCapacity go to the proxy of the selected node.
	NodeLocal bool `yaml:"nodeLocal,omitempty"`
	// Timeout bounds each CSI call (all its retries included) unless
	// MethodTimeouts names the method.
	Timeout        time.Duration            `yaml:"timeout,omitempty"`
	MethodTimeouts map[string]time.Duration `yaml:"methodTimeouts,omitempty"`
	Retry          RetryConfig              `yaml:"retry,omitempty"`
}

// ProxyConfig is one proxy of a driver.
type ProxyConfig struct {
	Address string `yaml:"address"`
	Node    string `yaml:"node,omitempty"`
}

// RetryConfig bounds the retries of one call. Only transport failures and
// Unavailable are retried, never ResourceExhausted or a client stream.
type RetryConfig struct {
	// MaxAttempts counts the first attempt; 1 disables retries.
	MaxAttempts   int           `yaml:"maxAttempts,omitempty"`
	IntervalStart time.Duration `yaml:"intervalStart,omitempty"`
	IntervalMax   time.Duration `yaml:"intervalMax,omitempty"`
}

// Defaults used where a DriverConfig leaves a value unset.
const (
	DefaultTimeout       = 30 * time.Second
	DefaultMaxAttempts   = 4
	DefaultIntervalStart = 100 * time.Millisecond
	DefaultIntervalMax   = 2 * time.Second
)

// withDefaults returns c with unset values filled.
func (c DriverConfig) withDefaults() DriverConfig {
	if c.Timeout <= 0 {
		c.Timeout = DefaultTimeout
	}
	if c.Retry.MaxAttempts <= 0 {
		c.Retry.MaxAttempts = DefaultMaxAttempts
	}
	c.Retry = c.Retry.Fill(RetryConfig{IntervalStart: DefaultIntervalStart, IntervalMax: DefaultIntervalMax})
	return c
}

// Fill returns r with its unset intervals taken from def, so that an entry
// that sets one only is never left with a start above its max: a start set
// above def's max raises the max to it; a max set below def's start lowers
// the start to it.
func (r RetryConfig) Fill(def RetryConfig) RetryConfig {
	startSet, maxSet := r.IntervalStart > 0, r.IntervalMax > 0
	if !startSet {
		r.IntervalStart = def.IntervalStart
		if maxSet {
			r.IntervalStart = min(r.IntervalStart, r.IntervalMax)
		}
	}
	if !maxSet {
		r.IntervalMax = def.IntervalMax
		if startSet {
			r.IntervalMax = max(r.IntervalMax, r.IntervalStart)
		}
	}
	return r
}

// checkAddress refuses a proxy address that is not host:port (a missing
// port would only show at every dial).
func checkAddress(addr string) error {
	if addr == "" {
		return errors.New("required")
	}
	if _, port, err := net.SplitHostPort(addr); err != nil || port == "" {
		return fmt.Errorf("%q: want host:port", addr)
	}
	return nil
}

// Validate reports what is wrong with one driver's configuration.
func (c DriverConfig) Validate() error {
	var errs []error
	if c.Name == "" {
		errs = append(errs, errors.New("name is required"))
	} else if err := csiname.Check(c.Name); err != nil {
		// The name the driver answers GetPluginInfo with, which a
		// StorageClass's provisioner and the proxy's identity repeat.
		errs = append(errs, err)
	}
	if c.Controller == nil && len(c.Nodes) == 0 {
		errs = append(errs, errors.New("needs a controller proxy or at least one node proxy"))
	}
	if c.Controller != nil {
		if err := checkAddress(c.Controller.Address); err != nil {
			errs = append(errs, fmt.Errorf("controller.address: %w", err))
		}
	}
	seen := map[string]bool{}
	for i, n := range c.Nodes {
		if n.Node == "" || n.Address == "" {
			errs = append(errs, fmt.Errorf("nodes[%d]: node and address are required", i))
		} else if err := checkAddress(n.Address); err != nil {
			errs = append(errs, fmt.Errorf("nodes[%d].address: %w", i, err))
		}
		if seen[n.Node] {
			errs = append(errs, fmt.Errorf("nodes[%d]: node %q listed twice", i, n.Node))
		}
		seen[n.Node] = true
	}
	if c.Retry.MaxAttempts < 0 || c.Retry.IntervalStart < 0 || c.Retry.IntervalMax < 0 || c.Timeout < 0 {
		errs = append(errs, errors.New("timeouts and retry values must not be negative"))
	}
	if c.Retry.IntervalStart > 0 && c.Retry.IntervalMax > 0 && c.Retry.IntervalStart > c.Retry.IntervalMax {
		errs = append(errs, fmt.Errorf("retry.intervalStart %v is above retry.intervalMax %v", c.Retry.IntervalStart, c.Retry.IntervalMax))
	}
	for m, d := range c.MethodTimeouts {
		if d <= 0 {
			errs = append(errs, fmt.Errorf("methodTimeouts[%s] must be positive", m))
		}
		if !csiMethodNames()[m] {
			errs = append(errs, fmt.Errorf("methodTimeouts[%s]: not the name of a CSI method (such as CreateVolume), so it would apply to nothing", m))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("driver %q: %w", c.Name, err)
	}
	return nil
}

// LoadRegistryConfig reads and validates a registry file.
func LoadRegistryConfig(path string) (*RegistryConfig, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("driver registry: %w", err)
	}
	return ParseRegistryConfig(b, path)
}

// ParseRegistryConfig parses and validates a registry file's contents;
// source names it in errors.
func ParseRegistryConfig(data []byte, source string) (*RegistryConfig, error) {
	var rc RegistryConfig
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&rc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("driver registry %s is empty: list the drivers under \"drivers:\" (write \"drivers: []\" for none)", source)
		}
		return nil, fmt.Errorf("driver registry %s: %w", source, err)
	}
	seen := map[string]bool{}
	for _, d := range rc.Drivers {
		if err := d.Validate(); err != nil {
			return nil, fmt.Errorf("driver registry %s: %w", source, err)
		}
		if seen[d.Name] {
			return nil, fmt.Errorf("driver registry %s: driver %q listed twice", source, d.Name)
		}
		seen[d.Name] = true
	}
	return &rc, nil
}

// csiMethodNames are the methods of every CSI service, by name
// ("CreateVolume"), as methodTimeouts keys name them.
var csiMethodNames = sync.OnceValue(func() map[string]bool {
	out := map[string]bool{}
	svcs := csi.File_csi_proto.Services()
	for i := 0; i < svcs.Len(); i++ {
		ms := svcs.Get(i).Methods()
		for j := 0; j < ms.Len(); j++ {
			out[string(ms.Get(j).Name())] = true
		}
	}
	return out
})
