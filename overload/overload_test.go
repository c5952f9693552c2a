package overload

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeClock is a manual clock: timers fire when Advance passes them.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time
	timers []*fakeTimer
}

type fakeTimer struct {
	at      time.Time
	f       func()
	stopped bool
}

// newFakeClock starts an hour ahead of real time, so that a context whose
// deadline is near on the fake clock does not expire in real time.
func newFakeClock() *fakeClock { return &fakeClock{now: time.Now().Add(time.Hour)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) AfterFunc(d time.Duration, f func()) func() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &fakeTimer{at: c.now.Add(d), f: f}
	c.timers = append(c.timers, t)
	return func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		was := !t.stopped
		t.stopped = true
		return was
	}
}

// Advance moves the clock by d in steps, running every timer that falls
// due, in order.
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	end := c.now.Add(d)
	c.mu.Unlock()
	for {
		c.mu.Lock()
		slices.SortFunc(c.timers, func(a, b *fakeTimer) int { return a.at.Compare(b.at) })
		if len(c.timers) == 0 || c.timers[0].at.After(end) {
			c.now = end
			c.mu.Unlock()
			return
		}
		t := c.timers[0]
		c.timers = c.timers[1:]
		if t.at.After(c.now) {
			c.now = t.at
		}
		stopped := t.stopped // read under the lock: the timer's stop runs on other goroutines
		c.mu.Unlock()
		if !stopped {
			t.f()
		}
	}
}

func newController(t *testing.T, s Settings) (*Controller, *fakeClock) {
	t.Helper()
	clk := newFakeClock()
	s.Now, s.AfterFunc = clk.Now, clk.AfterFunc
	c, err := New(s)
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

// waitLine spins (without sleeping) until n attempts wait in c's line.
func waitLine(t *testing.T, c *Controller, n int) {
	t.Helper()
	for i := 0; c.State().Waiting != n; i++ {
		if i > 1e7 {
			t.Fatalf("waiting = %d, want %d", c.State().Waiting, n)
		}
		runtime.Gosched()
	}
}

// waitLineOrShed spins until n attempts, counted since c began, wait in
// its line or were shed.
func waitLineOrShed(t *testing.T, c *Controller, n int) {
	t.Helper()
	for i := 0; ; i++ {
		st := c.State()
		if st.Waiting+int(st.Shed) == n {
			return
		}
		if i > 1e7 {
			t.Fatalf("waiting %d, shed %d; want %d in all", st.Waiting, st.Shed, n)
		}
		runtime.Gosched()
	}
}

// rateOf is the controller's rate in attempts per interval.
func rateOf(c *Controller) float64 {
	return c.State().Rate * float64(c.s.Interval) / float64(time.Second)
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		s    Settings
		want string
	}{
		{Settings{Interval: -1}, "Interval = -1ns"},
		{Settings{MinFailures: -2}, "MinFailures = -2"},
		{Settings{FailureRatio: 1.5}, "FailureRatio = 1.5"},
		{Settings{Hold: -time.Second}, "Hold = -1s"},
		{Settings{Calm: -1}, "Calm = -1"},
		{Settings{Headroom: 2}, "Headroom = 2"},
		{Settings{Now: time.Now}, "Now and AfterFunc"},
	} {
		_, err := New(tc.s)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New(%+v) = %v, want an error containing %q", tc.s, err, tc.want)
		}
	}
	if _, err := New(Settings{}); err != nil {
		t.Errorf("the zero Settings: %v", err)
	}
}

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
			c, _ := newController(t, Settings{})
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
// little later shows only refusals at first. Before, 30 refusals that came
// back ahead of 70 answers started pacing ("every answer"), as the trace
// demo's fresh client saw now and then against a server failing 30 % of
// its attempts on its own.
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
		run    func(*Controller, *fakeClock)
		pacing bool
	}{
		{"30 of 100 refused first", func(c *Controller, _ *fakeClock) {
			sent(c, 100)
			report(c, Overloaded, 30)
			report(c, Answered, 70)
		}, false},
		// 60 of 100: two standard deviations above half.
		{"60 of 100 refused first", func(c *Controller, _ *fakeClock) {
			sent(c, 100)
			report(c, Overloaded, 60)
		}, true},
		{"59 of 100 refused first", func(c *Controller, _ *fakeClock) {
			sent(c, 100)
			report(c, Overloaded, 59)
			report(c, Answered, 41)
		}, false},
		{"a wave sent in the last interval, refused in this one", func(c *Controller, clk *fakeClock) {
			report(c, Answered, 50) // a calm stretch before
			sent(c, 150)            // its 50 and a wave of 100
			clk.Advance(DefaultInterval)
			report(c, Overloaded, 30)
			report(c, Answered, 70)
		}, false},
		{"attempts cancelled in the last interval are not in flight", func(c *Controller, clk *fakeClock) {
			sent(c, 100)
			report(c, Ignored, 100)
			clk.Advance(DefaultInterval)
			sent(c, 20)
			report(c, Overloaded, 20)
		}, true},
		{"attempts in flight count for one interval only", func(c *Controller, clk *fakeClock) {
			sent(c, 100) // long-lived streams, say
			clk.Advance(DefaultInterval)
			report(c, Overloaded, 1) // closes the interval: 100 in flight
			clk.Advance(DefaultInterval)
			sent(c, 25)
			report(c, Overloaded, 25)
		}, true},
		{"a herd: every attempt sent refused", func(c *Controller, _ *fakeClock) {
			sent(c, 1000)
			report(c, Overloaded, 980)
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, clk := newController(t, Settings{})
			tc.run(c, clk)
			if got := c.State().Pacing; got != tc.pacing {
				t.Errorf("pacing = %v, want %v", got, tc.pacing)
			}
		})
	}
}

// Independent failures below the ratio start no pacing, also where the
// rule is checked: at each refusal, against the answers so far. Without
// the margin, a fresh client whose first 100 answers came at once with 30
// % refused started pacing in about 1 % of such waves, and a server that
// fails 30 % of a steady load's attempts was paced now and then.
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
			c, _ := newController(t, Settings{})
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
			c, clk := newController(t, Settings{})
			for i := range 3000 {
				answer(c, 60, share)
				clk.Advance(DefaultInterval)
				if c.Pacing() {
					t.Fatalf("%.0f %% independent failures: pacing after %d intervals of 60 answers", 100*share, i+1)
				}
			}
		}
	})
}

