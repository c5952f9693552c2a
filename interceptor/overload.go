package interceptor

import (
	"context"
	"errors"
	"time"

	"github.com/herdguard/herdguard/internal/clock"
	"github.com/herdguard/herdguard/internal/pacing"

	"github.com/herdguard/herdguard/internal/names"
	"github.com/herdguard/herdguard/telemetry"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// controllerFor returns the overload controller of a target, or nil when
// overload control is off.
func (ic *Interceptor) controllerFor(target string) *pacing.Controller {
	// Most interceptors serve one target: the last one found is checked
	// first, which is cheaper than the map's hashing.
	if last := ic.lastController.Load(); last != nil && last.target == target {
		return last.ctl
	}
	if ic.overload == nil {
		return nil
	}
	return ic.findController(target)
}

// findController is controllerFor past the last target found, with
// overload control on.
func (ic *Interceptor) findController(target string) *pacing.Controller {
	tc := ic.controllers.Get(target, func() *targetController {
		c, _ := pacing.New(*ic.overload, ic.pacingEnv) // validated in New
		return &targetController{target, c}
	})
	ic.lastController.Store(tc) // no allocation: an interceptor that alternates targets pays the map only
	return tc.ctl
}

// eachController calls fn with every target's overload controller.
func (ic *Interceptor) eachController(fn func(target string, c *pacing.Controller)) {
	ic.controllers.Range(func(target string, tc *targetController) { fn(target, tc.ctl) })
}

// targetController is a target's overload controller.
type targetController struct {
	target string
	ctl    *pacing.Controller
}

// ticket is an attempt's place with its target's overload controller: the
// interceptor reaches the controller only through paces, take, finish and
// Overloaded. Every attempt (a unary call's, a stream's, a hedge) takes a
// ticket before it goes and is finished once when it ends.
type ticket struct {
	ctl *pacing.Controller // nil: no overload control
	// sent is when the attempt went, and held how long it waited in the
	// controller's line first, while the controller paced (zero: sent
	// while calm, not timed).
	sent time.Time
	held time.Duration
	// live: the call's context was alive when it went. One whose context
	// was over before it went out was never sent, and says nothing of the
	// server's load.
	live bool
	// untimed: its length is not an answer's time (a stream's).
	untimed bool
}

// paces reports whether ctl (nil: none) paces its target's attempts.
func paces(ctl *pacing.Controller) bool { return ctl != nil && ctl.Pacing() }

// take asks the target's controller (nil: none) to send attempt n from
// place (see pacing.Place; a retry at the back of the line replaces its
// backoff, see inLine), and sets *t, the attempt's ticket. An attempt held
// back is traced as a span of its own, like a backoff wait, and the wait
// is measured. A retry at the back of the line has that span however
// short its wait: it is the wait it had in place of its backoff, so that
// in a trace every retry follows a wait. The error is nil when the
// attempt may go, [pacing.ErrShed] when it was shed, or the status error
// that matches the context's when ctx ended while it waited.
func (ic *Interceptor) take(ctx context.Context, tracer trace.Tracer, ctl *pacing.Controller, method, target string, n int, place pacing.Place, t *ticket) error {
	// While pacing, the controller learns how long answers take, and how
	// long an attempt that timed out waited in its line; while calm, the
	// clock is not read.
	if ctl == nil {
		t.live = ctx.Err() == nil // t.ctl, sent and held stay zero
		return nil
	}
	t.ctl, t.untimed = ctl, false
	timed := place != pacing.Aside && paces(ctl)
	var asked time.Time
	if timed {
		asked = ic.clock.Now()
	} else {
		t.sent, t.held, t.live = time.Time{}, 0, ctx.Err() == nil
		if !t.live {
			return nil // never sent: not counted
		}
	}
	held, err := ctl.Acquire(ctx, place)
	if !timed && held <= 0 && err == nil { // calm
		return nil
	}
	if timed {
		t.sent, t.live = ic.clock.Now(), ctx.Err() == nil
		t.held = t.sent.Sub(asked)
	}
	if err != nil {
		t.live = false // it never goes
	}
	if held <= 0 && err == nil && place != pacing.Back {
		return nil
	}
	return ic.held(ctx, tracer, method, target, n, t, held, err)
}

// held records that attempt n, with ticket t, was held back for held by
// its controller, which then told it err (nil: go), and returns the error
// take returns.
func (ic *Interceptor) held(ctx context.Context, tracer trace.Tracer, method, target string, n int, t *ticket, held time.Duration, err error) error {
	if tracer != nil {
		end := t.sent
		if end.IsZero() { // it began to pace as the attempt asked
			end = ic.clock.Now()
		}
		_, span := tracer.Start(ctx, telemetry.SpanHeld, trace.WithTimestamp(end.Add(-held)), trace.WithAttributes(
			telemetry.AttrAttempt.Int(n), names.AttrHeldMS.Float64(float64(held)/float64(time.Millisecond)), telemetry.AttrShed.Bool(errors.Is(err, pacing.ErrShed))))
		span.End(trace.WithTimestamp(end))
	}
	if held > 0 || err != nil {
		shed := errors.Is(err, pacing.ErrShed)
		ic.metering.held(ctx, method, target, held.Seconds(), shed)
		if ic.events.on {
			ic.events.held(ctx, HeldEvent{Method: method, Target: target, Attempt: n, Held: held, Shed: shed})
		}
	}
	if err != nil && !errors.Is(err, pacing.ErrShed) {
		return status.FromContextError(err).Err()
	}
	return err
}

// finish ends attempt e, which went with ticket t, for the call whose
// context is ctx: it tells the controller what the end says of the
// server's load, ends the attempt's span and records its metrics. hedge
// and won say whether it was a hedge, and the one whose answer the call
// kept. Every attempt is finished here, once.
func (ic *Interceptor) finish(ctx context.Context, method, target string, t *ticket, e *attemptEnd, hedge, won bool) {
	switch {
	case t.ctl == nil || !t.live:
	case e.err == nil && len(e.trailer) == 0 && t.sent.IsZero():
		t.ctl.Done(pacing.Answered, 0) // an answer while calm: outcome's first case, without the call
	default:
		if o, took, ok := t.outcome(ctx, ic.clock, e); ok {
			t.ctl.Done(o, took)
		}
	}
	ic.attemptEnded(ctx, method, target, e.span, e.n, e.err, hedge, won)
}

// outcome is what attempt e, which went with ticket t, tells the
// controller of the server's load, and how long the server took to answer
// it (0: not known); ok is false when it tells nothing at all.
//
//   - An answer counts, and, while pacing, how long it took. One that a
//     layer below held back in its line, saying so (heldBelow), is an
//     answer whose wait was that layer's line.
//   - A stream the server answered, ended later by the caller's deadline,
//     is an answer: a watch stream lives until its deadline.
//   - An attempt a layer below gave up on, saying so (gaveUpBelow), says
//     nothing of the load.
//   - So does one the caller's deadline ended before anyone asked the
//     server for an answer (an idle stream, see idleAtDeadlineLocked).
//   - One the call's deadline ended in flight is late, unless it waited
//     in the line longer than it then had left (see timeoutOutcome).
//   - Any other end is what its code says (loadOutcome).
func (t *ticket) outcome(ctx context.Context, clk clock.Clock, e *attemptEnd) (o pacing.Outcome, took time.Duration, ok bool) {
	switch {
	case t.ctl == nil || !t.live:
		return pacing.Ignored, 0, false
	case e.err == nil && heldBelow(e.trailer):
		return pacing.HeldBelow, 0, true
	case e.err == nil:
		if !t.sent.IsZero() && !t.untimed {
			took = clk.Now().Sub(t.sent)
		}
		return pacing.Answered, took, true
	case e.answered && status.Code(e.err) == codes.DeadlineExceeded:
		return pacing.Answered, 0, true
	case e.gaveUpBelow || gaveUpBelow(e.trailer):
		return pacing.Below, 0, true
	case e.idle:
		return pacing.Ignored, 0, true
	}
	if o, ok := timeoutOutcome(ctx, e.err, e.timedOut, t.held, t.sent, clk); ok {
		return o, 0, true
	}
	return loadOutcome(e.err), 0, true
}

// inLine reports whether the retry that d decided, after an attempt that
// ended with err, waits in the controller's line instead of its backoff:
// the controller paces the target and the server refused the attempt for
// load, without a pushback (whose wait is the server's own word). The
// retry then waits behind every other attempt, so that under a lasting
// overload fresh calls go first, and a retry goes as soon as the server
// takes it, not a backoff later.
func inLine(ctl *pacing.Controller, d decision, err error) bool {
	if !paces(ctl) || d.pushback {
		return false
	}
	o := loadOutcome(err)
	return o == pacing.Overloaded || o == pacing.Late
}

// shedError is the error of a call whose attempt n was shed: the previous
// attempt's error (last), or, for a first attempt, an Unavailable status
// that says so. Either way it is a *RetryError with OutcomeShed.
func shedError(n int, last, shed error) error {
	if last == nil {
		last = status.Error(codes.Unavailable, shed.Error()) // it has herdguard's prefix
	}
	return &RetryError{Attempts: n - 1, Outcome: OutcomeShed, Err: last}
}

// timeoutOutcome reports (ok) whether an attempt of the call whose context
// is ctx, which waited held in the controller's line and was sent at sent
// (zero: sent while calm), ended with err because the call's deadline passed
// while it was in flight: not its own PerAttemptTimeout (perAttempt), nor
// an error that is not DeadlineExceeded. Such an attempt is Late (the
// server did not answer in time), unless it waited in the line longer than
// it then had left: the line, not the server, spent the call's time, and
// it says nothing (Ignored). Served by deadline, the line sends callers at
// the edge of their deadlines, and a server that misses an edge that near
// is not therefore slow.
//
// The deadline has passed when the context says so, or when clk reads
// within deadlineSlack of it: the server holds its own copy of the
// deadline, and under load its timer can fire, and its DeadlineExceeded
// arrive, before the context's own timer has run.
func timeoutOutcome(ctx context.Context, err error, perAttempt bool, held time.Duration, sent time.Time, clk clock.Clock) (pacing.Outcome, bool) {
	if sent.IsZero() || perAttempt || status.Code(err) != codes.DeadlineExceeded {
		return pacing.Ignored, false
	}
	dl, ok := ctx.Deadline()
	if !ok || ctx.Err() != context.DeadlineExceeded && dl.Sub(clk.Now()) > deadlineSlack {
		return pacing.Ignored, false
	}
	if held > dl.Sub(sent) {
		return pacing.Ignored, true
	}
	return pacing.Late, true
}

// deadlineSlack is how close to the caller's deadline a DeadlineExceeded
// must come to be the caller's deadline rather than the server's own
// time-out: the server's copy of the deadline is a transit later than the
// caller's, less the rounding of grpc-timeout (under a microsecond), so
// it fires first only when the caller's timer runs late.
const deadlineSlack = time.Millisecond

// loadOutcome is what an attempt's end says of the server's load: no
// error, or any code the server answered with, is an answer; Unavailable
// and ResourceExhausted are refusals for load (Overloaded), and
// DeadlineExceeded (the server did not answer in time) is Late, unless the
// client made them itself; a cancellation says nothing, and neither does
// a caller's quota running out (ResourceExhausted with a
// google.rpc.QuotaFailure). Both what the controller is told and whether a
// retry waits in its line (inLine) read it.
func loadOutcome(err error) pacing.Outcome {
	if err == nil {
		return pacing.Answered
	}
	switch c := status.Code(err); c {
	case codes.Unavailable, codes.ResourceExhausted, codes.DeadlineExceeded:
		switch {
		case clientSide(err):
			return pacing.Ignored
		case c == codes.DeadlineExceeded:
			return pacing.Late
		case c == codes.ResourceExhausted && detailsOf(err).quota:
			return pacing.Ignored // the caller's quota, not the server's load
		}
		return pacing.Overloaded
	case codes.Canceled:
		return pacing.Ignored
	}
	return pacing.Answered
}
