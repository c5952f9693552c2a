package policy

import (
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/herdguard/herdguard/internal/errs"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard"
)

// Defaults that a zero field of [Policy] stands for.
const (
	DefaultMaxAttempts    = 3
	DefaultInitialBackoff = 100 * time.Millisecond
	DefaultMaxBackoff     = 10 * time.Second
	DefaultMultiplier     = 2.0
)

// Policy says how one logical call is retried. It is a plain value: copy it
// freely. Every zero field means its default, so a literal that sets only
// some fields, such as Policy{MaxAttempts: 5}, keeps the rest of [Default],
// full jitter included.
type Policy struct {
	// MaxAttempts is the number of attempts in all, the first included:
	// 1 means no retry. 0 means DefaultMaxAttempts (3).
	MaxAttempts int
	// InitialBackoff is the raw wait before the second attempt.
	// 0 means DefaultInitialBackoff (100ms).
	InitialBackoff time.Duration
	// MaxBackoff caps every wait. 0 means DefaultMaxBackoff (10s), or
	// InitialBackoff if that is larger than 10s.
	MaxBackoff time.Duration
	// Multiplier grows the raw wait from one retry to the next; 1 keeps it
	// fixed. 0 means DefaultMultiplier (2).
	Multiplier float64
	// Jitter randomises each wait. The zero value is FullJitter, the
	// default; NoJitter waits exactly the raw backoff.
	Jitter Jitter
	// RetryableCodes are the status codes worth another attempt. Empty means
	// herdguard.DefaultRetryableCodes() (Unavailable, ResourceExhausted).
	// OK and Canceled are refused: neither is a failure to retry.
	RetryableCodes []codes.Code
	// RetryIf, if set, decides on a failed attempt's whole status, its
	// message and details included, before the codes do: ok true says
	// whether to try again (retry), ok false leaves it to RetryableCodes
	// (for a hedged call, to Hedging.NonFatalCodes). It is asked only where
	// the code would be: a caller's own end, response headers (a commit),
	// the client's own error and a pushback that says stop still decide
	// first, and the attempts, budgets and deadline still bound the call.
	// It runs on the caller's goroutine, or a hedge's, and must be safe for
	// concurrent use.
	RetryIf func(st *status.Status) (retry, ok bool)
	// PerAttemptTimeout bounds each attempt; an attempt that runs out fails
	// with DeadlineExceeded, which is retried while the caller's own deadline
	// allows, whether or not DeadlineExceeded is in RetryableCodes.
	// 0 means no per-attempt bound.
	PerAttemptTimeout time.Duration
	// Timeout bounds the whole call, every attempt and wait included, as a
	// service config's "timeout" does; the caller's own deadline still
	// applies when it is sooner. 0 means no bound beyond the caller's.
	Timeout time.Duration
	// Hedging, when on, makes the call hedged instead of retried (gRFC A6:
	// a method is one or the other); the fields above but Timeout must then
	// be left zero. The zero value is off.
	Hedging Hedging
}

// Default returns the default policy: 3 attempts, waits from 100ms doubling
// up to 10s with full jitter, retrying Unavailable and ResourceExhausted, no
// per-attempt timeout.
func Default() Policy {
	return Policy{
		MaxAttempts:    DefaultMaxAttempts,
		InitialBackoff: DefaultInitialBackoff,
		MaxBackoff:     DefaultMaxBackoff,
		Multiplier:     DefaultMultiplier,
		Jitter:         FullJitter,
		RetryableCodes: herdguard.DefaultRetryableCodes(),
	}
}

// WithDefaults returns p with every zero field replaced by its default
// (a zero Jitter is FullJitter already). The RetryableCodes slice is copied,
// so the result shares nothing with p.
func (p Policy) WithDefaults() Policy {
	p.Hedging = p.Hedging.WithDefaults()
	p = p.timing()
	if p.MaxAttempts == 0 {
		p.MaxAttempts = DefaultMaxAttempts
	}
	if len(p.RetryableCodes) == 0 {
		p.RetryableCodes = herdguard.DefaultRetryableCodes()
	} else {
		p.RetryableCodes = slices.Clone(p.RetryableCodes)
	}
	return p
}

