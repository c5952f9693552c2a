// Package testutil holds the test helpers every module of herdguard
// shares: a fake [Clock] with its [Timer]s, and [Eventually], which waits
// for what goroutines the test does not control get round to.
//
// A Clock is the internal/clock.Clock that the interceptor and the
// overload controller take in place of the wall clock. A manual clock
// moves only when the test says, and runs the timers that fall due, in
// order:
//
//	clk := testutil.NewClock(time.Now())
//	pacing.New(s, pacing.Env{Clock: clk})
//	clk.Advance(time.Second) // runs every timer due within the second, then returns
//	clk.Delays()             // every delay a timer was set to, in order
//
// [Clock.Skip] moves the clock without firing anything (time the timers
// do not see yet), and [Clock.Expire] hands back the functions of the
// timers due instead of running them.
//
// Two options change how timers fire, for code with other contracts:
//
//   - [Instant]: every wait is instant. A timer fires as soon as it is set
//     and moves the clock on by its delay, as if the wait had passed. Retry
//     tests use it to make backoff free while still seeing every wait.
//   - [Async]: a timer's function runs in its own goroutine, as
//     [time.AfterFunc] runs it, instead of inside the [Clock.Advance] (or,
//     with [Instant], the AfterFunc or Reset) that made it due.
//
// Without Async a timer's function runs synchronously, so a test knows
// that when Advance returns, everything it made due has run.
//
// [Eventually] polls a condition until it holds, for a generous 10 s of
// real time, and fails the test, naming what it waited for, if it never
// does. It starts with yields rather than sleeps, so a wait of a few
// microseconds costs a few microseconds.
package testutil
