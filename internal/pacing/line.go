package pacing

import (
	"context"
	"slices"
	"sort"
	"time"
)

// waiter is an attempt waiting in the line.
type waiter struct {
	deadline time.Time // the call's deadline; zero: none
	// limit is when the waiter leaves the line unserved: its deadline, or
	// MaxWait after it came for one without (rule 12).
	limit time.Time
	// ready is called once, under the controller's lock, with nil (go),
	// an error (shed), or context.DeadlineExceeded (its limit passed).
	ready func(error)
	done  bool
}

// admit is Acquire without the wait: it reports err and queued false for
// an attempt that may go at once (err nil) or may not go at all, or puts w
// in the line (queued true), to be told by w.ready.
func (c *Controller) admit(deadline time.Time, retry bool, w *waiter) (err error, queued bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.s.Now()
	c.foldLocked(now)
	if !c.pacing.Load() {
		c.sentCalm()
		return nil, false
	}
	ep := &c.ep
	ep.arrived++
	c.ev.cur().asked++
	switch {
	case !deadline.IsZero() && !now.Before(deadline): // its context's timer has not run yet
		return context.DeadlineExceeded, false
	case ep.down && !c.probeDueLocked(now):
		c.stats.shed.Add(1)
		return ErrDown, false
	case c.lateLocked(deadline, now):
		c.stats.shed.Add(1)
		return ErrShed, false
	case len(c.line) == 0 && c.takeLocked(now):
		c.sentLocked()
		return nil, false
	}
	ep.waited = true
	w.deadline, w.limit = deadline, deadline
	if deadline.IsZero() {
		w.limit = now.Add(c.s.MaxWait)
	}
	if c.edfLocked() {
		i := limitIndex(c.line, w.limit)
		if c.unreachableLocked(i, w.limit, now) { // rule 10
			c.stats.shed.Add(1)
			return ErrShed, false
		}
		c.line = slices.Insert(c.line, i, w)
	} else if retry {
		c.line = slices.Insert(c.line, 0, w) // the old end: served last newest first
	} else {
		c.line = append(c.line, w)
	}
	c.serveLocked(now)
	return nil, true
}

// leave takes w out of the line when its caller gave up waiting, and
// reports whether it had been told already (its ready was called). A token
// it was given goes back.
func (c *Controller) leave(w *waiter) (told bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if w.done {
		return true
	}
	if i := slices.Index(c.line, w); i >= 0 {
		c.line = slices.Delete(c.line, i, i+1)
	}
	w.done = true
	return false
}

// sentLocked counts an attempt sent while pacing.
func (c *Controller) sentLocked() {
	c.ev.cur().sent++
	c.ep.sample.sent++
	c.runSent++
	c.inflight++
}

// grantLocked tells w err (nil: go) once.
func (c *Controller) grantLocked(w *waiter, err error) {
	if !w.done {
		w.done = true
		w.ready(err)
	}
}

// edfLocked reports whether the line is served by deadline (rule 9): the
// server refuses nothing, or answers late (every answer of the last
// Interval with answers took an Interval or more); newest first while it
// refuses. A switch to deadline order sorts the line.
func (c *Controller) edfLocked() bool {
	ep := &c.ep
	refusing := ep.collapsed || ep.refused || ep.refusedLast || ep.sample.refused > 0 && c.aboveOwn(ep.sample)
	edf := ep.lastTook >= c.s.Interval || !refusing
	if edf && !c.edf {
		slices.SortStableFunc(c.line, func(a, b *waiter) int { return a.limit.Compare(b.limit) })
	}
	c.edf = edf
	return edf
}

// limitIndex is where a waiter that leaves at limit goes in a line in
// deadline order: behind those that leave no later.
func limitIndex(line []*waiter, limit time.Time) int {
	return sort.Search(len(line), func(i int) bool { return line[i].limit.After(limit) })
}

// unreachableLocked reports whether the waiter at index i of the line in
// deadline order cannot be answered before limit at the current rate: its
// turn, then the least time the server took to answer (rule 10). Only
// while the server refuses nothing: a rate that may change says nothing
// of a turn.
func (c *Controller) unreachableLocked(i int, limit, now time.Time) bool {
	ep := &c.ep
	if ep.collapsed || ep.refused || ep.refusedLast || ep.rate <= 0 {
		return false
	}
	ahead := float64(i+1) - ep.tokens
	wait := time.Duration(max(ahead, 0) / ep.rate * float64(c.s.Interval))
	return now.Add(wait + ep.lastTook).After(limit)
}

// lateLocked reports whether an attempt due by deadline (zero: none) has
// less time left than every answer of the last Interval with answers took
// (rule 10): sent, it would be answered too late.
func (c *Controller) lateLocked(deadline, now time.Time) bool {
	return !deadline.IsZero() && c.ep.lastTook > 0 && deadline.Sub(now) < c.ep.lastTook
}

