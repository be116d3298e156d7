package provision

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/csibroker/csibroker/internal/chaintest"
	"github.com/csibroker/csibroker/internal/sampledriver"
	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
)

// chainDrivers reaches sample drivers through their own real chains
// (broker client chain, proxy over mTLS, driver socket); hook, when set,
// sees every answer of the drivers' controllers and may change it.
type chainDrivers struct {
	chains map[string]*chaintest.Chain
	hook   func(method string, args, reply any, err error) error
}

var _ drivers.Drivers = (*chainDrivers)(nil)

// add starts a sample driver behind a proxy and a broker.
func (d *chainDrivers) add(t *testing.T, cfg sampledriver.Config) *sampledriver.Driver {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	ep, drv := sampledriver.StartTest(t, cfg)
	if d.chains == nil {
		d.chains = map[string]*chaintest.Chain{}
	}
	d.chains[cfg.Name] = chaintest.Start(t, chaintest.Options{Driver: cfg.Name, DriverEndpoint: ep, LogLevel: slog.LevelWarn, Timeout: 30 * time.Second})
	return drv
}

// hooked is d with every controller answer passed through hook.
func (d *chainDrivers) hooked(hook func(method string, args, reply any, err error) error) *chainDrivers {
	return &chainDrivers{chains: d.chains, hook: hook}
}

func (d *chainDrivers) ControllerConn(drv string) (grpc.ClientConnInterface, error) {
	c, ok := d.chains[drv]
	if !ok {
		return nil, fmt.Errorf("unknown driver %q", drv)
	}
	conn, err := c.Broker.ControllerConn(drv)
	if err != nil || d.hook == nil {
		return conn, err
	}
	return hookedConn{conn, d.hook}, nil
}

func (d *chainDrivers) NodeConn(drv, node string) (grpc.ClientConnInterface, error) {
	return nil, fmt.Errorf("driver %q has no node proxies here", drv)
}
func (d *chainDrivers) NodeLocal(string) bool       { return false }
func (d *chainDrivers) DriverNodes(string) []string { return nil }
func (d *chainDrivers) HasDriver(drv string) bool   { _, ok := d.chains[drv]; return ok }
func (d *chainDrivers) DriverNames() []string       { return slices.Sorted(maps.Keys(d.chains)) }
func (d *chainDrivers) CallTimeout(drv, method string) time.Duration {
	if c, ok := d.chains[drv]; ok {
		return c.Broker.CallTimeout(drv, method)
	}
	return 0
}

type hookedConn struct {
	grpc.ClientConnInterface
	hook func(method string, args, reply any, err error) error
}

func (c hookedConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	return c.hook(method, args, reply, c.ClientConnInterface.Invoke(ctx, method, args, reply, opts...))
}

// createRequest is a 1 MiB mount volume's CreateVolume.
func createRequest(name string) *csi.CreateVolumeRequest {
	return &csi.CreateVolumeRequest{
		Name:          name,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		}},
	}
}

// createDriverVolume makes req's volume at driver (as an earlier leader
// did) and returns its ID.
func createDriverVolume(t *testing.T, d *chainDrivers, driver string, req *csi.CreateVolumeRequest) string {
	t.Helper()
	conn, err := d.ControllerConn(driver)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := csi.NewControllerClient(conn).CreateVolume(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	return resp.GetVolume().GetVolumeId()
}

// marshalRequest is r as an intent entry records it.
func marshalRequest(t *testing.T, r *csi.CreateVolumeRequest) []byte {
	t.Helper()
	b, err := proto.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// driverAnswer is a status as a driver's answer, for tests standing in for
// a driver (broker.Answered says so).
type driverAnswer struct{ st *status.Status }

func (e driverAnswer) Error() string              { return e.st.Err().Error() }
func (e driverAnswer) GRPCStatus() *status.Status { return e.st }
func (e driverAnswer) Answered() bool             { return true }
