package pacing

import (
	"math"
	"time"
)

// growStep is what the rate is multiplied by at each step of its growth
// past what the server is known to take: a quarter per step (per Hold
// while attempts wait, per interval while none do) finds a capacity that
// returned within a few steps, and each step risks little past it.
const growStep = 1.25

// aboveArrivals is how far above the attempts that come (their mean) the
// rate and the bucket's burst may grow past what is known: enough to drain
// the line on the tokens above the arrivals, and no more, as every step
// past what the server is known to take is a risk.
const aboveArrivals = 1.25

// quietShare is the share of the rate that the attempts of an interval
// must stay at or below, nobody waiting, for the interval to count toward
// the Calm intervals that end the pacing: well below the rate, so that
// the end of the pacing does not let a load that needs it come back.
const quietShare = 0.5

// refusedPerLate is how many times its time-outs an interval's refusals
// must be for the interval to count toward downIntervals: a server that
// only times out is slow, not down (see Late).
const refusedPerLate = 2

// maxHoldDoublings bounds how often the hold after a setback doubles: up
// to 16 Hold, after which a server kept down by its load has had its calm.
const maxHoldDoublings = 4

// slowStart is the rate, in attempts per interval, at which a restart with
// nothing known begins; each answer then adds a token (slowStartLocked).
const slowStart = 2

// firstProbes is the rate, in attempts per interval, at which a server
// is probed in the first firstProbeIntervals of an episode (later, one per
// interval): soon after the trigger, a server that fails most attempts
// on its own, whatever the load, answers one soon, and one that collapsed
// under a herd takes so few in stride. Probed once per interval from the
// start, callers of a server that fails most attempts on its own would be
// held far longer before a confirmation shows it.
const (
	firstProbes         = 4
	firstProbeIntervals = 3
)

// downIntervals is how many intervals in a row a collapsed server that
// never answered must refuse, answering nothing, to be down (1 s at the
// default Interval): one that restarts while it holds a fresh client's
// first attempts has not answered yet either, and comes back; found down
// too soon, the calls that would have outlived the restart fail.
const downIntervals = 10

// advanceLocked closes every interval that has ended by now and adjusts
// the rate after each.
func (c *Controller) advanceLocked(now time.Time) {
	if c.pacing.Load() {
		c.refillLocked(now)
	}
	for now.Sub(c.start) >= c.s.Interval {
		n := now.Sub(c.start) / c.s.Interval
		ok := float64(c.ok.Swap(0))
		if !c.pacing.Load() {
			c.closeCalmLocked(ok, n, now)
			return
		}
		c.closeLocked(ok, now)
		c.start = c.start.Add(c.s.Interval)
		if !c.pacing.Load() {
			c.calmFromLocked(now)
			return
		}
	}
}

