package k8sbridge

import (
	"context"
	"sync"

	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/shard"
)

// Leader election modes (Config.LeaderElectionMode): single, one Lease and
// one leader for everything (the default, also ""); per-driver, the
// drivers shared out among the replicas, a Lease per driver.
const (
	LeaderElectionSingle    = kube.LeaderElectionSingle
	LeaderElectionPerDriver = kube.LeaderElectionPerDriver
)

// newShards makes the shard manager of a bridge with per-driver leader
// election, and gives the controllers its view of the drivers in cfg.
func newShards(cfg *Config) (*shard.Manager, error) {
	if !cfg.LeaderElection || cfg.LeaderElectionMode != LeaderElectionPerDriver {
		return nil, nil
	}
	m, err := shard.New(shard.Config{
		Client: cfg.LeaseClient, Namespace: cfg.LeaderElectionNamespace, Name: cfg.LeaderElectionLockName, Identity: cfg.Identity,
		LeaseDuration: cfg.LeaderElectionLease, RenewDeadline: cfg.LeaderElectionRenew, RetryPeriod: cfg.LeaderElectionRetry,
		Drivers: cfg.Drivers, Log: cfg.Logger, Registerer: cfg.Registerer,
	})
	if err != nil {
		return nil, err
	}
	cfg.Drivers = shard.NewView(cfg.Drivers, m)
	return m, nil
}

// shareIntents makes the intent record one of the replicas' (each writes
// the entries of the drivers it leads) and tells it of each handover.
func (b *Bridge) shareIntents() {
	if b.shards == nil {
		return
	}
	b.Env.Intents.Share(func(d string) bool { return !drivers.Foreign(b.Cfg.Drivers, d) })
	b.shards.OnHandover(func(d string, _ bool) { b.Env.Intents.Handover(d) }, func(string) {
		select {
		case b.acquired <- struct{}{}:
		default:
		}
	})
}

// runSharded is Run with per-driver leader election: the controllers run
// for the process's life over the drivers this replica leads (the shard
// manager's view), and the leader Lease elects a coordinator that does only
// what one replica does for all (grants' status, discovery's Events,
// csibroker_leader). The driver Leases are released once the controllers
// have stopped.
func (b *Bridge) runSharded(ctx context.Context) error {
	var wg sync.WaitGroup
	var electErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		electErr = b.elect(ctx, func(term context.Context) { <-term.Done() })
	}()
	mctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	if b.keepLeaseOnStop {
		// A crash (tests): the Leases stop being renewed at once.
		mctx = ctx
	}
	managed := make(chan struct{})
	go func() { defer close(managed); b.shards.Run(mctx, !b.keepLeaseOnStop) }()
	b.lead(ctx)
	stop()
	<-managed
	wg.Wait()
	return electErr
}

// DriverLeaders maps each driver led by a live replica to that replica, as
// this replica sees the driver Leases; nil without per-driver leader
// election.
func (b *Bridge) DriverLeaders() map[string]string {
	if b.shards == nil {
		return nil
	}
	return b.shards.Leaders()
}

// LedDrivers are the drivers this replica leads (all of them without
// per-driver leader election).
func (b *Bridge) LedDrivers() []string { return b.Cfg.Drivers.DriverNames() }
