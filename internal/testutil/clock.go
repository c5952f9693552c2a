package testutil

import (
	"slices"
	"sync"
	"time"

	"github.com/herdguard/herdguard/internal/clock"
)

// Clock is a clock.Clock.
var _ clock.Clock = (*Clock)(nil)

// Clock is a fake clock for code that takes its time and timers from
// outside. Its time moves only when the test calls [Clock.Advance] (fire
// what falls due), [Clock.Skip] (fire nothing yet) or [Clock.Expire]
// (hand back what falls due), or, with [Instant], when a timer is set. It
// records every delay a timer was set to ([Clock.Delays]).
//
// By default a timer fires inside the Advance that reaches its due time:
// due timers fire in order of due time (ties in the order they were set),
// the clock reading each one's due time as it fires, and a function runs
// synchronously, so that it can set timers that fire in the same Advance.
// [Async] changes that to time.AfterFunc's contract. A Clock is safe for
// concurrent use.
type Clock struct {
	instant, async bool // fixed by NewClock's options

	mu     sync.Mutex
	now    time.Time
	armed  []*Timer // set and neither fired nor stopped
	seq    uint64   // how many times timers were armed, to order ties
	delays []time.Duration
}

// Option changes how a [Clock] runs its timers.
type Option interface{ apply(*Clock) }

type option func(*Clock)

func (o option) apply(c *Clock) { o(c) }

// Instant makes every wait instant: a timer fires as soon as it is set
// (by NewTimer, AfterFunc or Reset) and moves the clock on by its delay
// (a negative delay by nothing), as if the wait had passed. No timer is
// ever pending, so Advance and Skip only move the clock.
func Instant() Option { return option(func(c *Clock) { c.instant = true }) }

// Async runs each timer's function in its own goroutine, as
// time.AfterFunc does, instead of synchronously. Advance then moves the
// clock to its end first and starts the functions of every timer due by
// then, in order; a timer those functions set fires in a later Advance.
// With Instant, the function starts in its own goroutine from AfterFunc
// or Reset.
func Async() Option { return option(func(c *Clock) { c.async = true }) }

// NewClock returns a clock that reads start. Start at time.Now() when the
// code compares the clock with real deadlines (a context's), or later
// (time.Now().Add(time.Hour)) when the test makes contexts whose
// deadlines are near on the fake clock and must not expire in real time.
func NewClock(start time.Time, opts ...Option) *Clock {
	c := &Clock{now: start}
	for _, o := range opts {
		if o != nil {
			o.apply(c)
		}
	}
	return c
}

// Now returns the clock's time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// NewTimer returns a timer that sends the clock's time on its channel
// ([Timer.C]) when it fires, as time.NewTimer.
func (c *Clock) NewTimer(d time.Duration) clock.Timer {
	t := &Timer{clock: c, c: make(chan time.Time, 1)}
	t.Reset(d)
	return t
}

// AfterFunc returns a timer that calls f when it fires: synchronously,
// or in its own goroutine with [Async]. With [Instant] and without Async,
// f runs before AfterFunc returns.
func (c *Clock) AfterFunc(d time.Duration, f func()) clock.Timer {
	t := &Timer{clock: c, f: f}
	t.Reset(d)
	return t
}

// Advance moves the clock on by d, firing every timer that falls due by
// then, including timers set before and due already (see [Clock.Skip]).
// Without [Async], every function it fires has returned when it returns.
func (c *Clock) Advance(d time.Duration) {
	if c.async {
		for _, f := range c.Expire(d) {
			go f()
		}
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	end := c.now.Add(d)
	for {
		t := c.nextDueLocked(end)
		if t == nil {
			break
		}
		c.disarmLocked(t)
		c.now = later(c.now, t.due)
		if f := c.fireLocked(t); f != nil {
			c.mu.Unlock()
			f()
			c.mu.Lock()
		}
	}
	c.now = later(c.now, end)
}

// Expire moves the clock on by d and fires the NewTimer timers due by
// then, as Advance with [Async] does, but returns the functions of the
// AfterFunc timers due, in order, without running them: the test stands
// in for timers whose functions have not got round to running yet (a
// real timer's goroutine that waits for a lock).
func (c *Clock) Expire(d time.Duration) []func() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = later(c.now, c.now.Add(d))
	var due []func()
	for t := c.nextDueLocked(c.now); t != nil; t = c.nextDueLocked(c.now) {
		c.disarmLocked(t)
		if f := c.fireLocked(t); f != nil {
			due = append(due, f)
		}
	}
	return due
}

