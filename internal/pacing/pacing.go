package pacing

import (
	"context"
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/herdguard/herdguard/overload"

	"github.com/herdguard/herdguard/internal/clock"
	"github.com/herdguard/herdguard/internal/errs"
)

// The controller's fixed constants, each used by the rule named beside it
// (doc.go lists the rules). Its settings are overload.Settings.
const (
	// buckets: the Window the evidence covers is this many Intervals
	// (rule 1).
	buckets = 10
	// freshAttempts: before a whole Interval has passed, a client judges
	// only evidence of freshAttempts×MinFailures attempts (rule 1).
	freshAttempts = 4
	// sdAbove: refusals above the server's own share by this many
	// standard deviations are not chance (rules 2, 4, 7). The test runs
	// at every refusal, so a looser one would err every few seconds.
	sdAbove = 3
	// keptUp: a server that ends fewer than this share of the attempts
	// it was sent over a Window is queuing (rule 2).
	keptUp = 0.9
	// memory: what the server fails on its own is learnt with this weight
	// per Interval, over some 5 s (rule 3).
	memory = 0.98
	// settled: a share learnt from settled×MinFailures outcomes is
	// settled: Intervals it explains are learnt from at once (rule 3).
	settled = 4
	// sdSame: a sample refused within this many standard deviations of
	// the evidence that lowered the rate is refused as much (rule 4).
	sdSame = 2
	// chance: a collapse is a run of refusals that the share the server
	// fails on its own would make less often than this (rule 5), and less
	// often than once per falseCollapse at the rate runs begin (one per
	// answer): a client that gets thousands of answers a second would
	// otherwise take a server's own failures for a collapse every few
	// seconds.
	chance        = 1e-4
	falseCollapse = time.Hour
	// fellPrior: once the server collapsed in an episode, the share a run
	// is judged against counts its prior as this many attempts (rule 5).
	fellPrior = 1
	// probeShare: a collapsed server is probed at 1/probeShare of what
	// this client's traffic got from it per Interval (rule 5), at most
	// once per Interval and at least once per probeFloor Intervals.
	probeShare = 4
	probeFloor = 2 * buckets
	// maxDoublings bounds how often the hold doubles after setbacks
	// (rule 7).
	maxDoublings = 5
	// growth is the factor the rate grows by per Hold, and how far above
	// the attempts that come it may go (rule 8).
	growth = 1.1
	// burstShare: the token bucket keeps at most 1/burstShare of an
	// Interval's worth of tokens (at least one), so that attempts stay
	// spread over the Interval.
	burstShare = 10
	// foldEvery: the calm path reads the clock once per foldEvery answers
	// since the counts were last folded.
	foldEvery = 32
	// minWait is the least time the line's timer waits for a token.
	minWait = 100 * time.Microsecond
)

// ErrShed is returned by [Controller.Acquire] for an attempt the controller
// refused without sending: its deadline could not be met at the rate the
// server takes, or it waited in the line as long as a call may (MaxWait).
var ErrShed = errs.New("overload: attempt shed: the server is overloaded and the deadline cannot be met")

// ErrDown is returned by [Controller.Acquire] for an attempt the controller
// refused without sending because the server is down: it has refused every
// attempt for DownAfter while the controller held attempts back, so holding
// them back has not helped. One probe still goes now and then.
// errors.Is(ErrDown, ErrShed) is true.
var ErrDown error = downError{}

type downError struct{}

func (downError) Error() string {
	return errs.Prefix + "overload: attempt shed: the server has refused every attempt while held back"
}

func (downError) Is(target error) bool { return target == ErrShed }

// Outcome is what one attempt said about the server's load.
type Outcome uint8

const (
	// Ignored says nothing: the caller cancelled, the client failed by
	// itself, or the attempt never reached a server.
	Ignored Outcome = iota
	// Answered is any answer that is not an overload signal (OK, and also
	// NotFound or InvalidArgument: the server had the capacity to answer).
	Answered
	// Overloaded is a refusal for load: Unavailable, ResourceExhausted.
	Overloaded
	// Late is an attempt the server did not answer in time
	// (DeadlineExceeded): an overload signal, but a slow server is not a
	// down one, so it never makes the server down.
	Late
	// Below is an attempt that a layer below gave up on, saying so: it
	// judged the server below it overloaded and holds calls back for it.
	// It says nothing of this client's load, and that a server answering
	// late is not queuing this client's attempts (rule 2).
	Below
	// HeldBelow is an answer that came late because a layer below held the
	// call back, saying so: that layer paces the server below it, and this
	// target's answers wait on its line. It counts as an answer, and, as
	// Below, says that a server answering late is not queuing this
	// client's attempts (rules 2 and 8).
	HeldBelow
)

