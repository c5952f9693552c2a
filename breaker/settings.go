package breaker

import (
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/herdguard/herdguard/internal/clock"
	"github.com/herdguard/herdguard/internal/errs"
	"github.com/herdguard/herdguard/internal/window"

	"github.com/herdguard/herdguard"
)

// Defaults that a zero field of [Settings] stands for.
const (
	DefaultConsecutiveFailures = 5
	DefaultDownAfter           = time.Second
	DefaultMinRequests         = 10
	DefaultWindow              = 10 * time.Second
	DefaultOpenTimeout         = 500 * time.Millisecond
	DefaultMaxOpenTimeout      = 10 * time.Second
	DefaultHalfOpenMaxRequests = 1
)

// Scope says which calls share one breaker.
type Scope int

const (
	// PerTarget shares one breaker among all calls to a target
	// (grpc.ClientConn.Target()).
	PerTarget Scope = iota
	// PerMethod gives every method of a target its own breaker.
	PerMethod
)

// String returns "target" or "method".
func (s Scope) String() string {
	switch s {
	case PerTarget:
		return "target"
	case PerMethod:
		return "method"
	}
	return fmt.Sprintf("Scope(%d)", int(s))
}

// ParseScope parses "target" or "method".
func ParseScope(s string) (Scope, error) {
	switch strings.ToLower(s) {
	case "target":
		return PerTarget, nil
	case "method":
		return PerMethod, nil
	}
	return 0, errs.Errorf("breaker: unknown scope %q (want target or method)", s)
}

// Settings configures the breakers of a [Group]. A zero field means its
// default, as each field says.
type Settings struct {
	// ConsecutiveFailures trips the breaker after this many failed calls in
	// a row, however quickly or slowly they came (Window does not shorten
	// a run). 0 means the default rule: a run of
	// DefaultConsecutiveFailures (5) failed calls trips it once it has
	// lasted DownAfter (1 s) without a success, so that a server that fails
	// some calls on its own, however many, never trips it: only one from
	// which nothing succeeds (or, with FailureRatio, too large a share).
	ConsecutiveFailures uint32
	// DownAfter is how long a run of failed calls must have lasted, from
	// its first failure, before it trips the breaker: evidence that nothing
	// succeeds, rather than chance. At 600 calls a second, 5 failed calls
	// in a row come every few hundred calls from a server that fails two
	// attempts in three on its own; 1 s of them never does. 0 means
	// DefaultDownAfter (1s) when ConsecutiveFailures is 0 too, and no
	// condition when ConsecutiveFailures is set: an explicit count keeps
	// its meaning.
	DownAfter time.Duration
	// FailureRatio, if above 0, also trips the breaker when failed calls /
	// finished calls within Window reaches it, once at least MinRequests
	// calls finished there. It must be in [0, 1]. 0 turns the ratio off.
	FailureRatio float64
	// MinRequests is how many finished calls the ratio needs before it can
	// trip. 0 means DefaultMinRequests (10).
	MinRequests uint32
	// Window is the rolling period the counts for FailureRatio cover, in 10
	// buckets. 0 means DefaultWindow (10s).
	Window time.Duration
	// OpenTimeout is how long the breaker stays open, the first time, before
	// letting probes through. Each failed probe doubles the next open
	// period, up to MaxOpenTimeout, and closing resets it, as Envoy's
	// outlier ejection grows its ejection time: a blip costs little, a
	// server that stays down is asked less and less often. 0 means
	// DefaultOpenTimeout (500ms) and DefaultMaxOpenTimeout (10s); set both
	// to the same value for a fixed period.
	OpenTimeout    time.Duration
	MaxOpenTimeout time.Duration
	// HalfOpenMaxRequests is how many probes a half-open breaker lets
	// through; that many successes close it. 0 means 1.
	HalfOpenMaxRequests uint32
	// Scope says which calls share a breaker. The zero value is PerTarget.
	Scope Scope
	// Verdict, if set, says what a finished call's error tells the breaker:
	// Success (the server answered; the fault is the caller's), Failure (the
	// server is failing or unreachable) or Ignored (nothing either way). nil
	// means [herdguard.BreakerVerdict] of the error's status code, the table
	// in package herdguard. Use it to keep codes that are not the server's
	// fault out of the count, such as one tenant's ResourceExhausted quota:
	//
	//	Verdict: func(err error) herdguard.Verdict {
	//		if status.Code(err) == codes.ResourceExhausted {
	//			return herdguard.Ignored
	//		}
	//		return herdguard.BreakerVerdict(status.Code(err))
	//	},
	//
	// The interceptor calls it with the final error of every failed call,
	// except calls that say nothing of the server by themselves: those the
	// caller cancelled, those whose deadline ran out while no attempt was in
	// flight (during a backoff wait, or before the first attempt), and those
	// that ended with the client's own error (a message over the send limit,
	// one that could not be encoded, a send a later interceptor refused),
	// those a server stopped with a "do not retry" that says a layer below
	// gave up (mesh.GaveUpTrailerKey), and those that failed while the
	// target's overload controller paced it (the controller judges an
	// overloaded or refusing server, and fails calls at once once it is
	// down). It must be quick and safe for concurrent use.
	Verdict func(err error) herdguard.Verdict
	// Fleet, if set, shares each breaker with the other replicas of the
	// service that name the same scope (see [Fleet]); nil keeps every
	// breaker to this process.
	Fleet Fleet
	// OnStateChange, if set, is called on every transition with the scope
	// name (the target, or the target followed by the full method) and the
	// counts the transition was judged on: the calls counted since the
	// previous transition, whose ConsecutiveFailures is the run that
	// tripped a closed breaker (a healthy closed breaker's successes are
	// left out, see [Counts]). It runs while the breaker is locked: it must
	// return quickly and must not call the breaker.
	OnStateChange func(scope string, from, to State, counts Counts)
	// Now is the breaker's time: when a run of failures began, which part
	// of Window a call counts in, when an open period ends. nil means the
	// wall clock. A test sets it to a fake clock's, to move the breaker's
	// time without waiting.
	Now func() time.Time
}

