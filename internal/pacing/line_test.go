package pacing

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/herdguard/herdguard/overload"

	"github.com/herdguard/herdguard/internal/testutil"
)

// While the rate is below what the server sustained before the overload
// it may return there at any moment, so no waiter is shed on the wait the
// lower rate would give.
func TestNoSheddingBelowTheSustainedRate(t *testing.T) {
	c, clk := calmThenFail(t, 60)
	clk.Advance(overload.DefaultInterval)
	answerProbe(t, c, confirmMin) // restarts at the sustained 60
	// 60 come, as many go as the rate lets, and the server refuses every
	// one (it answered the probe): it collapsed under the rate.
	sent := 1 + demand{in: 60}.run(t, c, clk, refused) // and the probe
	answerProbe(t, c, confirmMin)
	if got, want := rateOf(c), 0.9*float64(sent); math.Abs(got-want) > 1e-9 || want >= 60 {
		t.Fatalf("restart at %v, want 90 %% of the %d sent, below the sustained 60", got, sent)
	}
	spend(t, c) // the tokens the bucket kept
	// Below the sustained 60, 21 waiters: the oldest has its turn after 21
	// tokens, some 40ms at the restarted rate, past its 30ms.
	out := make(chan grant, 21)
	near, cancelNear := deadlineIn(clk, 30*time.Millisecond)
	defer cancelNear()
	acquireAsync(near, c, 0, out)
	waitLine(t, c, 1)
	ctx, cancel := deadlineIn(clk, time.Hour)
	defer cancel()
	for id := 1; id <= 20; id++ {
		acquireAsync(ctx, c, id, out)
		waitLineOrShed(t, c, id+1)
	}
	if st := c.State(); st.Shed != 0 {
		t.Fatalf("shed %d below the sustained rate", st.Shed)
	}
	cancelNear()
	cancel()
	for range 21 {
		<-out
	}
}

// A waiter whose deadline falls before its turn is shed at once; while
// the server is collapsed nobody is shed before their deadline. Its turn
// is told at what the server is known to take, as if nobody newer came:
// attempts that come above the rate (a herd's retries) may stop, and they
// did not count against a waiter's time: counted at the spare above them
// (a tenth of the rate here), the waiter one place back from the newest
// would be shed with 200ms to wait.
func TestShedding(t *testing.T) {
	c, clk := herdRetried(t, 60) // 60 came in the interval before the recovery
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
	c.Done(Answered)
	confirmLoad(t, c, confirmMax) // the herd's 10 answers
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

// A retry waits behind every waiter, even those that come after it.
func TestRetryWaitsAtTheBack(t *testing.T) {
	c, clk := newController(t, overload.Settings{})
	report(c, Answered, 1) // a server that answered once: not down
	report(c, Overloaded, 20)
	// Collapsed, and later in the episode: one probe per interval.
	clk.Advance(firstProbeIntervals * overload.DefaultInterval)
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
		clk.Advance(overload.DefaultInterval)
		if g := <-out; g.id != want || g.err != nil {
			t.Fatalf("served %+v, want %d", g, want)
		}
	}
}