// A paced server whose failures are independent (30 % of its attempts
// fail, whatever the load) gets its rate back and is no longer paced.
// The refusals its share of independent failures explains are not load.
// Before, each interval's refusals cut the rate to Headroom of the
// answers, and the rate never grew again: one attempt per interval, the
// line of 60 arrivals an interval growing for good.
//
// A fresh client knows no such share: it learns it while paced, from the
// intervals in which the server took more than ever before in the episode
// (refusals that do not follow the load). Before, it stayed paced at 9
// attempts a second for the 600 that came: two attempts, one refused by
// chance, had shown a "capacity" of one, and nothing raised it again.
//
// The client that knew the server is asked it for ten random sequences.
// Before, each chance refusal beyond the share cut the rate to Headroom of
// the answers alone, 63 % of the attempts the server took, and the line
// that built kept the pacing on past 10 s in 12 of 20 such sequences (1
// now).
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
	c, clk := newController(t, Settings{})
	rng := rand.New(rand.NewPCG(seed, 5))
	for range calm {
		report(c, Answered, 42)
		report(c, Overloaded, 18)
		clk.Advance(DefaultInterval)
	}
	if c.Pacing() {
		t.Fatal("pacing on independent failures")
	}
	c.mu.Lock()
	c.beginLocked(clk.Now()) // as a real overload, or chance, would
	c.mu.Unlock()

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
// the end (most end within 300ms). Before, a share above FailureRatio looked like
// overload for good: at 67 % the rate fell to a probe per interval, and a
// client that retried got 2 % of its calls through, against 69 % with no
// pacing.
func TestIndependentFailuresAboveTheRatioEndThePacing(t *testing.T) {
	for _, share := range []float64{0.5, 0.67, 0.8, 0.9} {
		for seed := range uint64(5) {
			c, clk := newController(t, Settings{})
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
// has it take at least 70 % of its capacity. Before, a fresh client took
// 2 % in a quarter of the runs: a capacity shown by a handful of attempts
// (an interval in which the rate had just restarted), and the rate never
// rose past it again. Now it takes 93-100 % (20 runs).
//
// One that knew the server before takes at least 75 % in each of 8 runs
// (81-95 % in 20). Before, it took 63-70 % in about half the runs: the
// rate returned at once to what the server took before the cut, was
// refused, and was cut twice, the second time for the refusals that were
// only the echo of the rate before the first cut.
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
		clk *fakeClock
	)
	if fresh {
		c, clk = newController(t, Settings{})
		c.mu.Lock()
		c.beginLocked(clk.Now())
		c.mu.Unlock()
	} else {
		c, clk = calmThenFail(t, 60)
	}
	var (
		window time.Time
		taken  int
	)
	r := drive(t, c, clk, func(now time.Time) Outcome {
		if w := now.Truncate(DefaultInterval); w != window {
			window, taken = w, 0
		}
		if taken >= 50 {
			return Overloaded
		}
		taken++
		return Answered
	})
	c.mu.Lock()
	base := c.baseLocked()
	c.mu.Unlock()
	if base >= 0.1 {
		t.Errorf("run %d: a share of %.2f of independent failures learnt from a capacity cut", run, base)
	}
	if took := r.sentLate - r.refusedLate; took < least {
		t.Errorf("run %d: in the last 5 s the server took %d attempts, refused %d: want at least %d of its 2500", run, took, r.refusedLate, least)
	}
	t.Logf("run %d: %d sent, %d refused in the last 5 s of %d sent (took %d); %d not sent; base %.3f", run, r.sent, r.refusedLate, r.sentLate, r.sentLate-r.refusedLate, r.lost, base)
}

// TestCrossingACutTeachesNoIndependentFailures: while paced, the refusals
// of an interval that took clearly more than any before it are the
// server's share of independent failures, unless the last such interval
// before it had 10 answers or more and was refused nothing: then they are
// load, the rate passing a cut. A
// fresh client crossing a cut of 50 at 70 learnt before a share of 0.12
// from the crossing alone (up to 0.19 in the capacity-cut test, with
// attempts answered at once); a server that fails from the start still
// teaches its share, and an interval that takes only a little more than
// the most before it (answers that crossed an interval's end) teaches
// nothing.
func TestCrossingACutTeachesNoIndependentFailures(t *testing.T) {
	for _, tc := range []struct {
		name      string
		intervals [][2]int // answered, refused
		low, high float64  // the share learnt
	}{
		{"a cut crossed after a clean interval", [][2]int{{3, 0}, {14, 0}, {70, 12}}, 0, 0},
		{"then a little more, refused", [][2]int{{3, 0}, {14, 0}, {50, 12}, {53, 10}, {54, 9}}, 0, 0},
		{"independent failures from the start", [][2]int{{3, 1}, {14, 6}, {70, 30}}, 0.25, 0.35},
		{"a clean interval too small to tell", [][2]int{{3, 0}, {9, 0}, {40, 12}}, 0.15, 0.25},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, clk := newController(t, Settings{})
			c.mu.Lock()
			c.beginLocked(clk.Now())
			c.mu.Unlock()
			for _, iv := range tc.intervals {
				report(c, Answered, iv[0])
				report(c, Overloaded, iv[1])
				clk.Advance(DefaultInterval)
			}
			c.mu.Lock()
			c.advanceLocked(clk.Now())
			base := c.baseLocked()
			c.mu.Unlock()
			if base < tc.low || base > tc.high {
				t.Errorf("share of independent failures learnt = %.3f, want %.2f to %.2f", base, tc.low, tc.high)
			}
		})
	}
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
func drive(t *testing.T, c *Controller, clk *fakeClock, outcome func(time.Time) Outcome) driven {
	t.Helper()
	return driveEach(t, c, clk, outcome, nil)
}