// Validate reports the first unusable field, naming it and its value. Zero
// fields are valid: they mean defaults.
func (p Policy) Validate() error {
	switch {
	case p.MaxAttempts < 0:
		return fieldError("MaxAttempts", p.MaxAttempts, "must be 0 (default) or more")
	case p.InitialBackoff < 0:
		return fieldError("InitialBackoff", p.InitialBackoff, "must not be negative")
	case p.MaxBackoff < 0:
		return fieldError("MaxBackoff", p.MaxBackoff, "must not be negative")
	case p.MaxBackoff > 0 && p.MaxBackoff < p.timing().InitialBackoff:
		return fieldError("MaxBackoff", p.MaxBackoff, fmt.Sprintf("must not be below InitialBackoff (%v)", p.timing().InitialBackoff))
	case math.IsNaN(p.Multiplier) || math.IsInf(p.Multiplier, 0):
		return fieldError("Multiplier", p.Multiplier, "must be a finite number")
	case p.Multiplier != 0 && p.Multiplier < 1:
		return fieldError("Multiplier", p.Multiplier, "must be 0 (default) or at least 1")
	case !p.Jitter.valid():
		return fieldError("Jitter", int(p.Jitter), "is not a known Jitter")
	case p.PerAttemptTimeout < 0:
		return fieldError("PerAttemptTimeout", p.PerAttemptTimeout, "must not be negative")
	case p.Timeout < 0:
		return fieldError("Timeout", p.Timeout, "must not be negative")
	}
	if err := p.Hedging.Validate(); err != nil {
		return err
	}
	if p.Hedging.On() {
		for _, f := range []struct {
			name  string
			value any
			set   bool
		}{
			{"MaxAttempts", p.MaxAttempts, p.MaxAttempts != 0},
			{"InitialBackoff", p.InitialBackoff, p.InitialBackoff != 0},
			{"MaxBackoff", p.MaxBackoff, p.MaxBackoff != 0},
			{"Multiplier", p.Multiplier, p.Multiplier != 0},
			{"Jitter", p.Jitter, p.Jitter != 0},
			{"RetryableCodes", p.RetryableCodes, len(p.RetryableCodes) != 0},
			{"PerAttemptTimeout", p.PerAttemptTimeout, p.PerAttemptTimeout != 0},
		} {
			if f.set {
				return fieldError(f.name, f.value, "set beside Hedging: a call is retried or hedged, never both (gRFC A6); leave the retry fields zero")
			}
		}
	}
	for i, c := range p.RetryableCodes {
		switch {
		case c == codes.OK || c == codes.Canceled:
			return errs.Errorf("policy: RetryableCodes[%d] = %v: %v is not a failure to retry", i, c, c)
		case !herdguard.IsKnownCode(c):
			return errs.Errorf("policy: RetryableCodes[%d] = %d: not a gRPC status code", i, uint32(c))
		}
	}
	return nil
}

func fieldError(field string, value any, why string) error {
	return errs.Errorf("policy: %s = %v: %s", field, value, why)
}

// Retryable reports whether code is among the policy's retryable codes
// (the defaults when RetryableCodes is empty).
func (p Policy) Retryable(code codes.Code) bool {
	if len(p.RetryableCodes) == 0 {
		return slices.Contains(herdguard.DefaultRetryableCodes(), code)
	}
	return slices.Contains(p.RetryableCodes, code)
}

// RawBackoff returns the wait before attempt retry+1 without jitter:
// min(MaxBackoff, InitialBackoff × Multiplier^(retry-1)), for retry ≥ 1.
// Zero fields count as their defaults. It never overflows.
func (p Policy) RawBackoff(retry int) time.Duration {
	p = p.timing()
	if retry < 1 {
		retry = 1
	}
	f := float64(p.InitialBackoff) * math.Pow(p.Multiplier, float64(retry-1))
	if f >= float64(p.MaxBackoff) || math.IsInf(f, 0) || math.IsNaN(f) {
		return p.MaxBackoff
	}
	return time.Duration(f)
}

// Backoff returns the wait before attempt retry+1 (retry ≥ 1 counts the
// retries so far, the one about to happen included), shaped by the policy's
// Jitter with the random number r in [0, 1). prev is the previous wait, used
// by DecorrelatedJitter; pass 0 before the first retry. It is a pure function.
func (p Policy) Backoff(retry int, prev time.Duration, r float64) time.Duration {
	p = p.timing()
	return p.Jitter.Apply(p.RawBackoff(retry), prev, p.InitialBackoff, p.MaxBackoff, r)
}

// timing fills the zero timing fields without touching RetryableCodes, so
// that the hot path never allocates.
func (p Policy) timing() Policy {
	if p.InitialBackoff == 0 {
		p.InitialBackoff = DefaultInitialBackoff
	}
	if p.MaxBackoff == 0 {
		p.MaxBackoff = max(DefaultMaxBackoff, p.InitialBackoff)
	}
	if p.Multiplier == 0 {
		p.Multiplier = DefaultMultiplier
	}
	return p
}
