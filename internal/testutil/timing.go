package testutil

import (
	"os"
	"testing"
)

// TimingEnv is the variable that turns the timing tests on: make timing
// sets it.
const TimingEnv = "HERDGUARD_TIMING"

// Timing skips a timing test, one that measures wall time (calls a
// second, arrivals per window, latencies), unless TimingEnv is set and
// the race detector is off (race: the test binary's own knowledge of
// it). Such a test holds only with the cores to itself: make test skips
// it, and make timing, which make e2e and CI run, runs it. what says what
// it measures.
func Timing(t testing.TB, race bool, what string) {
	t.Helper()
	switch {
	case race:
		t.Skipf("a timing test (it %s), which the race detector distorts: make timing runs it", what)
	case os.Getenv(TimingEnv) == "":
		t.Skipf("a timing test (it %s): make timing runs it (%s=1)", what, TimingEnv)
	}
}
