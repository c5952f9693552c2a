package overload

import (
	"math"
	"time"

	"github.com/herdguard/herdguard/internal/errs"
)

// Defaults that a zero field of [Settings] stands for.
const (
	DefaultInterval     = 100 * time.Millisecond
	DefaultMinFailures  = 20
	DefaultFailureRatio = 0.5
	DefaultHold         = 500 * time.Millisecond
	DefaultCalm         = 10
	DefaultHeadroom     = 0.9
)

// Settings configure the overload controller that the interceptor runs per
// target (interceptor.WithOverloadControl). The zero value means every
// default.
type Settings struct {
	// Interval is the period the controller counts outcomes over and
	// adjusts its rate at. 0 means DefaultInterval (100ms).
	Interval time.Duration
	// MinFailures and FailureRatio say when a calm target is overloaded:
	// at least MinFailures overload failures within one Interval, and
	// every attempt or more than FailureRatio of that Interval's
	// attempts (sent in it, or still in flight from the last, or answered
	// if more) that the server's own share of independent failures leaves,
	// by more than chance makes (two standard deviations). Independent
	// failures (a flaky network, dead replicas behind a proxy) are left to
	// retries, however many: above the ratio, a confirmation shows them
	// for what they are (see the package doc). 0 means DefaultMinFailures
	// (20) and DefaultFailureRatio (0.5).
	MinFailures  int
	FailureRatio float64
	// Hold is how long the rate stays where a recovery put it before it
	// grows past what the server is known to take, and how long it stays
	// at each step of that growth. 0 means DefaultHold (500ms).
	Hold time.Duration
	// Calm is how many Intervals in a row with no overload failure and no
	// attempt kept waiting end the pacing. 0 means DefaultCalm (10).
	Calm int
	// Headroom is the share of a measured capacity the rate returns to
	// after a collapse, leaving room for the counts to be off. 0 means
	// DefaultHeadroom (0.9).
	Headroom float64
}

// WithDefaults returns s with every zero field set to its default.
func (s Settings) WithDefaults() Settings {
	if s.Interval == 0 {
		s.Interval = DefaultInterval
	}
	if s.MinFailures == 0 {
		s.MinFailures = DefaultMinFailures
	}
	if s.FailureRatio == 0 {
		s.FailureRatio = DefaultFailureRatio
	}
	if s.Hold == 0 {
		s.Hold = DefaultHold
	}
	if s.Calm == 0 {
		s.Calm = DefaultCalm
	}
	if s.Headroom == 0 {
		s.Headroom = DefaultHeadroom
	}
	return s
}

// Validate reports the first unusable field, naming it and its value.
func (s Settings) Validate() error {
	switch {
	case s.Interval < 0:
		return errs.Errorf("overload: Interval = %v: must not be negative", s.Interval)
	case s.MinFailures < 0:
		return errs.Errorf("overload: MinFailures = %d: must not be negative", s.MinFailures)
	case math.IsNaN(s.FailureRatio) || s.FailureRatio < 0 || s.FailureRatio > 1:
		return errs.Errorf("overload: FailureRatio = %v: must be in [0, 1]", s.FailureRatio)
	case s.Hold < 0:
		return errs.Errorf("overload: Hold = %v: must not be negative", s.Hold)
	case s.Calm < 0:
		return errs.Errorf("overload: Calm = %d: must not be negative", s.Calm)
	case math.IsNaN(s.Headroom) || s.Headroom < 0 || s.Headroom > 1:
		return errs.Errorf("overload: Headroom = %v: must be in [0, 1]", s.Headroom)
	}
	return nil
}
