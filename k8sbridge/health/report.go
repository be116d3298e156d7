package health

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"

	"github.com/csibroker/csibroker/k8sbridge/csiparams"
)

// Event reasons on the claim. The first is external-health-monitor's, so
// alerts written for it keep working.
const (
	ReasonAbnormal = "VolumeConditionAbnormal"
	ReasonNormal   = "VolumeConditionNormal"
	ReasonNotFound = "VolumeNotFound"
)

// seenKind is what a sweep learnt of one volume.
type seenKind int

const (
	// seenPresent: the driver has the volume; cond says how it is.
	seenPresent seenKind = iota
	// seenGone: the driver said it has no such volume (NotFound to a call
	// naming it).
	seenGone
	// seenAbsent: a complete listing did not hold it, and no call could
	// confirm it (the driver has no per-volume method). Listings are not
	// consistent views (the spec allows a volume to be missed while
	// paging), so only a second absence in a row counts as gone.
	seenAbsent
)

// seen is one volume's observation in one sweep.
type seen struct {
	kind seenKind
	cond csiparams.Condition
}

// stateKind is what was last reported of a volume.
type stateKind int

const (
	stateNormal stateKind = iota
	stateAbnormal
	stateGone
)

// volState is what the controller remembers of one PV between sweeps:
// what it last reported, so that an Event is recorded once per change and
// not on every sweep.
type volState struct {
	kind stateKind
	msg  string // the abnormal condition's message, as reported
	// absent counts the unconfirmed absences in a row (seenAbsent).
	absent int
}

// event is an Event to record on the volume's claim.
type event struct {
	typ, reason, msg string
}

// volumeInfo names the volume in Events.
type volumeInfo struct {
	driver, handle, pv string
}

// transition is the state after observation s of a volume whose last
// state is prev (nil: never seen this term), and the Event to record, if
// any: the first sight of an abnormal or gone volume, and every change
// after (an abnormal condition whose message changes is a change; a
// normal volume seen first is not news).
func transition(prev *volState, s seen, v volumeInfo) (volState, *event) {
	var next volState
	if prev != nil {
		next = *prev
	}
	switch s.kind {
	case seenAbsent:
		next.absent++
		if next.absent < 2 || (prev != nil && prev.kind == stateGone) {
			return next, nil
		}
		fallthrough
	case seenGone:
		was := prev != nil && prev.kind == stateGone
		next = volState{kind: stateGone, absent: next.absent}
		if was {
			return next, nil
		}
		return next, &event{corev1.EventTypeWarning, ReasonNotFound, fmt.Sprintf(
			"Driver %s does not have volume %s of PV %s any more: it was deleted or lost outside Kubernetes", v.driver, v.handle, v.pv)}
	}
	// Present.
	if s.cond.Abnormal {
		next = volState{kind: stateAbnormal, msg: s.cond.Message}
		if prev != nil && prev.kind == stateAbnormal && prev.msg == s.cond.Message {
			return next, nil
		}
		msg := s.cond.Message
		if msg == "" {
			msg = fmt.Sprintf("Driver %s reports volume %s of PV %s abnormal (no message)", v.driver, v.handle, v.pv)
		}
		return next, &event{corev1.EventTypeWarning, ReasonAbnormal, msg}
	}
	next = volState{kind: stateNormal}
	switch {
	case prev == nil || prev.kind == stateNormal:
		return next, nil
	case prev.kind == stateGone:
		return next, &event{corev1.EventTypeNormal, ReasonNormal, fmt.Sprintf(
			"Driver %s has volume %s of PV %s again, and reports its condition normal", v.driver, v.handle, v.pv)}
	default:
		return next, &event{corev1.EventTypeNormal, ReasonNormal, fmt.Sprintf(
			"Driver %s reports the condition of volume %s of PV %s normal again", v.driver, v.handle, v.pv)}
	}
}
