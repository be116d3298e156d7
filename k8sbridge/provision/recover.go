package provision

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"

	"github.com/csibroker/csibroker/broker"
	"github.com/csibroker/csibroker/k8sbridge/intent"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/policy"
)

// recoveryLoop settles the intent record: entries whose PV exists are
// dropped, entries of pending claims are provisioned as usual, and entries
// whose claim is gone (or bound to another PV) have their volume deleted
// (the request is re-issued, which CSI makes idempotent by name, to learn
// the volume's ID); so does an entry of a node-local volume whose PV names
// another node (its volume is a second one). It runs when leadership
// starts, when a claim is deleted, and every RecoveryInterval.
func (p *Provisioner) RecoveryLoop(ctx context.Context) {
	t := time.NewTicker(p.b.Cfg.RecoveryInterval)
	defer t.Stop()
	for {
		p.recoverOnce(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-p.recover:
			// Let a burst of deletions arrive before reading the record.
			if !kube.SleepCtx(ctx, 200*time.Millisecond) {
				return
			}
		}
	}
}

func (p *Provisioner) recoverOnce(ctx context.Context) {
	intents, err := p.b.Intents.List(ctx)
	if err != nil {
		p.b.Log.Error("recovery: cannot read the intent record", "err", err)
		return
	}
	defer p.recoveryPasses.Add(1)
	now := time.Now()
	p.forgetSettled(intents)
	p.forgetSettledClaims()
	// Each driver's entries in turn, the drivers side by side: a driver
	// whose calls hang holds up its own clean-up only.
	byDriver := map[string][]intent.Intent{}
	for _, in := range intents {
		byDriver[in.Driver] = append(byDriver[in.Driver], in)
	}
	var wg sync.WaitGroup
	for _, list := range byDriver {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, in := range list {
				if ctx.Err() != nil {
					return
				}
				// A panic (a bug a driver's answer hits) ends this
				// entry's turn only: logged with its stack and counted;
				// the next pass tries it again.
				p.b.Safely("recovery", in.Key(), func() { p.recoverIntent(ctx, in, now) })
			}
		}()
	}
	wg.Wait()
}

// recoverIntent settles one entry of the intent record, if it is due.
func (p *Provisioner) recoverIntent(ctx context.Context, in intent.Intent, now time.Time) {
	if p.isInflight(in.VolumeName) || p.b.Foreign(in.Driver) {
		return
	}
	if in.Superseded {
		p.recoverSuperseded(ctx, in, now)
		return
	}
	if pv, err := p.b.Volumes.Get(in.VolumeName); err == nil {
		if other := recordedNode(pv); !holdsNodeVolume(other, in.Node) {
			// An attempt whose PV create found the PV saved with
			// the volume of another node made a second volume
			// (settleExistingPV), which it could not delete.
			if p.recoveryDue(in.Key(), now) {
				p.deleteOrphan(ctx, in, now, "its PersistentVolume holds the volume made on node "+other)
			}
			return
		}
		p.b.Intents.Remove(in.Key())
		return
	}
	claim, err := p.b.Claims.PersistentVolumeClaims(in.ClaimNamespace).Get(in.ClaimName)
	if err == nil && string(claim.UID) == in.ClaimUID && claim.DeletionTimestamp == nil {
		// A claim's spec.volumeName never changes once set, so the
		// cache is trusted for it; only the PV's absence is confirmed.
		switch claim.Spec.VolumeName {
		case "":
			p.queue.Add(in.ClaimNamespace + "/" + in.ClaimName)
		case in.VolumeName:
			p.settleBoundToGonePV(ctx, in)
		default:
			// Bound to another PV (an admin pre-bound it to a static
			// one): the broker will never make a PV of this name, so
			// a volume made under it is an orphan.
			// deleteOrphan makes sure the entry's PV does not hold
			// the volume.
			if p.recoveryDue(in.Key(), now) {
				p.deleteOrphan(ctx, in, now, "claim is bound to PersistentVolume "+claim.Spec.VolumeName)
			}
		}
		return
	}
	if !p.recoveryDue(in.Key(), now) {
		return
	}
	// The cache says the claim is gone; make sure before deleting.
	cur, gerr := p.b.Cfg.Client.CoreV1().PersistentVolumeClaims(in.ClaimNamespace).Get(ctx, in.ClaimName, metav1.GetOptions{})
	if gerr == nil && string(cur.UID) == in.ClaimUID && cur.DeletionTimestamp == nil {
		return
	}
	if gerr != nil && !apierrors.IsNotFound(gerr) {
		return
	}
	p.deleteOrphan(ctx, in, now, "claim no longer exists")
}

