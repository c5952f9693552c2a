package pacing

import (
	"context"
	"errors"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/herdguard/herdguard/overload"
)

// rig is one controller on a simulated clock, driven outcome by outcome.
type rig struct {
	t *testing.T
	s *sim
	c *Controller
}

func newRig(t *testing.T, set overload.Settings) *rig {
	t.Helper()
	s := newSim(1)
	c, err := New(set, s.env())
	if err != nil {
		t.Fatal(err)
	}
	return &rig{t: t, s: s, c: c}
}

// advance moves the clock on by d, running the controller's timers.
func (r *rig) advance(d time.Duration) { r.s.run(r.s.now.Add(d)) }

// sent sends one attempt that goes only while calm, as a hedge does.
func (r *rig) sent() {
	if _, err := r.c.Acquire(context.Background(), Aside); err != nil {
		r.t.Fatalf("Acquire(Aside) = %v; it never waits or sheds", err)
	}
}

// calm reports n attempts sent while calm and answered.
func (r *rig) calm(n int) {
	for range n {
		r.sent()
		r.c.Done(Answered, 0)
	}
}

// outcomes reports n attempts sent while calm that ended with o.
func (r *rig) outcomes(o Outcome, n int) {
	for range n {
		r.sent()
		r.c.Done(o, 0)
	}
}

// behind reports an Interval in which 100 attempts were sent while calm and
// 50 answered, and ends it: a server that queues what it cannot serve.
func (r *rig) behind() {
	for range 100 {
		r.sent()
	}
	for range 50 {
		r.c.Done(Answered, 0)
	}
	r.advance(overload.DefaultInterval)
}

// ticket is an attempt that asked the controller: err is what it was told
// (nil: go), told whether it was told yet.
type ticket struct {
	err      error
	told     bool
	at       time.Time
	reported bool // its outcome was reported
}

// ask asks leave for an attempt with the deadline d from now (0: none);
// retry puts it at the line's old end.
func (r *rig) ask(d time.Duration, retry bool) *ticket {
	tk := &ticket{}
	var deadline time.Time
	if d > 0 {
		deadline = r.s.now.Add(d)
	}
	w := &waiter{ready: func(err error) { tk.err, tk.told, tk.at = err, true, r.s.now }}
	err, queued := r.c.admit(deadline, retry, w)
	if !queued {
		tk.err, tk.told, tk.at = err, true, r.s.now
	}
	return tk
}

// rate is the controller's rate in attempts per Interval (probes while
// collapsed).
func (r *rig) rate() float64 {
	return r.c.State().Rate * float64(overload.DefaultInterval) / float64(time.Second)
}

func near(a, b float64) bool { return math.Abs(a-b) <= 1e-6*math.Max(1, math.Abs(b)) }

// A calm interval of answers, then the server refuses: the rig has learnt
// that it fails nothing on its own and what 60 answers per Interval are.
func calmRig(t *testing.T, set overload.Settings) *rig {
	r := newRig(t, set)
	for range buckets {
		r.calm(60)
		r.advance(overload.DefaultInterval)
	}
	return r
}

// fellBehind is a calm rig whose server then answers half of what it is
// sent, and refuses nothing, until the controller paces: a server that
// queues what it cannot serve. Nothing it sent since is in flight.
func fellBehind(t *testing.T) *rig {
	t.Helper()
	r := calmRig(t, overload.Settings{})
	for range buckets {
		if r.behind(); r.c.State().Pacing {
			break
		}
	}
	if !r.c.Pacing() || r.c.ep.collapsed || r.c.ep.trig.refused != 0 {
		t.Fatalf("falling behind: pacing %v, collapsed %v, evidence %+v; want pacing at a rate on no refusal", r.c.Pacing(), r.c.ep.collapsed, r.c.ep.trig)
	}
	return r
}

// Rule 1: a client that sends much judges its last Interval, one that sends
// little its last second; refusals are judged against the attempts sent;
// a fresh client judges nothing before an Interval or 4×MinFailures
// attempts.
func TestEvidence(t *testing.T) {
	t.Run("much: the last Interval", func(t *testing.T) {
		r := calmRig(t, overload.Settings{})
		r.calm(30)
		r.outcomes(Overloaded, 31) // more than half of this Interval's, interleaved below
		if !r.c.Pacing() {
			t.Error("31 refusals of 61 attempts in the last Interval: not pacing")
		}
	})
	t.Run("little: the last second", func(t *testing.T) {
		r := newRig(t, overload.Settings{})
		for range buckets { // 2 answers an Interval: a client sending 20 a second
			r.calm(2)
			r.advance(overload.DefaultInterval)
		}
		for i := range 3 { // 2 refusals and 1 answer an Interval, interleaved
			r.outcomes(Overloaded, 1)
			r.calm(1)
			r.outcomes(Overloaded, 1)
			if got, want := r.c.Pacing(), i == 2; got != want {
				t.Errorf("after %d Intervals of 2 refusals in 3: pacing %v, want %v (5 refusals span 3 Intervals)", i+1, got, want)
			}
			r.advance(overload.DefaultInterval)
		}
	})
	t.Run("refusals ahead of the answers", func(t *testing.T) {
		r := calmRig(t, overload.Settings{})
		for range 100 {
			r.sent()
		}
		for range 30 {
			r.c.Done(Overloaded, 0)
		}
		if r.c.Pacing() {
			t.Error("30 refusals of 100 attempts sent, the answers still to come: pacing")
		}
	})
	t.Run("a burst after a quiet spell", func(t *testing.T) {
		// 200 attempts at once after 1.5 s of quiet, half of them ended
		// 110 ms later, 30 % refused: the attempts counted on the calm
		// path are counted when they were sent, not spread over the quiet
		// before them, where they would look like a backlog of old ones.
		r := newRig(t, overload.Settings{})
		r.advance(15 * overload.DefaultInterval)
		for range 200 {
			r.sent()
		}
		r.advance(overload.DefaultInterval / 2)
		for i := range 100 {
			if i%10 < 3 {
				r.c.Done(Overloaded, 0)
			} else {
				r.c.Done(Answered, 0)
			}
		}
		r.advance(overload.DefaultInterval * 6 / 10)
		if st := r.c.State(); st.Pacing {
			t.Errorf("a burst half answered, 30 %% refused: %+v", st)
		}
	})
	t.Run("fresh", func(t *testing.T) {
		r := newRig(t, overload.Settings{})
		r.outcomes(Overloaded, freshAttempts*overload.DefaultMinFailures-1)
		if r.c.Pacing() {
			t.Fatalf("a fresh client paces after %d refusals", freshAttempts*overload.DefaultMinFailures-1)
		}
		r.outcomes(Overloaded, 1)
		if !r.c.Pacing() {
			t.Errorf("a fresh client does not pace after %d refusals in a row", freshAttempts*overload.DefaultMinFailures)
		}
	})
}