// Env is the time a Controller reads and waits on, and its random source.
// A nil field is the real one: [clock.Real] (a timer's function runs in
// its own goroutine, or synchronously, as the clock decides) and
// math/rand/v2's Float64 (a number in [0, 1)).
type Env struct {
	Clock clock.Clock
	Rand  func() float64
}

// config is a controller's settings, defaults filled in, and its Env's
// time and random source.
type config struct {
	overload.Settings
	Now       func() time.Time
	AfterFunc func(d time.Duration, f func()) (stop func() bool)
	Rand      func() float64
}

// Controller paces one target's attempts. Make one with [New]. It is safe
// for concurrent use.
type Controller struct {
	s config

	// The calm path: read and counted without the lock.
	pacing    atomic.Bool
	collapsed atomic.Bool  // pacing, and the server answers nothing: probes only
	calmSent  atomic.Int64 // attempts sent while calm, not yet folded into ev
	firstSent atomic.Int64 // Unix ns: when the first of them was sent
	calmOK    atomic.Int64 // answers while calm, not yet folded
	calmGone  atomic.Int64 // attempts that said nothing, not yet folded
	calmBelow atomic.Int64 // attempts a layer below gave up on or held back
	heldAt    atomic.Int64 // Unix ns: the last answer a layer below held back (HeldBelow); 0: none
	foldAfter atomic.Int64 // Unix ns: a calm answer past this folds the counts in
	stats     counters
	mu        sync.Mutex
	ev        evidence  // the outcomes of the last Window
	folded    time.Time // when the calm counts were last folded into ev
	base      float64   // the share of attempts the server fails on its own: baseR/baseN
	baseR     float64   // the refusals behind it (decaying)
	baseN     float64   // the outcomes behind it (decaying)
	known     float64   // answers per Interval this client's traffic got while calm
	run       int       // refusals since the server's last answer
	runSent   float64   // attempts in flight at that answer, and sent since
	timedOut  bool      // the last refusal was a time-out (Late): the server may be slow, not refusing (rule 10)
	inflight  float64   // attempts sent and not yet ended
	ep        episode   // the current episode of pacing, or the last one
	lastPaced time.Time // when the controller last paced (its last episode began or ended)
	line      []*waiter // newest last; by deadline while edf
	edf       bool      // the line is in deadline order
	timer     lineTimer // serves the line
	intervals int       // Intervals since New, up to buckets: how much of ev is history
}

// counters are the totals since New that State reports.
type counters struct {
	delayed, shed, episodes atomic.Uint64
}

// New returns a calm controller for s, in env.
func New(s overload.Settings, env Env) (*Controller, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	clk, rnd := env.Clock, env.Rand
	if clk == nil {
		clk = clock.Real()
	}
	if rnd == nil {
		rnd = rand.Float64
	}
	c := &Controller{s: config{Settings: s.WithDefaults(), Now: clk.Now, Rand: rnd,
		AfterFunc: func(d time.Duration, f func()) func() bool { return clk.AfterFunc(d, f).Stop }}}
	now := c.s.Now()
	c.ev.start, c.folded = now, now
	c.foldAfter.Store(now.Add(c.s.Interval).UnixNano())
	return c, nil
}

// Pacing reports whether the controller paces attempts: the server has
// shown it is overloaded. It takes no lock.
func (c *Controller) Pacing() bool { return c.pacing.Load() }

// HeldBelow reports whether a layer below held back an answer to this
// target in the last Window (HeldBelow): calls to the target wait in that
// layer's line. It reads the clock only once it has seen one.
func (c *Controller) HeldBelow() bool {
	at := c.heldAt.Load()
	if at == 0 {
		return false
	}
	if c.s.Now().UnixNano()-at < int64(buckets*c.s.Interval) {
		return true
	}
	c.heldAt.CompareAndSwap(at, 0) // forgotten: the next asks read no clock
	return false
}

// sentCalm counts an attempt sent while calm; the first since the last
// fold reads the clock, so that the counts are spread over the time they
// came in, not the quiet before it.
func (c *Controller) sentCalm() {
	if c.calmSent.Add(1) == 1 {
		c.firstSentNow()
	}
}

// firstSentNow notes when the first attempt since the last fold was sent.
func (c *Controller) firstSentNow() { c.firstSent.Store(c.s.Now().UnixNano()) }

// Place is where an attempt asks [Controller.Acquire] for leave to go.
type Place uint8

