package provision

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/k8sbridge/csiparams"
	"github.com/csibroker/csibroker/k8sbridge/intent"
	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
	"github.com/csibroker/csibroker/k8sbridge/internal/kube"
	"github.com/csibroker/csibroker/k8sbridge/secrets"
	"github.com/csibroker/csibroker/policy"
)

// attempt is one provisioning attempt of a claim: what its phases learn
// and hand on, in the order they learn it.
type attempt struct {
	p      *Provisioner
	ctx    context.Context
	claim  *corev1.PersistentVolumeClaim
	class  *storagev1.StorageClass
	inTree string
	driver string
	pvName string
	ref    corev1.ObjectReference // the claim, for Events

	// selectedNode is the scheduler's choice (scheduled), or for a
	// node-local driver's Immediate claim the broker's, once placed.
	selectedNode string
	scheduled    bool // the scheduler chose the node, so it can choose again

	caps drivers.Caps // validate

	// earlierAttempt: the record's entry of an earlier attempt, which may
	// have made the volume (nil: none), and what that attempt asked.
	prev  *intent.Intent
	asked *csi.TopologyRequirement
	// gone is an earlier attempt's entry on a node deleted since
	// (placeNodeLocal).
	gone *intent.Intent

	// prepareRequest
	req           *csi.CreateVolumeRequest // without its secrets
	provSecretRef *corev1.SecretReference
	provSource    policy.Source
	requester     policy.Requester
	creds         map[string]string
	snap          *snapshotv1.VolumeSnapshot

	node string // recordIntent: a node-local driver's node, whose proxy is called
	vol  *csi.Volume
}

// outcome ends an attempt: the result label of the provisioning metric and
// the error the claim is retried for. A phase that returns nil lets the
// next one go on.
type outcome struct {
	result string
	err    error
}

func ended(result string, err error) *outcome { return &outcome{result, err} }

// warn logs a failure on every attempt and records it as an Event once per
// failure (EventOnce): a driver's answer is named by its method and code
// (drivers put counters and request IDs in their messages), anything else
// by its message.
func (a *attempt) warn(what, format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	a.p.b.Log.Warn("provisioning failed", "claim", a.claim.Namespace+"/"+a.claim.Name, "driver", a.driver, "err", msg)
	a.p.b.EventOnce(a.ctx, a.ref, corev1.EventTypeWarning, "ProvisioningFailed", what, "%s", msg)
}

// failAs fails the attempt with a failure named by what ("": by the
// message).
func (a *attempt) failAs(what, format string, args ...any) *outcome {
	err := fmt.Errorf(format, args...)
	msg := fmt.Sprintf("failed to provision volume with StorageClass %q: %v", a.class.Name, err)
	if what == "" {
		what = msg
	}
	a.warn(what, "%s", msg)
	return ended("failed", err)
}

func (a *attempt) fail(format string, args ...any) *outcome { return a.failAs("", format, args...) }

// failUnlessEnded fails the attempt with err, or, when the term (or the
// process) has ended under it, ends it quietly: that is not the claim's
// fault.
func (a *attempt) failUnlessEnded(err error, format string, args ...any) *outcome {
	if a.ctx.Err() != nil {
		return ended("failed", err)
	}
	return a.fail(format, args...)
}

// reschedule hands the claim back to the scheduler.
func (a *attempt) reschedule() *outcome {
	if err := a.p.reschedule(a.ctx, a.claim); err != nil {
		return ended("rescheduled", err)
	}
	return ended("rescheduled", nil)
}

