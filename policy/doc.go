// Package policy decides how a failed gRPC call is retried: how many
// attempts, which status codes, and how long to wait between attempts. It is
// pure: it makes no calls and reads no clock; the random number behind each
// jittered wait is an argument, so every wait can be tested exactly.
//
// A [Policy] is a plain value. Its zero fields mean defaults (see [Default]);
// [Policy.Validate] reports unusable values, naming the field and the value.
//
//	p := policy.Default()          // 3 attempts, 100ms..10s, ×2, full jitter
//	p.MaxAttempts = 5
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
//	NoJitter            raw
//	FullJitter          uniform in [0, raw]
//	EqualJitter         raw/2 + uniform in [0, raw/2]
//	DecorrelatedJitter  min(MaxBackoff, uniform in [InitialBackoff, 3 × previous wait])
//
// Jitter's zero value is [NoJitter], so a Policy literal that sets only some
// fields waits without jitter; start from [Default] to keep full jitter,
// which is what spreads a herd of callers that failed together.
package policy
