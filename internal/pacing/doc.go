// Package pacing is herdguard's overload controller: it paces the attempts
// a client sends to one target once the target shows overload, holds them
// in a line while that helps, and fails them at once once the target is
// down. It knows counts and time, nothing of gRPC; package overload holds
// its settings.
//
// # Use
//
// Before each attempt, a caller asks [Controller.Acquire], saying from
// which [Place] (a fresh attempt, a retry after a refusal for load, or a
// hedge that goes only while calm); after it, it reports the [Outcome]
// with [Controller.Done]. While calm this is an atomic add before the
// attempt and one after it, two atomic loads, and no lock.
//
// # Rules
//
// Every quantity is a share of what this client sends or gets, so that a
// fleet of clients, each with its own controller, acts as one client would:
// each sees the same shares, and what each sends adds up to the same share
// of the load. The constants are named in pacing.go; the settings (in
// capitals) are overload.Settings.
//
//  1. Evidence. Outcomes are counted per Interval over a Window of 10, and
//     judged over the fewest recent Intervals that hold MinFailures
//     refusals, against the attempts sent or ended, whichever are more:
//     a client that sends much judges its last Interval, one that sends
//     little its last second, and refusals that come back ahead of the
//     answers to the same attempts are not all there is. A client judges
//     nothing before its evidence covers an Interval or 4×MinFailures
//     attempts. (TestEvidence)
//  2. Overload. The target is overloaded when more than FailureRatio of
//     the attempts are refused and more than its own share of failures
//     explains (3 standard deviations, counting that share's own
//     uncertainty), when it collapsed (rule 5), or when it falls behind:
//     over a Window it ended fewer than 90 % of the attempts it was sent,
//     MinFailures fewer at least, as a server does that queues what it
//     cannot serve (not when a layer below gave up on or held back some of
//     them, saying so: that layer holds calls back already). The rate becomes Headroom of the answers per Interval
//     the evidence shows. (TestOverload)
//  3. Own share. The share of attempts the target fails on its own is
//     learnt, over some 5 s, from each Interval once it is a Window old,
//     if no pacing began since it began: the refusals that start an
//     overload come before the pacing they start, and are not the
//     target's own. Once that share is settled (learnt from 4×MinFailures
//     outcomes), an Interval whose evidence it explains is learnt from at
//     once. A higher share is learnt by rule 4. What this client's traffic
//     gets per Interval is learnt over a Window with no refusal beyond
//     that share, while the target keeps up with it. (TestOwnShare)
//  4. Independence. Holding back must help: a sample of MinFailures
//     refusals while pacing that the own share explains, or that, sent at
//     no more than Headroom of the rate the evidence of rule 2 was sent
//     at, is refused as much as that evidence (2 standard deviations of
//     the difference), shows refusals that do not follow this client's
//     load. Their share, with the evidence's, becomes the target's own,
//     the Intervals since the episode began may be learnt from, and the
//     pacing ends. Only evidence of MinFailures refusals is compared: a
//     target that fell behind before it refused shows no share to match.
//     A sample that ends in a run of MinFailures refusals is rule 5's to
//     judge: a fleet's other clients may keep the target collapsed.
//     (TestIndependentFailures)
//  5. Collapse. A run of refusals, most of the attempts sent since the last
//     answer and at least MinFailures, that the own share makes by chance
//     less than once in 10⁴ and, at the share learnt, less than once an
//     hour at the answers per second of the Window (a run begins at every
//     answer: a client that gets thousands a second would otherwise take a
//     server's own failures for a collapse every few seconds; for 10⁴ the
//     own share is counted as if MinFailures more attempts had been
//     refused at FailureRatio, so a client that has learnt little needs a
//     longer run; once the target collapsed in the episode, the outcomes
//     at the current rate before the run count too, and that prior as one
//     attempt: a fleet's clients, each of which sees a few of the
//     refusals, find a second collapse within a few of them) says the
//     target collapsed: only probes go, a quarter of what this client's
//     traffic got per Interval (before anything was answered, a sixteenth
//     of what it asked to send), at most one per Interval and at least
//     one per 2 s, at random gaps so that a fleet does not probe in step.
//     (TestCollapseAndProbes)
//  6. Restart. The first answer after a collapse restarts the rate at the
//     target rate: what this client's traffic got before the episode,
//     less setbacks, or, for a fresh client, Headroom of the most the
//     target answered in one Interval, counting the answers to attempts in
//     flight when the episode began that come after it (a herd's answers
//     can come back after its refusals). It holds for Hold. (TestRestart)
//  7. Setback. Refusals beyond the own share at the current rate bring it
//     to Headroom of what the target answered since that rate was set
//     (every answer: a target that queues answers late what it refuses at
//     once); if the rate was one the controller tried (a restart or
//     growth), the target rate falls to Headroom of the rate before that
//     step, and the next hold doubles. (TestSetback)
//  8. Growth. While attempts wait, nothing beyond the own share is
//     refused and the target keeps up (it ended 90 % of the attempts sent
//     in the last two Intervals, or all but MinFailures; one that ends
//     fewer queues them, unless a layer below gave up on or held back
//     some, as in rule 2): after a hold, back to what this client's traffic got
//     before the episode, then a tenth more per Hold, never past a tenth
//     above the attempts that come (a fleet's sum varies more than one
//     client's); while that bound is the target rate or more, a grown
//     rate above it over a Window comes back down to it (a client that kept
//     the highest of its short samples would send above what comes, and a
//     fleet of them above the sum), and a herd's line, which nothing comes
//     to replenish, drains at the rate it grew to; with nothing known, a
//     slow start that doubles per Interval, up to draining the line within
//     a Window. (TestGrowth)
//  9. Order. While the target refuses beyond its own share (in this
//     Interval, the last, or the sample at the current rate), the line
//     serves the newest first (an
//     old waiter starved behind new ones costs the target nothing) and a
//     retry waits at the old end; otherwise, and behind a target whose
//     answers take an Interval or more, it serves by deadline, earliest
//     first, which gets the most callers through a backlog served in
//     time. (TestOrder)
//  10. Shedding. An attempt that cannot go in time is shed at once, not
//     held to its deadline: while the target refuses nothing, one whose
//     turn at the rate, plus the time answers take, passes its deadline;
//     while it collapsed on refusals and no attempt is in flight, one
//     whose deadline comes before the next probe (nothing goes before it;
//     after a time-out the target may be slow, not refusing, and its
//     callers see their deadlines pass); at any rate, one with less time
//     left than every answer of the last Interval took. (TestShedding)
//  11. Calm. Calm Intervals in a row (no refusal beyond the own share,
//     nobody waiting, fewer attempts than half the rate) end the pacing.
//     (TestCalm)
//  12. Down, and bounds. A collapsed target that refused every attempt
//     for DownAfter, and half the probes that DownAfter holds at one per
//     Interval, is down: an
//     attempt that comes fails at once ([ErrDown]) but for a probe now and
//     then; an answer ends it. Attempts already waiting keep their place: a
//     client cannot tell a fleet's short recovery it missed from a target
//     that stayed down. No wait outlasts an attempt's deadline, and one
//     without a deadline waits MaxWait at most. (TestDownAndBounds)
//
// The fleet scenarios of the storm lab, simulated on one fake clock, hold
// these rules to account together (fleet_test.go); the storm lab measures
// them over gRPC (docs/stormlab.md).
package pacing
