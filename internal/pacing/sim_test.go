package pacing

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	"github.com/herdguard/herdguard/internal/clock"
	"github.com/herdguard/herdguard/overload"
	"github.com/herdguard/herdguard/policy"
)

// This file is a deterministic simulation of the storm lab (cmd/stormlab):
// its servers, a load of calls, and N clients that each send their share
// through a Controller of their own, all on one fake clock and one seeded
// random source. The scenario tests drive it; it stands in for gRPC, which
// the interceptor's tests and the storm lab cover.

// sim is a discrete-event simulation: events run in time order (ties in
// the order they were scheduled), one at a time.
type sim struct {
	now time.Time
	q   events
	seq uint64
	rng *rand.Rand
}

type event struct {
	at   time.Time
	seq  uint64
	f    func()
	dead bool
}

type events []*event

func (q events) Len() int { return len(q) }
func (q events) Less(i, j int) bool {
	return q[i].at.Before(q[j].at) || q[i].at.Equal(q[j].at) && q[i].seq < q[j].seq
}
func (q events) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *events) Push(x any)   { *q = append(*q, x.(*event)) }
func (q *events) Pop() any {
	old := *q
	e := old[len(old)-1]
	*q = old[:len(old)-1]
	return e
}

// simStart is the simulation's time 0: far from real time, so that nothing
// in it can be mistaken for a real deadline.

