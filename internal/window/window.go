// Package window counts two kinds of events over a rolling window split
// into Buckets parts, as the retry budget (calls and retries) and the
// breaker's FailureRatio (successes and failures) judge them: an event
// leaves the window about a window's length after it came, a bucket at a
// time. A Pair reads no clock of its own (every method takes now) and is
// not safe for concurrent use: its owner locks it.
package window

import "time"

// Buckets is how many parts a window is counted in.
const Buckets = 10

// Pair counts events of two kinds, a and b, over a rolling window.
type Pair struct {
	width time.Duration // a bucket's
	start time.Time     // bucket 0 begins here
	epoch int64         // the number of the newest bucket since start
	a, b  [Buckets]int64
}

// NewPair returns an empty window of length w (at least Buckets
// nanoseconds) whose first bucket begins at start.
func NewPair(w time.Duration, start time.Time) Pair {
	return Pair{width: max(w/Buckets, 1), start: start}
}

// Add counts a events of the first kind and b of the second at now.
func (p *Pair) Add(now time.Time, a, b int64) {
	i := p.advance(now)
	p.a[i] += a
	p.b[i] += b
}

// Sums returns the events of each kind in the window that ends at now.
func (p *Pair) Sums(now time.Time) (a, b int64) {
	p.advance(now)
	for i := range Buckets {
		a, b = a+p.a[i], b+p.b[i]
	}
	return a, b
}

// advance moves the window to now, emptying the buckets that fell out of
// it, and returns the index of the newest.
func (p *Pair) advance(now time.Time) int {
	if e := int64(now.Sub(p.start) / p.width); e > p.epoch {
		for i := p.epoch + 1; i <= e && i <= p.epoch+Buckets; i++ {
			p.a[i%Buckets], p.b[i%Buckets] = 0, 0
		}
		p.epoch = e
	}
	return int(p.epoch % Buckets)
}