// validate refuses what cannot be provisioned at all, and learns the
// driver's capabilities.
func (a *attempt) validate() *outcome {
	if a.claim.Spec.Selector != nil {
		// As external-provisioner: a provisioned PV would ignore it.
		return a.fail("claim Selector is not supported")
	}
	if ref := a.claim.Spec.DataSourceRef; ref != nil && ref.Namespace != nil && *ref.Namespace != "" && *ref.Namespace != a.claim.Namespace {
		// The API server leaves such a reference out of spec.dataSource:
		// provisioned as it stands, the volume would be empty.
		return a.fail("data source %s %s/%s in another namespace is not supported", ref.Kind, *ref.Namespace, ref.Name)
	}
	caps, err := a.p.b.Caps.Get(a.ctx, a.driver)
	if err != nil {
		a.p.b.Caps.Forget(a.driver)
		return a.failAs(kube.FailureOf("CreateVolume", drivers.NewUnreachable(err)), "driver %s is not reachable: %v", a.driver, err)
	}
	if !caps.CreateDelete {
		return a.fail("driver %s does not support CreateVolume (no CREATE_DELETE_VOLUME capability)", a.driver)
	}
	a.caps = caps
	return nil
}

// earlierAttempt reads the record as the API server has it (once per
// term). An entry there already is an earlier attempt's (this leader's or
// the previous one's) that may have made the volume (on prev.Node, for a
// node-local driver): whatever this attempt's answer, the entry stays until
// that volume is accounted for. The topology that attempt asked is asked
// again; without one, a selected node that is gone goes back to the
// scheduler.
func (a *attempt) earlierAttempt() *outcome {
	p, claim := a.p, a.claim
	prev, earlier, err := p.b.Intents.Lookup(a.ctx, a.pvName)
	if err != nil {
		return a.fail("read the intent record: %v", err)
	}
	if earlier {
		a.prev = &prev
	}
	// What an earlier attempt of this claim asked, while its entry says
	// its volume may exist (a requirement remembered from before another
	// replica led is not: that replica's answers settled the entry).
	if earlier && prev.ClaimUID == string(claim.UID) && !prev.Superseded {
		a.asked = p.askedBefore(claim.UID, a.driver, a.caps)
	} else {
		p.setAsked(claim.UID, nil)
	}
	if !a.scheduled || a.asked != nil {
		return nil
	}
	// As external-provisioner, a node that is gone, or (for a driver with
	// topology) that has no CSINode, whose topology is then unknown, is
	// handed back to the scheduler. The intent record keeps any entry of
	// an earlier attempt: the volume it may have made is still accounted
	// for.
	what, why := "", ""
	switch {
	case p.nodeGone(a.ctx, a.selectedNode):
		what, why = "node gone "+a.selectedNode, "no longer exists"
	case a.caps.Accessibility && p.csiNodeGone(a.ctx, a.selectedNode):
		what, why = "no CSINode "+a.selectedNode, "has no CSINode object (no CSI driver registered there)"
	}
	if why == "" {
		return nil
	}
	a.warn(what, "failed to provision volume with StorageClass %q: selected node %q %s; asking the scheduler for another node", a.class.Name, a.selectedNode, why)
	return a.reschedule()
}

