package breaker_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard"
	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/internal/testutil"
)

func newBreaker(t *testing.T, s breaker.Settings) *breaker.Breaker {
	t.Helper()
	b, err := breaker.New("dns:///pay", s)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return b
}

// run makes one call through b that returns v, and reports whether it ran.
func run(t *testing.T, b *breaker.Breaker, v herdguard.Verdict) (ran, probe bool, err error) {
	t.Helper()
	_, _, err = b.Execute(func(p bool) herdguard.Verdict { ran, probe = true, p; return v })
	return ran, probe, err
}

func TestTripsOnConsecutiveFailedCalls(t *testing.T) {
	b := newBreaker(t, breaker.Settings{ConsecutiveFailures: 3})
	for i := range 2 {
		run(t, b, herdguard.Failure)
		if got := b.State(); got != breaker.Closed {
			t.Fatalf("after %d failures: state %v, want closed", i+1, got)
		}
	}
	run(t, b, herdguard.Success) // a success breaks the run
	run(t, b, herdguard.Failure)
	run(t, b, herdguard.Failure)
	if got := b.State(); got != breaker.Closed {
		t.Fatalf("2 failures after a success: state %v, want closed", got)
	}
	run(t, b, herdguard.Ignored) // a cancelled call neither breaks nor extends the run
	if got := b.State(); got != breaker.Closed {
		t.Fatalf("after an ignored call: state %v, want closed", got)
	}
	_, _, err := run(t, b, herdguard.Failure)
	if err != nil {
		t.Fatalf("the call that trips the breaker ran and must not be refused: %v", err)
	}
	if got := b.State(); got != breaker.Open {
		t.Fatalf("after 3 failures in a row: state %v, want open", got)
	}

	ran, _, err := run(t, b, herdguard.Success)
	if ran {
		t.Fatal("an open breaker ran the call")
	}
	if !errors.Is(err, breaker.ErrOpen) {
		t.Fatalf("err = %v, want one wrapping ErrOpen", err)
	}
	if got := status.Code(err); got != codes.Unavailable {
		t.Errorf("status.Code(err) = %v, want Unavailable", got)
	}
	if !strings.Contains(err.Error(), "dns:///pay") {
		t.Errorf("err = %q, want it to name the scope", err)
	}
	var oe *breaker.OpenError
	if !errors.As(err, &oe) || oe.State != breaker.Open || oe.Scope != "dns:///pay" {
		t.Errorf("err = %#v, want *OpenError{Scope: dns:///pay, State: open}", err)
	}
}

func TestIgnoredCallsNeverTrip(t *testing.T) {
	b := newBreaker(t, breaker.Settings{ConsecutiveFailures: 1})
	for range 20 {
		run(t, b, herdguard.Ignored)
	}
	if got := b.State(); got != breaker.Closed {
		t.Fatalf("state %v after ignored calls, want closed", got)
	}
}

func TestOpenTimeoutThenProbe(t *testing.T) {
	clk := testutil.NewClock(time.Now())
	var changes []string
	b := newBreaker(t, breaker.Settings{
		Now:                 clk.Now,
		ConsecutiveFailures: 1,
		OpenTimeout:         2 * time.Second,
		OnStateChange: func(scope string, from, to breaker.State, c breaker.Counts) {
			changes = append(changes, fmt.Sprintf("%s: %v->%v %d/%d", scope, from, to, c.ConsecutiveFailures, c.ConsecutiveSuccesses))
		},
	})
	before, after, _ := b.Execute(func(bool) herdguard.Verdict { return herdguard.Failure })
	if before != breaker.Closed || after != breaker.Open {
		t.Errorf("tripping call saw %v -> %v, want closed -> open", before, after)
	}
	clk.Advance(2*time.Second - time.Nanosecond)
	if ran, _, err := run(t, b, herdguard.Success); ran || err == nil {
		t.Fatalf("just before OpenTimeout: ran=%v err=%v, want refused", ran, err)
	}
	clk.Advance(2 * time.Nanosecond)
	ran, probe, err := run(t, b, herdguard.Success)
	if !ran || !probe || err != nil {
		t.Fatalf("after OpenTimeout: ran=%v probe=%v err=%v, want a probe that runs", ran, probe, err)
	}
	if got := b.State(); got != breaker.Closed {
		t.Fatalf("after a good probe: state %v, want closed", got)
	}
	if _, probe, _ := run(t, b, herdguard.Success); probe {
		t.Error("a call through a closed breaker was told it is a probe")
	}
	// Each transition with the counts it was judged on: the failure
	// that tripped it, nothing while open, the good probe.
	want := []string{"dns:///pay: closed->open 1/0", "dns:///pay: open->half-open 0/0", "dns:///pay: half-open->closed 0/1"}
	if strings.Join(changes, "|") != strings.Join(want, "|") {
		t.Errorf("OnStateChange calls = %q, want %q", changes, want)
	}
}