// Rule 2: refusals above FailureRatio and the own share, or a server that
// falls behind, start the pacing at Headroom of the answers per Interval;
// fewer refusals, or a slow server that keeps up, do not.
func TestOverload(t *testing.T) {
	t.Run("refusals", func(t *testing.T) {
		r := calmRig(t, overload.Settings{})
		began := -1
		for i := range 20 { // 2 answers and 3 refusals every 5 ms
			r.advance(overload.DefaultInterval / 20)
			r.calm(2)
			r.outcomes(Overloaded, 3)
			if r.c.Pacing() {
				began = i + 1
				break
			}
		}
		// The evidence covers at least half an Interval: the current
		// bucket alone once it is that old, with the last one before.
		if began < 10 || began > 20 {
			t.Fatalf("pacing began after %d steps of 5 ms, want between half an Interval and one (10 to 20)", began)
		}
		// It starts at Headroom of the answers per Interval over the
		// evidence: this Interval's, over the 50 ms it has lasted.
		cur := r.c.ev.last(0)
		span := float64(r.s.now.Sub(r.c.ev.start)) / float64(overload.DefaultInterval)
		if got, want := r.rate(), overload.DefaultHeadroom*cur.answered/span; !near(got, want) {
			t.Errorf("rate %v, want %v: Headroom of the %v answers over %v Intervals, per Interval", got, want, cur.answered, span)
		}
	})
	t.Run("a share below FailureRatio", func(t *testing.T) {
		r := calmRig(t, overload.Settings{})
		for range 40 {
			r.calm(3)
			r.outcomes(Overloaded, 2)
		}
		if r.c.Pacing() {
			t.Error("40 % refused: pacing")
		}
	})
	t.Run("falling behind", func(t *testing.T) {
		r := calmRig(t, overload.Settings{})
		for i := range buckets {
			r.behind()
			r.c.State() // the Interval ends
			// The queue grows by 50 an Interval; the last two Intervals
			// sent 200, which may still be in flight.
			if got, want := r.c.Pacing(), i >= 4; got != want && i <= 4 {
				t.Fatalf("after %d Intervals (a queue of %d, 200 sent in the last two): pacing %v, want %v", i+1, 50*(i+1), got, want)
			}
		}
		if !r.c.Pacing() {
			t.Error("the server ended half of what it was sent for a Window: not pacing")
		}
	})
	t.Run("behind a layer below that holds calls back", func(t *testing.T) {
		// As "falling behind", but the answers say that a layer below
		// held them back: its line, not this target's queue, is why the
		// attempts end late, and that layer paces already.
		r := calmRig(t, overload.Settings{})
		for range 3 * buckets {
			for range 100 {
				r.sent()
			}
			for range 50 {
				r.c.Done(HeldBelow, 0)
			}
			r.advance(overload.DefaultInterval)
		}
		if st := r.c.State(); st.Pacing || st.Episodes != 0 {
			t.Errorf("half the attempts ended, each held back below: %+v", st)
		}
	})
	t.Run("held below for a Window", func(t *testing.T) {
		r := calmRig(t, overload.Settings{})
		if r.c.HeldBelow() {
			t.Fatal("HeldBelow before any answer held below")
		}
		r.sent()
		r.c.Done(HeldBelow, 0)
		r.advance(buckets*overload.DefaultInterval - time.Nanosecond)
		if !r.c.HeldBelow() {
			t.Error("HeldBelow false within a Window of an answer held below")
		}
		r.advance(time.Nanosecond)
		if r.c.HeldBelow() {
			t.Error("HeldBelow true a Window after the last answer held below")
		}
	})
	t.Run("slow but keeping up", func(t *testing.T) {
		r := calmRig(t, overload.Settings{})
		for range 3 * buckets { // answered a whole Interval late, every one of them
			for range 100 {
				r.sent()
			}
			r.advance(overload.DefaultInterval)
			for range 100 {
				r.c.Done(Answered, overload.DefaultInterval)
			}
		}
		if st := r.c.State(); st.Pacing || st.Episodes != 0 {
			t.Errorf("a slow server that keeps up: %+v", st)
		}
	})
}

