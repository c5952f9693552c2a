package pacing

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/herdguard/herdguard/overload"
)

// A herd over a server that takes 20 per interval and then stays down:
// probes newest first, the first at once, four an interval early in the
// episode and then one per interval; once one is answered and the
// confirmation's batch too, 90 % of the measured capacity.
func TestHerdSequence(t *testing.T) {
	c, clk := newController(t, overload.Settings{})
	report(c, Answered, 20)
	report(c, Overloaded, 980)
	if !c.State().Pacing {
		t.Fatal("not pacing after the herd")
	}
	ctx := context.Background()
	probe := func() { // a probe that goes at once, refused
		t.Helper()
		if d, err := c.Acquire(ctx); d != 0 || err != nil {
			t.Fatalf("probe: held %v, %v; want it sent at once", d, err)
		}
		c.Done(Overloaded)
	}
	probe()
	out := make(chan grant, 10)
	for id := range 2 {
		acquireAsync(ctx, c, id, out)
		waitLine(t, c, id+1)
	}
	// Early in the episode: a probe every 25ms, newest first.
	for _, want := range []int{1, 0} {
		clk.Advance(overload.DefaultInterval / 4)
		if g := <-out; g.id != want || g.err != nil {
			t.Fatalf("early probe went to %d (%v), want %d", g.id, g.err, want)
		}
		c.Done(Overloaded) // the server is still down
	}
	clk.Advance(firstProbeIntervals * overload.DefaultInterval)
	if got := rateOf(c); got != 1 {
		t.Fatalf("rate later in the episode = %v per interval, want 1 (a probe)", got)
	}
	probe() // the token that came meanwhile
	for id := 2; id < 5; id++ {
		acquireAsync(ctx, c, id, out)
		waitLine(t, c, id-1)
	}
	clk.Advance(overload.DefaultInterval)
	if g := <-out; g.id != 4 || g.err != nil {
		t.Fatalf("next probe went to %d (%v), want the newest, 4", g.id, g.err)
	}
	c.Done(Overloaded)
	clk.Advance(overload.DefaultInterval)
	if g := <-out; g.id != 3 {
		t.Fatalf("next probe went to %d, want 3", g.id)
	}
	c.Done(Answered)              // it recovered,
	confirmLoad(t, c, confirmMax) // and takes the confirmation's batch (the herd answered 20): restart at 90 % of 20
	if got := rateOf(c); got != 18 {
		t.Fatalf("rate after recovery = %v per interval, want 18", got)
	}
	clk.Advance(overload.DefaultInterval / 10)
	if g := <-out; g.id != 2 || g.err != nil {
		t.Fatalf("last waiter: %+v", g)
	}
	if st := c.State(); st.Delayed != 5 || st.Shed != 0 {
		t.Errorf("delayed %d shed %d, want 5 and 0", st.Delayed, st.Shed)
	}
}

// A restart returns to the throughput the server sustained before the
// overload (an outage that ended looks the same as a cut that persists
// until the rate is tried). If the server collapses again under that rate,
// the rate was too much: the next restart is at Headroom of what was sent,
// and only after a Hold does the rate go back toward what the server
// sustained before. Past that it grows by a quarter per Hold, until it and
// the bucket's burst are a quarter above the attempts that come, and only
// while attempts wait.
func TestRestartsAndGrowth(t *testing.T) {
	c, clk := calmThenFail(t, 60)
	clk.Advance(overload.DefaultInterval) // collapsed
	if got := rateOf(c); got != firstProbes {
		t.Fatalf("collapsed rate = %v, want %v early in the episode", got, firstProbes)
	}
	answerProbe(t, c, confirmMin)
	if got := rateOf(c); got != 60 {
		t.Fatalf("first restart at %v per interval, want the sustained 60", got)
	}
	// 60 sent; the server takes 30 and refuses the rest: collapsed again.
	setCounts(c, 60, 60)
	report(c, Answered, 29) // and the answer that restarted it
	report(c, Overloaded, 30)
	clk.Advance(overload.DefaultInterval)
	if got := rateOf(c); got != 1 {
		t.Fatalf("rate after a refused interval = %v, want 1", got)
	}
	// Two probes are refused: the server stays down 200ms more.
	for range 2 {
		if _, err := c.Acquire(context.Background()); err != nil {
			t.Fatal(err)
		}
		c.Done(Overloaded)
		clk.Advance(overload.DefaultInterval)
	}
	answerProbe(t, c, confirmMax) // the collapse answered 30
	if got := rateOf(c); got != 54 {
		t.Fatalf("second restart at %v, want 90 %% of the 60 sent", got)
	}
	// Demand above the rate (70 arrive, attempts wait), answers, no
	// failures: held until 500ms after the setback (300ms after the
	// restart), back to the sustained 60, then a quarter more per 500ms,
	// until the rate and the bucket's burst (a tenth of it) are a quarter
	// above the 70 that arrive.
	top := 1.25 * 70 / 1.1
	for i, want := range []float64{54, 54, 60, 60, 60, 60, 60, 75, 75, 75, 75, 75, top, top, top, top} {
		setCounts(c, 70, 0)
		markWaited(c)
		c.Done(Answered)
		clk.Advance(overload.DefaultInterval)
		if got := rateOf(c); math.Abs(got-want) > 1e-9 {
			t.Fatalf("interval %d: rate = %v, want %v", i, got, want)
		}
	}
}

