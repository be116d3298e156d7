package proxy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/csibroker/csibroker/internal/csiname"
	"github.com/csibroker/csibroker/internal/grpcsrv"
)

// DefaultPluginRegistrationDir is the kubelet's plugin registry, where
// Config.PluginRegistrationDir points by default.
const DefaultPluginRegistrationDir = "/var/lib/kubelet/plugins_registry"

// SupportedCSIVersions are the CSI versions the proxy advertises to the
// kubelet for its driver (what node-driver-registrar advertises).
var SupportedCSIVersions = []string{"1.0.0"}

// registrationLimits are the registration server's limits: its one client
// is the kubelet, which makes two small calls per registration.
var registrationLimits = grpcsrv.Limits{
	MaxConcurrentStreams: 8,
	MaxRecvMsgSize:       64 << 10,
	MaxSendMsgSize:       64 << 10,
	MaxHeaderListSize:    64 << 10,
}

// fileID tells one file from another that replaced it at the same path:
// a restarted driver re-creates its socket, which may get the same inode
// number, but not the same change time as well.
type fileID struct {
	dev, ino uint64
	ctime    int64 // nanoseconds
}

// registration registers the driver with the kubelet: it serves the
// kubelet's plugin-registration API on <dir>/<driver>-reg.sock, and
// re-creates that socket when the driver restarts or the socket is removed.
type registration struct {
	driver      *grpc.ClientConn
	target      string // the driver's socket, as the proxy sees it
	dir         string // the kubelet's plugin registry, as the proxy sees it
	kubeletPath string // the driver's socket, as the kubelet sees it
	interval    time.Duration
	timeout     time.Duration // of each GetPluginInfo
	log         *slog.Logger

	// cur, err and driverID are written only by the goroutine that runs
	// sync (run's), under mu; check reads them under mu. sync reads them
	// without it, and never holds it while it calls the driver: a hung
	// driver must not hold up /livez.
	mu  sync.Mutex
	cur *regSocket // nil until the driver has told its name
	err error      // why the socket could not be created, until it is
	// driverID is the driver's socket as it was when cur was created.
	driverID fileID
	// nameErr: the last GetPluginInfo failed (logged once per streak).
	nameErr bool
}

// regSocket is one registration socket and the server on it.
type regSocket struct {
	name string // the driver's name, as GetPluginInfo told it
	path string
	id   fileID // the socket file as created
	srv  *grpc.Server
}

// run registers the driver until ctx is done, then removes the
// registration socket (so the kubelet deregisters the driver).
func (r *registration) run(ctx context.Context) {
	r.log.Info("registering the driver with the kubelet", "registration_dir", r.dir, "kubelet_registration_path", r.kubeletPath)
	t := time.NewTicker(r.interval)
	defer t.Stop()
	for {
		r.sync(ctx)
		select {
		case <-ctx.Done():
			r.mu.Lock()
			defer r.mu.Unlock()
			if r.cur != nil && r.cur.srv != nil {
				r.close(r.cur)
				r.log.Info("registration socket removed: the kubelet deregisters the driver", "socket", r.cur.path)
				r.cur = nil
			}
			return
		case <-t.C:
		}
	}
}

// sync is one look at the driver's socket and the registration socket:
// register when the driver first answers, register again when its socket
// is a new one (it restarted) or ours was removed.
func (r *registration) sync(ctx context.Context) {
	id, err := statID(r.target)
	switch {
	case err != nil && r.cur == nil:
		return // the driver is not there yet
	case err == nil && (r.cur == nil || id != r.driverID):
		// The driver is new, or restarted: ask its name again (it may
		// be another driver, or another version of it).
		name, err := r.driverName(ctx)
		if err != nil {
			return
		}
		reason := "the driver answers"
		if r.cur != nil {
			reason = "the driver restarted"
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		if r.replace(name, reason) == nil {
			r.driverID = id
		}
		return
	}
	// The driver is gone (its registration stays: the kubelet calls it
	// when it returns) or unchanged: is our socket still there?
	if got, err := statID(r.cur.path); err != nil || got != r.cur.id {
		if r.cur.srv != nil { // not a creation that failed, retried here
			r.log.Warn("the registration socket was removed or replaced; re-creating it", "socket", r.cur.path)
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		_ = r.replace(r.cur.name, "the registration socket was removed")
	}
}

// driverName asks the driver its name (a name that cannot be a file name
// is refused).
func (r *registration) driverName(ctx context.Context) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, r.timeout)
	defer cancel()
	// WaitForReady: a driver that has just restarted is asked once the
	// proxy's connection to it is back, within the timeout.
	resp, err := csi.NewIdentityClient(r.driver).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{}, grpc.WaitForReady(true))
	if err == nil {
		err = csiname.Check(resp.GetName())
	}
	if err != nil {
		if !r.nameErr {
			r.log.Warn("cannot register the driver with the kubelet until it tells its name", "err", err)
		}
		r.nameErr = true
		return "", err
	}
	r.nameErr = false
	return resp.GetName(), nil
}

