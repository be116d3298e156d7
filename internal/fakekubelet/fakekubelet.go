// Package fakekubelet is the plugin-registration half of a kubelet, for
// tests: it watches a plugin registry directory as the kubelet's plugin
// watcher does, and registers each CSI plugin that appears there over the
// kubelet's own API (k8s.io/kubelet/pkg/apis/pluginregistration/v1):
// dial the new socket, GetInfo, check the plugin's type and versions as
// the kubelet's CSI handler does, call the advertised endpoint's
// NodeGetInfo (what the kubelet writes into the CSINode object), and
// NotifyRegistrationStatus. A socket that is removed deregisters its
// plugin; one re-created at the same path registers it again.
//
// It polls the directory (every Interval) where the kubelet uses inotify:
// the order of what it sees is the same, only later. It must not be used
// outside tests, and knows nothing of csibroker.
package fakekubelet

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// Event is one thing the kubelet did.
type Event struct {
	// Kind is "registered", "refused" or "deregistered".
	Kind   string
	Socket string // the registration socket
	Name   string // the plugin's name from GetInfo
	// Endpoint is the plugin's advertised socket; NodeID and Topology its
	// NodeGetInfo answer (registered only).
	Endpoint string
	NodeID   string
	Topology map[string]string
	Err      string // refused only
}

// Kubelet watches Dir.
type Kubelet struct {
	Dir      string
	Interval time.Duration // default 50ms
	Timeout  time.Duration // of each call; default 2s

	mu     sync.Mutex
	events []Event
	seen   map[string]sockID // registration sockets seen, by path
	names  map[string]string // the plugin registered from each socket
	notify chan struct{}
}

type sockID struct {
	ino   uint64
	ctime int64
}

// Run watches until ctx is done.
func (k *Kubelet) Run(ctx context.Context) {
	if k.Interval <= 0 {
		k.Interval = 50 * time.Millisecond
	}
	if k.Timeout <= 0 {
		k.Timeout = 2 * time.Second
	}
	t := time.NewTicker(k.Interval)
	defer t.Stop()
	for {
		k.scan(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// scan is one look at the directory.
func (k *Kubelet) scan(ctx context.Context) {
	k.mu.Lock()
	if k.seen == nil {
		k.seen, k.names = map[string]sockID{}, map[string]string{}
	}
	k.mu.Unlock()
	entries, _ := os.ReadDir(k.Dir)
	now := map[string]sockID{}
	for _, e := range entries {
		p := filepath.Join(k.Dir, e.Name())
		var st unix.Stat_t
		// The kubelet skips files that are not sockets and names that
		// start with a dot.
		if strings.HasPrefix(e.Name(), ".") || unix.Stat(p, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFSOCK {
			continue
		}
		now[p] = sockID{st.Ino, st.Ctim.Nano()}
	}
	k.mu.Lock()
	seen := maps.Clone(k.seen)
	k.mu.Unlock()
	for p := range seen {
		if _, ok := now[p]; !ok {
			k.deregister(p)
		}
	}
	for p, id := range now {
		if old, ok := seen[p]; ok && old == id {
			continue
		}
		if _, ok := seen[p]; ok {
			k.deregister(p) // re-created: the kubelet registers it anew
		}
		k.mu.Lock()
		k.seen[p] = id
		k.mu.Unlock()
		k.register(ctx, p)
	}
}

// register does what the kubelet's reconciler and CSI handler do for a
// new socket.
func (k *Kubelet) register(ctx context.Context, sock string) {
	ctx, cancel := context.WithTimeout(ctx, k.Timeout)
	defer cancel()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		k.add(Event{Kind: "refused", Socket: sock, Err: err.Error()})
		return
	}
	defer conn.Close()
	client := registerapi.NewRegistrationClient(conn)
	info, err := client.GetInfo(ctx, &registerapi.InfoRequest{})
	if status.Code(err) == codes.Unavailable && ctx.Err() == nil {
		// Not listening yet (a socket is bound before it listens): the
		// kubelet's reconciler tries again, and so does the next scan.
		k.mu.Lock()
		delete(k.seen, sock)
		k.mu.Unlock()
		return
	}
	if err != nil {
		k.add(Event{Kind: "refused", Socket: sock, Err: fmt.Sprintf("GetInfo: %v", err)})
		return
	}
	ev := Event{Kind: "registered", Socket: sock, Name: info.GetName(), Endpoint: info.GetEndpoint()}
	if err := k.validate(ctx, info, &ev); err != nil {
		ev.Kind, ev.Err = "refused", err.Error()
		_, _ = client.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: false, Error: err.Error()})
		k.add(ev)
		return
	}
	if _, err := client.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
		ev.Kind, ev.Err = "refused", fmt.Sprintf("NotifyRegistrationStatus: %v", err)
		k.add(ev)
		return
	}
	k.mu.Lock()
	k.names[sock] = ev.Name
	k.mu.Unlock()
	k.add(ev)
}

// validate checks the plugin as the kubelet's CSI handler does: its type,
// a CSI 1.x version, a name, and an endpoint that answers NodeGetInfo.
func (k *Kubelet) validate(ctx context.Context, info *registerapi.PluginInfo, ev *Event) error {
	if info.GetType() != registerapi.CSIPlugin {
		return fmt.Errorf("plugin type %q is not %s", info.GetType(), registerapi.CSIPlugin)
	}
	if !slices.ContainsFunc(info.GetSupportedVersions(), func(v string) bool {
		return v == "1.0.0" || strings.HasPrefix(v, "1.")
	}) {
		return fmt.Errorf("none of the versions %v is a CSI 1.x version", info.GetSupportedVersions())
	}
	if info.GetName() == "" || info.GetEndpoint() == "" {
		return errors.New("plugin without a name or endpoint")
	}
	conn, err := grpc.NewClient("unix://"+info.GetEndpoint(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ni, err := csi.NewNodeClient(conn).NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil {
		return fmt.Errorf("NodeGetInfo on %s: %w", info.GetEndpoint(), err)
	}
	ev.NodeID, ev.Topology = ni.GetNodeId(), ni.GetAccessibleTopology().GetSegments()
	return nil
}

func (k *Kubelet) deregister(sock string) {
	k.mu.Lock()
	name, ok := k.names[sock]
	delete(k.names, sock)
	delete(k.seen, sock)
	k.mu.Unlock()
	if ok {
		k.add(Event{Kind: "deregistered", Socket: sock, Name: name})
	}
}

func (k *Kubelet) add(ev Event) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.events = append(k.events, ev)
	if k.notify != nil {
		close(k.notify)
		k.notify = nil
	}
}

// Events returns what the kubelet did so far.
func (k *Kubelet) Events() []Event {
	k.mu.Lock()
	defer k.mu.Unlock()
	return slices.Clone(k.events)
}

// Registered returns the plugins registered now, by name.
func (k *Kubelet) Registered() map[string]string {
	k.mu.Lock()
	defer k.mu.Unlock()
	out := map[string]string{}
	for sock, name := range k.names {
		out[name] = sock
	}
	return out
}

// WaitEvent waits until there are more than n events, or ctx is done, and
// returns the events.
func (k *Kubelet) WaitEvent(ctx context.Context, n int) ([]Event, error) {
	for {
		k.mu.Lock()
		if len(k.events) > n {
			out := slices.Clone(k.events)
			k.mu.Unlock()
			return out, nil
		}
		if k.notify == nil {
			k.notify = make(chan struct{})
		}
		ch := k.notify
		k.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return k.Events(), fmt.Errorf("waiting for event %d: %w (events so far: %+v)", n+1, ctx.Err(), k.Events())
		}
	}
}
