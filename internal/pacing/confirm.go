package pacing

import (
	"math"
	"time"
)

// Confirmation batch sizes: see answeredCollapsedLocked.
const (
	confirmMin = 4
	confirmMax = 8
)

// confirmation is the state of a confirmation (answeredCollapsedLocked).
type confirmation struct {
	batch    int // tokens of the batch not yet given out
	need     int // outcomes it waits for; 0: not confirming
	ok, fail int // the outcomes counted so far
}

// answeredCollapsedLocked counts an answer while the server is collapsed:
// it ends the collapse, but does not yet restart the rate. It starts a
// confirmation: a batch of attempts goes at once, far fewer than were
// refused (at most what the server answered in the interval that began the
// episode, and at most confirmMax), and their outcomes, counted apart from
// the interval's, decide what the refusals were (judgeLocked). A server
// that was overloaded answers such a batch; one that fails a share of its
// attempts whatever the load refuses the same share of it.
func (c *Controller) answeredCollapsedLocked(now time.Time) {
	c.ep.down = false
	k := int(min(max(c.ep.trig.all-c.ep.trig.fail, confirmMin), confirmMax))
	c.ep.confirm = confirmation{batch: k, need: k}
	if len(c.line) > 0 {
		c.armLocked(now, 0) // the line takes the batch at once, on the timer's goroutine
	}
}

// unconfirmedLocked counts an outcome of the confirmation's batch that says
// nothing (Ignored: the caller cancelled, a layer below gave up, the line
// spent the caller's time): the batch waits for one outcome fewer, and is
// judged on those it has. Waited for, such an outcome would hold the
// episode confirming until a later attempt's outcome took its place, at one
// probe per interval, while the line shed; a batch of which nothing is
// counted shows nothing, and the server is probed again.
func (c *Controller) unconfirmedLocked(now time.Time) {
	cf := &c.ep.confirm
	cf.need--
	cf.batch = min(cf.batch, cf.need)
	if cf.ok+cf.fail == 0 && cf.need == 0 {
		return // nothing counted: still collapsed, probing
	}
	c.judgeLocked(now)
}

// judgeLocked decides, once the confirmation batch's outcomes are in, what
// the episode's refusals were. The probe's answer that began it showed the
// server answers at the low rate; then:
//   - the batch was refused no less than the interval that collapsed the
//     server, beyond chance (lessRefused): holding back did not help, the
//     refusals are independent of the load, and the pacing ends
//     (independentLocked);
//   - otherwise the server took at the low rate what it refused at the
//     high one: it was overloaded, and the rate restarts (restartLocked).
//
// The batch is held to the trigger's share, not to the server's known
// share of independent failures: a server that fails most attempts on its
// own refuses about that much of a batch whatever started the episode (a
// chance run of refusals, say), and taken for load, it would be paced.
func (c *Controller) judgeLocked(now time.Time) {
	cf := c.ep.confirm
	n := cf.ok + cf.fail
	if n < cf.need {
		return
	}
	ok, fail := float64(cf.ok), float64(cf.fail)
	sent := cf.need - cf.batch // the batch's attempts that went
	c.ep.confirm.need, c.ep.confirm.batch = 0, 0
	switch {
	case c.ep.trig.all > 0 && !lessRefused(fail, float64(n), c.ep.trig.fail, c.ep.trig.all):
		c.independentLocked(ok, fail)
	default:
		// The refusals followed the load. The batch went in this
		// interval: the restarted rate counts it (sent with a restarted
		// rate's worth into the same window, it would collapse a server
		// that takes little more), but for no more than an interval:
		// counted whole against a slow start, a batch would hold it back
		// for several intervals.
		c.indep, c.ep.loadShown = 0, true
		c.restartAfterLocked(now, float64(sent))
	}
}

// lessRefused reports whether fail refusals of n attempts are a smaller
// share than trigFail of trigN, by more than chance makes: triggerMargin
// standard deviations of the difference of the two shares.
func lessRefused(fail, n, trigFail, trigN float64) bool {
	if n == 0 || trigN == 0 {
		return false
	}
	p := (fail + trigFail) / (n + trigN)
	sd := math.Sqrt(p * (1 - p) * (1/n + 1/trigN))
	return trigFail/trigN-fail/n > triggerMargin*sd
}

// independentLocked ends an episode whose refusals a confirmation showed
// to be independent of the load: the server refused ok and fail of the
// batch about as it refused the interval that began the episode. The
// share of both is learnt as the server's own, in place of what was known,
// so that refusals within it no longer start the pacing, and calm
// intervals within it teach it from then on (indepLocked).
func (c *Controller) independentLocked(ok, fail float64) {
	n := c.ep.trig.all + ok + fail
	c.indep = (c.ep.trig.fail + fail) / n
	c.base = share{fail: c.indep * n, all: n}
	c.endLocked()
}
