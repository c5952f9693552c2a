package pacing

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/herdguard/herdguard/overload"

	"github.com/herdguard/herdguard/internal/errs"
)

// ErrShed is returned by [Controller.Acquire] for an attempt the controller
// refused without sending: its deadline could not be met at the rate the
// server takes.
var ErrShed = errs.New("overload: attempt shed: the server is overloaded and the deadline cannot be met")

// ErrDown is returned by [Controller.Acquire] for an attempt the controller
// refused without sending because the server has answered nothing: it
// collapsed before this controller ever saw it answer, so holding the
// attempt back cannot be shown to help. One attempt per Interval still goes,
// as a probe. errors.Is(ErrDown, ErrShed) is true.
var ErrDown error = downError{}

type downError struct{}

func (downError) Error() string {
	return errs.Prefix + "overload: attempt shed: the server has answered nothing since it collapsed"
}

func (downError) Is(target error) bool { return target == ErrShed }

// Outcome is what one attempt said about the server's load.
type Outcome uint8

const (
	// Ignored says nothing: the caller cancelled, or the client failed by
	// itself.
	Ignored Outcome = iota
	// Answered is any answer that is not an overload signal (OK, and also
	// NotFound or InvalidArgument: the server had the capacity to answer).
	Answered
	// Overloaded is a refusal for load: Unavailable, ResourceExhausted.
	Overloaded
	// Late is an attempt that timed out (DeadlineExceeded): an overload
	// signal, as Overloaded, but the server answered nothing in time
	// rather than refusing. A server whose attempts only time out is slow,
	// not down: it is paced, never refused at once as one that refuses
	// everything and never answered is ([ErrDown]).
	Late
)

// Controller paces one server's attempts. Make one with [New]. It is safe
// for concurrent use.
type Controller struct {
	s config

	// Read without the lock, on the calm path.
	pacing    atomic.Bool
	collapsed atomic.Bool  // pacing, and the last interval refused everything
	ok        atomic.Int64 // answers in the current interval (while calm: since start)
	calm      calmCounts
	stats     counters

	mu    sync.Mutex
	start time.Time // of the current interval
	cur   interval  // the current interval's counts
	ep    episode   // the current episode of pacing, or the last one
	line  []*waiter // newest last; by deadline while edf
	edf   bool      // the line was last served oldest first: see byDeadlineLocked
	timer lineTimer

	// What the controller has learnt of the server, across episodes.
	known float64 // answers per interval the server sustained before the overload
	base  share   // its refusals and answers in the intervals that were not overloaded: see baseLocked
	// indep is the share of attempts the last confirmation showed the
	// server fails whatever the load; 0 when none showed it.
	indep float64
	// While calm: the attempts sent in the last interval that it did not
	// answer, still in flight when the current one began.
	carried      float64
	answeredEver bool // the server has answered an attempt of this controller
}

// counters are the totals since New that State reports.
type counters struct {
	delayed, shed, episodes atomic.Uint64
}

// Clock is the time a Controller reads and waits on. A nil field is real
// time: time.Now, and time.AfterFunc (AfterFunc runs f after d, in its own
// goroutine or synchronously as the clock's owner decides, and returns a
// function that stops it).
type Clock struct {
	Now       func() time.Time
	AfterFunc func(d time.Duration, f func()) (stop func() bool)
}

// config is a controller's settings, defaults filled in, and its clock.
type config struct {
	overload.Settings
	Clock
}

// New returns a calm controller for s, on clk.
func New(s overload.Settings, clk Clock) (*Controller, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	if clk.Now == nil {
		clk.Now = time.Now
	}
	if clk.AfterFunc == nil {
		clk.AfterFunc = func(d time.Duration, f func()) func() bool { return time.AfterFunc(d, f).Stop }
	}
	c := &Controller{s: config{s.WithDefaults(), clk}}
	c.start = clk.Now()
	return c, nil
}

// Acquire asks leave to send one attempt, and returns how long the attempt
// was held back. While the server is calm it returns at once. While pacing
// it waits for a token in the line (served newest first while the server
// is overloaded, oldest first while the line drains; see design.go)
// until ctx ends (its error is returned; context.DeadlineExceeded as soon
// as its deadline passes on the controller's clock, whether or not its
// timer has run) or the controller sheds the attempt ([ErrShed]). Only an
// attempt with a deadline can be shed: one without waits as long as the
// overload lasts, or until ctx is cancelled.
func (c *Controller) Acquire(ctx context.Context) (time.Duration, error) {
	if !c.pacing.Load() {
		c.calm.sent.Add(1)
		return 0, nil
	}
	return c.acquire(ctx, false)
}

