package pacing

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/herdguard/herdguard/overload"

	"github.com/herdguard/herdguard/internal/testutil"
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
	// 60 come, as many go as the rate lets; the server takes a third and
	// refuses the rest: collapsed again.
	sent := 1 + demand{in: 60}.run(t, c, clk, func(i int) Outcome { // and the probe, answered
		if i%3 == 2 {
			return Answered
		}
		return Overloaded
	})
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
	answerProbe(t, c, confirmMax) // the collapse answered more than 8
	again := 0.9 * float64(sent)
	if got := rateOf(c); math.Abs(got-again) > 1e-9 || again >= 60 {
		t.Fatalf("second restart at %v, want 90 %% of the %d sent, below the sustained 60", got, sent)
	}
	// Demand above the rate (70 arrive, the probe first, and attempts
	// wait: 10 come at once), the server answering each one sent: held
	// until 500ms after the setback (300ms after the restart), back to the
	// sustained 60, then a quarter more per 500ms, until the rate and the
	// bucket's burst (a tenth of it) are a quarter above the 70 that
	// arrive.
	top := 1.25 * 70 / 1.1
	for i, want := range []float64{again, again, 60, 60, 60, 60, 60, 75, 75, 75, 75, 75, top, top, top, top} {
		demand{in: besidesProbe(70, i), burst: 10}.run(t, c, clk, answered)
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
	answerProbe(t, c, confirmMin)
	if got := rateOf(c); got != 68 {
		t.Fatalf("restart at %v, want the sustained 68", got)
	}
	// Demand of 80 an interval (the probe the first), the server answering
	// each one sent: after the hold the rate grows to 85, and the server
	// answers all it is sent there.
	for i := range 5 {
		demand{in: besidesProbe(80, i)}.run(t, c, clk, answered)
	}
	if got := rateOf(c); got != 85 {
		t.Fatalf("rate = %v, want grown to 85", got)
	}
	if took := (demand{in: 80}).run(t, c, clk, answered); float64(took) <= 0.9*80 {
		t.Fatalf("the server took %d at 85: want more than 90 %% of the 80 that come", took)
	}
	// The 80 sent, and the server refuses all but 9.
	sent := demand{in: 80}.run(t, c, clk, func(i int) Outcome {
		if i < 9 {
			return Answered
		}
		return Overloaded
	})
	setback := clk.Now() // the interval closes now
	answerProbe(t, c, confirmMax)
	if got, want := rateOf(c), 0.9*float64(sent); math.Abs(got-want) > 1e-9 {
		t.Fatalf("restart after the refused %d at %v, want %v: 90 %% of them, below the answers it took", sent, got, want)
	}
	// Held a Hold after one setback, attempts waiting, then grown.
	heldUntil(t, c, clk, demand{in: 80}, setback.Add(overload.DefaultHold))
	// Refused again, every attempt sent: the next restart holds twice as
	// long.
	sent = demand{in: 80}.run(t, c, clk, refused)
	setback = clk.Now()
	answerProbe(t, c, confirmMin) // the collapse answered none
	if got, want := rateOf(c), 0.9*float64(sent); math.Abs(got-want) > 1e-9 {
		t.Fatalf("restart after the refused %d at %v, want %v", sent, got, want)
	}
	heldUntil(t, c, clk, demand{in: 80}, setback.Add(2*overload.DefaultHold))
}

