package stormlab

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/herdguard/herdguard/internal/testutil"
	"github.com/herdguard/herdguard/policy"
	demov1 "github.com/herdguard/herdguard/proto/herdguard/demo/v1"
)

// The end-to-end comparison runs the real server and the real driver over
// gRPC on 127.0.0.1, scaled down, and asserts the shapes of the published
// results, not exact numbers.

// e2eScale shortens the lost-replies run: windows of 67 ms.
const e2eScale = 1.5

func runStrategies(t *testing.T, sc Scenario, scale float64, names ...string) map[string]Result {
	t.Helper()
	if testing.Short() {
		t.Skip("the end-to-end comparison takes about a minute")
	}
	_, addr := startServer(t, Faults{})
	r := &Runner{Addr: addr}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out := map[string]Result{}
	for _, st := range StrategiesFor(sc) {
		for _, n := range names {
			if st.Name != n {
				continue
			}
			res, err := r.Run(ctx, sc, st, scale)
			if err != nil {
				t.Fatalf("%s: %v", st.Name, err)
			}
			if res.Succeeded+res.Failed != res.Calls || res.FastFails != res.Outcomes["breaker_open"] || res.FastFails > res.Failed {
				t.Errorf("%s: ok %d + failed %d != %d calls, or fast-fails %d do not match outcomes %v",
					st.Name, res.Succeeded, res.Failed, res.Calls, res.FastFails, res.Outcomes)
			}
			// Every call the breaker did not refuse sent its first
			// attempt, unless the overload controller shed it before, or
			// its deadline passed while it waited in the controller's line
			// (such a call ends DeadlineExceeded, as one that timed out in
			// flight does).
			// A hedged call's first attempt may never reach the server's
			// handler: on a busy machine its hedge can be served first, win,
			// and cancel it before the server has read its request (gRPC
			// then never calls the handler). Such a call still reached the
			// server, with a hedge, which the server counts as a retry.
			sent, shed := int64(res.Calls-res.FastFails), int64(res.Outcomes["shed"])
			expired := int64(res.Outcomes["error "+codes.DeadlineExceeded.String()])
			var overtaken int64
			if st.Policy.Hedging.MaxAttempts > 1 {
				overtaken = res.Stats.Retries
			}
			if res.Stats.FirstAttempts > sent || res.Stats.FirstAttempts < sent-shed-expired-overtaken {
				t.Errorf("%s: server saw %d first attempts, want %d (calls not refused by the breaker) less at most the %d shed, the %d that ran out of time and the %d hedges that could have overtaken a first attempt",
					st.Name, res.Stats.FirstAttempts, sent, shed, expired, overtaken)
			}
			out[n] = res
			var series []int64
			for _, w := range res.Stats.Windows {
				series = append(series, w.Retries)
			}
			t.Logf("%s retries per window: %v", n, series)
			t.Logf("%-28s ok %4d  attempts %5d  peak retries %4d (any span %4d)  overloaded %5d ms  last success %5d ms  outcomes %v",
				n, res.Succeeded, res.Stats.Attempts, res.Stats.PeakRetries, res.Stats.PeakRetriesSliding, res.Stats.OverloadedMs, res.Stats.LastSuccessMs, res.Outcomes)
		}
	}
	return out
}

func TestPublishedScenarioShapes(t *testing.T) {
	// At full scale, with 300 calls: a herd of them takes tens of ms to
	// dispatch under the race detector, which must fit in a 100 ms window.
	sc := Published()
	sc.Calls = 300
	rs := runStrategies(t, sc, 1, "fixed wait", "exponential", "exponential + full jitter")
	for name, r := range rs {
		if r.Succeeded*100 < r.Calls*99 {
			t.Errorf("%s: %d of %d calls succeeded, want at least 99%%", name, r.Succeeded, r.Calls)
		}
	}
	// Peaks over any window-long span: a wave of retries straddling two
	// windows of the series still counts whole, whatever the machine's load.
	fixed, exp, full := rs["fixed wait"].Stats.PeakRetriesSliding, rs["exponential"].Stats.PeakRetriesSliding, rs["exponential + full jitter"].Stats.PeakRetriesSliding
	// Backoff without jitter does not break up the herd: the first wave of
	// retries (~30 % of the calls) lands together in both.
	if lo, hi := fixed*2/3, fixed*3/2; exp < lo || exp > hi {
		t.Errorf("exponential peak %d, want about the fixed wait's %d (within [%d, %d])", exp, fixed, lo, hi)
	}
	if full*4 > exp {
		t.Errorf("full jitter peak %d, want at most a quarter of exponential's %d", full, exp)
	}
}

