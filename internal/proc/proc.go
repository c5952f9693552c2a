// Package proc starts child processes and stops them by their process id:
// the demo's servers, Jaeger and Redis, for the demos and the tests.
package proc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"

	"github.com/herdguard/herdguard/internal/clock"
)

// Process is a child process, stopped by its process id.
type Process struct {
	cmd    *exec.Cmd
	done   chan struct{} // closed when the process has exited
	err    error         // its exit status, once done
	stopMu sync.Mutex
}

// Start starts bin with args, its output going to stdout and
// stderr, in env (nil: this process's). On Linux the child is killed if
// the process that started it dies first.
func Start(bin string, stdout, stderr io.Writer, env []string, args ...string) (*Process, error) {
	if _, err := os.Stat(bin); err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr, cmd.Env = stdout, stderr, env
	cmd.SysProcAttr = dieWithParent()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	p := &Process{cmd: cmd, done: make(chan struct{})}
	go func() { p.err = cmd.Wait(); close(p.done) }()
	return p, nil
}

// PID is the process id.
func (p *Process) PID() int { return p.cmd.Process.Pid }

// Done is closed once the process has exited.
func (p *Process) Done() <-chan struct{} { return p.done }

// Err is the process's exit status, once Done is closed.
func (p *Process) Err() error { return p.err }

// Wait waits for the process to exit, or stops it when ctx ends and
// returns ctx's error.
func (p *Process) Wait(ctx context.Context) error {
	select {
	case <-p.done:
		return p.err
	case <-ctx.Done():
		p.Stop()
		return ctx.Err()
	}
}

// Stop ends the process by its id: SIGTERM, then SIGKILL if it has not
// exited within 5 s. It returns once the process has exited, with its exit
// error: nil for an exit caused by the SIGTERM.
func (p *Process) Stop() error {
	p.stopMu.Lock()
	defer p.stopMu.Unlock()
	select {
	case <-p.done:
	default:
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		grace := clock.Real().NewTimer(5 * time.Second) // a real process takes real time
		defer grace.Stop()
		select {
		case <-p.done:
		case <-grace.C():
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	}
	var ee *exec.ExitError
	if errors.As(p.err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGTERM {
			return nil
		}
	}
	return p.err
}

// FreePorts returns n distinct ports free on 127.0.0.1 a moment ago.
func FreePorts(n int) ([]int, error) {
	var ports []int
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("finding a free port: %w", err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}
