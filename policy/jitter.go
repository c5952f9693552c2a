package policy

import (
	"fmt"
	"strings"
	"time"

	"github.com/herdguard/herdguard/internal/errs"
)

// Jitter says how a computed backoff is randomised. Jitter is what spreads
// callers that failed at the same moment; backoff alone only slows them.
//
// The zero value is [FullJitter], the default; waiting without jitter is
// asked for by name, with [NoJitter].
type Jitter int

const (
	// FullJitter waits uniformly in [0, raw], where raw is
	// min(MaxBackoff, InitialBackoff*Multiplier^(n-1)). It is the zero value.
	FullJitter Jitter = iota
	// NoJitter waits exactly raw.
	NoJitter
	// EqualJitter waits that/2 + uniformly in [0, that/2]: it keeps a floor.
	EqualJitter
	// DecorrelatedJitter waits min(MaxBackoff, uniformly in
	// [InitialBackoff, 3*previous wait]), starting from InitialBackoff.
	DecorrelatedJitter
)

// jitterNames is indexed by Jitter.
var jitterNames = [...]string{FullJitter: "full", NoJitter: "none", EqualJitter: "equal", DecorrelatedJitter: "decorrelated"}

// String returns "none", "full", "equal" or "decorrelated".
func (j Jitter) String() string {
	if j.valid() {
		return jitterNames[j]
	}
	return fmt.Sprintf("Jitter(%d)", int(j))
}

func (j Jitter) valid() bool { return j >= 0 && int(j) < len(jitterNames) }

// ParseJitter parses the names String returns, in any case.
func ParseJitter(s string) (Jitter, error) {
	for i, name := range jitterNames {
		if strings.EqualFold(s, name) {
			return Jitter(i), nil
		}
	}
	return 0, errs.Errorf("policy: unknown jitter %q (want one of none, full, equal, decorrelated)", s)
}

// Apply shapes a raw wait with the random number r in [0, 1). prev is the
// previous wait (DecorrelatedJitter only; 0 before the first retry), base the
// policy's InitialBackoff and ceiling its MaxBackoff. It is a pure function.
// An r outside [0, 1] is clamped.
func (j Jitter) Apply(raw, prev, base, ceiling time.Duration, r float64) time.Duration {
	switch {
	case r < 0 || r != r: // negative or NaN
		r = 0
	case r > 1:
		r = 1
	}
	switch j {
	case NoJitter:
		return raw
	case FullJitter:
		return scale(raw, r)
	case EqualJitter:
		half := raw / 2
		return raw - half + scale(half, r)
	case DecorrelatedJitter:
		if prev <= 0 {
			prev = base
		}
		hi := ceiling
		if prev < ceiling/3 {
			hi = 3 * prev
		}
		if hi < base {
			hi = base
		}
		d := base + scale(hi-base, r)
		return min(d, ceiling)
	}
	return raw
}

// scale returns d*r for r in [0, 1] without leaving [0, d].
func scale(d time.Duration, r float64) time.Duration {
	v := time.Duration(float64(d) * r)
	return min(max(v, 0), d)
}