func TestFailedProbeReopens(t *testing.T) {
	clk := testutil.NewClock(time.Now())
	b := newBreaker(t, breaker.Settings{Now: clk.Now, ConsecutiveFailures: 1, OpenTimeout: time.Second})
	run(t, b, herdguard.Failure)
	clk.Advance(time.Second + time.Nanosecond)
	if ran, probe, _ := run(t, b, herdguard.Failure); !ran || !probe {
		t.Fatalf("ran=%v probe=%v, want a probe", ran, probe)
	}
	if got := b.State(); got != breaker.Open {
		t.Fatalf("after a failed probe: state %v, want open", got)
	}
	// and the open period starts again
	clk.Advance(time.Second - time.Nanosecond)
	if ran, _, _ := run(t, b, herdguard.Success); ran {
		t.Fatal("reopened breaker let a call through before a new OpenTimeout")
	}
}

// Each failed probe doubles the open period, up to MaxOpenTimeout; a probe
// that succeeds closes the breaker and the next trip starts short again.
func TestOpenPeriodGrows(t *testing.T) {
	clk := testutil.NewClock(time.Now())
	b := newBreaker(t, breaker.Settings{Now: clk.Now, ConsecutiveFailures: 1, OpenTimeout: time.Second, MaxOpenTimeout: 3 * time.Second})
	run(t, b, herdguard.Failure)
	for i, open := range []time.Duration{time.Second, 2 * time.Second, 3 * time.Second, 3 * time.Second} {
		clk.Advance(open - time.Nanosecond)
		if ran, _, _ := run(t, b, herdguard.Success); ran {
			t.Fatalf("trip %d: a call ran before the open period of %v ended", i, open)
		}
		if got := b.State(); got != breaker.Open {
			t.Fatalf("trip %d: state %v before the period ended, want open", i, got)
		}
		clk.Advance(2 * time.Nanosecond)
		if ran, probe, _ := run(t, b, herdguard.Failure); !ran || !probe {
			t.Fatalf("trip %d: ran=%v probe=%v after %v, want a probe", i, ran, probe, open)
		}
	}
	clk.Advance(3 * time.Second)
	if ran, probe, _ := run(t, b, herdguard.Success); !ran || !probe {
		t.Fatalf("ran=%v probe=%v, want a probe that closes", ran, probe)
	}
	run(t, b, herdguard.Failure) // trips again: back to a short period
	clk.Advance(time.Second + time.Nanosecond)
	if ran, probe, _ := run(t, b, herdguard.Success); !ran || !probe {
		t.Fatalf("after closing, the open period did not start again from OpenTimeout: ran=%v probe=%v", ran, probe)
	}
}

