package interceptor

import (
	"errors"
	"fmt"

	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/breaker"
)

// Outcome says how a call ended; it is the herdguard.outcome span attribute.
type Outcome string

// The outcomes of a call.
const (
	// OutcomeOK: an attempt succeeded.
	OutcomeOK Outcome = "ok"
	// OutcomeExhausted: every allowed attempt failed with a retryable code
	// (a half-open breaker's probe is allowed one).
	OutcomeExhausted Outcome = "exhausted"
	// OutcomeNotRetryable: an attempt failed with a code the policy does not
	// retry.
	OutcomeNotRetryable Outcome = "not_retryable"
	// OutcomeBreakerOpen: the circuit breaker refused the call; nothing was
	// sent.
	OutcomeBreakerOpen Outcome = "breaker_open"
	// OutcomeBreakerOpenShared: the fleet's shared circuit breaker refused
	// the call (see breaker.Fleet); nothing was sent.
	OutcomeBreakerOpenShared Outcome = "breaker_open_shared"
	// OutcomeDeadline: the caller's deadline ended the call, during an
	// attempt or a wait, or the next wait would have outlasted it.
	OutcomeDeadline Outcome = "deadline"
	// OutcomeCanceled: the caller cancelled the call.
	OutcomeCanceled Outcome = "canceled"
	// OutcomePushbackStop: the server's grpc-retry-pushback-ms trailer said
	// not to retry.
	OutcomePushbackStop Outcome = "pushback_stop"
	// OutcomeBudgetExhausted: the retry budget or gRPC's retry throttling
	// refused the next retry.
	OutcomeBudgetExhausted Outcome = "budget_exhausted"
	// OutcomeNotIdempotent: an attempt failed with a retryable code, but
	// the method is not marked idempotent (WithIdempotentOnly) and the
	// request may have reached the server, so it was not repeated.
	OutcomeNotIdempotent Outcome = "not_idempotent"
	// OutcomeFailedAfterCommit: the call failed after it committed, so it
	// was not retried: the server had sent response headers (gRFC A6), or,
	// for a stream, the caller had a message, called Context, or the replay
	// buffer overflowed. Every attempt is checked, a unary call's last too,
	// and every hedge. A committed unary attempt whose trailer says a layer
	// below gave up ends as OutcomePushbackStop instead; a committed stream
	// keeps this outcome, and its breaker and overload controller leave
	// the failure out.
	OutcomeFailedAfterCommit Outcome = "failed_after_commit"
	// OutcomeShed: the overload controller shed an attempt without sending
	// it: the server is overloaded and the call's deadline could not be met
	// at the rate it takes (see package overload).
	OutcomeShed Outcome = "shed"
	// OutcomeInvalidCallOption: a call option held an invalid value;
	// nothing was sent.
	OutcomeInvalidCallOption Outcome = "invalid_call_option"
)

// RetryError is the error of a call that failed with a retryable code and
// was not retried further: its attempts ran out, the next wait would have
// outlasted the caller's deadline, the server's pushback said stop, or the
// retry budget was spent. It carries the last attempt's error:
// errors.Unwrap returns it, and status.Code and status.FromError report its
// status unchanged.
//
// A call that failed with a code the policy does not retry, that was not
// allowed to retry at all (a single attempt: NoRetry, MaxAttempts 1, a
// half-open breaker's probe), that failed after it committed, or that the
// caller cancelled, returns the attempt's error as it is; but a call
// stopped by a server that says a layer below it gave up (GaveUpTrailerKey
// of package mesh, beside a stopping pushback) returns a RetryError with
// OutcomePushbackStop whatever its code and its attempts, so that a server
// half above passes the "don't retry" on.
type RetryError struct {
	// Attempts is how many attempts were sent, the first included.
	Attempts int
	// Outcome is OutcomeExhausted, OutcomeDeadline, OutcomePushbackStop,
	// OutcomeBudgetExhausted or OutcomeShed (Attempts is then how many were
	// sent before the shed one: 0 for a first attempt, whose Err is an
	// Unavailable status saying so).
	Outcome Outcome
	// Err is the last attempt's error.
	Err error
	// Overloaded is true for a call whose attempts ran out
	// (OutcomeExhausted) while the overload controller paced the target:
	// the server was judged overloaded, so retrying the call from further
	// up would add to its load. Package mesh says "don't retry" above on
	// it, and not on an exhausted call without it.
	Overloaded bool
}

// Error says why the retries stopped and quotes the last attempt's error.
func (e *RetryError) Error() string {
	var why string
	switch e.Outcome {
	case OutcomeDeadline:
		why = "stopped retrying: the next wait would outlast the deadline"
	case OutcomePushbackStop:
		why = "stopped retrying: the server's pushback said not to retry"
	case OutcomeBudgetExhausted:
		why = "stopped retrying: the retry budget is spent"
	case OutcomeShed:
		why = "shed: the server is overloaded and the deadline cannot be met"
	default:
		why = "gave up"
	}
	return fmt.Sprintf("herdguard: %s after %d attempt(s); last: %v", why, e.Attempts, e.Err)
}

// Unwrap returns the last attempt's error.
func (e *RetryError) Unwrap() error { return e.Err }

// GRPCStatus returns the last attempt's status, so that status.Code and
// status.FromError see through the wrapper.
func (e *RetryError) GRPCStatus() *status.Status { return status.Convert(e.Err) }

// refusalOutcome is the outcome of a call the breaker refused with err.
func refusalOutcome(err error) Outcome {
	var oe *breaker.OpenError
	if errors.As(err, &oe) && oe.Shared {
		return OutcomeBreakerOpenShared
	}
	return OutcomeBreakerOpen
}
