package testutil

import (
	"runtime"
	"testing"
	"time"

	"github.com/herdguard/herdguard/internal/clock"
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
	wall := clock.Real() // the goroutines it waits for run in real time
	began := wall.Now()
	nap := time.Microsecond
	var sleep clock.Timer
	for i := 0; !cond(); i++ {
		if wall.Now().Sub(began) > limit {
			t.Fatalf("waited %v for %s", limit, what)
		}
		if i < spins {
			runtime.Gosched()
			continue
		}
		if sleep == nil {
			sleep = wall.NewTimer(nap)
		} else {
			sleep.Reset(nap)
		}
		<-sleep.C()
		nap = min(2*nap, time.Millisecond)
	}
	return wall.Now().Sub(began)
}
