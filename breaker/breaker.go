package breaker

import (
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/herdguard/herdguard/internal/errs"
	"github.com/herdguard/herdguard/internal/window"

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
var ErrOpen = errs.New("circuit breaker is open")

// OpenError is the error of a call that a breaker refused without sending
// anything. It wraps [ErrOpen], and status.Code reports codes.Unavailable.
type OpenError struct {
	// Scope names the breaker: the target, or the target and the method.
	Scope string
	// State is Open, or HalfOpen when its probes were all taken.
	State State
	// Shared is true when the fleet's shared breaker refused the call (see
	// [Fleet]), false when this replica's own breaker did.
	Shared bool
	// RetryAfter is how long the breaker stays open from the refusal: after
	// it, the next call may go as a probe. 0 when the breaker is half-open
	// (its probes decide when it closes) or its open period is just over.
	RetryAfter time.Duration
}

// Error names the scope, the state, how long an open breaker stays open,
// and whether the breaker is the fleet's.
func (e *OpenError) Error() string {
	whose := ""
	if e.Shared {
		whose = "the fleet's "
	}
	switch {
	case e.State == HalfOpen:
		return fmt.Sprintf("herdguard: %scircuit breaker for %s is half-open and its probes are in flight; call not sent", whose, e.Scope)
	case e.RetryAfter > 0:
		return fmt.Sprintf("herdguard: %scircuit breaker for %s is open for %v more; call not sent", whose, e.Scope, e.RetryAfter.Round(time.Millisecond))
	}
	return fmt.Sprintf("herdguard: %scircuit breaker for %s is open; call not sent", whose, e.Scope)
}

// openRefusal returns the refusal, at now, of an open breaker whose open
// period ends at until (Unix nanoseconds; 0: not known).
func openRefusal(scope string, until, now int64, shared bool) *OpenError {
	e := &OpenError{Scope: scope, State: Open, Shared: shared}
	if until != 0 {
		e.RetryAfter = max(time.Duration(until-now), 0)
	}
	return e
}

// Unwrap returns [ErrOpen].
func (e *OpenError) Unwrap() error { return ErrOpen }

// GRPCStatus reports codes.Unavailable with the error's message.
func (e *OpenError) GRPCStatus() *status.Status { return status.New(codes.Unavailable, e.Error()) }

// Breaker is one circuit breaker: the breaker of one scope.
//
// gobreaker keeps the state machine (closed, open, half-open and its
// probes) and the counts since the last transition, through its two-step
// breaker, so that a unary call ([Breaker.Execute]) and a stream, whose
// verdict comes later ([Breaker.Allow]), share one breaker. A healthy
// breaker adds almost nothing to a call: with FailureRatio off, the only
// count that can trip a closed breaker is its run of consecutive failures,
// and a success only resets that run to zero. So while the breaker is closed
// and the run is known to be zero, a call runs without taking gobreaker's
// lock, and only a failure is handed to gobreaker, or a success when some
// failure began while the call ran (it may end that run). [Breaker.Counts]
// then leaves out the other successes and ignored calls (in Requests,
// TotalSuccesses, ConsecutiveSuccesses); the failures, and every
// transition, are gobreaker's: a result counts in the generation the call
// was admitted in, or not at all.
type Breaker struct {
	scope string
	cb    *gobreaker.TwoStepCircuitBreaker[struct{}]
	// state mirrors the gobreaker state as of its last transition. gobreaker
	// moves from open to half-open lazily, inside the next request.
	state atomic.Int32
	// gen counts transitions, as gobreaker's generation does (a closed
	// breaker over a rolling Window never starts a new one otherwise): the
	// result of a call admitted in an older generation counts for nothing.
	gen atomic.Uint64

	// fast is true when FailureRatio is off, so that successes need not be
	// counted while the run of failures is zero.
	fast bool
	// failuresBegun counts failures about to be handed to gobreaker, and
	// failuresDone those it has taken. quietAt is failuresBegun as of the
	// last time gobreaker's run of consecutive failures was seen to be zero
	// with no failure in flight: while failuresBegun still equals it, the run
	// is still zero.
	failuresBegun, failuresDone, quietAt atomic.Uint64

	// openFor is the current open period in nanoseconds, from OpenTimeout,
	// doubled by each failed probe up to maxOpen; openUntil is when the
	// last open period ends (Unix nanoseconds on now), 0 once closed.
	openFor, openUntil atomic.Int64
	baseOpen, maxOpen  time.Duration
	now                func() time.Time // Settings.Now

	// view and member link the breaker to its fleet's shared breaker, when
	// Settings.Fleet is set (see [Fleet]); nil otherwise.
	view   *FleetView
	member FleetMember
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
	b := &Breaker{scope: scope, fast: s.FailureRatio == 0, baseOpen: s.OpenTimeout, maxOpen: s.MaxOpenTimeout, now: s.Now}
	b.openFor.Store(int64(s.OpenTimeout))
	b.cb = gobreaker.NewTwoStepCircuitBreaker[struct{}](gobreakerSettings(scope, s, func(to State) {
		b.grow(State(b.state.Load()), to)
		b.state.Store(int32(to))
		b.gen.Add(1)
	}))
	if s.Fleet != nil {
		b.view = &FleetView{now: s.Now}
		b.member = s.Fleet.Join(scope, s, b.view)
	}
	return b
}

// gobreakerSettings translates validated settings with defaults filled into
// gobreaker's. mirror is told every new state before OnStateChange is.
//
// Every duration is judged here, on Settings.Now, never by gobreaker,
// which reads the wall clock: gobreaker keeps no window (its counts run
// from one transition to the next), and its open period is a nanosecond,
// so that the breaker's own (admit, until openUntil) is the one that
// holds.
func gobreakerSettings(scope string, s Settings, mirror func(State)) gobreaker.Settings {
	consecutive, ratio, minRequests, downAfter := s.ConsecutiveFailures, s.FailureRatio, s.MinRequests, s.DownAfter
	onChange, now := s.OnStateChange, s.Now
	// since counts the calls gobreaker counted since the last transition,
	// for OnStateChange to say what a transition was judged on: its
	// ConsecutiveFailures is the current run of failed calls, and runStart
	// is when that run began; calls counts the calls of the last Window
	// for FailureRatio. gobreaker calls IsSuccessful for every call it
	// counts, ReadyToTrip at every failure of a closed breaker and
	// OnStateChange at every transition, each under its lock, which guards
	// them. Only a success or a transition ends a run: a run of failures
	// however far apart reaches its count.
	var (
		since    Counts
		runStart time.Time
		calls    = window.NewPair(s.Window, now()) // successes and failures, for FailureRatio
	)
	return gobreaker.Settings{
		Name:        scope,
		MaxRequests: s.HalfOpenMaxRequests,
		Timeout:     time.Nanosecond,
		ReadyToTrip: func(gobreaker.Counts) bool {
			run := since.ConsecutiveFailures
			if downAfter > 0 {
				now := now()
				if run <= 1 {
					runStart = now
				}
				if run >= consecutive && now.Sub(runStart) >= downAfter {
					return true
				}
			} else if run >= consecutive {
				return true
			}
			if ratio == 0 {
				return false
			}
			ok, failed := calls.Sums(now())
			return ok+failed >= int64(minRequests) && float64(failed) >= ratio*float64(ok+failed)
		},
		OnStateChange: func(_ string, from, to gobreaker.State) {
			judged := since
			since, calls = Counts{}, window.NewPair(s.Window, now()) // gobreaker starts its counts afresh
			mirror(fromGobreaker(to))
			if onChange != nil {
				onChange(scope, fromGobreaker(from), fromGobreaker(to), judged)
			}
		},
		IsSuccessful: func(err error) bool {
			since.Requests++
			if ratio > 0 {
				if err != nil {
					calls.Add(now(), 0, 1)
				} else {
					calls.Add(now(), 1, 0)
				}
			}
			if err != nil {
				since.TotalFailures++
				since.ConsecutiveFailures++
				since.ConsecutiveSuccesses = 0
				return false
			}
			since.TotalSuccesses++
			since.ConsecutiveSuccesses++
			since.ConsecutiveFailures = 0
			return true
		},
		IsExcluded: func(err error) bool { return err == errExcluded },
	}
}

// grow sets the open period on a transition: a probe that failed (half-open
// to open) doubles it, up to maxOpen; closing resets it. admit refuses calls
// until openUntil.
func (b *Breaker) grow(from, to State) {
	switch {
	case to == Closed:
		b.openFor.Store(int64(b.baseOpen))
		b.openUntil.Store(0)
	case to == Open && from == HalfOpen:
		b.openFor.Store(int64(min(2*time.Duration(b.openFor.Load()), b.maxOpen)))
	}
	if to == Open {
		b.openUntil.Store(b.now().Add(time.Duration(b.openFor.Load())).UnixNano())
	}
}

// heldOpen reports whether the open period still runs.
func (b *Breaker) heldOpen() bool {
	u := b.openUntil.Load()
	return u != 0 && b.now().UnixNano() < u
}

// Scope returns the breaker's scope name.
func (b *Breaker) Scope() string { return b.scope }

// State returns the breaker's state now, moving an open breaker whose
// open period has passed to half-open.
func (b *Breaker) State() State {
	if State(b.state.Load()) == Open && b.heldOpen() {
		return Open
	}
	return fromGobreaker(b.cb.State())
}

// LastState returns the state as of the breaker's last transition, without
// taking its lock. An open breaker whose OpenTimeout has passed reads as
// open until a call or State moves it to half-open.
func (b *Breaker) LastState() State { return State(b.state.Load()) }

// Counts are a breaker's counts of calls since its last transition, as
// gobreaker keeps them: ConsecutiveFailures is the run of failed calls a
// closed breaker trips on. They start again from zero at every transition
// (FailureRatio is judged over the last Window, apart). With FailureRatio off, a healthy
// closed breaker lets calls through without counting them (see [Breaker]),
// so Requests, TotalSuccesses and ConsecutiveSuccesses then leave those
// calls out.
type Counts struct {
	// Requests counts the calls let through, those still in flight and
	// those whose verdict was Ignored included.
	Requests uint32
	// TotalSuccesses and TotalFailures count the calls that ended with
	// each verdict.
	TotalSuccesses uint32
	TotalFailures  uint32
	// ConsecutiveSuccesses and ConsecutiveFailures are the current runs:
	// a success ends a run of failures, and a failure a run of successes.
	ConsecutiveSuccesses uint32
	ConsecutiveFailures  uint32
}

// countsOf converts gobreaker's counts.
func countsOf(c gobreaker.Counts) Counts {
	return Counts{
		Requests:             c.Requests,
		TotalSuccesses:       c.TotalSuccesses,
		TotalFailures:        c.TotalFailures,
		ConsecutiveSuccesses: c.ConsecutiveSuccesses,
		ConsecutiveFailures:  c.ConsecutiveFailures,
	}
}

// Counts returns the breaker's counts for its current state. With
// FailureRatio off they leave out the successes and ignored calls of a
// healthy closed breaker (see [Breaker]).
func (b *Breaker) Counts() Counts { return countsOf(b.cb.Counts()) }

// Calm reports whether the breaker is closed with no failed call on its run
// of consecutive failures: the server shows no sign of failing. Hedging
// asks it before each hedge, so that under overload, which shows as
// failures, hedging stops by itself. It may take gobreaker's lock.
func (b *Breaker) Calm() bool {
	if State(b.state.Load()) != Closed {
		return false
	}
	return b.quiet() || b.cb.Counts().ConsecutiveFailures == 0
}

// quiet reports whether the breaker is closed with no failure on its run,
// so that a call may skip gobreaker unless it fails.
func (b *Breaker) quiet() bool {
	return b.fast && State(b.state.Load()) == Closed && b.quietAt.Load() == b.failuresBegun.Load()
}

// admit asks gobreaker to let a call through. It returns gobreaker's done
// and whether the call is a probe, or the refusal as an [*OpenError].
func (b *Breaker) admit() (done func(error), probe bool, err error) {
	if State(b.state.Load()) == Open && b.heldOpen() {
		return nil, false, openRefusal(b.scope, b.openUntil.Load(), b.now().UnixNano(), false)
	}
	done, err = b.cb.Allow()
	switch {
	case errors.Is(err, gobreaker.ErrOpenState):
		return nil, false, openRefusal(b.scope, b.openUntil.Load(), b.now().UnixNano(), false)
	case errors.Is(err, gobreaker.ErrTooManyRequests):
		return nil, false, &OpenError{Scope: b.scope, State: HalfOpen}
	case err != nil:
		return nil, false, err
	}
	// gobreaker moved an open breaker to half-open, if it was due, inside
	// Allow, and told the mirror before returning.
	return done, State(b.state.Load()) != Closed, nil
}

// report hands gobreaker the verdict of a call it admitted.
func (b *Breaker) report(done func(error), v herdguard.Verdict) {
	switch v {
	case herdguard.Failure:
		b.failuresBegun.Add(1)
		done(errFailure)
		b.failuresDone.Add(1)
	case herdguard.Ignored:
		done(errExcluded)
	default:
		done(nil)
		b.noteSuccess()
	}
}

// quietCall is a call admitted on the fast path: what it saw when admitted.
type quietCall struct {
	gen, begun uint64
}

func (b *Breaker) admitQuiet() quietCall {
	return quietCall{gen: b.gen.Load(), begun: b.failuresBegun.Load()}
}

// quietVerdict gives gobreaker what it would have counted of a call that
// ran without it. A failure is always handed over. A success is handed over
// only when some failure began while the call ran: then gobreaker's run of
// consecutive failures may not be zero, and this success ends it, as it
// would in gobreaker; otherwise the run is zero and the success changes
// nothing. As gobreaker drops the results of calls admitted before its last
// transition, so does this.
func (b *Breaker) quietVerdict(c quietCall, v herdguard.Verdict) {
	switch {
	case v == herdguard.Failure:
		b.failuresBegun.Add(1)
		defer b.failuresDone.Add(1)
		b.late(c, errFailure)
	case v == herdguard.Success && b.failuresBegun.Load() != c.begun:
		if b.late(c, nil) {
			b.noteSuccess()
		}
	}
}

// late hands gobreaker the result of a call admitted in generation c.gen,
// if the breaker is still closed in that generation, and reports whether
// it did.
func (b *Breaker) late(c quietCall, err error) bool {
	if State(b.state.Load()) != Closed || b.gen.Load() != c.gen {
		return false
	}
	done, aerr := b.cb.Allow()
	if aerr != nil {
		return false
	}
	if State(b.state.Load()) != Closed || b.gen.Load() != c.gen {
		done(errExcluded)
		return false
	}
	done(err)
	return true
}

// noteSuccess is called after gobreaker counted a success. If no failure is
// in flight and gobreaker's run of failures is zero, later calls may take
// the fast path until the next failure begins.
func (b *Breaker) noteSuccess() {
	if !b.fast {
		return
	}
	// A failure begun after this load makes the mark stale. One begun
	// before it has, if failuresDone caught up, been counted before Counts
	// reads the run; if failuresDone did not catch up, no mark is made.
	begun := b.failuresBegun.Load()
	if b.failuresDone.Load() == begun && b.cb.Counts().ConsecutiveFailures == 0 {
		b.quietAt.Store(begun)
	}
}

// executeQuiet runs fn without gobreaker and hands it only a failure. A
// call that panics is a failure, as in gobreaker; the panic goes on.
func (b *Breaker) executeQuiet(fn func(probe bool) herdguard.Verdict) (after State, v herdguard.Verdict) {
	c := b.admitQuiet()
	returned := false
	defer func() {
		if !returned {
			b.quietVerdict(c, herdguard.Failure)
		}
	}()
	v = fn(false)
	returned = true
	b.quietVerdict(c, v)
	return State(b.state.Load()), v
}

// Execute runs fn if the breaker lets the call through, and records the
// verdict fn returns. probe is true when the call goes through a half-open
// breaker; the caller should then make a single attempt. A call that panics
// counts as a failure, as in gobreaker, and the panic goes on.
//
// It returns the breaker's state as seen just before and just after the call
// (they differ when the call, or a concurrent one, moved the breaker) and,
// when the breaker refused the call without running fn, an [*OpenError].
func (b *Breaker) Execute(fn func(probe bool) herdguard.Verdict) (before, after State, err error) {
	if b.view != nil {
		return b.executeShared(fn)
	}
	before, after, _, err = b.executeLocal(fn)
	return before, after, err
}

// executeLocal is Execute by this replica's own breaker. It also returns
// the verdict of fn, when fn ran.
func (b *Breaker) executeLocal(fn func(probe bool) herdguard.Verdict) (before, after State, v herdguard.Verdict, err error) {
	before = State(b.state.Load())
	if b.quiet() {
		after, v = b.executeQuiet(fn)
		return before, after, v, nil
	}
	done, probe, err := b.admit()
	if err != nil {
		return before, State(b.state.Load()), herdguard.Ignored, err
	}
	returned := false
	defer func() {
		if !returned {
			b.report(done, herdguard.Failure)
		}
	}()
	v = fn(probe)
	returned = true
	b.report(done, v)
	return before, State(b.state.Load()), v, nil
}

// Allow asks to start a call whose verdict is known only later, such as a
// stream's. If the breaker lets it through, done must be called with the
// call's verdict once the verdict is known; the breaker has counted it when
// done returns, and later calls of done do nothing. Until then the call
// holds its place: a half-open breaker counts it among its probes. probe is
// true when the call goes through a half-open breaker. A refused call gets
// an [*OpenError].
//
// A quiet breaker (closed, no failure on its run; see [Breaker]) lets the
// call through at once and hears only a failure.
func (b *Breaker) Allow() (done func(herdguard.Verdict), probe bool, err error) {
	if b.view != nil {
		return b.allowShared()
	}
	return b.allowLocal()
}

// allowLocal is Allow by this replica's own breaker.
func (b *Breaker) allowLocal() (done func(herdguard.Verdict), probe bool, err error) {
	var called atomic.Bool
	if b.quiet() {
		c := b.admitQuiet()
		return func(v herdguard.Verdict) {
			if !called.Swap(true) {
				b.quietVerdict(c, v)
			}
		}, false, nil
	}
	gdone, probe, err := b.admit()
	if err != nil {
		return nil, false, err
	}
	return func(v herdguard.Verdict) {
		if !called.Swap(true) {
			b.report(gdone, v)
		}
	}, probe, nil
}
