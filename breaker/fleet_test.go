package breaker_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/herdguard/herdguard"
	"github.com/herdguard/herdguard/breaker"
)

// testFleet is a fleet of one scope held in memory, for exact sequences of
// what the breaker tells the fleet and what the fleet answers. (The fleet
// over a real Redis is tested in module redisfleet.)
type testFleet struct {
	mu                sync.Mutex
	view              *breaker.FleetView
	scope             string
	settings          breaker.Settings
	failed, recovered int
	probeErr          error // what Probe returns, when not nil
	closed            bool  // Probe finds the fleet closed
	asked             int   // calls of Probe
	verdicts          []herdguard.Verdict
}

func (f *testFleet) Join(scope string, s breaker.Settings, v *breaker.FleetView) breaker.FleetMember {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.scope, f.settings, f.view = scope, s, v
	return f
}

func (f *testFleet) Failed()    { f.mu.Lock(); f.failed++; f.mu.Unlock() }
func (f *testFleet) Recovered() { f.mu.Lock(); f.recovered++; f.mu.Unlock() }

func (f *testFleet) Probe(context.Context) (breaker.ProbeLease, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.asked++
	switch {
	case f.probeErr != nil:
		return nil, f.probeErr
	case f.closed:
		return nil, nil
	}
	return lease{f}, nil
}

type lease struct{ f *testFleet }

func (l lease) Done(v herdguard.Verdict) {
	l.f.mu.Lock()
	l.f.verdicts = append(l.f.verdicts, v)
	l.f.mu.Unlock()
	if v == herdguard.Success {
		l.f.view.Calm()
	}
}

func (f *testFleet) counts() (failed, recovered int, verdicts []herdguard.Verdict) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.failed, f.recovered, append([]herdguard.Verdict(nil), f.verdicts...)
}

func sharedBreaker(t *testing.T) (*breaker.Breaker, *testFleet) {
	t.Helper()
	f := &testFleet{}
	b := newBreaker(t, breaker.Settings{ConsecutiveFailures: 3, Fleet: f})
	if f.view == nil || f.scope != "dns:///pay" || f.settings.ConsecutiveFailures != 3 || f.settings.OpenTimeout != breaker.DefaultOpenTimeout {
		t.Fatalf("Join got scope %q and settings %+v, want the scope and the settings with defaults filled", f.scope, f.settings)
	}
	return b, f
}

func TestFleetUnheardLeavesTheReplicaAlone(t *testing.T) {
	b, f := sharedBreaker(t)
	if b.Shared() {
		t.Error("a breaker whose fleet never spoke reports itself shared")
	}
	for range 3 {
		run(t, b, herdguard.Failure)
	}
	if b.State() != breaker.Open {
		t.Errorf("state %v: the replica's own breaker must decide while the fleet is unheard", b.State())
	}
	// the fleet hears of the failures all the same: at start, a replica's
	// first failures count for the fleet before its first read answers
	if failed, _, _ := f.counts(); failed != 3 {
		t.Errorf("told an unheard fleet of %d failures, want 3", failed)
	}
}

func TestFleetCalmCountsFailuresAndRecoveries(t *testing.T) {
	b, f := sharedBreaker(t)
	f.view.Calm()
	if !b.Shared() {
		t.Fatal("a breaker whose fleet is calm does not report itself shared")
	}
	run(t, b, herdguard.Success)
	run(t, b, herdguard.Failure)
	run(t, b, herdguard.Ignored)
	if failed, recovered, _ := f.counts(); failed != 1 || recovered != 0 {
		t.Errorf("after success, failure, ignored on a calm fleet: told %d failures, %d recoveries; want 1, 0", failed, recovered)
	}
	// the fleet counts failures: this replica's next success ends their run, once
	f.view.Suspect()
	run(t, b, herdguard.Success)
	run(t, b, herdguard.Success)
	if _, recovered, _ := f.counts(); recovered != 1 {
		t.Errorf("two successes while the fleet is suspect: %d recoveries told, want 1", recovered)
	}
	if s, ok := b.FleetState(); !ok || s != breaker.Closed {
		t.Errorf("fleet state %v (%v), want closed", s, ok)
	}
	// the replica's own breaker still counts its own run
	for range 3 {
		run(t, b, herdguard.Failure)
	}
	if ran, _, err := run(t, b, herdguard.Success); ran || !errors.Is(err, breaker.ErrOpen) {
		t.Errorf("after 3 failures of its own: ran %v, %v; want the replica's own breaker to refuse", ran, err)
	} else if oe := new(breaker.OpenError); errors.As(err, &oe) && oe.Shared {
		t.Errorf("the replica's own refusal says it is shared: %v", err)
	}
}

