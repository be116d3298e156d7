package broker

import (
	"context"

	brokerstatusv1 "github.com/csibroker/csibroker/proto/brokerstatus/v1"
)

// StatusServer serves the broker status API read by `csibroker status`. It
// implements every method of the service itself (the code is generated
// without the requirement to embed the generated Unimplemented stub).
type StatusServer struct {
	B       *Broker
	Version string
	// Leader reports whether this replica leads and who does; nil means no
	// leader election (always leader).
	Leader func() (bool, string)
	// DriverLeaders maps each driver to the replica leading it, with
	// per-driver leader election (nil, or an empty map, without).
	DriverLeaders func() map[string]string
}

// GetStatus snapshots drivers, proxies and leadership.
func (s *StatusServer) GetStatus(context.Context, *brokerstatusv1.GetStatusRequest) (*brokerstatusv1.GetStatusResponse, error) {
	out := &brokerstatusv1.GetStatusResponse{Version: s.Version, Leader: true}
	if s.Leader != nil {
		out.Leader, out.LeaderIdentity = s.Leader()
	}
	var leaders map[string]string
	if s.DriverLeaders != nil {
		leaders = s.DriverLeaders()
	}
	for _, d := range s.B.Status() {
		ds := &brokerstatusv1.DriverStatus{Name: d.Name, InflightCalls: d.Inflight, TotalCalls: d.Total, FailedCalls: d.Failed, Socket: d.Socket, Leader: leaders[d.Name]}
		for _, p := range d.Proxies {
			ds.Proxies = append(ds.Proxies, &brokerstatusv1.ProxyStatus{Address: p.Address, Node: p.Node, State: p.State, ExpectedIdentity: p.ExpectedIdentity})
		}
		out.Drivers = append(out.Drivers, ds)
	}
	return out, nil
}

var _ brokerstatusv1.BrokerStatusServer = (*StatusServer)(nil)