// A rate grown past what the server sustained before, then refused, is
// not tried again: what the server is known to take comes down below it,
// however many answers it took on the way (the loop that would otherwise
// collapse a sticky server again after every restart). Each such setback
// doubles the hold before the next growth.
func TestSetbacksLowerWhatIsKnown(t *testing.T) {
	c, clk := calmThenFail(t, 68)
	clk.Advance(overload.DefaultInterval)
	answerProbe(t, c, confirmMin) // restart at 68
	// Demand of 80 an interval: after the hold the rate grows to 85, and
	// the server answers all of it.
	for i := range 5 {
		setCounts(c, 80, 68)
		markWaited(c)
		answers := 68
		if i == 0 {
			answers-- // the probe's answer was the first interval's 68th
		}
		report(c, Answered, answers)
		clk.Advance(overload.DefaultInterval)
	}
	if got := rateOf(c); got != 85 {
		t.Fatalf("rate = %v, want grown to 85", got)
	}
	setCounts(c, 80, 85)
	report(c, Answered, 85)
	clk.Advance(overload.DefaultInterval)
	// 85 sent, and the server refuses nearly all.
	setCounts(c, 80, 85)
	report(c, Answered, 9)
	report(c, Overloaded, 76)
	clk.Advance(overload.DefaultInterval)
	answerProbe(t, c, confirmMax) // the collapse answered 9 of 85
	if got := rateOf(c); got != 76.5 {
		t.Fatalf("restart after the refused 85 at %v, want 76.5", got)
	}
	first := holdLeft(c, clk.Now())
	if first != overload.DefaultHold {
		t.Fatalf("hold after one setback = %v, want %v", first, overload.DefaultHold)
	}
	// Refused again at 76.5: the next restart holds twice as long.
	setCounts(c, 80, 77)
	report(c, Overloaded, 40)
	clk.Advance(overload.DefaultInterval)
	answerProbe(t, c, confirmMax) // the collapse answered none of 77 sent
	second := holdLeft(c, clk.Now())
	if got := rateOf(c); got != 0.9*77 {
		t.Fatalf("restart after the refused 77 at %v, want %v", got, 0.9*77)
	}
	if second != 2*overload.DefaultHold {
		t.Fatalf("hold after two setbacks = %v, want %v", second, 2*overload.DefaultHold)
	}
}