// TestTimingOverloadScenarioShapes counts arrivals in 100 ms windows
// against a server that takes 40 of them: the race detector's jitter
// overshoots such windows now and then, and a client that paces its
// attempts at 90 % of that capacity is the first to show it. make timing
// runs it without -race.
func TestTimingOverloadScenarioShapes(t *testing.T) {
	testutil.Timing(t, raceEnabled, "counts arrivals in 100 ms windows")
	sc := Overload()
	sc.Calls = 500
	sc.Faults.Capacity = 40 // the same share of the herd as 80 of 1000
	rs := runStrategies(t, sc, 1, "exponential", "herdguard defaults", "herdguard + budget", "single attempt", "hedging at p95")
	exp, hg, bud := rs["exponential"], rs["herdguard defaults"], rs["herdguard + budget"]
	// Hedging on ends no worse than hedging off: no fewer calls through, no
	// more attempts, no longer overload. Calls through are compared to one
	// capacity window: a herd that happens to straddle two windows gets up
	// to twice the capacity through, whatever the strategy. Attempts are
	// compared to one per call: the overload controller may hold back some
	// of the herd's first attempts, more or fewer from run to run, for
	// either strategy.
	single, hedged := rs["single attempt"], rs["hedging at p95"]
	if hedged.Succeeded < single.Succeeded-sc.Faults.Capacity || hedged.Stats.Attempts > max(single.Stats.Attempts, int64(sc.Calls))*105/100 ||
		hedged.Stats.OverloadedMs > single.Stats.OverloadedMs*5/4+overloadSlackMS {
		t.Errorf("hedging at p95: ok %d, %d attempts, overloaded %d ms; a single attempt: ok %d, %d attempts, %d ms: want no worse",
			hedged.Succeeded, hedged.Stats.Attempts, hedged.Stats.OverloadedMs, single.Succeeded, single.Stats.Attempts, single.Stats.OverloadedMs)
	}
	if hg.Succeeded < exp.Succeeded {
		t.Errorf("herdguard got %d calls through, exponential %d: want at least as many", hg.Succeeded, exp.Succeeded)
	}
	if hg.Stats.Attempts >= exp.Stats.Attempts {
		t.Errorf("herdguard sent %d attempts, exponential %d: want fewer", hg.Stats.Attempts, exp.Stats.Attempts)
	}
	if hg.Stats.PeakRetriesSliding >= exp.Stats.PeakRetriesSliding {
		t.Errorf("herdguard peak %d, exponential %d: want lower", hg.Stats.PeakRetriesSliding, exp.Stats.PeakRetriesSliding)
	}
	if hg.Stats.OverloadedMs >= exp.Stats.OverloadedMs {
		t.Errorf("server overloaded for %d ms under herdguard, %d under exponential: want sooner recovery", hg.Stats.OverloadedMs, exp.Stats.OverloadedMs)
	}
	// A budget caps retries across calls: at most its ratio of the calls
	// started plus its reserve, and it refuses what it does not send (in a
	// one-shot herd, most retries: see docs/stormlab.md). Not compared with the
	// defaults' attempts: how many of the herd's first attempts go out
	// before the overload controller paces the rest depends on how fast the
	// machine dispatches the herd, in either run.
	b := policy.Budget{}.WithDefaults()
	if limit := int64(b.Ratio*float64(sc.Calls) + b.MinPerSecond*b.Window.Seconds()); bud.Stats.Retries > limit || bud.Stats.Retries >= exp.Stats.Retries {
		t.Errorf("%d retries with a budget (exponential: %d): want at most its %d", bud.Stats.Retries, exp.Stats.Retries, limit)
	}
	if bud.BudgetRefusals == 0 || bud.BudgetRefusals != bud.Outcomes["budget_exhausted"] {
		t.Errorf("budget refusals %d, outcomes %v: want them counted", bud.BudgetRefusals, bud.Outcomes)
	}
	for name, r := range rs {
		if r.AfterRecovery == 0 || r.AfterRecoveryOK != r.AfterRecovery {
			t.Errorf("%s: %d of %d calls after recovery got through, want all", name, r.AfterRecoveryOK, r.AfterRecovery)
		}
	}
}