const (
	// Fresh is a call's first attempt, or a retry after a failure that
	// was not a refusal for load: it waits at the new end of the line.
	Fresh Place = iota
	// Back is the retry of an attempt the server refused for load: it
	// waits instead of its backoff, at the old end of the line, so that
	// under a lasting overload fresh calls go first.
	Back
	// Aside is an attempt that goes only while the controller is calm,
	// such as a hedge: it never waits, and while pacing it is not counted.
	Aside
)

// Acquire asks leave to send one attempt from place, and returns how long
// the attempt was held back. While the server is calm it returns at once,
// having counted the attempt: one atomic load and one atomic add, and the
// refusals that may start the pacing are judged against the attempts
// sent, not only those that ended. While pacing it waits in the line for
// a token until ctx ends (its error is returned; context.DeadlineExceeded
// as soon as its deadline passes on the controller's clock), or the
// controller sheds the attempt ([ErrShed], [ErrDown]). A wait never
// outlasts the attempt's deadline, nor MaxWait.
func (c *Controller) Acquire(ctx context.Context, place Place) (time.Duration, error) {
	// Inlined while calm: one atomic load and one atomic add.
	if p := c.pacing.Load(); p || c.calmSent.Add(1) == 1 {
		return c.acquire(ctx, place, p)
	}
	return 0, nil
}

// acquire is Acquire while pacing (paced), or for the first attempt sent
// while calm since the last fold, which reads the clock (see sentCalm).
func (c *Controller) acquire(ctx context.Context, place Place, paced bool) (time.Duration, error) {
	if !paced {
		c.firstSent.Store(c.s.Now().UnixNano())
		return 0, nil
	}
	if place == Aside {
		return 0, nil
	}
	retry := place == Back
	deadline, _ := ctx.Deadline()
	ready := make(chan error, 1)
	w := &waiter{ready: func(err error) { ready <- err }}
	began := c.s.Now()
	err, queued := c.admit(deadline, retry, w)
	if !queued {
		return 0, err
	}
	select {
	case err := <-ready:
		if err == nil {
			c.stats.delayed.Add(1)
		}
		return c.s.Now().Sub(began), err
	case <-ctx.Done():
		if c.leave(w) { // served or shed at the same moment: a token is lost
			<-ready
		}
		return c.s.Now().Sub(began), ctx.Err()
	}
}

// Done reports how an attempt that Acquire let through ended, and how long the server took to answer it (0: not known).
func (c *Controller) Done(o Outcome, took time.Duration) {
	switch o {
	case Answered, HeldBelow:
		if o == HeldBelow {
			c.calmBelow.Add(1) // folded into the evidence with the calm counts
			c.heldAt.Store(c.s.Now().UnixNano())
		}
		if !c.pacing.Load() {
			if c.calmOK.Add(1)%foldEvery == 0 && c.s.Now().UnixNano() >= c.foldAfter.Load() {
				c.mu.Lock()
				c.foldLocked(c.s.Now())
				c.mu.Unlock()
			}
			return
		}
		c.mu.Lock()
		now := c.s.Now()
		c.foldLocked(now)
		c.ev.cur().answered++
		c.inflight = max(c.inflight-1, 0)
		c.run, c.runSent = 0, c.inflight
		if c.pacing.Load() {
			c.answeredLocked(now, took)
		}
		c.mu.Unlock()
	case Overloaded, Late:
		c.mu.Lock()
		now := c.s.Now()
		c.foldLocked(now)
		c.inflight = max(c.inflight-1, 0)
		c.run++
		c.timedOut = o == Late
		c.ev.cur().refused++
		if c.pacing.Load() {
			c.refusedLocked(now, o == Late)
		} else {
			c.judgeCalmLocked(now)
		}
		c.mu.Unlock()
	case Ignored:
		c.calmGone.Add(1) // no longer in flight
	case Below:
		c.calmGone.Add(1)
		c.calmBelow.Add(1)
	}
}