// Rule 3: the own share is learnt from Intervals that show no overload, and
// what this client's traffic gets while the server keeps up.
func TestOwnShare(t *testing.T) {
	r := newRig(t, overload.Settings{})
	for range 3 * buckets {
		for range 10 {
			r.calm(7)
			r.outcomes(Overloaded, 3)
		}
		r.advance(overload.DefaultInterval)
	}
	if r.c.Pacing() || math.Abs(r.c.base-0.3) > 0.01 || math.Abs(r.c.known-70) > 1 {
		t.Errorf("30 %% refused for 3 s: pacing %v, own share %.3f, known %.1f; want calm, 0.3, 70", r.c.Pacing(), r.c.base, r.c.known)
	}
	// A server that falls behind teaches nothing of what it takes.
	for range buckets {
		if r.behind(); r.c.Pacing() {
			break
		}
	}
	if r.c.known < 69 {
		t.Errorf("known %.1f after the server fell behind, want 70 kept", r.c.known)
	}
}

// Rule 4: a sample whose refusals the own share explains ends the pacing;
// so does one refused as much at a lowered rate, which teaches the share.
func TestIndependentFailures(t *testing.T) {
	t.Run("explained by the own share", func(t *testing.T) {
		r := calmRig(t, overload.Settings{})
		r.c.base, r.c.baseR, r.c.baseN = 0.3, 300, 1000
		r.advance(overload.DefaultInterval)
		r.outcomes(Overloaded, 40) // a collapse-like burst: pacing
		if !r.c.Pacing() {
			t.Fatal("not pacing")
		}
		r.c.ep.collapsed = false // judge a sample at a rate
		r.c.ep.sample = counts{}
		for range 5 {
			r.c.Done(Answered, 0)
			r.c.Done(Answered, 0)
			r.c.Done(Overloaded, 0)
		}
		if r.c.Pacing() {
			t.Error("5 refusals of 15, the server's own 30 %: still pacing")
		}
	})
	// refusing60 is a calm rig whose server then refuses 6 in 10 for an
	// Interval: pacing, on evidence sent at 100 an Interval.
	refusing60 := func(t *testing.T) *rig {
		r := calmRig(t, overload.Settings{})
		for i := 0; i < 100 && !r.c.Pacing(); i++ {
			if i%10 == 0 {
				r.advance(overload.DefaultInterval / 10)
			}
			if i%5 < 2 {
				r.calm(1)
			} else {
				r.outcomes(Overloaded, 1)
			}
		}
		if !r.c.Pacing() || r.c.ep.trig.share() < 0.5 {
			t.Fatalf("not pacing on 60 %% refused: pacing %v, %+v share %v", r.c.Pacing(), r.c.ep.trig, r.c.ep.trig.share())
		}
		r.c.ep.collapsed = false
		return r
	}
	// sample reports, at the rig's rate, sent attempts over an Interval
	// whose outcomes are answered answers, then refused refusals in a run.
	sample := func(r *rig, sent float64, answered, refused int) {
		r.c.ep.sample, r.c.ep.sampleFrom = counts{sent: sent}, r.s.now.Add(-overload.DefaultInterval)
		for range answered {
			r.c.Done(Answered, 0)
		}
		for range refused {
			r.c.Done(Overloaded, 0)
		}
	}
	t.Run("as much at the evidence's rate", func(t *testing.T) {
		r := refusing60(t)
		sample(r, r.c.ep.trigRate, 4, 6) // refused as much, sent as fast
		if !r.c.Pacing() || r.c.base > 0.1 {
			t.Errorf("refused as much at the rate that was refused: pacing %v, own share %.2f; want pacing, nothing learnt", r.c.Pacing(), r.c.base)
		}
	})
	t.Run("as much at a tenth of it", func(t *testing.T) {
		r := refusing60(t)
		trig := r.c.ep.trig
		sample(r, r.c.ep.trigRate/10, 2, 3)
		r.c.Done(Answered, 0)
		r.c.Done(Answered, 0)
		r.c.Done(Overloaded, 0)
		r.c.Done(Overloaded, 0)
		// The sample's refusals and the evidence's are the server's own.
		if want := (5 + trig.refused) / (9 + trig.outcomes()); r.c.Pacing() || !near(r.c.base, want) {
			t.Errorf("refused as much at a tenth of the rate: pacing %v, own share %.3f; want calm, %.3f learnt (5 of 9, and the evidence's)", r.c.Pacing(), r.c.base, want)
		}
	})
	t.Run("a sample that ends in a run", func(t *testing.T) {
		r := refusing60(t)
		// 20 attempts in flight: a run of 5 is not yet most of them, so
		// not a collapse, but it may be the start of one.
		r.c.inflight = 20
		trig := r.c.ep.trig
		sample(r, r.c.ep.trigRate/10, 1, overload.DefaultMinFailures)
		if !r.c.Pacing() || r.c.ep.collapsed {
			t.Fatalf("a sample ending in a run of %d: pacing %v, collapsed %v; want pacing at a rate, undecided", overload.DefaultMinFailures, r.c.Pacing(), r.c.ep.collapsed)
		}
		r.c.Done(Answered, 0)
		r.c.Done(Overloaded, 0)
		if want := (6 + trig.refused) / (8 + trig.outcomes()); r.c.Pacing() || !near(r.c.base, want) {
			t.Errorf("the run broken by an answer, 6 of 8 refused at a tenth of the rate: pacing %v, own share %.3f; want calm, %.3f learnt", r.c.Pacing(), r.c.base, want)
		}
	})
	t.Run("refused after falling behind", func(t *testing.T) {
		// Evidence without refusals has no share that a sample could
		// match: refusals that come once a queueing server is full say
		// it is overloaded still, not that it fails on its own.
		r := fellBehind(t)
		r.c.ep.before = 0
		r.c.ep.sample, r.c.ep.sampleFrom = counts{sent: r.c.ep.trigRate / 10}, r.s.now.Add(-overload.DefaultInterval)
		for range overload.DefaultMinFailures {
			r.c.Done(Answered, 0)
			r.c.Done(Overloaded, 0)
		}
		if !r.c.Pacing() || r.c.base != 0 {
			t.Errorf("half refused at a tenth of the rate, after falling behind: pacing %v, own share %.3f; want pacing, nothing learnt", r.c.Pacing(), r.c.base)
		}
	})
	t.Run("as much at a lower rate", func(t *testing.T) {
		f := newFleet(1, 1, &flaky{p: 0.67}, partialLoad(), &overload.Settings{}).run()
		c := f.ctls[0]
		if c.Pacing() || math.Abs(c.base-0.67) > 0.1 {
			t.Errorf("a server failing 67 %% on its own: pacing %v at the end, own share %.2f", c.Pacing(), c.base)
		}
	})
}