// placeNodeLocal settles, for a node-local driver, the node whose proxy
// makes the volume: where an earlier attempt may have made it, unless that
// node is gone, has no room, or the scheduler moved the claim (the earlier
// volume is deleted there first); for an Immediate claim, the broker's
// choice.
func (a *attempt) placeNodeLocal() *outcome {
	p, prev := a.p, a.prev
	if !p.b.Cfg.Drivers.NodeLocal(a.driver) {
		return nil
	}
	if prev != nil && prev.Node != "" && prev.ClaimUID == string(a.claim.UID) {
		// An earlier attempt asked prev.Node's proxy for this volume and
		// may have made it there (its answer was "may still be in
		// progress", or the broker stopped before the answer).
		switch {
		case p.nodeGone(a.ctx, prev.Node):
			// Nobody can reach that volume now; its entry is kept under a
			// key of its own (superseded) when this attempt is recorded,
			// so that recovery deletes the volume if the node comes back
			// under its name.
			a.gone = prev
			p.b.Event(a.ctx, a.ref, corev1.EventTypeWarning, "ProvisioningOrphan",
				"an earlier attempt may have made volume %s on node %s, which no longer exists; the claim is provisioned anew, and that volume is deleted if the node comes back", a.pvName, prev.Node)
			p.b.Log.Warn("an earlier attempt's node is gone; provisioning anew", "claim", a.claim.Namespace+"/"+a.claim.Name, "volume", a.pvName, "node", prev.Node)
		case a.selectedNode == "" && slices.Contains(p.noRoomNodes(a.claim.UID), prev.Node):
			// Placed by the broker on a node that has since answered it
			// has no room: the volume the earlier attempt may have made
			// there is deleted first, and the claim placed anew.
			if err := p.undoOnNode(a.ctx, *prev); err != nil {
				return a.failAs(kube.FailureOf("undo on "+prev.Node, err), "an earlier attempt may have made volume %s on node %s, which has no room now; it must be deleted there before the claim is placed on another node: %v", a.pvName, prev.Node, err)
			}
		case a.selectedNode == "":
			// Placed by the broker: finish on the same node.
			a.selectedNode = prev.Node
		case a.selectedNode != prev.Node:
			// The scheduler moved the claim: the volume the earlier
			// attempt may have made is deleted there first.
			if err := p.undoOnNode(a.ctx, *prev); err != nil {
				return a.failAs(kube.FailureOf("undo on "+prev.Node, err), "an earlier attempt may have made volume %s on node %s; it must be deleted there before the volume is made on node %s: %v", a.pvName, prev.Node, a.selectedNode, err)
			}
			p.b.Log.Info("the volume an earlier attempt may have made on another node is deleted there, or was never made", "volume", a.pvName, "node", prev.Node, "selected_node", a.selectedNode)
		}
	}
	if a.selectedNode == "" {
		// Immediate claim of a node-local driver: the broker places it.
		node, err := p.placeOnNode(a.ctx, a.claim, a.class, a.driver, a.caps)
		if err != nil {
			return a.fail("%v", err)
		}
		a.selectedNode = node
	}
	return nil
}

// prepareRequest builds the CreateVolumeRequest, decides its secrets (the
// provisioner secret, fetched, and the node secrets that go into the PV)
// and protects a clone's or a restore's source until the copy is done.
func (a *attempt) prepareRequest() *outcome {
	p, claim, class := a.p, a.claim, a.class
	req, provSecretRef, snap, err := p.buildRequest(a.ctx, claim, class, a.driver, a.pvName, a.selectedNode, a.caps, a.asked)
	if err != nil {
		return a.fail("%v", err)
	}
	a.req, a.provSecretRef, a.snap = req, provSecretRef, snap
	// The namespace's labels decide now and are recorded (intent entry,
	// PV) for decisions after the namespace is gone: the same labels, read
	// once, from the API server if the cache has not got the namespace
	// yet.
	a.requester = policy.Requester{Kind: policy.KindPersistentVolumeClaim, Namespace: claim.Namespace, Name: claim.Name, Labels: claim.Labels, StorageClass: class.Name,
		NamespaceLabels: p.b.ReadNamespaceLabels(a.ctx, claim.Namespace)}
	if p.b.Cfg.Drivers.NodeLocal(a.driver) {
		// The call goes to this node's proxy: a grant's requesters.nodes
		// can say which nodes' proxies may receive the secret.
		a.requester.Node = a.selectedNode
	}
	a.provSource = secrets.PolicySource(secrets.Provisioner, class.Parameters)
	creds, err := p.b.FetchSecret(a.ctx, kube.SecretUse{Driver: a.driver, Op: policy.OpCreateVolume, Ref: provSecretRef, Source: a.provSource, Requester: a.requester})
	if err != nil {
		return a.fail("%v", err)
	}
	a.creds = creds
	// The node secrets go into the PV, where the kubelet reads them for the
	// node plugin: writing them there is their use, so they are decided
	// now, before any volume exists.
	for _, k := range []struct {
		kind secrets.Kind
		op   policy.Operation
	}{{secrets.NodeStage, policy.OpNodeStageVolume}, {secrets.NodePublish, policy.OpNodePublishVolume}, {secrets.NodeExpand, policy.OpNodeExpandVolume}} {
		ref, err := secrets.Ref(k.kind, class.Parameters, a.pvName, claim)
		if err != nil {
			return a.fail("storageclass %q: %v", class.Name, err)
		}
		if ref == nil {
			continue
		}
		if err := p.b.DecideSecret(a.ctx, kube.SecretUse{Driver: a.driver, Op: k.op, Ref: ref, Source: secrets.PolicySource(k.kind, class.Parameters), Requester: a.requester}); err != nil {
			return a.fail("%v (the secret would go into the PV for the kubelet)", err)
		}
	}
	// A clone's or a restore's source stays until the copy is done:
	// deleting it now waits (SourceProtector releases it once no claim
	// copying it is pending).
	if err := p.protectSource(a.ctx, claim, snap); err != nil {
		return a.failUnlessEnded(err, "%v", err)
	}
	return nil
}

