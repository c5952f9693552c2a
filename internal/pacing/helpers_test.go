package pacing

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/herdguard/herdguard/overload"

	"go.uber.org/goleak"

	"github.com/herdguard/herdguard/internal/testutil"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// newController is a Controller on a manual clock, whose Advance runs
// every timer that falls due, in order, synchronously. The clock starts an
// hour ahead of real time, so that a context whose deadline is near on it
// does not expire in real time.
func newController(t *testing.T, s overload.Settings) (*Controller, *testutil.Clock) {
	t.Helper()
	clk := testutil.NewClock(time.Now().Add(time.Hour))
	c, err := New(s, Clock{Now: clk.Now, AfterFunc: func(d time.Duration, f func()) func() bool { return clk.AfterFunc(d, f).Stop }})
	if err != nil {
		t.Fatal(err)
	}
	return c, clk
}

func report(c *Controller, o Outcome, n int) {
	for range n {
		c.Done(o)
	}
}

// waitLine waits until n attempts wait in c's line.
func waitLine(t *testing.T, c *Controller, n int) {
	t.Helper()
	testutil.Eventually(t, fmt.Sprintf("%d attempts waiting in line", n), func() bool { return c.State().Waiting == n })
}

// waitLineOrShed spins until n attempts, counted since c began, wait in
// its line or were shed.
func waitLineOrShed(t *testing.T, c *Controller, n int) {
	t.Helper()
	testutil.Eventually(t, fmt.Sprintf("%d attempts waiting or shed in all", n), func() bool {
		st := c.State()
		return st.Waiting+int(st.Shed) == n
	})
}

// rateOf is the controller's rate in attempts per interval (of the
// default Interval, which every test uses).
func rateOf(c *Controller) float64 {
	return c.State().Rate * float64(overload.DefaultInterval) / float64(time.Second)
}

// driven is what drive saw: when the pacing ended (-1: it did not), the
// attempts sent and not, and those sent and refused in its second half.
type driven struct {
	ended                 time.Duration
	sent, lost            int
	sentLate, refusedLate int
}

// drive asks c for 6 attempts every 10 ms of clk for 10 s, each with a long
// deadline, and reports how each one it lets through ended: outcome, called
// with the time it was sent.
func drive(t *testing.T, c *Controller, clk *testutil.Clock, outcome func(time.Time) Outcome) driven {
	t.Helper()
	return driveEach(t, c, clk, outcome, nil)
}

// driveEach is drive that calls each (if not nil) after every step of 10
// ms.
func driveEach(t *testing.T, c *Controller, clk *testutil.Clock, outcome func(time.Time) Outcome, each func()) driven {
	t.Helper()
	var (
		wg sync.WaitGroup
		mu sync.Mutex
		r  = driven{ended: -1}
	)
	ctx, cancel := context.WithDeadline(context.Background(), clk.Now().Add(time.Hour))
	defer cancel()
	const step, per, steps = 10 * time.Millisecond, 6, 1000
	for i := range steps {
		late := i >= steps/2
		for range per {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, err := c.Acquire(ctx)
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					r.lost++
					return
				}
				r.sent++
				o := outcome(clk.Now())
				if late {
					r.sentLate++
					if o == Overloaded {
						r.refusedLate++
					}
				}
				c.Done(o)
			}()
		}
		testutil.Eventually(t, "every attempt of the step sent, lost or waiting", func() bool {
			mu.Lock()
			n := r.sent + r.lost
			mu.Unlock()
			return n+c.State().Waiting == per*(i+1)
		})
		clk.Advance(step)
		if r.ended < 0 && !c.Pacing() {
			r.ended = time.Duration(i+1) * step
		}
		if each != nil {
			each()
		}
	}
	cancel()
	wg.Wait()
	return r
}

type grant struct {
	id  int
	err error
}

// acquireAsync starts Acquire for id and reports it on out.
func acquireAsync(ctx context.Context, c *Controller, id int, out chan<- grant) {
	go func() {
		_, err := c.Acquire(ctx)
		out <- grant{id, err}
	}()
}

// answerProbe sends a probe, which must go at once, answers it, and
// answers the confirmation's batch of k (confirmLoad).
func answerProbe(t *testing.T, c *Controller, k int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if d, err := c.Acquire(ctx); d != 0 || err != nil {
		t.Fatalf("probe: held %v, %v", d, err)
	}
	c.Done(Answered)
	confirmLoad(t, c, k)
}

// confirmLoad answers the k attempts of the confirmation an answered probe
// began: the server took at the low rate what it refused at the high one,
// so the refusals were load, and the rate restarts. k is the batch's size:
// the attempts the server answered in the interval that collapsed it, but
// at least confirmMin and at most confirmMax. It fails unless the rate
// stays the probes' until the k-th answer, and restarts at it.
func confirmLoad(t *testing.T, c *Controller, k int) {
	t.Helper()
	probing := rateOf(c)
	for i := range k - 1 {
		c.Done(Answered)
		if got := rateOf(c); got != probing {
			t.Fatalf("answer %d of a batch of %d: rate = %v, want the probes' %v until the batch is in", i+1, k, got, probing)
		}
	}
	c.Done(Answered)
	if got := rateOf(c); got == probing {
		t.Fatalf("after a batch of %d answers: rate = %v, want it restarted", k, got)
	}
}

// startCollapsed starts an episode as a burst of refusals does (MinFailures
// of them, nothing answered) and lets the burst's interval end: the server
// is collapsed, it showed no capacity, and the next interval begins.
func startCollapsed(t *testing.T, c *Controller, clk *testutil.Clock) {
	t.Helper()
	report(c, Overloaded, overload.DefaultMinFailures)
	clk.Advance(overload.DefaultInterval)
	if !c.Pacing() || rateOf(c) != firstProbes {
		t.Fatalf("after a burst of refusals: pacing %v at %v per interval, want collapsed: probed at %v", c.Pacing(), rateOf(c), firstProbes)
	}
}

// calmThenFail runs perInterval answers for 30 intervals, then enough
// failures in the next to start pacing.
func calmThenFail(t *testing.T, perInterval int) (*Controller, *testutil.Clock) {
	t.Helper()
	c, clk := newController(t, overload.Settings{})
	for range 30 {
		report(c, Answered, perInterval)
		clk.Advance(overload.DefaultInterval)
	}
	report(c, Overloaded, 20)
	if !c.State().Pacing {
		t.Fatal("not pacing")
	}
	return c, clk
}

// herdCollapsed is a fresh client (nothing sustained before, so its line
// never drains oldest first) whose first interval's herd the server took
// 10 of, collapsing.
func herdCollapsed(t *testing.T) (*Controller, *testutil.Clock) {
	t.Helper()
	c, clk := newController(t, overload.Settings{})
	report(c, Answered, 10)
	report(c, Overloaded, 30)
	clk.Advance(overload.DefaultInterval)
	if st := c.State(); !st.Pacing || rateOf(c) != firstProbes {
		t.Fatalf("pacing %v at %v per interval after the herd, want collapsed: probed at %v", st.Pacing, rateOf(c), firstProbes)
	}
	return c, clk
}

// deadlineIn is a context whose deadline is d away on clk, which also
// ends (cancelled) after 10s of real time, so that a test that would wait
// for it fails instead of hanging.
func deadlineIn(clk *testutil.Clock, d time.Duration) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithDeadline(context.Background(), clk.Now().Add(d))
	stop := time.AfterFunc(10*time.Second, cancel)
	return ctx, func() { stop.Stop(); cancel() }
}
