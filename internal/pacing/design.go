package pacing

// Design of the overload controller. This comment is not the package doc
// (doc.go is): it is the controller's rules, rule by rule, and why each is
// as it is, for whoever changes them.
//
// # Holding back only when it helps
//
// The controller holds attempts back only on evidence that holding back
// helps: the server is overloaded (what it serves stops growing with what
// it is sent), or down (nothing succeeds). A server that fails a share of
// its attempts on its own, fast and whatever the load (dead replicas
// behind a proxy, a bad shard), refuses the same share of a handful of
// attempts as of the load that started the pacing; holding back only
// loses it the calls that retries would have got through. So:
//
//   - the first probe a collapsed server answers starts a confirmation: a
//     batch of 4 to 8 attempts (no more than the server answered in the
//     interval that collapsed it) goes at once, and its outcomes are
//     counted apart. If the server refused no less of the batch than of
//     that interval, beyond chance (two standard deviations), the refusals
//     are independent of the load: their share becomes the server's own,
//     and the pacing ends. Otherwise the server took at the low rate what
//     it refused at the high one, and the rate restarts as below. An
//     answer to an attempt sent before the episode began (behind a queue,
//     the server working through what it had) ends a collapse too, once the
//     episode's first interval is over, and restarts the rate unconfirmed:
//     a batch half refused by a full queue and half answered after it
//     would look like independent failures;
//   - overload is FailureRatio of the attempts that the server's share of
//     independent failures leaves, not of every attempt: a server that
//     fails 67 % on its own refuses more than half whatever the load, and
//     is overloaded when it also refuses more than half of the rest;
//   - a collapsed server that never answered this controller, and refused
//     every attempt for 10 intervals (a second at the default Interval),
//     is down: its waiters and the attempts that come fail at once with
//     [ErrDown], but for one probe per interval. Time-outs ([Late]) are
//     slow, not down, and never make a server down.
//
// # Pacing
//
// While the server answers, Acquire returns at once: it takes no lock and
// allocates nothing. When, within one Interval, at least MinFailures
// attempts fail with an overload signal and they are every attempt (which
// the server's independent failures would refuse by chance less than once
// in a million), or more than the overload share of the attempts by two
// standard deviations, the controller starts pacing: every attempt waits
// for a token, and tokens come at a rate that follows what the server
// takes. Independent failures well below the ratio are not overload and
// change nothing: the rule is checked at every refusal, against the
// attempts so far, and the margin keeps chance runs of refusals from
// starting the pacing. The attempts are those sent in the interval and
// those of the last one still in flight, or its answers if they are more:
// refusals often come back ahead of answers (a server sheds at once and
// serves the rest), and judged against the answers alone, 30 refusals that
// come back before 70 answers would look like an overload.
//
// The share of attempts a server fails on its own is learnt while it is
// calm, from the intervals that were not overloaded, and while pacing from
// those in which the server took more attempts than in any interval of the
// episode before, refusing fewer than FailureRatio: refusals that do not
// follow the load. A fresh client, which knows no calm, learns it so. While
// pacing, refusals within that share (by two standard deviations) are not
// load: such an interval counts as one without refusals, and below
// "refused nothing" means nothing beyond that share. A server that fails a
// share of its attempts whatever the load is thus paced no longer than it
// takes its line to drain, rather than having its rate cut after each
// interval's refusals, for good.
//
//   - An episode begins probing: an attempt at once, four per interval
//     for its first three intervals (until a confirmation shows load),
//     then one per interval; and an interval in which at least the
//     overload share of the answers were refusals (more than the server's
//     own share) ends in probing, so that a server that stays down while
//     it is hit (the metastable case) gets its calm. If the server took
//     some attempts in that interval, and answered at least MinFailures,
//     their number is the capacity it showed: a handful of attempts shows
//     none.
//   - The first answer to a probe, once a confirmation shows the refusals
//     were load (above), restarts the rate at what the server is known to
//     take, the batch counted in it: the throughput it sustained before the
//     overload (pauses of Calm intervals or more left out: idle time is not
//     what the server takes), or Headroom of the capacity it showed; with
//     nothing known, a slow start that adds a token per answer.
//   - A collapse under a rate the controller chose (not a probe's), seen
//     in at least MinFailures answers, says that rate is too much for
//     now: what the server is known to take comes down to Headroom of the
//     attempts sent in that interval (or answered, if more), and the rate
//     holds there until Hold after the setback, doubled for each earlier
//     one in the episode (up to 16 Hold). Without it a rate learned on the
//     way up would be tried again after every restart, collapsing a server
//     that stays down while it is hit each time: the client's own
//     metastable loop.
//   - An interval with fewer refusals brings the rate down to Headroom of
//     what the server took, if it was above, unless the interval before
//     did so: refusals right after a cut are mostly its echo. What the
//     server took counts attempts there, as the rate does: its answers and
//     the refusals its share of independent failures explains (so does
//     what it sustained while calm). Without refusals, the rate rises
//     while attempts wait: to what is known at once; after a hold, back to
//     what the server sustained before this episode (a cut capacity may
//     have returned); past that by a quarter per Hold, until the rate and
//     the bucket's burst (a tenth of the rate) are a quarter above the
//     attempts that come (their mean since the last step). A capacity the
//     server showed in this episode bounds the rate for a hold (doubled as
//     after a setback); then, attempts waiting and none refused, it is
//     tried higher: back to the most the server took in an interval of
//     this episode, by doubling, and past that by a quarter. A refusal
//     there shows it again, a hold before the next try. Intervals with no
//     refusals raise what is known.
//   - Calm intervals in a row (no refusal, nobody waiting, attempts below
//     half the rate) end the pacing.
//
// # The line
//
// Waiting attempts form a line. While the server is overloaded (it
// collapsed, refuses attempts, or takes less than it sustained before this
// episode), the line is served newest first: not every caller can be
// served, the newest is the one most likely to still want the answer, and
// an old waiter starved behind new ones costs the server nothing. Once the
// rate is at what the server is known to take, and at least what it
// sustained before this episode, and the server refused nothing in this
// interval, a waiter whose deadline cannot be met (its wait in the line,
// then the least time the server took to answer in the last interval) is
// shed at once with [ErrShed] rather than sent late. Its wait is told at
// that rate, as if nobody newer came: the attempts that come above the rate
// may be a herd's own retries, which end, and counted at the spare they
// leave, the wait of a caller the server could serve in time would look
// too long. At any rate an attempt is shed rather than sent with less time
// left than every answer of the last interval took
// ([Controller.AnsweredAfter]): a server that queues answers late, and an
// attempt sent too late only takes the place of one that could still be
// answered. One whose deadline has passed, its context's timer not yet
// run, is never sent: Acquire returns context.DeadlineExceeded, as its
// context would.
//
// The line is served oldest first instead while it drains: the server
// answers, refused nothing in this interval, and takes again what it
// sustained before this episode. The attempts that come are then served as
// they were before the overload, and the tokens above them (the rate and
// its burst grow to a quarter above them while attempts wait) can go to
// the callers who waited. Newest first would spend those tokens on the
// newest waiters, who could wait, while the oldest, whom the spare tokens
// could still serve in time, ran out of time in the line one after
// another; the line would empty of its old waiters in a deadline's time,
// and the tokens above the arrivals would go unused from then on. Oldest
// first is earliest deadline first: the line is put in deadline order when
// it begins, and each waiter that comes while it lasts takes its place by
// its deadline. The order of arrival alone is not that: a retry waits at
// the old end of the line, and the retry of a probe the collapsed server
// refused is a young call's (a probe goes to the newest waiter); served
// first once the line drains, the probes' retries of a 1 s outage took the
// tokens of the oldest callers, who were then shed (about 30 calls of the
// mesh lab's 7200). Earliest deadline first, with every caller that cannot
// be answered in time shed, gets the most callers through a backlog that
// can be served in time. The price is latency: while the line drains,
// callers wait in it up to their deadlines. A refusal turns the line back
// to newest first at once, so that the retries of attempts a collapsing
// server refused, which wait at the old end, are not sent first into the
// collapse.
//
// While every answer of the last interval with answers took an Interval or
// more, the server keeps a queue of its own, and the line is served oldest
// first too: the callers it can still answer in time are those with more
// time left than its answers take, and newest first would send the newest,
// who could wait, while the oldest run out of time one after another. An
// answer to an attempt sent before the pacing began
// ([Controller.AnsweredSentCalm]) took at least as long as the pacing has
// lasted, so the queue shows as soon as those answers come in, a whole
// queue's wait before a paced attempt is answered.