// heldUntil drives intervals of demand d at c, the server answering each
// attempt sent, from now until end, when a hold ends (at an interval's
// end), and fails unless the rate stays as it is until just before end,
// attempts waiting in each interval, and grows at end. Nothing closes the
// next to last interval before the attempts of the last come, together,
// in its last nanosecond: it closes then, just before end, and the last
// one at end.
func heldUntil(t *testing.T, c *Controller, clk *testutil.Clock, d demand, end time.Time) {
	t.Helper()
	held := rateOf(c)
	for clk.Now().Add(2 * overload.DefaultInterval).Before(end) {
		d.run(t, c, clk, answered)
		if got := rateOf(c); got != held {
			t.Fatalf("%v before the hold ends: rate = %v, want held at %v", end.Sub(clk.Now()), got, held)
		}
	}
	d.run(t, c, clk, answered)
	clk.Advance(end.Sub(clk.Now()) - 1)
	report(c, Answered, arrive(t, c, d.in)) // closes the interval before
	if got := rateOf(c); got != held {
		t.Fatalf("just before the hold ends: rate = %v, want held at %v", got, held)
	}
	clk.Advance(1)
	if got := rateOf(c); got <= held {
		t.Fatalf("as the hold ends: rate = %v, want grown from %v", got, held)
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
	// holds reports intervals of 18 answers, 18 attempts coming (came of
	// them, in the first, already), until the rate leaves 18, and returns
	// when that was; every other interval without attempts waiting, unless
	// always.
	holds := func(want float64, always bool, came int) time.Time {
		t.Helper()
		for i := range 20 {
			d := demand{in: 18} // one every 5.6ms: at 18 an interval, none waits
			if i == 0 {
				d.in -= came
			}
			if always || i%2 == 0 {
				d.burst = 3 // more than the bucket's burst
			}
			report(c, Answered, 18)
			d.run(t, c, clk, nil)
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
	if tried := holds(18, false, 1); tried.Sub(restart) < overload.DefaultHold {
		t.Fatalf("capacity tried %v after the restart, want a Hold (%v) at least", tried.Sub(restart), overload.DefaultHold)
	}
	if got := rateOf(c); math.Abs(got-top) > 1e-9 {
		t.Fatalf("tried at %v, want a quarter above the 18 that come (%.2f)", got, top)
	}
	for i := range 5 { // answers that land late
		report(c, Answered, 21)
		demand{in: 18, burst: 3}.run(t, c, clk, nil)
		if got := rateOf(c); math.Abs(got-top) > 1e-9 {
			t.Fatalf("interval %d (21 answers for 18 sent): rate = %v, want it held at %.2f", i, got, top)
		}
	}
	report(c, Answered, 18)
	report(c, Overloaded, 3)
	demand{in: 21, burst: 3}.run(t, c, clk, nil)
	refusal := clk.Now()
	if got := rateOf(c); math.Abs(got-16.2) > 1e-9 {
		t.Fatalf("after 3 refused beside 18 taken: rate = %v, want 16.2", got)
	}
	if tried := holds(16.2, true, 0); tried.Sub(refusal) < overload.DefaultHold {
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
	rate := rateOf(c)
	if rate < 10 {
		t.Fatalf("rate %v after 10 answers from 2, want it grown by one per answer", rate)
	}
	// Had the slow start's answers been taken as what the server sustains,
	// the rate would be past it: no answer would grow it...
	c.Done(Answered)
	if got := rateOf(c); got != rate+1 {
		t.Errorf("after the slow start's interval, an answer made the rate %v, want %v: a token more", got, rate+1)
	}
	// ...and a waiter whose deadline is half a token away would be shed:
	// its turn, as told at the rate, comes after it.
	spend(t, c)
	token := time.Duration(float64(overload.DefaultInterval) / rateOf(c))
	ctx, cancel := deadlineIn(clk, token/2)
	defer cancel()
	out := make(chan grant, 1)
	acquireAsync(ctx, c, 0, out)
	waitLineOrShed(t, c, 1)
	if st := c.State(); st.Shed != 0 {
		t.Errorf("shed %d on the wait at %v per interval, with nothing known", st.Shed, rateOf(c))
	}
	cancel()
	<-out
}

// Refusals below the ratio bring the rate down to Headroom of what the
// server took, and stop its growth; none of it is probing.
func TestFewRefusalsBringTheRateDown(t *testing.T) {
	c, clk := calmThenFail(t, 60)
	clk.Advance(overload.DefaultInterval)
	answerProbe(t, c, confirmMin) // restart at 60
	if arrive(t, c, 1) != 0 {     // an attempt waits: the restart left the bucket empty
		t.Fatal("an attempt went at once")
	}
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
// What is known shows in the rate: attempts waiting and none refused, the
// rate returns at once to what the server is known to take.
func TestLearningStopsAtTheRate(t *testing.T) {
	c, clk := calmThenFail(t, 60)
	clk.Advance(overload.DefaultInterval)
	answerProbe(t, c, confirmMin) // restart at 60
	// 60 arrive (the probe the first), and attempts wait (10 come at
	// once): after the hold the rate grows to where it and the bucket's
	// burst are a quarter above them. The server answers every attempt
	// sent.
	top := 1.25 * 60 / 1.1
	for i := range 12 {
		demand{in: besidesProbe(60, i), burst: 10}.run(t, c, clk, answered)
	}
	if got := rateOf(c); math.Abs(got-top) > 1e-9 {
		t.Fatalf("rate = %v, want grown to %v", got, top)
	}
	// Still 60 an interval, but unevenly: 45 within the first 90ms of an
	// interval (8 at once: attempts wait), the bucket full at its end, and
	// 75 spread over the next, in which the bucket's burst and the rate let
	// more than the rate through, the last ones waiting.
	for i := range 11 {
		d := demand{in: 45, burst: 8, span: 90 * time.Millisecond}
		if i%2 == 1 {
			d = demand{in: 75}
		}
		sent := d.run(t, c, clk, answered)
		if i%2 == 1 && float64(sent) <= top {
			t.Fatalf("interval %d: %d of 75 sent at %.1f, want more than the rate", i, sent, top)
		}
		if got := rateOf(c); got > top+1e-9 {
			t.Fatalf("interval %d (%d sent, every one answered): rate %v, want no more than %v", i, sent, got, top)
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
		demand{in: besidesProbe(in, i), burst: 8}.run(t, c, clk, answered) // attempts wait

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
