package k8sbridge

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
)

// Drivers is what k8sbridge needs from the broker: connections to a driver's
// controller and node proxies (with the broker's client chain in them).
type Drivers interface {
	ControllerConn(driver string) (grpc.ClientConnInterface, error)
	NodeConn(driver, node string) (grpc.ClientConnInterface, error)
	// NodeLocal reports whether the driver's volumes live on one node, so
	// CreateVolume/DeleteVolume/GetCapacity go to the selected node's proxy.
	NodeLocal(driver string) bool
	// DriverNodes lists the nodes with a proxy of the driver.
	DriverNodes(driver string) []string
	DriverNames() []string
}

// callTimeouts is what the broker adds to Drivers: each call's own timeout
// (a driver's per-method override included).
type callTimeouts interface {
	CallTimeout(driver, method string) time.Duration
}

// callContext bounds one CSI call of method to driver: by the longer of
// --timeout and the driver's timeout for the method, so a per-method
// override (a CreateVolume of minutes) is not cut short here; the broker's
// chain applies the driver's own.
func (b *Bridge) callContext(ctx context.Context, driver, method string) (context.Context, context.CancelFunc) {
	t := b.cfg.Timeout
	if ct, ok := b.cfg.Drivers.(callTimeouts); ok {
		t = max(t, ct.CallTimeout(driver, method))
	}
	return context.WithTimeout(ctx, t)
}

// driverCaps are the capabilities provisioning needs, learned from the driver.
type driverCaps struct {
	createDelete          bool
	clone                 bool
	snapshot              bool // CREATE_DELETE_SNAPSHOT: it restores its snapshots
	singleNodeMultiWriter bool
	publishUnpublish      bool
	publishReadonly       bool // PUBLISH_READONLY: ControllerPublish may be asked for read-only
	expand                bool
	getCapacity           bool
	listPublishedNodes    bool // LIST_VOLUMES with LIST_VOLUMES_PUBLISHED_NODES
	accessibility         bool // VOLUME_ACCESSIBILITY_CONSTRAINTS
	modify                bool // MODIFY_VOLUME: volume attributes classes
	fetched               time.Time
}

// capsCache asks each driver once a minute for its capabilities.
type capsCache struct {
	drivers Drivers
	mu      sync.Mutex
	m       map[string]driverCaps
}

// capsNodeTries bounds how many more node proxies of a node-local driver
// are asked for its capabilities when the first one does not answer.
const capsNodeTries = 3

func (c *capsCache) get(ctx context.Context, driver string) (driverCaps, error) {
	c.mu.Lock()
	caps, ok := c.m[driver]
	c.mu.Unlock()
	if ok && time.Since(caps.fetched) < time.Minute {
		return caps, nil
	}
	conn, err := c.drivers.ControllerConn(driver)
	if err == nil {
		caps, err = c.fetch(ctx, driver, conn)
	}
	if err != nil && c.drivers.NodeLocal(driver) {
		// A node-local driver's node plugins are its controllers and all
		// answer alike: one node down (its proxy unreachable, say) must
		// not stop the driver's calls on every other node.
		errs := []error{err}
		tried := 0
		for _, n := range c.drivers.DriverNodes(driver) {
			if tried == capsNodeTries {
				break
			}
			nc, nerr := c.drivers.NodeConn(driver, n)
			if nerr != nil || nc == conn {
				continue
			}
			tried++
			if caps, nerr = c.fetch(ctx, driver, nc); nerr == nil {
				err = nil
				break
			}
			errs = append(errs, fmt.Errorf("node %s: %w", n, nerr))
		}
		if err != nil {
			err = errors.Join(errs...)
		}
	}
	if err != nil {
		return driverCaps{}, err
	}
	c.mu.Lock()
	if c.m == nil {
		c.m = map[string]driverCaps{}
	}
	c.m[driver] = caps
	c.mu.Unlock()
	return caps, nil
}

// fetch asks the driver behind conn for its capabilities.
func (c *capsCache) fetch(ctx context.Context, driver string, conn grpc.ClientConnInterface) (driverCaps, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	pc, err := csi.NewIdentityClient(conn).GetPluginCapabilities(ctx, &csi.GetPluginCapabilitiesRequest{})
	if err != nil {
		return driverCaps{}, fmt.Errorf("driver %s: GetPluginCapabilities: %w", driver, err)
	}
	caps := driverCaps{fetched: time.Now()}
	hasController := false
	for _, cp := range pc.GetCapabilities() {
		switch cp.GetService().GetType() {
		case csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS:
			caps.accessibility = true
		case csi.PluginCapability_Service_CONTROLLER_SERVICE:
			hasController = true
		}
	}
	if hasController {
		cc, err := csi.NewControllerClient(conn).ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{})
		if err != nil {
			return driverCaps{}, fmt.Errorf("driver %s: ControllerGetCapabilities: %w", driver, err)
		}
		for _, cp := range cc.GetCapabilities() {
			switch cp.GetRpc().GetType() {
			case csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME:
				caps.createDelete = true
			case csi.ControllerServiceCapability_RPC_CLONE_VOLUME:
				caps.clone = true
			case csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER:
				caps.singleNodeMultiWriter = true
			case csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME:
				caps.publishUnpublish = true
			case csi.ControllerServiceCapability_RPC_PUBLISH_READONLY:
				caps.publishReadonly = true
			case csi.ControllerServiceCapability_RPC_EXPAND_VOLUME:
				caps.expand = true
			case csi.ControllerServiceCapability_RPC_GET_CAPACITY:
				caps.getCapacity = true
			case csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES:
				caps.listPublishedNodes = true
			case csi.ControllerServiceCapability_RPC_MODIFY_VOLUME:
				caps.modify = true
			case csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT:
				caps.snapshot = true
			}
		}
	}
	return caps, nil
}

func (c *capsCache) forget(driver string) {
	c.mu.Lock()
	delete(c.m, driver)
	c.mu.Unlock()
}
