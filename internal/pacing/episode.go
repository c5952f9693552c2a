package pacing

import "time"

// interval holds the counts of the current interval that closeLocked
// reads and resets.
type interval struct {
	fail     int           // overload failures
	lateFail int           // of which time-outs (Late)
	arrived  int           // attempts that asked, while pacing
	sent     int           // attempts let through, while pacing
	took     time.Duration // least time an answer took; 0: none timed
	waited   bool          // an attempt waited in the line
}

// episode is the state of one episode of pacing, from beginLocked on.
type episode struct {
	began  time.Time // when this episode began
	before float64   // what was known when this episode began

	// The token bucket.
	rate     float64 // tokens per interval
	tokens   float64
	refilled time.Time

	ceiling  float64       // answers per interval the server took while refusing others; 0 unknown
	tookMost float64       // the most answers in one interval of this episode
	setbacks int           // collapses under a rate this controller chose
	setback  time.Time     // when the last one was seen
	growAt   time.Time     // no growth past what is known before this
	quiet    int           // calm intervals in a row
	lastIn   int           // attempts that asked in the last closed interval
	inSum    float64       // attempts that asked in the intervals since the rate last grew past what is known
	inN      int           // and how many intervals those were
	lastTook time.Duration // least time an answer took in the last closed interval with answers
	// refusedRun is the intervals in a row in which the server refused
	// and answered nothing.
	refusedRun int

	fresh     bool // the interval in which the episode began is not over
	loadShown bool // a confirmation in this episode showed the refusals are load
	down      bool // collapsed, and the server never answered this controller
	cut       bool // the last interval's refusals cut the rate
	// moreClean is true when the last interval of this episode that took
	// clearly more than any before it (see learnShareLocked) had
	// cleanAnswers answers or more and no refusal.
	moreClean bool

	// The refusals and attempts of the last interval that collapsed the
	// server, which a confirmation compares with (judgeLocked): those that
	// began the episode until an interval collapses it.
	trig    share
	confirm confirmation
}

// beginLocked starts pacing within the current interval: one probe's worth
// of tokens until the interval's counts say more. The interval's refusals
// so far stay counted in it.
func (c *Controller) beginLocked(now time.Time) {
	c.answeredEver = c.answeredEver || c.ok.Load() > 0
	c.ep = episode{
		began:    now,
		before:   c.known,
		rate:     firstProbes,
		tokens:   1,
		refilled: now,
		fresh:    true,
		trig:     share{fail: float64(c.cur.fail), all: c.triggerCountLocked()},
	}
	c.cur = interval{fail: c.cur.fail, lateFail: c.cur.lateFail}
	c.pacing.Store(true)
	c.stats.episodes.Add(1)
	// Collapsed from the start: probes (probeRateLocked), the first at
	// once, and an answer starts a confirmation (answeredCollapsedLocked).
	c.collapsed.Store(true)
}

// endLocked stops pacing and lets every waiter go.
func (c *Controller) endLocked() {
	c.pacing.Store(false)
	c.collapsed.Store(false)
	c.ep.confirm, c.ep.down = confirmation{}, false
	// The calm counts start afresh: attempts sent while pacing were
	// counted by Acquire, and answered within the episode.
	c.calm.sent.Store(0)
	c.calm.lost.Store(0)
	c.carried = 0
	for _, w := range c.line {
		w.done = true
		w.ready <- nil
	}
	clear(c.line)
	c.line = c.line[:0]
}