// settleBoundToGonePV drops the entry of a claim bound to the entry's own
// PV when that PV is gone: the claim could only be bound to it once it
// existed, so the PV's own lifecycle (its reclaim policy, or an admin) has
// decided the volume's fate, and recovery must not overrule it.
func (p *Provisioner) settleBoundToGonePV(ctx context.Context, in intent.Intent) {
	found, err := p.pvHolds(ctx, in.VolumeName, "") // "": whatever node it names
	if err != nil {
		p.b.Log.Warn("recovery: cannot read PersistentVolume; will retry", "volume", in.VolumeName, "err", err)
		return
	}
	if !found {
		p.b.Log.Info("recovery: the claim's PersistentVolume no longer exists; entry dropped, volume left alone",
			"volume", in.VolumeName, "driver", in.Driver, "claim", in.ClaimNamespace+"/"+in.ClaimName,
			"why", "the PV's reclaim policy or an administrator decided the volume's fate")
	}
	p.b.Intents.Remove(in.Key())
}

// SupersededKeep is how long a superseded entry waits for its node to come
// back (counted from its attempt) before it is given up.
const SupersededKeep = 7 * 24 * time.Hour

// recoverSuperseded deletes the volume a superseded entry's attempt may
// have made on its node, once that node is back (a node deleted and
// registered again under its name, its storage kept). While the node is
// gone there is nothing to reach: the node is looked at again less and
// less often, nothing is logged (the claim's ProvisioningOrphan Event said
// so), and after supersededKeep the entry is given up, saying so.
func (p *Provisioner) recoverSuperseded(ctx context.Context, in intent.Intent, now time.Time) {
	if cur, ok := p.b.Intents.Get(in.VolumeName); ok && cur.Node == in.Node {
		// A later attempt is on the same node again, under the same name:
		// provisioning folds this entry's requests into its own.
		return
	}
	if !p.recoveryDue(in.Key(), now) {
		return
	}
	if p.nodeGone(ctx, in.Node) {
		if now.Sub(in.Created.Time) > SupersededKeep {
			p.b.Log.Warn("recovery: an earlier attempt's node has not come back; its entry is given up",
				"then", "the volume it may have made there is left to an administrator", "volume", in.VolumeName, "driver", in.Driver, "node", in.Node, "claim", in.ClaimNamespace+"/"+in.ClaimName, "since", in.Created.Time)
			p.b.Metrics.Leaked.WithLabelValues(in.Driver, "abandoned").Inc()
			p.b.Intents.Remove(in.Key())
			return
		}
		p.recoveryFailed(in.Key(), now) // looked at again later, backing off
		return
	}
	p.deleteOrphan(ctx, in, now, "an attempt on node "+in.Node+", which was gone when the claim was provisioned anew")
}

// holdsNodeVolume reports whether a PV whose node-local volume is on
// pvNode ("": not said) accounts for the volume an attempt made on node
// ("": not node-local). Only a PV that names another node does not.
func holdsNodeVolume(pvNode, node string) bool {
	return node == "" || pvNode == "" || pvNode == node
}

// recordedNode is the node the broker recorded on a node-local PV it made
// ("": none recorded). Only a recorded node says that a volume on another
// node is not the PV's: a hostname from the affinity need not be the
// node's name (nodeOfPV maps it, for routing only).
func recordedNode(pv *corev1.PersistentVolume) string { return pv.Annotations[kube.AnnVolumeNode] }

// pvHolds asks the API server (not the cache, which may lag) whether PV
// name exists and accounts for the volume an attempt made on node ("": not
// node-local; see holdsNodeVolume). A node-local volume is known by its
// node and ID together (drivers may derive the ID from the name), so a PV
// that names another node does not hold it, whatever its handle.
func (p *Provisioner) pvHolds(ctx context.Context, name, node string) (bool, error) {
	pv, err := p.b.Cfg.Client.CoreV1().PersistentVolumes().Get(ctx, name, metav1.GetOptions{})
	switch {
	case err == nil:
		return holdsNodeVolume(recordedNode(pv), node), nil
	case apierrors.IsNotFound(err):
		return false, nil
	default:
		return false, fmt.Errorf("get PersistentVolume %s: %w", name, err)
	}
}

// Where re-issuing a recorded CreateVolume stopped (learnVolumeID).
type reissueStage int

