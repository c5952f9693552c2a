package testutil

import (
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fatalT records a Fatalf and ends its goroutine, as testing.T does.
type fatalT struct {
	testing.TB
	mu     sync.Mutex
	failed string
}

func (f *fatalT) Helper() {}
func (f *fatalT) Fatalf(format string, args ...any) {
	f.mu.Lock()
	f.failed = fmt.Sprintf(format, args...)
	f.mu.Unlock()
	runtime.Goexit()
}

func TestEventuallyWaitsForAnotherGoroutine(t *testing.T) {
	for _, tt := range []struct {
		name  string
		after time.Duration
	}{
		{"at once", 0},
		{"after a few yields", -1},
		{"after sleeps", 30 * time.Millisecond},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var done atomic.Bool
			var calls atomic.Int64
			switch {
			case tt.after == 0:
				done.Store(true)
			case tt.after < 0:
				go done.Store(true)
			default:
				time.AfterFunc(tt.after, func() { done.Store(true) })
			}
			took := Eventually(t, "the flag", func() bool { calls.Add(1); return done.Load() })
			if tt.after > 0 && took < tt.after {
				t.Errorf("took %v, want at least the %v the flag took", took, tt.after)
			}
			if tt.after == 0 && calls.Load() != 1 {
				t.Errorf("cond called %d times for a flag set already, want 1", calls.Load())
			}
		})
	}
}

func TestEventuallyFailsNamingWhat(t *testing.T) {
	ft := &fatalT{TB: t}
	done := make(chan time.Duration)
	began := time.Now()
	go func() {
		defer close(done)
		eventually(ft, "the moon", func() bool { return false }, 20*time.Millisecond)
		t.Error("eventually returned for a cond that never holds")
	}()
	<-done
	if took := time.Since(began); took < 20*time.Millisecond {
		t.Errorf("gave up after %v, want at least the limit of 20ms", took)
	}
	ft.mu.Lock()
	defer ft.mu.Unlock()
	if want := "waited 20ms for the moon"; ft.failed != want {
		t.Errorf("failed with %q, want %q", ft.failed, want)
	}
}
