package mesh

import (
	"context"
	"errors"

	"github.com/herdguard/herdguard/internal/wire"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/interceptor"
)

const (
	// GaveUpTrailerKey is the trailer that says which give-up made the
	// answer "don't retry": its value is the outcome of the call below that
	// gave up ("exhausted", "shed", "breaker_open", "breaker_open_shared",
	// "pushback_stop", "budget_exhausted"), "deadline" for one that ran out
	// of the time the deadline reserve left it, or OutcomeRetriedAbove.
	// A herdguard client stopped by it gives up with OutcomePushbackStop,
	// and counts the call against neither its breaker nor its overload
	// controller: the layer below judged.
	GaveUpTrailerKey = wire.GaveUpKey
	// AttemptMetadataKey is the request metadata by which herdguard's
	// client marks every retry with its attempt number ("2", "3", ...);
	// a first attempt carries none. The server half reads it, beside
	// gRPC's grpc-previous-rpc-attempts, to tell retries from first sends.
	AttemptMetadataKey = wire.AttemptKey
	// RetriesBelowKey is the request metadata that says how many retries
	// each call made below may still send. herdguard's client half sends
	// "0" on the calls a request makes when that request is a retry or
	// arrived with "0" itself: only one layer retries. "0" is the only
	// value it sends or reads; any other leaves the layer's own policy in
	// charge.
	RetriesBelowKey = "herdguard-retries-below"
	// OutcomeRetriedAbove is the GaveUpTrailerKey value of a call that made
	// its one attempt, and failed with a retryable code, because a layer
	// above is retrying the request: the request's budget is spent.
	OutcomeRetriedAbove = "retried_above"
)

// stop is the trailer value that tells a gRPC client not to retry (gRFC A6).
const stop = "-1"

// retryKeys are the request metadata that mark a retry or a hedge, with the
// value of a first send: gRPC's own (every language, Envoy), herdguard's,
// and go-grpc-middleware's.
var retryKeys = [...]struct {
	key   string
	first string
}{
	{"grpc-previous-rpc-attempts", "0"},
	{wire.AttemptKey, "1"},
	{"x-retry-attempt", "0"},
}

// GaveUp reports whether err is the error of a herdguard call that gave up
// on evidence that retrying it from further up would hurt the server
// below, and which outcome it was: shed by the overload controller, out of
// attempts while the controller paced the server (RetryError.Overloaded),
// refused by an open breaker, stopped by the server's pushback (a layer
// below judged), or out of the retry budget. A call out of attempts at a
// server that was not judged overloaded, one that ended by its deadline or
// its caller, failed with a code its policy does not retry, or failed
// after it committed did not: a server that fails on its own gets the
// retries from above that it would get without the server half.
func GaveUp(err error) (interceptor.Outcome, bool) {
	var re *interceptor.RetryError
	if errors.As(err, &re) {
		switch re.Outcome {
		case interceptor.OutcomeShed, interceptor.OutcomePushbackStop, interceptor.OutcomeBudgetExhausted:
			return re.Outcome, true
		case interceptor.OutcomeExhausted:
			if re.Overloaded {
				return re.Outcome, true
			}
		}
		return "", false
	}
	var oe *breaker.OpenError
	if errors.As(err, &oe) {
		if oe.Shared {
			return interceptor.OutcomeBreakerOpenShared, true
		}
		return interceptor.OutcomeBreakerOpen, true
	}
	return "", false
}

// retriedAbove reports whether the request being served (ctx) is a retry or
// a hedge, or arrived saying that no retries are left below.
func retriedAbove(ctx context.Context) bool {
	if v := metadata.ValueFromIncomingContext(ctx, RetriesBelowKey); len(v) > 0 && v[0] == "0" {
		return true
	}
	for _, k := range retryKeys {
		if v := metadata.ValueFromIncomingContext(ctx, k.key); len(v) > 0 && v[0] != k.first {
			return true
		}
	}
	return false
}

// signal makes the request being served (ctx) answer "don't retry", saying
// why. It does nothing outside a gRPC server's handler.
func signal(ctx context.Context, outcome string) {
	_ = grpc.SetTrailer(ctx, metadata.Pairs(wire.PushbackKey, stop, GaveUpTrailerKey, outcome))
}

// signalled is the error of a call below that gave up after the client
// half had made the request answer "don't retry": the server half then
// knows not to say it twice. Its text and status are err's.
type signalled struct{ error }

func (e signalled) Unwrap() error              { return e.error }
func (e signalled) GRPCStatus() *status.Status { return status.Convert(e.error) }