func TestHalfOpenLimitsProbes(t *testing.T) {
	clk := testutil.NewClock(time.Now())
	b := newBreaker(t, breaker.Settings{Now: clk.Now, ConsecutiveFailures: 1, OpenTimeout: time.Second, HalfOpenMaxRequests: 2})
	run(t, b, herdguard.Failure)
	clk.Advance(2 * time.Second)

	release, started := make(chan struct{}), make(chan struct{})
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			b.Execute(func(probe bool) herdguard.Verdict {
				if !probe {
					t.Error("a half-open call was not told it is a probe")
				}
				started <- struct{}{}
				<-release
				return herdguard.Success
			})
		})
	}
	<-started
	<-started // both probes are in flight
	ran, _, err := run(t, b, herdguard.Success)
	var oe *breaker.OpenError
	if ran || !errors.As(err, &oe) || oe.State != breaker.HalfOpen {
		t.Fatalf("third call while 2 probes run: ran=%v err=%v, want refused as half-open", ran, err)
	}
	if !errors.Is(err, breaker.ErrOpen) || !strings.Contains(err.Error(), "half-open") {
		t.Errorf("err = %q, want ErrOpen saying half-open", err)
	}
	close(release)
	wg.Wait()
	if got := b.State(); got != breaker.Closed {
		t.Fatalf("after 2 good probes: state %v, want closed", got)
	}
}

func TestFailureRatio(t *testing.T) {
	b := newBreaker(t, breaker.Settings{ConsecutiveFailures: 100, FailureRatio: 0.5, MinRequests: 4})
	for _, v := range []herdguard.Verdict{herdguard.Failure, herdguard.Success, herdguard.Failure} {
		run(t, b, v)
	}
	if got := b.State(); got != breaker.Closed {
		t.Fatalf("2 of 3 failed but MinRequests is 4: state %v, want closed", got)
	}
	run(t, b, herdguard.Ignored) // does not count towards MinRequests
	if got := b.State(); got != breaker.Closed {
		t.Fatalf("an ignored call counted: state %v, want closed", got)
	}
	run(t, b, herdguard.Success)
	if got := b.State(); got != breaker.Closed {
		t.Fatalf("a success cannot trip: state %v", got)
	}
	run(t, b, herdguard.Failure) // 3 of 5 failed
	if got := b.State(); got != breaker.Open {
		t.Fatalf("3 of 5 failed with ratio 0.5: state %v, want open", got)
	}
}

func TestWindowForgetsOldFailures(t *testing.T) {
	clk := testutil.NewClock(time.Now())
	b := newBreaker(t, breaker.Settings{Now: clk.Now, ConsecutiveFailures: 100, FailureRatio: 0.5, MinRequests: 2, Window: 10 * time.Second})
	run(t, b, herdguard.Success)
	run(t, b, herdguard.Success)
	run(t, b, herdguard.Failure) // 1 of 3
	clk.Advance(11 * time.Second)
	run(t, b, herdguard.Failure) // the old calls rolled out: 1 of 1, below MinRequests
	if got := b.State(); got != breaker.Closed {
		t.Fatalf("state %v, want closed", got)
	}
	run(t, b, herdguard.Failure) // 2 of 2 in the window
	if got := b.State(); got != breaker.Open {
		t.Fatalf("2 of 2 failed in the window: state %v, want open", got)
	}
}

// TestWindowRolls: the Window rolls by tenths, on the breaker's clock: a
// call leaves it a Window after it came, not when a fixed period ends.
func TestWindowRolls(t *testing.T) {
	clk := testutil.NewClock(time.Now())
	b := newBreaker(t, breaker.Settings{Now: clk.Now, ConsecutiveFailures: 100, FailureRatio: 0.5, MinRequests: 2, Window: 10 * time.Second})
	run(t, b, herdguard.Success)
	run(t, b, herdguard.Success)
	clk.Advance(6 * time.Second)
	run(t, b, herdguard.Failure) // 1 of 3
	clk.Advance(5 * time.Second)
	if got := b.State(); got != breaker.Closed {
		t.Fatalf("state %v, want closed", got)
	}
	run(t, b, herdguard.Failure) // the successes left 11 s after they came; the failure of 5 s ago stays: 2 of 2
	if got := b.State(); got != breaker.Open {
		t.Fatalf("2 of 2 failed within the last 10 s: state %v, want open", got)
	}
}

