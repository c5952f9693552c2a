//go:build !linux

package jaegerlab

import "syscall"

// DieWithParent has no portable equivalent off Linux: Stop ends Jaeger.
func DieWithParent() *syscall.SysProcAttr { return nil }
