// Package interceptor holds herdguard's gRPC client interceptors: retries
// of transient failures with capped exponential backoff and jitter, inside
// a circuit breaker, paced by an overload controller, with an
// OpenTelemetry span for every call, attempt and wait. It is the only
// herdguard package that drives gRPC calls.
//
//	ic, err := interceptor.New() // the defaults below; options change them
//	if err != nil { ... }        // every option is checked here
//	cc, err := grpc.NewClient(target, append(ic.DialOptions(), creds)...)
//
// Unary calls and streams of every kind go through it. What is retried and
// how long each wait is: [Interceptor.Unary]; streams: [Interceptor.Stream];
// what a failed call returns: [RetryError] and [Outcome]; what the breaker
// counts: [WithBreaker]; one call's policy: [CallPolicy] and [NoRetry]. A
// policy whose Hedging is on hedges instead of retrying ([policy.Hedging],
// [WithHedgeBudget]). The guides, with examples and measurements, are in
// docs/ (https://github.com/herdguard/herdguard/tree/main/docs).
//
// # Defaults
//
// This section is where herdguard states its defaults; the rest of its
// documentation links here. Every zero field of a setting means its
// default, so a partial literal such as policy.Policy{MaxAttempts: 5} keeps
// the rest, full jitter included. With no options:
//
// Retries ([policy.Default], [WithPolicy]): 3 attempts in all (MaxAttempts);
// waits from 100ms (InitialBackoff), doubling (Multiplier 2), at most 10s
// (MaxBackoff), with full jitter (the zero Jitter; none is
// [policy.NoJitter]); on Unavailable and ResourceExhausted
// ([herdguard.DefaultRetryableCodes]); no PerAttemptTimeout (a timed-out
// attempt is retried while the caller's deadline allows) and no Timeout
// (it bounds the whole call, as a service config's timeout).
//
// A circuit breaker per target ([breaker.Settings], [WithBreaker]): it
// opens after 5 failed calls in a row (ConsecutiveFailures, counted after
// their retries) once that run has lasted 1s (DownAfter; none when
// ConsecutiveFailures is set) with nothing succeeding; FailureRatio off (or
// that share of the calls in a rolling 10s Window, once MinRequests, 10,
// finished); half-open after 500ms (OpenTimeout), an open period that
// doubles while probes fail, up to 10s (MaxOpenTimeout); 1 probe at once
// (HalfOpenMaxRequests), which makes one attempt; Scope per target.
//
// An overload controller per target ([overload.Settings],
// [WithOverloadControl]; [WithoutOverloadControl] turns it off): counts in
// 100ms Intervals; pacing starts when the fewest recent Intervals (at most
// 10) that hold 5 refusals for load (MinFailures) show more than half of
// the attempts refused (FailureRatio 0.5) and more than the server fails on
// its own, when a run of refusals shows it collapsed, or when it falls
// behind; the rate is 0.9 of what it answered (Headroom); 500ms between
// growth steps (Hold); 10 calm Intervals end the pacing (Calm); a server
// that refused everything for 2s while held back is down (DownAfter), and
// new attempts fail at once but for a probe now and then; a call without
// a deadline waits 10s at most (MaxWait). It holds attempts back only while
// that helps: a server that fails a share of its attempts on its own,
// whatever the load, is left to the retries. While it paces a target, the
// breaker leaves that target's calls to it.
//
// Spans and metrics go to the global OpenTelemetry providers, as New finds
// them ([WithTracerProvider], [WithMeterProvider]); no span or metric work
// is done while they record nothing. Off until asked for: retry throttling
// and budgets, hedging, idempotency gates and keys, the fleet's shared
// breaker (breaker.Settings.Fleet), hooks ([WithHooks]) and logs
// ([WithLogger]), a policy's RetryIf.
//
// # Order
//
// [Interceptor.DialOptions] chains the interceptors: those installed before
// them run once per call, those after them once per attempt. It also turns
// gRPC's own retry off, so that a service config's retryPolicy does not run
// inside every herdguard attempt.
package interceptor
