// Package latency keeps a method's recent attempt latencies and answers a
// quantile of them, for a hedging delay that follows what the server shows
// ("The Tail at Scale": hedge a request once it is slower than the 95th
// percentile). It knows durations and counts, no gRPC.
//
//	w := latency.New(0.95, 32)
//	w.Record(elapsed)             // every completed attempt
//	p95, known := w.Quantile()    // known once 32 latencies are in
//
// Memory is bounded: the last [Size] latencies, in a ring. Neither Record
// nor Quantile takes a lock: Record stores with atomics, and every
// [Refresh] latencies the goroutine whose Record crosses the mark
// recomputes the quantile from the ring (a selection over Size values, a
// few microseconds) while any other that would, skips. Quantile reads the
// last result with one atomic load.
package latency

import (
	"math"
	"sync/atomic"
	"time"
)

const (
	// Size is how many of the most recent latencies a Window keeps.
	Size = 256
	// Refresh is how many latencies pass between two computations of the
	// quantile.
	Refresh = 32
)

// Window is the recent latencies of one method. It is safe for concurrent
// use; the zero value is not usable, make one with [New].
type Window struct {
	q       float64
	min     uint64 // latencies needed before the quantile is known
	ring    [Size]atomic.Int64
	n       atomic.Uint64 // latencies recorded
	quant   atomic.Int64  // the last quantile computed, in ns; -1: none yet
	busy    atomic.Bool   // a goroutine is computing it
	scratch [Size]int64   // for the computing goroutine only
}

// New returns an empty window that answers the q quantile (0 < q < 1) once
// it holds samples latencies (at least 1, at most Size).
func New(q float64, samples int) *Window {
	w := &Window{q: q, min: uint64(max(1, min(samples, Size)))}
	w.quant.Store(-1)
	return w
}

// Record adds the latency of one completed attempt.
func (w *Window) Record(d time.Duration) {
	i := w.n.Add(1) - 1
	w.ring[i%Size].Store(int64(d))
	n := i + 1
	if n == w.min || n > w.min && n%Refresh == 0 {
		w.compute(n)
	}
}

// Quantile returns the quantile of the recent latencies as of the last
// computation, and whether enough latencies were known then.
func (w *Window) Quantile() (time.Duration, bool) {
	q := w.quant.Load()
	return time.Duration(q), q >= 0
}

// compute recomputes the quantile from the first min(n, Size) slots,
// unless another goroutine is at it.
func (w *Window) compute(n uint64) {
	if !w.busy.CompareAndSwap(false, true) {
		return
	}
	defer w.busy.Store(false)
	m := int(min(n, Size))
	s := w.scratch[:m]
	for i := range s {
		s[i] = w.ring[i].Load()
	}
	// The q quantile by the nearest-rank method: the k-th smallest, k =
	// ceil(q*m), counted from 1.
	k := int(math.Ceil(w.q*float64(m))) - 1
	w.quant.Store(selectKth(s, min(max(k, 0), m-1)))
}

// selectKth returns the k-th smallest value of s (from 0), reordering s.
func selectKth(s []int64, k int) int64 {
	lo, hi := 0, len(s)-1
	for lo < hi {
		// median of three as the pivot, moved to hi
		mid := lo + (hi-lo)/2
		if s[mid] < s[lo] {
			s[mid], s[lo] = s[lo], s[mid]
		}
		if s[hi] < s[lo] {
			s[hi], s[lo] = s[lo], s[hi]
		}
		if s[mid] < s[hi] {
			s[mid], s[hi] = s[hi], s[mid]
		}
		pivot := s[hi]
		i := lo
		for j := lo; j < hi; j++ {
			if s[j] < pivot {
				s[i], s[j] = s[j], s[i]
				i++
			}
		}
		s[i], s[hi] = s[hi], s[i]
		switch {
		case k < i:
			hi = i - 1
		case k > i:
			lo = i + 1
		default:
			return s[i]
		}
	}
	return s[lo]
}
