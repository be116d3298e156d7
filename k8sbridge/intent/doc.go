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
package intent