// driveEach is drive that calls each (if not nil) after every step of 10
// ms.
func driveEach(t *testing.T, c *Controller, clk *fakeClock, outcome func(time.Time) Outcome, each func()) driven {
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
		for j := 0; ; j++ { // every attempt of this step asked
			mu.Lock()
			n := r.sent + r.lost
			mu.Unlock()
			if n+c.State().Waiting == per*(i+1) {
				break
			}
			if j > 1e7 {
				t.Fatal("attempts neither sent nor waiting")
			}
			runtime.Gosched()
		}
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

// The failures must fall in one interval: the same failures spread over
// many calm intervals are not an overload.
func TestDetectionPerInterval(t *testing.T) {
	c, clk := newController(t, Settings{})
	for range 10 {
		report(c, Answered, 10)
		report(c, Overloaded, 5)
		clk.Advance(DefaultInterval)
	}
	if c.State().Pacing {
		t.Fatal("pacing after 5 failures in each of 10 intervals")
	}
}

func TestCalmPathAllocatesNothing(t *testing.T) {
	c, _ := newController(t, Settings{})
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

// answerProbe sends a probe, which must go at once, and answers it.
func answerProbe(t *testing.T, c *Controller) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if d, err := c.Acquire(ctx); d != 0 || err != nil {
		t.Fatalf("probe: held %v, %v", d, err)
	}
	c.Done(Answered)
	confirmLoad(c)
}

// confirmLoad answers every attempt of the confirmation an answered probe
// began: the server took at the low rate what it refused at the high one,
// so the refusals were load, and the rate restarts.
func confirmLoad(c *Controller) {
	c.mu.Lock()
	k := c.ep.confirm.need
	c.mu.Unlock()
	_, file, line, _ := runtime.Caller(1)
	_, f2, l2, _ := runtime.Caller(2)
	println("KNEED", k, file[len(file)-20:], line, f2[len(f2)-20:], l2)
	report(c, Answered, k)
}

// A herd over a server that takes 20 per interval and then stays down:
// probes newest first, the first at once, four an interval early in the
// episode and then one per interval; once one is answered and the
// confirmation's batch too, 90 % of the measured capacity.
func TestHerdSequence(t *testing.T) {
	c, clk := newController(t, Settings{})
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
		clk.Advance(DefaultInterval / 4)
		if g := <-out; g.id != want || g.err != nil {
			t.Fatalf("early probe went to %d (%v), want %d", g.id, g.err, want)
		}
		c.Done(Overloaded) // the server is still down
	}
	clk.Advance(firstProbeIntervals * DefaultInterval)
	if got := rateOf(c); got != 1 {
		t.Fatalf("rate later in the episode = %v per interval, want 1 (a probe)", got)
	}
	probe() // the token that came meanwhile
	for id := 2; id < 5; id++ {
		acquireAsync(ctx, c, id, out)
		waitLine(t, c, id-1)
	}
	clk.Advance(DefaultInterval)
	if g := <-out; g.id != 4 || g.err != nil {
		t.Fatalf("next probe went to %d (%v), want the newest, 4", g.id, g.err)
	}
	c.Done(Overloaded)
	clk.Advance(DefaultInterval)
	if g := <-out; g.id != 3 {
		t.Fatalf("next probe went to %d, want 3", g.id)
	}
	c.Done(Answered) // it recovered,
	confirmLoad(c)   // and takes the confirmation's batch: restart at 90 % of 20
	if got := rateOf(c); got != 18 {
		t.Fatalf("rate after recovery = %v per interval, want 18", got)
	}
	clk.Advance(DefaultInterval / 10)
	if g := <-out; g.id != 2 || g.err != nil {
		t.Fatalf("last waiter: %+v", g)
	}
	if st := c.State(); st.Delayed != 5 || st.Shed != 0 {
		t.Errorf("delayed %d shed %d, want 5 and 0", st.Delayed, st.Shed)
	}
}

// calmThenFail runs perInterval answers for 30 intervals, then enough
// failures in the next to start pacing.
func calmThenFail(t *testing.T, perInterval int) (*Controller, *fakeClock) {
	t.Helper()
	c, clk := newController(t, Settings{})
	for range 30 {
		report(c, Answered, perInterval)
		clk.Advance(DefaultInterval)
	}
	report(c, Overloaded, 20)
	if !c.State().Pacing {
		t.Fatal("not pacing")
	}
	return c, clk
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
	clk.Advance(DefaultInterval) // collapsed
	if got := rateOf(c); got != firstProbes {
		t.Fatalf("collapsed rate = %v, want %v early in the episode", got, firstProbes)
	}
	answerProbe(t, c)
	if got := rateOf(c); got != 60 {
		t.Fatalf("first restart at %v per interval, want the sustained 60", got)
	}
	// 60 sent; the server takes 30 and refuses the rest: collapsed again.
	setCounts(c, 60, 60)
	report(c, Answered, 29) // and the answer that restarted it
	report(c, Overloaded, 30)
	clk.Advance(DefaultInterval)
	if got := rateOf(c); got != 1 {
		t.Fatalf("rate after a refused interval = %v, want 1", got)
	}
	// Two probes are refused: the server stays down 200ms more.
	for range 2 {
		if _, err := c.Acquire(context.Background()); err != nil {
			t.Fatal(err)
		}
		c.Done(Overloaded)
		clk.Advance(DefaultInterval)
	}
	answerProbe(t, c)
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
		clk.Advance(DefaultInterval)
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
	clk.Advance(DefaultInterval)
	answerProbe(t, c) // restart at 68
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
		clk.Advance(DefaultInterval)
	}
	if got := rateOf(c); got != 85 {
		t.Fatalf("rate = %v, want grown to 85", got)
	}
	setCounts(c, 80, 85)
	report(c, Answered, 85)
	clk.Advance(DefaultInterval)
	// 85 sent, and the server refuses nearly all.
	setCounts(c, 80, 85)
	report(c, Answered, 9)
	report(c, Overloaded, 76)
	clk.Advance(DefaultInterval)
	answerProbe(t, c)
	if got := rateOf(c); got != 76.5 {
		t.Fatalf("restart after the refused 85 at %v, want 76.5", got)
	}
	c.mu.Lock()
	first := c.ep.growAt.Sub(clk.Now())
	c.mu.Unlock()
	if first != DefaultHold {
		t.Fatalf("hold after one setback = %v, want %v", first, DefaultHold)
	}
	// Refused again at 76.5: the next restart holds twice as long.
	setCounts(c, 80, 77)
	report(c, Overloaded, 40)
	clk.Advance(DefaultInterval)
	answerProbe(t, c)
	c.mu.Lock()
	second := c.ep.growAt.Sub(clk.Now())
	c.mu.Unlock()
	if got := rateOf(c); got != 0.9*77 {
		t.Fatalf("restart after the refused 77 at %v, want %v", got, 0.9*77)
	}
	if second != 2*DefaultHold {
		t.Fatalf("hold after two setbacks = %v, want %v", second, 2*DefaultHold)
	}
}

