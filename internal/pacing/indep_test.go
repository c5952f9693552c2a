package pacing

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/herdguard/herdguard/overload"

	"github.com/herdguard/herdguard/internal/testutil"
)

// A paced server whose failures are independent (30 % of its attempts
// fail, whatever the load) gets its rate back and is no longer paced.
// The refusals its share of independent failures explains are not load,
// and a cut counts the attempts the server took, not its answers alone.
//
// A fresh client knows no such share: it learns it while paced, from the
// intervals in which the server took more than ever before in the episode
// (refusals that do not follow the load).
//
// The client that knew the server is asked it for ten random sequences.
func TestIndependentFailuresEndThePacing(t *testing.T) {
	for _, tc := range []struct {
		name  string
		calm  int // intervals of calm before the pacing, the server failing 30 %
		seeds int
	}{{"after 2 s of calm", 20, 10}, {"a fresh client", 0, 1}} {
		t.Run(tc.name, func(t *testing.T) {
			for seed := range uint64(tc.seeds) {
				independentFailuresEndThePacing(t, tc.calm, 3+seed)
			}
		})
	}
}

func independentFailuresEndThePacing(t *testing.T, calm int, seed uint64) {
	c, clk := newController(t, overload.Settings{})
	rng := rand.New(rand.NewPCG(seed, 5))
	for range calm {
		report(c, Answered, 42)
		report(c, Overloaded, 18)
		clk.Advance(overload.DefaultInterval)
	}
	if c.Pacing() {
		t.Fatal("pacing on independent failures")
	}
	startCollapsed(t, c, clk) // as a real overload, or chance, would

	r := drive(t, c, clk, func(time.Time) Outcome {
		if rng.Float64() < 0.3 {
			return Overloaded
		}
		return Answered
	})
	if r.ended < 0 {
		st := c.State()
		t.Fatalf("seed %d: still pacing after 10 s: rate %.0f/s for 600 arrivals/s, %d waiting, %d sent", seed, st.Rate, st.Waiting, r.sent)
	}
	t.Logf("seed %d: pacing ended after %v; %d of %d sent, %d not", seed, r.ended, r.sent, r.sent+r.lost, r.lost)
	if r.lost > 0 {
		t.Errorf("%d attempts never sent", r.lost)
	}
}

// A server that fails a share of its attempts whatever the load, more
// than FailureRatio of them (dead replicas behind a proxy), starts the
// pacing of a fresh client by chance or at once; a confirmation then shows
// that it refuses a batch at a low rate as much as the load that began the
// episode, and the pacing ends, for good: the share is learnt as the
// server's own. Over 10 s of 600 attempts a second, 5 random sequences at
// each share: one episode, that ends within 2.5 s (a probe must be
// answered first: at 90 %, one in 10 is), every attempt sent, and calm at
// the end.
func TestIndependentFailuresAboveTheRatioEndThePacing(t *testing.T) {
	for _, share := range []float64{0.5, 0.67, 0.8, 0.9} {
		for seed := range uint64(5) {
			c, clk := newController(t, overload.Settings{})
			rng := rand.New(rand.NewPCG(seed, 17))
			paced := 0
			r := driveEach(t, c, clk, func(time.Time) Outcome {
				if rng.Float64() < share {
					return Overloaded
				}
				return Answered
			}, func() {
				if c.Pacing() {
					paced++
				}
			})
			st := c.State()
			if pacedFor := time.Duration(paced) * 10 * time.Millisecond; pacedFor > 2500*time.Millisecond || st.Pacing || st.Episodes > 1 || r.lost > 0 {
				t.Errorf("%.0f %% independent failures, seed %d: paced for %v of 10 s (pacing at the end: %v, %d episodes); %d attempts never sent",
					100*share, seed, pacedFor, st.Pacing, st.Episodes, r.lost)
			}
		}
	}
}

// A paced server whose capacity was cut (it takes 50 attempts per window
// of its own and refuses the rest, 60 coming) refuses more as the rate
// rises past 50, and none below: what it refuses is load, not a share of
// independent failures to be left alone (less than a tenth learnt as
// that). The rate follows what it takes: in the last 5 s a fresh client
// has it take at least 70 % of its capacity (a capacity shown by a
// handful of attempts must not hold the rate under it), and one that knew
// the server before at least 75 % in each of 8 runs (the echo of a cut's
// refusals must not cut the rate twice). The share learnt shows after the
// 10 s: an interval that refuses 27 of 50 collapses the server, as only a
// share of 8 % or less lets it.
func TestCapacityCutIsNotIndependentFailures(t *testing.T) {
	for _, tc := range []struct {
		name  string
		fresh bool
		runs  int
		least int // of the 2500 the server can take in the last 5 s
	}{{"after 3 s of calm", false, 8, 1875}, {"a fresh client", true, 2, 1750}} {
		t.Run(tc.name, func(t *testing.T) {
			for run := range tc.runs {
				capacityCut(t, tc.fresh, run, tc.least)
			}
		})
	}
}