// Rule 5: a run of refusals, most of those sent, that the own share cannot
// explain is a collapse: probes only, a quarter of what the traffic got
// per Interval, at most one per Interval, at random gaps.
func TestCollapseAndProbes(t *testing.T) {
	r := calmRig(t, overload.Settings{})
	r.outcomes(Overloaded, overload.DefaultMinFailures)
	if !r.c.Pacing() || !r.c.ep.collapsed {
		t.Fatalf("a run of %d refusals after a calm second: %+v, collapsed %v", overload.DefaultMinFailures, r.c.State(), r.c.ep.collapsed)
	}
	if got := r.rate(); !near(got, 1) {
		t.Errorf("probe rate %v per Interval, want 1 (60/4, at most 1)", got)
	}
	// The probes go at random gaps: the line's waiters are served one by
	// one, never two in one gap shorter than half the mean.
	var at []time.Time
	for range 20 {
		r.ask(10*time.Second, false)
	}
	for range 30 {
		r.advance(overload.DefaultInterval / 10)
	}
	for _, w := range r.c.line {
		_ = w
	}
	served := 20 - len(r.c.line)
	if served < 1 || served > 5 {
		t.Errorf("%d probes went in 300 ms at one per 100 ms (random gaps of 50 to 150 ms)", served)
	}
	_ = at

	t.Run("a run the own share explains", func(t *testing.T) {
		r := calmRig(t, overload.Settings{})
		r.c.base, r.c.baseR, r.c.baseN = 0.67, 670, 1000
		r.outcomes(Overloaded, 10)
		if r.c.ep.collapsed {
			t.Error("a run of 10 at a server failing 67 % on its own: collapsed")
		}
	})
	t.Run("a busy client's run", func(t *testing.T) {
		// 1000 answers a second from a server that fails 67 % on its own:
		// a run begins at each answer, so a run the own share makes once
		// in 10⁴ (23: 0.67²³ < 10⁻⁴) would come every few seconds. Once an
		// hour at that rate (3.6 million runs) takes 38: 0.67³⁸ < 1/3.6e6.
		r := newRig(t, overload.Settings{})
		for range buckets {
			r.calm(100)
			r.advance(overload.DefaultInterval)
		}
		r.c.State() // the Window's last Interval learnt from
		r.c.base, r.c.baseR, r.c.baseN = 0.67, 670, 1000
		run := 0
		for run < 60 && !r.c.Pacing() {
			r.outcomes(Overloaded, 1)
			run++
		}
		if !r.c.ep.collapsed || run < 37 || run > 39 {
			t.Errorf("collapsed %v after a run of %d at about 1000 answers a second; want a collapse after 38 (0.67³⁸ < 1/3.6e6), give or take one for the answers the Window holds", r.c.ep.collapsed, run)
		}
	})
	t.Run("a small client's probes", func(t *testing.T) {
		r := smallClient(t)
		// Little learnt: the run must be unlikely at FailureRatio too,
		// 14 at most (0.5¹⁴ < 10⁻⁴), more than MinFailures.
		run := r.refuseUntilCollapsed()
		if run <= overload.DefaultMinFailures || run > 14 {
			t.Fatalf("collapsed after a run of %d, with 10 answers in 1.7 s; want more than %d, at most 14", run, overload.DefaultMinFailures)
		}
		if got := r.rate(); got >= 0.5 || got < 1.0/probeFloor {
			t.Errorf("a client whose traffic got 0.6 an Interval probes %v an Interval, want a quarter of that, at least 1/%d", got, probeFloor)
		}
	})
}

// smallClient is a client whose traffic got 0.6 answers an Interval, and
// that learnt nothing of the server's own share.
func smallClient(t *testing.T) *rig {
	r := newRig(t, overload.Settings{})
	for range buckets {
		r.calm(1)
		r.advance(overload.DefaultInterval * 5 / 3)
	}
	return r
}

// refuseUntilCollapsed reports refusals until the controller collapses,
// 20 at most, and returns how many it took.
func (r *rig) refuseUntilCollapsed() int {
	run := 0
	for run < 20 && !r.c.ep.collapsed {
		r.outcomes(Overloaded, 1)
		run++
	}
	return run
}

