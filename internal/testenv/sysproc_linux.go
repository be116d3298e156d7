package testenv

import "syscall"

// sysProcAttr puts a component in its own process group, so Stop can signal
// it and anything it spawns, and has the kernel kill it should the test
// binary die without cleaning up (the parent-death signal follows the thread
// that started the child; Go only retires threads locked by LockOSThread,
// which this package never uses).
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
