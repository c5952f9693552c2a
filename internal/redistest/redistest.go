// Package redistest runs Debian's redis-server for tests and demos: on
// 127.0.0.1 with a free port and a temporary directory, no persistence,
// stopped by its process id.
package redistest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/herdguard/herdguard/internal/clock"
	"github.com/herdguard/herdguard/internal/proc"
)

// Install says how to get redis-server.
const Install = "install it with `apt-get install redis-server` (Debian, Ubuntu), or put a redis-server binary on PATH"

// Server is a running redis-server.
type Server struct {
	Addr string // 127.0.0.1:port
	bin  string
	dir  string
	port int

	mu sync.Mutex
	p  *proc.Process
}

// Find returns the path of redis-server, or an error saying how to get it.
func Find() (string, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return "", fmt.Errorf("redis-server not found: %s", Install)
	}
	return bin, nil
}

// Start runs redis-server for the test and stops it when the test ends.
// Without redis-server the test is skipped, saying how to install it, or,
// under CI (CI=true), fails.
func Start(t testing.TB) *Server {
	t.Helper()
	bin, err := Find()
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%v (CI installs it: .ci/run)", err)
		}
		t.Skip(err)
	}
	s, err := StartServer(bin, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Stop() })
	return s
}

// StartServer runs bin on a free port of 127.0.0.1 with dir as its
// working directory, and returns once it answers.
func StartServer(bin, dir string) (*Server, error) {
	var last error
	for range 5 { // a free port may be taken between finding and binding it
		ports, err := proc.FreePorts(1)
		if err != nil {
			return nil, err
		}
		s := &Server{bin: bin, dir: dir, port: ports[0], Addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[0]))}
		if last = s.start(); last == nil {
			return s, nil
		}
	}
	return nil, last
}

func (s *Server) start() error {
	logf := filepath.Join(s.dir, "redis.log")
	p, err := proc.Start(s.bin, nil, nil, nil,
		"--bind", "127.0.0.1", "--port", strconv.Itoa(s.port), "--dir", s.dir, "--logfile", logf,
		"--save", "", "--appendonly", "no", "--protected-mode", "yes", "--daemonize", "no")
	if err != nil {
		return err
	}
	wall := clock.Real() // a real process takes real time
	deadline := wall.Now().Add(10 * time.Second)
	poll := wall.NewTimer(0)
	defer poll.Stop()
	for {
		// the server that answers must be this one, not another process
		// that took the port meanwhile
		if pid, err := serverPID(s.Addr); err == nil && pid == p.PID() {
			break
		}
		select {
		case <-p.Done():
			b, _ := os.ReadFile(logf)
			return fmt.Errorf("redis-server on %s exited: %v\n%s", s.Addr, p.Err(), tail(b))
		case <-poll.C():
			poll.Reset(20 * time.Millisecond)
		}
		if wall.Now().After(deadline) {
			p.Stop()
			return fmt.Errorf("redis-server on %s did not answer within 10 s", s.Addr)
		}
	}
	s.mu.Lock()
	s.p = p
	s.mu.Unlock()
	return nil
}

// PID is the process id of the running server, 0 when stopped.
func (s *Server) PID() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.p == nil {
		return 0
	}
	return s.p.PID()
}

// Stop ends the server by its process id (SIGTERM).
func (s *Server) Stop() {
	if p := s.take(); p != nil {
		p.Stop()
	}
}

// Kill ends the server at once (SIGKILL), as a crash would: its data is
// lost.
func (s *Server) Kill() {
	if p := s.take(); p != nil {
		_ = syscall.Kill(p.PID(), syscall.SIGKILL)
		<-p.Done()
	}
}

// take returns the running process, if any, and forgets it.
func (s *Server) take() *proc.Process {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.p
	s.p = nil
	return p
}

// Pause stops the server without ending it (SIGSTOP): it accepts
// connections and answers nothing, as an overloaded Redis would. Resume
// it with Resume.
func (s *Server) Pause() error { return s.signal(syscall.SIGSTOP) }

// Resume continues a paused server (SIGCONT).
func (s *Server) Resume() error { return s.signal(syscall.SIGCONT) }

func (s *Server) signal(sig syscall.Signal) error {
	pid := s.PID()
	if pid == 0 {
		return errors.New("redis-server is not running")
	}
	return syscall.Kill(pid, sig)
}

// Restart starts a stopped or killed server again on the same port, empty.
func (s *Server) Restart() error {
	var err error
	pause := clock.Real().NewTimer(0)
	defer pause.Stop()
	for range 50 { // the port may linger a moment after a kill
		<-pause.C()
		if err = s.start(); err == nil {
			return nil
		}
		pause.Reset(50 * time.Millisecond)
	}
	return err
}

// serverPID asks the Redis at addr for its process id (INFO server), in
// the Redis protocol.
func serverPID(addr string) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	_ = c.SetDeadline(clock.Real().Now().Add(time.Second))
	if _, err := c.Write([]byte("INFO server\r\n")); err != nil {
		return 0, err
	}
	r := bufio.NewReader(c)
	head, err := r.ReadString('\n')
	if err != nil {
		return 0, err
	}
	if !strings.HasPrefix(head, "$") {
		return 0, fmt.Errorf("INFO answered %q", head)
	}
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			return 0, err
		}
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "process_id:"); ok {
			return strconv.Atoi(v)
		}
	}
}

func tail(b []byte) []byte {
	if len(b) > 2000 {
		return b[len(b)-2000:]
	}
	return b
}
