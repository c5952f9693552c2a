package pacing

import (
	"math"
	"time"
)

// episode is the state of one episode of pacing, from beginLocked on.
type episode struct {
	// The token bucket: rate tokens per Interval.
	rate     float64
	tokens   float64
	refilled time.Time

	// collapsed: the server answered none of the last sample; only probes
	// go, one at probeAt or later (rule 5).
	collapsed bool
	probeAt   time.Time
	// spell is when the server's current run of refusals began (its first
	// refusal since its last answer); zero when it answered since.
	spell time.Time
	// probesRefused counts the probes refused in a row (rule 12).
	probesRefused int
	down          bool // rule 12
	fell          bool // the server collapsed in this episode (rule 5)

	began time.Time // when the episode began

	// target is the rate a restart goes to: what the server took before
	// the episode, lowered by each setback (rule 7).
	target   float64
	setbacks int
	holdTill time.Time // no growth before this (rules 6 and 7)
	// early is the outcomes still to come of the attempts in flight when
	// the episode began: a fresh client's target counts their answers
	// too (rule 6).
	early float64

	// sample is the outcomes of the attempts sent since the rate was last
	// set, which the next decision judges (the first outcomes after it,
	// as many as were in flight, are counted as the earlier attempts'); trig is the evidence that began the episode, which
	// rule 4 compares the sample with, and trigRate its attempts per
	// Interval.
	sample     counts
	sampleFrom time.Time
	before     float64 // outcomes still to come of attempts sent before the rate was set
	// answered counts every answer since the rate was set, those to
	// attempts sent before it too: what the server answered meanwhile.
	answered float64
	trig     counts
	trigRate float64
	// tried is true while the rate is one the controller chose to try (a
	// restart or growth), false while it is one the server's answers set;
	// stepped is the factor the last growth multiplied it by (1 after a
	// restart).
	tried   bool
	stepped float64

	refused     bool    // a refusal beyond the base share in the current Interval
	refusedLast bool    // and in the last one (the line's order, rule 9)
	waited      bool    // an attempt waited in the line since the rate last grew
	arrived     float64 // attempts that asked in the current Interval
	arrivals    float64 // their mean per Interval since the rate last grew
	arrivalsN   float64
	quiet       int           // calm Intervals in a row (rule 11)
	took        time.Duration // least time an answer took in the current Interval
	lastTook    time.Duration // in the last Interval with answers
}

// perInterval is the rate of n over d, in n per Interval, counting d as
// one Interval at least: a server that answers a burst and then refuses
// took the burst in one of its windows.
func (c *Controller) perInterval(n float64, d time.Duration) float64 {
	return n / max(1, float64(d)/float64(c.s.Interval))
}

// beginLocked starts an episode on the evidence e, gathered over span
// (rule 2): the rate becomes Headroom of the answers per Interval over
// it, or, if the server collapsed, probes only (rule 5). A restart later
// goes to what this client's traffic got before the episode or, for a
// fresh client, to Headroom of the most the server answered in one
// Interval of the Window: a herd's burst shows what the server takes per
// Interval, and its answers that come after its refusals count too
// (lateAnswerLocked).
func (c *Controller) beginLocked(now time.Time, e counts, span time.Duration) {
	c.pacing.Store(true)
	c.stats.episodes.Add(1)
	c.lastPaced = now
	c.ep = episode{began: now, refilled: now, sampleFrom: now, trig: e, trigRate: c.perInterval(e.outcomes(), span), spell: now,
		target: c.known, holdTill: now.Add(c.s.Hold), early: c.inflight}
	if c.known == 0 {
		c.ep.target = c.s.Headroom * c.mostAnswered() // a fresh client knows only what it saw now
	}
	rate := 0.0 // rule 5: the server collapsed
	if !c.collapsedRun() {
		rate = c.s.Headroom * e.answered * float64(c.s.Interval) / float64(max(span, minWait))
	}
	c.setRateLocked(now, rate)
}

// mostAnswered is the most the server answered in one Interval of the
// Window.
func (c *Controller) mostAnswered() float64 {
	var most float64
	for k := range buckets {
		most = max(most, c.ev.last(k).answered)
	}
	return most
}

// lateAnswerLocked counts an answer to an attempt that was in flight when
// the episode began (rule 6). A fresh client's target is Headroom of the
// most the server answered in one Interval, and a herd's answers can come
// back after enough of its refusals to begin the episode: each raises
// the target, and a rate just restarted at the target (not grown, not set
// back) rises with it.
func (c *Controller) lateAnswerLocked(now time.Time) {
	ep := &c.ep
	if c.known != 0 || ep.setbacks != 0 {
		return
	}
	t := c.s.Headroom * c.mostAnswered()
	if t <= ep.target {
		return
	}
	ep.target = t
	if !ep.collapsed && ep.tried && ep.stepped == 1 && ep.rate < t {
		ep.rate = t
		c.serveLocked(now)
	}
}