// A herd on a fresh client: nothing was sustained before, the first
// interval measured a capacity of 20; the rate restarts at 90 % of it and
// holds there for a Hold, waiting or not. Then, with attempts waiting and
// none refused, the capacity is tried a quarter higher, as far as a
// quarter above the attempts that come (18: 20.45); answers that land late
// (21 for 18 sent) are no proof of more. A refusal there shows the capacity
// again (18 taken: 16.2), and the next try is a Hold away. Before the try,
// a capacity shown too low held the rate under it for good: answers above
// the rate are not learnt, and with attempts waiting the pacing never
// ended.
func TestMeasuredCapacityBounds(t *testing.T) {
	c, clk := newController(t, overload.Settings{})
	report(c, Answered, 20)
	report(c, Overloaded, 980)
	clk.Advance(overload.DefaultInterval)
	answerProbe(t, c, confirmMax) // the herd answered 20
	restart := clk.Now()
	if got := rateOf(c); got != 18 {
		t.Fatalf("restart at %v, want 18", got)
	}
	const top = 1.25 * 18 / 1.1
	// holds reports intervals of 18 answers for 18 sent until the rate
	// leaves 18, and returns when that was; every other interval without
	// attempts waiting, unless always.
	holds := func(want float64, always bool) time.Time {
		t.Helper()
		for i := range 20 {
			if always || i%2 == 0 {
				markWaited(c)
			}
			report(c, Answered, 18)
			setCounts(c, 18, 18)
			clk.Advance(overload.DefaultInterval)
			if got := rateOf(c); got != want {
				if got < want || got > top+1e-9 {
					t.Fatalf("interval %d: rate = %v, want %v or a try up to %.2f", i, got, want, top)
				}
				return clk.Now()
			}
		}
		t.Fatalf("rate held at %v for 2 s of attempts waiting", want)
		return time.Time{}
	}
	if tried := holds(18, false); tried.Sub(restart) < overload.DefaultHold {
		t.Fatalf("capacity tried %v after the restart, want a Hold (%v) at least", tried.Sub(restart), overload.DefaultHold)
	}
	if got := rateOf(c); math.Abs(got-top) > 1e-9 {
		t.Fatalf("tried at %v, want a quarter above the 18 that come (%.2f)", got, top)
	}
	for i := range 5 { // answers that land late
		markWaited(c)
		report(c, Answered, 21)
		setCounts(c, 18, 18)
		clk.Advance(overload.DefaultInterval)
		if got := rateOf(c); math.Abs(got-top) > 1e-9 {
			t.Fatalf("interval %d (21 answers for 18 sent): rate = %v, want it held at %.2f", i, got, top)
		}
	}
	markWaited(c)
	report(c, Answered, 18)
	report(c, Overloaded, 3)
	setCounts(c, 21, 21)
	clk.Advance(overload.DefaultInterval)
	refusal := clk.Now()
	if got := rateOf(c); math.Abs(got-16.2) > 1e-9 {
		t.Fatalf("after 3 refused beside 18 taken: rate = %v, want 16.2", got)
	}
	if tried := holds(16.2, true); tried.Sub(refusal) < overload.DefaultHold {
		t.Fatalf("capacity tried again %v after the refusal, want a Hold (%v) at least", tried.Sub(refusal), overload.DefaultHold)
	}
}

// With nothing known (no throughput before, no capacity measured) a
// restart is a slow start.
func TestRestartWithNothingKnown(t *testing.T) {
	c, clk := newController(t, overload.Settings{})
	report(c, Overloaded, 20)
	clk.Advance(overload.DefaultInterval)
	answerProbe(t, c, confirmMin)
	if got := rateOf(c); got != 2 {
		t.Fatalf("restart = %v per interval, want a slow start at 2", got)
	}
}

func TestPacingEnds(t *testing.T) {
	c, clk := calmThenFail(t, 60)
	clk.Advance(overload.DefaultInterval)
	answerProbe(t, c, confirmMin)
	for i := range overload.DefaultCalm {
		if !c.State().Pacing {
			t.Fatalf("pacing ended after %d calm intervals, want %d", i, overload.DefaultCalm)
		}
		report(c, Answered, 10)
		clk.Advance(overload.DefaultInterval)
	}
	if c.State().Pacing {
		t.Fatal("still pacing after the calm intervals")
	}
	if d, err := c.Acquire(context.Background()); d != 0 || err != nil {
		t.Fatalf("calm Acquire = %v, %v", d, err)
	}
}

