package pacing

import "time"

// The few tests that still set or read the controller's state under its
// lock do it here, and only here. Each helper names what the public
// surface does not show: the setters put an interval or a bucket in a
// state that real arrivals would make only with many goroutines and
// exact timing; the readers return what the controller has learnt (the
// share of independent failures, what the server is known to take, the
// hold before growth), which no exported method reports.

// setCounts sets the current interval's arrivals and attempts let through,
// as if that many had called Acquire.
func setCounts(c *Controller, arrived, sent int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.advanceLocked(c.s.Now()) // into the interval of now
	c.cur.arrived, c.cur.sent = arrived, sent
}

// markWaited makes the current interval one in which attempts waited.
func markWaited(c *Controller) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.cur.waited = true
}

// setBucket sets the rate, the tokens left now and the arrivals of the
// last interval.
func setBucket(c *Controller, rate, tokens float64, lastIn int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.advanceLocked(c.s.Now())
	c.ep.rate, c.ep.tokens, c.ep.lastIn = rate, tokens, lastIn
}

// setLastIn sets the arrivals of the last interval, which a waiter's wait
// in a line served newest first is told against.
func setLastIn(c *Controller, lastIn int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.ep.lastIn = lastIn
}

// setTokens sets the tokens left in the bucket now.
func setTokens(c *Controller, tokens float64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.ep.tokens = tokens
}

// setKnown sets what the server is known to take, as a setback would.
func setKnown(c *Controller, known float64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.known = known
}

// indepShare is the share of independent failures the controller has
// learnt (it closes no interval).
func indepShare(c *Controller) float64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.baseLocked()
}

// knownOf is what the server is known to take, and the rate the
// controller may return to without holding (+Inf: nothing known).
func knownOf(c *Controller) (known, free float64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.known, c.freeLocked()
}

// holdLeft is how long from now the rate holds before it grows past what
// is known.
func holdLeft(c *Controller, now time.Time) time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ep.growAt.Sub(now)
}
