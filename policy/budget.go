package policy

import (
	"math"
	"time"

	"github.com/herdguard/herdguard/internal/errs"
)

// Throttling is gRPC's retryThrottling (gRFC A6): a token bucket per
// target. It starts full at MaxTokens; each attempt that fails with a
// retryable code takes one token, each successful call adds TokenRatio, and
// retries are allowed only while more than MaxTokens/2 tokens are left.
type Throttling struct {
	MaxTokens  float64 // in (0, 1000], as gRPC requires
	TokenRatio float64 // above 0, used as it is, as grpc-go uses it
}

// Validate reports an unusable field, naming it and its value.
func (t Throttling) Validate() error {
	switch {
	case !(t.MaxTokens > 0 && t.MaxTokens <= 1000):
		return errs.Errorf("policy: Throttling.MaxTokens = %v: must be in (0, 1000]", t.MaxTokens)
	case !(t.TokenRatio > 0) || math.IsInf(t.TokenRatio, 0):
		return errs.Errorf("policy: Throttling.TokenRatio = %v: must be above 0 and finite", t.TokenRatio)
	}
	return nil
}

// Budget is a ratio retry budget, as Finagle, Linkerd and Envoy keep: a
// retry is allowed while the retries in the sliding Window are fewer than
// Ratio × the calls started in it plus MinPerSecond × Window. The second
// term is a reserve, so a quiet client can still retry. Zero fields mean
// their defaults.
type Budget struct {
	// Ratio is retries allowed per call started. 0 means 0.2.
	Ratio float64
	// MinPerSecond is retries always allowed per second. 0 means 10.
	MinPerSecond float64
	// Window is how far back the counts reach. 0 means 10s.
	Window time.Duration
}

// Defaults of a [Budget].
const (
	DefaultBudgetRatio        = 0.2
	DefaultBudgetMinPerSecond = 10.0
	DefaultBudgetWindow       = 10 * time.Second
)

// WithDefaults returns b with every zero field replaced by its default.
func (b Budget) WithDefaults() Budget {
	if b.Ratio == 0 {
		b.Ratio = DefaultBudgetRatio
	}
	if b.MinPerSecond == 0 {
		b.MinPerSecond = DefaultBudgetMinPerSecond
	}
	if b.Window == 0 {
		b.Window = DefaultBudgetWindow
	}
	return b
}

// Validate reports an unusable field, naming it and its value.
func (b Budget) Validate() error {
	switch {
	case !(b.Ratio >= 0) || math.IsInf(b.Ratio, 0):
		return errs.Errorf("policy: Budget.Ratio = %v: must be 0 (default) or more, and finite", b.Ratio)
	case !(b.MinPerSecond >= 0) || math.IsInf(b.MinPerSecond, 0):
		return errs.Errorf("policy: Budget.MinPerSecond = %v: must be 0 (default) or more, and finite", b.MinPerSecond)
	case b.Window < 0:
		return errs.Errorf("policy: Budget.Window = %v: must not be negative", b.Window)
	case b.Window > 0 && b.Window < 10*time.Millisecond:
		return errs.Errorf("policy: Budget.Window = %v: must be at least 10ms", b.Window)
	}
	return nil
}
