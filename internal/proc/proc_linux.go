package proc

import "syscall"

// dieWithParent makes the child exit when the process that started it
// does, so a test or demo killed outright leaves no Jaeger behind.
func dieWithParent() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