// Skip moves the clock on by d without firing any timer: time that passes
// unseen by the timers, such as an attempt's latency inside a handler.
// A timer that falls due meanwhile fires at the next Advance.
func (c *Clock) Skip(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// Delays returns every delay a timer was set to, by NewTimer, AfterFunc
// or Reset, in the order set.
func (c *Clock) Delays() []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.delays)
}

// nextDueLocked returns the armed timer due first by end (ties: the first
// armed), or nil if none is.
func (c *Clock) nextDueLocked(end time.Time) *Timer {
	var next *Timer
	for _, t := range c.armed {
		if t.due.After(end) {
			continue
		}
		if next == nil || t.due.Before(next.due) || (t.due.Equal(next.due) && t.seq < next.seq) {
			next = t
		}
	}
	return next
}

// disarmLocked takes t off the armed timers, if it is on them.
func (c *Clock) disarmLocked(t *Timer) {
	if !t.armed {
		return
	}
	t.armed = false
	i := slices.Index(c.armed, t)
	c.armed[i] = c.armed[len(c.armed)-1]
	c.armed[len(c.armed)-1] = nil
	c.armed = c.armed[:len(c.armed)-1]
}

// fireLocked fires t, which is not armed: it sends the clock's time on
// t's channel, or returns t's function for the caller to run (once it has
// let go of the lock) or start.
func (c *Clock) fireLocked(t *Timer) func() {
	if t.c == nil {
		return t.f
	}
	select { // the channel was emptied when t was set
	case t.c <- c.now:
	default:
	}
	return nil
}

// Timer is a [Clock]'s timer, made by NewTimer (with a channel) or
// AfterFunc (with a function). It can be stopped and set again, and, as
// time.Timer since Go 1.23, after Stop or Reset its channel holds no time
// sent before.
type Timer struct {
	clock *Clock
	c     chan time.Time // NewTimer's; nil for AfterFunc's
	f     func()         // AfterFunc's

	// guarded by clock.mu
	due   time.Time
	seq   uint64
	armed bool
}

// C returns the channel a NewTimer timer fires on; nil for an AfterFunc
// timer.
func (t *Timer) C() <-chan time.Time { return t.c }

// Stop keeps t from firing. It reports whether t was pending, as
// time.Timer.Stop: false if it had fired or been stopped already.
func (t *Timer) Stop() bool {
	c := t.clock
	c.mu.Lock()
	defer c.mu.Unlock()
	t.drainLocked()
	was := t.armed
	c.disarmLocked(t)
	return was
}

// Reset sets t to fire after d from the clock's time, whether it was
// pending, fired or stopped, and records d. It reports whether t was
// pending. With [Instant], t fires at once.
func (t *Timer) Reset(d time.Duration) bool {
	c := t.clock
	c.mu.Lock()
	c.delays = append(c.delays, d)
	t.drainLocked()
	was := t.armed
	if !c.instant {
		if !t.armed {
			t.armed = true
			c.armed = append(c.armed, t)
		}
		t.due, t.seq = c.now.Add(d), c.seq
		c.seq++
		c.mu.Unlock()
		return was
	}
	c.now = c.now.Add(max(d, 0))
	f := c.fireLocked(t)
	c.mu.Unlock()
	switch {
	case f == nil:
	case c.async:
		go f()
	default:
		f()
	}
	return was
}

// drainLocked drops a time t sent and nobody received.
func (t *Timer) drainLocked() {
	select {
	case <-t.c: // a nil channel (AfterFunc's) is never ready
	default:
	}
}

// later returns the later of a and b.
func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