func TestFleetOpenRefusesThenLeasesProbes(t *testing.T) {
	b, f := sharedBreaker(t)
	f.view.Open(time.Hour)
	ran, _, err := run(t, b, herdguard.Success)
	var oe *breaker.OpenError
	if ran || !errors.As(err, &oe) || !oe.Shared || oe.State != breaker.Open {
		t.Fatalf("open fleet: ran %v, err %v; want a shared refusal", ran, err)
	}
	if s := b.State(); s != breaker.Closed {
		t.Errorf("the replica's own state %v, want closed: the fleet refused", s)
	}

	// the open period is over: a lease makes the call a probe
	f.view.Open(-time.Millisecond)
	before, after, err := b.Execute(func(probe bool) herdguard.Verdict {
		if !probe {
			t.Error("a call on a fleet lease was not told it is a probe")
		}
		return herdguard.Success
	})
	if err != nil || before != breaker.HalfOpen || after != breaker.HalfOpen {
		t.Errorf("probe: before %v, after %v, %v; want half-open both (the fleet hears the verdict after), nil", before, after, err)
	}
	if s, ok := b.FleetState(); !ok || s != breaker.Closed {
		t.Errorf("after the probe's success the fleet is %v, want closed", s)
	}
	if _, _, v := f.counts(); len(v) != 1 || v[0] != herdguard.Success {
		t.Errorf("probe verdicts %v, want [success]", v)
	}

	// the fleet's probes are taken: a shared half-open refusal
	f.view.Open(-time.Millisecond)
	f.probeErr = breaker.ErrProbesTaken
	ran, _, err = run(t, b, herdguard.Success)
	if ran || !errors.As(err, &oe) || !oe.Shared || oe.State != breaker.HalfOpen {
		t.Errorf("probes taken: ran %v, err %v; want a shared half-open refusal", ran, err)
	}

	// told the leases are taken, the replica refuses without asking until they lapse
	f.probeErr = nil
	f.view.Taken(time.Hour)
	asked := f.asked
	ran, _, err = run(t, b, herdguard.Success)
	if ran || !errors.As(err, &oe) || !oe.Shared || oe.State != breaker.HalfOpen || f.asked != asked {
		t.Errorf("leases taken: ran %v, err %v, asked %d more; want a shared half-open refusal without asking", ran, err, f.asked-asked)
	}
	if s, _ := b.FleetState(); s != breaker.HalfOpen {
		t.Errorf("view with leases taken reads %v, want half-open", s)
	}
	f.view.Open(-time.Millisecond) // a new open period forgets the leases

	// the store does not answer: the replica's own breaker decides
	f.probeErr = errors.New("redis: connection refused")
	if ran, probe, err := run(t, b, herdguard.Success); !ran || probe || err != nil {
		t.Errorf("store down: ran %v, probe %v, %v; want the call sent, not as a probe", ran, probe, err)
	}
}

// TestFleetOpenStillNeedsTheReplicasOwnBreaker: a replica whose own
// breaker is open takes no fleet probe (its own path to the server may be
// what fails), and a fleet that turned out closed lets the call go as any
// other.
func TestFleetOpenStillNeedsTheReplicasOwnBreaker(t *testing.T) {
	b, f := sharedBreaker(t)
	f.view.Calm()
	for range 3 {
		run(t, b, herdguard.Failure) // the replica's own breaker opens
	}
	f.view.Open(-time.Millisecond)
	ran, _, err := run(t, b, herdguard.Success)
	var oe *breaker.OpenError
	if ran || !errors.As(err, &oe) || oe.Shared {
		t.Errorf("own breaker open, fleet half-open: ran %v, %v; want the replica's own refusal", ran, err)
	}
	if f.asked != 0 {
		t.Errorf("the replica asked the fleet for %d probes with its own breaker open", f.asked)
	}

	b, f = sharedBreaker(t)
	f.view.Open(-time.Millisecond)
	f.closed = true
	ran, probe, err := run(t, b, herdguard.Failure)
	if !ran || probe || err != nil {
		t.Errorf("fleet turned out closed: ran %v, probe %v, %v; want an ordinary call", ran, probe, err)
	}
	if failed, _, v := f.counts(); failed != 1 || len(v) != 0 {
		t.Errorf("told %d failures and %d probe verdicts, want 1 failure and no probe", failed, len(v))
	}
}

func TestFleetProbeThatPanicsFails(t *testing.T) {
	b, f := sharedBreaker(t)
	f.view.Open(-time.Millisecond)
	func() {
		defer func() {
			if r := recover(); r != "boom" {
				t.Errorf("recovered %v, want the call's panic re-raised", r)
			}
		}()
		b.Execute(func(bool) herdguard.Verdict { panic("boom") })
	}()
	if _, _, v := f.counts(); len(v) != 1 || v[0] != herdguard.Failure {
		t.Errorf("verdicts %v, want [failure]", v)
	}
}

func TestFleetAllow(t *testing.T) {
	b, f := sharedBreaker(t)
	f.view.Suspect()
	done, probe, err := b.Allow()
	if err != nil || probe {
		t.Fatalf("Allow on a suspect fleet: probe %v, %v", probe, err)
	}
	done(herdguard.Success)
	if _, recovered, _ := f.counts(); recovered != 1 {
		t.Errorf("a stream's success on a suspect fleet: %d recoveries told, want 1", recovered)
	}

	f.view.Open(time.Hour)
	if _, _, err := b.Allow(); !errors.Is(err, breaker.ErrOpen) {
		t.Errorf("Allow on an open fleet: %v, want a refusal", err)
	}
	f.view.Open(-time.Millisecond)
	done, probe, err = b.Allow()
	if err != nil || !probe {
		t.Fatalf("Allow once the open period is over: probe %v, %v; want a probe", probe, err)
	}
	done(herdguard.Failure)
	done(herdguard.Success) // later calls do nothing
	if _, _, v := f.counts(); len(v) != 1 || v[0] != herdguard.Failure {
		t.Errorf("probe verdicts %v, want [failure]", v)
	}

	f.view.Calm()
	done, _, err = b.Allow()
	if err != nil {
		t.Fatal(err)
	}
	done(herdguard.Failure)
	done(herdguard.Failure) // later calls do nothing
	if failed, _, _ := f.counts(); failed != 1 {
		t.Errorf("a stream's failure told %d times, want 1", failed)
	}
	f.view.Lost()
	if b.Shared() {
		t.Error("a breaker whose store is lost reports itself shared")
	}
}

func TestOpenErrorSaysShared(t *testing.T) {
	e := &breaker.OpenError{Scope: "dns:///pay", State: breaker.Open, Shared: true}
	if got := e.Error(); got != "herdguard: the fleet's circuit breaker for dns:///pay is open; call not sent" {
		t.Errorf("Error() = %q", got)
	}
}
