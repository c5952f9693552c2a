package interceptor

import (
	"context"
	"strconv"
	"strings"
	"time"

	"github.com/herdguard/herdguard/internal/clock"
	"github.com/herdguard/herdguard/internal/pacing"
	"github.com/herdguard/herdguard/internal/wire"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// backoffState is what one call's retry decisions remember and use.
type backoffState struct {
	prev    time.Duration // the last wait, for decorrelated jitter
	retries int           // retries since the start or the last pushback
	timer   *clock.Timer  // where the call keeps its timer: made on the first wait, then reset

	method, target string
	lim            *limits // the target's budgets; nil when none is on
	// unsafe is true when only attempts that never reached the server may
	// be repeated (WithIdempotentOnly, and the method is not idempotent).
	unsafe bool
	ctl    *pacing.Controller // the target's overload controller; nil when off
	// floor is the last google.rpc.RetryInfo's retry_delay: the waits
	// after it grow from it (0: none came).
	floor time.Duration
}

// attemptEnd is what a failed attempt tells the retry decision.
type attemptEnd struct {
	n        int   // the attempt's number, from 1
	err      error // its error
	timedOut bool  // it ran out of its PerAttemptTimeout
	// trailer is its trailer, where a pushback would be; nil when not caught.
	trailer metadata.MD
	// reached is false when the attempt provably never reached the server.
	reached bool
	// headers is true when the server sent response headers: gRFC A6
	// commits the call to this attempt, so it is never repeated.
	headers bool
	// client is true when the error is the client's own (see clientSide).
	client bool
	// gaveUpBelow: a layer below gave up on it, saying so in a trailer
	// read before the attempt ended (a stream's; see gaveUpBelow).
	gaveUpBelow bool
	// answered: the server answered it (a stream's header or message)
	// before the caller's deadline ended it.
	answered bool
	// idle: the caller's deadline ended it before anyone asked the server
	// for an answer (see idleAtDeadlineLocked).
	idle bool
	span trace.Span // its span; nil when not traced
}

// decision is what follows a failed attempt: a wait and another attempt,
// or the end of the call with its outcome and error.
type decision struct {
	retry bool
	// pushback: the wait is the server's own (gRFC A6), not a backoff.
	pushback bool
	// gaveUpBelow: the call stops on a "do not retry" pushback that came
	// with the herdguard-gave-up trailer (a layer below gave up).
	gaveUpBelow bool
	wait        time.Duration
	jitter      string // the span's name for the wait: the Jitter's, or "pushback"
	outcome     Outcome
	err         error
}

// failure is how a failed attempt bears on its call, by the rules of
// gRFC A6 that retries and hedges share. What follows it (the attempts
// left, the budgets, the wait, the next hedge) is each one's own.
type failure int8

const (
	// failCaller: the caller's context ended; the call ends with it.
	failCaller failure = iota
	// failCommitted: the server sent response headers, which commit the
	// call to the attempt; it is never repeated.
	failCommitted
	// failClient: the client's own error, made before the request left
	// (see clientSide); it says nothing of the server.
	failClient
	// failStop: the server's pushback says not to try again.
	failStop
	// failFatal: a code the policy does not try again on.
	failFatal
	// failAgain: another attempt may go, after the server's pushback if
	// it gave one.
	failAgain
)

// judgement is what judge makes of a failed attempt.
type judgement struct {
	fail failure
	// again: the code is one the policy tries again on (retryable, or
	// non-fatal for hedges).
	again bool
	// gaveUpBelow: the trailer says "do not retry" because a layer below
	// gave up (gaveUpBelow): the call gives up too, saying so, and neither
	// the breaker nor the overload controller counts it.
	gaveUpBelow bool
	// pushback: the server said how long to wait (wait), for failAgain.
	pushback bool
	wait     time.Duration
}

// judge says how attempt e's failure bears on its call, in gRPC's order:
// the caller's end, headers (a commit), the client's own error, a
// pushback that says stop, and then the code (again: the policy tries it
// again). Retries (decide) and hedges (hedger.failedLocked) both judge by
// it, and differ only in what follows.
func judge(ctx context.Context, e attemptEnd, again bool) judgement {
	j := judgement{again: again, gaveUpBelow: gaveUpBelow(e.trailer)}
	switch {
	case ctx.Err() != nil:
		j.fail = failCaller
	case e.headers:
		j.fail = failCommitted
	case e.client:
		j.fail = failClient
	default:
		wait, ok, present := pushback(e.trailer)
		switch {
		case present && !ok:
			j.fail = failStop
		case !again:
			j.fail = failFatal
		default:
			j.fail, j.pushback, j.wait = failAgain, present, wait
		}
	}
	return j
}

// decide says what follows a failed attempt. Unary calls and streams share
// it, so both retry by exactly the same rules (judge's, as hedges too): a
// call that committed (the server sent headers), or whose error is the
// client's own, ends as it is and takes no throttling token (a committed
// one whose trailer says a layer below gave up gives up too); a pushback
// that says stop takes a token, whatever the code; a call that may not be
// retried at all (one attempt allowed) ends with the attempt's error as it
// is; a retryable code takes a token, and then the attempts, the
// throttling, the deadline and the ratio budget may each stop the call.
func (ic *Interceptor) decide(ctx context.Context, p *resolved, bs *backoffState, maxAttempts int, e attemptEnd) decision {
	code := status.Code(e.err)
	j := judge(ctx, e, p.again(e.err, p.retryableCode(code) || e.timedOut && code == codes.DeadlineExceeded))
	switch j.fail {
	case failCaller:
		return decision{outcome: contextOutcome(ctx.Err()), err: e.err}
	case failCommitted:
		if j.gaveUpBelow {
			// Committed, and a layer below gave up: the call gives up
			// too, saying so, like one that had not committed (below).
			// A committed call takes no throttling token. Only a unary
			// call gets here with its trailer: a committed stream keeps
			// its error as it is, and reads the trailer only to leave the
			// failure out of the counts (retryLocked, recvDone).
			d := stop(OutcomePushbackStop, e.n, e.err)
			d.gaveUpBelow = true
			return d
		}
		return decision{outcome: OutcomeFailedAfterCommit, err: e.err}
	case failClient:
		return decision{outcome: OutcomeNotRetryable, err: e.err}
	case failStop:
		bs.throttleFailure() // gRPC counts a refused pushback as a failure, whatever the code
		switch {
		case j.gaveUpBelow:
			// A layer below gave up: this call gives up too, whatever
			// the code, and says so (a *RetryError), so that a server
			// half above passes the "don't retry" on.
		case !j.again:
			return decision{outcome: OutcomeNotRetryable, err: e.err}
		case maxAttempts <= 1:
			return decision{outcome: OutcomePushbackStop, err: e.err}
		}
		d := stop(OutcomePushbackStop, e.n, e.err)
		d.gaveUpBelow = j.gaveUpBelow
		return d
	}
	if maxAttempts <= 1 {
		if j.fail == failFatal {
			return decision{outcome: OutcomeNotRetryable, err: e.err}
		}
		return decision{outcome: OutcomeExhausted, err: e.err}
	}
	if j.fail == failFatal {
		return decision{outcome: OutcomeNotRetryable, err: e.err}
	}
	if bs.unsafe && e.reached {
		return decision{outcome: OutcomeNotIdempotent, err: e.err}
	}
	throttled := !bs.throttleFailure() // every retryable failure takes a token
	if e.n >= maxAttempts {
		d := stop(OutcomeExhausted, e.n, e.err)
		d.err.(*RetryError).Overloaded = paces(bs.ctl)
		return d
	}
	if throttled {
		return ic.refuse(ctx, bs, "throttling", e)
	}
	d := decision{retry: true, jitter: p.p.Jitter.String()}
	reason := "backoff"
	switch dt := detailsOf(e.err); {
	case dt.retryInfo && (!j.pushback || dt.retryDelay > j.wait):
		// google.rpc.RetryInfo: wait retry_delay, then back off from it,
		// as if it had been the backoff's first wait (the next is
		// retry_delay × Multiplier, jittered).
		d.wait, d.pushback, d.jitter, bs.retries, bs.prev = dt.retryDelay, true, "retry_info", 1, dt.retryDelay
		bs.floor = max(bs.floor, dt.retryDelay)
		reason = "retry_info"
	case j.pushback:
		// gRFC A6: wait as told, then start the backoff afresh.
		d.wait, d.pushback, d.jitter, bs.retries, bs.prev = j.wait, true, "pushback", 0, 0
		reason = "pushback"
	default:
		bs.retries++
		if bs.floor == 0 {
			d.wait = p.p.Backoff(bs.retries, bs.prev, ic.rand())
		} else {
			pol := p.p
			pol.InitialBackoff, pol.MaxBackoff = max(pol.InitialBackoff, bs.floor), max(pol.MaxBackoff, bs.floor)
			d.wait = pol.Backoff(bs.retries, bs.prev, ic.rand())
		}
		bs.prev = d.wait
	}
	if deadline, ok := ctx.Deadline(); ok && ic.clock.Now().Add(d.wait).After(deadline) {
		return stop(OutcomeDeadline, e.n, e.err)
	}
	if bs.lim != nil && bs.lim.ratio != nil && !bs.lim.ratio.TryRetry() {
		return ic.refuse(ctx, bs, "ratio", e)
	}
	ic.metering.retryDelay(ctx, bs.method, bs.target, d.wait.Seconds())
	if ic.events.on {
		ic.events.retry(ctx, RetryEvent{Method: bs.method, Target: bs.target, Attempt: e.n, Err: e.err, Wait: d.wait, Reason: reason})
	}
	return d
}

// refuse ends a call whose retry a budget refused, and counts the refusal.
func (ic *Interceptor) refuse(ctx context.Context, bs *backoffState, kind string, e attemptEnd) decision {
	ic.metering.refusal(ctx, bs.method, bs.target, kind)
	return stop(OutcomeBudgetExhausted, e.n, e.err)
}

// throttleFailure takes a throttling token, if throttling is on, and
// reports whether retries are still allowed.
func (bs *backoffState) throttleFailure() bool {
	if bs.lim == nil || bs.lim.throttle == nil {
		return true
	}
	return bs.lim.throttle.Failure()
}

// started records a call's first attempt with the budgets.
func (bs *backoffState) started() {
	if bs.lim != nil && bs.lim.ratio != nil {
		bs.lim.ratio.Call()
	}
}

// succeeded records a successful call with the throttling.
func (bs *backoffState) succeeded() {
	if bs.lim != nil && bs.lim.throttle != nil {
		bs.lim.throttle.Success()
	}
}

// clientSide reports whether err is one that gRPC makes in the client before
// the request leaves it: a message over the call's send limit, or one that
// could not be encoded or compressed. gRPC's own retry never retries these,
// and they say nothing of the server. An interceptor sees only the status,
// so the messages gRPC writes for them are matched; a test pins them to the
// gRPC version in go.mod.
func clientSide(err error) bool {
	st, _ := status.FromError(err)
	msg := st.Message()
	switch st.Code() {
	case codes.ResourceExhausted:
		return strings.HasPrefix(msg, "trying to send message larger than max")
	case codes.Internal:
		return strings.HasPrefix(msg, "grpc: error while marshaling") || strings.HasPrefix(msg, "grpc: error while compressing")
	}
	return false
}

func stop(o Outcome, attempts int, err error) decision {
	return decision{outcome: o, err: &RetryError{Attempts: attempts, Outcome: o, Err: err}}
}

// pause waits as d says before attempt next, traced as a backoff span, and
// reports whether the whole wait passed; if ctx ended first, it returns the
// status error that matches the context's.
func (ic *Interceptor) pause(ctx context.Context, tracer trace.Tracer, bs *backoffState, next int, d decision) error {
	var span trace.Span
	if tracer != nil {
		span = startBackoff(ctx, tracer, next, float64(d.wait)/float64(time.Millisecond), d.jitter)
	}
	waited := ic.wait(ctx.Done(), d.wait, bs.timer)
	if span != nil {
		span.End()
	}
	if !waited {
		return status.FromContextError(ctx.Err()).Err()
	}
	return nil
}

// wait blocks for d on the interceptor's clock, or until done closes, and
// reports whether the full wait passed. *t is reused across waits.
func (ic *Interceptor) wait(done <-chan struct{}, d time.Duration, t *clock.Timer) bool {
	if d <= 0 {
		select {
		case <-done:
			return false
		default:
			return true
		}
	}
	if *t == nil {
		*t = ic.clock.NewTimer(d)
	} else {
		(*t).Reset(d)
	}
	select {
	case <-(*t).C():
		return true
	case <-done:
		(*t).Stop()
		return false
	}
}

func contextOutcome(err error) Outcome {
	if err == context.DeadlineExceeded {
		return OutcomeDeadline
	}
	return OutcomeCanceled
}

// hasGaveUpKey reports whether a trailer carries the herdguard-gave-up key
// a layer below sets beside its "do not retry" (see gaveUpBelow).
func hasGaveUpKey(md metadata.MD) bool { return len(md[wire.GaveUpKey]) > 0 } // a trailer's keys are lowercase: no Get

// heldBelow reports whether an answer's trailer says that a layer below
// held the call back in its overload controller's line
// (wire.HeldBelowKey): the answer's wait was that layer's, not a queue at
// this target.
func heldBelow(md metadata.MD) bool { return len(md[wire.HeldBelowKey]) > 0 }

// gaveUpBelow reports whether a failed attempt's trailer says "do not
// retry" because a layer below gave up (the herdguard-gave-up key beside
// a stopping pushback): the server answered, and the protection of the layer below
// acted. It says nothing of this target's load, and the overload
// controller does not count it: pacing here too would hold back, on the
// evidence of another layer's, calls the layer below already paces.
func gaveUpBelow(md metadata.MD) bool {
	if !hasGaveUpKey(md) {
		return false
	}
	_, ok, present := pushback(md)
	return present && !ok
}

// pushback reads the server's retry pushback from a trailer. present is
// false when there is none; ok is false when it says not to retry.
func pushback(md metadata.MD) (wait time.Duration, ok, present bool) {
	vals := md[wire.PushbackKey] // a trailer's keys are lowercase: no Get, on every failed attempt
	if len(vals) == 0 {
		return 0, false, false
	}
	if len(vals) != 1 {
		return 0, false, true
	}
	ms, err := strconv.ParseInt(vals[0], 10, 64)
	if err != nil || ms < 0 || ms > int64(time.Duration(1<<63-1)/time.Millisecond) {
		return 0, false, true
	}
	return time.Duration(ms) * time.Millisecond, true, true
}
