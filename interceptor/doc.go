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
// in a row and probes after 5s (package breaker); spans to the global
// OpenTelemetry provider.
//
// # What is retried
//
// An attempt is retried when its code is one of the policy's RetryableCodes,
// or it is a DeadlineExceeded of an attempt run under PerAttemptTimeout, and
// the caller's context is alive, and attempts remain. Before attempt n+1 it
// waits [policy.Policy.Backoff], or the server's pushback
// ([PushbackTrailerKey], gRFC A6: a non-negative number of milliseconds
// replaces the wait and restarts the backoff; anything else stops the
// retries). If that wait would end after the caller's deadline it stops at
// once with the last attempt's status. Every retry carries
// [AttemptMetadataKey] with its attempt number.
//
// A call that fails with a code the policy does not retry, or that the
// caller cancelled, returns gRPC's error as it is. A call whose retries
// stopped returns a [*RetryError] that carries the last status: status.Code
// and status.FromError see through it.
//
// # Circuit breaker
//
// The breaker wraps the whole retry loop: one call is one result, counted
// once its retries are over, by the table in package herdguard. An open
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
// with rpc.system.name, rpc.method and rpc.response.status_code (semconv
// v1.43.0), herdguard.attempts and herdguard.outcome (an [Outcome]). Its
// children: a span "attempt" per attempt (herdguard.attempt, 1-based, and
// rpc.response.status_code) and a span "backoff" per wait
// (herdguard.attempt of the attempt that follows, herdguard.backoff.delay_ms
// and herdguard.backoff.jitter, the Jitter's name or "pushback"). Breaker
// refusals and state changes are events on the call span. The attempt
// span's context is what the next interceptor and gRPC's stats handlers
// see, so otelgrpc's spans nest under each attempt. When the provider is a
// no-op, no span work is done at all.
//
// # Streams
//
// [Interceptor.Stream] retries every stream kind until the stream commits
// (the caller received headers or a message, or the replay buffer of
// [DefaultStreamBuffer] bytes overflowed), replaying the messages sent and
// CloseSend into each new attempt. gRPC forbids changing a message after
// SendMsg; herdguard keeps gRPC's own encoding of each message, so a replay
// sends the bytes the first attempt sent.
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
// [MetricBreakerTransitions] and [MetricBudgetRefusals]; see the README for
// their attributes. A no-op provider costs nothing.
//
// # Order
//
// [Interceptor.DialOptions] chains the interceptors: those installed before
// them run once per call, those after them once per attempt.
package interceptor