// setRateLocked sets the rate; 0 means the server collapsed: probes only.
func (c *Controller) setRateLocked(now time.Time, rate float64) {
	c.ep.rate = rate
	c.ep.tokens = 0
	c.ep.collapsed = rate < c.probeRate()
	if c.ep.collapsed {
		c.ep.fell = true
		c.ep.rate = 0
		c.ep.probeAt = now.Add(c.probeGap(c.s.Rand())) // the first within a mean gap
	}
	c.ep.sample, c.ep.sampleFrom, c.ep.before, c.ep.answered = counts{}, now, c.inflight, 0
}

// probeRate is the rate of probes while the server is collapsed, in
// attempts per Interval (rule 5): a 1/probeShare share of what this
// client's traffic got answered per Interval, so that a fleet's probes add
// up to that share of what the server took whatever the fleet's size
// (with nothing answered, 1/probeShare² of what it asks to send, over a
// whole Window, so that a herd's burst is not taken for a rate); at most one per
// Interval, and at least one per probeFloor Intervals.
func (c *Controller) probeRate() float64 {
	took := max(c.known, c.ep.target)
	if took == 0 { // nothing answered: a smaller share of what it sends
		took = c.ev.total().asked / buckets / probeShare
	}
	return min(1, max(1.0/probeFloor, took/probeShare))
}

// answeredLocked counts an answer while pacing, that took took (0: not
// known).
func (c *Controller) answeredLocked(now time.Time, took time.Duration) {
	ep := &c.ep
	if ep.before >= 1 {
		ep.before-- // sent before the rate was set
	} else {
		ep.sample.answered++
	}
	ep.answered++
	if ep.early >= 1 {
		ep.early--
		c.lateAnswerLocked(now)
	}
	ep.spell, ep.probesRefused = time.Time{}, 0
	if took > 0 && (ep.took == 0 || took < ep.took) {
		ep.took = took
	}
	if ep.collapsed { // rule 6
		c.restartLocked(now)
	}
}

// restartLocked restarts the rate after a collapse, at the first answer
// (rule 6): at the target, what the server took before the episode less
// the setbacks, which holds for a Hold.
func (c *Controller) restartLocked(now time.Time) {
	ep := &c.ep
	ep.down = false
	ep.holdTill = now.Add(c.s.Hold)
	c.setRateLocked(now, max(ep.target, c.probeRate()))
	ep.collapsed, ep.tried, ep.stepped = false, true, 1
	c.serveLocked(now)
}

// refusedLocked counts a refusal while pacing (late: a time-out).
func (c *Controller) refusedLocked(now time.Time, late bool) {
	ep := &c.ep
	if ep.before >= 1 {
		ep.before--
	} else {
		ep.sample.refused++
	}
	ep.early = max(ep.early-1, 0)
	if ep.spell.IsZero() {
		ep.spell = now
	}
	if ep.collapsed && !late {
		ep.probesRefused++
		if now.Sub(ep.spell) >= c.s.DownAfter && ep.probesRefused >= int(c.s.DownAfter/(2*c.s.Interval)) { // rule 12
			ep.down = true
		}
	}
	switch {
	case c.collapsedRun() && !ep.collapsed: // rule 5: the server collapsed
		if ep.tried {
			c.setbackLocked(now)
		}
		c.setRateLocked(now, 0)
		ep.tried, ep.refused = false, true
	case ep.sample.refused >= float64(c.s.MinFailures) && !ep.collapsed:
		c.decideLocked(now)
	}
	if ep.collapsed { // the waiters that cannot go before the next probe are shed (rule 10)
		c.serveLocked(now)
	}
}

// decideLocked judges the sample, which holds MinFailures refusals: if
// the share the server fails on its own explains them, or, at a rate
// lowered on refusals, they are as many as in that evidence, the
// refusals are the server's own (rule 4); otherwise the rate is too high
// (rule 7), and becomes Headroom of what the server answered since it
// was set: every answer counts, those to attempts sent before too, as a
// server that queues answers late what it refuses at once.
func (c *Controller) decideLocked(now time.Time) {
	ep := &c.ep
	s, span := ep.sample, now.Sub(ep.sampleFrom)
	switch {
	case c.run >= c.s.MinFailures: // a run: rule 5 judges it
	case !c.aboveOwn(s): // rule 4: the server's own share explains them
		c.ownLocked()
	case ep.trig.refused >= float64(c.s.MinFailures) && c.perInterval(s.outcomes(), span) <= c.s.Headroom*ep.trigRate && same(s, ep.trig): // rule 4
		c.independentLocked(s)
	default: // rule 7
		took := c.perInterval(ep.answered, span)
		if ep.tried {
			c.setbackLocked(now)
		}
		ep.tried = false
		c.setRateLocked(now, c.s.Headroom*took)
		ep.refused = true
	}
}

// same reports whether a is refused no less than b, but for chance: its
// share is at least b's less sdSame standard deviations of the
// difference of two samples.
func same(a, b counts) bool {
	na, nb := a.outcomes(), b.outcomes()
	if na == 0 || nb == 0 {
		return false
	}
	p := (a.refused + b.refused) / (na + nb)
	return a.share() >= b.share()-sdSame*math.Sqrt(p*(1-p)*(1/na+1/nb))
}