const (
	stageRequest reissueStage = iota // the recorded request is unreadable
	stageSecret                      // its secret is denied or gone
	stageConn                        // the driver is unreachable
	stageCreate                      // the driver refused the call
	// stageAbsent: the driver holds no volume of that name. It answered
	// the re-issued request ResourceExhausted or OutOfRange, which the
	// CSI spec lets no plugin answer for a name it has a volume of (a
	// compatible one gets OK, another AlreadyExists).
	stageAbsent
)

// learnVolumeID re-issues in's recorded CreateVolume on in.Node (CSI makes
// it idempotent by name) to learn the volume's ID; on failure it says at
// which stage. requester is whom the volume's secrets are used for.
func (p *Provisioner) learnVolumeID(ctx context.Context, in intent.Intent) (id string, requester policy.Requester, stage reissueStage, err error) {
	requester = policy.Requester{Kind: policy.KindPersistentVolumeClaim, Namespace: in.ClaimNamespace, Name: in.ClaimName, Labels: in.ClaimLabels, StorageClass: in.StorageClass, Node: in.Node}
	var reqs []*csi.CreateVolumeRequest
	for _, raw := range in.Requests() {
		req := &csi.CreateVolumeRequest{}
		if err := proto.Unmarshal(raw, req); err != nil {
			return "", requester, stageRequest, fmt.Errorf("unreadable recorded request: %w", err)
		}
		reqs = append(reqs, req)
	}
	// Decided as the recorded attempt was, on the same requester and
	// source (an older entry without them: as recorded by the broker).
	source := policy.Source{Kind: policy.SourceStatic, Key: "intent record"}
	if in.SecretSource != nil {
		source = *in.SecretSource
	}
	creds, err := p.b.FetchSecret(ctx, kube.SecretUse{Driver: in.Driver, Op: policy.OpCreateVolume, Ref: in.ProvisionerSecret, Source: source, Requester: requester, RecordedNSLabels: in.NamespaceLabels})
	var gone kube.SecretNotFound
	switch {
	case errors.As(err, &gone):
		// Gone with its namespace, typically, when the claim was deleted
		// mid-creation. Asked without credentials, as the volume's
		// deletion is (and as external-provisioner deletes): a driver
		// that needs none to find the volume by name lets recovery delete
		// it; one that refuses leaves the entry failing, as before.
		p.b.Log.Warn("recovery: the provisioner secret is gone; re-issuing CreateVolume without credentials to learn the volume's ID",
			"driver", in.Driver, "volume", in.VolumeName, "err", err)
		creds = nil
	case err != nil:
		return "", requester, stageSecret, err
	}
	conn, err := p.conn(in.Driver, in.Node)
	if err != nil {
		return "", requester, stageConn, err
	}
	// The latest request first; AlreadyExists (the volume exists, made by
	// another request) and no room (a request that may not be the one that
	// made it) move on to the earlier ones. Only when every request was
	// refused for want of room, by the driver itself, is there no volume.
	absent := len(reqs) > 0
	for _, req := range reqs {
		callCtx, cancel := p.b.CallContext(ctx, in.Driver, "CreateVolume")
		req.Secrets = creds
		var resp *csi.CreateVolumeResponse
		resp, err = csi.NewControllerClient(conn).CreateVolume(callCtx, req)
		cancel()
		req.Secrets = nil
		if err == nil {
			return resp.GetVolume().GetVolumeId(), requester, 0, nil
		}
		if driversNoRoom(err) {
			continue
		}
		absent = false
		if status.Code(err) == codes.AlreadyExists {
			continue
		}
		break
	}
	if absent {
		return "", requester, stageAbsent, err
	}
	return "", requester, stageCreate, err
}

// driversNoRoom reports whether err is a driver's ResourceExhausted or
// OutOfRange, which the CSI spec lets no plugin give for a name it has a
// compatible volume of. Only an answer the proxy carried counts (the proxy
// gives neither code of its own to a CSI call); one the broker made itself
// (an answer over its message limit, a reset) says nothing about volumes.
// Nor does one after an attempt of the same call that ended Unavailable:
// that attempt may still be making the volume in the driver, and taking
// the room the answer says is missing.
func driversNoRoom(err error) bool {
	code := status.Code(err)
	return (code == codes.ResourceExhausted || code == codes.OutOfRange) && broker.Answered(err) && !broker.EarlierAttemptUnavailable(err)
}

