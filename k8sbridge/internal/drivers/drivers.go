package drivers

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
	// HasDriver reports whether one driver is registered, without listing
	// them all (asked on every informer event).
	HasDriver(driver string) bool
	// CallTimeout is one call's own timeout at the broker (a driver's
	// per-method override included); 0: none of its own.
	CallTimeout(driver, method string) time.Duration
}

// CallContext bounds one CSI call of method to driver: by the longer of
// timeout (--timeout) and the driver's timeout for the method, so a
// per-method override (a CreateVolume of minutes) is not cut short here;
// the broker's chain applies the driver's own.
func CallContext(ctx context.Context, d Drivers, timeout time.Duration, driver, method string) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(ctx, max(timeout, d.CallTimeout(driver, method)))
	s, ok := d.(Sharded)
	if !ok {
		return ctx, cancel
	}
	ctx, done := s.Track(ctx, driver)
	return ctx, func() { done(); cancel() }
}

// Sharded is what a Drivers view of one replica's share of the drivers
// adds (per-driver leader election): its HasDriver and DriverNames name
// only the drivers this replica leads.
type Sharded interface {
	// Foreign reports whether driver is another replica's to work on
	// (registered but not led here, or led by another replica).
	Foreign(driver string) bool
	// Track counts one call to driver in flight until done; the context
	// ends with this replica's leadership of driver.
	Track(ctx context.Context, driver string) (context.Context, func())
}

// Foreign reports whether d is a sharded view in which driver is another
// replica's; never for a whole registry.
func Foreign(d Drivers, driver string) bool {
	s, ok := d.(Sharded)
	return ok && s.Foreign(driver)
}

// Unreachable marks the failure of a driver's capabilities lookup, so that
// an Event tells it apart from the answers of the method it came before.
type Unreachable struct{ error }

func (u Unreachable) Unwrap() error { return u.error }

// NewUnreachable marks err as a failed capabilities lookup.
func NewUnreachable(err error) Unreachable { return Unreachable{err} }

// Caps are the capabilities provisioning needs, learned from the driver.
type Caps struct {
	CreateDelete  bool
	Clone         bool
	Snapshot      bool // CREATE_DELETE_SNAPSHOT: it makes, deletes and restores snapshots
	ListSnapshots bool // LIST_SNAPSHOTS: a snapshot's status can be asked by its ID
	// GroupSnapshot: the GROUP_CONTROLLER_SERVICE plugin capability and
	// the group controller's CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT.
	GroupSnapshot         bool
	SingleNodeMultiWriter bool
	PublishUnpublish      bool
	PublishReadonly       bool // PUBLISH_READONLY: ControllerPublish may be asked for read-only
	Expand                bool
	GetCapacity           bool
	ListPublishedNodes    bool // LIST_VOLUMES with LIST_VOLUMES_PUBLISHED_NODES
	Accessibility         bool // VOLUME_ACCESSIBILITY_CONSTRAINTS
	Modify                bool // MODIFY_VOLUME: volume attributes classes
	// Volume health (k8sbridge/health): the legacy VOLUME_CONDITION (CSI
	// <= 1.12, value 11, removed from v1.13) with LIST_VOLUMES or
	// GET_VOLUME, or v1.13's GET_VOLUME_HEALTH / LIST_VOLUME_HEALTH.
	ListVolumes      bool // LIST_VOLUMES
	GetVolume        bool // GET_VOLUME
	VolumeCondition  bool // VOLUME_CONDITION (legacy)
	GetVolumeHealth  bool // GET_VOLUME_HEALTH
	ListVolumeHealth bool // LIST_VOLUME_HEALTH
	fetched          time.Time
}

// volumeConditionCap is VOLUME_CONDITION, which CSI v1.13 removed (the
// value is reserved there) and drivers built on an older spec still send.
const volumeConditionCap = csi.ControllerServiceCapability_RPC_Type(11)

// Cache asks each driver once a minute for its capabilities.
type Cache struct {
	drivers Drivers
	mu      sync.Mutex
	m       map[string]Caps
}

