package pacing

import (
	"sync/atomic"
	"time"
)

// calmCounts are counted without the lock while calm.
type calmCounts struct {
	// The attempts sent in the current interval, and those of it that
	// ended saying nothing (Ignored); see triggerCountLocked.
	sent, lost atomic.Int64
	// The time of the first answer since start, and of the last
	// calmBatch-th, in Unix nanoseconds (0: none yet), and the count of
	// answers at that one; see calmRateLocked.
	firstAt, batchAt, batchN atomic.Int64
}

// calmBatch is how many calm answers go between two readings of the clock
// (a power of two): the calm path reads it at the first answer of a calm
// stretch and then once per calmBatch answers, to see pauses.
const calmBatch = 128

// countCalm counts an answer while calm: one atomic add, and at the first
// and every calmBatch-th answer a reading of the clock.
func (c *Controller) countCalm() {
	if n := c.ok.Add(1); n&(calmBatch-1) <= 1 { // one test, to stay inlined
		c.stampCalm(n)
	}
}

func (c *Controller) stampCalm(n int64) {
	switch {
	case n == 1:
		c.calm.firstAt.Store(c.s.Now().UnixNano())
	case n&(calmBatch-1) == 0:
		c.calm.batchAt.Store(c.s.Now().UnixNano())
		c.calm.batchN.Store(n)
	}
}

// closeCalmLocked closes the calm stretch of the n intervals that have
// ended by now, with ok answers: whatever passed since the last failure is
// the throughput the server sustains (per interval), and its refusals are
// its share of independent failures.
func (c *Controller) closeCalmLocked(ok float64, n time.Duration, now time.Time) {
	fail := float64(c.cur.fail)
	if ok > 0 {
		c.answeredEver = true
	}
	if fail == 0 || fail < c.s.FailureRatio*(ok+fail) || c.indepLocked(fail, ok+fail) {
		c.baseAddLocked(fail, ok+fail, float64(n))
		if r := c.calmRateLocked(ok, n, now); r > 0 {
			// In attempts: the server also took those its
			// independent failures refused.
			c.known = r / (1 - c.baseLocked())
		}
	}
	c.cur = interval{} // while calm only the refusals were counted
	sent := c.calm.sent.Load()
	c.calm.sent.Add(-sent) // keeps the attempts sent meanwhile
	c.carried = max(0, float64(sent)-ok-fail-float64(c.calm.lost.Swap(0)))
	c.calmFromLocked(now)
}

// calmFromLocked starts a calm stretch at now.
func (c *Controller) calmFromLocked(now time.Time) {
	c.start = now
	c.calm.firstAt.Store(0)
	c.calm.batchAt.Store(0)
	c.calm.batchN.Store(0)
}

// calmRateLocked is the throughput per interval that a calm stretch of n
// intervals, which ends now with ok answers, shows the server sustains; 0
// when it shows nothing, and what was known stays. Idle time says nothing
// of the server and is left out: a client idle for ten minutes before a
// burst, or after one, would otherwise learn a rate far below what the
// server took, restart at it after an overload, and starve its callers.
// The stretch counts from its first answer; its end, from the last batch
// of answers plus the time the answers after it took at the rate of those
// before, when a pause of Calm intervals or more follows. A stretch with
// less than one answer per interval, pauses left out, shows nothing.
func (c *Controller) calmRateLocked(ok float64, n time.Duration, now time.Time) float64 {
	span := float64(n * c.s.Interval)
	if first := c.calm.firstAt.Load(); first != 0 {
		span = float64(now.UnixNano() - first)
		if at, k := c.calm.batchAt.Load(), c.calm.batchN.Load(); at > first && k > 1 {
			perAnswer := float64(at-first) / float64(k-1)
			trail := float64(now.UnixNano()-at) - (ok-float64(k))*perAnswer
			if trail >= float64(time.Duration(c.s.Calm)*c.s.Interval) {
				span -= trail
			}
		}
	}
	if r := ok / max(1, span/float64(c.s.Interval)); r >= 1 {
		return r
	}
	return 0
}

// triggerCountLocked is what a calm controller's refusals in the current
// interval are judged against: its answers so far (refusals included), or,
// if more, the attempts sent in it and those of the last interval still in
// flight when it began. Refusals often come back faster than answers (a
// server sheds at once, and serves the rest), so that the first answers to
// a wave of attempts are mostly refusals even when most attempts succeed:
// judged against the answers alone, a server that fails 30 % of a wave at
// once would look overloaded.
func (c *Controller) triggerCountLocked() float64 {
	return max(float64(c.cur.fail)+float64(c.ok.Load()), c.carried+float64(c.calm.sent.Load()))
}