// foldLocked moves the controller's time to now: it ends the Intervals
// that are over, each Interval's bucket learnt from as it leaves the
// Window (rule 3), folds the calm path's counts into the evidence, spread
// over the time since they were last folded, and runs the episode's rules
// at the end of each Interval.
func (c *Controller) foldLocked(now time.Time) {
	iv := c.s.Interval
	ended := 0
	for now.Sub(c.ev.start) >= iv {
		if ended == buckets { // a whole Window more, every bucket learnt from
			c.ev.restart(now, iv)
			break
		}
		if !c.pacing.Load() {
			c.learnOwnLocked(c.intervals + ended)
		}
		c.ev.step(iv)
		ended++
	}
	sent, ok, gone, below := c.calmSent.Swap(0), c.calmOK.Swap(0), c.calmGone.Swap(0), c.calmBelow.Swap(0)
	if sent > 0 || ok > 0 || gone > 0 {
		since := c.folded
		if first := time.Unix(0, c.firstSent.Load()); sent > 0 && first.After(since) {
			since = first // a burst after a quiet spell is counted when it came
		}
		c.ev.spread(counts{asked: float64(sent), sent: float64(sent), answered: float64(ok), gone: float64(gone), below: float64(below)}, since, now, iv)
	}
	c.inflight = max(c.inflight+float64(sent-ok-gone), 0)
	if ok > 0 { // the server answered since the last refusal
		c.run, c.runSent = 0, c.inflight
	} else {
		c.runSent += float64(sent)
	}
	c.folded = now
	c.foldAfter.Store(c.ev.start.Add(iv).UnixNano())
	if ended == 0 {
		return
	}
	c.intervals = min(c.intervals+ended, buckets)
	if c.pacing.Load() {
		for k := ended; k > 0 && c.pacing.Load(); k-- {
			c.intervalLocked(c.ev.last(k), c.ev.last(min(k+1, buckets)), now)
		}
		return
	}
	c.learnSettledLocked(ended)
	c.learnKnownLocked()
	if c.queuing() {
		c.beginLocked(now, c.ev.total(), buckets*c.s.Interval)
	}
}

// queuing reports whether the server falls behind: over a whole Window,
// the attempts that ended are fewer than keptUp of those sent, and fewer
// by more than the last two Intervals sent and MinFailures, so its queue
// grows (rule 2). A slow server that keeps up ends as many as it is sent,
// however long each takes; a burst just sent is in flight, not queued; and
// a server whose layer below gave up on or held back attempts of the
// Window (Below, HeldBelow) answers late because that layer holds calls
// back for the server it judged overloaded: holding them back here too
// would only add a wait.
func (c *Controller) queuing() bool {
	t := c.ev.total()
	ended := t.answered + t.refused + t.gone
	last := c.ev.last(0).sent + c.ev.last(1).sent + c.ev.last(2).sent
	return c.intervals >= buckets && t.below == 0 && t.sent-ended > max(last, float64(c.s.MinFailures)) && ended < keptUp*t.sent
}

// learnOwnLocked learns, while calm, the share of attempts the server
// fails on its own from the Window's oldest bucket as it leaves it (lived
// Intervals since New), if no pacing began since that bucket began (rule
// 3): the refusals that start an overload come before the pacing they
// start, and are not the server's own.
func (c *Controller) learnOwnLocked(lived int) {
	c.baseR, c.baseN = c.baseR*memory, c.baseN*memory
	began := c.ev.start.Add(-(buckets - 1) * c.s.Interval)
	if lived >= buckets-1 && c.lastPaced.Before(began) {
		c.learnBucketLocked(buckets - 1)
	}
}

// learnSettledLocked learns at once, once the own share is settled
// (learnt from settled×MinFailures outcomes), from the Intervals that
// just ended whose evidence (MinFailures refusals at least) that share
// explains (rule 3): refusals at the share the server is known to fail
// are its own, whenever they come.
func (c *Controller) learnSettledLocked(ended int) {
	for k := min(ended, buckets-1); k > 0; k-- {
		if c.baseN < settled*float64(c.s.MinFailures) {
			return
		}
		if e, _, ok := c.ev.holding(float64(c.s.MinFailures), k); ok && !c.aboveOwn(e) {
			c.learnBucketLocked(k)
		}
	}
}

// learnBucketLocked adds the outcomes of the bucket k Intervals back to
// what the own share is learnt from, once.
func (c *Controller) learnBucketLocked(k int) {
	if !c.ev.learn(k) {
		return
	}
	b := c.ev.last(k)
	c.baseR += b.refused
	c.baseN += b.answered + b.refused
	if c.baseN > 0 {
		c.base = c.baseR / c.baseN
	}
}

// learnKnownLocked learns, while calm, the answers per Interval this
// client's traffic gets (rule 3), over a Window that shows no refusal
// beyond the server's own share and a server that keeps up: one that
// answers less than it is sent, refusing nothing, queues, and its answers
// then tell its capacity, not what it took before the overload.
func (c *Controller) learnKnownLocked() {
	if t := c.ev.total(); c.intervals > 1 && !c.aboveOwn(t) && t.answered+t.refused >= keptUp*t.sent {
		c.known = (t.answered - c.ev.cur().answered) / float64(c.intervals-1)
	}
}

