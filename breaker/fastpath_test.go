package breaker

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sony/gobreaker/v2"

	"github.com/herdguard/herdguard"
	"github.com/herdguard/herdguard/internal/testutil"
)

// TestFastPathMatchesTheSlowPath drives a Breaker and a reference with the
// same settings whose every call goes through gobreaker (no fast path)
// through the same long random sequence of calls and pauses on a fake
// clock, and checks after every call that both let the same calls through,
// as probes or not, and hold the same state and failure counts. With
// FailureRatio set there is no fast path and every count must match.
func TestFastPathMatchesTheSlowPath(t *testing.T) {
	settings := []Settings{
		{ConsecutiveFailures: 1},
		{ConsecutiveFailures: 3},
		{ConsecutiveFailures: 5, HalfOpenMaxRequests: 3},
		{ConsecutiveFailures: 4, Window: 2 * time.Second, OpenTimeout: time.Second, HalfOpenMaxRequests: 2},
		{ConsecutiveFailures: 100, FailureRatio: 0.5, MinRequests: 4, Window: 3 * time.Second},
		{}, // the default rule: a run that has lasted DownAfter
	}
	pauses := []time.Duration{0, 0, 0, 10 * time.Millisecond, 300 * time.Millisecond, time.Second, 6 * time.Second}
	for _, s := range settings {
		for seed := range uint64(8) {
			t.Run(fmt.Sprintf("%+v/seed=%d", s, seed), func(t *testing.T) {
				clk := testutil.NewClock(time.Now())
				s.Now = clk.Now
				s := s.WithDefaults()
				b, ref := newBreaker("x", s), newBreaker("x", s)
				ref.fast = false
				rng := rand.New(rand.NewPCG(seed, 1))
				quietCalls, transitions := 0, 0
				failing := false
				for i := range 3000 {
					// Bursts: the server is up or down for a while.
					if rng.IntN(20) == 0 {
						failing = !failing
					}
					v := herdguard.Success
					switch r := rng.IntN(10); {
					case r == 0:
						v = herdguard.Ignored
					case failing && r < 9, !failing && r == 1:
						v = herdguard.Failure
					}
					if b.quiet() {
						quietCalls++
					}
					var ran, probe, refRan, refProbe bool
					_, _, err := b.Execute(func(p bool) herdguard.Verdict { ran, probe = true, p; return v })
					_, _, refErr := ref.Execute(func(p bool) herdguard.Verdict { refRan, refProbe = true, p; return v })
					if ran != refRan || probe != refProbe || (err != nil) != (refErr != nil) {
						t.Fatalf("call %d (%v): ran=%v probe=%v err=%v; slow path ran=%v probe=%v err=%v",
							i, v, ran, probe, err, refRan, refProbe, refErr)
					}
					got, want := b.State(), ref.State()
					if got != want {
						t.Fatalf("call %d (%v): state %v, slow path %v", i, v, got, want)
					}
					if got != Closed {
						transitions++
					}
					gc, wc := b.Counts(), ref.Counts()
					if s.FailureRatio == 0 {
						gc = Counts{TotalFailures: gc.TotalFailures, ConsecutiveFailures: gc.ConsecutiveFailures}
						wc = Counts{TotalFailures: wc.TotalFailures, ConsecutiveFailures: wc.ConsecutiveFailures}
					}
					if gc != wc {
						t.Fatalf("call %d (%v): counts %+v, slow path %+v", i, v, gc, wc)
					}
					clk.Advance(pauses[rng.IntN(len(pauses))])
				}
				if s.FailureRatio == 0 && quietCalls < 300 {
					t.Errorf("only %d of 3000 calls took the fast path", quietCalls)
				}
				if s.FailureRatio > 0 && quietCalls > 0 {
					t.Errorf("%d calls took the fast path with FailureRatio set", quietCalls)
				}
				if transitions == 0 {
					t.Error("the breaker never left the closed state: the sequence tests nothing")
				}
			})
		}
	}
}