// recordIntent makes the intent durable before the call: from here on the
// volume is never forgotten. The entry of an attempt on a node that is gone
// is kept under a key of its own; an earlier attempt's requests of the same
// volume join this entry.
func (a *attempt) recordIntent() *outcome {
	p, claim := a.p, a.claim
	stored := proto.Clone(a.req).(*csi.CreateVolumeRequest)
	stored.Secrets = nil
	stored.AccessibilityRequirements = recordedTopology(a.req.AccessibilityRequirements)
	raw, err := proto.Marshal(stored)
	if err != nil {
		return a.fail("encode request: %v", err)
	}
	if p.b.Cfg.Drivers.NodeLocal(a.driver) {
		a.node = a.selectedNode
	}
	if gone := a.gone; gone != nil && gone.Node != a.node {
		kept := *gone
		kept.Superseded = true
		if err := p.b.Intents.Add(a.ctx, kept); err != nil {
			return a.failUnlessEnded(err, "keep the intent of the attempt on node %s, which is gone, before provisioning anew: %v", gone.Node, err)
		}
	}
	entry := intent.Intent{VolumeName: a.pvName, Driver: a.driver, ClaimNamespace: claim.Namespace, ClaimName: claim.Name, ClaimUID: string(claim.UID),
		StorageClass: a.class.Name, Request: raw, ProvisionerSecret: a.provSecretRef, Node: a.node, NamespaceLabels: a.requester.NamespaceLabels, Created: metav1.Now()}
	if a.provSecretRef != nil {
		entry.ClaimLabels, entry.SecretSource = claim.Labels, &a.provSource
	}
	if a.prev != nil && a.gone == nil && a.prev.Node == a.node && a.prev.ClaimUID == string(claim.UID) {
		// The same volume, asked for again: an earlier request (other
		// topology, say) may be the one that made it.
		entry = intent.WithEarlier(entry, *a.prev)
	}
	folded := ""
	if a.node != "" {
		// Back on a node an attempt was superseded on (it was gone, and
		// registered again): that attempt's requests join this entry's.
		if kept, ok := p.b.Intents.Get(intent.Intent{VolumeName: a.pvName, Node: a.node, Superseded: true}.Key()); ok && kept.ClaimUID == string(claim.UID) {
			entry, folded = intent.WithEarlier(entry, kept), kept.Key()
		}
	}
	if err := p.b.Intents.Add(a.ctx, entry); err != nil {
		// Nothing was called yet: back off and try again.
		return a.failUnlessEnded(err, "record the intent to create volume %s before calling the driver: %v", a.pvName, err)
	}
	if folded != "" {
		p.b.Intents.Remove(folded)
	}
	p.b.EventOnce(a.ctx, a.ref, corev1.EventTypeNormal, "Provisioning", a.selectedNode, "External provisioner is provisioning volume for claim %q", claim.Namespace+"/"+claim.Name)
	return nil
}