// Answers during a slow start (nothing known before) are not taken as what
// the server sustains: the rate keeps growing, and nobody is shed on a
// guess of the wait.
func TestSlowStartLearnsNothing(t *testing.T) {
	c, clk := newController(t, overload.Settings{})
	report(c, Overloaded, 20)
	clk.Advance(overload.DefaultInterval)
	answerProbe(t, c, confirmMin) // restart: a slow start at 2, then one more per answer
	report(c, Answered, 9)
	clk.Advance(overload.DefaultInterval)
	known, free := knownOf(c)
	if known != 0 || !math.IsInf(free, 1) {
		t.Errorf("after a slow start's interval: known %v, free %v; want 0 and +Inf", known, free)
	}
	if got := rateOf(c); got < 10 {
		t.Errorf("rate %v after 10 answers from 2, want it grown by one per answer", got)
	}
}

// Refusals below the ratio bring the rate down to Headroom of what the
// server took, and stop its growth; none of it is probing.
func TestFewRefusalsBringTheRateDown(t *testing.T) {
	c, clk := calmThenFail(t, 60)
	clk.Advance(overload.DefaultInterval)
	answerProbe(t, c, confirmMin) // restart at 60
	markWaited(c)
	report(c, Answered, 49) // and the probe's answer: 50
	report(c, Overloaded, 10)
	clk.Advance(overload.DefaultInterval)
	if got := rateOf(c); got != 45 {
		t.Fatalf("rate = %v, want 90 %% of the 50 taken", got)
	}
	// Probing would have set the rate to a probe's (1 or firstProbes per
	// interval), not 45.
	if c.State().Waiting != 0 {
		t.Fatal("few refusals started probing")
	}
}

// An interval whose answers outnumber its rate (tokens the bucket kept
// from the interval before, answers of attempts sent in it) raises what
// the server is known to take no higher than the rate: a rate held just
// under a capacity would otherwise creep past it, one answer an interval.
func TestLearningStopsAtTheRate(t *testing.T) {
	c, clk := calmThenFail(t, 60)
	clk.Advance(overload.DefaultInterval)
	answerProbe(t, c, confirmMin) // restart at 60
	// 60 arrive and wait: after the hold the rate grows to where it and
	// the bucket's burst are a quarter above them.
	top := 1.25 * 60 / 1.1
	for range 12 {
		setCounts(c, 60, 0)
		markWaited(c)
		c.Done(Answered)
		clk.Advance(overload.DefaultInterval)
	}
	if got := rateOf(c); math.Abs(got-top) > 1e-9 {
		t.Fatalf("rate = %v, want grown to %v", got, top)
	}
	for i := range 10 {
		setCounts(c, 60, 75) // 75 let through at 68.2, the burst included
		markWaited(c)
		report(c, Answered, 75)
		clk.Advance(overload.DefaultInterval)
		rate := rateOf(c) // closes the interval
		known, _ := knownOf(c)
		if known > top+1e-9 || rate > top+1e-9 {
			t.Fatalf("interval %d: known %v, rate %v: want neither past the rate of %v", i, known, rate, top)
		}
	}
}

// Past what is known, the rate grows toward a quarter above the attempts
// that come counted as their mean since its last step, not as the last
// interval's count: the rate only rises, and a step to each high of that
// count would take it, with the bucket's burst, well past the arrivals.
func TestGrowthFollowsTheMeanOfTheArrivals(t *testing.T) {
	c, clk := calmThenFail(t, 60)
	clk.Advance(overload.DefaultInterval)
	answerProbe(t, c, confirmMin) // restart at 60
	top := 1.25 * 60 / 1.1
	// 57, 63, 60, 58, 62, 64, 56, ...: a mean of 60, highs of 64.
	noise := []int{-3, 3, 0, -2, 2, 4, -4}
	for i := range 80 {
		in := 60 + noise[i%len(noise)]
		setCounts(c, in, int(top))
		markWaited(c)
		report(c, Answered, int(top))
		clk.Advance(overload.DefaultInterval)
		// The means of this sequence over its holds are 60 and 60.5.
		if got := rateOf(c); got > top+1.2 {
			t.Fatalf("interval %d (%d came): rate = %.2f, want no more than %.2f: a quarter above the 60 that come on average (%.2f), with its burst, and a hold's noise", i, in, got, top+1.2, top)
		}
	}
	// And it does grow there: the line drains on the tokens above the 60.
	if got := rateOf(c); got < top-1 {
		t.Fatalf("rate = %.2f, want grown to about %.2f", got, top)
	}
}
