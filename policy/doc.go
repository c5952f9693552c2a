// Package policy decides how a gRPC call is retried after a failure, or
// hedged while it is slow: how many attempts, which status codes, and how
// long to wait between attempts. It is pure: it makes no calls and reads no
// clock; the random number behind each jittered wait is an argument, so
// every wait can be tested exactly.
//
// A [Policy] is a plain value. Every zero field means its default (see
// [Default]), so a partial literal is safe; [Policy.Validate] reports
// unusable values, naming the field and the value.
//
//	p := policy.Policy{MaxAttempts: 5} // 5 attempts, 100ms..10s, ×2, full jitter
//	if err := p.Validate(); err != nil { ... }
//	wait := p.Backoff(1, 0, rnd.Float64()) // the wait before attempt 2
//
// # Backoff
//
// Before attempt n+1 the raw wait is
//
//	min(MaxBackoff, InitialBackoff × Multiplier^(n-1))
//
// computed without overflow for any n, and the [Jitter] shapes it:
//
//	FullJitter          uniform in [0, raw] (the zero value, the default)
//	NoJitter            raw
//	EqualJitter         raw/2 + uniform in [0, raw/2]
//	DecorrelatedJitter  min(MaxBackoff, uniform in [InitialBackoff, 3 × previous wait])
//
// Jitter's zero value is [FullJitter], which is what spreads a herd of
// callers that failed together; waiting without jitter is asked for by name,
// with [NoJitter].
//
// # Hedging
//
// A Policy whose [Hedging] is on hedges its calls instead of retrying them
// (gRFC A6's hedgingPolicy): its retry fields must then be zero.
// [Hedging.HedgeDelay] gives the wait before the next hedge from a quantile
// of the method's recent latencies, and [Budget.WithHedgeDefaults] the
// budget that hedges pass.
package policy
