package k8sbridge

import (
	"context"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/csibroker/csibroker/policy"
)

// recoveryLoop settles the intent record: entries whose PV exists are
// dropped, entries of pending claims are provisioned as usual, and entries
// whose claim is gone have their volume deleted (the request is re-issued,
// which CSI makes idempotent by name, to learn the volume's ID). It runs when
// leadership starts, when a claim is deleted, and every RecoveryInterval.
func (p *provisioner) recoveryLoop(ctx context.Context) {
	t := time.NewTicker(p.b.cfg.RecoveryInterval)
	defer t.Stop()
	for {
		p.recoverOnce(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-p.recover:
			// Let a burst of deletions arrive before reading the record.
			if !sleepCtx(ctx, 200*time.Millisecond) {
				return
			}
		}
	}
}

func (p *provisioner) recoverOnce(ctx context.Context) {
	intents, err := p.b.intents.List(ctx)
	if err != nil {
		p.b.log.Error("recovery: cannot read the intent record", "err", err)
		return
	}
	for _, in := range intents {
		if ctx.Err() != nil {
			return
		}
		if p.isInflight(in.VolumeName) {
			continue
		}
		if _, err := p.b.volumes.Get(in.VolumeName); err == nil {
			p.b.intents.Remove(in.VolumeName)
			continue
		}
		claim, err := p.b.claims.PersistentVolumeClaims(in.ClaimNamespace).Get(in.ClaimName)
		if err == nil && string(claim.UID) == in.ClaimUID && claim.DeletionTimestamp == nil {
			if claim.Spec.VolumeName == "" {
				p.queue.Add(in.ClaimNamespace + "/" + in.ClaimName)
			}
			continue
		}
		// The cache says the claim is gone; make sure before deleting.
		cur, gerr := p.b.cfg.Client.CoreV1().PersistentVolumeClaims(in.ClaimNamespace).Get(ctx, in.ClaimName, metav1.GetOptions{})
		if gerr == nil && string(cur.UID) == in.ClaimUID && cur.DeletionTimestamp == nil {
			continue
		}
		if gerr != nil && !apierrors.IsNotFound(gerr) {
			continue
		}
		p.deleteOrphan(ctx, in)
	}
}

func (p *provisioner) deleteOrphan(ctx context.Context, in Intent) {
	if !p.acquire(in.Driver, in.VolumeName) {
		return
	}
	defer p.release(in.Driver, in.VolumeName)
	log := p.b.log.With("volume", in.VolumeName, "driver", in.Driver, "claim", in.ClaimNamespace+"/"+in.ClaimName)
	ctx, span := p.b.tracer.Start(ctx, "recover "+in.VolumeName)
	defer span.End()
	req := &csi.CreateVolumeRequest{}
	if err := proto.Unmarshal(in.Request, req); err != nil {
		log.Error("recovery: unreadable recorded request; leaving the entry for an admin", "err", err)
		return
	}
	requester := policy.Requester{Kind: policy.KindPersistentVolumeClaim, Namespace: in.ClaimNamespace, Name: in.ClaimName, StorageClass: in.StorageClass}
	secrets, err := p.b.fetchSecret(ctx, secretUse{driver: in.Driver, op: policy.OpCreateVolume, ref: in.ProvisionerSecret, source: policy.Source{Kind: policy.SourceStatic, Key: "intent record"}, requester: requester, recordedNSLabels: in.NamespaceLabels})
	if err != nil {
		log.Error("recovery: cannot re-issue CreateVolume", "err", err)
		p.b.metrics.leaked.WithLabelValues(in.Driver, "failed").Inc()
		return
	}
	conn, err := p.conn(in.Driver, in.Node)
	if err != nil {
		log.Error("recovery: driver unreachable", "err", err)
		return
	}
	callCtx, cancel := context.WithTimeout(ctx, p.b.cfg.Timeout)
	req.Secrets = secrets
	resp, err := csi.NewControllerClient(conn).CreateVolume(callCtx, req)
	cancel()
	req.Secrets = nil
	if err != nil {
		// Even a final error does not prove that no volume of that name
		// exists (a clone source deleted since, rotated credentials): the
		// entry stays and is retried every pass; after a few failures it is
		// reported so an administrator can look.
		n := p.recoveryFailed(in.VolumeName)
		if n == 3 {
			p.b.metrics.leaked.WithLabelValues(in.Driver, "stuck").Inc()
			log.Error("recovery: cannot learn the volume ID of a claim that no longer exists; the intent record keeps it (delete the entry once the volume is dealt with)",
				"configmap", p.b.cfg.Namespace+"/csibroker-intents", "attempts", n, "err", statusText(err))
		} else {
			log.Warn("recovery: CreateVolume to learn the volume ID failed; will retry", "attempt", n, "err", statusText(err))
		}
		return
	}
	p.mu.Lock()
	delete(p.recFails, in.VolumeName)
	p.mu.Unlock()
	if err := p.deleteVolumeWith(ctx, in.Driver, in.Node, resp.GetVolume().GetVolumeId(), in.ProvisionerSecret, requester, in.NamespaceLabels); err != nil {
		log.Error("recovery: DeleteVolume failed; will retry", "err", err)
		p.b.metrics.leaked.WithLabelValues(in.Driver, "failed").Inc()
		return
	}
	log.Info("recovery: deleted the volume of a claim that no longer exists", "volume_id", resp.GetVolume().GetVolumeId())
	p.b.metrics.leaked.WithLabelValues(in.Driver, "deleted").Inc()
	p.b.intents.Remove(in.VolumeName)
}

// recoveryFailed counts failed recovery attempts per volume.
func (p *provisioner) recoveryFailed(volume string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.recFails == nil {
		p.recFails = map[string]int{}
	}
	p.recFails[volume]++
	return p.recFails[volume]
}