// While the rate is below what the server sustained before the overload
// it may return there at any moment, so no waiter is shed on the wait the
// lower rate would give.
func TestNoSheddingBelowTheSustainedRate(t *testing.T) {
	c, clk := calmThenFail(t, 60)
	clk.Advance(DefaultInterval)
	answerProbe(t, c)
	setCounts(c, 60, 60)
	report(c, Overloaded, 60)
	clk.Advance(DefaultInterval)
	// Restarted at 54 with 60 arriving: the spare is 5.4 an interval, so a
	// waiter 20 places back would wait about 370ms, past its 100ms.
	answerProbe(t, c)
	c.mu.Lock()
	c.ep.lastIn, c.ep.tokens = 60, 0
	c.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	near, cancelNear := context.WithDeadline(ctx, clk.Now().Add(100*time.Millisecond))
	defer cancelNear()
	out := make(chan grant, 21)
	acquireAsync(near, c, 0, out)
	waitLine(t, c, 1)
	for id := 1; id <= 20; id++ {
		acquireAsync(ctx, c, id, out)
		waitLine(t, c, id+1)
	}
	if st := c.State(); st.Shed != 0 {
		t.Fatalf("shed %d below the sustained rate", st.Shed)
	}
	cancel()
	for range 21 {
		<-out
	}
}

// setCounts sets the current interval's arrivals and attempts let through,
// as if that many had called Acquire.
func setCounts(c *Controller, arrived, sent int) {
	c.mu.Lock()
	c.advanceLocked(c.s.Now()) // into the interval of now
	c.cur.arrived, c.cur.sent = arrived, sent
	c.mu.Unlock()
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
	c, clk := newController(t, Settings{})
	report(c, Answered, 20)
	report(c, Overloaded, 980)
	clk.Advance(DefaultInterval)
	answerProbe(t, c)
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
			clk.Advance(DefaultInterval)
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
	if tried := holds(18, false); tried.Sub(restart) < DefaultHold {
		t.Fatalf("capacity tried %v after the restart, want a Hold (%v) at least", tried.Sub(restart), DefaultHold)
	}
	if got := rateOf(c); math.Abs(got-top) > 1e-9 {
		t.Fatalf("tried at %v, want a quarter above the 18 that come (%.2f)", got, top)
	}
	for i := range 5 { // answers that land late
		markWaited(c)
		report(c, Answered, 21)
		setCounts(c, 18, 18)
		clk.Advance(DefaultInterval)
		if got := rateOf(c); math.Abs(got-top) > 1e-9 {
			t.Fatalf("interval %d (21 answers for 18 sent): rate = %v, want it held at %.2f", i, got, top)
		}
	}
	markWaited(c)
	report(c, Answered, 18)
	report(c, Overloaded, 3)
	setCounts(c, 21, 21)
	clk.Advance(DefaultInterval)
	refusal := clk.Now()
	if got := rateOf(c); math.Abs(got-16.2) > 1e-9 {
		t.Fatalf("after 3 refused beside 18 taken: rate = %v, want 16.2", got)
	}
	if tried := holds(16.2, true); tried.Sub(refusal) < DefaultHold {
		t.Fatalf("capacity tried again %v after the refusal, want a Hold (%v) at least", tried.Sub(refusal), DefaultHold)
	}
}

// markWaited makes the current interval one in which attempts waited.
func markWaited(c *Controller) {
	c.mu.Lock()
	c.cur.waited = true
	c.mu.Unlock()
}

// With nothing known (no throughput before, no capacity measured) a
// restart is a slow start.
func TestRestartWithNothingKnown(t *testing.T) {
	c, clk := newController(t, Settings{})
	report(c, Overloaded, 20)
	clk.Advance(DefaultInterval)
	answerProbe(t, c)
	if got := rateOf(c); got != 2 {
		t.Fatalf("restart = %v per interval, want a slow start at 2", got)
	}
}

// The confirmation's batch counts against the restarted rate for at most
// an interval: a slow start of 2 an interval after a batch of 4 owes 2
// tokens, and serves its line within two intervals (counted whole, the 4
// would hold it for two and a half).
func TestBatchCountsAgainstOneIntervalAtMost(t *testing.T) {
	c, clk := newController(t, Settings{})
	report(c, Overloaded, 20)
	clk.Advance(DefaultInterval) // collapsed, later than the first probe
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
	confirmLoad(c) // answered: a slow start at 2
	if got := rateOf(c); got != 2 {
		t.Fatalf("restart = %v per interval, want a slow start at 2", got)
	}
	clk.Advance(2 * DefaultInterval)
	if c.State().Waiting != 0 {
		t.Fatal("the waiter was not served within two intervals of the restart")
	}
	if g := <-out; g.err != nil {
		t.Fatalf("waiter: %v", g.err)
	}
}

