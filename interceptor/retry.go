package interceptor

import (
	"context"
	"strconv"
	"time"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// backoffState is what one call's retry decisions remember and use.
type backoffState struct {
	prev    time.Duration // the last wait, for decorrelated jitter
	retries int           // retries since the start or the last pushback
	timer   timer         // made on the first wait, then reset

	method string
	lim    *limits        // the target's budgets; nil when none is on
	meter  *meterSnapshot // nil when metrics are off
	// unsafe is true when only attempts that never reached the server may
	// be repeated (WithIdempotentOnly, and the method is not idempotent).
	unsafe bool
}

// decision is what follows a failed attempt: a wait and another attempt,
// or the end of the call with its outcome and error.
type decision struct {
	retry   bool
	wait    time.Duration
	jitter  string // the Jitter's name, or "pushback"
	outcome Outcome
	err     error
}

// decide says what follows attempt number attempt, which failed with err.
// timedOut reports that the attempt ran out of its PerAttemptTimeout; trailer
// is the attempt's trailer (nil when not caught); reached is false when the
// attempt provably never reached the server. Unary calls and streams share
// it, so both retry by exactly the same rules.
func (ic *Interceptor) decide(ctx context.Context, p *resolved, bs *backoffState, attempt, maxAttempts int, err error, timedOut bool, trailer metadata.MD, reached bool) decision {
	if ctxErr := ctx.Err(); ctxErr != nil {
		return decision{outcome: contextOutcome(ctxErr), err: err}
	}
	code := status.Code(err)
	if !p.retryableCode(code) && !(timedOut && code == codes.DeadlineExceeded) {
		return decision{outcome: OutcomeNotRetryable, err: err}
	}
	if bs.unsafe && reached {
		return decision{outcome: OutcomeNotIdempotent, err: err}
	}
	throttled := false
	if bs.lim != nil && bs.lim.throttle != nil {
		throttled = !bs.lim.throttle.Failure() // every retryable failure takes a token
	}
	if attempt >= maxAttempts {
		return stop(OutcomeExhausted, attempt, err)
	}
	if throttled {
		return bs.refuse(ctx, "throttling", attempt, err)
	}
	d := decision{retry: true, jitter: p.p.Jitter.String()}
	if ms, ok, present := pushback(trailer); present {
		if !ok {
			return stop(OutcomePushbackStop, attempt, err)
		}
		// gRFC A6: wait as told, then start the backoff afresh.
		d.wait, d.jitter, bs.retries, bs.prev = ms, "pushback", 0, 0
	} else {
		bs.retries++
		d.wait = p.p.Backoff(bs.retries, bs.prev, ic.rand())
		bs.prev = d.wait
	}
	if deadline, ok := ctx.Deadline(); ok && ic.clock.Now().Add(d.wait).After(deadline) {
		return stop(OutcomeDeadline, attempt, err)
	}
	if bs.lim != nil && bs.lim.ratio != nil && !bs.lim.ratio.TryRetry() {
		return bs.refuse(ctx, "ratio", attempt, err)
	}
	if bs.meter != nil {
		bs.meter.retryDelay(ctx, bs.method, d.wait.Seconds())
	}
	return d
}

// refuse ends a call whose retry a budget refused, and counts the refusal.
func (bs *backoffState) refuse(ctx context.Context, kind string, attempt int, err error) decision {
	if bs.meter != nil {
		bs.meter.refusal(ctx, bs.method, kind)
	}
	return stop(OutcomeBudgetExhausted, attempt, err)
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
	waited := ic.wait(ctx.Done(), d.wait, &bs.timer)
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
func (ic *Interceptor) wait(done <-chan struct{}, d time.Duration, t *timer) bool {
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

// pushback reads the server's retry pushback from a trailer. present is
// false when there is none; ok is false when it says not to retry.
func pushback(md metadata.MD) (wait time.Duration, ok, present bool) {
	vals := md.Get(PushbackTrailerKey)
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
