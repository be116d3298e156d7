// Package shard shares the registered drivers out among the broker's
// replicas (per-driver leader election, --leader-election-mode
// per-driver): each driver is led by one replica at a time through a
// coordination/v1 Lease of its own, and the replicas balance as they come
// and go.
//
// Leases, in the leader Lease's namespace, labelled with the election's
// name (csibroker.io/leader-election):
//
//   - a member Lease per replica (<name>-member-<identity>), renewed every
//     retry period, as client-go's elector renews its Lease;
//   - a driver Lease per driver (<name>-driver-<driver>, label
//     csibroker.io/driver), whose holderIdentity is the replica leading
//     the driver. It holds while its holder's member Lease does: it is
//     written only when a replica takes or gives it up. Renewing twenty
//     driver Leases every half second, as twenty electors would, would
//     cost forty writes a second (and standbys' reads on top) against a
//     Lease client budget of a few requests a second; this costs one
//     write per replica.
//
// Exactly one leader: a replica leads a driver while it holds the
// driver's Lease (written with the Lease's resource version: of two
// takers, one wins) and its member Lease was renewed within the renew
// deadline; it stops at once otherwise. Another replica takes the driver
// only once the holder's member Lease has not changed, by its own clock,
// for the lease duration (longer than the renew deadline), checked again
// on the API server just before the take, or once the holder wrote it
// free. As with client-go's elector, the clocks only need to run at the
// same rate.
//
// Balance (Decide, a pure function): with D drivers and N live members,
// each leads D/N or ceil(D/N). One over its share gives the extra ones up
// gracefully: Leads turns false at once (no new work), calls in flight
// (counted through Track) may end for Drain, then are cancelled, and the
// Lease is written free; one under its share takes free ones. Drivers are
// ranked per member by a rendezvous hash, so members racing for free
// drivers mostly want different ones and a balanced state stays put.
//
// View is the drivers registry the bridge's controllers see: only the
// drivers this replica leads. It imports no controller.
package shard