// AcquireRetry is Acquire for the retry of an attempt the server refused
// for load while the controller paces: instead of a backoff wait, the retry
// waits at the old end of the line, with the oldest callers. Served newest
// first, it goes behind every attempt already waiting and every one that
// comes later: under a lasting overload fresh calls go first. Served
// oldest first (the line drains, or the server answers late), the line is
// in deadline order and the retry takes its call's place in it: first when
// its call is among the oldest, behind the older callers when it is not
// (the retry of a probe, which is the newest waiter's call).
func (c *Controller) AcquireRetry(ctx context.Context) (time.Duration, error) {
	if !c.pacing.Load() {
		c.calm.sent.Add(1)
		return 0, nil
	}
	return c.acquire(ctx, true)
}

func (c *Controller) acquire(ctx context.Context, back bool) (time.Duration, error) {
	c.mu.Lock()
	now := c.s.Now()
	c.advanceLocked(now)
	if !c.pacing.Load() {
		c.calm.sent.Add(1)
		c.mu.Unlock()
		return 0, nil
	}
	c.cur.arrived++
	deadline, _ := ctx.Deadline()
	if c.ep.down && c.ep.tokens < 1 {
		c.stats.shed.Add(1)
		c.mu.Unlock()
		return 0, ErrDown
	}
	if pastDeadline(deadline, now) { // its context's timer has not run yet
		c.mu.Unlock()
		return 0, context.DeadlineExceeded
	}
	if c.lateLocked(deadline, now) {
		c.stats.shed.Add(1)
		c.mu.Unlock()
		return 0, ErrShed
	}
	if len(c.line) == 0 && c.takeLocked() { // nobody waits: back or front is the same
		c.cur.sent++
		c.mu.Unlock()
		return 0, nil
	}
	c.cur.waited = true
	w := &waiter{deadline: deadline, ready: make(chan error, 1)}
	switch {
	case c.byDeadlineLocked():
		c.line = slices.Insert(c.line, deadlineIndex(c.line, deadline), w)
	case back:
		c.line = slices.Insert(c.line, 0, w)
	default:
		c.line = append(c.line, w)
	}
	c.serveLocked(now)
	c.mu.Unlock()

	select {
	case err := <-w.ready:
		if err == nil {
			c.stats.delayed.Add(1)
		}
		return c.s.Now().Sub(now), err
	case <-ctx.Done():
		c.mu.Lock()
		if w.done { // served or shed at the same moment: give a token back
			if err := <-w.ready; err == nil {
				c.ep.tokens++
			}
		} else {
			c.removeLocked(w)
		}
		c.mu.Unlock()
		return c.s.Now().Sub(now), ctx.Err()
	}
}

// Pacing reports whether the controller is pacing attempts: the server has
// shown it is overloaded. It takes no lock.
func (c *Controller) Pacing() bool { return c.pacing.Load() }

// Sent reports an attempt sent without asking Acquire because Pacing
// reported false, as a caller that keeps the calm path short does: one
// atomic load and one atomic add, and nothing while pacing (every attempt
// then asks Acquire). The refusals that may start the pacing are judged
// against the attempts sent, not only those answered: a server that fails
// a share of its attempts at once and answers the rest a little later would
// otherwise show only refusals at first, and look overloaded.
func (c *Controller) Sent() {
	if !c.pacing.Load() {
		c.calm.sent.Add(1)
	}
}

// Answered is Done(Answered) without its switch: while calm it is one
// atomic load and one atomic add (and two clock readings per 128 answers), and
// takes no lock.
func (c *Controller) Answered() {
	if !c.pacing.Load() {
		c.countCalm()
	} else {
		c.answeredPacing(0, false)
	}
}

// AnsweredAfter is Answered for an attempt the server answered d after it
// was sent. While pacing, the controller keeps the least such time of each
// interval: an attempt with less time left before its deadline than every
// answer of the last interval took cannot be answered in time (a server
// with a queue answers late, and a waiter's time runs out in the line), so
// it is shed rather than sent. Attempts whose time is not known are
// reported with Answered and teach nothing.
func (c *Controller) AnsweredAfter(d time.Duration) {
	if !c.pacing.Load() {
		c.countCalm()
	} else {
		c.answeredPacing(max(d, 1), false)
	}
}

// AnsweredSentCalm is Answered for an attempt sent while the controller
// was calm (Pacing reported false before it was sent), whose time was not
// taken so that the calm path stays cheap. Answered while pacing, it was
// sent before this episode began, so its answer took at least as long as
// the episode has lasted: the controller counts that time as it counts
// AnsweredAfter's. A server that queues is then seen to answer late as
// soon as the answers to the attempts sent before the overload come in,
// a whole queue's wait before the first paced attempt is answered.
func (c *Controller) AnsweredSentCalm() {
	if !c.pacing.Load() {
		c.countCalm()
	} else {
		c.answeredPacing(0, true)
	}
}