// An attempt with less time left than every answer of the last interval
// took is shed rather than sent: at once when it asks, or when its turn
// comes, and its token goes to the next waiter. Answers of unknown time
// teach nothing.
//
// The controller is a fresh client's in a slow start: nothing is known of
// the server, so no wait in the line is told (nobody is shed for it), and
// a waiter is shed only for the time answers take.
func TestLateAttemptsAreShed(t *testing.T) {
	c, clk := newController(t, overload.Settings{})
	report(c, Overloaded, 20)
	clk.Advance(overload.DefaultInterval)
	answerProbe(t, c, confirmMin) // a slow start at 2, then a token more per answer
	for _, d := range []time.Duration{90 * time.Millisecond, 80 * time.Millisecond, 100 * time.Millisecond} {
		c.AnsweredAfter(d)
	}
	clk.Advance(overload.DefaultInterval) // the last interval's answers took at least 80ms
	if got := rateOf(c); got != 6.25 {
		t.Fatalf("rate = %v, want the slow start's 5 grown by a quarter (nobody waited)", got)
	}

	short, cancelShort := deadlineIn(clk, 79*time.Millisecond)
	defer cancelShort()
	if _, err := c.Acquire(short); !errors.Is(err, ErrShed) {
		t.Fatalf("79ms left, answers take 80ms: Acquire = %v, want ErrShed", err)
	}
	long, cancelLong := deadlineIn(clk, 2*time.Second)
	defer cancelLong()
	if d, err := c.Acquire(long); d != 0 || err != nil {
		t.Fatalf("2s left: Acquire = %v, %v; want sent at once, on the bucket's token", d, err)
	}

	// At 6.25 an interval, the bucket empty: an old waiter with time, then
	// a newer one with 90ms. The next token comes 16ms later, for the
	// newer one, which has 74ms left by then: it is shed, and the token
	// goes to the old one.
	out := make(chan grant, 3)
	acquireAsync(long, c, 0, out)
	waitLine(t, c, 1)
	tight, cancelTight := deadlineIn(clk, 90*time.Millisecond)
	defer cancelTight()
	acquireAsync(tight, c, 1, out)
	waitLine(t, c, 2)
	clk.Advance(overload.DefaultInterval / 5)
	if st := c.State(); st.Waiting != 0 {
		cancelLong()
		cancelTight()
		t.Errorf("%d still waiting after a token: want the newer shed and the old one sent", st.Waiting)
	}
	got := map[int]error{}
	for range 2 {
		g := <-out
		got[g.id] = g.err
	}
	if got[0] != nil || !errors.Is(got[1], ErrShed) {
		t.Fatalf("old waiter: %v, newer with 74ms left: %v; want nil and ErrShed", got[0], got[1])
	}
	if st := c.State(); st.Shed != 2 {
		t.Fatalf("shed %d, want 2", st.Shed)
	}

	// An interval without answers keeps the time; one whose answers are
	// not timed forgets it.
	clk.Advance(overload.DefaultInterval)
	short, cancelShort = deadlineIn(clk, 79*time.Millisecond)
	defer cancelShort()
	if _, err := c.Acquire(short); !errors.Is(err, ErrShed) {
		t.Fatalf("no answer in the last interval, 79ms left: Acquire = %v, want ErrShed", err)
	}
	c.Done(Answered)
	clk.Advance(overload.DefaultInterval)
	if !c.Pacing() {
		t.Fatal("the pacing ended")
	}
	short, cancelShort = deadlineIn(clk, 79*time.Millisecond)
	defer cancelShort()
	if d, err := c.Acquire(short); d != 0 || err != nil {
		t.Fatalf("no answer timed in the last interval, 79ms left: Acquire = %v, %v; want sent at once", d, err)
	}
}

// Shedding by wait counts the time answers take too: at 60 an interval
// the waiter's turn comes in about 1.7ms, and its answer 80ms later, past
// its 81ms.
func TestShedWaitCountsAnswerTime(t *testing.T) {
	c, clk := answersTook(t, 80*time.Millisecond)
	spend(t, c)
	// At the sustained 60 the line drains, oldest first: the waiter's turn
	// is the next token, 1.7ms away, and its answer 80ms after that.
	ctx, cancel := deadlineIn(clk, 81*time.Millisecond)
	defer cancel()
	out := make(chan grant, 1)
	acquireAsync(ctx, c, 0, out)
	waitLineOrShed(t, c, 1)
	cancel() // a waiter that was not shed leaves
	if g := <-out; !errors.Is(g.err, ErrShed) {
		t.Fatalf("Acquire = %v, want ErrShed", g.err)
	}
}

// While answers take an Interval or more (the server keeps a queue of its
// own) the line is served oldest first, earliest deadline first: a waiter
// is shed when the waiters kept ahead of it, then the answer time, leave
// it too late, and the earliest deadlines that can still be met go first,
// whatever the order they came in.
func TestOldestFirstWhileAnswersAreLate(t *testing.T) {
	c, clk := answersTook(t, 300*time.Millisecond)
	var cancels []context.CancelFunc
	defer func() {
		for _, cancel := range cancels {
			cancel()
		}
	}()

	// At 60, a token per 1.7ms, and answers 300ms after it: the first
	// token's answer comes at about 301.7ms, the second's at 303.3ms. By
	// deadline, the one with 302ms goes first; the one with 302.5ms, second,
	// would be answered too late and is shed; the one with 304.5ms takes
	// its place, then the one with 2s. (In the order they came, the one
	// with 304.5ms would go first and both with about 302ms be shed.)
	spend(t, c)
	deadlines := []time.Duration{304500 * time.Microsecond, 302 * time.Millisecond, 302500 * time.Microsecond, 2 * time.Second}
	out := make(chan grant, len(deadlines))
	for id, d := range deadlines {
		ctx, cancel := deadlineIn(clk, d)
		cancels = append(cancels, cancel)
		acquireAsync(ctx, c, id, out)
		waitLineOrShed(t, c, id+1)
	}
	if g := <-out; g.id != 2 || !errors.Is(g.err, ErrShed) {
		t.Fatalf("first result %+v, want waiter 2 shed", g)
	}
	for _, want := range []int{1, 0, 3} {
		if g := serveNext(t, c, clk, out); g.id != want || g.err != nil {
			t.Fatalf("token went to %+v, want waiter %d", g, want)
		}
	}
	wantOldestFirst(t, c, clk)
}