// A pause in the calm stretch before an overload is not throughput: the
// restart returns to what the server took while the client was busy, and
// with too little known (less than an answer per interval) to a slow
// start, never to an average diluted by idle time. Such an average once
// restarted a client idle for ten minutes at one attempt per eight
// minutes, and its line never moved. Answers come spread over each
// interval, as they do.
func TestCalmPausesAreNotThroughput(t *testing.T) {
	type step = func(*Controller, *fakeClock)
	steady := func(intervals int, perInterval float64) step {
		return func(c *Controller, clk *fakeClock) {
			every := time.Duration(float64(DefaultInterval) / perInterval)
			for end := clk.Now().Add(time.Duration(intervals) * DefaultInterval); clk.Now().Before(end); clk.Advance(every) {
				c.Done(Answered)
			}
		}
	}
	idle := func(d time.Duration) step { return func(_ *Controller, clk *fakeClock) { clk.Advance(d) } }
	burst := func(n int) step { return func(c *Controller, _ *fakeClock) { report(c, Answered, n) } }
	for _, tc := range []struct {
		name  string
		calm  []step
		state bool    // a metrics reader closes the stretch between the steps
		want  float64 // the restart's rate per interval; 2 is a slow start
	}{
		{"steady", []step{steady(30, 60)}, false, 60},
		{"steady and low", []step{steady(50, 5)}, false, 5},
		{"steady and lower", []step{steady(100, 3)}, false, 3},
		{"a short pause is noise", []step{steady(15, 60), idle(5 * DefaultInterval), steady(15, 60)}, false, 1800.0 / 35},
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
			c, clk := newController(t, Settings{})
			for _, do := range tc.calm {
				do(c, clk)
				if tc.state {
					c.State()
				}
			}
			println("OKLOAD", tc.name, c.ok.Load())
			report(c, Overloaded, max(20, int(c.ok.Load()))) // at least as many refusals as answers
			if !c.Pacing() {
				t.Fatal("not pacing")
			}
			clk.Advance(DefaultInterval) // collapsed
			answerProbe(t, c)
			if got := rateOf(c); math.Abs(got-tc.want) > 0.02*tc.want {
				t.Errorf("restart = %v per interval, want %v", got, tc.want)
			}
		})
	}
}

func TestPacingEnds(t *testing.T) {
	c, clk := calmThenFail(t, 60)
	clk.Advance(DefaultInterval)
	answerProbe(t, c)
	for i := range DefaultCalm {
		if !c.State().Pacing {
			t.Fatalf("pacing ended after %d calm intervals, want %d", i, DefaultCalm)
		}
		report(c, Answered, 10)
		clk.Advance(DefaultInterval)
	}
	if c.State().Pacing {
		t.Fatal("still pacing after the calm intervals")
	}
	if d, err := c.Acquire(context.Background()); d != 0 || err != nil {
		t.Fatalf("calm Acquire = %v, %v", d, err)
	}
}

// A waiter whose deadline falls before its turn is shed at once; while
// the server is collapsed nobody is shed before their deadline. Its turn
// is told at what the server is known to take, as if nobody newer came:
// attempts that come above the rate (a herd's retries) may stop, and they
// did not count against a waiter's time. Counted at the spare above them
// (a tenth of the rate here), the waiter one place back from the newest
// was shed with 200ms to wait: a herd of 1000 calls with 30 s deadlines on
// a server that takes 20 per window, which a pacer that knew it served by
// 6 s, lost 460 of them so.
func TestShedding(t *testing.T) {
	c, clk := herdCollapsed(t)
	out := make(chan grant, 10)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if d, err := c.Acquire(ctx); d != 0 || err != nil { // the probe
		t.Fatalf("probe: %v, %v", d, err)
	}
	near, cancelNear := context.WithDeadline(ctx, clk.Now().Add(20*time.Millisecond))
	defer cancelNear()
	acquireAsync(near, c, 0, out)
	waitLine(t, c, 1)
	soon, cancelSoon := context.WithDeadline(ctx, clk.Now().Add(40*time.Millisecond))
	defer cancelSoon()
	acquireAsync(soon, c, 1, out)
	waitLine(t, c, 2)
	acquireAsync(ctx, c, 2, out)
	waitLine(t, c, 3)
	if st := c.State(); st.Shed != 0 {
		t.Fatalf("shed %d while collapsed", st.Shed)
	}
	// Recovery at 9 per interval (a token per 11ms), with 60 arrivals an
	// interval before: the oldest waiter, two places back from the
	// newest, has its turn in 33ms, past its 20ms; the one a place back
	// has its turn in 22ms, within its 40ms.
	c.mu.Lock()
	c.ep.lastIn = 60
	c.mu.Unlock()
	c.Done(Answered)
	confirmLoad(c)
	g := <-out
	if g.id != 0 || !errors.Is(g.err, ErrShed) {
		t.Fatalf("first result %+v, want 0 shed", g)
	}
	if st := c.State(); st.Shed != 1 || st.Waiting != 2 {
		t.Errorf("shed %d, waiting %d; want 1 and 2", st.Shed, st.Waiting)
	}
	cancel()
	for range 2 {
		if g := <-out; !errors.Is(g.err, context.Canceled) {
			t.Errorf("waiter %d: %v, want its context's error", g.id, g.err)
		}
	}
	if st := c.State(); st.Waiting != 0 {
		t.Errorf("waiting = %d after every waiter left", st.Waiting)
	}
}

// herdCollapsed is a fresh client (nothing sustained before, so its line
// never drains oldest first) whose first interval's herd the server took
// 10 of, collapsing.
func herdCollapsed(t *testing.T) (*Controller, *fakeClock) {
	t.Helper()
	c, clk := newController(t, Settings{})
	report(c, Answered, 10)
	report(c, Overloaded, 30)
	clk.Advance(DefaultInterval)
	if st := c.State(); !st.Pacing || !c.collapsed.Load() {
		t.Fatal("not collapsed after the herd")
	}
	return c, clk
}

// Answers during a slow start (nothing known before) are not taken as what
// the server sustains: the rate keeps growing, and nobody is shed on a
// guess of the wait.
func TestSlowStartLearnsNothing(t *testing.T) {
	c, clk := newController(t, Settings{})
	report(c, Overloaded, 20)
	clk.Advance(DefaultInterval)
	answerProbe(t, c) // restart: a slow start at 2, then one more per answer
	report(c, Answered, 9)
	clk.Advance(DefaultInterval)
	c.mu.Lock()
	known, free := c.known, c.freeLocked()
	c.mu.Unlock()
	if known != 0 || !math.IsInf(free, 1) {
		t.Errorf("after a slow start's interval: known %v, free %v; want 0 and +Inf", known, free)
	}
	if got := rateOf(c); got < 10 {
		t.Errorf("rate %v after 10 answers from 2, want it grown by one per answer", got)
	}
}