// TestTimingHerdPaced: through the overload controller, a herd gets every
// call through at about the least number of attempts (every call once,
// plus one retry of each the first window turned away) and the least time,
// and the server is overloaded no longer than by the herd's first attempts
// alone. It runs at full scale (windows of 100 ms) without the race
// detector, which would blur the windows: make timing runs it so.
func TestTimingHerdPaced(t *testing.T) {
	testutil.Timing(t, raceEnabled, "counts arrivals in 100 ms windows")
	sc := Overload()
	sc.Calls = 500
	sc.Faults.Capacity = 40
	rs := runStrategies(t, sc, 1, "herdguard defaults", "single attempt")
	hg, single := rs["herdguard defaults"], rs["single attempt"]
	least := 2*sc.Calls - sc.Faults.Capacity
	leastTime := 1100 + 100*((sc.Calls-sc.Faults.Capacity+sc.Faults.Capacity-1)/sc.Faults.Capacity) // ms
	if hg.Succeeded*100 < sc.Calls*99 || hg.Stats.Attempts*10 > int64(least)*12 {
		t.Errorf("%d of %d calls through in %d attempts: want at least 99 %%, in at most 1.2 × %d", hg.Succeeded, sc.Calls, hg.Stats.Attempts, least)
	}
	if hg.Stats.LastSuccessMs > int64(2*leastTime) {
		t.Errorf("last success at %d ms, want at most twice the least, %d ms", hg.Stats.LastSuccessMs, leastTime)
	}
	if hg.Stats.OverloadedMs > single.Stats.OverloadedMs+overloadSlackMS {
		t.Errorf("server overloaded for %d ms under herdguard, %d with single attempts: want no longer", hg.Stats.OverloadedMs, single.Stats.OverloadedMs)
	}
}

// TestTimingHerdWithDeadlines: the herd with a 30 s deadline on each call,
// as callers nearly always have, gets every call through as the herd
// without deadlines does: at least 99 %, within 1.2 times the least
// attempts and twice the least time. The herd is 500 calls on a server
// that takes 10 per window (C = 20 for 1000): served at what the server
// takes, the last of them go within 6 s. Before, the line told a
// waiter's turn at the spare the rate left above the attempts that came,
// which in a herd are its own retries: it shed 201 of these 500 at once
// (460 of 1000 at C = 20) as unable to make a deadline they would have
// made.
func TestTimingHerdWithDeadlines(t *testing.T) {
	testutil.Timing(t, raceEnabled, "counts arrivals in 100 ms windows")
	sc := HerdDeadline(10)
	sc.Calls = 500
	b, _ := sc.Bound()
	hg := runStrategies(t, sc, 1, "herdguard defaults")["herdguard defaults"]
	if hg.Succeeded*100 < sc.Calls*99 || hg.Stats.Attempts*10 > int64(b.Attempts)*12 {
		t.Errorf("%d of %d calls through in %d attempts (outcomes %v): want at least 99 %%, in at most 1.2 × %d",
			hg.Succeeded, sc.Calls, hg.Stats.Attempts, hg.Outcomes, b.Attempts)
	}
	if last := time.Duration(hg.Stats.LastSuccessMs) * time.Millisecond; last > 2*b.LastSuccess {
		t.Errorf("last success at %v, want at most twice the least, %v", last, b.LastSuccess)
	}
}

// overloadSlackMS is a capacity window at full scale: how far apart two
// runs of the same shape may end.
const overloadSlackMS = 100

