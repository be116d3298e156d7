// Package health is the volume health controller, as
// external-health-monitor-controller: every MonitorInterval
// (--monitor-interval, a minute by default) it asks each registered
// driver that reports volume health how its bound volumes are, and
// records on each claim the changes: VolumeConditionAbnormal (Warning, the
// driver's message, sanitized and cut to 512 bytes), VolumeConditionNormal
// (Normal, on recovery), VolumeNotFound (Warning, the driver no longer has
// the volume). It exports csibroker_volumes_abnormal{driver},
// csibroker_volumes_not_found{driver}, and counts sweeps and their CSI
// calls.
//
// Which API. CSI v1.13, the spec the broker is built on, removed the
// alpha VOLUME_CONDITION capability (value 11) and the volume_condition
// fields of ListVolumes and ControllerGetVolume, and added
// ControllerListVolumeHealth / ControllerGetVolumeHealth
// (LIST_VOLUME_HEALTH / GET_VOLUME_HEALTH). Drivers in use today are
// built on older specs and send the removed ones; protobuf keeps them as
// unknown fields, which csiparams.LegacyCondition reads. A driver is asked
// (modeOf), first match wins:
//
//   - LIST_VOLUME_HEALTH: a paged ControllerListVolumeHealth (it names the
//     abnormal volumes; every other volume is normal), and, if the driver
//     has LIST_VOLUMES, a paged ListVolumes to find the volumes it no
//     longer has. Without LIST_VOLUMES a gone volume is not told from a
//     healthy one.
//   - GET_VOLUME_HEALTH: ControllerGetVolumeHealth per PV.
//   - VOLUME_CONDITION with LIST_VOLUMES: a paged ListVolumes, the
//     condition read from each entry (the health monitor's preferred way).
//   - VOLUME_CONDITION with GET_VOLUME: ControllerGetVolume per PV.
//   - otherwise the driver is never asked.
//
// A listing is a few calls (500 entries a page) whatever the number of
// volumes; a call per volume runs 8 at a time. Each page is checked
// (csiparams.CheckListVolumesPage, CheckVolumeHealthPage) and a bad one
// ends the sweep with nothing concluded; so does a failed page. A PV's
// volume missing from a complete listing is confirmed with the driver's
// per-volume method (NotFound: gone), since the spec lets a listing miss
// a volume while it pages; without one, two absences in a row count as
// gone. Drivers with no bound PVs are not asked at all.
//
// Events once per change. Upstream records the abnormal Event on every
// sweep and relies on Event aggregation; here each PV's last reported
// state (normal, abnormal with its message, gone) is remembered, and an
// Event is recorded only when it changes: a first sight of an abnormal or
// gone volume, a new message, a recovery. The memory is the term's: a new
// leader reports each abnormal or gone volume once more, and a recovery
// that happens while no replica leads gets no Normal Event (no state is
// written to the API server for it: that would cost a write per change
// on the objects' budget).
//
// Node-local drivers (volumes that live on one node) are swept on each
// node's proxy, for the PVs of that node (kube.NodeOfPV; a PV naming no
// node is skipped): each node plugin answers for its own volumes only, so
// asking one proxy for all would call every other node's volumes gone.
//
// It reaches Kubernetes and the drivers through k8sbridge/internal/kube
// and internal/drivers, and imports no other controller.
package health
