package sampledriver

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// mountInfo is one line of /proc/self/mountinfo.
type mountInfo struct {
	MountPoint string
	Root       string
	Options    []string // per-mount options (field 6)
}

func (m mountInfo) readonly() bool {
	for _, o := range m.Options {
		if o == "ro" {
			return true
		}
	}
	return false
}

const mountInfoPath = "/proc/self/mountinfo"

// findMount returns the topmost mount whose mount point is path (after
// resolving symlinks), or ok=false when path is not a mount point.
func findMount(path string) (m mountInfo, ok bool, err error) {
	p, err := filepath.EvalSymlinks(path)
	if errors.Is(err, fs.ErrNotExist) {
		return mountInfo{}, false, nil
	}
	if err != nil {
		return mountInfo{}, false, err
	}
	f, err := os.Open(mountInfoPath)
	if err != nil {
		return mountInfo{}, false, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		mi, perr := parseMountInfoLine(sc.Text())
		if perr != nil {
			return mountInfo{}, false, perr
		}
		if mi.MountPoint == p {
			// Later lines are mounted on top of earlier ones.
			m, ok = mi, true
		}
	}
	if err := sc.Err(); err != nil {
		return mountInfo{}, false, fmt.Errorf("read %s: %w", mountInfoPath, err)
	}
	return m, ok, nil
}

// parseMountInfoLine parses
// "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue".
func parseMountInfoLine(line string) (mountInfo, error) {
	fields := strings.Fields(line)
	if len(fields) < 10 {
		return mountInfo{}, fmt.Errorf("mountinfo line %q: too few fields", line)
	}
	return mountInfo{
		Root:       unescapeMountPath(fields[3]),
		MountPoint: unescapeMountPath(fields[4]),
		Options:    strings.Split(fields[5], ","),
	}, nil
}

// unescapeMountPath undoes the kernel's octal escapes (\040 for a space,
// \011, \012, \134).
func unescapeMountPath(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) && isOctal(s[i+1]) && isOctal(s[i+2]) && isOctal(s[i+3]) {
			b.WriteByte((s[i+1]-'0')<<6 | (s[i+2]-'0')<<3 | (s[i+3] - '0'))
			i += 3
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func isOctal(c byte) bool { return c >= '0' && c <= '7' }

// sameDir reports whether a and b are the same directory (device and inode),
// which is how a bind mount's target looks compared to its source.
func sameDir(a, b string) (bool, error) {
	var sa, sb unix.Stat_t
	if err := unix.Stat(a, &sa); err != nil {
		return false, err
	}
	if err := unix.Stat(b, &sb); err != nil {
		return false, err
	}
	return sa.Dev == sb.Dev && sa.Ino == sb.Ino, nil
}

// boundTo reports whether path is a mount point showing the directory src,
// and whether that mount is read-only.
func boundTo(path, src string) (bound, readonly bool, err error) {
	m, ok, err := findMount(path)
	if err != nil || !ok {
		return false, false, err
	}
	same, err := sameDir(path, src)
	if errors.Is(err, fs.ErrNotExist) {
		return false, m.readonly(), nil
	}
	if err != nil {
		return false, false, err
	}
	return same, m.readonly(), nil
}

// isMountPoint reports whether path is a mount point.
func isMountPoint(path string) (bool, error) {
	_, ok, err := findMount(path)
	return ok, err
}

// bindMount binds src onto dst, read-only if asked.
func bindMount(src, dst string, readonly bool) error {
	if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind mount %s on %s: %w", src, dst, err)
	}
	if readonly {
		if err := unix.Mount(src, dst, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
			_ = unmount(dst)
			return fmt.Errorf("remount %s read-only: %w", dst, err)
		}
	}
	return nil
}

// unmount unmounts path, lazily if it is busy; not being a mount point is
// not an error.
func unmount(path string) error {
	err := unix.Unmount(path, 0)
	switch {
	case err == nil, errors.Is(err, syscall.EINVAL), errors.Is(err, syscall.ENOENT):
		return nil
	case errors.Is(err, syscall.EBUSY):
		if err := unix.Unmount(path, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("unmount %s (detach): %w", path, err)
		}
		return nil
	default:
		return fmt.Errorf("unmount %s: %w", path, err)
	}
}

// fsStats returns total, free and used bytes and inodes of the filesystem
// holding path.
func fsStats(path string) (totalBytes, availBytes, totalInodes, freeInodes int64, err error) {
	var s unix.Statfs_t
	if err := unix.Statfs(path, &s); err != nil {
		return 0, 0, 0, 0, err
	}
	bs := int64(s.Bsize)
	return int64(s.Blocks) * bs, int64(s.Bavail) * bs, int64(s.Files), int64(s.Ffree), nil
}

// lockDir takes an exclusive, non-blocking lock on dir/lock; the returned
// file holds it until closed (or the process exits).
func lockDir(dir string) (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(dir, "lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("state dir %s is in use by another sample driver", dir)
		}
		return nil, fmt.Errorf("lock state dir %s: %w", dir, err)
	}
	return f, nil
}
