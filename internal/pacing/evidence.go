package pacing

import (
	"time"
)

// counts are outcomes: attempts asked for (while calm, every one is
// sent), sent, answered, refused for load, and gone (ended saying nothing
// of the load: the caller gave up, or a layer below judged); below counts
// the attempts a layer below gave up on (gone) or held back (answered),
// saying so.
type counts struct {
	asked, sent, answered, refused, gone, below float64
}

func (c *counts) add(o counts) {
	c.asked += o.asked
	c.sent += o.sent
	c.answered += o.answered
	c.refused += o.refused
	c.gone += o.gone
	c.below += o.below
}

// outcomes is how many attempts the counts judge: those that ended with
// an answer or a refusal, or those sent if more (refusals often come back
// ahead of the answers to the same attempts, which a server serves after
// it refuses the rest; an attempt its caller gave up on was being served).
func (c counts) outcomes() float64 { return max(c.answered+c.refused, c.sent) }

// share is the refused share of the outcomes; 0 with none.
func (c counts) share() float64 {
	if n := c.outcomes(); n > 0 {
		return c.refused / n
	}
	return 0
}

// evidence is a target's outcomes of the last Window, in Intervals: a
// ring of buckets, the current one last.
type evidence struct {
	start  time.Time // when the current bucket began
	b      [buckets]counts
	learnt [buckets]bool // the bucket's outcomes were learnt from (rule 3)
	i      int           // the current bucket
}

// step ends the current bucket's Interval: the oldest bucket is dropped
// and a new one begins.
func (e *evidence) step(iv time.Duration) {
	e.i = (e.i + 1) % buckets
	e.b[e.i], e.learnt[e.i] = counts{}, false
	e.start = e.start.Add(iv)
}

// restart empties the ring, its current bucket the Interval now falls in:
// a whole Window passed with nothing counted.
func (e *evidence) restart(now time.Time, iv time.Duration) {
	e.b, e.learnt = [buckets]counts{}, [buckets]bool{}
	e.start = e.start.Add(now.Sub(e.start) / iv * iv)
}

func (e *evidence) cur() *counts { return &e.b[e.i] }

// learn marks the bucket k Intervals back as learnt from, and reports
// whether it was not yet.
func (e *evidence) learn(k int) bool {
	j := (e.i - k + buckets) % buckets
	was := e.learnt[j]
	e.learnt[j] = true
	return !was
}

// last returns the bucket k Intervals back (0: the current one).
func (e *evidence) last(k int) counts { return e.b[(e.i-k+buckets)%buckets] }

// holding returns the counts of the fewest buckets, from the one from
// Intervals back (0: the current one) back in time, that hold at least
// refused refusals, and false when the Window holds fewer, with how many
// buckets they are: the evidence of a client that sends much is its last
// Interval, and of one that sends little its last second.
func (e *evidence) holding(refused float64, from int) (c counts, k int, ok bool) {
	for k = range buckets - from {
		c.add(e.last(from + k))
		if c.refused >= refused {
			return c, k + 1, true
		}
	}
	return c, buckets - from, false
}

// total returns the counts of the whole Window.
func (e *evidence) total() counts {
	var c counts
	for k := range buckets {
		c.add(e.b[k])
	}
	return c
}

// spread adds c, counted over the time from since to now, to the buckets
// that time covers, evenly: the calm path counts without the clock, and
// its counts are folded in now and then.
func (e *evidence) spread(c counts, since, now time.Time, iv time.Duration) {
	span := now.Sub(since)
	if span <= 0 || !since.Before(e.start) {
		e.cur().add(c)
		return
	}
	for k := range buckets {
		from := e.start.Add(-time.Duration(k) * iv)
		to := from.Add(iv)
		if k == 0 {
			to = now
		}
		lo := max(from.UnixNano(), since.UnixNano())
		if over := to.UnixNano() - lo; over > 0 {
			f := float64(over) / float64(span)
			b := &e.b[(e.i-k+buckets)%buckets]
			b.asked += c.asked * f
			b.sent += c.sent * f
			b.answered += c.answered * f
			b.refused += c.refused * f
			b.gone += c.gone * f
			b.below += c.below * f
		}
		if !from.After(since) {
			return
		}
	}
}