func TestSettingsValidate(t *testing.T) {
	tests := []struct {
		s          breaker.Settings
		field, val string
	}{
		{breaker.Settings{FailureRatio: -0.1}, "FailureRatio", "-0.1"},
		{breaker.Settings{FailureRatio: 1.5}, "FailureRatio", "1.5"},
		{breaker.Settings{Window: -time.Second}, "Window", "-1s"},
		{breaker.Settings{Window: 5}, "Window", "5ns"},
		{breaker.Settings{OpenTimeout: -time.Second}, "OpenTimeout", "-1s"},
		{breaker.Settings{MaxOpenTimeout: -time.Second}, "MaxOpenTimeout", "-1s"},
		{breaker.Settings{OpenTimeout: 2 * time.Second, MaxOpenTimeout: time.Second}, "MaxOpenTimeout", "below OpenTimeout (2s)"},
		{breaker.Settings{Scope: 3}, "Scope", "3"},
		{breaker.Settings{DownAfter: -time.Second}, "DownAfter", "-1s"},
	}
	for _, tt := range tests {
		err := tt.s.Validate()
		if err == nil || !strings.Contains(err.Error(), tt.field) || !strings.Contains(err.Error(), tt.val) {
			t.Errorf("Validate(%+v) = %v, want an error naming %s and %s", tt.s, err, tt.field, tt.val)
		}
		if _, err := breaker.New("x", tt.s); err == nil {
			t.Errorf("New accepted %+v", tt.s)
		}
		if _, err := breaker.NewGroup(tt.s); err == nil {
			t.Errorf("NewGroup accepted %+v", tt.s)
		}
	}
	if err := (breaker.Settings{}).Validate(); err != nil {
		t.Errorf("zero Settings: %v", err)
	}
	d := breaker.Settings{}.WithDefaults()
	if d.ConsecutiveFailures != 5 || d.DownAfter != time.Second || d.MinRequests != 10 || d.Window != 10*time.Second ||
		d.OpenTimeout != 500*time.Millisecond || d.MaxOpenTimeout != 10*time.Second || d.HalfOpenMaxRequests != 1 || d.Scope != breaker.PerTarget {
		t.Errorf("defaults = %+v", d)
	}
	// An explicit count keeps its meaning: a run of that many, however
	// quick, with no DownAfter unless it is set too.
	if d := (breaker.Settings{ConsecutiveFailures: 10}).WithDefaults(); d.ConsecutiveFailures != 10 || d.DownAfter != 0 {
		t.Errorf("defaults of an explicit count = %+v, want 10 and no DownAfter", d)
	}
	if d := (breaker.Settings{DownAfter: 2 * time.Second}).WithDefaults(); d.ConsecutiveFailures != 5 || d.DownAfter != 2*time.Second {
		t.Errorf("defaults with DownAfter = %+v, want 5 and 2s", d)
	}
}

