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
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/herdguard/herdguard/internal/clock"
	"github.com/herdguard/herdguard/internal/window"
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

// Ratio is a ratio retry budget over a sliding window.
type Ratio struct {
	ratio   float64
	reserve float64 // MinPerSecond × Window
	now     func() time.Time

	mu sync.Mutex  // guards w
	w  window.Pair // calls and retries
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
	return &Ratio{ratio: b.Ratio, reserve: b.MinPerSecond * b.Window.Seconds(), now: now, w: window.NewPair(b.Window, now())}, nil
}

// Call records a call started: its first attempt.
func (r *Ratio) Call() {
	r.mu.Lock()
	r.w.Add(r.now(), 1, 0)
	r.mu.Unlock()
}

// TryRetry reports whether a retry is allowed now and, if so, counts it.
func (r *Ratio) TryRetry() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	ok := r.roomLocked(now)
	if ok {
		r.w.Add(now, 0, 1)
	}
	return ok
}

// Allowed reports whether a retry would be allowed now, without counting
// one: for a caller that must also pass another budget before it retries.
func (r *Ratio) Allowed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.roomLocked(r.now())
}

// roomLocked reports whether the window has room for a retry at now.
func (r *Ratio) roomLocked(now time.Time) bool {
	calls, retries := r.w.Sums(now)
	return float64(retries) < r.ratio*float64(calls)+r.reserve
}

// Counts returns the calls and retries in the window now.
func (r *Ratio) Counts() (calls, retries int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.w.Sums(r.now())
}