// A fleet's client, once the server collapsed in its episode, finds the
// second collapse in a few refusals: the answers at its restarted rate are
// what it learnt of the server since. With none, it judges the run as it
// judged the first.
func TestSecondCollapse(t *testing.T) {
	for _, tt := range []struct {
		name     string
		answered int // at the restarted rate, before the run
		want     int // the run that collapses it
	}{
		// (0 + 0.5×1) / (3 + 1) = 0.125: 0.125⁵ < 10⁻⁴, and MinFailures.
		{"three answers, then refusals", 3, overload.DefaultMinFailures},
		// (0 + 0.5×1) / (0 + 1) = 0.5: 0.5¹⁴ < 10⁻⁴, as the first.
		{"refusals from the restart on", 0, 14},
	} {
		t.Run(tt.name, func(t *testing.T) {
			// Little learnt: its first collapse takes a run of 14.
			r := smallClient(t)
			first := r.refuseUntilCollapsed()
			r.c.Done(Answered, 0) // the probe's answer: the rate restarts
			if first != 14 || r.c.ep.collapsed {
				t.Fatalf("first collapse after a run of %d, then restarted: %v; want 14, then restarted", first, !r.c.ep.collapsed)
			}
			r.outcomes(Answered, tt.answered)
			if run := r.refuseUntilCollapsed(); run != tt.want || !r.c.ep.collapsed {
				t.Errorf("collapsed %v after a run of %d; want a collapse after %d", r.c.ep.collapsed, run, tt.want)
			}
		})
	}
}

// Rule 6: the first answer after a collapse restarts the rate at what the
// traffic got before the episode.
func TestRestart(t *testing.T) {
	r := calmRig(t, overload.Settings{})
	r.outcomes(Overloaded, overload.DefaultMinFailures)
	r.c.Done(Answered, 0)
	if got := r.rate(); !near(got, r.c.known) || r.c.known < 59 {
		t.Errorf("rate %v after the first answer, want %v, what the traffic got (60 an Interval)", got, r.c.known)
	}
	if r.c.ep.collapsed {
		t.Error("still collapsed")
	}
	t.Run("a fresh client's herd answered late", func(t *testing.T) {
		// A herd of 500 attempts at once at a server that takes 40 an
		// Interval: its refusals come back first, enough of them to begin
		// the episode, and the 40 answers after. The target, and the rate
		// restarted at it, are Headroom of the 40, not of the answers that
		// happened to come before the judgement.
		r := newRig(t, overload.Settings{})
		for range 500 {
			r.sent()
		}
		r.c.Done(Answered, 0)
		for range 460 {
			r.c.Done(Overloaded, 0)
		}
		if !r.c.Pacing() || !r.c.ep.collapsed {
			t.Fatalf("pacing %v, collapsed %v after the herd's refusals; want collapsed", r.c.Pacing(), r.c.ep.collapsed)
		}
		for range 39 {
			r.c.Done(Answered, 0)
		}
		want := overload.DefaultHeadroom * 40
		if got := r.c.ep.target; !near(got, want) {
			t.Errorf("target %v after the herd's late answers, want %v: Headroom of its 40", got, want)
		}
		if got := r.rate(); !near(got, want) {
			t.Errorf("rate %v, want the restarted rate at the target, %v", got, want)
		}
	})
}

// Rule 7: refusals at a rate the controller tried lower the target to
// Headroom of the rate before the step, and the next hold doubles.
func TestSetback(t *testing.T) {
	r := calmRig(t, overload.Settings{})
	r.outcomes(Overloaded, overload.DefaultMinFailures)
	r.c.Done(Answered, 0) // restart at 60
	for range 20 {
		r.c.Done(Answered, 0)
	}
	for range overload.DefaultMinFailures {
		r.c.Done(Overloaded, 0)
	}
	if got, want := r.c.ep.target, overload.DefaultHeadroom*r.c.known; !near(got, want) {
		t.Errorf("target %v after refusals at the restarted 60, want %v", got, want)
	}
	if got, want := r.c.ep.holdTill.Sub(r.s.now), 2*overload.DefaultHold; got != want {
		t.Errorf("hold %v after the first setback, want %v", got, want)
	}
	t.Run("a queueing server's late answers count", func(t *testing.T) {
		// A server that queues answers late what it refuses at once: the
		// sample of the current rate has its refusals before most of its
		// answers. What the server answered meanwhile counts, the
		// answers to attempts sent before the rate too.
		r := fellBehind(t)
		r.c.ep.before = 30
		r.c.ep.sampleFrom = r.s.now.Add(-overload.DefaultInterval)
		for range 30 {
			r.c.Done(Answered, 0)
		}
		for range overload.DefaultMinFailures {
			r.c.Done(Answered, 0)
			r.c.Done(Overloaded, 0)
		}
		if !r.c.Pacing() {
			t.Fatal("not pacing")
		}
		if got, want := r.rate(), overload.DefaultHeadroom*float64(30+overload.DefaultMinFailures); !near(got, want) {
			t.Errorf("rate %v after the setback, want %v: Headroom of the %d answers of the last Interval", got, want, 30+overload.DefaultMinFailures)
		}
	})
}

