package main

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/herdguard/herdguard/internal/redistest"
	"github.com/herdguard/herdguard/internal/testutil"
)

// TestMain lets the lab start this test binary as its replicas.
func TestMain(m *testing.M) {
	if os.Getenv(replicaEnv) != "" {
		if err := replicaMain(os.Args[1:], os.Stdout); err != nil {
			os.Stderr.WriteString(err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestTimingFleetScenario runs the fleet scenario 3 times at half scale, 8
// replica processes against a real Redis, and checks what the shared
// breaker is for, with margins wider than the lab's full-scale targets
// (docs/benchmarks.md): the fleet sends about what one replica carrying its
// whole load sends, far less than replicas with their own breakers (medians
// of the 3 runs: one run's count of attempts moves by half with the
// machine's load, as a CI run showed); in every run, one
// probe per open period across the fleet; every replica opens within 50 ms
// of the first; with Redis killed, refusals stay instant and the fleet
// follows Redis again within one open period of its return.
func TestTimingFleetScenario(t *testing.T) {
	testutil.Timing(t, raceEnabled, "times processes")
	if _, err := redistest.Find(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%v (CI installs it: .ci/run)", err)
		}
		t.Skip(err)
	}
	var out, progress bytes.Buffer
	o := labOptions{runs: 3, replicas: 8, scale: 2, rate: 160}
	all, err := lab(context.Background(), o, &out, &progress)
	if err != nil {
		t.Fatalf("%v\n%s", err, progress.String())
	}
	t.Log("\n" + out.String())
	dead := func(st strategy) float64 {
		return median(all[st.name], func(r result) float64 { return float64(r.deadAttempts) })
	}
	alone, own, shared := dead(strategies[0]), dead(strategies[1]), dead(strategies[2])
	if shared > alone*3/2 {
		t.Errorf("a fleet sharing one breaker sent %.0f attempts to the dead backend, one replica alone %.0f (medians): want at most 1.5 times",
			shared, alone)
	}
	if own < shared*3/2 {
		t.Errorf("replicas with their own breakers sent %.0f attempts, the shared breaker %.0f (medians): want the shared one to save a third at least",
			own, shared)
	}
	for i := range o.runs {
		checkFleetRun(t, i, o, all[strategies[0].name][i], all[strategies[1].name][i], all[strategies[2].name][i],
			all[strategies[3].name][i], all[strategies[4].name][i])
	}
	if !strings.Contains(out.String(), "attempts at the dead backend") {
		t.Errorf("no table:\n%s", out.String())
	}
}

// checkFleetRun checks what must hold in every run of the fleet scenario.
func checkFleetRun(t *testing.T, run int, o labOptions, alone, own, shared, killedUp, killed result) {
	t.Helper()
	open := time.Duration(float64(openTimeout) / o.scale)
	if shared.periods == 0 || float64(shared.probes) > shared.periods {
		t.Errorf("run %d: shared breaker: %d probes in %.0f open periods, want at most one per period", run+1, shared.probes, shared.periods)
	}
	if shared.neverOpened != 0 || shared.openSpread > 50*time.Millisecond {
		t.Errorf("run %d: shared breaker: %d replicas never opened, the others opened within %v; want all within 50 ms", run+1, shared.neverOpened, shared.openSpread)
	}
	if killed.slowRefusal > 100*time.Millisecond || shared.slowRefusal > 100*time.Millisecond {
		t.Errorf("run %d: slowest refusal %v (Redis killed), %v (shared): a refusal must not wait for Redis", run+1, killed.slowRefusal, shared.slowRefusal)
	}
	for _, r := range []result{alone, own, shared, killedUp, killed} {
		if r.failedUp != 0 || r.slowUp > 200*time.Millisecond {
			t.Errorf("run %d: while the backend was up: %d calls failed, the slowest took %v; want none, and no wait for Redis", run+1, r.failedUp, r.slowUp)
		}
	}
	if killedUp.rejoin < 0 || killedUp.rejoin > open {
		t.Errorf("run %d: Redis killed while the backend was up: the fleet followed it again %v after it returned, want within %v", run+1, killedUp.rejoin, open)
	}
	if killed.rejoin < 0 || killed.rejoin > open {
		t.Errorf("run %d: after Redis returned the fleet followed it again in %v, want within one open period (%v)", run+1, killed.rejoin, open)
	}
}
