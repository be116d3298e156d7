// Package intent is the durable record of in-flight CreateVolume calls: one
// ConfigMap in the broker's namespace, an entry per volume being made,
// written before the driver is called and removed once the PV exists, so
// that a volume the driver made is never forgotten (a broker killed at any
// point, or a claim deleted meanwhile, leaves no volume behind).
//
// Writes are batched (one write carries every entry added meanwhile) and
// carry the record's resource version, so two leaders in overlap never
// overwrite each other's entries. It knows nothing of claims' controllers:
// it stores, lists and removes entries.
//
// Record is generic over its entries (Entry: JSON with a Key), so another
// kind of in-flight call gets a sibling record of its own ConfigMap with
// the same guarantees: the snapshot controller records its CreateSnapshot
// calls in one, with an entry type it defines. Store is the volumes'.
package intent