// The default breaker trips on evidence that nothing succeeds: a run of 5
// failed calls that has lasted DownAfter (1 s) from its first failure. A
// server that fails a share of its calls on its own, however many, makes
// runs of 5 often but never one that long at any rate of calls: before,
// 5 failed calls in a row tripped it, and a server that fails two attempts
// in three (30 % of calls after 3 attempts) had it open for 500ms every
// few hundred calls. The failures can come at once (a dead server) or
// slowly (a hung one): the run's length counts, not how they came.
func TestDefaultTripsOnlyWhenNothingSucceeds(t *testing.T) {
	clk := testutil.NewClock(time.Now())
	b := newBreaker(t, breaker.Settings{Now: clk.Now})
	// 50 failed calls in a row within 900ms: not yet.
	for range 50 {
		run(t, b, herdguard.Failure)
		clk.Advance(18 * time.Millisecond)
	}
	if got := b.State(); got != breaker.Closed {
		t.Fatalf("a run of 50 failures over 900ms: %v, want closed", got)
	}
	run(t, b, herdguard.Success) // the run ends, and the next starts afresh
	for range 55 {
		run(t, b, herdguard.Failure)
		clk.Advance(18 * time.Millisecond)
	}
	if got := b.State(); got != breaker.Closed {
		t.Fatalf("a new run of 55 over 990ms after a success: %v, want closed", got)
	}
	clk.Advance(10 * time.Millisecond)
	run(t, b, herdguard.Failure) // 1 s since the run's first failure
	if got := b.State(); got != breaker.Open {
		t.Fatalf("a run of failures that lasted 1s: %v, want open", got)
	}
}

// At a low rate of calls the count decides: 4 failures spread over 2 s
// are not a run of 5.
func TestDefaultRunNeedsItsCount(t *testing.T) {
	clk := testutil.NewClock(time.Now())
	b := newBreaker(t, breaker.Settings{Now: clk.Now})
	for range 4 {
		run(t, b, herdguard.Failure)
		clk.Advance(500 * time.Millisecond)
	}
	if got := b.State(); got != breaker.Closed {
		t.Fatalf("4 failures over 2s: %v, want closed", got)
	}
	run(t, b, herdguard.Failure)
	if got := b.State(); got != breaker.Open {
		t.Fatalf("5 failures over 2s: %v, want open", got)
	}
}

// A server that fails 30 % of its calls on its own (two attempts in three,
// with 3 attempts a call) at 600 calls a second never trips the default
// breaker, in 60 s of calls; with ConsecutiveFailures 5, the rule before,
// it trips every few hundred calls.
func TestDefaultIgnoresIndependentFailures(t *testing.T) {
	for _, tc := range []struct {
		name  string
		s     breaker.Settings
		trips bool
	}{{"default", breaker.Settings{}, false}, {"ConsecutiveFailures 5", breaker.Settings{ConsecutiveFailures: 5}, true}} {
		t.Run(tc.name, func(t *testing.T) {
			clk := testutil.NewClock(time.Now())
			var opened int
			s := tc.s
			s.OnStateChange = func(_ string, _, to breaker.State, _ breaker.Counts) {
				if to == breaker.Open {
					opened++
				}
			}
			s.Now = clk.Now
			b := newBreaker(t, s)
			rng := rand.New(rand.NewPCG(1, 2))
			for range 600 * 60 {
				v := herdguard.Success
				if rng.Float64() < 0.3 {
					v = herdguard.Failure
				}
				run(t, b, v)
				clk.Advance(time.Second / 600)
			}
			if (opened > 0) != tc.trips {
				t.Errorf("opened %d times in 60 s, want trips: %v", opened, tc.trips)
			}
		})
	}
}

func TestGroupScopes(t *testing.T) {
	g, _ := breaker.NewGroup(breaker.Settings{})
	a, b := g.Get("t1", "/s.S/A"), g.Get("t1", "/s.S/B")
	if a != b || a.Scope() != "t1" {
		t.Errorf("PerTarget: different methods got different breakers (%q, %q)", a.Scope(), b.Scope())
	}
	if g.Get("t2", "/s.S/A") == a {
		t.Error("PerTarget: two targets share a breaker")
	}

	g, _ = breaker.NewGroup(breaker.Settings{Scope: breaker.PerMethod})
	a, b = g.Get("t1", "/s.S/A"), g.Get("t1", "/s.S/B")
	if a == b {
		t.Error("PerMethod: two methods share a breaker")
	}
	if a != g.Get("t1", "/s.S/A") || a.Scope() != "t1/s.S/A" {
		t.Errorf("PerMethod: scope %q, or a second Get made a new breaker", a.Scope())
	}
	n := 0
	g.Each(func(*breaker.Breaker) { n++ })
	if n != 2 {
		t.Errorf("Each saw %d breakers, want 2", n)
	}
}

