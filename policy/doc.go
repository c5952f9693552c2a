// Package policy decides how a failed gRPC call is retried: how many
// attempts, which status codes, and how long to wait between attempts. It is
// pure: it makes no calls and reads no clock; the random number behind each
// jittered wait is an argument, so every wait can be tested exactly.
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
package policy