// closeLocked adjusts the rate at the end of a paced interval in which the
// server answered ok attempts and refused c.cur.fail.
func (c *Controller) closeLocked(ok float64, now time.Time) {
	cur := c.cur
	c.cur = interval{}
	fail := float64(cur.fail)
	defer func() { c.ep.fresh = false }()
	if ok > 0 {
		c.answeredEver = true
	}
	// A capacity, or a setback's lesson, is taken only from enough
	// answers: a handful (an interval in which the rate had just
	// restarted, or one refused by chance) shows none, and would hold the
	// rate under it.
	enough := ok+fail >= float64(c.s.MinFailures)
	// The server's share of independent failures before this interval,
	// which may add to it (learnShareLocked), explains some of its
	// refusals.
	base := c.baseLocked()
	c.learnShareLocked(ok, fail)
	// Refusals the server's independent failures explain are not load:
	// with them the interval counts as one without refusals.
	refused := c.refusedLocked(fail, ok+fail)
	overloaded := refused && fail >= c.overloadShareLocked()*(ok+fail)
	waited := cur.waited || len(c.line) > 0
	cut := c.ep.cut
	c.ep.cut = false
	c.ep.lastIn = cur.arrived
	c.ep.inSum += float64(cur.arrived)
	c.ep.inN++
	sent := float64(cur.sent)
	late := float64(cur.lateFail)
	if ok > 0 { // an interval without answers says nothing of their time
		c.ep.lastTook = cur.took
	}

	if c.collapsed.Load() || overloaded {
		switch {
		case ok > 0:
			c.ep.refusedRun = 0
		case fail > refusedPerLate*late: // refused, not slow: see Late
			c.ep.refusedRun++
		}
	}
	switch {
	case c.ep.confirm.need > 0:
		// Confirming: the batch's outcomes decide (judgeLocked).
	case overloaded:
		c.overloadedLocked(ok, fail, sent, enough, now)
	case c.collapsed.Load():
		// Still waiting for a probe's answer.
		c.ep.rate = c.probeRateLocked(now)
	case refused:
		c.refusedSomeLocked(ok, fail, base, cut, enough, now)
	case waited:
		c.learnLocked(min(ok, sent))
		c.ep.quiet = 0
		if ok > 0 {
			c.growLocked(now)
		}
	default:
		c.learnLocked(min(ok, sent))
		// Nobody waited: the rate may rise to what the server is known
		// to take, and the pacing ends once the attempts have stayed
		// well below the rate for Calm intervals.
		if c.boundLocked() {
			c.ep.rate = max(c.ep.rate, min(growStep*c.ep.rate, c.freeLocked()))
		} else {
			c.ep.rate *= growStep
		}
		if float64(c.ep.lastIn) <= c.ep.rate*quietShare {
			c.ep.quiet++
		} else {
			c.ep.quiet = 0
		}
		if c.ep.quiet >= c.s.Calm && len(c.line) == 0 {
			c.endLocked()
		}
	}
	if c.collapsed.Load() && !c.ep.down && !c.answeredEver && c.ep.refusedRun >= downIntervals {
		c.downLocked()
	}
}

// overloadedLocked closes an interval in which the server collapsed, or
// took ok and refused the rest (its capacity), of sent attempts: a server
// that refuses for load is often down for a while (it recovers only once
// it is left alone), so it is probed until a probe is answered.
func (c *Controller) overloadedLocked(ok, fail, sent float64, enough bool, now time.Time) {
	if ok > 0 && enough {
		c.ep.ceiling = ok
	}
	if !c.collapsed.Load() || c.ep.fresh {
		c.ep.trig = share{fail: fail, all: max(ok+fail, sent)} // judged by a confirmation at its end
	}
	if !c.collapsed.Load() && sent > 1 && enough {
		// The server collapsed under the rate this controller chose:
		// that rate is too much for now, whatever was known. The load is
		// what the server answered in the interval, or the attempts sent
		// in it if more: an interval in which the rate restarted sends a
		// few, and those few alone would hold the rate under them.
		load := max(sent, ok+fail)
		c.known = min(c.known, c.s.Headroom*load)
		c.ep.ceiling = min(c.ep.ceiling, load)
		c.ep.setbacks++
		c.ep.setback = now
	}
	c.collapsed.Store(true)
	c.ep.rate, c.ep.quiet = c.probeRateLocked(now), 0
}

