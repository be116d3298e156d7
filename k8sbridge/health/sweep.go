package health

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csibroker/csibroker/k8sbridge/csiparams"
	"github.com/csibroker/csibroker/k8sbridge/internal/drivers"
)

// mode is how a driver's volumes are asked after.
type mode int

const (
	modeNone mode = iota
	// modeHealthList: CSI v1.13's paged ControllerListVolumeHealth (the
	// abnormal volumes), and a paged ListVolumes for the volumes that are
	// gone, when the driver lists volumes.
	modeHealthList
	// modeHealthGet: ControllerGetVolumeHealth per PV.
	modeHealthGet
	// modeConditionList: a paged ListVolumes whose entries carry the
	// legacy volume condition (CSI <= 1.12's VOLUME_CONDITION).
	modeConditionList
	// modeConditionGet: ControllerGetVolume per PV, with the legacy
	// condition in its status.
	modeConditionGet
)

func (m mode) String() string {
	return [...]string{"none", "health-list", "health-get", "condition-list", "condition-get"}[m]
}

// modeOf picks how to ask a driver: v1.13's health RPCs before the legacy
// condition, a listing before a call per volume (one paged sweep costs a
// few calls, not one per volume).
func modeOf(c drivers.Caps) mode {
	switch {
	case c.ListVolumeHealth:
		return modeHealthList
	case c.GetVolumeHealth:
		return modeHealthGet
	case c.VolumeCondition && c.ListVolumes:
		return modeConditionList
	case c.VolumeCondition && c.GetVolume:
		return modeConditionGet
	}
	return modeNone
}

// perVolumeWorkers bounds the calls in flight of a per-volume sweep.
const perVolumeWorkers = 8

// prober asks one driver proxy (a controller, or a node-local driver's
// node) about volumes; calls counts each CSI call by method.
type prober struct {
	conn grpc.ClientConnInterface
	caps drivers.Caps
	// call bounds (and counts) one call of method.
	call func(ctx context.Context, method string) (context.Context, context.CancelFunc)
}

// errSweep wraps what ends a sweep early: nothing is concluded from it.
var errSweep = errors.New("volume health sweep failed")

// probe observes every volume of handles, by the driver's mode. A volume
// missing from the result was not observed (its call failed); an error
// means nothing was observed.
func (p *prober) probe(ctx context.Context, m mode, handles []string) (map[string]seen, error) {
	switch m {
	case modeHealthList:
		return p.healthList(ctx, handles)
	case modeHealthGet:
		return p.each(ctx, handles, p.getHealth)
	case modeConditionList:
		return p.conditionList(ctx, handles)
	case modeConditionGet:
		return p.each(ctx, handles, p.getCondition)
	}
	return nil, nil
}

// conditionList lists the driver's volumes with their legacy conditions;
// a PV's volume not listed is confirmed gone with ControllerGetVolume, if
// the driver has it, or else counted as absent.
func (p *prober) conditionList(ctx context.Context, handles []string) (map[string]seen, error) {
	listed := map[string]seen{}
	err := p.listVolumes(ctx, func(e *csi.ListVolumesResponse_Entry) {
		c, _, _ := csiparams.LegacyCondition(e.GetStatus()) // checked by CheckListVolumesPage
		listed[e.GetVolume().GetVolumeId()] = seen{kind: seenPresent, cond: c}
	})
	if err != nil {
		return nil, err
	}
	return p.resolveMissing(ctx, handles, listed, p.getCondition)
}

// healthList lists the abnormal volumes (every other one is normal) and,
// when the driver lists volumes, which volumes it has.
func (p *prober) healthList(ctx context.Context, handles []string) (map[string]seen, error) {
	abnormal := map[string]csiparams.Condition{}
	if err := p.listHealth(ctx, func(h *csi.VolumeHealth) {
		if c := csiparams.HealthCondition(h); c.Abnormal {
			abnormal[h.GetVolumeId()] = c
		}
	}); err != nil {
		return nil, err
	}
	out := map[string]seen{}
	if !p.caps.ListVolumes {
		// Without a listing of the volumes, one that is gone is not
		// told from a healthy one (the health listing names only
		// abnormal ones), short of a call per volume.
		for _, h := range handles {
			out[h] = seen{kind: seenPresent, cond: abnormal[h]}
		}
		return out, nil
	}
	if err := p.listVolumes(ctx, func(e *csi.ListVolumesResponse_Entry) {
		id := e.GetVolume().GetVolumeId()
		out[id] = seen{kind: seenPresent, cond: abnormal[id]}
	}); err != nil {
		return nil, err
	}
	return p.resolveMissing(ctx, handles, out, p.getHealth)
}

// resolveMissing keeps the observations of handles from listed, and asks
// get about each handle a listing did not hold (if the driver has the
// method; else it is absent).
func (p *prober) resolveMissing(ctx context.Context, handles []string, listed map[string]seen, get func(context.Context, string) (seen, error)) (map[string]seen, error) {
	out := make(map[string]seen, len(handles))
	var missing []string
	for _, h := range handles {
		if s, ok := listed[h]; ok {
			out[h] = s
		} else {
			missing = append(missing, h)
		}
	}
	canGet := p.caps.GetVolumeHealth || p.caps.GetVolume && p.caps.VolumeCondition
	if len(missing) == 0 {
		return out, nil
	}
	if !canGet {
		for _, h := range missing {
			out[h] = seen{kind: seenAbsent}
		}
		return out, nil
	}
	got, err := p.each(ctx, missing, get)
	for h, s := range got {
		out[h] = s
	}
	return out, err
}