// deleteOrphan re-issues the recorded CreateVolume to learn the volume's ID
// and deletes the volume; why says why it is an orphan. now is the start of
// the recovery pass, from which a failure's backoff is counted.
func (p *Provisioner) deleteOrphan(ctx context.Context, in intent.Intent, now time.Time, why string) {
	// Outside the driver's --per-driver-workers slots: recovery cleans up
	// one volume at a time, and must not wait behind a line of claims
	// that never lets a slot go free.
	if !p.takeVolume(in.VolumeName) {
		return
	}
	defer p.dropVolume(in.VolumeName)
	log := p.b.Log.With("volume", in.VolumeName, "driver", in.Driver, "claim", in.ClaimNamespace+"/"+in.ClaimName, "reason", why)
	// Every failure below backs off as a failed call does: an entry whose
	// driver is down must not cost API reads (this PV's, the claim's) on
	// every pass.
	if _, err := p.conn(in.Driver, in.Node); err != nil {
		p.orphanFailed(log, in, now, "reach the driver of an orphaned volume", err.Error())
		return
	}
	// The pass works from a list read at its start, and the PV cache may
	// lag: a worker (or the previous leader) may have made the PV since.
	// Asked of the API server before any volume is deleted.
	switch held, err := p.pvHolds(ctx, in.VolumeName, in.Node); {
	case err != nil:
		p.orphanFailed(log, in, now, "read the PersistentVolume of an orphaned volume", err.Error())
		return
	case held:
		p.b.Intents.Remove(in.Key())
		return
	}
	ctx, span := p.b.Tracer.Start(ctx, "recover "+in.VolumeName)
	defer span.End()
	id, requester, stage, err := p.learnVolumeID(ctx, in)
	if stage == stageAbsent {
		log.Info("recovery: the driver holds no volume of that name; entry dropped", "answer", kube.StatusText(err),
			"why", "it cannot make one now, which it may not say of a volume it has")
		p.mu.Lock()
		delete(p.recFails, in.Key())
		p.mu.Unlock()
		p.b.Intents.Remove(in.Key())
		return
	}
	if err != nil {
		detail := err.Error()
		switch stage {
		case stageRequest, stageConn:
			// Retried with backoff too (a record written by a newer
			// broker may be read by the next leader), and reported as
			// stuck.
		case stageSecret:
			// A secret denied or gone (its namespace deleted, say):
			// retried with the same backoff as a failed call.
			p.b.Metrics.Leaked.WithLabelValues(in.Driver, "failed").Inc()
		case stageCreate:
			detail = kube.StatusText(err)
		}
		// Even a final error does not prove that no volume of that name
		// exists (a clone source deleted since, rotated credentials): the
		// entry stays and is retried.
		p.orphanFailed(log, in, now, "learn the volume ID of an orphaned volume", detail)
		return
	}
	if err := p.deleteVolumeWith(ctx, in.Driver, in.Node, id, in.ProvisionerSecret, requester, in.NamespaceLabels, nil); err != nil {
		// Retried and reported like a failed re-issue (a DeleteVolume
		// secret denied, say).
		p.b.Metrics.Leaked.WithLabelValues(in.Driver, "failed").Inc()
		p.orphanFailed(log.With("volume_id", id), in, now, "delete an orphaned volume", err.Error())
		return
	}
	p.mu.Lock()
	delete(p.recFails, in.Key())
	p.mu.Unlock()
	log.Info("recovery: deleted an orphaned volume", "volume_id", id)
	p.b.Metrics.Leaked.WithLabelValues(in.Driver, "deleted").Inc()
	p.b.Intents.Remove(in.Key())
}

// orphanFailed counts a failed attempt at in's orphaned volume in the pass
// that started at now: the entry stays and is retried, each time after a
// longer wait (recoveryBackoff), and at its recoveryStuckAfter-th failure
// in a row it is reported as stuck, so an administrator can look. what
// says what could not be done.
func (p *Provisioner) orphanFailed(log *slog.Logger, in intent.Intent, now time.Time, what, detail string) {
	n, wait := p.recoveryFailed(in.Key(), now)
	if n == recoveryStuckAfter {
		p.b.Metrics.Leaked.WithLabelValues(in.Driver, "stuck").Inc()
		log.Error("recovery: cannot "+what+"; the intent record keeps it (delete the entry once the volume is dealt with)",
			"configmap", p.b.Cfg.Namespace+"/csibroker-intents", "attempts", n, "retry_in", wait, "err", detail)
		return
	}
	log.Warn("recovery: cannot "+what+"; will retry", "attempt", n, "retry_in", wait, "err", detail)
}

