package policy

import (
	"math"
	"slices"
	"time"

	"github.com/herdguard/herdguard/internal/errs"

	"google.golang.org/grpc/codes"

	"github.com/herdguard/herdguard"
)

// Defaults of a [Hedging] that is on.
const (
	DefaultHedgeAttempts = 2
	DefaultHedgeDelay    = 10 * time.Millisecond
	// HedgeSamples is how many of a method's recent attempt latencies a
	// latency-aware delay needs before it follows them; until then it is
	// Delay.
	HedgeSamples = 32
)

// Hedging says how a call is hedged (gRFC A6's hedgingPolicy): the first
// attempt goes at once, and while no attempt has answered, another copy
// goes after each hedging delay, up to MaxAttempts in all; the first
// answer wins and the others are cancelled. A call is retried or hedged,
// never both. The zero value is off: no hedging.
type Hedging struct {
	// MaxAttempts is the number of attempts in all, the first included.
	// 0 turns hedging off; otherwise it must be at least 2.
	MaxAttempts int
	// Delay is the wait before each next hedge: gRFC A6's hedgingDelay. With
	// a Quantile it is the floor: the wait is the quantile of the method's
	// recent attempt latencies, never less than Delay, and Delay itself until
	// HedgeSamples latencies are known. 0 means DefaultHedgeDelay (10ms).
	Delay time.Duration
	// Quantile, if above 0, makes the delay latency-aware: the Quantile of
	// the method's recent attempt latencies (0.95 hedges the slowest 5 %, as
	// "The Tail at Scale" advises). It must be below 1. 0 means a fixed
	// Delay, as in gRFC A6.
	Quantile float64
	// NonFatalCodes are the codes after which the next hedge goes at once;
	// any other failure is fatal: it ends the call and cancels the other
	// attempts. Empty means none, as in gRFC A6.
	NonFatalCodes []codes.Code
}

// On reports whether h hedges.
func (h Hedging) On() bool { return h.MaxAttempts != 0 }

// WithDefaults returns h with its zero fields replaced by their defaults,
// if h is on. The NonFatalCodes slice is copied.
func (h Hedging) WithDefaults() Hedging {
	if !h.On() {
		return h
	}
	if h.Delay == 0 {
		h.Delay = DefaultHedgeDelay
	}
	h.NonFatalCodes = slices.Clone(h.NonFatalCodes)
	return h
}

// Validate reports the first unusable field, naming it and its value.
func (h Hedging) Validate() error {
	switch {
	case h.MaxAttempts < 0 || h.MaxAttempts == 1:
		return fieldError("Hedging.MaxAttempts", h.MaxAttempts, "must be 0 (off) or at least 2")
	case h.Delay < 0:
		return fieldError("Hedging.Delay", h.Delay, "must not be negative")
	case math.IsNaN(h.Quantile) || h.Quantile < 0 || h.Quantile >= 1:
		return fieldError("Hedging.Quantile", h.Quantile, "must be 0 (a fixed delay) or in (0, 1)")
	}
	for i, c := range h.NonFatalCodes {
		switch {
		case c == codes.OK || c == codes.Canceled:
			return errs.Errorf("policy: Hedging.NonFatalCodes[%d] = %v: %v is not a failure to hedge past", i, c, c)
		case !herdguard.IsKnownCode(c):
			return errs.Errorf("policy: Hedging.NonFatalCodes[%d] = %d: not a gRPC status code", i, uint32(c))
		}
	}
	return nil
}

// NonFatal reports whether code is among h's non-fatal codes.
func (h Hedging) NonFatal(code codes.Code) bool { return slices.Contains(h.NonFatalCodes, code) }

// HedgeDelay returns the wait before the next hedge, given the quantile of
// the method's recent attempt latencies (known is false while fewer than
// HedgeSamples exist). It is a pure function; zero fields count as their
// defaults.
func (h Hedging) HedgeDelay(quantile time.Duration, known bool) time.Duration {
	d := h.Delay
	if d == 0 {
		d = DefaultHedgeDelay
	}
	if h.Quantile > 0 && known {
		d = max(d, quantile)
	}
	return d
}

// Defaults of the budget that hedges pass (see [Budget.WithHedgeDefaults]).
// A hedge is load the server did not ask for, so its budget is earned by
// answers: at most a tenth of the calls that succeeded, plus one a second.
const (
	DefaultHedgeBudgetRatio        = 0.1
	DefaultHedgeBudgetMinPerSecond = 1.0
)

// WithHedgeDefaults returns b as a budget for hedges: a hedge is allowed
// while the hedges of the last Window are fewer than Ratio × the calls that
// succeeded in it plus MinPerSecond × Window. Zero fields become
// DefaultHedgeBudgetRatio, DefaultHedgeBudgetMinPerSecond and
// DefaultBudgetWindow.
func (b Budget) WithHedgeDefaults() Budget {
	if b.Ratio == 0 {
		b.Ratio = DefaultHedgeBudgetRatio
	}
	if b.MinPerSecond == 0 {
		b.MinPerSecond = DefaultHedgeBudgetMinPerSecond
	}
	return b.WithDefaults()
}