// refusedSomeLocked closes an interval with some refusals beyond the
// server's share of independent failures (base), fewer than FailureRatio:
// the server took ok answers, so the rate comes down to Headroom of that if
// it was above; it neither grows nor learns. Where a capacity it showed is
// being tried higher (growLocked), ok is that capacity now, and the next
// try is a hold away.
//
// The cut counts attempts, as the rate does: the answers and the refusals
// the server's share of independent failures explains. Cut to Headroom of
// its answers alone, the rate of a server that fails a share on its own
// would fall below the attempts it takes after each chance refusal, and
// the line that built would keep the pacing on. The capacities it shows and
// what is learnt stay counted in answers: counted in attempts, a herd would
// be sent more than the server takes.
//
// In the interval right after a cut (the last interval's, cut) the rate
// holds: its refusals are mostly the echo of the rate before it (the
// server's windows are not the controller's intervals, and the last
// attempts sent at the old rate land in this one), and cut again, the rate
// would fall well below a cut server's capacity.
func (c *Controller) refusedSomeLocked(ok, fail, base float64, cut, enough bool, now time.Time) {
	took := ok + min(fail, base*(ok+fail))
	if !cut && c.s.Headroom*took < c.ep.rate {
		c.ep.rate, c.ep.cut = max(1, c.s.Headroom*took), true
	}
	if ok > 0 && ok < c.ep.ceiling && enough {
		c.ep.ceiling = ok
		c.ep.growAt = now.Add(c.holdLocked())
	}
	c.ep.quiet = 0
}

// restartLocked sets the rate after the first answer that ends a collapse.
func (c *Controller) restartLocked(now time.Time) { c.restartAfterLocked(now, 0) }

// restartAfterLocked is restartLocked after sent attempts went at once in
// this interval (a confirmation's batch): the restarted rate counts them,
// up to an interval's worth of it, so that the server's window takes no
// more than the rate.
func (c *Controller) restartAfterLocked(now time.Time, sent float64) {
	c.collapsed.Store(false)
	c.ep.rate, c.ep.growAt = c.freeLocked(), now.Add(c.s.Hold)
	c.ep.inSum, c.ep.inN = 0, 0 // the arrivals while collapsed hold the retries of its refusals
	if c.ep.setbacks > 0 {
		// The hold runs from the setback: a server that stayed down
		// while it was left alone has already had that time.
		c.ep.growAt = c.ep.setback.Add(c.holdLocked())
	}
	if math.IsInf(c.ep.rate, 1) {
		c.ep.rate, c.ep.growAt = slowStart, now // nothing known: a slow start, at once
	}
	c.ep.tokens -= min(sent, c.ep.rate)
	c.serveLocked(now)
}

// probeRateLocked is the rate at which a collapsed server is probed now:
// firstProbes early in the episode, until a confirmation showed its
// refusals are load, then one per interval.
func (c *Controller) probeRateLocked(now time.Time) float64 {
	if !c.ep.loadShown && now.Sub(c.ep.began) < firstProbeIntervals*c.s.Interval {
		return firstProbes
	}
	return 1
}

// downLocked marks a collapsed server that never answered this controller,
// and refused every attempt of downIntervals intervals, as down: holding
// attempts back cannot be shown to help a server that served nothing, so
// the line lets its waiters go at once with [ErrDown], and attempts that
// come are refused so, but for one probe per interval.
func (c *Controller) downLocked() {
	c.ep.down = true
	c.shedAllLocked(ErrDown)
}

// holdLocked is how long after a setback (a collapse under a rate this
// controller chose) the rate holds before it grows past what is known:
// Hold, doubled for each setback in this episode after the first, up to
// maxHoldDoublings times.
func (c *Controller) holdLocked() time.Duration {
	return c.s.Hold << min(max(c.ep.setbacks-1, 0), maxHoldDoublings)
}

// freeLocked is the rate the controller may return to without holding:
// what the server sustained before the overload, or Headroom of the
// capacity it showed since; +Inf when nothing is known.
func (c *Controller) freeLocked() float64 {
	if f := max(c.known, c.s.Headroom*c.ep.ceiling); f > 0 {
		return f
	}
	return math.Inf(1)
}

// learnLocked raises what the server is known to sustain after an interval
// in which it took ok attempts and refused none, once that is more than the
// capacity it showed in this episode: the capacity has grown since. The
// caller passes no more than the attempts sent in the interval, and no more
// than the interval's rate is learnt: answers to attempts sent in the one
// before, which land late, and the tokens a bucket kept from it, are no
// proof of more capacity. A rate held just under a capacity would
// otherwise learn that noise, one more each interval, creep past the
// capacity, and collapse the server.
//
// With nothing known the rate is in its slow start: answers then say only
// that the server takes at least that many, which the slow start already
// follows, and are not taken as what it sustains.
func (c *Controller) learnLocked(ok float64) {
	ok = min(ok, c.ep.rate)
	if ok > c.ep.ceiling && (c.known > 0 || c.ep.ceiling > 0) {
		c.known = max(c.known, ok)
	}
}

