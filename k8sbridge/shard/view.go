package shard

import (
	"context"

	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
)

// View is the registry as the controllers of a sharded bridge see it:
// only the drivers this replica leads are registered (HasDriver,
// DriverNames), so a controller looks at their objects only, and sees a
// driver it starts leading as one just registered. Connections pass
// through; CallContext (drivers.Sharded) ends a call when leadership of
// its driver ends.
type View struct {
	drivers.Drivers
	m *Manager
}

var _ drivers.Sharded = View{}

// NewView is all's drivers as m shares them out.
func NewView(all drivers.Drivers, m *Manager) View { return View{Drivers: all, m: m} }

func (v View) HasDriver(driver string) bool {
	return v.m.Leads(driver) && v.Drivers.HasDriver(driver)
}

func (v View) DriverNames() []string {
	var out []string
	for _, d := range v.Drivers.DriverNames() {
		if v.m.Leads(d) {
			out = append(out, d)
		}
	}
	return out
}

func (v View) Foreign(driver string) bool { return v.m.Foreign(driver) }

func (v View) Track(ctx context.Context, driver string) (context.Context, func()) {
	return v.m.Track(ctx, driver)
}