// An answer to an attempt sent while calm took at least as long as the
// pacing has lasted: 150ms into the episode, such an answer makes the
// answers of its interval take at least 150ms, so a caller with 140ms
// left is shed and the line is served oldest first, a whole queue's wait
// before a paced attempt's own answer would say so. An answer whose time
// is not known (Answered: a stream's) teaches nothing, and a timed answer
// that came sooner is the least time.
func TestAnswerSentCalmTookAtLeastTheEpisode(t *testing.T) {
	// sentCalmAnswered is a controller 150ms into its episode, when an
	// answer sent calm came, and an interval later.
	sentCalmAnswered := func(t *testing.T) (*Controller, *testutil.Clock) {
		t.Helper()
		c, clk := calmThenFail(t, 60) // pacing began now
		clk.Advance(overload.DefaultInterval + overload.DefaultInterval/2)
		c.AnsweredSentCalm() // ends the collapse and, past the episode's first interval, restarts the rate unconfirmed
		if got := rateOf(c); got != 60 {
			t.Fatalf("rate after an answer sent calm = %v per interval, want the sustained 60 at once", got)
		}
		clk.Advance(overload.DefaultInterval)
		return c, clk
	}
	c, clk := sentCalmAnswered(t)
	short, cancelShort := deadlineIn(clk, 140*time.Millisecond)
	defer cancelShort()
	if _, err := c.Acquire(short); !errors.Is(err, ErrShed) {
		t.Fatalf("140ms left, an answer sent before the episode 150ms ago: Acquire = %v, want ErrShed", err)
	}
	wantOldestFirst(t, c, clk)

	for _, tc := range []struct {
		name   string
		answer func(*Controller)
	}{
		{"not timed", func(c *Controller) { c.Answered() }},
		{"timed sooner", func(c *Controller) { c.AnsweredSentCalm(); c.AnsweredAfter(20 * time.Millisecond) }},
	} {
		c, clk := sentCalmAnswered(t)
		clk.Advance(overload.DefaultInterval)
		tc.answer(c)
		clk.Advance(overload.DefaultInterval)
		if !c.Pacing() {
			t.Fatalf("%s: the pacing ended", tc.name)
		}
		short, cancelShort := deadlineIn(clk, 140*time.Millisecond)
		defer cancelShort()
		if d, err := c.Acquire(short); d != 0 || err != nil {
			t.Fatalf("%s: 140ms left: Acquire = %v, %v; want sent at once", tc.name, d, err)
		}
	}
}

// wantOldestFirst checks that c serves its line oldest first for its
// answers' time alone: after a refusal in this interval (a line that
// drains is then served newest first), and the bucket spent, three waiters
// with time get a token each, oldest first. The refusal stays counted in
// the interval: the check ends what a test does with c.
func wantOldestFirst(t *testing.T, c *Controller, clk *testutil.Clock) {
	t.Helper()
	c.Done(Overloaded)
	spend(t, c)
	out := make(chan grant, 3)
	for id := range 3 {
		ctx, cancel := deadlineIn(clk, 2*time.Second)
		defer cancel()
		acquireAsync(ctx, c, id, out)
		waitLine(t, c, id+1)
	}
	for want := range 3 {
		if g := serveNext(t, c, clk, out); g.id != want || g.err != nil {
			t.Fatalf("token %d went to %+v, want waiter %d", want, g, want)
		}
	}
}

