// Package budget caps retries across all the calls of an interceptor, so
// that retries cannot multiply an outage: a per-call attempt cap does not,
// since every call still makes all its attempts while a backend is down.
//
// [Throttle] is gRPC's retry throttling (gRFC A6), a token bucket; [Ratio]
// is a ratio budget with a reserve, as Finagle, Linkerd and Envoy keep. Both
// are safe for concurrent use and allocate nothing per call. Their
// configurations are [policy.Throttling] and [policy.Budget].
package budget

import (
	"github.com/herdguard/herdguard/internal/clock"

	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/herdguard/herdguard/policy"
)

// Throttle is gRPC's retry throttling: a token bucket counted in float64,
// with grpc-go's own arithmetic (gRPC's C core counts thousandths of a
// token instead; grpc-go, which herdguard runs beside, does not round).
type Throttle struct {
	max, ratio, threshold float64
	tokens                atomic.Uint64 // math.Float64bits of the tokens left
}

// NewThrottle returns a full bucket for t.
func NewThrottle(t policy.Throttling) (*Throttle, error) {
	if err := t.Validate(); err != nil {
		return nil, err
	}
	th := &Throttle{max: t.MaxTokens, ratio: t.TokenRatio, threshold: t.MaxTokens / 2}
	th.tokens.Store(math.Float64bits(th.max))
	return th, nil
}

// Failure records an attempt that failed with a retryable code, taking one
// token, and reports whether a retry is still allowed: more than half the
// tokens are left.
func (t *Throttle) Failure() (retryAllowed bool) {
	for {
		cur := t.tokens.Load()
		next := max(math.Float64frombits(cur)-1, 0)
		if t.tokens.CompareAndSwap(cur, math.Float64bits(next)) {
			return next > t.threshold
		}
	}
}

// Success records a successful call, adding TokenRatio up to MaxTokens.
func (t *Throttle) Success() {
	for {
		cur := t.tokens.Load()
		next := min(math.Float64frombits(cur)+t.ratio, t.max)
		if next == math.Float64frombits(cur) || t.tokens.CompareAndSwap(cur, math.Float64bits(next)) {
			return
		}
	}
}

// Allowed reports whether retries and hedges are allowed now: more than
// half the tokens are left. It takes none.
func (t *Throttle) Allowed() bool { return t.Tokens() > t.threshold }

// Tokens returns the tokens left.
func (t *Throttle) Tokens() float64 { return math.Float64frombits(t.tokens.Load()) }

// buckets is how many parts the Ratio window is counted in.
const buckets = 10

// Ratio is a ratio retry budget over a sliding window.
type Ratio struct {
	ratio   float64
	reserve float64 // MinPerSecond × Window
	width   time.Duration
	now     func() time.Time
	start   time.Time

	mu      sync.Mutex // guards the counts
	epoch   int64      // index of the newest bucket since start
	calls   [buckets]int64
	retries [buckets]int64
}

// NewRatio returns an empty budget for b that reads the time from now (nil:
// the wall clock).
func NewRatio(b policy.Budget, now func() time.Time) (*Ratio, error) {
	if err := b.Validate(); err != nil {
		return nil, err
	}
	b = b.WithDefaults()
	if now == nil {
		now = clock.Real().Now
	}
	return &Ratio{
		ratio: b.Ratio, reserve: b.MinPerSecond * b.Window.Seconds(),
		width: b.Window / buckets, now: now, start: now(),
	}, nil
}

// advanceLocked moves the window to now, clearing the buckets that fell out.
func (r *Ratio) advanceLocked() int {
	e := int64(r.now().Sub(r.start) / r.width)
	if e > r.epoch {
		for i := r.epoch + 1; i <= e && i <= r.epoch+buckets; i++ {
			r.calls[i%buckets], r.retries[i%buckets] = 0, 0
		}
		r.epoch = e
	}
	return int(r.epoch % buckets)
}

// Call records a call started: its first attempt.
func (r *Ratio) Call() {
	r.mu.Lock()
	r.calls[r.advanceLocked()]++
	r.mu.Unlock()
}

// TryRetry reports whether a retry is allowed now and, if so, counts it.
func (r *Ratio) TryRetry() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	i, ok := r.roomLocked()
	if ok {
		r.retries[i]++
	}
	return ok
}

// Allowed reports whether a retry would be allowed now, without counting
// one: for a caller that must also pass another budget before it retries.
func (r *Ratio) Allowed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.roomLocked()
	return ok
}

// roomLocked moves the window to now and reports whether it has room for a
// retry, and the index of the newest bucket.
func (r *Ratio) roomLocked() (int, bool) {
	i := r.advanceLocked()
	var calls, retries int64
	for j := range buckets {
		calls += r.calls[j]
		retries += r.retries[j]
	}
	return i, float64(retries) < r.ratio*float64(calls)+r.reserve
}

// Counts returns the calls and retries in the window now.
func (r *Ratio) Counts() (calls, retries int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.advanceLocked()
	for j := range buckets {
		calls += r.calls[j]
		retries += r.retries[j]
	}
	return calls, retries
}