// boundLocked reports whether the capacity the server showed in this
// episode is what limits the rate: it took that many and refused the rest,
// and it sustained no more before the overload.
func (c *Controller) boundLocked() bool {
	return c.ep.ceiling > 0 && c.ep.ceiling >= c.known
}

// slowStartLocked reports whether the rate is below what the server may
// take, with no refusal in this interval: it grows with each answer.
func (c *Controller) slowStartLocked(now time.Time) bool {
	return !c.refusingLocked() && c.ep.rate < c.freeLocked() && !now.Before(c.ep.growAt)
}

// growLocked raises the rate after an interval whose attempts had to wait
// and were not refused.
func (c *Controller) growLocked(now time.Time) {
	if now.Before(c.ep.growAt) {
		return
	}
	// Past what is known, the rate grows only to meet the attempts that
	// come: it need not be far above them to drain the line, and every
	// step past what the server is known to take is a risk. What the
	// server may get in a window of its own is the rate and the bucket's
	// burst (refillLocked) together: they stay within aboveArrivals of
	// the attempts that come (top), as the server's windows are not the
	// controller's intervals.
	//
	// The attempts that come are their mean since the rate last grew
	// past what is known (a hold, at least): the rate only rises, and
	// stepped to a quarter above a single interval's count, it would
	// follow that count's highs.
	top := aboveArrivals * c.ep.inSum / float64(c.ep.inN) / (1 + 1.0/burstDivisor) // closeLocked counted this interval: inN > 0
	if free := c.freeLocked(); c.ep.rate < free {
		c.ep.rate = min(2*c.ep.rate, free)
		if c.ep.rate == free && c.boundLocked() {
			c.ep.growAt = now.Add(c.holdLocked()) // see below
		}
		return
	}
	if c.boundLocked() {
		// The capacity the server showed in this episode bounds the
		// rate, but not for good: after a hold at it with attempts
		// waiting and no refusal, it is tried higher (doubled back to
		// the most the server took in an interval of this episode, then
		// a quarter up, never past top), and a refusal there shows it
		// again (closeLocked). A capacity may come back, and one is
		// shown too low by an interval in which the server still
		// refused the burst of the one before, or by a handful of
		// attempts: for good, the rate could never rise past it again
		// (answers above the rate are not learnt) and the pacing, with
		// attempts waiting, never end.
		if c.ep.rate < top {
			next := growStep * c.ep.ceiling
			if c.ep.ceiling < c.ep.tookMost {
				next = min(2*c.ep.ceiling, c.ep.tookMost) // it took that much in this episode
			}
			c.ep.ceiling = min(next, top/c.s.Headroom)
			c.ep.rate = c.freeLocked()
			c.ep.growAt = now.Add(c.holdLocked())
			c.ep.inSum, c.ep.inN = 0, 0
		}
		return
	}
	if c.ep.rate < c.ep.before {
		// Back toward what the server sustained before this episode:
		// its capacity was cut, and may have returned. A collapse on the
		// way lowers what is known and doubles the wait before the next
		// try (holdLocked).
		c.ep.rate = min(2*c.ep.rate, c.ep.before)
		if c.ep.rate == c.ep.before {
			c.ep.growAt = now.Add(c.s.Hold) // past it only after a hold
		}
		return
	}
	// Past what is known: toward top, by growStep per Hold.
	if c.ep.rate >= top {
		return
	}
	c.ep.rate = min(growStep*c.ep.rate, top)
	c.ep.growAt = now.Add(c.s.Hold)
	c.ep.inSum, c.ep.inN = 0, 0
}