// overloaded reports whether counts show overload: more than FailureRatio
// of the attempts refused, and more than the server's own share explains
// (rule 2).
func (c *Controller) overloaded(e counts) bool {
	return e.share() > c.s.FailureRatio && c.aboveOwn(e)
}

// aboveOwn reports whether e's refusals are more than the share the server
// fails on its own explains by chance: more than sdAbove standard
// deviations above it, counting both e's chance and the uncertainty of the
// share itself, learnt from baseN attempts.
func (c *Controller) aboveOwn(e counts) bool {
	n, p := e.outcomes(), c.base
	v := n * p * (1 - p)
	if c.baseN > 0 {
		v += n * n * p * (1 - p) / c.baseN
	}
	return e.refused > n*p+sdAbove*math.Sqrt(v)
}

// collapsedRun reports whether the refusals since the server's last answer
// show it collapsed (rule 5): at least MinFailures of them, and a longer
// run than the share the server fails on its own makes by chance once in
// 1/chance. That share is the one learnt (rule 3), counted as if
// MinFailures more attempts had been refused at FailureRatio, so that a
// client that has learnt little judges a run as if the server failed
// FailureRatio on its own. Once the server collapsed in this episode, a
// collapse is no longer the rare event that prior guards against: the
// outcomes at the current rate before the run count as learnt too, and
// the prior as fellPrior attempts. The share learnt must also make the
// run less often than once per falseCollapse at the answers per second
// of the Window.
func (c *Controller) collapsedRun() bool {
	need := float64(c.s.MinFailures)
	r, n, prior := c.baseR, c.baseN, need
	if c.pacing.Load() && c.ep.fell {
		s := c.ep.sample
		before := max(s.refused-float64(c.run), 0) // refused at this rate, before the run
		r, n, prior = r+before, n+before+s.answered, fellPrior
	}
	own := (r + c.s.FailureRatio*prior) / (n + prior)
	if own > 0 && own < 1 {
		need = max(need, math.Log(chance)/math.Log(own))
	}
	// Runs begin at every answer: at the Window's answers per second, the
	// share learnt must make the run less often than once per
	// falseCollapse, when that is rarer than 1/chance.
	if runs := c.ev.total().answered / (buckets * c.s.Interval.Seconds()) * falseCollapse.Seconds(); c.base > 0 && c.base < 1 && runs*chance > 1 {
		need = max(need, math.Log(1/runs)/math.Log(c.base))
	}
	// Refusals often come back ahead of the answers to attempts sent with
	// them: the run is a collapse only once it is most of the attempts in
	// flight at the last answer and sent since.
	return float64(c.run) >= need && float64(c.run) > c.s.FailureRatio*max(c.runSent, float64(c.run))
}

// judgeCalmLocked starts the pacing when the evidence, which must cover
// at least a whole Interval or hold freshAttempts×MinFailures attempts,
// shows overload (rule 2): a collapse (rule 5), or refusals above
// FailureRatio of the attempts sent or ended and above the server's own
// share.
func (c *Controller) judgeCalmLocked(now time.Time) {
	if c.intervals == 0 && c.ev.total().outcomes() < freshAttempts*float64(c.s.MinFailures) {
		return // too little evidence yet: less than an Interval's, and few attempts
	}
	e, k, ok := c.ev.holding(float64(c.s.MinFailures), 0)
	if k == 1 && now.Sub(c.ev.start) < c.s.Interval/2 { // at least an Interval's evidence
		e.add(c.ev.last(1))
		k = 2
	}
	if !c.collapsedRun() && (!ok || !c.overloaded(e)) {
		return
	}
	c.beginLocked(now, e, time.Duration(k-1)*c.s.Interval+now.Sub(c.ev.start))
}

// State is a snapshot of a controller, for metrics.
type State struct {
	Pacing   bool
	Down     bool    // the server refused every attempt for DownAfter while held back
	Rate     float64 // attempts per second while pacing (probes, while collapsed); 0 when calm
	Waiting  int     // attempts in the line
	Delayed  uint64  // attempts sent after waiting, since New
	Shed     uint64  // attempts shed, since New
	Episodes uint64  // times pacing began, since New
}

// State returns the controller's state now.
func (c *Controller) State() State {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.foldLocked(c.s.Now())
	st := State{Pacing: c.pacing.Load(), Waiting: len(c.line),
		Delayed: c.stats.delayed.Load(), Shed: c.stats.shed.Load(), Episodes: c.stats.episodes.Load()}
	if st.Pacing {
		st.Down = c.ep.down
		rate := c.ep.rate
		if c.ep.collapsed {
			rate = c.probeRate()
		}
		st.Rate = rate * float64(time.Second) / float64(c.s.Interval)
	}
	return st
}