// capsNodeTries bounds how many more node proxies of a node-local driver
// are asked for its capabilities when the first one does not answer.
const capsNodeTries = 3

// Get is driver's capabilities, asked of it at most once a minute.
func (c *Cache) Get(ctx context.Context, driver string) (Caps, error) {
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
		return Caps{}, err
	}
	c.mu.Lock()
	if c.m == nil {
		c.m = map[string]Caps{}
	}
	c.m[driver] = caps
	c.mu.Unlock()
	return caps, nil
}

// fetch asks the driver behind conn for its capabilities.
func (c *Cache) fetch(ctx context.Context, driver string, conn grpc.ClientConnInterface) (Caps, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	pc, err := csi.NewIdentityClient(conn).GetPluginCapabilities(ctx, &csi.GetPluginCapabilitiesRequest{})
	if err != nil {
		return Caps{}, fmt.Errorf("driver %s: GetPluginCapabilities: %w", driver, err)
	}
	caps := Caps{fetched: time.Now()}
	hasController, hasGroups := false, false
	for _, cp := range pc.GetCapabilities() {
		switch cp.GetService().GetType() {
		case csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS:
			caps.Accessibility = true
		case csi.PluginCapability_Service_CONTROLLER_SERVICE:
			hasController = true
		case csi.PluginCapability_Service_GROUP_CONTROLLER_SERVICE:
			hasGroups = true
		}
	}
	if hasGroups {
		gc, err := csi.NewGroupControllerClient(conn).GroupControllerGetCapabilities(ctx, &csi.GroupControllerGetCapabilitiesRequest{})
		if err != nil {
			return Caps{}, fmt.Errorf("driver %s: GroupControllerGetCapabilities: %w", driver, err)
		}
		for _, cp := range gc.GetCapabilities() {
			if cp.GetRpc().GetType() == csi.GroupControllerServiceCapability_RPC_CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT {
				caps.GroupSnapshot = true
			}
		}
	}
	if hasController {
		cc, err := csi.NewControllerClient(conn).ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{})
		if err != nil {
			return Caps{}, fmt.Errorf("driver %s: ControllerGetCapabilities: %w", driver, err)
		}
		for _, cp := range cc.GetCapabilities() {
			switch cp.GetRpc().GetType() {
			case csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME:
				caps.CreateDelete = true
			case csi.ControllerServiceCapability_RPC_CLONE_VOLUME:
				caps.Clone = true
			case csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER:
				caps.SingleNodeMultiWriter = true
			case csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME:
				caps.PublishUnpublish = true
			case csi.ControllerServiceCapability_RPC_PUBLISH_READONLY:
				caps.PublishReadonly = true
			case csi.ControllerServiceCapability_RPC_EXPAND_VOLUME:
				caps.Expand = true
			case csi.ControllerServiceCapability_RPC_GET_CAPACITY:
				caps.GetCapacity = true
			case csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES:
				caps.ListPublishedNodes = true
			case csi.ControllerServiceCapability_RPC_MODIFY_VOLUME:
				caps.Modify = true
			case csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT:
				caps.Snapshot = true
			case csi.ControllerServiceCapability_RPC_LIST_VOLUMES:
				caps.ListVolumes = true
			case csi.ControllerServiceCapability_RPC_GET_VOLUME:
				caps.GetVolume = true
			case volumeConditionCap:
				caps.VolumeCondition = true
			case csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH:
				caps.GetVolumeHealth = true
			case csi.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH:
				caps.ListVolumeHealth = true
			case csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS:
				caps.ListSnapshots = true
			}
		}
	}
	return caps, nil
}

// Forget drops what is known of driver: the next Get asks it.
func (c *Cache) Forget(driver string) {
	c.mu.Lock()
	delete(c.m, driver)
	c.mu.Unlock()
}

// NewCache is a capabilities cache over d.
func NewCache(d Drivers) *Cache { return &Cache{drivers: d} }