// Rule 8: while attempts wait and nothing is refused, the rate grows back
// to what the traffic got, then a tenth per Hold up to a tenth above the
// attempts that come; with nothing known, a slow start doubles it.
func TestGrowth(t *testing.T) {
	r := calmRig(t, overload.Settings{})
	r.outcomes(Overloaded, overload.DefaultMinFailures)
	r.c.Done(Answered, 0)                            // restart at 60
	r.offer(80, func(int) { r.c.Done(Answered, 0) }) // every attempt sent is answered at once
	if got := r.rate(); got <= 60 || got > growth*80+1e-9 {
		t.Errorf("rate %v after 3 s of 80 attempts an Interval, want above 60, at most %v", got, growth*80)
	}
	for _, tc := range []struct {
		name  string
		below bool // a layer below gives up on some, saying so
		grows bool
	}{
		{"not while the target queues", false, false},
		{"while a layer below holds calls back", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			growsUnlessQueued(t, tc.below, tc.grows)
		})
	}
	t.Run("back down to the attempts that come", func(t *testing.T) {
		// A fleet's clients each keeping the highest rate a short sample
		// allowed would together send above what comes to them.
		r := calmRig(t, overload.Settings{})
		r.outcomes(Overloaded, overload.DefaultMinFailures)
		r.c.Done(Answered, 0) // restart at 60
		var waiting []*ticket
		interval := func(n int) { // n attempts ask; each told to go is answered
			for range n {
				waiting = append(waiting, r.ask(time.Minute, false))
			}
			for range 10 {
				waiting = r.answerTold(waiting)
			}
		}
		for range 3 * buckets {
			interval(150)
		}
		grown := r.rate()
		for range 3 * buckets {
			interval(70) // the backlog still waits
		}
		if got := r.rate(); grown < 90 || !near(got, growth*70) || len(waiting) == 0 {
			t.Errorf("rate %v after 3 s of 150 attempts an Interval, then %v after 3 s of 70 with %d waiting; want it grown past 90, then back to 1.1 × 70", grown, got, len(waiting))
		}
	})
	for _, tc := range []struct {
		name   string
		target float64 // set after the restart at 60: 0 as a fresh client's
		known  float64
	}{
		{"a herd's line drains at the rate it grew to", 60, 60},
		{"so does a fresh client's, with no target", 0, 0.01},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := calmRig(t, overload.Settings{})
			r.outcomes(Overloaded, overload.DefaultMinFailures)
			r.c.Done(Answered, 0) // restart at 60
			r.c.ep.target, r.c.known = tc.target, tc.known
			least := r.rate()
			var waiting []*ticket
			for range 3000 { // a herd, and then nothing more comes
				waiting = append(waiting, r.ask(time.Minute, false))
			}
			for range 4 * buckets {
				for range 10 {
					waiting = r.answerTold(waiting)
				}
				got := r.rate()
				if got < least && len(waiting) > 0 {
					t.Fatalf("rate %v with %d of a herd waiting and nothing more coming (target %v, known %v); want %v at least, the rate it grew to", got, len(waiting), tc.target, tc.known, least)
				}
				least = max(least, got)
			}
		})
	}
	t.Run("slow start", func(t *testing.T) {
		r := newRig(t, overload.Settings{})
		r.outcomes(Overloaded, freshAttempts*overload.DefaultMinFailures) // a fresh client: nothing known
		for range 200 {
			r.ask(time.Minute, false)
		}
		r.advance(3 * time.Second)
		r.c.Done(Answered, 0) // a probe answered: restart, nothing known
		before := r.rate()
		r.advance(3 * overload.DefaultInterval)
		if got := r.rate(); got < 4*before {
			t.Errorf("rate %v three Intervals after a restart at %v with nothing known, want it doubled each Interval", got, before)
		}
	})
}

// Rule 9: newest first while the server refuses, a retry at the old end;
// by deadline otherwise.
func TestOrder(t *testing.T) {
	r := calmRig(t, overload.Settings{})
	r.outcomes(Overloaded, overload.DefaultMinFailures) // collapsed: probes
	old := r.ask(5*time.Second, false)
	retry := r.ask(time.Second, true)
	newest := r.ask(3*time.Second, false)
	for !newest.told && !old.told && !retry.told {
		r.advance(time.Millisecond)
	}
	if !newest.told || old.told || retry.told {
		t.Fatalf("refusing: told newest %v, old %v, retry %v; want the newest first", newest.told, old.told, retry.told)
	}
	r.c.Done(Answered, 0) // restart: the server answers, nothing refused
	r.advance(overload.DefaultInterval)
	if !retry.told || !old.told || retry.at.After(old.at) {
		t.Errorf("draining: retry told %v at %v, old told %v at %v; want the earliest deadline first", retry.told, retry.at, old.told, old.at)
	}
}