// forget drops the entry after a refusal, unless an earlier attempt may
// have made the volume.
func (a *attempt) forget() {
	if a.prev != nil {
		a.p.b.Log.Info("CreateVolume refused; intent entry kept", "claim", a.claim.Namespace+"/"+a.claim.Name, "volume", a.pvName,
			"why", "an earlier attempt may have made the volume (recovery deletes it if the claim goes)")
		return
	}
	a.p.b.Intents.Remove(a.pvName)
}

// call asks the driver for the volume, with the provisioner secret, and
// classifies a failure as external-provisioner does: in progress (the
// entry stays, the same request is asked again), reschedule, or final.
func (a *attempt) call() *outcome {
	p := a.p
	conn, err := p.conn(a.driver, a.node)
	if err != nil {
		return a.fail("%v", err)
	}
	callCtx, cancel := p.b.CallContext(a.ctx, a.driver, "CreateVolume")
	a.req.Secrets = a.creds
	resp, err := csi.NewControllerClient(conn).CreateVolume(callCtx, a.req)
	cancel()
	a.req.Secrets = nil
	if err == nil {
		a.vol = resp.GetVolume()
		if cerr := csiparams.CheckCreatedVolume(a.vol); errors.Is(cerr, csiparams.ErrNoVolumeID) {
			// Answered, but naming no volume: one may exist under this
			// name, so the entry stays and the same request is asked
			// again (an answer with an ID but unusable otherwise is
			// deleted by wrongVolume).
			p.setAsked(a.claim.UID, a.req.AccessibilityRequirements)
			a.warn("CreateVolume answer without a volume ID", "failed to provision volume with StorageClass %q: %v; retrying with the same name", a.class.Name, cerr)
			return ended("in_progress", cerr)
		}
		return nil
	}
	if status.Code(err) == codes.ResourceExhausted {
		// The objects said there was room: refreshed now, not at the
		// next poll.
		p.b.NoteVolumeChange(kube.VolumeChange{Driver: a.driver, Class: a.class.Name, Node: a.node})
		if a.node != "" && !a.scheduled {
			p.noteNoRoom(a.claim.UID, a.node) // placed by the broker: another node next
		}
	}
	failure := kube.FailureOf("CreateVolume", err)
	class := csiparams.ClassifyCreateError(err, a.caps.Accessibility && a.scheduled)
	if class == csiparams.CreateInProgress {
		p.setAsked(a.claim.UID, a.req.AccessibilityRequirements)
	} else {
		p.setAsked(a.claim.UID, nil) // a final answer: the next attempt asks anew
	}
	switch class {
	case csiparams.CreateInProgress:
		// The volume may still appear: keep the intent and re-issue the
		// same request later.
		a.warn(failure, "failed to provision volume with StorageClass %q: %s (may still be in progress; retrying with the same name)", a.class.Name, kube.StatusText(err))
		return ended("in_progress", err)
	case csiparams.CreateReschedule:
		a.forget()
		a.warn(failure+" reschedule from "+a.selectedNode, "failed to provision volume with StorageClass %q: %s; asking the scheduler for another node", a.class.Name, kube.StatusText(err))
		return a.reschedule()
	default:
		a.forget()
		a.warn(failure, "failed to provision volume with StorageClass %q: %s", a.class.Name, kube.StatusText(err))
		return ended("failed", err)
	}
}