// Finding a breaker again, whether the scope is the last one found or
// another, gives the same breaker and allocates nothing.
func TestGroupGetAlternating(t *testing.T) {
	g, _ := breaker.NewGroup(breaker.Settings{Scope: breaker.PerMethod})
	scopes := [][2]string{{"t1", "/s.S/A"}, {"t1", "/s.S/B"}, {"t2", "/s.S/A"}, {"t1", "/s.S/A"}}
	first := map[[2]string]*breaker.Breaker{}
	for range 3 {
		for _, sc := range scopes {
			b := g.Get(sc[0], sc[1])
			if want, ok := first[sc]; ok && b != want {
				t.Fatalf("Get%q gave another breaker than the first time", sc)
			}
			first[sc] = b
			if b.Scope() != sc[0]+sc[1] {
				t.Errorf("Get%q: scope %q", sc, b.Scope())
			}
		}
	}
	if len(first) != 3 || first[scopes[0]] == first[scopes[1]] || first[scopes[0]] == first[scopes[2]] {
		t.Errorf("want 3 distinct breakers for 3 scopes, got %v", first)
	}
	if n := testing.AllocsPerRun(100, func() {
		for _, sc := range scopes {
			g.Get(sc[0], sc[1])
		}
	}); n != 0 {
		t.Errorf("Get of existing scopes, alternating: %v allocations, want 0", n)
	}
}

func TestGroupConcurrentGet(t *testing.T) {
	g, _ := breaker.NewGroup(breaker.Settings{})
	got := make([]*breaker.Breaker, 64)
	var wg sync.WaitGroup
	for i := range got {
		wg.Go(func() { got[i] = g.Get("t", "/s.S/M") })
	}
	wg.Wait()
	for i, b := range got {
		if b != got[0] {
			t.Fatalf("goroutine %d got another breaker for the same scope", i)
		}
	}
}

func TestStrings(t *testing.T) {
	for s, want := range map[breaker.State]string{breaker.Closed: "closed", breaker.HalfOpen: "half-open", breaker.Open: "open", 9: "State(9)"} {
		if s.String() != want {
			t.Errorf("State(%d).String() = %q, want %q", int(s), s.String(), want)
		}
	}
	for _, name := range []string{"target", "method"} {
		s, err := breaker.ParseScope(name)
		if err != nil || s.String() != name {
			t.Errorf("ParseScope(%q) = %v, %v", name, s, err)
		}
	}
	if _, err := breaker.ParseScope("host"); err == nil {
		t.Error("ParseScope(host) = nil error")
	}
}

func TestAllowCountsTheLaterVerdict(t *testing.T) {
	clk := testutil.NewClock(time.Now())
	b := newBreaker(t, breaker.Settings{Now: clk.Now, ConsecutiveFailures: 2, OpenTimeout: time.Second})
	run(t, b, herdguard.Failure) // a run of one failure: Allow goes through gobreaker
	done, probe, err := b.Allow()
	if err != nil || probe {
		t.Fatalf("Allow on a closed breaker: probe=%v err=%v", probe, err)
	}
	if b.State() != breaker.Closed {
		t.Fatal("the breaker moved before the verdict came")
	}
	done(herdguard.Failure)
	done(herdguard.Failure) // a second call does nothing
	if got := b.State(); got != breaker.Open {
		t.Fatalf("after 2 failed calls: state %v, want open", got)
	}
	if _, _, err := b.Allow(); !errors.Is(err, breaker.ErrOpen) {
		t.Fatalf("Allow on an open breaker: %v, want ErrOpen", err)
	}
	// the same breaker refuses unary calls too
	if ran, _, _ := run(t, b, herdguard.Success); ran {
		t.Fatal("Execute ran through a breaker that streams opened")
	}
	clk.Advance(time.Second + time.Nanosecond)
	done, probe, err = b.Allow()
	if err != nil || !probe {
		t.Fatalf("after OpenTimeout: probe=%v err=%v, want a probe", probe, err)
	}
	if _, _, err := b.Allow(); err == nil {
		t.Fatal("a second stream got through while the only probe is pending")
	}
	if ran, _, _ := run(t, b, herdguard.Success); ran {
		t.Fatal("a unary call got through while the only probe is pending")
	}
	done(herdguard.Success) // counted when done returns
	if got := b.State(); got != breaker.Closed {
		t.Fatalf("after a good probe: state %v, want closed", got)
	}
}