// TestFastPathUnderConcurrency lets goroutines race through a breaker with
// successes and failures, stops them all now and then, and checks at every
// stop that the fast path never outlives a failure: if the breaker is quiet,
// gobreaker's run of failures is zero. At the end, exactly
// ConsecutiveFailures failures in a row must still trip it.
func TestFastPathUnderConcurrency(t *testing.T) {
	for round := range 10 {
		b := newBreaker("x", Settings{ConsecutiveFailures: 1000}.WithDefaults())
		var (
			world     sync.RWMutex // workers hold it shared; a check takes it whole
			wg        sync.WaitGroup
			stop      = make(chan struct{})
			fastCalls atomic.Int64 // calls a worker began while the breaker was quiet
			ops       atomic.Int64 // calls the workers made
		)
		for g := range 8 {
			wg.Go(func() {
				rng := rand.New(rand.NewPCG(uint64(round), uint64(g)))
				for {
					select {
					case <-stop:
						return
					default:
					}
					v := herdguard.Success
					if rng.IntN(2) == 0 {
						v = herdguard.Failure
					}
					world.RLock()
					if b.quiet() {
						fastCalls.Add(1)
					}
					b.Execute(func(bool) herdguard.Verdict { return v })
					world.RUnlock()
					ops.Add(1)
				}
			})
		}
		check := func(i int) {
			if b.quiet() {
				if c := b.Counts(); c.ConsecutiveFailures != 0 {
					world.Unlock()
					close(stop)
					wg.Wait()
					t.Fatalf("round %d, stop %d: quiet with a run of %d failures", round, i, c.ConsecutiveFailures)
				}
			}
		}
		for i := range 500 {
			// let the workers make calls between stops, however the
			// scheduler of a loaded machine treats them
			from := ops.Load()
			testutil.Eventually(t, "the workers to make 8 calls", func() bool { return ops.Load() >= from+8 })
			world.Lock()
			check(i)
			if b.LastState() != Closed {
				t.Fatalf("round %d: state %v; 8 goroutines cannot make 1000 failures in a row at these odds", round, b.LastState())
			}
			// Now and then a success with every worker stopped, which must
			// make the breaker quiet: the workers then start again on the
			// fast path, with successes and failures racing on it. (Left to
			// themselves, a loaded machine may never stop them quiet.)
			if i%25 == 0 {
				b.Execute(func(bool) herdguard.Verdict { return herdguard.Success })
				if !b.quiet() {
					world.Unlock()
					close(stop)
					wg.Wait()
					t.Fatalf("round %d, stop %d: a success with nothing in flight left the breaker not quiet", round, i)
				}
				check(i)
			}
			world.Unlock()
		}
		close(stop)
		wg.Wait()
		if fastCalls.Load() == 0 {
			t.Errorf("round %d: no call began on the fast path: the check tests nothing", round)
		}
		b.Execute(func(bool) herdguard.Verdict { return herdguard.Success })
		for i := range 1000 {
			if b.LastState() != Closed {
				t.Fatalf("round %d: open after %d failures in a row, want 1000", round, i)
			}
			b.Execute(func(bool) herdguard.Verdict { return herdguard.Failure })
		}
		if b.LastState() != Open {
			t.Fatalf("round %d: 1000 failures in a row left the breaker %v", round, b.LastState())
		}
	}
}

func TestExecuteQuietAllocatesNothing(t *testing.T) {
	b := newBreaker("x", Settings{}.WithDefaults())
	fn := func(bool) herdguard.Verdict { return herdguard.Success }
	if n := testing.AllocsPerRun(100, func() { b.Execute(fn) }); n != 0 {
		t.Errorf("Execute on a quiet breaker: %v allocations, want 0", n)
	}
	if !b.quiet() {
		t.Fatal("a breaker with only successes is not quiet")
	}
	// Through gobreaker, its two-step breaker makes one closure per call:
	// the price of one breaker that unary calls and streams share without a
	// goroutine per stream.
	ratio := newBreaker("x", Settings{FailureRatio: 0.5}.WithDefaults())
	if n := testing.AllocsPerRun(100, func() { ratio.Execute(fn) }); n != 1 || ratio.quiet() {
		t.Errorf("Execute through gobreaker: %v allocations, want 1 (quiet=%v)", n, ratio.quiet())
	}
	_, _, err := b.Execute(func(bool) herdguard.Verdict { return herdguard.Failure })
	if err != nil || b.quiet() {
		t.Fatalf("after a failure: err=%v quiet=%v, want nil and false", err, b.quiet())
	}
	if c := b.Counts(); c.ConsecutiveFailures != 1 {
		t.Fatalf("a failure on the fast path was not handed to gobreaker: %+v", c)
	}
	b.Execute(fn)
	if !b.quiet() {
		t.Fatal("a success after the failure did not make the breaker quiet again")
	}
}

// TestPanicIsAFailure: a call that panics counts as a failure on the fast
// path as it does in gobreaker, and the panic reaches the caller.
func TestPanicIsAFailure(t *testing.T) {
	for _, quiet := range []bool{true, false} {
		b := newBreaker("x", Settings{ConsecutiveFailures: 3}.WithDefaults())
		if !quiet {
			b.Execute(func(bool) herdguard.Verdict { return herdguard.Failure })
		}
		if b.quiet() != quiet {
			t.Fatalf("quiet = %v, want %v", b.quiet(), quiet)
		}
		before := b.Counts().ConsecutiveFailures
		func() {
			defer func() {
				if r := recover(); r != "boom" {
					t.Errorf("quiet=%v: recovered %v, want the call's panic", quiet, r)
				}
			}()
			b.Execute(func(bool) herdguard.Verdict { panic("boom") })
		}()
		if got := b.Counts().ConsecutiveFailures; got != before+1 {
			t.Errorf("quiet=%v: run of failures %d after a panic, want %d", quiet, got, before+1)
		}
		if begun, done := b.failuresBegun.Load(), b.failuresDone.Load(); begun != done || begun != uint64(before)+1 {
			t.Errorf("quiet=%v: failures begun %d, done %d, want %d each", quiet, begun, done, before+1)
		}
		b.Execute(func(bool) herdguard.Verdict { return herdguard.Success })
		if !b.quiet() {
			t.Errorf("quiet=%v: a success after the panic did not make the breaker quiet", quiet)
		}
	}
}

