// Package clock is the time herdguard reads and waits on: one interface,
// the wall clock behind it ([Real]), and in tests the fake clock of
// internal/testutil, which moves only when the test says so. The
// interceptor, the overload controller and the breaker's own reads take
// a Clock; nothing else in the library reads or waits on the wall clock.
package clock

import "time"

// Clock tells the time and makes timers.
type Clock interface {
	// Now returns the current time.
	Now() time.Time
	// NewTimer returns a timer that sends the time on its channel after
	// d, as time.NewTimer.
	NewTimer(d time.Duration) Timer
	// AfterFunc calls f in its own goroutine after d, as time.AfterFunc;
	// the timer's channel is nil.
	AfterFunc(d time.Duration, f func()) Timer
}

// Timer is a reusable timer: after Stop or a fire, Reset starts it again
// with nothing stale in its channel (time.Timer's behaviour since Go
// 1.23).
type Timer interface {
	// C returns the channel the time is sent on; nil for AfterFunc's.
	C() <-chan time.Time
	// Stop stops the timer, and reports whether that kept it from firing.
	Stop() bool
	// Reset sets the timer to fire after d, and reports whether it had
	// been armed.
	Reset(d time.Duration) bool
}

// Real returns the wall clock: package time's Now, NewTimer and AfterFunc.
func Real() Clock { return wall{} }

type wall struct{}

func (wall) Now() time.Time                 { return time.Now() }
func (wall) NewTimer(d time.Duration) Timer { return wallTimer{time.NewTimer(d)} }
func (wall) AfterFunc(d time.Duration, f func()) Timer {
	return wallTimer{time.AfterFunc(d, f)}
}

type wallTimer struct{ t *time.Timer }

func (t wallTimer) C() <-chan time.Time        { return t.t.C }
func (t wallTimer) Stop() bool                 { return t.t.Stop() }
func (t wallTimer) Reset(d time.Duration) bool { return t.t.Reset(d) }