// TimedOut reports an attempt that Acquire let through and whose caller's
// deadline passed while it was in flight: it waited held in the line, and
// went out with left before the deadline. It is an overload signal, as
// Done(Overloaded) is, unless it waited longer than it then had left: the
// line, not the server, spent most of the caller's time, and it says
// nothing (Done(Ignored)). Served oldest
// first, the line sends callers at the edge of their deadlines, and a
// server that misses an edge that near is not therefore slow; taken as
// overload, a few such misses would stop a line that drains.
func (c *Controller) TimedOut(held, left time.Duration) {
	if held > left {
		c.Done(Ignored)
		return
	}
	c.Done(Late)
}

// Done reports how an attempt that Acquire let through ended.
func (c *Controller) Done(o Outcome) {
	switch o {
	case Answered:
		c.Answered()
	case Overloaded, Late:
		c.mu.Lock()
		now := c.s.Now()
		c.advanceLocked(now)
		if c.ep.confirm.need > 0 {
			// An outcome of the confirmation's batch, counted apart
			// from the interval's (see answeredCollapsedLocked).
			c.ep.confirm.fail++
			c.judgeLocked(now)
		} else {
			c.cur.fail++
			if o == Late {
				c.cur.lateFail++
			}
			if !c.pacing.Load() && c.cur.fail >= c.s.MinFailures && c.triggerLocked(float64(c.cur.fail), c.triggerCountLocked()) {
				c.beginLocked(now)
			}
		}
		c.mu.Unlock()
	case Ignored:
		if !c.pacing.Load() {
			c.calm.lost.Add(1)
			return
		}
		c.mu.Lock()
		now := c.s.Now()
		c.advanceLocked(now)
		if c.ep.confirm.need > 0 {
			c.unconfirmedLocked(now)
		}
		c.mu.Unlock()
	}
}

// answeredPacing counts an answer while pacing, that took d (0: not
// known), or was sent before the episode began (sentCalm): it may end a
// collapse, or grow a slow start.
func (c *Controller) answeredPacing(d time.Duration, sentCalm bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.s.Now()
	c.advanceLocked(now) // the answer belongs to the interval now
	c.answeredEver = true
	if sentCalm {
		d = max(now.Sub(c.ep.began), 1) // at least: it was sent before
	}
	if d > 0 && (c.cur.took == 0 || d < c.cur.took) {
		c.cur.took = d
	}
	if c.ep.confirm.need > 0 && !sentCalm {
		c.ep.confirm.ok++
		c.judgeLocked(now)
		return
	}
	c.ok.Add(1)
	switch {
	case c.collapsed.Load() && !sentCalm:
		c.answeredCollapsedLocked(now)
	case c.collapsed.Load():
		// An answer to an attempt sent before the episode began: the
		// server works through what it had. In the interval the episode
		// began in, that is the attempts in flight when it began, and
		// says nothing; after it, a server that queues answers so (see
		// AnsweredSentCalm), which is the overload, and the rate
		// restarts at once, unconfirmed. Behind a queue a probe is
		// answered a queue's wait later: a line that waited for it
		// would lose its oldest callers; and a confirmation on such an
		// answer would see a batch half refused by the full queue and
		// half answered, take it for failures independent of the load,
		// and end the pacing into the overload.
		if !c.ep.fresh && c.ep.confirm.need == 0 {
			c.restartLocked(now)
		}
	case c.slowStartLocked(now):
		// Below what the server is known to take, each answer adds a
		// token per interval: the rate doubles every round trip, as TCP's
		// slow start does.
		c.ep.rate = min(c.ep.rate+1, c.freeLocked())
		c.serveLocked(now)
	}
}

// State is a snapshot of a controller, for metrics.
type State struct {
	Pacing   bool
	Rate     float64 // attempts per second while pacing; 0 when calm
	Waiting  int     // attempts in the line
	Delayed  uint64  // attempts sent after waiting, since New
	Shed     uint64  // attempts shed, since New
	Episodes uint64  // times pacing began, since New
}

// State returns the controller's state now.
func (c *Controller) State() State {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.advanceLocked(c.s.Now())
	st := State{Pacing: c.pacing.Load(), Waiting: len(c.line),
		Delayed: c.stats.delayed.Load(), Shed: c.stats.shed.Load(), Episodes: c.stats.episodes.Load()}
	if st.Pacing {
		st.Rate = c.ep.rate * float64(time.Second) / float64(c.s.Interval)
	}
	return st
}
