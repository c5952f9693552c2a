package pacing

import (
	"context"
	"testing"
	"time"

	"github.com/herdguard/herdguard/overload"
)

// The confirmation's batch counts against the restarted rate for at most
// an interval: a slow start of 2 an interval after a batch of 4 owes 2
// tokens, and serves its line within two intervals (counted whole, the 4
// would hold it for two and a half).
func TestBatchCountsAgainstOneIntervalAtMost(t *testing.T) {
	c, clk := newController(t, overload.Settings{})
	report(c, Overloaded, 20)
	clk.Advance(overload.DefaultInterval) // collapsed, later than the first probe
	if _, err := c.Acquire(context.Background()); err != nil {
		t.Fatal(err)
	}
	c.Done(Answered) // the probe's answer: a batch of 4, and its attempts go
	for range confirmMin {
		if d, err := c.Acquire(context.Background()); d != 0 || err != nil {
			t.Fatalf("batch attempt: held %v, %v; want it sent at once", d, err)
		}
	}
	out := make(chan grant, 1)
	acquireAsync(context.Background(), c, 0, out)
	waitLine(t, c, 1)
	confirmLoad(t, c, confirmMin) // answered: a slow start at 2
	if got := rateOf(c); got != 2 {
		t.Fatalf("restart = %v per interval, want a slow start at 2", got)
	}
	clk.Advance(2 * overload.DefaultInterval)
	if c.State().Waiting != 0 {
		t.Fatal("the waiter was not served within two intervals of the restart")
	}
	if g := <-out; g.err != nil {
		t.Fatalf("waiter: %v", g.err)
	}
}

// An outcome of the confirmation's batch that says nothing (a cancelled
// caller, a layer below that gave up, a caller whose time the line spent)
// does not hold the confirmation: the batch is judged on the outcomes it
// has, and a batch of which nothing is counted leaves the server collapsed
// and probed again, a later probe's answer starting a batch of its own.
func TestConfirmationSkipsOutcomesThatSayNothing(t *testing.T) {
	for _, tc := range []struct {
		name     string
		nothing  func(c *Controller) // one outcome of the batch that says nothing
		nothingN int                 // how many of the batch's confirmMin end so
	}{
		{"one ignored", func(c *Controller) { c.Done(Ignored) }, 1},
		{"one timed out after the line spent its time", func(c *Controller) { c.TimedOut(1900*time.Millisecond, 100*time.Millisecond) }, 1},
		{"three ignored", func(c *Controller) { c.Done(Ignored) }, 3},
		{"the whole batch ignored", func(c *Controller) { c.Done(Ignored) }, confirmMin},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, clk := newController(t, overload.Settings{})
			report(c, Overloaded, 20)
			clk.Advance(firstProbeIntervals * overload.DefaultInterval) // collapsed, one probe per interval
			atOnce := func() bool {                                     // an attempt goes at once, or not at all
				ctx, cancel := context.WithCancel(context.Background())
				cancel()
				_, err := c.Acquire(ctx)
				return err == nil
			}
			if !atOnce() {
				t.Fatal("the probe was held")
			}
			c.Done(Answered) // the probe's answer: a batch of confirmMin
			for i := range confirmMin {
				if !atOnce() {
					t.Fatalf("batch attempt %d was held", i)
				}
			}
			for range tc.nothingN {
				tc.nothing(c)
			}
			report(c, Answered, confirmMin-tc.nothingN)
			if tc.nothingN < confirmMin {
				// Judged on what was counted: all answered, so the refusals
				// were load, and the rate restarts at a slow start.
				if got := rateOf(c); got != 2 {
					t.Fatalf("rate after the batch = %v per interval, want the restart's 2", got)
				}
				return
			}
			if !c.Pacing() || rateOf(c) != 1 {
				t.Fatalf("after a batch that showed nothing: pacing %v, rate %v; want still probing at 1 per interval", c.Pacing(), rateOf(c))
			}
			clk.Advance(overload.DefaultInterval)
			if !atOnce() {
				t.Fatal("the next probe was held")
			}
			c.Done(Answered)
			for i := range confirmMin {
				if !atOnce() {
					t.Fatalf("the second batch's attempt %d was held", i)
				}
			}
			report(c, Answered, confirmMin)
			if got := rateOf(c); got != 2 {
				t.Fatalf("rate after the second batch = %v per interval, want the restart's 2", got)
			}
		})
	}
}
