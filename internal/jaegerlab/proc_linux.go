package jaegerlab

import "syscall"

// DieWithParent makes the child exit when the process that started it
// does, so a test or demo killed outright leaves no Jaeger behind.
func DieWithParent() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
