package pacing

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/herdguard/herdguard/overload"

	"github.com/herdguard/herdguard/internal/testutil"
)

func TestDetection(t *testing.T) {
	for _, tc := range []struct {
		name             string
		answered, failed int
		pacing           bool
	}{
		{"independent failures: 30 % of 1000", 700, 300, false},
		{"fewer failures than MinFailures", 0, 19, false},
		{"MinFailures, nothing answered", 0, 20, true},
		{"failures just below the ratio", 21, 20, false},
		{"failures at the ratio, as chance makes them", 20, 20, false},
		// 22 of 32: two standard deviations above half.
		{"failures clearly above the ratio", 10, 22, true},
		{"failures just short of that", 10, 21, false},
		{"a herd over capacity 20", 20, 980, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, _ := newController(t, overload.Settings{})
			report(c, Answered, tc.answered)
			report(c, Overloaded, tc.failed)
			if got := c.State().Pacing; got != tc.pacing {
				t.Errorf("pacing = %v, want %v", got, tc.pacing)
			}
		})
	}
}

// Refusals are judged against the attempts sent, not only those answered:
// a server that fails a share of a wave at once and answers the rest a
// little later shows only refusals at first.
func TestRefusalsAheadOfAnswers(t *testing.T) {
	sent := func(c *Controller, n int) {
		for i := range n {
			if i%2 == 0 {
				c.Sent() // as the interceptor reports a calm attempt
			} else if _, err := c.Acquire(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, tc := range []struct {
		name   string
		run    func(*Controller, *testutil.Clock)
		pacing bool
	}{
		{"30 of 100 refused first", func(c *Controller, _ *testutil.Clock) {
			sent(c, 100)
			report(c, Overloaded, 30)
			report(c, Answered, 70)
		}, false},
		// 60 of 100: two standard deviations above half.
		{"60 of 100 refused first", func(c *Controller, _ *testutil.Clock) {
			sent(c, 100)
			report(c, Overloaded, 60)
		}, true},
		{"59 of 100 refused first", func(c *Controller, _ *testutil.Clock) {
			sent(c, 100)
			report(c, Overloaded, 59)
			report(c, Answered, 41)
		}, false},
		{"a wave sent in the last interval, refused in this one", func(c *Controller, clk *testutil.Clock) {
			report(c, Answered, 50) // a calm stretch before
			sent(c, 150)            // its 50 and a wave of 100
			clk.Advance(overload.DefaultInterval)
			report(c, Overloaded, 30)
			report(c, Answered, 70)
		}, false},
		{"attempts cancelled in the last interval are not in flight", func(c *Controller, clk *testutil.Clock) {
			sent(c, 100)
			report(c, Ignored, 100)
			clk.Advance(overload.DefaultInterval)
			sent(c, 20)
			report(c, Overloaded, 20)
		}, true},
		{"attempts in flight count for one interval only", func(c *Controller, clk *testutil.Clock) {
			sent(c, 100) // long-lived streams, say
			clk.Advance(overload.DefaultInterval)
			report(c, Overloaded, 1) // closes the interval: 100 in flight
			clk.Advance(overload.DefaultInterval)
			sent(c, 25)
			report(c, Overloaded, 25)
		}, true},
		{"a herd: every attempt sent refused", func(c *Controller, _ *testutil.Clock) {
			sent(c, 1000)
			report(c, Overloaded, 980)
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, clk := newController(t, overload.Settings{})
			tc.run(c, clk)
			if got := c.State().Pacing; got != tc.pacing {
				t.Errorf("pacing = %v, want %v", got, tc.pacing)
			}
		})
	}
}

// Independent failures below the ratio start no pacing, also where the
// rule is checked: at each refusal, against the answers so far (the
// margin, triggerMargin, is what keeps chance runs out).
func TestIndependentFailuresStartNoPacing(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 11))
	answer := func(c *Controller, n int, share float64) {
		for range n {
			if rng.Float64() < share {
				c.Done(Overloaded)
			} else {
				c.Done(Answered)
			}
		}
	}
	t.Run("waves of 100 to fresh clients", func(t *testing.T) {
		paced := 0
		for range 3000 {
			c, _ := newController(t, overload.Settings{})
			answer(c, 100, 0.3)
			if c.Pacing() {
				paced++
			}
		}
		if paced > 0 {
			t.Errorf("%d of 3000 waves with 30 %% independent failures started pacing", paced)
		}
	})
	t.Run("steady load", func(t *testing.T) {
		for _, share := range []float64{0.2, 0.3} {
			c, clk := newController(t, overload.Settings{})
			for i := range 3000 {
				answer(c, 60, share)
				clk.Advance(overload.DefaultInterval)
				if c.Pacing() {
					t.Fatalf("%.0f %% independent failures: pacing after %d intervals of 60 answers", 100*share, i+1)
				}
			}
		}
	})
}

// The failures must fall in one interval: the same failures spread over
// many calm intervals are not an overload.
func TestDetectionPerInterval(t *testing.T) {
	c, clk := newController(t, overload.Settings{})
	for range 10 {
		report(c, Answered, 10)
		report(c, Overloaded, 5)
		clk.Advance(overload.DefaultInterval)
	}
	if c.State().Pacing {
		t.Fatal("pacing after 5 failures in each of 10 intervals")
	}
}

func TestCalmPathAllocatesNothing(t *testing.T) {
	c, _ := newController(t, overload.Settings{})
	ctx := context.Background()
	allocs := testing.AllocsPerRun(1000, func() {
		if _, err := c.Acquire(ctx); err != nil {
			t.Fatal(err)
		}
		c.AnsweredSentCalm() // what the interceptor reports after a calm attempt
	})
	if allocs != 0 {
		t.Errorf("allocs per calm attempt = %v, want 0", allocs)
	}
}

// A pause in the calm stretch before an overload is not throughput: the
// restart returns to what the server took while the client was busy, and
// with too little known (less than an answer per interval) to a slow
// start, never to an average diluted by idle time. Answers come spread
// over each interval, as they do.
func TestCalmPausesAreNotThroughput(t *testing.T) {
	type step = func(*Controller, *testutil.Clock) (answers int)
	steady := func(intervals int, perInterval float64) step {
		return func(c *Controller, clk *testutil.Clock) (n int) {
			every := time.Duration(float64(overload.DefaultInterval) / perInterval)
			for end := clk.Now().Add(time.Duration(intervals) * overload.DefaultInterval); clk.Now().Before(end); clk.Advance(every) {
				c.Done(Answered)
				n++
			}
			return n
		}
	}
	idle := func(d time.Duration) step {
		return func(_ *Controller, clk *testutil.Clock) int { clk.Advance(d); return 0 }
	}
	burst := func(n int) step {
		return func(c *Controller, _ *testutil.Clock) int { report(c, Answered, n); return n }
	}
	for _, tc := range []struct {
		name  string
		calm  []step
		state bool    // a metrics reader closes the stretch between the steps
		want  float64 // the restart's rate per interval; 2 is a slow start
	}{
		{"steady", []step{steady(30, 60)}, false, 60},
		{"steady and low", []step{steady(50, 5)}, false, 5},
		{"steady and lower", []step{steady(100, 3)}, false, 3},
		{"a short pause is noise", []step{steady(15, 60), idle(5 * overload.DefaultInterval), steady(15, 60)}, false, 1800.0 / 35},
		{"busy, then idle", []step{steady(30, 60), idle(3 * time.Second)}, false, 60},
		{"low, then idle", []step{steady(50, 5), idle(3 * time.Second)}, false, 5},
		{"idle, then busy", []step{idle(10 * time.Minute), steady(30, 60)}, false, 60},
		{"idle, then a burst", []step{idle(10 * time.Minute), burst(100)}, false, 100},
		{"idle, then a larger burst", []step{idle(10 * time.Minute), burst(200)}, false, 200},
		{"one answer, then idle", []step{burst(1), idle(10 * time.Minute)}, false, 2},
		{"a trickle", []step{steady(60, 0.5)}, false, 2},
		{"an idle stretch keeps what was known", []step{steady(30, 60), idle(3 * time.Second)}, true, 60},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, clk := newController(t, overload.Settings{})
			answers := 0 // since the controller last closed an interval: calm answers close none
			for _, do := range tc.calm {
				answers += do(c, clk)
				if tc.state {
					c.State()
					answers = 0
				}
			}
			report(c, Overloaded, max(20, answers)) // at least as many refusals as answers
			if !c.Pacing() {
				t.Fatal("not pacing")
			}
			clk.Advance(overload.DefaultInterval) // collapsed
			answerProbe(t, c, confirmMin)
			if got := rateOf(c); math.Abs(got-tc.want) > 0.02*tc.want {
				t.Errorf("restart = %v per interval, want %v", got, tc.want)
			}
		})
	}
}

// An attempt that ran out of its caller's time in flight is an overload
// signal, unless it had waited in the line longer than it then had left.
func TestTimedOutAtTheEdgeSaysNothing(t *testing.T) {
	for _, tc := range []struct {
		name       string
		held, left time.Duration
		pacing     bool
	}{
		{"sent at once", 0, time.Second, true},
		{"waited less than it had left", 300 * time.Millisecond, 500 * time.Millisecond, true},
		{"waited as long as it had left", 500 * time.Millisecond, 500 * time.Millisecond, true},
		{"waited longer than it had left", 1900 * time.Millisecond, 100 * time.Millisecond, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, _ := newController(t, overload.Settings{})
			for range overload.DefaultMinFailures {
				c.TimedOut(tc.held, tc.left)
			}
			if got := c.State().Pacing; got != tc.pacing {
				t.Errorf("pacing after %d time-outs = %v, want %v", overload.DefaultMinFailures, got, tc.pacing)
			}
		})
	}
}