// answersTook is a controller that paces at the 60 an interval it
// sustained before, the answers of its last interval having taken d. An
// attempt waited in that interval (the restart left the bucket empty), so
// the rate holds there until a Hold after the restart.
func answersTook(t *testing.T, d time.Duration) (*Controller, *testutil.Clock) {
	t.Helper()
	c, clk := calmThenFail(t, 60)
	clk.Advance(overload.DefaultInterval)
	answerProbe(t, c, confirmMin)
	if sent := arrive(t, c, 1); sent != 0 {
		t.Fatal("an attempt went at once on the bucket the restart left empty")
	}
	c.AnsweredAfter(d)
	clk.Advance(overload.DefaultInterval)
	if got := rateOf(c); got != 60 {
		t.Fatalf("rate = %v per interval, want held at the sustained 60", got)
	}
	return c, clk
}

// Once the server answers again at the rate it sustained before, the line
// drains: it is served oldest first, so that the tokens above the arrivals
// go to the callers who waited longest. A refusal turns it back to newest
// first within the same interval, and the retries of the refused attempts,
// at the old end, go last.
func TestLineDrainsOldestFirst(t *testing.T) {
	c, clk := calmThenFail(t, 10)
	clk.Advance(overload.DefaultInterval) // collapsed
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
	c.Done(Answered)              // the probe's answer,
	confirmLoad(t, c, confirmMin) // and the batch's: restart at the sustained 10
	if got := rateOf(c); got != 10 {
		t.Fatalf("restart at %v per interval, want the sustained 10", got)
	}
	next := func() int {
		t.Helper()
		clk.Advance(overload.DefaultInterval / 10) // a token
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

// The line drains earliest deadline first, whatever the order the waiters
// came in: the retry of a refused probe waits at the old end of the line
// while the server is collapsed, but its call is among the youngest, and
// once the line drains it goes after the older callers, who would run out
// of time behind it. (Served in the line's order, the retry went first,
// and through a 1 s outage of the mesh lab about 30 callers were shed at
// the recovery, with up to 48 ms left.)
func TestLineDrainsByDeadline(t *testing.T) {
	c, clk := calmThenFail(t, 10)
	// Collapsed, and later in the episode: one probe per interval.
	clk.Advance((1 + firstProbeIntervals) * overload.DefaultInterval)
	probe, cancelProbe := deadlineIn(clk, 1900*time.Millisecond)
	defer cancelProbe()
	if d, err := c.Acquire(probe); d != 0 || err != nil {
		t.Fatalf("probe: %v, %v", d, err)
	}
	out := make(chan grant, 4)
	for id, d := range []time.Duration{time.Second, 1100 * time.Millisecond, 1200 * time.Millisecond} {
		ctx, cancel := deadlineIn(clk, d)
		defer cancel()
		acquireAsync(ctx, c, id, out)
		waitLine(t, c, id+1)
	}
	c.Done(Overloaded) // the probe refused: its call retries, at the old end
	const retry = 9
	go func() {
		_, err := c.AcquireRetry(probe)
		out <- grant{retry, err}
	}()
	waitLine(t, c, 4)

	// leave advances the clock until k more waiters leave the line, and
	// returns who they were (they may leave together).
	leave := func(k int) map[int]bool {
		t.Helper()
		before := c.State().Waiting
		for i := 0; c.State().Waiting > before-k; i++ {
			if i == 10000 {
				t.Fatalf("%d waiting after a second, want %d", c.State().Waiting, before-k)
			}
			clk.Advance(100 * time.Microsecond)
		}
		got := map[int]bool{}
		for range before - c.State().Waiting {
			g := <-out
			if g.err != nil {
				t.Fatalf("waiter %d: %v", g.id, g.err)
			}
			got[g.id] = true
		}
		return got
	}

	// The next interval's probe is the newest waiter, 2; the server answers
	// it and the batch, and the rate restarts at the sustained 10: with no
	// refusal in this interval, the line drains.
	if got := leave(1); !got[2] {
		t.Fatalf("second probe: %v, want the newest waiter, 2", got)
	}
	c.Done(Answered)
	confirmLoad(t, c, confirmMin)
	if got := rateOf(c); got != 10 {
		t.Fatalf("restart at %v per interval, want the sustained 10", got)
	}
	if got := leave(2); !got[0] || !got[1] {
		t.Fatalf("first served %v, want 0 and 1 (earliest deadline first)", got)
	}
	if got := leave(1); !got[retry] {
		t.Fatalf("served %v, want the retry last", got)
	}
}

// Below the rate the server sustained before, the line does not drain
// (attempts come faster than before the overload was served), and it is
// served newest first.
func TestLineBelowTheSustainedRateIsNewestFirst(t *testing.T) {
	c, clk := calmThenFail(t, 60)
	clk.Advance(overload.DefaultInterval)
	answerProbe(t, c, confirmMin) // restarts at the sustained 60
	// A setback: 30 come, as many go as the rate lets, and the server
	// refuses every one (it answered the probe). What it is known to take
	// comes down to 90 % of those sent.
	sent := 1 + demand{in: 30}.run(t, c, clk, refused) // and the probe
	if got := rateOf(c); got != 1 {
		t.Fatalf("rate after the setback = %v, want a probe's 1", got)
	}
	if spend(t, c) == 0 { // probes, on what the bucket kept
		t.Fatal("no probe went")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	out := make(chan grant, 3)
	for id := range 3 {
		acquireAsync(ctx, c, id, out)
		waitLine(t, c, id+1)
	}
	c.Done(Answered) // a probe's answer
	confirmLoad(t, c, confirmMin)
	if got, want := rateOf(c), 0.9*float64(sent); math.Abs(got-want) > 1e-9 || want >= 60 {
		t.Fatalf("restart at %v, want 90 %% of the %d sent, below the sustained 60", got, sent)
	}
	if g := serveNext(t, c, clk, out); g.id != 2 || g.err != nil {
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
	// As in TestShedding, but with a refusal in the restart's interval,
	// and as many arrivals an interval before as the restarted rate.
	c, clk := herdRetried(t, 9)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := c.Acquire(ctx); err != nil { // the probe
		t.Fatal(err)
	}
	out := make(chan grant, 3)
	near, cancelNear := context.WithDeadline(ctx, clk.Now().Add(20*time.Millisecond))
	defer cancelNear()
	acquireAsync(near, c, 0, out)
	waitLine(t, c, 1)
	for id := 1; id <= 2; id++ {
		acquireAsync(ctx, c, id, out)
		waitLine(t, c, id+1)
	}
	c.Done(Overloaded)            // a refusal in the interval of the restart
	c.Done(Answered)              // the probe's answer,
	confirmLoad(t, c, confirmMax) // and the batch's (the herd answered 10): restart at 9
	if got := rateOf(c); got != 9 {
		t.Fatalf("restart at %v, want 90 %% of the 10 taken", got)
	}
	// The token goes to the newest; the oldest, whose 20ms the line could
	// not meet (its turn at 9 an interval comes in 33ms), stays while the
	// interval shows a refusal.
	clk.Advance(overload.DefaultInterval / 5) // a token (at most one is kept)
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

// TestAWaiterPastItsDeadlineIsNotSent: right after a collapse no answer
// has been timed, so nobody is shed for answers that come late; a waiter
// whose deadline passes on the controller's clock before its context's
// timer has run is still not sent when its turn comes. It gets
// context.DeadlineExceeded, as its context would, is not counted as shed,
// and the token goes to the next attempt. An attempt that asks after its
// deadline is answered so at once.
func TestAWaiterPastItsDeadlineIsNotSent(t *testing.T) {
	c, clk := herdCollapsed(t)
	spend(t, c) // the bucket empty: the next attempt waits a token, 12.5ms at 4 an interval
	shed := c.State().Shed
	ctx, cancel := deadlineIn(clk, 5*time.Millisecond)
	defer cancel()
	out := make(chan grant, 1)
	acquireAsync(ctx, c, 0, out)
	waitLine(t, c, 1)
	if g := serveNext(t, c, clk, out); !errors.Is(g.err, context.DeadlineExceeded) {
		t.Errorf("the waiter whose deadline passed in the line: %v, want context.DeadlineExceeded, not sent", g.err)
	}
	if ctx.Err() != nil {
		t.Fatal("the waiter's context ended in real time: the test shows nothing")
	}
	past, cancelPast := deadlineIn(clk, -time.Millisecond)
	defer cancelPast()
	if _, err := c.Acquire(past); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("an attempt that asks after its deadline: %v, want context.DeadlineExceeded", err)
	}
	if st := c.State(); st.Shed != shed {
		t.Errorf("%d shed, want none: the deadlines passed, the controller shed nobody", st.Shed-shed)
	}
	if arrive(t, c, 1) != 1 {
		t.Error("the token of the expired waiter's turn was not left for the next attempt")
	}
}
