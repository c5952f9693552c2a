package pacing

import (
	"context"
	"errors"
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
	settled := func(n int) {
		testutil.Eventually(t, "every attempt sent and answered, lost or waiting", func() bool {
			mu.Lock()
			defer mu.Unlock()
			return r.sent+r.lost+c.State().Waiting == n
		})
	}
	for i := range steps {
		late := i >= steps/2
		for k := range per {
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
			// One at a time: each attempt is sent and answered, lost or
			// waiting before the next asks, so that what the controller
			// sees does not depend on how the goroutines were scheduled.
			settled(per*i + k + 1)
		}
		clk.Advance(step)
		settled(per * (i + 1)) // and those the tick let go are answered
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

// answerProbe sends a probe, which must go at once (its caller will not
// wait: a probe held fails at once, rather than hang), answers it, and
// answers the confirmation's batch of k (confirmLoad).
func answerProbe(t *testing.T, c *Controller, k int) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
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

// answered and refused are outcomes for demand.run: the server answers,
// or refuses, every attempt sent.
func answered(int) Outcome { return Answered }
func refused(int) Outcome  { return Overloaded }

// arrive makes n attempts ask c for leave at the same moment, each from a
// caller that will not wait (its context has already ended), with nobody
// else in the line: an attempt goes if the bucket has a token for it, and
// one that would wait joins the line (the interval is then one in which
// attempts waited) and leaves it at once. It returns how many went.
func arrive(t *testing.T, c *Controller, n int) (sent int) {
	t.Helper()
	if w := c.State().Waiting; w != 0 {
		t.Fatalf("arrive with %d waiting: a caller that will not wait could take their token", w)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for range n {
		switch _, err := c.Acquire(ctx); {
		case err == nil:
			sent++
		case !errors.Is(err, context.Canceled):
			t.Fatalf("an attempt that would not wait: %v, want it sent or its context's error", err)
		}
	}
	return sent
}

// spend lets attempts go at once (as arrive makes them) until the bucket
// has no token left, and returns how many went: the last one asked and
// would have waited.
func spend(t *testing.T, c *Controller) (sent int) {
	t.Helper()
	for ; sent < 1000; sent++ {
		if arrive(t, c, 1) == 0 {
			return sent
		}
	}
	t.Fatalf("%d attempts went at once, pacing %v: the bucket never ran out", sent, c.Pacing())
	return sent
}

// demand is the attempts that come to a controller in one interval: in of
// them, the first burst together at the interval's start and each other
// one, the k-th, k span/in after it (span 0: the whole Interval). A burst
// larger than the bucket's makes attempts wait even at a rate above the
// arrivals; a span short of the Interval leaves the interval's end idle,
// so that the bucket is full when the next begins.
type demand struct {
	in, burst int
	span      time.Duration
}

// run drives the interval of c that begins now under d, each attempt
// asking as arrive makes it, and each one that goes ending at once as
// outcome says (outcome(i) for the i-th sent; nil: it stays in flight). It
// leaves the clock at the next interval's start and returns how many went.
func (d demand) run(t *testing.T, c *Controller, clk *testutil.Clock, outcome func(i int) Outcome) (sent int) {
	t.Helper()
	span := d.span
	if span == 0 {
		span = overload.DefaultInterval
	}
	var at time.Duration // since the interval's start
	for k := range d.in {
		if next := span * time.Duration(k) / time.Duration(d.in); k >= d.burst && next > at {
			clk.Advance(next - at)
			at = next
		}
		if arrive(t, c, 1) == 1 {
			if outcome != nil {
				c.Done(outcome(sent))
			}
			sent++
		}
	}
	clk.Advance(overload.DefaultInterval - at)
	return sent
}

// besidesProbe is how many attempts come in the i-th interval after a
// restart, of in in all, besides the probe whose answer restarted the
// rate: it came first, in the first.
func besidesProbe(in, i int) int {
	if i == 0 {
		return in - 1
	}
	return in
}

// serveNext moves clk on a tenth of a millisecond at a time (the least
// wait of the line's timer: it hands out at most one token in a step at
// the rates the tests use) until c's line is one shorter, and returns what
// the waiter that left it got on out.
func serveNext(t *testing.T, c *Controller, clk *testutil.Clock, out <-chan grant) grant {
	t.Helper()
	const step = 100 * time.Microsecond
	n := c.State().Waiting
	for range int(time.Second / step) {
		clk.Advance(step)
		if c.State().Waiting < n {
			return <-out
		}
	}
	t.Fatalf("nobody of the %d waiting left the line in a second", n)
	return grant{}
}

// herdRetried is herdCollapsed, then the interval in which the herd's
// retries come: n attempts together, the first of which goes as a probe
// and is refused while the others wait and give up. It leaves the clock at
// the next interval's start, the server still collapsed and probed, the n
// counted as the last interval's arrivals.
func herdRetried(t *testing.T, n int) (*Controller, *testutil.Clock) {
	t.Helper()
	c, clk := herdCollapsed(t)
	if sent := (demand{in: n, burst: n}).run(t, c, clk, refused); sent != 1 {
		t.Fatalf("%d of the herd's %d retries sent while collapsed, want 1: a probe", sent, n)
	}
	if st := c.State(); !st.Pacing || rateOf(c) != firstProbes {
		t.Fatalf("pacing %v at %v per interval after the retries, want still probed at %v", st.Pacing, rateOf(c), firstProbes)
	}
	return c, clk
}

// collapses reports one interval from now in which c's server refuses
// refusals of n attempts and answers the rest, and whether that collapsed
// it: its rate fell to a probe's, one an interval past the first
// intervals of an episode. Overload is FailureRatio (a half) of the
// attempts that the server's share of independent failures leaves, so the
// interval collapses the server if that share is at most 2·refusals/n − 1,
// and otherwise cuts the rate (to 90 % of what the server took, at least
// n−refusals) or leaves it: provided the refusals are more than the share
// explains (they are, by far, for the shares the tests probe), and that
// the server took more than n−refusals in an interval of the episode
// before, so that this one teaches nothing. c must pace, not collapsed,
// above a probe's rate.
func collapses(t *testing.T, c *Controller, clk *testutil.Clock, refusals, n int) bool {
	t.Helper()
	if !c.Pacing() || rateOf(c) <= 1 {
		t.Fatalf("pacing %v at %v per interval: want paced above a probe's rate, to tell a collapse", c.Pacing(), rateOf(c))
	}
	report(c, Answered, n-refusals)
	report(c, Overloaded, refusals)
	clk.Advance(overload.DefaultInterval)
	return c.Pacing() && rateOf(c) <= 1
}
