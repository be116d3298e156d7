//go:build !linux

package sampledriver

import (
	"errors"
	"os"
)

// The node side needs Linux bind mounts; elsewhere the package builds (for
// the controller side and for editors) and node calls fail.

var errNoMounts = errors.New("sample driver: bind mounts need Linux")

type mountInfo struct{}

func (mountInfo) readonly() bool { return false }

func findMount(string) (mountInfo, bool, error)          { return mountInfo{}, false, errNoMounts }
func sameDir(string, string) (bool, error)               { return false, errNoMounts }
func boundTo(string, string) (bool, bool, error)         { return false, false, errNoMounts }
func isMountPoint(string) (bool, error)                  { return false, errNoMounts }
func bindMount(string, string, bool) error               { return errNoMounts }
func unmount(string) error                               { return errNoMounts }
func lockDir(string) (*os.File, error)                   { return nil, nil }
func fsStats(string) (int64, int64, int64, int64, error) { return 0, 0, 0, 0, errNoMounts }
