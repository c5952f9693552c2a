package policy_test

import (
	"fmt"
	"time"

	"github.com/herdguard/herdguard/policy"
)

// The waits of a policy, with a fixed random number so they are exact.
func ExamplePolicy_Backoff() {
	p := policy.Policy{InitialBackoff: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond, Multiplier: 2}
	for _, j := range []policy.Jitter{policy.NoJitter, policy.FullJitter, policy.EqualJitter} {
		p.Jitter = j
		fmt.Print(j, ":")
		for retry := 1; retry <= 6; retry++ {
			fmt.Print(" ", p.Backoff(retry, 0, 0.5))
		}
		fmt.Println()
	}
	// Output:
	// none: 10ms 20ms 40ms 80ms 100ms 100ms
	// full: 5ms 10ms 20ms 40ms 50ms 50ms
	// equal: 7.5ms 15ms 30ms 60ms 75ms 75ms
}

// A literal that sets only some fields keeps the other defaults, full jitter
// included; no jitter is asked for by name.
func ExamplePolicy_partial() {
	p := policy.Policy{MaxAttempts: 5}
	fmt.Print(p.Jitter, ":")
	for retry := 1; retry <= 4; retry++ {
		fmt.Print(" ", p.Backoff(retry, 0, 0.5))
	}
	fmt.Println()
	p.Jitter = policy.NoJitter
	fmt.Print(p.Jitter, ":")
	for retry := 1; retry <= 4; retry++ {
		fmt.Print(" ", p.Backoff(retry, 0, 0.5))
	}
	fmt.Println()
	// Output:
	// full: 50ms 100ms 200ms 400ms
	// none: 100ms 200ms 400ms 800ms
}

func ExamplePolicy_Validate() {
	p := policy.Default()
	p.MaxBackoff = time.Millisecond
	fmt.Println(p.Validate())
	// Output: herdguard: policy: MaxBackoff = 1ms: must not be below InitialBackoff (100ms)
}