// A retry waits behind every waiter, even those that come after it.
func TestRetryWaitsAtTheBack(t *testing.T) {
	c, clk := newController(t, Settings{})
	report(c, Answered, 1) // a server that answered once: not down
	report(c, Overloaded, 20)
	// Collapsed, and later in the episode: one probe per interval.
	clk.Advance(firstProbeIntervals * DefaultInterval)
	// The probe.
	if _, err := c.Acquire(context.Background()); err != nil {
		t.Fatal(err)
	}
	out := make(chan grant, 3)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		_, err := c.AcquireRetry(ctx)
		out <- grant{0, err}
	}()
	waitLine(t, c, 1)
	acquireAsync(ctx, c, 1, out)
	waitLine(t, c, 2)
	acquireAsync(ctx, c, 2, out)
	waitLine(t, c, 3)
	for _, want := range []int{2, 1, 0} {
		clk.Advance(DefaultInterval)
		if g := <-out; g.id != want || g.err != nil {
			t.Fatalf("served %+v, want %d", g, want)
		}
	}
}

// Refusals below the ratio bring the rate down to Headroom of what the
// server took, and stop its growth; none of it is probing.
func TestFewRefusalsBringTheRateDown(t *testing.T) {
	c, clk := calmThenFail(t, 60)
	clk.Advance(DefaultInterval)
	answerProbe(t, c) // restart at 60
	markWaited(c)
	report(c, Answered, 49) // and the probe's answer: 50
	report(c, Overloaded, 10)
	clk.Advance(DefaultInterval)
	if got := rateOf(c); got != 45 {
		t.Fatalf("rate = %v, want 90 %% of the 50 taken", got)
	}
	if c.State().Waiting != 0 || c.collapsed.Load() {
		t.Fatal("few refusals started probing")
	}
}

// An attempt with less time left than every answer of the last interval
// took is shed rather than sent: at once when it asks, or when its turn
// comes, and its token goes to the next waiter. Answers of unknown time
// teach nothing.
func TestLateAttemptsAreShed(t *testing.T) {
	c, clk := calmThenFail(t, 60)
	clk.Advance(DefaultInterval)
	answerProbe(t, c) // restarts at 60 an interval
	for _, d := range []time.Duration{90 * time.Millisecond, 80 * time.Millisecond, 100 * time.Millisecond} {
		c.AnsweredAfter(d)
	}
	clk.Advance(DefaultInterval) // the last interval's answers took at least 80ms
	setBucket(c, 60, 10, 0)

	short, cancelShort := deadlineIn(clk, 79*time.Millisecond)
	defer cancelShort()
	if _, err := c.Acquire(short); !errors.Is(err, ErrShed) {
		t.Fatalf("79ms left, answers take 80ms: Acquire = %v, want ErrShed", err)
	}
	long, cancelLong := deadlineIn(clk, 2*time.Second)
	defer cancelLong()
	if _, err := c.Acquire(long); err != nil {
		t.Fatalf("2s left: Acquire = %v, want nil", err)
	}

	// At 5 an interval, nothing left in the bucket: an old waiter with
	// time, then a newer one with 95ms. The next token comes 20ms later,
	// for the newer one, which has 75ms left by then: it is shed, and the
	// token goes to the old one.
	setBucket(c, 5, 0, 0)
	out := make(chan grant, 3)
	acquireAsync(long, c, 0, out)
	waitLine(t, c, 1)
	tight, cancelTight := deadlineIn(clk, 95*time.Millisecond)
	defer cancelTight()
	acquireAsync(tight, c, 1, out)
	waitLine(t, c, 2)
	clk.Advance(DefaultInterval / 5)
	got := map[int]error{}
	for range 2 {
		g := <-out
		got[g.id] = g.err
	}
	if got[0] != nil || !errors.Is(got[1], ErrShed) {
		t.Fatalf("old waiter: %v, newer with 75ms left: %v; want nil and ErrShed", got[0], got[1])
	}
	if st := c.State(); st.Shed != 2 {
		t.Fatalf("shed %d, want 2", st.Shed)
	}

	// An interval without answers keeps the time; one whose answers are
	// not timed forgets it.
	clk.Advance(DefaultInterval)
	setBucket(c, 60, 10, 0)
	if _, err := c.Acquire(short); !errors.Is(err, ErrShed) {
		t.Fatalf("no answer in the last interval: Acquire = %v, want ErrShed", err)
	}
	c.Done(Answered)
	clk.Advance(DefaultInterval)
	setBucket(c, 60, 10, 0)
	if _, err := c.Acquire(short); err != nil {
		t.Fatalf("no answer timed in the last interval: Acquire = %v, want nil", err)
	}
}

// Shedding by wait counts the time answers take too: at 60 an interval
// the waiter's turn comes in about 1.7ms, and its answer 80ms later, past
// its 81ms.
func TestShedWaitCountsAnswerTime(t *testing.T) {
	c, clk := answersTook(t, 80*time.Millisecond)
	setBucket(c, 60, 0, 60)
	// At the sustained 60 the line drains, oldest first: the waiter's turn
	// is the next token, 1.7ms away, and its answer 80ms after that.
	ctx, cancel := deadlineIn(clk, 81*time.Millisecond)
	defer cancel()
	if _, err := c.Acquire(ctx); !errors.Is(err, ErrShed) {
		t.Fatalf("Acquire = %v, want ErrShed", err)
	}
}

// While answers take an Interval or more (the server keeps a queue of its
// own) the line is served oldest first, and a waiter is shed when the
// waiters kept ahead of it, then the answer time, leave it too late: the
// earliest deadlines that can still be met go first.
func TestOldestFirstWhileAnswersAreLate(t *testing.T) {
	c, clk := answersTook(t, 300*time.Millisecond)

	wantOldestFirst(t, c, clk)
	var cancels []context.CancelFunc
	defer func() {
		for _, cancel := range cancels {
			cancel()
		}
	}()

	// At 60, a token per 1.7ms: the oldest, with 304.5ms, goes first and
	// is answered at about 302ms; the next, with 302ms, would be answered
	// at about 303ms and is shed; the one after, with 2s, takes its place.
	// (Counted from the newest end instead, the oldest would have two
	// ahead of it and be shed too.)
	setBucket(c, 60, 0, 60)
	deadlines := []time.Duration{304500 * time.Microsecond, 302 * time.Millisecond, 2 * time.Second}
	out := make(chan grant, len(deadlines))
	for id, d := range deadlines {
		ctx, cancel := deadlineIn(clk, d)
		cancels = append(cancels, cancel)
		acquireAsync(ctx, c, id, out)
		waitLineOrShed(t, c, id+1)
	}
	if g := <-out; g.id != 1 || !errors.Is(g.err, ErrShed) {
		t.Fatalf("first result %+v, want waiter 1 shed", g)
	}
	clk.Advance(2 * time.Millisecond)
	if g := <-out; g.id != 0 || g.err != nil {
		t.Fatalf("first token went to %+v, want waiter 0", g)
	}
	clk.Advance(2 * time.Millisecond)
	if g := <-out; g.id != 2 || g.err != nil {
		t.Fatalf("second token went to %+v, want waiter 2", g)
	}
}