func TestAllowIgnoredFreesTheProbe(t *testing.T) {
	clk := testutil.NewClock(time.Now())
	b := newBreaker(t, breaker.Settings{Now: clk.Now, ConsecutiveFailures: 1, OpenTimeout: time.Second})
	run(t, b, herdguard.Failure)
	clk.Advance(time.Second + time.Nanosecond)
	done, probe, err := b.Allow()
	if err != nil || !probe {
		t.Fatalf("after OpenTimeout: probe=%v err=%v, want a probe", probe, err)
	}
	done(herdguard.Ignored) // the caller gave up: the probe says nothing
	if got := b.State(); got != breaker.HalfOpen {
		t.Fatalf("after an ignored probe: state %v, want half-open", got)
	}
	done, probe, err = b.Allow()
	if err != nil || !probe {
		t.Fatalf("after an ignored probe: probe=%v err=%v, want another probe", probe, err)
	}
	done(herdguard.Failure)
	if got := b.State(); got != breaker.Open {
		t.Fatalf("after a failed probe: state %v, want open", got)
	}
}

func TestAllowOnAQuietBreaker(t *testing.T) {
	clk := testutil.NewClock(time.Now())
	b := newBreaker(t, breaker.Settings{Now: clk.Now, ConsecutiveFailures: 2})
	done, probe, err := b.Allow()
	if err != nil || probe {
		t.Fatalf("closed breaker: probe=%v err=%v", probe, err)
	}
	done(herdguard.Success)
	done(herdguard.Failure) // too late: the verdict was given
	if c := b.Counts(); c.TotalFailures != 0 {
		t.Fatalf("a second verdict was counted: %+v", c)
	}
	for i := range 2 {
		done, _, err := b.Allow()
		if err != nil {
			t.Fatalf("stream %d refused: %v", i+1, err)
		}
		done(herdguard.Failure)
		done(herdguard.Failure) // a second call does nothing
		if c := b.Counts(); i == 0 && c.ConsecutiveFailures != 1 {
			t.Fatalf("after %d failed streams: counts %+v", i+1, c)
		}
	}
	if got := b.State(); got != breaker.Open {
		t.Fatalf("2 failed streams in a row left the breaker %v", got)
	}
}

// TestAllowStartsNoGoroutine: a stream's admission through gobreaker holds
// its place with gobreaker's two-step breaker, not with a goroutine that
// waits for the verdict.
func TestAllowStartsNoGoroutine(t *testing.T) {
	b := newBreaker(t, breaker.Settings{ConsecutiveFailures: 3})
	run(t, b, herdguard.Failure) // a failure on the run: Allow goes through gobreaker
	before := runtime.NumGoroutine()
	var dones []func(herdguard.Verdict)
	for range 50 {
		done, _, err := b.Allow()
		if err != nil {
			t.Fatal(err)
		}
		dones = append(dones, done)
	}
	if after := runtime.NumGoroutine(); after > before {
		t.Errorf("%d goroutines after 50 pending admissions, %d before", after, before)
	}
	for _, done := range dones {
		done(herdguard.Success)
	}
}

