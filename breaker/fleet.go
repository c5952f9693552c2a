package breaker

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	"github.com/herdguard/herdguard/internal/clock"
	"github.com/herdguard/herdguard/internal/errs"

	"github.com/herdguard/herdguard"
)

// Fleet shares breakers across the replicas of a service, through a store
// they all reach (package github.com/herdguard/herdguard/redisfleet keeps
// it in Redis). Set it in [Settings.Fleet].
//
// A shared breaker counts the fleet's consecutive failed calls in the
// store, opens for the whole fleet when they reach ConsecutiveFailures
// (once the run has lasted DownAfter, timed by the store's clock, when
// that is set, as it is by default), and leases its half-open probes fleet-wide, so that at most
// HalfOpenMaxRequests probes run across the fleet per open period. The
// store pushes every change to each replica's [FleetView], which the
// breaker reads with one atomic load: a call through a calm shared breaker
// makes no network round trip, and a failure is handed to the fleet
// without making the caller wait. Each replica's own breaker goes on
// counting its own calls too, and a call must pass both: a replica whose
// own path to the server fails while the rest of the fleet succeeds opens
// its own breaker without stopping the fleet. While the store cannot be
// reached, the replica's own breaker alone decides.
type Fleet interface {
	// Join starts sharing the breaker of scope, configured by s (defaults
	// filled), and returns this replica's link to it. The fleet keeps view
	// up to date from then on. Join must not wait on the network.
	Join(scope string, s Settings, view *FleetView) FleetMember
}

// FleetMember is one replica's link to a shared breaker. Failed and
// Recovered must not block: they hand the news to the fleet and return.
type FleetMember interface {
	// Failed reports a failed call.
	Failed()
	// Recovered reports a successful call made while the fleet's view was
	// suspect (closed with failures counted), which ends the fleet's run of
	// consecutive failures.
	Recovered()
	// Probe asks for one of the fleet's half-open probe leases, waiting at
	// most a small bound. It returns [ErrProbesTaken] when the fleet's
	// probes for this open period are taken or the open period has not
	// ended; a nil lease and a nil error when the fleet's breaker turned
	// out closed (the call goes as any other); and another error when the
	// store could not answer (the replica's own breaker then decides
	// alone).
	Probe(ctx context.Context) (ProbeLease, error)
}

// ProbeLease is a granted fleet-wide probe. Done reports its verdict,
// once, without waiting: Success closes the fleet's breaker (once
// HalfOpenMaxRequests probes succeeded), Failure opens it again, and
// Ignored hands the lease back for another probe.
type ProbeLease interface {
	Done(v herdguard.Verdict)
}

// ErrProbesTaken is returned by [FleetMember.Probe] when the fleet's probe
// leases for this open period are all taken.
var ErrProbesTaken = errs.New("breaker: the fleet's probes are taken")

// The fleet's state as a [FleetView] holds it.
const (
	fleetUnknown int32 = iota // not heard from the store: the replica decides alone
	fleetCalm                 // closed, no failure counted
	fleetSuspect              // closed, failures counted
	fleetOpen                 // open until openUntil, then probes are leased
)

// FleetView is a replica's view of one shared breaker. The [Fleet] keeps
// it with the methods below, each of which records what the store last
// said; the breaker reads it on every call without a lock, and
// [Breaker.FleetState] reports it. Its zero value is a view the fleet has
// not spoken to: the replica's own breaker decides alone.
type FleetView struct {
	state     atomic.Int32
	openUntil atomic.Int64 // on now, unix nanoseconds
	// takenUntil is when the probe leases of this open period lapse, as
	// last heard: until then the replica refuses without asking.
	takenUntil atomic.Int64
	// now is the breaker's clock (Settings.Now); nil: the wall clock.
	now func() time.Time
}

// unixNow returns the view's time in Unix nanoseconds.
func (v *FleetView) unixNow() int64 {
	if v.now == nil {
		return clock.Real().Now().UnixNano()
	}
	return v.now().UnixNano()
}

// Calm records that the fleet's breaker is closed with no failure counted.
func (v *FleetView) Calm() { v.state.Store(fleetCalm) }

// Suspect records that the fleet's breaker is closed with failures
// counted: the next success of this replica tells the fleet.
func (v *FleetView) Suspect() { v.state.Store(fleetSuspect) }

// Open records that the fleet's breaker is open for remaining more (0 or
// less: its open period is over and probes are leased).
func (v *FleetView) Open(remaining time.Duration) {
	v.takenUntil.Store(0)
	v.openUntil.Store(v.unixNow() + int64(remaining))
	v.state.Store(fleetOpen)
}

// Taken records that the fleet's breaker is half-open with its probe
// leases taken for remaining more: the replica refuses without asking
// until then, or until the fleet's state changes.
func (v *FleetView) Taken(remaining time.Duration) {
	v.takenUntil.Store(v.unixNow() + int64(remaining))
	if v.state.Load() != fleetOpen {
		v.openUntil.Store(0)
		v.state.Store(fleetOpen)
	}
}

// Lost records that the store cannot be reached: until the fleet speaks
// again, the replica's own breaker decides alone.
func (v *FleetView) Lost() { v.state.Store(fleetUnknown) }

// shared reports whether the view follows the fleet (the store was heard
// from and not lost since).
func (v *FleetView) shared() bool { return v.state.Load() != fleetUnknown }

