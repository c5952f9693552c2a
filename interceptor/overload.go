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
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// controllerFor returns the overload controller of a target, or nil when
// overload control is off.
func (ic *Interceptor) controllerFor(target string) *pacing.Controller {
	// Most interceptors serve one target: the last one found is checked
	// first, inlined, which is cheaper than the map's hashing.
	if last := ic.lastController.Load(); last != nil && last.target == target {
		return last.ctl
	}
	return ic.findController(target)
}

// findController is controllerFor past the last target found.
func (ic *Interceptor) findController(target string) *pacing.Controller {
	if ic.overload == nil {
		return nil
	}
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

// admit asks the target's controller (nil: none) to send attempt n; back
// puts a retry at the back of its line (see inLine). An attempt held back
// is traced as a span of its own, like a backoff wait, and the wait is
// measured. A retry at the back of the line has that span however short
// its wait: it is the wait it had in place of its backoff, so that in a
// trace every retry follows a wait. It returns nil when the attempt may
// go, [pacing.ErrShed] when it was shed, or the status error that matches
// the context's when ctx ended while it waited.
func (ic *Interceptor) admit(ctx context.Context, tracer trace.Tracer, ctl *pacing.Controller, method string, n int, back bool) error {
	if ctl == nil || !ctl.Pacing() {
		return nil
	}
	held, err := ctl.Acquire(ctx, back)
	if held <= 0 && err == nil && !back {
		return nil
	}
	if tracer != nil {
		end := ic.clock.Now()
		_, span := tracer.Start(ctx, telemetry.SpanHeld, trace.WithTimestamp(end.Add(-held)), trace.WithAttributes(
			telemetry.AttrAttempt.Int(n), names.AttrHeldMS.Float64(float64(held)/float64(time.Millisecond)), telemetry.AttrShed.Bool(errors.Is(err, pacing.ErrShed))))
		span.End(trace.WithTimestamp(end))
	}
	if held > 0 || err != nil {
		ic.metering.held(ctx, method, held.Seconds(), errors.Is(err, pacing.ErrShed))
	}
	if err != nil && !errors.Is(err, pacing.ErrShed) {
		return status.FromContextError(err).Err()
	}
	return err
}

// inLine reports whether the retry that d decided, after an attempt that
// ended with err, waits in the controller's line instead of its backoff:
// the controller paces the target and the server refused the attempt for
// load, without a pushback (whose wait is the server's own word). The
// retry then waits behind every other attempt, so that under a lasting
// overload fresh calls go first, and a retry goes as soon as the server
// takes it, not a backoff later.
func inLine(ctl *pacing.Controller, d decision, err error) bool {
	if ctl == nil || !ctl.Pacing() || d.pushback {
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

// attemptDoneAfter is attemptDone for an attempt sent at sent (zero: sent
// while the controller was calm, and not timed) to a target with a
// controller, whose trailer was trailer: an answer tells the controller
// how long it took, but one that a layer below held back, saying so
// (heldBelow), is an answer whose wait was that layer's line.
func attemptDoneAfter(ctl *pacing.Controller, err error, trailer metadata.MD, clk clock.Clock, sent time.Time) {
	switch {
	case err != nil:
		attemptDone(ctl, err)
	case heldBelow(trailer):
		ctl.Done(pacing.HeldBelow, 0)
	case sent.IsZero():
		ctl.Done(pacing.Answered, 0)
	default:
		ctl.Done(pacing.Answered, clk.Now().Sub(sent))
	}
}

// attemptDoneIn is attemptDoneAfter for an attempt of the call whose
// context is ctx, that asked the controller at asked and was sent at sent
// (both zero: sent while calm). An attempt that a layer below gave up
// on, and said so (judgedBelow), says nothing; so does one that ended
// because the call's deadline passed while it was in flight after it
// waited in the line longer than it then had left (see timedOutIn).
func attemptDoneIn(ctx context.Context, ctl *pacing.Controller, end *attemptEnd, clk clock.Clock, asked, sent time.Time) {
	switch {
	case end.err == nil:
	case judgedBelow(end.trailer):
		ctl.Done(pacing.Below, 0)
		return
	case timedOutIn(ctx, ctl, end.err, end.timedOut, asked, sent, clk):
		return
	}
	attemptDoneAfter(ctl, end.err, end.trailer, clk, sent)
}

// timedOutIn tells the controller what timeoutOutcome makes of an
// attempt's end, and reports whether it was a time-out at the call's
// deadline.
func timedOutIn(ctx context.Context, ctl *pacing.Controller, err error, perAttempt bool, asked, sent time.Time, clk clock.Clock) bool {
	o, ok := timeoutOutcome(ctx, err, perAttempt, asked, sent, clk)
	if ok {
		ctl.Done(o, 0)
	}
	return ok
}

// timeoutOutcome reports (ok) whether an attempt of the call whose context
// is ctx, which asked the controller at asked and was sent at sent (zero:
// sent while calm), ended with err because the call's deadline passed
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
func timeoutOutcome(ctx context.Context, err error, perAttempt bool, asked, sent time.Time, clk clock.Clock) (pacing.Outcome, bool) {
	if sent.IsZero() || perAttempt || status.Code(err) != codes.DeadlineExceeded {
		return pacing.Ignored, false
	}
	dl, ok := ctx.Deadline()
	if !ok || ctx.Err() != context.DeadlineExceeded && dl.Sub(clk.Now()) > deadlineSlack {
		return pacing.Ignored, false
	}
	if sent.Sub(asked) > dl.Sub(sent) {
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

// attemptDone tells the controller (nil: none) how an attempt ended.
func attemptDone(ctl *pacing.Controller, err error) {
	if ctl != nil {
		ctl.Done(loadOutcome(err), 0)
	}
}

// loadOutcome is what an attempt's end says of the server's load: no
// error, or any code the server answered with, is an answer; Unavailable
// and ResourceExhausted are refusals for load (Overloaded), and
// DeadlineExceeded (the server did not answer in time) is Late, unless the
// client made them itself; a cancellation says nothing.
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
		}
		return pacing.Overloaded
	case codes.Canceled:
		return pacing.Ignored
	}
	return pacing.Answered
}