// TestTimingSlowAttemptsHedged: with 1 in 100 attempts taking a second,
// hedging at the method's p95 cuts the p99.9 latency many times over for a
// few extra attempts, and sends no hedge it does not need. It measures
// latencies of a few milliseconds, so make timing runs it without -race.
func TestTimingSlowAttemptsHedged(t *testing.T) {
	testutil.Timing(t, raceEnabled, "measures latencies")
	sc := SlowAttempts()
	sc.Calls = 1000
	rs := runStrategies(t, sc, 1, "no hedging", "hedging at p95")
	none, p95 := rs["no hedging"], rs["hedging at p95"]
	extra := float64(p95.Stats.Attempts-int64(p95.Calls)) / float64(p95.Calls)
	if p95.Succeeded != p95.Calls || p95.Percentile(0.999)*10 > none.Percentile(0.999) || extra > 0.05 {
		t.Errorf("hedging at p95: %d of %d calls ok, p99.9 %v (without hedging %v), %.1f %% extra attempts; want all, 10 times lower, at most 5 %%",
			p95.Succeeded, p95.Calls, p95.Percentile(0.999), none.Percentile(0.999), 100*extra)
	}
	if none.Stats.Attempts != int64(none.Calls) {
		t.Errorf("without hedging the server saw %d attempts for %d calls", none.Stats.Attempts, none.Calls)
	}
}

func TestLostRepliesChargeOnceWithAKey(t *testing.T) {
	sc := LostReplies()
	sc.Calls = 300
	rs := runStrategies(t, sc, e2eScale, "herdguard, no idempotency key", "herdguard + idempotency key")
	without, with := rs["herdguard, no idempotency key"], rs["herdguard + idempotency key"]
	if extra := without.Stats.ChargesApplied - int64(without.Calls); extra <= 0 {
		t.Errorf("without a key %d charges for %d calls: the lost replies must show as double charges", without.Stats.ChargesApplied, without.Calls)
	}
	if with.Stats.ChargesApplied != int64(with.Calls) || with.Stats.DuplicatesRefused == 0 {
		t.Errorf("with a key %d charges for %d calls, %d duplicates refused: want exactly one charge per call",
			with.Stats.ChargesApplied, with.Calls, with.Stats.DuplicatesRefused)
	}
}

func TestReportShowsWhatWasCounted(t *testing.T) {
	rs := []Result{{Strategy: "a", Calls: 3, Succeeded: 2, Failed: 1, FastFails: 1, Outcomes: map[string]int{"ok": 2, "breaker_open": 1},
		Stats: fakeStats(100, []int64{0, 7, 2}, 5000, 1200)}}
	var table, hist, svg, outc strings.Builder
	if err := WriteTable(&table, rs); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"breaker fast-fails", "(any span)", "  1  ", "5.0s", "1.2s"} {
		if !strings.Contains(table.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, table.String())
		}
	}
	if strings.Contains(table.String(), "\x1b[") {
		t.Error("the table colours its figures")
	}
	WriteOutcomes(&outc, rs)
	if got := outc.String(); got != "a: breaker_open 1, ok 2\n" {
		t.Errorf("outcomes %q", got)
	}
	WriteHistograms(&hist, rs, 72)
	if !strings.Contains(hist.String(), "| █▃|") || !strings.Contains(hist.String(), "peak 7") {
		t.Errorf("histogram:\n%s", hist.String())
	}
	var empty strings.Builder
	if err := WriteHistograms(&empty, nil, 72); err != nil || empty.Len() != 0 {
		t.Errorf("histograms of no results: %q, %v; want nothing", empty.String(), err)
	}
	WriteSVG(&svg, []SVGSection{{Title: "t<1>", Results: rs}})
	if !strings.HasPrefix(svg.String(), "<svg") || strings.Count(svg.String(), `fill="#3b6ea5"`) != 2 || !strings.Contains(svg.String(), "t&lt;1&gt;") {
		t.Errorf("svg:\n%s", svg.String())
	}
}

func fakeStats(windowMS int64, retries []int64, lastOK, recovered int64) *demov1.GetStatsResponse {
	s := &demov1.GetStatsResponse{WindowMs: windowMS, LastSuccessMs: lastOK, RecoveredMs: recovered, OverloadedMs: 3000}
	for _, r := range retries {
		s.Windows = append(s.Windows, &demov1.Window{Retries: r})
		s.PeakRetries = max(s.PeakRetries, r)
	}
	return s
}