// setbackLocked lowers the restart target after the server refused too
// much at a rate this controller chose (rule 7): to Headroom of the rate
// before the last growth step (the last the server took: after a slow
// start's doubling, half the rate), and the hold after it doubles with
// each setback of the episode.
func (c *Controller) setbackLocked(now time.Time) {
	ep := &c.ep
	ep.setbacks++
	ep.target = min(ep.target, c.s.Headroom*ep.rate/max(ep.stepped, 1))
	ep.holdTill = now.Add(c.s.Hold << min(ep.setbacks, maxDoublings))
}

// independentLocked learns that the server fails the share of s's
// attempts on its own, whatever the load (rule 4), and ends the pacing.
func (c *Controller) independentLocked(s counts) {
	// The evidence that began the episode was refused as much: its
	// refusals were the server's own too.
	c.baseR, c.baseN = s.refused+c.ep.trig.refused, s.outcomes()+c.ep.trig.outcomes()
	c.base = c.baseR / c.baseN
	c.ownLocked()
}

// ownLocked ends an episode whose refusals were the server's own (rule
// 4): the Intervals since it began may be learnt from (rule 3).
func (c *Controller) ownLocked() {
	c.endLocked()
	c.lastPaced = c.ep.began
}

// intervalLocked runs the episode's rules at the end of an Interval whose
// outcomes were b, after one whose outcomes were prev.
func (c *Controller) intervalLocked(b, prev counts, now time.Time) {
	ep := &c.ep
	if ep.took > 0 {
		ep.lastTook = ep.took
	}
	ep.took = 0
	ep.refusedLast, ep.refused = ep.refused || b.refused > 0 && c.aboveOwn(b), false
	ep.arrivals += ep.arrived
	ep.arrivalsN++
	arrived := ep.arrived
	ep.arrived = 0
	// Rule 11: calm Intervals in a row end the pacing.
	if !ep.refusedLast && len(c.line) == 0 && !ep.collapsed && arrived < ep.rate/2 {
		ep.quiet++
		if ep.quiet >= c.s.Calm {
			c.endLocked()
			return
		}
	} else {
		ep.quiet = 0
	}
	c.growLocked(now, b, prev)
}

// growLocked grows the rate while attempts wait, the server refuses
// nothing beyond its own share and it keeps up with the rate (rule 8):
// after a Hold, back to what this client's traffic got before the
// episode at once, past it by a factor growth per Hold, never past growth
// times the attempts that come; while that bound is the target or more,
// a grown rate above it over a Window comes back down to it. With nothing
// known, a slow start doubles it per Interval, up to what drains the line
// within a Window if that is more. The server keeps up unless it ended
// fewer than keptUp of the attempts sent in the last two Intervals (b and
// prev), and MinFailures fewer at least: one that ends fewer queues them,
// and more would only lengthen its queue until it refuses. As in rule 2, a
// server whose layer below gave up on or held back some of them is not
// queueing: that layer holds calls back already.
func (c *Controller) growLocked(now time.Time, b, prev counts) {
	ep := &c.ep
	if ep.collapsed || ep.refusedLast || !ep.waited && len(c.line) == 0 {
		return
	}
	sent, ended := b.sent+prev.sent, b.answered+b.refused+b.gone+prev.answered+prev.refused+prev.gone
	if b.below+prev.below == 0 && sent-ended > float64(c.s.MinFailures) && ended < keptUp*sent {
		return
	}
	slow := ep.target == 0 && c.known == 0
	if !slow && now.Before(ep.holdTill) {
		return
	}
	mean := ep.arrivals / max(ep.arrivalsN, 1)
	next := ep.rate * growth
	switch {
	case slow:
		next = 2 * ep.rate
	case ep.rate < c.known:
		next = c.known
	}
	limit := growth * mean
	if slow {
		limit = max(limit, float64(len(c.line))/buckets)
	}
	next = min(next, limit)
	if next <= ep.rate {
		if ep.tried && ep.arrivalsN >= buckets && limit < ep.rate && limit >= ep.target && ep.target > 0 {
			// The bound holds after growth too, judged over a Window,
			// while it is the target or more: a client whose rate kept
			// the highest of its short samples would send above what
			// comes, and a fleet of them above the sum of what comes. A
			// herd's line, which nothing comes to replenish, drains at
			// the rate it grew to.
			ep.rate = limit
			ep.arrivals, ep.arrivalsN = 0, 0
		}
		return
	}
	ep.rate, ep.tried, ep.stepped = next, true, next/ep.rate
	ep.holdTill = now.Add(c.s.Hold)
	ep.waited, ep.arrivals, ep.arrivalsN = false, 0, 0
	c.serveLocked(now)
}

// endLocked ends the pacing: the line is let go and attempts go at once.
func (c *Controller) endLocked() {
	c.pacing.Store(false)
	c.lastPaced = c.s.Now()
	c.ep.down = false
	for _, w := range c.line {
		c.grantLocked(w, nil)
	}
	c.line = c.line[:0]
	c.timer.stopLocked()
}