func capacityCut(t *testing.T, fresh bool, run, least int) {
	var (
		c   *Controller
		clk *testutil.Clock
	)
	if fresh {
		c, clk = newController(t, overload.Settings{})
		startCollapsed(t, c, clk)
	} else {
		c, clk = calmThenFail(t, 60)
	}
	var (
		window time.Time
		taken  int
	)
	r := drive(t, c, clk, func(now time.Time) Outcome {
		if w := now.Truncate(overload.DefaultInterval); w != window {
			window, taken = w, 0
		}
		if taken >= 50 {
			return Overloaded
		}
		taken++
		return Answered
	})
	if took := r.sentLate - r.refusedLate; took < least {
		t.Errorf("run %d: in the last 5 s the server took %d attempts, refused %d: want at least %d of its 2500", run, took, r.refusedLate, least)
	}
	t.Logf("run %d: %d sent, %d refused in the last 5 s of %d sent (took %d); %d not sent", run, r.sent, r.refusedLate, r.sentLate, r.sentLate-r.refusedLate, r.lost)
	clk.Advance(overload.DefaultInterval) // the answers to the last attempts sent land in this interval
	// Some runs end with the server collapsed. An answer to an attempt sent
	// before the episode (a long call of the calm before it) ends a
	// collapse unconfirmed and teaches nothing of the share: a
	// confirmation would judge the share afresh.
	c.AnsweredSentCalm()
	clk.Advance(overload.DefaultInterval)
	if !collapses(t, c, clk, 27, 50) {
		t.Errorf("run %d: 27 of 50 refused did not collapse the server: a share of more than 8 %% of independent failures learnt from a capacity cut", run)
	}
}

// TestCrossingACutTeachesNoIndependentFailures: while paced, the refusals
// of an interval that took clearly more than any before it are the
// server's share of independent failures, unless the last such interval
// before it had 10 answers or more and was refused nothing: then they are
// load, the rate passing a cut. A server that fails from the start still
// teaches its share, and an interval that takes only a little more than
// the most before it (answers that crossed an interval's end) teaches
// nothing.
//
// The share learnt shows in what collapses the server next: overload is
// FailureRatio of the attempts that share leaves, so that an interval
// that refuses (1+b)/2 of 40 attempts collapses the server if and only if
// the share is b or less. Each bound is probed after the intervals, on a
// controller of its own: low by an interval that must not collapse the
// server (the share is above low; unprobed at 0), high by one that must.
func TestCrossingACutTeachesNoIndependentFailures(t *testing.T) {
	for _, tc := range []struct {
		name      string
		intervals [][2]int // answered, refused
		low, high float64  // the share learnt: above low, at most high
	}{
		{"a cut crossed after a clean interval", [][2]int{{3, 0}, {14, 0}, {70, 12}}, 0, 0},
		{"then a little more, refused", [][2]int{{3, 0}, {14, 0}, {50, 12}, {53, 10}, {54, 9}}, 0, 0},
		{"independent failures from the start", [][2]int{{3, 1}, {14, 6}, {70, 30}}, 0.25, 0.35},
		{"a clean interval too small to tell", [][2]int{{3, 0}, {9, 0}, {40, 12}}, 0.15, 0.25},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, probe := range []struct {
				share    float64
				collapse bool
			}{{tc.low, false}, {tc.high, true}} {
				if !probe.collapse && probe.share == 0 {
					continue // nothing to probe: no share is below 0
				}
				c, clk := newController(t, overload.Settings{})
				startCollapsed(t, c, clk)
				for _, iv := range tc.intervals {
					report(c, Answered, iv[0])
					report(c, Overloaded, iv[1])
					clk.Advance(overload.DefaultInterval)
				}
				refusals := int(math.Round((1 + probe.share) / 2 * 40))
				if float64(refusals) != (1+probe.share)/2*40 {
					t.Fatalf("a share of %v is not probed by a whole number of 40 refused", probe.share)
				}
				switch got := collapses(t, c, clk, refusals, 40); {
				case got && !probe.collapse:
					t.Errorf("%d of 40 refused collapsed the server: the share learnt is %.2f or less", refusals, probe.share)
				case !got && probe.collapse:
					t.Errorf("%d of 40 refused did not collapse the server: the share learnt is more than %.2f", refusals, probe.share)
				}
			}
		})
	}
}