// TestTimingBrownoutsHeal: through each brownout, herdguard's defaults are
// ok again no later than 1 s after sending no retries is, with at least as
// many calls ok, and at least 85 % of the calls ok through the two 2 s
// cuts.
//
//   - The sticky server stays down while it is hit: the controller must
//     never keep it overloaded, also not by growing its own rate back past
//     what the server takes after every restart (a loop that once left
//     about half the runs stuck). Once it answers again at the rate it
//     sustained before, the line must drain oldest first: newest first,
//     the callers who waited through the cut ran out of time in the line
//     while the tokens above the arrivals went to the newest, and calls ok
//     were 81.9 % (96-97 % oldest first). A rate held just under the
//     server's capacity while the line drains must not creep past it (one
//     more answer an interval, learnt as capacity, collapsed the server
//     after the outage now and then), and a few attempts that the line sent
//     at the edge of their deadlines, and that then timed out, must not
//     stop the drain (as overload they cut the rate and turned the line
//     newest first: 92.9 % and 96.5 % in two runs of twelve).
//   - The 1 s outage: the server fails everything, then needs 1 s of calm.
//     Calls ok 99.3-99.4 % (no retries 83.3 %).
//   - The gentle server queues up to 1 s: attempts that waited in the line
//     must not be sent into that queue too late to be answered (they ended
//     at their deadlines up to 2.5 s after the cut), and the line must be
//     served oldest first while answers come that late (newest first, the
//     oldest ran out of time one after another: calls ok fell to those of
//     no retries), from the first answers on (the answers to the calls sent
//     before the overload tell that the server answers late). Calls ok are
//     at least those of no retries, and of retries with decorrelated
//     jitter and no overload control, the best of the retries that land
//     in the server's queue (99.8-99.9 % against 97.9 % at full scale).
//
// It runs at full scale without the race detector; make timing runs it so.
func TestTimingBrownoutsHeal(t *testing.T) {
	testutil.Timing(t, raceEnabled, "counts arrivals in 100 ms windows")
	for _, tc := range []struct {
		name   string
		sc     Scenario
		rivals []string // strategies whose calls ok the defaults must reach, besides no retries
	}{
		{"sticky", SteadyCut(), nil},
		{"outage", SteadyOutage(), nil},
		{"gentle", SteadyGentle(), []string{"exponential + decorrelated"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rs := runStrategies(t, tc.sc, 1, append([]string{"no retries", "herdguard defaults"}, tc.rivals...)...)
			none, hg := rs["no retries"], rs["herdguard defaults"]
			noneAfter, noneNever := none.Steady.Recovery(RecoveredShare)
			hgAfter, hgNever := hg.Steady.Recovery(RecoveredShare)
			t.Logf("no retries: %d ok, recovery %v (never %v); herdguard: %d ok, recovery %v (never %v), outcomes %v",
				none.Succeeded, noneAfter, noneNever, hg.Succeeded, hgAfter, hgNever, hg.Outcomes)
			if noneNever {
				t.Fatal("sending no retries never recovered: the server or the machine is off")
			}
			if hgNever || hgAfter > noneAfter+time.Second {
				t.Errorf("herdguard ok again %v after the cut (never: %v), no retries %v: want no later than 1 s after", hgAfter, hgNever, noneAfter)
			}
			if ok := float64(hg.Succeeded) / float64(hg.Calls); tc.sc.Faults.TriggerCapacity > 0 && ok < 0.85 {
				t.Errorf("herdguard %.1f %% of calls ok through a capacity cut: want at least 85 %%", 100*ok)
			}
			for _, name := range append([]string{"no retries"}, tc.rivals...) {
				r, ok := rs[name]
				if !ok {
					t.Fatalf("no strategy %q in this scenario", name)
				}
				if hg.Succeeded < r.Succeeded {
					t.Errorf("herdguard %d calls ok, %s %d: want at least as many", hg.Succeeded, name, r.Succeeded)
				}
			}
		})
	}
}
