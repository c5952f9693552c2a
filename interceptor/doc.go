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
// spans to the global OpenTelemetry provider. This section is where
// herdguard states its defaults; the rest of its documentation links here.
//
// Every zero field of a [policy.Policy] means its default, so a partial
// literal such as policy.Policy{MaxAttempts: 5} keeps the rest, full jitter
// included. The retry policy:
//
//   - MaxAttempts: 3, attempts in all, the first included.
//   - InitialBackoff: 100ms, the raw wait before the second attempt.
//   - Multiplier: 2, the raw wait grows by this per retry.
//   - MaxBackoff: 10s, the cap on every wait.
//   - Jitter: full, the zero Jitter; no jitter is [policy.NoJitter].
//   - RetryableCodes: Unavailable, ResourceExhausted
//     ([herdguard.DefaultRetryableCodes]).
//   - PerAttemptTimeout: none; a timed-out attempt is retried while the
//     caller's deadline allows.
//   - Timeout: none; it bounds the whole call, as a service config's
//     timeout.
//
// The circuit breaker ([breaker.Settings], [WithBreaker]):
//
//   - ConsecutiveFailures: 5, in a run that has lasted DownAfter: failed
//     calls (after their retries) in a row that open it; set, it opens on
//     that many however quickly they came.
//   - DownAfter: 1s (none when ConsecutiveFailures is set): how long the run
//     must have lasted since its first failure: evidence that nothing
//     succeeds, not chance.
//   - FailureRatio: off; or: this share of failed calls in Window, once
//     MinRequests (10) finished.
//   - Window: 10s, rolling, in 10 buckets.
//   - OpenTimeout: 500ms, then half-open; each failed probe doubles the next
//     open period.
//   - MaxOpenTimeout: 10s, the longest open period; closing resets it.
//   - HalfOpenMaxRequests: 1 probe at once; a probe makes one attempt.
//   - Scope: per target, or per method.
//
// The overload controller is on, per target ([overload.Settings],
// [WithOverloadControl]; [WithoutOverloadControl] turns it off):
//
//   - Interval: 100ms, for counts and rate adjustments.
//   - MinFailures, FailureRatio: 20, 0.5: overload refusals in one
//     interval, and their share of its answers, that start the pacing.
//   - Hold: 500ms between growth steps past what the server is known to
//     take.
//   - Headroom: 0.9, the share of a measured capacity the rate returns to.
//   - Calm: 10 calm intervals end the pacing.
//
// Tracing goes to the global provider, as New finds it; no span work is
// done while it makes no spans.
//
// Before attempt n+1 the raw wait is
//
//	min(MaxBackoff, InitialBackoff × Multiplier^(n-1))
//
// and the jitter shapes it: none (raw), full (uniform[0, raw]), equal
// (raw/2 + uniform[0, raw/2]) or decorrelated (min(MaxBackoff,
// uniform[InitialBackoff, 3 × previous wait])). A wait that would end after
// the caller's deadline is not started: the call ends at once with the last
// status. A server's grpc-retry-pushback-ms trailer replaces the wait
// (gRFC A6); a negative or malformed one stops the retries. Every retry
// carries metadata herdguard-attempt: N (N = 2, 3, ...), so servers can
// count retries apart.
//
// For the breaker a call's final status says the server is failing
// (Unavailable, DeadlineExceeded, ResourceExhausted, Internal, Unknown,
// DataLoss) or healthy (everything else); the table is in package herdguard
// ([herdguard.BreakerVerdict], in codes.go), and breaker.Settings.Verdict
// replaces it, for example to keep one tenant's ResourceExhausted quota
// from opening the breaker for every tenant:
//
//	interceptor.WithBreaker(breaker.Settings{Verdict: func(err error) herdguard.Verdict {
//		if status.Code(err) == codes.ResourceExhausted {
//			return herdguard.Ignored
//		}
//		return herdguard.BreakerVerdict(status.Code(err))
//	}})
//
// # What is retried
//
// An attempt is retried when its code is one of the policy's RetryableCodes,
// or it is a DeadlineExceeded of an attempt run under PerAttemptTimeout, and
// the caller's context is alive, and attempts remain, and the server sent
// no response headers (gRFC A6: headers commit the call). Before attempt n+1 it
// waits [policy.Policy.Backoff], or the server's pushback
// (the grpc-retry-pushback-ms trailer, gRFC A6: a non-negative number of milliseconds
// replaces the wait and restarts the backoff; anything else stops the
// retries). If that wait would end after the caller's deadline it stops at
// once with the last attempt's status. Every retry carries the
// herdguard-attempt metadata key with its attempt number.
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
// Context, or the replay buffer (256 KiB; [WithStreamBuffer]) overflowed.
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
// With [WithMeterProvider] (default: the global provider) herdguard records
// the instruments that package [github.com/herdguard/herdguard/telemetry]
// names (MetricAttempts, MetricRetryDelay, MetricCalls, MetricBreakerState,
// MetricBreakerTransitions, MetricBudgetRefusals, MetricHedges and the
// overload controller's); see docs/observability.md for their attributes
// (https://github.com/herdguard/herdguard/blob/main/docs/observability.md#metrics).
// A no-op provider costs nothing.
//
// # Order
//
// [Interceptor.DialOptions] chains the interceptors: those installed before
// them run once per call, those after them once per attempt.
package interceptor
