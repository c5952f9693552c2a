package pacing

import (
	"cmp"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/herdguard/herdguard/overload"
)

// TestFleets runs the storm lab's scenarios on the simulator, offered by
// 1 to 100 clients, each with its own controller, and pins herdguard's
// calls ok in the median of 5 seeds (a fleet's runs are chaotic: one
// seed's figure moves by several points when a change moves the mean by
// a tenth): where the lab's target is met, at the target; where it is not
// (the C=20 and C=320 herds from 40 clients on, the partial failures from
// 10), at the median the controller gets, less half a point, so that a
// change that loses calls fails; and never below no retries' median (less
// 2 points: the dead server's calls that came back as it did).
// docs/stormlab.md has the same scenarios over gRPC.
func TestFleets(t *testing.T) {
	for _, tt := range []struct {
		scenario string
		n        int
		least    float64 // calls ok, %
	}{
		{"cut", 1, 96}, {"cut", 10, 95}, {"cut", 40, 90}, {"cut", 100, 90},
		{"outage", 1, 99}, {"outage", 10, 98.5}, {"outage", 40, 98}, {"outage", 100, 96},
		{"gentle", 1, 95.8}, {"gentle", 10, 95.8}, {"gentle", 40, 95.8}, {"gentle", 100, 95.8}, // retries alone less 0.5
		{"herd20", 1, 100}, {"herd20", 10, 100}, {"herd20", 40, 88}, {"herd20", 100, 91.4}, // target 99.5
		{"herd80", 1, 100}, {"herd80", 10, 100}, {"herd80", 40, 100}, {"herd80", 100, 99.5},
		{"herd320", 1, 100}, {"herd320", 10, 100}, {"herd320", 40, 100}, {"herd320", 100, 92.3}, // target 99.5
		{"p0.5", 1, 86.6}, {"p0.5", 40, 84.9}, {"p0.5", 100, 83.2}, // retries alone 87.6
		{"p0.67", 1, 68.3}, {"p0.67", 40, 64.5}, {"p0.67", 100, 60.4}, // retries alone 69.3
		{"p0.8", 1, 47.9}, {"p0.8", 10, 42.1}, {"p0.8", 40, 36.7}, {"p0.8", 100, 30.9}, // retries alone 48.9
		{"dead", 1, 58.5}, {"dead", 10, 58}, {"dead", 40, 76}, {"dead", 100, 71.5}, // no retries 60
	} {
		t.Run(fmt.Sprintf("%s/N=%d", tt.scenario, tt.n), func(t *testing.T) {
			t.Parallel() // each run has a simulator of its own
			sc := scenarioNamed(tt.scenario)
			hg, got := medianRun(sc, tt.n, "herdguard")
			_, floor := medianRun(sc, tt.n, "none")
			if got < tt.least {
				t.Errorf("%d clients: %.1f %% of calls ok in the median of 5 seeds, want at least %.1f (%v)", tt.n, got, tt.least, hg)
			}
			if got < floor-2 {
				t.Errorf("%d clients: %.1f %% of calls ok, below no retries' %.1f", tt.n, got, floor)
			}
		})
	}
}

// TestFleetDrainsWithoutCollapse: after the 1 s outage, 100 clients drain
// the lines the outage left while the sticky server takes 80 attempts a
// window against the 60 a window they are sent. Each sends less than one
// attempt a window, so the windows' sums vary by several attempts however
// the rates are set; a fleet whose rates kept the highest of short samples
// of what comes drains near the capacity, and one window over it sends
// the server down again for seconds. Over 20 seeds, at most 2 runs fall
// below 95 % of calls ok.
func TestFleetDrainsWithoutCollapse(t *testing.T) {
	sc := scenarioNamed("outage")
	var low []string
	for seed := range uint64(20) {
		r := runStrategy(sc, 100, "herdguard", seed+1)
		if p := pct(r); p < 95 {
			low = append(low, fmt.Sprintf("seed %d: %.1f %%, recovery %v", seed+1, p, r.recovery))
		}
	}
	if len(low) > 2 {
		t.Errorf("%d of 20 runs below 95 %% of calls ok, want 2 at most: %v", len(low), low)
	}
}