// An answer to an attempt sent while calm took at least as long as the
// pacing has lasted: 150ms into the episode, such an answer makes the
// answers of its interval take at least 150ms, so a caller with 140ms
// left is shed and the line is served oldest first, a whole queue's wait
// before a paced attempt's own answer would say so. An answer whose time
// is not known (Answered: a stream's) teaches nothing, and a timed answer
// that came sooner is the least time.
func TestAnswerSentCalmTookAtLeastTheEpisode(t *testing.T) {
	c, clk := calmThenFail(t, 60) // pacing began now
	clk.Advance(DefaultInterval + DefaultInterval/2)
	c.AnsweredSentCalm() // ends the collapse,
	confirmLoad(c)       // and the batch restarts it at 60 an interval
	clk.Advance(DefaultInterval)
	setBucket(c, 60, 10, 0)
	short, cancelShort := deadlineIn(clk, 140*time.Millisecond)
	defer cancelShort()
	if _, err := c.Acquire(short); !errors.Is(err, ErrShed) {
		t.Fatalf("140ms left, an answer sent before the episode 150ms ago: Acquire = %v, want ErrShed", err)
	}

	wantOldestFirst(t, c, clk)

	for _, tc := range []struct {
		name   string
		answer func()
	}{
		{"not timed", func() { c.Answered() }},
		{"timed sooner", func() { c.AnsweredSentCalm(); c.AnsweredAfter(20 * time.Millisecond) }},
	} {
		clk.Advance(DefaultInterval)
		tc.answer()
		clk.Advance(DefaultInterval)
		setBucket(c, 60, 10, 0)
		short, cancelShort := deadlineIn(clk, 140*time.Millisecond)
		defer cancelShort()
		if _, err := c.Acquire(short); err != nil {
			t.Fatalf("%s: 140ms left: Acquire = %v, want nil", tc.name, err)
		}
	}
}

// wantOldestFirst checks that c serves its line oldest first: at 5 an
// interval (below what is known: no shedding by wait), three waiters with
// time get a token every 20ms, oldest first.
func wantOldestFirst(t *testing.T, c *Controller, clk *fakeClock) {
	t.Helper()
	setBucket(c, 5, 0, 0)
	out := make(chan grant, 3)
	for id := range 3 {
		ctx, cancel := deadlineIn(clk, 2*time.Second)
		defer cancel()
		acquireAsync(ctx, c, id, out)
		waitLine(t, c, id+1)
	}
	for want := range 3 {
		clk.Advance(DefaultInterval / 5)
		if g := <-out; g.id != want || g.err != nil {
			t.Fatalf("token %d went to %+v, want waiter %d", want, g, want)
		}
	}
}

// answersTook is a controller that paces at the 60 an interval it
// sustained before, the answers of its last interval having taken d.
func answersTook(t *testing.T, d time.Duration) (*Controller, *fakeClock) {
	t.Helper()
	c, clk := calmThenFail(t, 60)
	clk.Advance(DefaultInterval)
	answerProbe(t, c)
	c.AnsweredAfter(d)
	clk.Advance(DefaultInterval)
	return c, clk
}

// setBucket sets the rate, the tokens left now and the arrivals of the
// last interval.
func setBucket(c *Controller, rate, tokens float64, lastIn int) {
	c.mu.Lock()
	c.advanceLocked(c.s.Now())
	c.ep.rate, c.ep.tokens, c.ep.lastIn = rate, tokens, lastIn
	c.mu.Unlock()
}

// deadlineIn is a context whose deadline is d away on clk, which also
// ends (cancelled) after 10s of real time, so that a test that would wait
// for it fails instead of hanging.
func deadlineIn(clk *fakeClock, d time.Duration) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithDeadline(context.Background(), clk.Now().Add(d))
	stop := time.AfterFunc(10*time.Second, cancel)
	return ctx, func() { stop.Stop(); cancel() }
}

// Once the server answers again at the rate it sustained before, the line
// drains: it is served oldest first, so that the tokens above the arrivals
// go to the callers who waited longest. A refusal turns it back to newest
// first within the same interval, and the retries of the refused attempts,
// at the old end, go last.
func TestLineDrainsOldestFirst(t *testing.T) {
	c, clk := calmThenFail(t, 10)
	clk.Advance(DefaultInterval) // collapsed
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if d, err := c.Acquire(ctx); d != 0 || err != nil { // the probe
		t.Fatalf("probe: %v, %v", d, err)
	}
	out := make(chan grant, 4)
	for id := range 4 {
		acquireAsync(ctx, c, id, out)
		waitLine(t, c, id+1)
	}
	c.Done(Answered) // the probe's answer,
	confirmLoad(c)   // and the batch's: restart at the sustained 10
	if got := rateOf(c); got != 10 {
		t.Fatalf("restart at %v per interval, want the sustained 10", got)
	}
	next := func() int {
		t.Helper()
		clk.Advance(DefaultInterval / 10) // a token
		g := <-out
		if g.err != nil {
			t.Fatalf("waiter %d: %v", g.id, g.err)
		}
		return g.id
	}
	for _, want := range []int{0, 1} {
		if id := next(); id != want {
			t.Fatalf("served %d, want %d (oldest first)", id, want)
		}
	}
	c.Done(Overloaded) // one refusal in this interval
	for _, want := range []int{3, 2} {
		if id := next(); id != want {
			t.Fatalf("after a refusal served %d, want %d (newest first)", id, want)
		}
	}
}