// Rule 10: an attempt whose turn at the rate, plus the answer time, passes
// its deadline is shed; at any rate, one with less time left than the
// answers took.
func TestShedding(t *testing.T) {
	r := calmRig(t, overload.Settings{})
	r.outcomes(Overloaded, overload.DefaultMinFailures)
	r.c.Done(Answered, 0)                   // restart at 60 an Interval
	r.advance(2 * overload.DefaultInterval) // the collapse's refusals are two Intervals back
	// 300 attempts with 300 ms left each: at 60 an Interval, 180 can go
	// in time, in deadline order; the rest are shed as they ask.
	shed, kept := 0, 0
	for range 300 {
		switch tk := r.ask(300*time.Millisecond, false); {
		case errors.Is(tk.err, ErrShed):
			shed++
		case tk.err == nil:
			kept++
		}
	}
	if shed < 100 || kept < 170 {
		t.Errorf("300 attempts with 300 ms left at 60 an Interval: %d shed, %d kept; want about 120 and 180", shed, kept)
	}
	r.c.Done(Answered, 400*time.Millisecond) // answers take 400 ms
	r.advance(overload.DefaultInterval)
	if tk := r.ask(200*time.Millisecond, false); !errors.Is(tk.err, ErrShed) {
		t.Errorf("200 ms left, answers take 400 ms: %v, want ErrShed", tk.err)
	}

	t.Run("collapsed: a deadline before the next probe", func(t *testing.T) {
		r := calmRig(t, overload.Settings{})
		r.outcomes(Overloaded, overload.DefaultMinFailures)
		if !r.c.ep.collapsed {
			t.Fatal("not collapsed")
		}
		probe := r.ask(10*time.Second, false)
		for !probe.told {
			r.advance(overload.DefaultInterval / 100)
		}
		gap := r.c.ep.probeAt.Sub(r.s.now)
		if probe.err != nil || gap < overload.DefaultInterval/2 {
			t.Fatalf("the first waiter went as a probe: %v, next probe in %v; want nil, at least half an Interval", probe.err, gap)
		}
		// The probe is in flight: its answer would restart the rate, and
		// the waiters go at once.
		short, long := r.ask(gap/2, false), r.ask(gap+overload.DefaultInterval, false)
		if short.told || long.told {
			t.Fatalf("with a probe in flight, a waiter due before the next probe was told %v, one due after it %v; want both waiting", short.err, long.err)
		}
		r.c.Done(Overloaded, 0) // refused: nothing goes before the next probe
		if !short.told || !errors.Is(short.err, ErrShed) || short.at != r.s.now {
			t.Errorf("the probe refused, a waiter due before the next probe: told %v at %v, %v; want ErrShed at once", short.told, short.at, short.err)
		}
		if long.told {
			t.Errorf("a waiter due after the next probe was told %v; want it waiting", long.err)
		}
		if tk := r.ask(gap/4, false); !errors.Is(tk.err, ErrShed) || tk.at != r.s.now {
			t.Errorf("an attempt due before the next probe asks: told %v at %v; want ErrShed at once", tk.err, tk.at)
		}
		r.advance(gap)
		if !long.told || long.err != nil {
			t.Errorf("the waiter due after the next probe: told %v, %v; want it sent as that probe", long.told, long.err)
		}
	})
	t.Run("collapsed on time-outs: to the deadline", func(t *testing.T) {
		// A server whose attempts time out may be slow, not refusing: its
		// callers see their deadlines pass, as without the controller.
		r := calmRig(t, overload.Settings{})
		r.outcomes(Late, overload.DefaultMinFailures)
		if !r.c.ep.collapsed {
			t.Fatal("not collapsed")
		}
		gap := r.c.ep.probeAt.Sub(r.s.now)
		if gap < 2*time.Millisecond {
			t.Fatalf("next probe in %v", gap)
		}
		tk := r.ask(gap/2, false)
		r.advance(gap / 4)
		if tk.told {
			t.Fatalf("a waiter due before the next probe, after time-outs: told %v at once; want it waiting to its deadline", tk.err)
		}
		r.advance(gap / 2)
		if !tk.told || !errors.Is(tk.err, context.DeadlineExceeded) {
			t.Errorf("its deadline passed: told %v, %v; want context.DeadlineExceeded", tk.told, tk.err)
		}
	})
}

// Rule 11: calm Intervals in a row end the pacing.
func TestCalm(t *testing.T) {
	r := calmRig(t, overload.Settings{})
	r.outcomes(Overloaded, overload.DefaultMinFailures)
	r.c.Done(Answered, 0)
	for i := range overload.DefaultCalm + 2 {
		r.calm(10)
		r.advance(overload.DefaultInterval)
		if i < overload.DefaultCalm-2 && !r.c.Pacing() {
			t.Fatalf("calm after %d Intervals, want %d", i+1, overload.DefaultCalm)
		}
	}
	if r.c.Pacing() {
		t.Error("still pacing after Calm quiet Intervals")
	}
}

// Where an attempt asks from: while calm, every place goes at once and is
// counted as sent; while pacing, a fresh attempt asks the line (here, one
// whose deadline has passed is refused), and an attempt from Aside (a
// hedge, sent only while calm) goes at once without a word to the line.
func TestAcquirePlaces(t *testing.T) {
	r := calmRig(t, overload.Settings{})
	sent := r.c.calmSent.Load()
	for _, p := range []Place{Fresh, Back, Aside} {
		if held, err := r.c.Acquire(context.Background(), p); held != 0 || err != nil {
			t.Errorf("calm: Acquire(%v) = %v, %v; want 0, nil", p, held, err)
		}
	}
	if got := r.c.calmSent.Load() - sent; got != 3 {
		t.Errorf("calm: %d attempts counted as sent, want 3", got)
	}
	r.outcomes(Overloaded, overload.DefaultMinFailures)
	if !r.c.Pacing() {
		t.Fatal("not pacing")
	}
	past, cancel := context.WithDeadline(context.Background(), r.s.now)
	defer cancel()
	before := r.c.State()
	if _, err := r.c.Acquire(past, Fresh); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("pacing: Acquire(Fresh) past its deadline = %v, want %v", err, context.DeadlineExceeded)
	}
	if held, err := r.c.Acquire(past, Aside); held != 0 || err != nil {
		t.Errorf("pacing: Acquire(Aside) = %v, %v; want 0, nil", held, err)
	}
	if after := r.c.State(); after != before {
		t.Errorf("pacing: state %+v after, want %+v", after, before)
	}
}