func newSim(seed uint64) *sim {
	return &sim{now: simStart, rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
}

// after runs f after d.
func (s *sim) after(d time.Duration, f func()) *event {
	e := &event{at: s.now.Add(max(d, 0)), seq: s.seq, f: f}
	s.seq++
	heap.Push(&s.q, e)
	return e
}

// env is the simulation's time and random source for a Controller.
func (s *sim) env() Env { return Env{Clock: simClock{s}, Rand: s.rng.Float64} }

// simClock is the simulation's time as a clock.Clock.
type simClock struct{ s *sim }

func (c simClock) Now() time.Time { return c.s.now }

func (c simClock) NewTimer(d time.Duration) clock.Timer {
	t := &simTimer{s: c.s, c: make(chan time.Time, 1)}
	t.Reset(d)
	return t
}

func (c simClock) AfterFunc(d time.Duration, f func()) clock.Timer {
	t := &simTimer{s: c.s, f: f}
	t.Reset(d)
	return t
}

// simTimer is a timer of the simulation: an event, dead once it fired or
// was stopped.
type simTimer struct {
	s *sim
	e *event
	c chan time.Time
	f func()
}

func (t *simTimer) C() <-chan time.Time { return t.c }

func (t *simTimer) Stop() bool {
	was := t.e != nil && !t.e.dead
	if t.e != nil {
		t.e.dead = true
	}
	return was
}

func (t *simTimer) Reset(d time.Duration) bool {
	was := t.Stop()
	t.e = t.s.after(d, func() {
		if t.f != nil {
			t.f()
			return
		}
		select {
		case t.c <- t.s.now:
		default:
		}
	})
	return was
}

// run runs the events due by end.
func (s *sim) run(end time.Time) {
	for len(s.q) > 0 && !s.q[0].at.After(end) {
		e := heap.Pop(&s.q).(*event)
		if e.dead {
			continue
		}
		e.dead = true
		s.now = e.at
		e.f()
	}
	s.now = later(s.now, end)
}

// since is the simulation's time since its start.
func (s *sim) since() time.Duration { return s.now.Sub(simStart) }

// server is one of the storm lab's fault models.
type server interface {
	// arrive receives an attempt at now (since the start), and says
	// whether it is answered (else refused for load) and after how long.
	arrive(now time.Duration, rng *rand.Rand) (ok bool, took time.Duration)
}

// sticky is the storm lab's sticky server: it takes capacity attempts per
// window; a window over it overloads it, and it fails everything until
// arrivals have stayed within capacity for recoverAfter. From trigger for
// triggerFor the capacity is cutTo instead (0: an outage, which it takes
// as capacity 0, so that it still needs its calm after).
type sticky struct {
	capacity, cutTo       int
	trigger, triggerFor   time.Duration
	window, recoverAfter  time.Duration
	winStart, calmSince   time.Duration
	inWindow              int
	overloaded, calmKnown bool
	spent                 time.Duration // time overloaded, in all
	since                 time.Duration
}

func newSticky(capacity int) *sticky {
	return &sticky{capacity: capacity, window: 100 * time.Millisecond, recoverAfter: time.Second}
}

func (s *sticky) capacityAt(t time.Duration) int {
	if s.triggerFor > 0 && t >= s.trigger && t < s.trigger+s.triggerFor {
		return s.cutTo
	}
	return s.capacity
}

func (s *sticky) arrive(now time.Duration, _ *rand.Rand) (bool, time.Duration) {
	for now-s.winStart >= s.window {
		if s.inWindow > s.capacityAt(s.winStart) {
			s.calmKnown = false
		} else if !s.calmKnown {
			s.calmSince, s.calmKnown = s.winStart, true
		}
		s.winStart += s.window
		s.inWindow = 0
		if s.overloaded && s.calmKnown && s.winStart-s.calmSince >= s.recoverAfter {
			s.overloaded = false
			s.spent += s.winStart - s.since
		}
	}
	s.inWindow++
	if s.inWindow > s.capacityAt(s.winStart) && !s.overloaded {
		s.overloaded, s.since, s.calmKnown = true, now, false
	}
	return !s.overloaded, 0
}

// gentle is the storm lab's gentle server: it serves capacity attempts per
// window in arrival order through a queue, and refuses an attempt whose
// turn is more than queueLimit away.
type gentle struct {
	capacity, cutTo     int
	trigger, triggerFor time.Duration
	window, queueLimit  time.Duration
	queueEnd            time.Duration
}

func (g *gentle) arrive(now time.Duration, _ *rand.Rand) (bool, time.Duration) {
	c := g.capacity
	if g.triggerFor > 0 && now >= g.trigger && now < g.trigger+g.triggerFor {
		c = g.cutTo
	}
	slot := max(now, g.queueEnd) + g.window/time.Duration(c)
	if slot-now > g.queueLimit {
		return false, 0
	}
	g.queueEnd = slot
	return true, slot - now
}

// flaky fails each attempt with probability p on its own, whatever the
// load; from deadFrom for deadFor it refuses everything (a server that
// dies after it answered).
type flaky struct {
	p                 float64
	deadFrom, deadFor time.Duration
}

func (f *flaky) arrive(now time.Duration, rng *rand.Rand) (bool, time.Duration) {
	if f.deadFor > 0 && now >= f.deadFrom && now < f.deadFrom+f.deadFor {
		return false, 0
	}
	return rng.Float64() >= f.p, 0
}

// load is the calls a scenario makes: steady (rate per second for dur),
// or a herd (calls at once).
type load struct {
	rate     float64
	dur      time.Duration
	herd     int
	deadline time.Duration // 0: none
	policy   policy.Policy
}

// steadyLoad is the storm lab's steady load: 600 calls/s for 12 s, 2 s
// deadlines, policy.Default.
func steadyLoad() load {
	return load{rate: 600, dur: 12 * time.Second, deadline: 2 * time.Second, policy: policy.Default()}
}

// herdLoad is the storm lab's one-shot herd: 1000 calls at once, 5
// attempts, a 1 s first wait, full jitter, 30 s deadlines.
func herdLoad() load {
	return load{herd: 1000, deadline: 30 * time.Second,
		policy: policy.Policy{MaxAttempts: 5, InitialBackoff: time.Second, MaxBackoff: time.Minute, Multiplier: 2}}
}

// call is one call's record.
type call struct {
	start, end time.Duration
	ok         bool
	how        string // "ok", "exhausted", "shed", "down", "deadline"
}

// fleet is a simulated run: N clients, each with its own controller (nil:
// no overload control), sending a load's calls round-robin to a server.
type fleet struct {
	s        *sim
	srv      server
	ctls     []*Controller
	l        load
	calls    []call
	attempts int // attempts the server received
	perTenth []int
	pol      policy.Policy
}

// newFleet makes n clients with settings set (nil: no controller).
func newFleet(seed uint64, n int, srv server, l load, set *overload.Settings) *fleet {
	f := &fleet{s: newSim(seed), srv: srv, l: l, pol: l.policy.WithDefaults()}
	for range n {
		var c *Controller
		if set != nil {
			var err error
			if c, err = New(*set, f.s.env()); err != nil {
				panic(err)
			}
		}
		f.ctls = append(f.ctls, c)
	}
	return f
}

// run makes the load's calls and runs until every call ended.
func (f *fleet) run() *fleet {
	n := f.l.herd
	if n == 0 {
		n = int(f.l.rate * f.l.dur.Seconds())
	}
	f.calls = make([]call, n)
	for i := range n {
		var at time.Duration
		if f.l.herd == 0 {
			at = time.Duration(float64(i) * float64(time.Second) / f.l.rate)
		}
		f.s.after(at, func() { f.start(i) })
	}
	f.s.run(simStart.Add(time.Hour))
	return f
}

// start begins call i on client i mod N.
func (f *fleet) start(i int) {
	c := &f.calls[i]
	c.start = f.s.since()
	ctl := f.ctls[i%len(f.ctls)]
	var deadline time.Time
	if f.l.deadline > 0 {
		deadline = f.s.now.Add(f.l.deadline)
	}
	st := &callState{f: f, c: c, ctl: ctl, deadline: deadline}
	if !deadline.IsZero() {
		st.timeout = f.s.after(f.l.deadline, func() { st.finish(false, "deadline") })
	}
	st.attempt(false)
}

// callState is a call in flight.
type callState struct {
	f        *fleet
	c        *call
	ctl      *Controller
	deadline time.Time
	timeout  *event
	n        int // attempts made
	prev     time.Duration
	over     bool
	w        *waiter
}

func (st *callState) finish(ok bool, how string) {
	if st.over {
		return
	}
	st.over = true
	if st.timeout != nil {
		st.timeout.dead = true
	}
	if st.w != nil && st.ctl != nil {
		st.ctl.leave(st.w)
	}
	st.c.end, st.c.ok, st.c.how = st.f.s.since(), ok, fmt.Sprintf("%s@%d", how, st.n)
}

// attempt asks the controller for the next attempt (retry: the last one
// was refused while it paced), then sends it.
func (st *callState) attempt(retry bool) {
	if st.over {
		return
	}
	if st.ctl == nil {
		st.send()
		return
	}
	w := &waiter{}
	w.ready = func(err error) { st.f.s.after(0, func() { st.admitted(w, err) }) }
	err, queued := st.ctl.admit(st.deadline, retry, w)
	if queued {
		st.w = w
		return
	}
	st.admitted(nil, err)
}

func (st *callState) admitted(w *waiter, err error) {
	if w != nil {
		if st.w != w {
			return
		}
		st.w = nil
	}
	switch {
	case st.over:
		if err == nil && st.ctl != nil {
			st.ctl.Done(Ignored, 0)
		}
	case errors.Is(err, ErrDown):
		st.finish(false, "down")
	case errors.Is(err, ErrShed):
		st.finish(false, "shed")
	case errors.Is(err, context.DeadlineExceeded):
		st.finish(false, "deadline")
	case err != nil:
		panic(err)
	default:
		st.send()
	}
}

// oneWay is the network's delay each way.
const oneWay = 100 * time.Microsecond

func (st *callState) send() {
	st.n++
	f := st.f
	sent := f.s.now
	f.s.after(oneWay, func() {
		f.attempts++
		tenth := int(f.s.since() / (10 * time.Millisecond))
		for len(f.perTenth) <= tenth {
			f.perTenth = append(f.perTenth, 0)
		}
		f.perTenth[tenth]++
		ok, took := f.srv.arrive(f.s.since(), f.s.rng)
		back := took + oneWay
		if !st.deadline.IsZero() && f.s.now.Add(back).After(st.deadline) {
			// Not answered in time: the call's deadline ends the attempt.
			f.s.after(st.deadline.Sub(f.s.now), func() { st.ended(Late, 0) })
			return
		}
		f.s.after(back, func() {
			if ok {
				st.ended(Answered, f.s.now.Sub(sent))
			} else {
				st.ended(Overloaded, 0)
			}
		})
	})
}

// ended reports how an attempt ended and decides what follows: the
// interceptor's rules for unary calls, on the simulation.
func (st *callState) ended(o Outcome, took time.Duration) {
	if st.ctl != nil {
		st.ctl.Done(o, took)
	}
	if st.over {
		return
	}
	if o == Answered {
		st.finish(true, "ok")
		return
	}
	if o == Late || st.n >= st.f.pol.MaxAttempts {
		st.finish(false, "exhausted")
		return
	}
	if st.ctl != nil && st.ctl.Pacing() {
		st.attempt(true) // the line replaces the backoff wait
		return
	}
	wait := st.f.pol.Backoff(st.n, st.prev, st.f.s.rng.Float64())
	st.prev = wait
	if !st.deadline.IsZero() && st.f.s.now.Add(wait).After(st.deadline) {
		st.finish(false, "exhausted")
		return
	}
	st.f.s.after(wait, func() { st.attempt(false) })
}

// result is what a run did.
type result struct {
	calls, ok int
	attempts  int
	last      time.Duration // the last success
	recovery  time.Duration // from trigEnd until every later 250 ms bucket is 95 % ok; -1: never
	failedP50 time.Duration
	hows      map[string]int
}

func (f *fleet) result(trigEnd time.Duration) result {
	r := result{calls: len(f.calls), attempts: f.attempts, hows: map[string]int{}}
	const bucket = 250 * time.Millisecond
	var ok, all []int
	var failed []time.Duration
	for _, c := range f.calls {
		r.hows[c.how]++
		i := int(c.end / bucket)
		for len(all) <= i {
			ok, all = append(ok, 0), append(all, 0)
		}
		all[i]++
		if c.ok {
			r.ok++
			ok[i]++
			r.last = max(r.last, c.end)
		} else {
			failed = append(failed, c.end-c.start)
		}
	}
	k := len(all)
	for i := len(all) - 1; i >= 0; i-- {
		if all[i] > 0 && float64(ok[i]) < 0.95*float64(all[i]) {
			break
		}
		k = i
	}
	r.recovery = max(time.Duration(k)*bucket-trigEnd, 0)
	if k == len(all) {
		r.recovery = -1
	}
	if len(failed) > 0 {
		slices.Sort(failed)
		r.failedP50 = failed[len(failed)/2]
	}
	return r
}

func (r result) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "ok %5d/%5d (%5.1f %%) attempts %6d (%.2f/call) last %6v rec %6v failed p50 %v",
		r.ok, r.calls, 100*float64(r.ok)/float64(r.calls), r.attempts, float64(r.attempts)/float64(r.calls),
		r.last.Round(time.Millisecond), r.recovery.Round(time.Millisecond), r.failedP50.Round(time.Millisecond))
	keys := make([]string, 0, len(r.hows))
	for k := range r.hows {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		fmt.Fprintf(&b, " %s=%d", k, r.hows[k])
	}
	return b.String()
}

var simStart = time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
