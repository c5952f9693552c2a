package main

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/herdguard/herdguard/redisfleet/internal/redistest"
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

// TestTimingFleetScenario runs the fleet scenario once at half scale, 8
// replica processes against a real Redis, and checks what the shared
// breaker is for, with margins wider than the lab's full-scale targets
// (docs/benchmarks.md): the fleet sends about what one replica carrying its
// whole load sends, far less than replicas with their own breakers; one
// probe per open period across the fleet; every replica opens within 50 ms
// of the first; with Redis killed, refusals stay instant and the fleet
// follows Redis again within one open period of its return.
func TestTimingFleetScenario(t *testing.T) {
	if raceEnabled {
		t.Skip("times processes, which the race detector distorts; make test runs it without -race")
	}
	if _, err := redistest.Find(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%v (CI installs it: .ci/run)", err)
		}
		t.Skip(err)
	}
	var out, progress bytes.Buffer
	o := labOptions{runs: 1, replicas: 8, scale: 2, rate: 160}
	all, err := lab(context.Background(), o, &out, &progress)
	if err != nil {
		t.Fatalf("%v\n%s", err, progress.String())
	}
	t.Log("\n" + out.String())
	alone, own, shared, killedUp, killed := all[strategies[0].name][0], all[strategies[1].name][0], all[strategies[2].name][0],
		all[strategies[3].name][0], all[strategies[4].name][0]
	open := time.Duration(float64(openTimeout) / o.scale)

	if shared.deadAttempts > alone.deadAttempts*3/2 {
		t.Errorf("a fleet sharing one breaker sent %d attempts to the dead backend, one replica alone %d: want at most 1.5 times",
			shared.deadAttempts, alone.deadAttempts)
	}
	if own.deadAttempts < shared.deadAttempts*3/2 {
		t.Errorf("replicas with their own breakers sent %d attempts, the shared breaker %d: want the shared one to save a third at least",
			own.deadAttempts, shared.deadAttempts)
	}
	if shared.periods == 0 || float64(shared.probes) > shared.periods {
		t.Errorf("shared breaker: %d probes in %.0f open periods, want at most one per period", shared.probes, shared.periods)
	}
	if shared.neverOpened != 0 || shared.openSpread > 50*time.Millisecond {
		t.Errorf("shared breaker: %d replicas never opened, the others opened within %v; want all within 50 ms", shared.neverOpened, shared.openSpread)
	}
	if killed.slowRefusal > 100*time.Millisecond || shared.slowRefusal > 100*time.Millisecond {
		t.Errorf("slowest refusal %v (Redis killed), %v (shared): a refusal must not wait for Redis", killed.slowRefusal, shared.slowRefusal)
	}
	for _, r := range []result{alone, own, shared, killedUp, killed} {
		if r.failedUp != 0 || r.slowUp > 200*time.Millisecond {
			t.Errorf("while the backend was up: %d calls failed, the slowest took %v; want none, and no wait for Redis", r.failedUp, r.slowUp)
		}
	}
	if killedUp.rejoin < 0 || killedUp.rejoin > open {
		t.Errorf("Redis killed while the backend was up: the fleet followed it again %v after it returned, want within %v", killedUp.rejoin, open)
	}
	if killed.rejoin < 0 || killed.rejoin > open {
		t.Errorf("after Redis returned the fleet followed it again in %v, want within one open period (%v)", killed.rejoin, open)
	}
	if !strings.Contains(out.String(), "attempts at the dead backend") {
		t.Errorf("no table:\n%s", out.String())
	}
}