func TestCalm(t *testing.T) {
	for _, s := range []breaker.Settings{{ConsecutiveFailures: 3}, {ConsecutiveFailures: 3, FailureRatio: 0.9}} {
		b := newBreaker(t, s)
		if !b.Calm() {
			t.Errorf("%+v: a new breaker is not calm", s)
		}
		run(t, b, herdguard.Failure)
		if b.Calm() {
			t.Errorf("%+v: calm with a failure on its run", s)
		}
		run(t, b, herdguard.Success)
		if !b.Calm() {
			t.Errorf("%+v: not calm after a success ended the run", s)
		}
		for range 3 {
			run(t, b, herdguard.Failure)
		}
		if b.State() != breaker.Open || b.Calm() {
			t.Errorf("%+v: %v and calm=%v after 3 failures, want open and not calm", s, b.State(), b.Calm())
		}
	}
}

// A run of failed calls trips the breaker at its count however slowly the
// failures come, its first ones older than the Window included: the
// Window forgets old calls for FailureRatio, never a run that no success
// has broken. Each case spreads 5 failures over 12 s, past the 10 s
// Window.
func TestSlowRunTripsAtItsCount(t *testing.T) {
	for _, tc := range []struct {
		name string
		s    breaker.Settings
	}{
		{"the default rule", breaker.Settings{}},
		{"ConsecutiveFailures 5", breaker.Settings{ConsecutiveFailures: 5}},
		{"ConsecutiveFailures 5 with a ratio", breaker.Settings{ConsecutiveFailures: 5, FailureRatio: 0.9, MinRequests: 100}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := testutil.NewClock(time.Now())
			if w := tc.s.WithDefaults().Window; w != 10*time.Second {
				t.Fatalf("Window %v, want the default 10s", w)
			}
			s := tc.s
			s.Now = clk.Now
			b := newBreaker(t, s)
			for i := range 4 {
				run(t, b, herdguard.Failure)
				if got := b.State(); got != breaker.Closed {
					t.Fatalf("after %d failures: %v, want closed", i+1, got)
				}
				clk.Advance(3 * time.Second)
			}
			run(t, b, herdguard.Failure)
			if got := b.State(); got != breaker.Open {
				t.Fatalf("5 failures in a row over 12s: %v, want open", got)
			}
		})
	}
}

// A refusal says how long the breaker stays open: its OpenError's
// RetryAfter, and its message. After a failed probe the period doubles,
// and so does what the refusal says.
func TestOpenErrorSaysHowLong(t *testing.T) {
	clk := testutil.NewClock(time.Now())
	b := newBreaker(t, breaker.Settings{Now: clk.Now, ConsecutiveFailures: 1, OpenTimeout: time.Second, MaxOpenTimeout: 10 * time.Second})
	refusal := func() *breaker.OpenError {
		t.Helper()
		ran, _, err := run(t, b, herdguard.Success)
		var oe *breaker.OpenError
		if ran || !errors.As(err, &oe) {
			t.Fatalf("ran %v, err %v; want a refusal", ran, err)
		}
		return oe
	}
	run(t, b, herdguard.Failure)
	clk.Advance(300 * time.Millisecond)
	oe := refusal()
	if oe.State != breaker.Open || oe.RetryAfter != 700*time.Millisecond {
		t.Errorf("refusal %+v, want open with RetryAfter 700ms", oe)
	}
	if want := "is open for 700ms more"; !strings.Contains(oe.Error(), want) {
		t.Errorf("message %q, want it to say %q", oe.Error(), want)
	}
	clk.Advance(701 * time.Millisecond)                      // past the open period
	if _, probe, _ := run(t, b, herdguard.Failure); !probe { // the probe fails: 2 s open
		t.Fatal("no probe after the open period")
	}
	clk.Advance(500 * time.Millisecond)
	if oe := refusal(); oe.RetryAfter != 1500*time.Millisecond {
		t.Errorf("after a failed probe: RetryAfter %v, want 1.5s of the doubled 2s", oe.RetryAfter)
	}
}