// current returns the fleet's state as the view holds it: Closed, Open,
// or HalfOpen once the open period is over. ok is false while the view
// does not follow the fleet.
func (v *FleetView) current() (s State, ok bool) {
	switch v.state.Load() {
	case fleetCalm, fleetSuspect:
		return Closed, true
	case fleetOpen:
		if v.unixNow() >= v.openUntil.Load() {
			return HalfOpen, true
		}
		return Open, true
	}
	return Closed, false
}

// executeShared is Execute for a breaker shared by a fleet.
func (b *Breaker) executeShared(fn func(probe bool) herdguard.Verdict) (before, after State, err error) {
	if b.view.state.Load() != fleetOpen {
		// Calm, suspect, or not heard from (at start, or with the store
		// lost): this replica's own breaker decides, and the fleet hears
		// of every failure (a store that cannot be reached drops them). A
		// call that panics counts as a failure of the replica's own breaker
		// only: the panic goes on before the fleet hears of it.
		before, after, v, err := b.executeLocal(fn)
		if err == nil {
			b.tellFleet(v)
		}
		return before, after, err
	}
	before = State(b.state.Load())
	settle, probe, leased, err := b.admitOpen()
	if err != nil {
		var oe *OpenError
		if errors.As(err, &oe) && oe.Shared {
			return oe.State, oe.State, err
		}
		return before, State(b.state.Load()), err
	}
	v := herdguard.Failure
	defer func() { settle(v) }() // also when fn panics: a failure
	v = fn(probe)
	if leased {
		return HalfOpen, HalfOpen, nil // the fleet hears the verdict after the call returns
	}
	return before, State(b.state.Load()), nil
}

// admitOpen admits a call while the fleet's breaker is open. The call must
// pass this replica's own breaker first, then the fleet, which refuses it
// while the open period lasts or its probe leases are taken, or leases it
// a probe. settle reports the call's verdict to both; probe says the call
// is a probe (of either breaker), leased that it holds the fleet's lease.
func (b *Breaker) admitOpen() (settle func(herdguard.Verdict), probe, leased bool, err error) {
	if refusal := b.fleetRefusal(); refusal != nil {
		return nil, false, false, refusal
	}
	ldone, lprobe, err := b.admit()
	if err != nil {
		return nil, false, false, err
	}
	lease, fleet, refusal := b.fleetProbe()
	if refusal != nil {
		b.report(ldone, herdguard.Ignored)
		return nil, false, false, refusal
	}
	return func(v herdguard.Verdict) {
		b.report(ldone, v)
		switch {
		case lease != nil:
			lease.Done(v)
		case fleet:
			b.tellFleet(v)
		}
	}, lprobe || lease != nil, lease != nil, nil
}

// allowShared is Allow for a breaker shared by a fleet.
func (b *Breaker) allowShared() (done func(herdguard.Verdict), probe bool, err error) {
	var called atomic.Bool
	if b.view.state.Load() != fleetOpen { // as in executeShared
		ldone, probe, err := b.allowLocal()
		if err != nil {
			return nil, false, err
		}
		return func(v herdguard.Verdict) {
			if !called.Swap(true) {
				ldone(v)
				b.tellFleet(v)
			}
		}, probe, nil
	}
	settle, probe, _, err := b.admitOpen()
	if err != nil {
		return nil, false, err
	}
	return func(v herdguard.Verdict) {
		if !called.Swap(true) {
			settle(v)
		}
	}, probe, nil
}

// fleetRefusal is the refusal of an open fleet breaker while its open
// period lasts, or while its probe leases are known to be taken.
func (b *Breaker) fleetRefusal() *OpenError {
	now := b.view.unixNow()
	switch {
	case now < b.view.openUntil.Load():
		return openRefusal(b.scope, b.view.openUntil.Load(), now, true)
	case now < b.view.takenUntil.Load():
		return &OpenError{Scope: b.scope, State: HalfOpen, Shared: true}
	}
	return nil
}

// fleetProbe asks the fleet to let a call through its open breaker once the
// open period is over: a refusal while its probes are taken; a lease for a
// probe; or neither, with fleet true when the fleet turned out closed (the
// call is an ordinary one, which the fleet hears of), false when the store
// did not answer (this replica decides alone).
func (b *Breaker) fleetProbe() (lease ProbeLease, fleet bool, refusal *OpenError) {
	lease, err := b.member.Probe(context.Background())
	switch {
	case errors.Is(err, ErrProbesTaken):
		return nil, false, &OpenError{Scope: b.scope, State: HalfOpen, Shared: true}
	case err != nil:
		return nil, false, nil
	}
	return lease, lease == nil, nil
}

// tellFleet hands a call's verdict to the fleet: every failure, and the
// first success while the fleet counts failures (which ends their run).
func (b *Breaker) tellFleet(v herdguard.Verdict) {
	switch v {
	case herdguard.Failure:
		b.member.Failed()
	case herdguard.Success:
		if b.view.state.Load() == fleetSuspect && b.view.state.CompareAndSwap(fleetSuspect, fleetCalm) {
			b.member.Recovered()
		}
	}
}

// Shared reports whether the breaker follows a fleet's shared breaker now
// (Settings.Fleet is set and its store answers).
func (b *Breaker) Shared() bool { return b.view != nil && b.view.shared() }

// FleetState returns the state of the fleet's shared breaker as this
// replica last heard it; ok is false when the breaker is not shared or its
// store does not answer.
func (b *Breaker) FleetState() (s State, ok bool) {
	if b.view == nil {
		return Closed, false
	}
	return b.view.current()
}