// Validate reports the first unusable field, naming it and its value.
func (s Settings) Validate() error {
	switch {
	case math.IsNaN(s.FailureRatio) || s.FailureRatio < 0 || s.FailureRatio > 1:
		return errs.Errorf("breaker: FailureRatio = %v: must be in [0, 1]", s.FailureRatio)
	case s.DownAfter < 0:
		return errs.Errorf("breaker: DownAfter = %v: must not be negative", s.DownAfter)
	case s.Window < 0:
		return errs.Errorf("breaker: Window = %v: must not be negative", s.Window)
	case s.Window > 0 && s.Window < window.Buckets:
		return errs.Errorf("breaker: Window = %v: must be at least %dns to split into buckets", s.Window, window.Buckets)
	case s.OpenTimeout < 0:
		return errs.Errorf("breaker: OpenTimeout = %v: must not be negative", s.OpenTimeout)
	case s.MaxOpenTimeout < 0:
		return errs.Errorf("breaker: MaxOpenTimeout = %v: must not be negative", s.MaxOpenTimeout)
	case s.MaxOpenTimeout > 0 && s.MaxOpenTimeout < s.OpenTimeout:
		return errs.Errorf("breaker: MaxOpenTimeout = %v: must not be below OpenTimeout (%v)", s.MaxOpenTimeout, s.OpenTimeout)
	case s.Scope != PerTarget && s.Scope != PerMethod:
		return errs.Errorf("breaker: Scope = %d: must be PerTarget or PerMethod", int(s.Scope))
	}
	return nil
}

// WithDefaults returns s with every zero field replaced by its default.
// A zero ConsecutiveFailures becomes DefaultConsecutiveFailures with a
// DownAfter of DefaultDownAfter (unless DownAfter is set), which is the
// default rule; a ConsecutiveFailures that is set leaves DownAfter as it
// is. Either way the result means what s meant.
func (s Settings) WithDefaults() Settings {
	if s.ConsecutiveFailures == 0 {
		s.ConsecutiveFailures = DefaultConsecutiveFailures
		if s.DownAfter == 0 {
			s.DownAfter = DefaultDownAfter
		}
	}
	if s.MinRequests == 0 {
		s.MinRequests = DefaultMinRequests
	}
	if s.Window == 0 {
		s.Window = DefaultWindow
	}
	if s.OpenTimeout == 0 {
		s.OpenTimeout = DefaultOpenTimeout
	}
	if s.MaxOpenTimeout == 0 {
		s.MaxOpenTimeout = max(DefaultMaxOpenTimeout, s.OpenTimeout)
	}
	if s.HalfOpenMaxRequests == 0 {
		s.HalfOpenMaxRequests = DefaultHalfOpenMaxRequests
	}
	if s.Now == nil {
		s.Now = clock.Real().Now
	}
	return s
}
