package pacing

import "math"

// triggerMargin is how many standard deviations a share of refusals must
// be above what is expected of it to count: above FailureRatio for a calm
// controller to start pacing, above the server's own share of independent
// failures for them to be load. The rule is checked at every refusal,
// against the attempts counted so far in the interval
// (triggerCountLocked): without a margin, chance runs of independent
// failures well below the ratio would start the pacing now and then.
const triggerMargin = 2

// baseKeep is the weight an interval's counts keep in the server's share
// of independent failures for each interval since.
const baseKeep = 0.95

// cleanAnswers is how many answers without a refusal, in an interval
// that took more than any before it, show that the server's refusals at a
// higher rate are load (see learnShareLocked): a server that fails a
// third of its attempts on its own rarely answers that many in a row.
const cleanAnswers = 10

// moreMargin is how much more than any interval of an episode before it an
// interval must take for its refusals to teach the share of independent
// failures (see learnShareLocked): the rate grows by a quarter at a time,
// and answers that cross an interval's end move a few percent.
const moreMargin = 1.1

// allRefusedChance bounds the chance that a server's independent failures
// refuse every attempt of an interval so far, for that to start the
// pacing: a server that fails most attempts on its own refuses a run of
// MinFailures in a row now and then, which is no overload.
const allRefusedChance = 1e-6

// share is a count of refusals (fail) among attempts (all).
type share struct{ fail, all float64 }

// baseLocked is the server's share of independent failures: of its
// answers in the intervals that were not overloaded, recent ones weighing
// more, the share it refused.
func (c *Controller) baseLocked() float64 {
	if c.base.all == 0 {
		return 0
	}
	return c.base.fail / c.base.all
}

// baseAddLocked counts fail refusals of n answers of a calm stretch of k
// intervals that was not overloaded: what was counted before weighs
// baseKeep less for each of them.
func (c *Controller) baseAddLocked(fail, n, k float64) {
	keep := math.Pow(baseKeep, k)
	c.base.fail = c.base.fail*keep + fail
	c.base.all = c.base.all*keep + n
}

// learnShareLocked counts a paced interval that answered ok and refused
// fail toward the share of independent failures, if it took clearly more
// than any interval of this episode before it: no capacity the server
// showed bounded it, so the refusals beside are taken for its share of
// independent failures, counted as while calm. Without this a fresh
// client, which knows no calm, would take a server that fails a share of
// its attempts on its own for one overloaded for good, once paced.
//
// Not after such an interval that had cleanAnswers answers or more and no
// refusal: a server that failed nothing on its own at the lower rate
// refuses for load at this one. That is a capacity cut, as the rate passes
// it, and a share learnt from it would then take some of the cut's
// refusals for the server's own. "Clearly" (moreMargin) leaves out the
// interval that takes an answer or two more than the cut because answers
// near the end of an interval fall into the next.
func (c *Controller) learnShareLocked(ok, fail float64) {
	if ok <= c.ep.tookMost {
		return
	}
	if ok >= moreMargin*c.ep.tookMost {
		if !c.ep.moreClean && !c.collapsed.Load() && fail < c.s.FailureRatio*(ok+fail) {
			c.baseAddLocked(fail, ok+fail, 1)
		}
		c.ep.moreClean = fail == 0 && ok >= cleanAnswers
	}
	c.ep.tookMost = ok
}

// refusedLocked reports whether fail refusals of n answers are more than
// the server's independent failures explain: above its share of them
// (baseLocked) by triggerMargin standard deviations. A server that failed
// nothing on its own explains no refusal. Without this, a server that
// fails a share of its attempts on its own, once paced, would have its
// rate cut to Headroom of its answers in every interval, and never grow it
// again.
func (c *Controller) refusedLocked(fail, n float64) bool {
	b := c.baseLocked()
	return fail > b*n+triggerMargin*math.Sqrt(n*b*(1-b))
}

// refusingLocked reports whether the current interval's refusals so far
// are more than the server's independent failures explain.
func (c *Controller) refusingLocked() bool {
	return c.cur.fail > 0 && c.refusedLocked(float64(c.cur.fail), float64(c.cur.fail)+float64(c.ok.Load()))
}

// indepLocked reports whether fail refusals of n attempts are within the
// share of independent failures the last confirmation showed (by
// triggerMargin standard deviations).
func (c *Controller) indepLocked(fail, n float64) bool {
	b := c.indep
	return b > 0 && fail <= b*n+triggerMargin*math.Sqrt(n*b*(1-b))
}

// overloadShareLocked is the share of refusals that says a server is
// overloaded: FailureRatio of the attempts its independent failures leave
// (baseLocked). A server that fails 67 % of attempts on its own refuses
// more than half of them whatever the load; it is overloaded when it also
// refuses more than half of the rest.
func (c *Controller) overloadShareLocked() float64 {
	b := c.baseLocked()
	return b + (1-b)*c.s.FailureRatio
}

// triggerLocked reports whether fail refusals of n attempts (at least
// MinFailures; see triggerCountLocked) say that a calm server is
// overloaded: they are every attempt, or more than FailureRatio of them by
// triggerMargin standard deviations; and more than its independent
// failures explain.
func (c *Controller) triggerLocked(fail, n float64) bool {
	r := c.overloadShareLocked()
	return (fail == n && math.Pow(c.baseLocked(), n) < allRefusedChance || fail >= r*n+triggerMargin*math.Sqrt(n*r*(1-r))) &&
		c.refusedLocked(fail, n)
}
