package pacing

import (
	"context"
	"slices"
	"sort"
	"time"
)

// burstDivisor says how many tokens the bucket keeps at most: a
// 1/burstDivisor share of an interval's worth (at least one), so that the
// attempts of an interval stay spread out over it rather than going in a
// burst.
const burstDivisor = 10

// minWait is the least time the timer that serves the line waits for the
// next token, so that a rate far above the arrivals does not spin it.
const minWait = time.Millisecond / 10

// lineTimer is the timer that serves the line.
type lineTimer struct {
	armed bool // a tick is scheduled at due
	due   time.Time
	stop  func() bool
}

type waiter struct {
	deadline time.Time // zero: none
	ready    chan error
	done     bool
}

// takeLocked takes a token for an attempt, from the confirmation batch
// first, and reports whether there was one.
func (c *Controller) takeLocked() bool {
	switch {
	case c.ep.confirm.batch > 0:
		c.ep.confirm.batch--
	case c.ep.tokens >= 1:
		c.ep.tokens--
	default:
		return false
	}
	return true
}

// refillLocked adds the tokens earned since the last refill, keeping at
// most a 1/burstDivisor share of an interval's worth (at least one).
func (c *Controller) refillLocked(now time.Time) {
	if d := now.Sub(c.ep.refilled); d > 0 {
		c.ep.tokens = min(c.ep.tokens+c.ep.rate*float64(d)/float64(c.s.Interval), max(1, c.ep.rate/burstDivisor))
		c.ep.refilled = now
	}
}

// serveLocked hands tokens to the waiters in the line's order (newest
// first, or oldest first behind a server that answers late), sheds those
// that cannot be served in time, and arms the timer for the next token.
func (c *Controller) serveLocked(now time.Time) {
	c.refillLocked(now)
	oldest := c.byDeadlineLocked()
	for len(c.line) > 0 && (c.ep.confirm.batch > 0 || c.ep.tokens >= 1) {
		i := len(c.line) - 1 // the newest
		if oldest {
			i = 0
		}
		w := c.line[i]
		c.line = slices.Delete(c.line, i, i+1) // and lets go of w
		switch {                               // the token goes to the next:
		case pastDeadline(w.deadline, now):
			expireLocked(w)
			continue
		case c.lateLocked(w.deadline, now):
			c.shedOneLocked(w)
			continue
		}
		c.takeLocked()
		c.cur.sent++
		w.done = true
		w.ready <- nil
	}
	c.shedLocked(now)
	if len(c.line) == 0 {
		return
	}
	c.armLocked(now, max(time.Duration((1-c.ep.tokens)/c.ep.rate*float64(c.s.Interval)), minWait))
}

// armLocked makes the timer serve the line wait after now, unless it is
// armed to come sooner.
func (c *Controller) armLocked(now time.Time, wait time.Duration) {
	if c.timer.armed {
		if !now.Add(wait).Before(c.timer.due) || !c.timer.stop() {
			return // the timer comes soon enough, or is firing now
		}
	}
	c.timer.armed, c.timer.due = true, now.Add(wait)
	c.timer.stop = c.s.AfterFunc(wait, c.tick)
}

func (c *Controller) tick() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.timer.armed = false
	now := c.s.Now()
	c.advanceLocked(now)
	if c.pacing.Load() {
		c.serveLocked(now)
	}
}

// shedLocked refuses the waiters that would not be answered before their
// deadlines: each waits for its turn, then the least time an answer took
// in the last interval with answers. While the server is collapsed, or
// refused attempts in this interval (the rate is about to come down, or the
// server to collapse), or the rate is still below what the server is known
// to take or sustained before this episode (it may grow there at any
// moment), the wait cannot be told, and waiters stay until their own
// deadlines.
//
// Served newest first, the one k places from the newest waits about k+1
// tokens of what is left after newer arrivals. Served oldest first
// (byDeadlineLocked: earliest deadline first), the one with k kept ahead
// of it waits k+1 tokens of the rate, later arrivals queueing behind it.
// Either way the part of a token the bucket already holds is counted: the
// next token is that much nearer than a whole token's time.
func (c *Controller) shedLocked(now time.Time) {
	if c.collapsed.Load() || c.refusingLocked() || len(c.line) == 0 || c.ep.rate < max(c.freeLocked(), c.ep.before) {
		return // the rate is unknown, about to change, or still growing: no wait can be told
	}
	oldest := c.byDeadlineLocked()
	per := float64(c.s.Interval) / c.ep.rate
	kept := c.line[:0]
	n := len(c.line)
	for i, w := range c.line {
		k := n - 1 - i
		if oldest {
			k = len(kept)
		}
		eta := now.Add(time.Duration(max(float64(k+1)-c.ep.tokens, 0)*per) + c.ep.lastTook)
		switch {
		case pastDeadline(w.deadline, now):
			expireLocked(w)
			continue
		case !w.deadline.IsZero() && eta.After(w.deadline):
			c.shedOneLocked(w)
			continue
		}
		kept = append(kept, w)
	}
	clear(c.line[len(kept):])
	c.line = kept
}