// TestQuietSuccessEndsARunLikeGobreaker: a call admitted while the breaker
// is quiet that succeeds after another call failed ends the run of
// failures, as it does in gobreaker, so the next failure does not trip a
// breaker that needs two in a row. Admission order and verdict order are
// interleaved as a long call (or a stream) and short ones would be.
func TestQuietSuccessEndsARunLikeGobreaker(t *testing.T) {
	for _, stream := range []bool{false, true} {
		s := Settings{ConsecutiveFailures: 2}.WithDefaults()
		b := newBreaker("x", s)
		refState := Closed
		ref := gobreaker.NewTwoStepCircuitBreaker[struct{}](gobreakerSettings("x", s, func(to State) { refState = to }))
		fail := func() {
			b.Execute(func(bool) herdguard.Verdict { return herdguard.Failure })
			if d, err := ref.Allow(); err == nil {
				d(errFailure)
			}
		}
		refA, err := ref.Allow()
		if err != nil {
			t.Fatal(err)
		}
		if stream {
			doneA, _, err := b.Allow() // A admitted while quiet
			if err != nil {
				t.Fatal(err)
			}
			fail() // B fails: a run of 1
			doneA(herdguard.Success)
		} else {
			b.Execute(func(bool) herdguard.Verdict { // A, admitted while quiet
				fail() // B fails while A runs
				return herdguard.Success
			})
		}
		refA(nil) // A succeeds: the run is back to 0
		fail()    // C fails: a run of 1
		if got, want := b.State(), refState; got != want || b.Counts().ConsecutiveFailures != ref.Counts().ConsecutiveFailures {
			t.Errorf("stream=%v: state %v with a run of %d; gobreaker %v with a run of %d",
				stream, got, b.Counts().ConsecutiveFailures, want, ref.Counts().ConsecutiveFailures)
		}
	}
}

// TestCountsOfKeepsEachField: every count reaches its own field.
func TestCountsOfKeepsEachField(t *testing.T) {
	got := countsOf(gobreaker.Counts{Requests: 1, TotalSuccesses: 2, TotalFailures: 3, TotalExclusions: 4, ConsecutiveSuccesses: 5, ConsecutiveFailures: 6})
	want := Counts{Requests: 1, TotalSuccesses: 2, TotalFailures: 3, ConsecutiveSuccesses: 5, ConsecutiveFailures: 6}
	if got != want {
		t.Errorf("countsOf = %+v, want %+v", got, want)
	}
}

// calmFleet is a fleet whose shared breaker stays calm.
type calmFleet struct{}

func (calmFleet) Join(_ string, _ Settings, v *FleetView) FleetMember { v.Calm(); return calmFleet{} }
func (calmFleet) Failed()                                             {}
func (calmFleet) Recovered()                                          {}
func (calmFleet) Probe(context.Context) (ProbeLease, error)           { return nil, ErrProbesTaken }

func TestSharedCalmAllocatesNothing(t *testing.T) {
	b := newBreaker("x", Settings{Fleet: calmFleet{}}.WithDefaults())
	fn := func(bool) herdguard.Verdict { return herdguard.Success }
	if n := testing.AllocsPerRun(100, func() { b.Execute(fn) }); n != 0 {
		t.Errorf("Execute on a calm shared breaker: %v allocations, want 0", n)
	}
	if !b.Shared() || !b.quiet() {
		t.Fatalf("shared %v, quiet %v; want both", b.Shared(), b.quiet())
	}
}

// BenchmarkExecute compares a healthy call through the replica's own
// breaker and through a calm shared one: the shared breaker adds an atomic
// load of the fleet's view and no network round trip.
func BenchmarkExecute(b *testing.B) {
	fn := func(bool) herdguard.Verdict { return herdguard.Success }
	for _, bc := range []struct {
		name string
		s    Settings
	}{{"local", Settings{}}, {"shared", Settings{Fleet: calmFleet{}}}} {
		b.Run(bc.name, func(b *testing.B) {
			br := newBreaker("x", bc.s.WithDefaults())
			b.ReportAllocs()
			for b.Loop() {
				br.Execute(fn)
			}
		})
	}
}