// replace closes the current registration socket, if any, and creates
// one for name: the kubelet sees a new socket and registers the driver
// again. A failure is kept for check and retried at the next sync.
func (r *registration) replace(name, reason string) error {
	if r.cur != nil {
		r.close(r.cur)
	}
	s, err := r.listen(name)
	if err != nil {
		if r.err == nil || r.err.Error() != err.Error() {
			r.log.Error("cannot create the registration socket", "err", err)
		}
		r.err = err
		// Not nil: a later sync retries with the same name.
		if r.cur == nil {
			r.cur = &regSocket{name: name, path: filepath.Join(r.dir, name+"-reg.sock")}
		}
		return err
	}
	r.cur, r.err = s, nil
	r.log.Info("registration socket created; waiting for the kubelet", "driver", name, "socket", s.path, "reason", reason)
	return nil
}

// listen creates the registration socket for the driver name and serves
// the kubelet on it.
func (r *registration) listen(name string) (*regSocket, error) {
	path := filepath.Join(r.dir, name+"-reg.sock")
	// A socket left by an earlier proxy (or registrar) is stale.
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("remove stale registration socket %s: %w", path, err)
	}
	lis, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listen on registration socket: %w", err)
	}
	// The socket is removed by close, and only while it is ours: Go's
	// own unlink on close could remove a successor at the same path.
	lis.(*net.UnixListener).SetUnlinkOnClose(false)
	id, err := statID(path)
	if err != nil {
		lis.Close()
		return nil, fmt.Errorf("registration socket: %w", err)
	}
	srv := grpc.NewServer(append(grpcsrv.ServerOptions(registrationLimits),
		grpc.Creds(insecure.NewCredentials()))...)
	registerapi.RegisterRegistrationServer(srv, kubeletAPI{name: name, endpoint: r.kubeletPath, log: r.log})
	go srv.Serve(grpcsrv.UnixListener(lis))
	return &regSocket{name: name, path: path, id: id, srv: srv}, nil
}

// close stops s's server and removes its socket if it is still s's.
func (r *registration) close(s *regSocket) {
	if s.srv == nil {
		return
	}
	s.srv.Stop()
	if got, err := statID(s.path); err == nil && got == s.id {
		if err := os.Remove(s.path); err != nil {
			r.log.Warn("cannot remove the registration socket", "socket", s.path, "err", err)
		}
	}
}

// check fails while the registration socket is missing (or could not be
// created). Before the driver has told its name there is nothing to
// check: the driver's own health says why.
func (r *registration) check() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case r.err != nil:
		return r.err
	case r.cur == nil:
		return nil
	}
	got, err := statID(r.cur.path)
	if err != nil {
		return fmt.Errorf("registration socket %s is gone: %w", r.cur.path, err)
	}
	if got != r.cur.id {
		return fmt.Errorf("registration socket %s was replaced by another file", r.cur.path)
	}
	return nil
}

// kubeletAPI is the plugin-registration API served to the kubelet.
type kubeletAPI struct {
	registerapi.UnimplementedRegistrationServer
	name, endpoint string
	log            *slog.Logger
}

func (k kubeletAPI) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	k.log.Info("the kubelet asked for the driver's registration", "driver", k.name, "endpoint", k.endpoint)
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              k.name,
		Endpoint:          k.endpoint,
		SupportedVersions: SupportedCSIVersions,
	}, nil
}

// NotifyRegistrationStatus logs the kubelet's answer. A refusal is not
// retried here: the kubelet retries the registration on its own.
func (k kubeletAPI) NotifyRegistrationStatus(_ context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	if st.GetPluginRegistered() {
		k.log.Info("the kubelet registered the driver", "driver", k.name, "endpoint", k.endpoint)
	} else {
		k.log.Error("the kubelet refused to register the driver", "driver", k.name, "endpoint", k.endpoint, "err", st.GetError())
	}
	return &registerapi.RegistrationStatusResponse{}, nil
}

// statID identifies the file at path.
func statID(path string) (fileID, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return fileID{}, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	return fileID{dev: uint64(st.Dev), ino: st.Ino, ctime: st.Ctim.Nano()}, nil
}