// undoOnNode deletes the volume of an intent on its node, if it exists
// there. The caller holds the volume's slot.
func (p *Provisioner) undoOnNode(ctx context.Context, in intent.Intent) error {
	id, requester, stage, err := p.learnVolumeID(ctx, in)
	if stage == stageAbsent {
		// Full, say: nothing to delete there.
		p.b.Log.Info("an earlier attempt's node holds no volume of that name", "volume", in.VolumeName, "node", in.Node, "answer", kube.StatusText(err))
		return nil
	}
	if err != nil {
		if stage == stageCreate {
			// The status as text and wrapped: its code names the failure.
			return fmt.Errorf("CreateVolume to learn the volume's ID: %w", status.Convert(err).Err())
		}
		return err
	}
	if err := p.deleteVolumeWith(ctx, in.Driver, in.Node, id, in.ProvisionerSecret, requester, in.NamespaceLabels, nil); err != nil {
		return err
	}
	p.b.Metrics.Leaked.WithLabelValues(in.Driver, "deleted").Inc()
	return nil
}

// recoveryState is what recovery remembers of an entry whose re-issued
// CreateVolume failed.
type recoveryState struct {
	fails int       // consecutive failures
	next  time.Time // no attempt in a pass that starts before this
}

// Bounds of the wait between two attempts of one entry.
const (
	recoveryBackoffIntervals = 32
	recoveryBackoffMax       = 10 * time.Minute
)

// recoveryStuckAfter is the failure in a row at which an entry is reported
// as stuck (once: it is still retried).
const recoveryStuckAfter = 3

// recoveryBackoff is the wait after the nth consecutive failure of an
// entry: one interval after the first, doubling after each further one, at
// most recoveryBackoffIntervals intervals or recoveryBackoffMax, whichever
// is shorter (but never under one interval).
func recoveryBackoff(n int, interval time.Duration) time.Duration {
	limit := min(recoveryBackoffIntervals*interval, recoveryBackoffMax)
	if limit < interval {
		limit = interval
	}
	d := interval
	for i := 1; i < n && d < limit; i++ {
		d *= 2
	}
	return min(d, limit)
}

// recoveryFailed counts a failed attempt of volume's entry in the pass
// that started at now and returns the count and the wait before the next.
func (p *Provisioner) recoveryFailed(volume string, now time.Time) (int, time.Duration) {
	interval := p.b.Cfg.RecoveryInterval
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.recFails == nil {
		p.recFails = map[string]recoveryState{}
	}
	st := p.recFails[volume]
	st.fails++
	wait := recoveryBackoff(st.fails, interval)
	// Passes come about one interval apart, give or take a tick's
	// jitter: half an interval of slack makes a wait of k intervals
	// skip exactly k-1 passes.
	st.next = now.Add(wait - interval/2)
	p.recFails[volume] = st
	return st.fails, wait
}

// recoveryDue reports whether volume's entry may be attempted in the pass
// that started at now.
func (p *Provisioner) recoveryDue(volume string, now time.Time) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	st, ok := p.recFails[volume]
	return !ok || !now.Before(st.next)
}

// forgetSettledClaims drops what provisioning remembers per claim (the
// topology asked, the nodes without room) for claims that are no longer
// waiting for a volume: bound, or gone (a deletion seen before an attempt
// in flight remembered something).
func (p *Provisioner) forgetSettledClaims() {
	p.mu.Lock()
	n := len(p.asked) + len(p.noRoom)
	p.mu.Unlock()
	if n == 0 {
		return
	}
	claims, err := p.b.Claims.List(labels.Everything())
	if err != nil {
		return
	}
	waiting := make(map[types.UID]bool, len(claims))
	for _, c := range claims {
		if c.Spec.VolumeName == "" && c.DeletionTimestamp == nil {
			waiting[c.UID] = true
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for uid := range p.asked {
		if !waiting[uid] {
			delete(p.asked, uid)
		}
	}
	for uid := range p.noRoom {
		if !waiting[uid] {
			delete(p.noRoom, uid)
		}
	}
}

// forgetSettled drops the failure counts of entries no longer recorded.
func (p *Provisioner) forgetSettled(intents []intent.Intent) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.recFails) == 0 {
		return
	}
	recorded := make(map[string]bool, len(intents))
	for _, in := range intents {
		recorded[in.Key()] = true
	}
	for v := range p.recFails {
		if !recorded[v] {
			delete(p.recFails, v)
		}
	}
}