// oldestFirstLocked reports whether the line is served oldest first: the
// line drains (drainingLocked), or every answer of the last interval with
// answers took an Interval or more, so the server keeps a queue of its own
// and the callers it can still answer in time are those with more time
// left than that. design.go says why oldest first then gets the most
// of them through.
func (c *Controller) oldestFirstLocked() bool {
	return c.ep.lastTook >= c.s.Interval || c.drainingLocked()
}

// byDeadlineLocked reports whether the line is served oldest first
// (oldestFirstLocked), and then keeps it in deadline order, earliest at
// the old end: sorted when that begins, each new waiter put in its place.
// Oldest first is meant to be earliest deadline first, and the line's
// order of arrival is not always that: a retry waits at the old end
// (AcquireRetry), where a call's retry after a failed probe, a call
// younger than most of the line, would take the tokens of the oldest
// waiters while they run out of time. A waiter without a deadline comes
// after every one with a deadline; waiters with the same deadline keep
// their order.
func (c *Controller) byDeadlineLocked() bool {
	oldest := c.oldestFirstLocked()
	if oldest && !c.edf {
		slices.SortStableFunc(c.line, func(a, b *waiter) int { return compareDeadlines(a.deadline, b.deadline) })
	}
	c.edf = oldest
	return oldest
}

// compareDeadlines orders deadlines earliest first, none (zero) last.
func compareDeadlines(a, b time.Time) int {
	switch {
	case a.IsZero() == b.IsZero():
		return a.Compare(b)
	case a.IsZero():
		return 1
	default:
		return -1
	}
}

// deadlineIndex is where a waiter with deadline goes in a line in deadline
// order: after every waiter whose deadline is not later.
func deadlineIndex(line []*waiter, deadline time.Time) int {
	return sort.Search(len(line), func(i int) bool { return compareDeadlines(line[i].deadline, deadline) > 0 })
}

// drainingLocked reports whether the line drains: the server answers
// again, refused nothing in this interval, and the rate is back at what it
// sustained before this episode (from there it grows, while attempts
// wait, until it and its burst are a quarter above the attempts that
// come). The attempts that come
// are then served as they were before the overload, and the tokens above
// them go to the callers who waited.
func (c *Controller) drainingLocked() bool {
	return !c.collapsed.Load() && !c.refusingLocked() && c.ep.before > 0 && c.ep.rate >= c.ep.before
}

// shedAllLocked lets every waiter go with err.
func (c *Controller) shedAllLocked(err error) {
	for _, w := range c.line {
		c.shedOneWithLocked(w, err)
	}
	clear(c.line)
	c.line = c.line[:0]
}

// shedOneLocked refuses waiter w with ErrShed; the caller takes it out of
// the line.
func (c *Controller) shedOneLocked(w *waiter) { c.shedOneWithLocked(w, ErrShed) }

// shedOneWithLocked refuses waiter w with err; the caller takes it out of
// the line.
func (c *Controller) shedOneWithLocked(w *waiter, err error) {
	w.done = true
	w.ready <- err
	c.stats.shed.Add(1)
}

// pastDeadline reports whether deadline (zero: none) has passed at t. A
// waiter's context may not have ended yet (its timer runs late under
// load), but an attempt sent now cannot be answered in time. Right after
// a collapse no answer has been timed, so lateLocked sheds nobody, and the
// oldest waiters, the first served once the line drains, are the ones
// past their deadlines: a token handed to one was an attempt that could
// not succeed, in place of one that could.
func pastDeadline(deadline, t time.Time) bool {
	return !deadline.IsZero() && !t.Before(deadline)
}

// expireLocked lets waiter w go with its context's error: its deadline
// has passed, and the controller shed nothing (it is not counted as
// shed, and its caller sees the DeadlineExceeded its context would give).
// The caller takes it out of the line.
func expireLocked(w *waiter) {
	w.done = true
	w.ready <- context.DeadlineExceeded
}

// lateLocked reports whether an attempt with deadline (zero: none), sent
// at t, could not be answered in time: it would have less time left than
// every answer of the last interval with answers took.
func (c *Controller) lateLocked(deadline, t time.Time) bool {
	return c.ep.lastTook > 0 && !deadline.IsZero() && deadline.Sub(t) < c.ep.lastTook
}

func (c *Controller) removeLocked(w *waiter) {
	if i := slices.Index(c.line, w); i >= 0 {
		c.line = slices.Delete(c.line, i, i+1)
	}
}