// probeDueLocked reports whether a probe may go now, and if so takes it.
func (c *Controller) probeDueLocked(now time.Time) bool {
	if now.Before(c.ep.probeAt) {
		return false
	}
	c.ep.probeAt = now.Add(c.probeGap(0.5 + c.s.Rand()))
	return true
}

// probeGap is the time to the next probe: f times the mean gap, where f
// is random (rule 5): the clients of a fleet that saw the same collapse
// would otherwise probe in step, and their probes together keep the
// server down.
func (c *Controller) probeGap(f float64) time.Duration {
	return time.Duration(f * float64(c.s.Interval) / c.probeRate())
}

// takeLocked takes a token (while collapsed: a probe) and reports whether
// there was one.
func (c *Controller) takeLocked(now time.Time) bool {
	ep := &c.ep
	if ep.collapsed {
		return c.probeDueLocked(now)
	}
	c.refillLocked(now)
	if ep.tokens < 1 {
		return false
	}
	ep.tokens--
	return true
}

// refillLocked adds the tokens earned since the last refill, keeping at
// most 1/burstShare of an Interval's worth (at least one).
func (c *Controller) refillLocked(now time.Time) {
	ep := &c.ep
	if d := now.Sub(ep.refilled); d > 0 {
		ep.tokens = min(ep.tokens+ep.rate*float64(d)/float64(c.s.Interval), max(1, ep.rate/burstShare))
		ep.refilled = now
	}
}

// serveLocked hands tokens to the waiters in the line's order, lets go of
// those whose limit passed or that are shed, and arms the timer for what
// comes next.
func (c *Controller) serveLocked(now time.Time) {
	if !c.pacing.Load() {
		return
	}
	edf := c.edfLocked()
	for len(c.line) > 0 {
		i := len(c.line) - 1 // the newest
		if edf {
			i = 0
		}
		w := c.line[i]
		switch {
		case !now.Before(w.limit):
			c.line = slices.Delete(c.line, i, i+1)
			c.expireLocked(w)
			continue
		case c.lateLocked(w.deadline, now):
			c.line = slices.Delete(c.line, i, i+1)
			c.stats.shed.Add(1)
			c.grantLocked(w, ErrShed)
			continue
		}
		if !c.takeLocked(now) {
			break
		}
		c.line = slices.Delete(c.line, i, i+1)
		c.sentLocked()
		c.grantLocked(w, nil)
	}
	c.expireDueLocked(now)
	c.armLocked(now)
}

// expireLocked lets go of a waiter whose limit passed: its deadline
// (context.DeadlineExceeded, as its context would say), or MaxWait
// (ErrShed).
func (c *Controller) expireLocked(w *waiter) {
	if w.deadline.IsZero() {
		c.stats.shed.Add(1)
		c.grantLocked(w, ErrShed)
		return
	}
	c.grantLocked(w, context.DeadlineExceeded)
}

// expireDueLocked lets go of every waiter whose limit passed, and sheds
// every waiter that cannot go before its limit (rule 10): while the
// target collapsed on refusals and no attempt is in flight, nothing goes
// before the next probe. A target whose last refusal was a time-out may
// be slow, not refusing: its callers see their deadlines pass, as they
// would without the controller.
func (c *Controller) expireDueLocked(now time.Time) {
	next := now
	if c.ep.collapsed && c.inflight < 1 && !c.timedOut {
		next = later(now, c.ep.probeAt)
	}
	c.line = slices.DeleteFunc(c.line, func(w *waiter) bool {
		switch {
		case next.Before(w.limit):
			return false
		case now.Before(w.limit):
			c.stats.shed.Add(1)
			c.grantLocked(w, ErrShed)
		default:
			c.expireLocked(w)
		}
		return true
	})
}

// lineTimer serves the line when the next token, probe or limit is due.
type lineTimer struct {
	armed bool
	due   time.Time
	stop  func() bool
}

func (t *lineTimer) stopLocked() {
	if t.armed {
		t.stop()
		t.armed = false
	}
}

// armLocked sets the timer for the next moment the line can move: a token
// or a probe for its first waiter, or a waiter's limit.
func (c *Controller) armLocked(now time.Time) {
	if len(c.line) == 0 {
		c.timer.stopLocked()
		return
	}
	ep := &c.ep
	var next time.Time
	switch {
	case ep.collapsed:
		next = ep.probeAt
	case ep.rate > 0:
		next = now.Add(time.Duration((1 - ep.tokens) / ep.rate * float64(c.s.Interval)))
	}
	for _, w := range c.line {
		if next.IsZero() || w.limit.Before(next) {
			next = w.limit
		}
	}
	next = later(next, now.Add(minWait))
	if c.timer.armed && !next.Before(c.timer.due) && c.timer.due.After(now) {
		return // due sooner already
	}
	c.timer.stopLocked()
	c.timer.armed, c.timer.due = true, next
	c.timer.stop = c.s.AfterFunc(next.Sub(now), c.tick)
}

// tick is the line timer's function.
func (c *Controller) tick() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.timer.armed = false
	now := c.s.Now()
	c.foldLocked(now)
	c.serveLocked(now)
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
