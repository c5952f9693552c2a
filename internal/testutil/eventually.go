package testutil

import (
	"runtime"
	"testing"
	"time"
)

// patience bounds, in real time, how long Eventually waits: long enough
// for a loaded machine under the race detector, short enough that a
// broken test fails instead of hanging until the test binary's timeout.
const patience = 10 * time.Second

// spins is how many times Eventually yields before it starts to sleep.
const spins = 1000

// Eventually calls cond until it reports true and returns how long that
// took in real time. If cond is still false after 10 s it fails the test
// with t.Fatalf, naming what it waited for; call it, like t.Fatal, only
// from the goroutine running the test.
//
// It waits for goroutines the test does not control: a handler noticing
// that its context ended, attempts joining a controller's line, a replica
// hearing from Redis. It yields between the first calls of cond and then
// sleeps, from a few microseconds up to a millisecond, so that it costs
// little both when cond is about to hold and when it needs a while.
func Eventually(t testing.TB, what string, cond func() bool) time.Duration {
	t.Helper()
	return eventually(t, what, cond, patience)
}

// eventually is Eventually waiting at most limit.
func eventually(t testing.TB, what string, cond func() bool, limit time.Duration) time.Duration {
	t.Helper()
	began := time.Now()
	nap := time.Microsecond
	for i := 0; !cond(); i++ {
		if time.Since(began) > limit {
			t.Fatalf("waited %v for %s", limit, what)
		}
		if i < spins {
			runtime.Gosched()
			continue
		}
		time.Sleep(nap)
		nap = min(2*nap, time.Millisecond)
	}
	return time.Since(began)
}