// recordResult ends an attempt whose volume exists: discarded if its claim
// went meanwhile or the driver made the wrong volume, else its PV saved and
// the intent removed.
func (a *attempt) recordResult() *outcome {
	p := a.p
	// The volume exists: until its PV is saved, a retry asks the same.
	p.setAsked(a.claim.UID, a.req.AccessibilityRequirements)
	made := kube.VolumeChange{Driver: a.driver, Node: a.node}
	for _, t := range a.vol.GetAccessibleTopology() {
		made.Topo = append(made.Topo, t.GetSegments())
	}
	p.b.NoteVolumeChange(made)
	if p.AfterCreate != nil {
		p.AfterCreate(a.ctx, a.pvName)
		if a.ctx.Err() != nil {
			return ended("failed", a.ctx.Err())
		}
	}
	if o := a.claimGoneMeanwhile(); o != nil {
		return o
	}
	if o := a.wrongVolume(); o != nil {
		return o
	}
	return a.savePV()
}

// claimGoneMeanwhile deletes the volume of a claim that went while the
// driver worked, instead of leaving a PV for nobody. The informer cache is
// asked, not the API server (a read costs a token of the client's QPS
// budget); a deletion it has not seen yet leaves a PV whose claim is gone,
// which the PV controller releases and the deleter then deletes.
func (a *attempt) claimGoneMeanwhile() *outcome {
	p, claim, volID := a.p, a.claim, a.vol.GetVolumeId()
	cur, gerr := p.b.Claims.PersistentVolumeClaims(claim.Namespace).Get(claim.Name)
	if !apierrors.IsNotFound(gerr) && (gerr != nil || (cur.UID == claim.UID && cur.DeletionTimestamp == nil)) {
		return nil
	}
	// An earlier attempt (the previous leader's, whose PV the cache has
	// not shown yet) may have made the PV: its reclaim policy decides
	// then, not this attempt.
	held, rerr, derr := p.discardVolume(a.ctx, a.driver, a.node, a.pvName, volID, a.provSecretRef, a.requester)
	switch {
	case rerr != nil:
		p.b.Log.Warn("claim deleted during provisioning; whether its PV holds the volume is unknown", "claim", claim.Namespace+"/"+claim.Name, "pv", a.pvName, "err", rerr,
			"then", "the intent record keeps it; retried")
		return ended("failed", rerr)
	case held:
		p.b.Log.Info("claim deleted during provisioning; its PV exists", "claim", claim.Namespace+"/"+claim.Name, "pv", a.pvName,
			"then", "the volume is left to the PV's reclaim policy")
		return ended("claim_deleted", nil)
	case derr != nil:
		p.b.Log.Error("claim deleted during provisioning; deleting its volume failed", "claim", claim.Namespace+"/"+claim.Name, "driver", a.driver, "volume", volID, "err", derr,
			"then", "the intent record keeps it; recovery retries")
		p.b.Metrics.Leaked.WithLabelValues(a.driver, "failed").Inc()
		return ended("failed", derr)
	}
	p.b.Log.Info("claim deleted during provisioning; its volume was deleted", "claim", claim.Namespace+"/"+claim.Name, "volume", volID)
	p.b.Metrics.Leaked.WithLabelValues(a.driver, "deleted").Inc()
	return ended("claim_deleted", nil)
}

// wrongVolume, as external-provisioner, deletes a volume smaller than asked
// for (it would never be bound) or a clone without its source's content
// (the claim would get an empty volume), and the attempt is retried.
func (a *attempt) wrongVolume() *outcome {
	wrong := ""
	if got, want := a.vol.GetCapacityBytes(), a.req.GetCapacityRange().GetRequiredBytes(); got != 0 && got < want {
		wrong = fmt.Sprintf("created volume capacity %d less than requested capacity %d", got, want)
	} else if a.req.GetVolumeContentSource() != nil && a.vol.GetContentSource() == nil {
		wrong = "volume content source missing in the driver's answer"
	} else if err := csiparams.CheckCreatedVolume(a.vol); err != nil {
		wrong = err.Error()
	}
	if wrong == "" {
		return nil
	}
	held, rerr, derr := a.p.discardVolume(a.ctx, a.driver, a.node, a.pvName, a.vol.GetVolumeId(), a.provSecretRef, a.requester)
	switch {
	case rerr != nil:
		return a.failAs(wrong+", PV unknown", "%s; whether a PersistentVolume holds it could not be read: %v", wrong, rerr)
	case held:
		return ended("success", nil)
	case derr != nil:
		// The retry gets the same volume back and tries again; recovery
		// deletes it if the claim goes.
		return a.failAs(wrong+", delete failed", "%s; deleting it failed: %v", wrong, derr)
	}
	return a.failAs(wrong, "%s; the volume was deleted", wrong)
}

