package grpcsrv

import (
	"context"
	"errors"
	"fmt"
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// SocketBuffer is the send and receive buffer size set on every unix
// socket connection csibroker makes or accepts (see doc.go: grpc-go issue
// 9330). The kernel caps it at net.core.wmem_max and rmem_max.
const SocketBuffer = 4 << 20

// SetSocketBuffers sets SO_SNDBUF and SO_RCVBUF to SocketBuffer on a unix
// socket connection; any other connection is left as it is.
func SetSocketBuffers(c net.Conn) error {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return nil
	}
	rc, err := uc.SyscallConn()
	if err != nil {
		return err
	}
	return setBuffers(rc)
}

func setBuffers(rc syscall.RawConn) error {
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = errors.Join(
			unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF, SocketBuffer),
			unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, SocketBuffer))
	}); err != nil {
		return err
	}
	if serr != nil {
		return fmt.Errorf("set unix socket buffers: %w", serr)
	}
	return nil
}

// SocketBuffers reports a unix socket connection's SO_SNDBUF and
// SO_RCVBUF as the kernel holds them (Linux doubles what was set, up to
// twice the cap).
func SocketBuffers(c net.Conn) (snd, rcv int, err error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return 0, 0, fmt.Errorf("%T is not a unix socket connection", c)
	}
	rc, err := uc.SyscallConn()
	if err != nil {
		return 0, 0, err
	}
	var e1, e2 error
	if err := rc.Control(func(fd uintptr) {
		snd, e1 = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF)
		rcv, e2 = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF)
	}); err != nil {
		return 0, 0, err
	}
	return snd, rcv, errors.Join(e1, e2)
}

// DialUnix dials the unix socket at path with SocketBuffer-sized buffers.
// It is a dialer for grpc.WithContextDialer (whose address is the target's
// path, e.g. with the target "unix:///path" or "passthrough:///path").
func DialUnix(ctx context.Context, path string) (net.Conn, error) {
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error { return setBuffers(rc) }}
	return d.DialContext(ctx, "unix", path)
}

// UnixListener wraps a listener so that every unix socket connection it
// accepts has SocketBuffer-sized buffers (connections of other kinds pass
// unchanged).
func UnixListener(l net.Listener) net.Listener { return bufListener{l} }

type bufListener struct{ net.Listener }

func (l bufListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	// Best effort: refusing the connection would not help its peer, which
	// keeps the default buffers.
	_ = SetSocketBuffers(c)
	return c, nil
}