// Rule 12: a server that refused every attempt for DownAfter, and
// DownAfter/(2×Interval) probes, is down: new attempts fail at once but for a
// probe now and then; the waiting keep their place; an answer ends it. A
// wait never outlasts its deadline, nor MaxWait without one.
func TestDownAndBounds(t *testing.T) {
	r := calmRig(t, overload.Settings{})
	r.outcomes(Overloaded, overload.DefaultMinFailures)
	waiting := r.ask(time.Hour, false)
	var asked []*ticket
	refuse := func() { // every attempt let go (a probe) is refused
		for _, tk := range asked {
			if tk.told && tk.err == nil && !tk.reported {
				tk.reported = true
				r.c.Done(Overloaded, 0)
			}
		}
	}
	for r.s.now.Before(simStart.Add(buckets*overload.DefaultInterval + 3*time.Second)) {
		asked = append(asked, r.ask(time.Hour, false))
		refuse()
		r.advance(10 * time.Millisecond)
		refuse()
	}
	st := r.c.State()
	if !st.Down {
		t.Fatalf("not down after 3 s of refused probes: %+v", st)
	}
	if tk := r.ask(time.Hour, false); !errors.Is(tk.err, ErrDown) && tk.err != nil {
		t.Errorf("an attempt while down: %v, want ErrDown (or a probe)", tk.err)
	}
	if waiting.told && waiting.err != nil && !errors.Is(waiting.err, context.DeadlineExceeded) {
		t.Errorf("an attempt waiting before the server was judged down was told %v", waiting.err)
	}
	asked = append(asked, waiting)
	answer := func() bool { // the server is back: a probe let go is answered
		for _, tk := range asked {
			if tk.told && tk.err == nil && !tk.reported {
				tk.reported = true
				r.c.Done(Answered, 0)
				return true
			}
		}
		return false
	}
	for range 300 {
		asked = append(asked, r.ask(time.Hour, false))
		if answer() {
			break
		}
		r.advance(10 * time.Millisecond)
	}
	if r.c.State().Down {
		t.Error("still down after an answer")
	}

	t.Run("bounds", func(t *testing.T) {
		r := calmRig(t, overload.Settings{})
		r.outcomes(Overloaded, overload.DefaultMinFailures)
		dl := r.ask(300*time.Millisecond, false)
		none := r.ask(0, false)
		r.advance(400 * time.Millisecond)
		if !dl.told || !errors.Is(dl.err, context.DeadlineExceeded) && dl.err != nil {
			t.Errorf("a waiter with 300 ms left, 400 ms later: told %v, %v; want it let go at its deadline", dl.told, dl.err)
		}
		r.advance(overload.DefaultMaxWait)
		if !none.told || none.err == nil && none.at.Sub(simStart) > buckets*overload.DefaultInterval+overload.DefaultMaxWait+time.Second {
			t.Errorf("a waiter without a deadline, MaxWait later: told %v, %v", none.told, none.err)
		}
	})
}

// partialLoad is the storm lab's partial failure's load: 600 calls/s for
// 6 s with 2 s deadlines and policy.Default.
func partialLoad() load {
	l := steadyLoad()
	l.dur = 6 * time.Second
	return l
}

// growsUnlessQueued restarts a rig at 60 an Interval and offers 80 an
// Interval for 3 s to a target that answers two of every three attempts
// sent and refuses none: it queues the rest (rule 8: no growth), unless a
// layer below gave up on some of them, saying so (below: it grows).
func growsUnlessQueued(t *testing.T, below, grows bool) {
	t.Helper()
	r := calmRig(t, overload.Settings{})
	r.outcomes(Overloaded, overload.DefaultMinFailures)
	r.c.Done(Answered, 0) // restart at 60
	r.offer(80, func(sent int) {
		switch {
		case sent%3 != 0:
			r.c.Done(Answered, 0)
		case below && sent%30 == 0:
			r.c.Done(Below, 0)
		}
	})
	if got := r.rate(); (got > 60) != grows {
		t.Errorf("rate %v after 3 s of a target that answers two thirds of what it is sent (a layer below giving up on some: %v): want it grown past the 60 it restarted at: %v", got, below, grows)
	}
}

// answerTold advances a tenth of an Interval, answers each attempt of
// waiting told to go, and returns those still waiting.
func (r *rig) answerTold(waiting []*ticket) []*ticket {
	r.advance(overload.DefaultInterval / 10)
	return slices.DeleteFunc(waiting, func(tk *ticket) bool {
		if tk.told && tk.err == nil {
			r.c.Done(Answered, 0)
		}
		return tk.told
	})
}

// offer asks the rig for n attempts an Interval for 3 s, deadlines a
// minute away, and calls sent with the count so far of each attempt told
// to go, as soon as it is (a tenth of an Interval later at most).
func (r *rig) offer(n int, sent func(int)) {
	count := 0
	var waiting []*ticket
	tell := func() {
		waiting = slices.DeleteFunc(waiting, func(tk *ticket) bool {
			if tk.told && tk.err == nil {
				count++
				sent(count)
			}
			return tk.told
		})
	}
	for range 3 * buckets {
		for range n {
			waiting = append(waiting, r.ask(time.Minute, false))
			tell()
		}
		for range 10 {
			r.advance(overload.DefaultInterval / 10)
			tell()
		}
	}
}
