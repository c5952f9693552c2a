//go:build !linux

package proc

import "syscall"

// dieWithParent has no portable equivalent off Linux: Stop ends Jaeger.
func dieWithParent() *syscall.SysProcAttr { return nil }