// each asks get about every handle, perVolumeWorkers at a time. The
// first failure is returned (with how many failed) beside what was
// observed.
func (p *prober) each(ctx context.Context, handles []string, get func(context.Context, string) (seen, error)) (map[string]seen, error) {
	var mu sync.Mutex
	out := make(map[string]seen, len(handles))
	failed := 0
	var first error
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(perVolumeWorkers)
	for _, h := range handles {
		g.Go(func() error {
			s, err := get(gctx, h)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				if failed++; failed == 1 {
					first = fmt.Errorf("volume %s: %w", h, err)
				}
				return nil
			}
			out[h] = s
			return nil
		})
	}
	_ = g.Wait()
	if failed > 0 {
		return out, fmt.Errorf("%d of %d volumes not observed, first: %w", failed, len(handles), first)
	}
	return out, nil
}

// getCondition is one volume by ControllerGetVolume and its legacy
// condition.
func (p *prober) getCondition(ctx context.Context, handle string) (seen, error) {
	ctx, cancel := p.call(ctx, "ControllerGetVolume")
	defer cancel()
	resp, err := csi.NewControllerClient(p.conn).ControllerGetVolume(ctx, &csi.ControllerGetVolumeRequest{VolumeId: handle})
	if status.Code(err) == codes.NotFound {
		return seen{kind: seenGone}, nil
	}
	if err != nil {
		return seen{}, fmt.Errorf("ControllerGetVolume: %w", err)
	}
	if id := resp.GetVolume().GetVolumeId(); id != "" && id != handle {
		return seen{}, fmt.Errorf("ControllerGetVolume of %s answered for volume %q", handle, id)
	}
	c, _, err := csiparams.LegacyCondition(resp.GetStatus())
	if err != nil {
		return seen{}, fmt.Errorf("ControllerGetVolume: %w", err)
	}
	return seen{kind: seenPresent, cond: c}, nil
}

// getHealth is one volume by ControllerGetVolumeHealth.
func (p *prober) getHealth(ctx context.Context, handle string) (seen, error) {
	ctx, cancel := p.call(ctx, "ControllerGetVolumeHealth")
	defer cancel()
	resp, err := csi.NewControllerClient(p.conn).ControllerGetVolumeHealth(ctx, &csi.ControllerGetVolumeHealthRequest{VolumeId: handle})
	if status.Code(err) == codes.NotFound {
		return seen{kind: seenGone}, nil
	}
	if err != nil {
		return seen{}, fmt.Errorf("ControllerGetVolumeHealth: %w", err)
	}
	if id := resp.GetVolumeHealth().GetVolumeId(); id != "" && id != handle {
		return seen{}, fmt.Errorf("ControllerGetVolumeHealth of %s answered for volume %q", handle, id)
	}
	return seen{kind: seenPresent, cond: csiparams.HealthCondition(resp.GetVolumeHealth())}, nil
}

// listVolumes reads a whole ListVolumes listing, page by checked page.
func (p *prober) listVolumes(ctx context.Context, each func(*csi.ListVolumesResponse_Entry)) error {
	client := csi.NewControllerClient(p.conn)
	token := ""
	for page := 1; ; page++ {
		cctx, cancel := p.call(ctx, "ListVolumes")
		resp, err := client.ListVolumes(cctx, &csi.ListVolumesRequest{MaxEntries: csiparams.ListPageSize, StartingToken: token})
		cancel()
		if err != nil {
			return fmt.Errorf("%w: ListVolumes page %d: %w", errSweep, page, err)
		}
		if err := csiparams.CheckListVolumesPage(resp, token, csiparams.ListPageSize, page); err != nil {
			return fmt.Errorf("%w: %w", errSweep, err)
		}
		for _, e := range resp.GetEntries() {
			each(e)
		}
		if token = resp.GetNextToken(); token == "" {
			return nil
		}
	}
}

// listHealth reads a whole ControllerListVolumeHealth listing.
func (p *prober) listHealth(ctx context.Context, each func(*csi.VolumeHealth)) error {
	client := csi.NewControllerClient(p.conn)
	token := ""
	for page := 1; ; page++ {
		cctx, cancel := p.call(ctx, "ControllerListVolumeHealth")
		resp, err := client.ControllerListVolumeHealth(cctx, &csi.ControllerListVolumeHealthRequest{MaxEntries: csiparams.ListPageSize, StartingToken: token})
		cancel()
		if err != nil {
			return fmt.Errorf("%w: ControllerListVolumeHealth page %d: %w", errSweep, page, err)
		}
		if err := csiparams.CheckVolumeHealthPage(resp, token, csiparams.ListPageSize, page); err != nil {
			return fmt.Errorf("%w: %w", errSweep, err)
		}
		for _, h := range resp.GetEntries() {
			each(h)
		}
		if token = resp.GetNextToken(); token == "" {
			return nil
		}
	}
}
