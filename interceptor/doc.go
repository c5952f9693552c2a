// Package interceptor holds herdguard's gRPC client interceptors: retries
// of transient failures with capped exponential backoff and jitter, inside
// a circuit breaker, with an OpenTelemetry span for every call, attempt and
// wait. It is the only herdguard package that drives gRPC calls.
//
//	ic, err := interceptor.New(
//		interceptor.WithPolicy(policy.Default()),
//		interceptor.WithBreaker(breaker.Settings{ConsecutiveFailures: 5}),
//	)
//	if err != nil { ... } // every option is checked here
//	cc, err := grpc.NewClient(target, append(creds, ic.DialOptions()...)...)
//
// # Defaults
//
// With no options: 3 attempts, waits from 100ms doubling to at most 10s
// with full jitter, retrying Unavailable and ResourceExhausted
// ([policy.Default]); a breaker per target that opens after 5 failed calls
// in a row once that run has lasted 1s (nothing succeeds), and probes after
// 500ms, an open period that doubles while probes fail, up to 10s (package
// breaker); an overload controller per target (package overload), which
// holds attempts back only while that helps: a server that fails a share of
// its attempts on its own, whatever the load, is left to the retries;
// spans to the global OpenTelemetry provider.
//
// # What is retried
//
// An attempt is retried when its code is one of the policy's RetryableCodes,
// or it is a DeadlineExceeded of an attempt run under PerAttemptTimeout, and
// the caller's context is alive, and attempts remain, and the server sent
// no response headers (gRFC A6: headers commit the call). Before attempt n+1 it
// waits [policy.Policy.Backoff], or the server's pushback
// ([PushbackTrailerKey], gRFC A6: a non-negative number of milliseconds
// replaces the wait and restarts the backoff; anything else stops the
// retries). If that wait would end after the caller's deadline it stops at
// once with the last attempt's status. Every retry carries
// [AttemptMetadataKey] with its attempt number.
//
// A call that fails with a code the policy does not retry, that may make a
// single attempt only, that failed after the server sent headers, or that
// the caller cancelled, returns gRPC's error as it is. A call whose retries
// stopped returns a [*RetryError] that carries the last status: status.Code
// and status.FromError see through it. The last attempt a call may make is
// not checked for headers or pushback, as no retry could follow it (gRPC
// copies the caught headers and trailer): a call whose last attempt failed
// with a retryable code returns a RetryError with outcome exhausted, even if
// that attempt's server sent headers or a pushback that stops retries. With
// throttling on the last attempt is checked too, for gRPC counts a stopping
// pushback there, and so is every hedge of a hedged call.
//
// # Circuit breaker
//
// The breaker wraps the whole retry loop: one call is one result, counted
// once its retries are over, by breaker.Settings.Verdict (by default the
// table in package herdguard). A call the caller cancelled counts for
// nothing, as does one whose deadline ran out during a backoff wait or
// before its first attempt; a deadline that runs out while an attempt is in
// flight is a failure: the server did not answer in time. A stream counts
// as a success as soon as the server answers it (headers or a message), so
// a long healthy stream admitted as a half-open probe closes the breaker at
// once; a stream that fails after that counts for nothing more. An open
// breaker fails a call at once with a [*breaker.OpenError]: errors.Is(err,
// breaker.ErrOpen) holds and status.Code(err) is Unavailable. A call through
// a half-open breaker is a probe and makes a single attempt.
//
// # Per-call options
//
// [CallPolicy] and [NoRetry] change one call. They embed
// grpc.EmptyCallOption, so they do nothing on a connection without the
// interceptor. Policies are chosen in this order: CallPolicy, then
// [WithMethodPolicy] for the method, then for its service, then
// [WithPolicy]. NoRetry makes any of them a single attempt.
//
// # Spans
//
// For each call a CLIENT span named after the method ("pkg.Service/Method")
// with rpc.system.name, rpc.method, server.address and server.port (from
// the connection's target), rpc.response.status_code and, on failure,
// error.type (semconv v1.43.0), herdguard.attempts and herdguard.outcome
// (an [Outcome]). Its children: a span "attempt" per attempt (rpc.method,
// herdguard.attempt, 1-based, rpc.response.status_code and error.type on
// failure) and a span "backoff" per wait
// (herdguard.attempt of the attempt that follows, herdguard.backoff.delay_ms
// and herdguard.backoff.jitter, the Jitter's name or "pushback"). Breaker
// refusals and state changes are events on the call span. The attempt
// span's context is what the next interceptor and gRPC's stats handlers
// see, so otelgrpc's spans nest under each attempt. When the provider makes
// no spans (a no-op, or the global provider before an SDK is installed), no
// span work is done at all.
//
// # Streams
//
// [Interceptor.Stream] retries every stream kind until the stream commits:
// the server's response headers or a message reached it, the caller called
// Context, or the replay buffer of [DefaultStreamBuffer] bytes overflowed.
// Each new attempt replays the messages sent and CloseSend. SendMsg, RecvMsg
// and Header all drive a retry when they find the attempt broken, through
// one funnel, as gRPC's own stream does. Interceptors chained after
// herdguard's see the caller's messages; the buffer keeps each message
// encoded, and a replay sends a new message of the caller's type decoded
// from it.
//
// # Hedging
//
// A policy whose Hedging is on ([policy.Hedging], or a service config's
// hedgingPolicy) hedges instead of retrying, as gRFC A6 says: the first
// attempt goes at once, the next after the hedging delay while none has
// answered, or at once after a non-fatal failure, or after the server's
// pushback. The first answer (a unary reply, a stream's headers or first
// message) or the first fatal failure decides the call, and every other
// attempt is cancelled; the caller sees that answer only. With a Quantile
// the delay is that quantile of the method's recent attempt latencies,
// never below Delay. A hedge needs the breaker closed with no failure since
// its last success, a throttling token and room in the retry budget when
// those are on, and room in the target's hedge budget ([WithHedgeBudget]),
// which only successful calls earn: under overload hedging stops by itself.
// A half-open probe is never hedged, and the breaker counts a hedged call
// once. Hedged streams replay their messages to each hedge and commit as
// retried streams do; no hedge starts once the replay buffer overflowed.
//
// # gRPC's own retry
//
// [Interceptor.DialOptions] turns gRPC's retry off (grpc.WithDisableRetry),
// so that a service config's retryPolicy does not run inside every herdguard
// attempt; install Unary and Stream by hand and you must add it yourself.
// gRPC's transparent retry of requests that never reached a server stays.
//
// # Budgets, service configs, idempotency
//
// [WithRetryThrottling] and [WithRetryBudget] cap retries across all calls
// per target; a refused retry ends the call with outcome budget_exhausted.
// [WithServiceConfig] takes policies from gRPC service config JSON.
// [WithIdempotentOnly] retries methods not marked idempotent only when the
// request never reached a server; [WithIdempotencyKey] gives each call a key
// servers can dedupe by.
//
// # Metrics
//
// With [WithMeterProvider] (default: the global provider): [MetricAttempts],
// [MetricRetryDelay], [MetricCalls], [MetricBreakerState],
// [MetricBreakerTransitions], [MetricBudgetRefusals] and [MetricHedges];
// see the README for their attributes. A no-op provider costs nothing.
//
// # Order
//
// [Interceptor.DialOptions] chains the interceptors: those installed before
// them run once per call, those after them once per attempt.
package interceptor