// savePV saves the volume's PV and removes the intent: the claim is
// provisioned.
func (a *attempt) savePV() *outcome {
	p, volID := a.p, a.vol.GetVolumeId()
	pv, err := p.buildPV(a.claim, a.class, a.inTree, a.driver, a.pvName, a.vol, a.req, a.provSecretRef)
	if err != nil {
		return a.fail("%v", err)
	}
	a.placePV(pv)
	_, err = p.b.Cfg.Client.CoreV1().PersistentVolumes().Create(a.ctx, pv, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		// An earlier attempt (the previous leader's, or this leader's
		// whose PV the cache has not shown yet) saved the PV: it must hold
		// the volume this attempt made, or that volume is a second one
		// nothing accounts for.
		err = p.settleExistingPV(a.ctx, a.claim, a.driver, a.node, a.pvName, volID, a.provSecretRef, a.requester)
		if err != nil {
			a.warn(kube.FailureOf("save PV", err), "volume %s was created but PersistentVolume %s exists already: %v", volID, a.pvName, err)
			return ended("failed", err) // intent kept: recovery deletes the second volume
		}
	}
	if err != nil {
		// Intent kept: the next attempt re-issues CreateVolume (same name,
		// same volume) and tries the PV again.
		a.warn("save PV "+string(apierrors.ReasonForError(err)), "volume %s was created but saving PersistentVolume %s failed: %v (retrying)", volID, a.pvName, err)
		return ended("failed", err)
	}
	p.b.Intents.Remove(a.pvName)
	p.b.Event(a.ctx, a.ref, corev1.EventTypeNormal, "ProvisioningSucceeded", "Successfully provisioned volume %s", a.pvName)
	p.b.ForgetEvents(a.claim.UID)
	return ended("success", nil)
}

// placePV writes into pv where its volume is: a node-local volume's node,
// the claim's namespace labels (for decisions after the namespace is
// gone), and the node affinity.
func (a *attempt) placePV(pv *corev1.PersistentVolume) {
	if a.node != "" {
		// Deletion goes to this node's proxy, whatever topology the driver reports.
		pv.Annotations[kube.AnnVolumeNode] = a.node
	}
	if labels := a.requester.NamespaceLabels; labels != nil {
		if b, err := json.Marshal(labels); err == nil {
			pv.Annotations[kube.AnnNamespaceLabels] = string(b)
		}
	}
	if !a.caps.Accessibility {
		// As external-provisioner: the topology a driver without
		// VOLUME_ACCESSIBILITY_CONSTRAINTS reports names no node labels it
		// promised, and an affinity on it could match no node.
		pv.Spec.NodeAffinity = nil
	}
	if a.node != "" && pv.Spec.NodeAffinity == nil {
		// A node-local volume is reachable from its node only: the node's
		// hostname label, which need not be its name.
		host := a.node
		if n, err := a.p.b.Nodes.Get(a.node); err == nil && n.Labels[corev1.LabelHostname] != "" {
			host = n.Labels[corev1.LabelHostname]
		}
		pv.Spec.NodeAffinity = &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
			MatchExpressions: []corev1.NodeSelectorRequirement{{Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpIn, Values: []string{host}}}}}}}
	}
}