// TestFleetsRecover: after the sticky cut and the outage, offered by 40
// and 100 clients, every 250 ms of calls ends at least 95 % ok within
// 1.5 s of the trigger's end, in the median of 5 seeds (the sticky server
// itself needs a calm second: no retries recovers in 1 s). A fleet's
// clients find the server back each at its next probe, up to a second
// apart; the calls whose deadlines come before that probe are shed as
// soon as that is known, not held to their deadlines.
func TestFleetsRecover(t *testing.T) {
	for _, name := range []string{"cut", "outage"} {
		sc := scenarioNamed(name)
		for _, n := range []int{40, 100} {
			var recs []time.Duration
			for seed := range uint64(5) {
				recs = append(recs, runStrategy(sc, n, "herdguard", seed+1).recovery)
			}
			slices.Sort(recs)
			if m := recs[len(recs)/2]; m < 0 || m > 1500*time.Millisecond {
				t.Errorf("%s, %d clients: recovery %v in the median of 5 seeds (%v), want at most 1.5 s", sc.name, n, m, recs)
			}
		}
	}
}

// TestFleetsFailFastWhenDead: one client fails the calls started once
// the dead server had refused everything for 1 s in a median of at most
// 50 ms, and sends it at most 25 attempts a second while dead. A fleet's
// clients each see too few refusals to judge it down within its 4 s
// death: they hold their calls to their deadlines (and so get more calls
// through at its return than no retries), and send it less than no
// retries would.
func TestFleetsFailFastWhenDead(t *testing.T) {
	sc := scenarioNamed("dead")
	dead := sc.srv().(*flaky)
	for _, n := range []int{1, 10, 40, 100} {
		f := newFleet(1, n, sc.srv(), sc.l, &overload.Settings{}).run()
		var took []time.Duration
		for _, c := range f.calls {
			if !c.ok && c.start >= dead.deadFrom+time.Second && c.start < dead.deadFrom+dead.deadFor {
				took = append(took, c.end-c.start)
			}
		}
		slices.Sort(took)
		attempts := 0
		for tenth := dead.deadFrom / (10 * time.Millisecond); tenth < (dead.deadFrom+dead.deadFor)/(10*time.Millisecond); tenth++ {
			if int(tenth) < len(f.perTenth) {
				attempts += f.perTenth[tenth]
			}
		}
		perSecond := float64(attempts) / dead.deadFor.Seconds()
		if n == 1 {
			if p50 := took[len(took)/2]; p50 > 50*time.Millisecond {
				t.Errorf("one client: calls started 1 s into the death failed in %v (median), want at most 50 ms", p50)
			}
			if perSecond > 25 {
				t.Errorf("one client: %.0f attempts/s reached the dead server, want at most 25", perSecond)
			}
			continue
		}
		if perSecond > sc.l.rate {
			t.Errorf("%d clients: %.0f attempts/s reached the dead server, more than no retries' %v", n, perSecond, sc.l.rate)
		}
	}
}

func pct(r result) float64 { return 100 * float64(r.ok) / float64(r.calls) }

// medianRun runs sc offered by n clients with strategy st on seeds 1 to 5,
// and returns the run whose calls ok are the median, and that figure.
func medianRun(sc scenario, n int, st string) (result, float64) {
	runs := make([]result, 5)
	for i := range runs {
		runs[i] = runStrategy(sc, n, st, uint64(i+1))
	}
	slices.SortFunc(runs, func(a, b result) int { return cmp.Compare(pct(a), pct(b)) })
	return runs[2], pct(runs[2])
}

// scenarioNamed is the scenario of that name.
func scenarioNamed(name string) scenario {
	for _, sc := range scenarios() {
		if sc.name == name {
			return sc
		}
	}
	panic("no scenario " + name)
}