// Below the rate the server sustained before, the line does not drain
// (attempts come faster than before the overload was served), and it is
// served newest first.
func TestLineBelowTheSustainedRateIsNewestFirst(t *testing.T) {
	c, clk := calmThenFail(t, 10)
	clk.Advance(DefaultInterval)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := c.Acquire(ctx); err != nil {
		t.Fatal(err)
	}
	out := make(chan grant, 3)
	for id := range 3 {
		acquireAsync(ctx, c, id, out)
		waitLine(t, c, id+1)
	}
	c.mu.Lock()
	c.known = 5 // a setback lowered what the server is known to take
	c.mu.Unlock()
	c.Done(Answered)
	confirmLoad(c)
	if got := rateOf(c); got != 5 {
		t.Fatalf("restart at %v, want 5", got)
	}
	clk.Advance(DefaultInterval / 5) // a token
	if g := <-out; g.id != 2 || g.err != nil {
		t.Fatalf("first served %+v, want the newest, 2", g)
	}
	cancel()
	for range 2 {
		<-out
	}
}

// No waiter is shed on the wait the line would have in an interval in
// which the server refused attempts: the rate is about to come down or
// collapse, and the wait cannot be told.
func TestNoSheddingInARefusedInterval(t *testing.T) {
	// As in TestShedding, but with a refusal in the restart's interval.
	c, clk := herdCollapsed(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := c.Acquire(ctx); err != nil { // the probe
		t.Fatal(err)
	}
	out := make(chan grant, 3)
	near, cancelNear := context.WithDeadline(ctx, clk.Now().Add(50*time.Millisecond))
	defer cancelNear()
	acquireAsync(near, c, 0, out)
	waitLine(t, c, 1)
	for id := 1; id <= 2; id++ {
		acquireAsync(ctx, c, id, out)
		waitLine(t, c, id+1)
	}
	c.mu.Lock()
	c.ep.lastIn = 9 // arrivals as fast as the rate: no spare for the line
	c.mu.Unlock()
	c.Done(Overloaded) // a refusal in the interval of the restart
	c.Done(Answered)   // the probe's answer,
	confirmLoad(c)     // and the batch's: restart at 9
	if got := rateOf(c); got != 9 {
		t.Fatalf("restart at %v, want 90 %% of the 10 taken", got)
	}
	// The token goes to the newest; the oldest, whose 50ms the line could
	// not meet, stays while the interval shows a refusal.
	clk.Advance(DefaultInterval / 5) // a token (at most one is kept)
	if g := <-out; g.id != 2 || g.err != nil {
		t.Fatalf("first result %+v, want 2 served", g)
	}
	if st := c.State(); st.Shed != 0 || st.Waiting != 2 {
		t.Fatalf("shed %d, waiting %d in a refused interval; want 0 and 2", st.Shed, st.Waiting)
	}
	cancel()
	for range 2 {
		<-out
	}
}

// An interval whose answers outnumber its rate (tokens the bucket kept
// from the interval before, answers of attempts sent in it) raises what
// the server is known to take no higher than the rate: a rate held just
// under a capacity would otherwise creep past it, one answer an interval.
func TestLearningStopsAtTheRate(t *testing.T) {
	c, clk := calmThenFail(t, 60)
	clk.Advance(DefaultInterval)
	answerProbe(t, c) // restart at 60
	// 60 arrive and wait: after the hold the rate grows to where it and
	// the bucket's burst are a quarter above them.
	top := 1.25 * 60 / 1.1
	for range 12 {
		setCounts(c, 60, 0)
		markWaited(c)
		c.Done(Answered)
		clk.Advance(DefaultInterval)
	}
	if got := rateOf(c); math.Abs(got-top) > 1e-9 {
		t.Fatalf("rate = %v, want grown to %v", got, top)
	}
	for i := range 10 {
		setCounts(c, 60, 75) // 75 let through at 68.2, the burst included
		markWaited(c)
		report(c, Answered, 75)
		clk.Advance(DefaultInterval)
		c.mu.Lock()
		known, rate := c.known, c.ep.rate
		c.mu.Unlock()
		if known > top+1e-9 || rate > top+1e-9 {
			t.Fatalf("interval %d: known %v, rate %v: want neither past the rate of %v", i, known, rate, top)
		}
	}
}

// Past what is known, the rate grows toward a quarter above the attempts
// that come counted as their mean since its last step, not as the last
// interval's count: the rate only rises, and a step to each high of that
// count (63 or 64 of the 60 that came on average) took it past 72 in the
// storm lab's sticky cut, where it and the bucket's burst put more than
// the 80 the server takes into one of its windows now and then.
func TestGrowthFollowsTheMeanOfTheArrivals(t *testing.T) {
	c, clk := calmThenFail(t, 60)
	clk.Advance(DefaultInterval)
	answerProbe(t, c) // restart at 60
	top := 1.25 * 60 / 1.1
	// 57, 63, 60, 58, 62, 64, 56, ...: a mean of 60, highs of 64.
	noise := []int{-3, 3, 0, -2, 2, 4, -4}
	for i := range 80 {
		in := 60 + noise[i%len(noise)]
		setCounts(c, in, int(top))
		markWaited(c)
		report(c, Answered, int(top))
		clk.Advance(DefaultInterval)
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
			c, _ := newController(t, Settings{})
			for range DefaultMinFailures {
				c.TimedOut(tc.held, tc.left)
			}
			if got := c.State().Pacing; got != tc.pacing {
				t.Errorf("pacing after %d time-outs = %v, want %v", DefaultMinFailures, got, tc.pacing)
			}
		})
	}
}

// An outcome of the confirmation's batch that says nothing (a cancelled
// caller, a layer below that gave up, a caller whose time the line spent)
// does not hold the confirmation: the batch is judged on the outcomes it
// has, and a batch of which nothing is counted leaves the server collapsed
// and probed again, a later probe's answer starting a batch of its own.
// Before, the confirmation waited for an outcome in its place, one probe's
// worth per interval, while the line shed.
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
			c, clk := newController(t, Settings{})
			report(c, Overloaded, 20)
			clk.Advance(firstProbeIntervals * DefaultInterval) // collapsed, one probe per interval
			atOnce := func() bool {                            // an attempt goes at once, or not at all
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
			clk.Advance(DefaultInterval)
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
