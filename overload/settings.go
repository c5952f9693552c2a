package overload

import (
	"math"
	"time"

	"github.com/herdguard/herdguard/internal/errs"
)

// Defaults that a zero field of [Settings] stands for.
const (
	DefaultInterval     = 100 * time.Millisecond
	DefaultMinFailures  = 5
	DefaultFailureRatio = 0.5
	DefaultHold         = 500 * time.Millisecond
	DefaultCalm         = 10
	DefaultHeadroom     = 0.9
	DefaultDownAfter    = 2 * time.Second
	DefaultMaxWait      = 10 * time.Second
)

// Settings configure the overload controller that the interceptor runs per
// target (interceptor.WithOverloadControl). The zero value means every
// default. docs/overload.md states the controller's rules these settings
// enter.
type Settings struct {
	// Interval is the period the controller counts outcomes over and
	// adjusts its rate at; its evidence covers at most 10 of them. 0 means
	// DefaultInterval (100ms).
	Interval time.Duration
	// MinFailures and FailureRatio say when a calm target is overloaded:
	// the fewest recent Intervals that hold MinFailures refusals for load
	// (at most 10 Intervals back) show more than FailureRatio of their
	// attempts refused, and more than the share the server fails on its
	// own explains by chance. A client that sends much judges its last
	// Interval; one that sends little, its last second. While pacing,
	// every MinFailures refusals are judged again. 0 means
	// DefaultMinFailures (5) and DefaultFailureRatio (0.5).
	MinFailures  int
	FailureRatio float64
	// Hold is how long the rate stays where a restart put it before it
	// grows, and how long it stays at each step of that growth. It
	// doubles after each setback (a rate the controller chose was refused)
	// in an episode. 0 means DefaultHold (500ms).
	Hold time.Duration
	// Calm is how many Intervals in a row with no overload failure and no
	// attempt kept waiting end the pacing. 0 means DefaultCalm (10).
	Calm int
	// Headroom is the share of a measured rate the controller sends at,
	// leaving room for the counts to be off. 0 means DefaultHeadroom (0.9).
	Headroom float64
	// DownAfter is how long a server may refuse every attempt while the
	// controller holds attempts back before it is down: holding back has
	// not helped, so new attempts fail at once (ErrDown, with the call's
	// last status), but for a probe now and then, until the server
	// answers; attempts already waiting keep their place. A server that
	// only times out is slow, not down. Shorter fails callers sooner; a
	// server that collapsed and recovers once left alone refuses
	// everything for a while too, and its callers would fail instead of
	// being held for the recovery. 0 means DefaultDownAfter (2s).
	DownAfter time.Duration
	// MaxWait is the longest an attempt without a deadline waits in the
	// controller's line; one with a deadline never waits past it. 0 means
	// DefaultMaxWait (10s).
	MaxWait time.Duration
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
	if s.DownAfter == 0 {
		s.DownAfter = DefaultDownAfter
	}
	if s.MaxWait == 0 {
		s.MaxWait = DefaultMaxWait
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
	case s.DownAfter < 0:
		return errs.Errorf("overload: DownAfter = %v: must not be negative", s.DownAfter)
	case s.MaxWait < 0:
		return errs.Errorf("overload: MaxWait = %v: must not be negative", s.MaxWait)
	}
	return nil
}
