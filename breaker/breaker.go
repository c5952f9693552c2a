package breaker

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/sony/gobreaker/v2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard"
)

// State is a breaker's state.
type State int32

const (
	// Closed lets calls through and counts their results.
	Closed State = iota
	// HalfOpen lets a few probe calls through.
	HalfOpen
	// Open refuses every call.
	Open
)

// String returns "closed", "half-open" or "open".
func (s State) String() string {
	switch s {
	case Closed:
		return "closed"
	case HalfOpen:
		return "half-open"
	case Open:
		return "open"
	}
	return fmt.Sprintf("State(%d)", int(s))
}

func fromGobreaker(s gobreaker.State) State {
	switch s {
	case gobreaker.StateHalfOpen:
		return HalfOpen
	case gobreaker.StateOpen:
		return Open
	}
	return Closed
}

// ErrOpen is wrapped by every error of a call the breaker refused.
var ErrOpen = errors.New("circuit breaker is open")

// OpenError is the error of a call that a breaker refused without sending
// anything. It wraps [ErrOpen], and status.Code reports codes.Unavailable.
type OpenError struct {
	// Scope names the breaker: the target, or the target and the method.
	Scope string
	// State is Open, or HalfOpen when its probes were all taken.
	State State
}

// Error names the scope and the state.
func (e *OpenError) Error() string {
	if e.State == HalfOpen {
		return fmt.Sprintf("herdguard: circuit breaker for %s is half-open and its probes are in flight; call not sent", e.Scope)
	}
	return fmt.Sprintf("herdguard: circuit breaker for %s is open; call not sent", e.Scope)
}

// Unwrap returns [ErrOpen].
func (e *OpenError) Unwrap() error { return ErrOpen }

// GRPCStatus reports codes.Unavailable with the error's message.
func (e *OpenError) GRPCStatus() *status.Status { return status.New(codes.Unavailable, e.Error()) }

// Breaker is one circuit breaker: the breaker of one scope.
type Breaker struct {
	scope string
	cb    *gobreaker.CircuitBreaker[struct{}]
	// state mirrors the gobreaker state as of its last transition. gobreaker
	// moves from open to half-open lazily, inside the next request.
	state atomic.Int32
}

// errFailure and errExcluded carry a verdict through gobreaker without
// allocating; the caller's own error never passes through it.
var (
	errFailure  = errors.New("failure")
	errExcluded = errors.New("excluded")
)

// New returns a breaker for the named scope. It validates s.
func New(scope string, s Settings) (*Breaker, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	return newBreaker(scope, s.WithDefaults()), nil
}

// newBreaker builds a breaker from validated settings with defaults filled.
func newBreaker(scope string, s Settings) *Breaker {
	b := &Breaker{scope: scope}
	consecutive, ratio, minRequests := s.ConsecutiveFailures, s.FailureRatio, s.MinRequests
	onChange := s.OnStateChange
	b.cb = gobreaker.NewCircuitBreaker[struct{}](gobreaker.Settings{
		Name:         scope,
		MaxRequests:  s.HalfOpenMaxRequests,
		Interval:     s.Window,
		BucketPeriod: s.Window / windowBuckets,
		Timeout:      s.OpenTimeout,
		ReadyToTrip: func(c gobreaker.Counts) bool {
			if c.ConsecutiveFailures >= consecutive {
				return true
			}
			finished := c.TotalSuccesses + c.TotalFailures
			return ratio > 0 && finished >= minRequests &&
				float64(c.TotalFailures) >= ratio*float64(finished)
		},
		OnStateChange: func(_ string, from, to gobreaker.State) {
			b.state.Store(int32(fromGobreaker(to)))
			if onChange != nil {
				onChange(scope, fromGobreaker(from), fromGobreaker(to))
			}
		},
		IsSuccessful: func(err error) bool { return err == nil },
		IsExcluded:   func(err error) bool { return err == errExcluded },
	})
	return b
}

// Scope returns the breaker's scope name.
func (b *Breaker) Scope() string { return b.scope }

// State returns the breaker's state now, moving an open breaker whose
// OpenTimeout has passed to half-open.
func (b *Breaker) State() State { return fromGobreaker(b.cb.State()) }

// LastState returns the state as of the breaker's last transition, without
// taking its lock. An open breaker whose OpenTimeout has passed reads as
// open until a call or State moves it to half-open.
func (b *Breaker) LastState() State { return State(b.state.Load()) }

// Counts returns gobreaker's counts for the current state.
func (b *Breaker) Counts() gobreaker.Counts { return b.cb.Counts() }

// Execute runs fn if the breaker lets the call through, and records the
// verdict fn returns. probe is true when the call goes through a half-open
// breaker; the caller should then make a single attempt.
//
// It returns the breaker's state as seen just before and just after the call
// (they differ when the call, or a concurrent one, moved the breaker) and,
// when the breaker refused the call without running fn, an [*OpenError].
func (b *Breaker) Execute(fn func(probe bool) herdguard.Verdict) (before, after State, err error) {
	before = State(b.state.Load())
	_, err = b.cb.Execute(func() (struct{}, error) {
		switch fn(State(b.state.Load()) != Closed) {
		case herdguard.Failure:
			return struct{}{}, errFailure
		case herdguard.Ignored:
			return struct{}{}, errExcluded
		}
		return struct{}{}, nil
	})
	after = State(b.state.Load())
	switch {
	case errors.Is(err, gobreaker.ErrOpenState):
		return before, after, &OpenError{Scope: b.scope, State: Open}
	case errors.Is(err, gobreaker.ErrTooManyRequests):
		return before, after, &OpenError{Scope: b.scope, State: HalfOpen}
	}
	return before, after, nil
}

// Allow asks to start a call whose result is known only later, such as a
// stream's. If the breaker lets it through, done must be called once with
// the call's verdict, and returns once the breaker has counted it; a second
// call does nothing. If ctx ends first, the call counts as Ignored. probe is
// true when the call goes through a half-open breaker. A refused call gets
// an [*OpenError].
//
// gobreaker's two-step breaker keeps its own private state, so it cannot
// share a breaker with [Breaker.Execute], which unary calls use because it
// allocates nothing. Allow therefore holds one gobreaker request open in a
// goroutine that lives until done is called or ctx ends.
func (b *Breaker) Allow(ctx context.Context) (done func(herdguard.Verdict), probe bool, err error) {
	admitted := make(chan bool, 1)
	refused := make(chan error, 1)
	result := make(chan herdguard.Verdict, 1)
	counted := make(chan struct{})
	go func() {
		defer close(counted)
		_, _, err := b.Execute(func(p bool) herdguard.Verdict {
			admitted <- p
			select {
			case v := <-result:
				return v
			case <-ctx.Done():
				return herdguard.Ignored
			}
		})
		if err != nil {
			refused <- err
		}
	}()
	select {
	case probe = <-admitted:
	case err = <-refused:
		return nil, false, err
	}
	var once sync.Once
	return func(v herdguard.Verdict) {
		once.Do(func() {
			result <- v
			<-counted
		})
	}, probe, nil
}
