//go:build unix && !linux

package testenv

import "syscall"

// sysProcAttr puts a component in its own process group so Stop can signal it
// and anything it spawns. There is no parent-death signal outside Linux.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}
