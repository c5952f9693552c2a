package stormlab

import (
	"fmt"
	"io"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/policy"
)

// The dead server's timeline, at full scale: it answers for deadAt, then is
// dead for deadFor, then answers again; calls started deadSince into the
// death are the ones that should fail fast.
const (
	deadAt    = 2 * time.Second
	deadFor   = 4 * time.Second
	deadSince = time.Second
	// DefaultPatience is how long after the last call started a steady
	// load without deadlines waits for its calls before it counts the
	// rest as not returned.
	DefaultPatience = 20 * time.Second
)

// Dead is a server that dies after it has answered: 300 calls/s for 10 s,
// retried (when retried) by policy.Default, each with a 2 s deadline, or
// none without deadline. The server answers every attempt at once for 2 s,
// then for 4 s either refuses every attempt at once with Unavailable (as a
// proxy whose backends are gone), or, with kill, is gone (a replica killed:
// nothing listens on its address), and then answers again on the same
// address.
func Dead(kill, deadline bool) Scenario {
	p := policy.Default()
	how := "refusing"
	if kill {
		how = "killed"
	}
	sc := Scenario{
		Name: fmt.Sprintf("dead after answering, %s, 2 s deadlines", how), Rate: 300, Duration: 10 * time.Second,
		Deadline: 2 * time.Second, Bucket: DefaultBucket,
		Attempts: p.MaxAttempts, Base: p.InitialBackoff, Cap: p.MaxBackoff,
		Faults: Faults{Model: ModelGentle, Seed: 1, Window: DefaultWindow,
			TriggerAt: deadAt, TriggerFor: deadFor, TriggerOutage: !kill, TriggerKill: kill},
		dead: true,
	}
	if !deadline {
		sc.Name = fmt.Sprintf("dead after answering, %s, no deadline", how)
		sc.Deadline = 0
	}
	return sc
}

// DeadScenarios are Dead refusing and killed, with deadlines and without.
func DeadScenarios() []Scenario {
	return []Scenario{Dead(false, true), Dead(true, true), Dead(false, false), Dead(true, false)}
}

// IsDead reports whether sc is one of the dead servers made by [Dead].
func (sc Scenario) IsDead() bool { return sc.dead }

// DeadStrategies are those compared at a dead server: no retries, retries
// alone (policy.Default, no breaker, no overload control), herdguard's
// defaults, and gRPC's built-in retry with the same attempts and waits.
func DeadStrategies() []Strategy {
	return []Strategy{
		NoRetriesStrategy(),
		{Name: RetriesAlone, Policy: policy.Default()},
		{Name: HerdguardDefault, Policy: policy.Default(), Breaker: &breaker.Settings{}},
		GRPCRetryStrategy(false),
	}
}

// DeadSummary is one row of a dead server's table: the figures of one run,
// or their medians over several runs of one strategy.
type DeadSummary struct {
	Strategy string
	Runs     int
	Calls    int
	OK       int
	// FailedP50 is the median time of the failed calls started once the
	// server had been dead for deadSince, while it stayed dead.
	FailedP50 time.Duration
	// AttemptsPerSecond is the attempts that reached the server per
	// second while it was dead (none reach a killed one).
	AttemptsPerSecond float64
	// Recovery is how long after the server came back every later bucket
	// of completions was at least RecoveredShare ok; Never: the run ended
	// short of it.
	Recovery time.Duration
	Never    bool
	// NotReturned counts the calls without a deadline still running
	// Patience after the last call started.
	NotReturned int
}

// SummarizeDead returns the row of one strategy's runs of sc (scaled by
// scale): each figure's median over runs.
func SummarizeDead(sc Scenario, scale float64, runs ...Result) DeadSummary {
	sc = sc.Scale(scale)
	from, to := sc.Faults.TriggerAt+scaleDur(deadSince, scale), sc.Faults.TriggerAt+sc.Faults.TriggerFor
	each := make([]DeadSummary, len(runs))
	for i, r := range runs {
		s := DeadSummary{Strategy: r.Strategy, Runs: 1, Calls: r.Calls, OK: r.Succeeded, NotReturned: r.Outcomes[NotReturned]}
		var failed []time.Duration
		for _, c := range r.Steady.Calls {
			if !c.OK() && c.Start >= from && c.Start < to {
				failed = append(failed, c.End-c.Start)
			}
		}
		slices.Sort(failed)
		s.FailedP50 = nearestRank(failed, 0.5)
		s.AttemptsPerSecond = float64(attemptsBetween(r, sc.Faults.TriggerAt, to)) / sc.Faults.TriggerFor.Seconds() * (1 / scale)
		s.Recovery, s.Never = r.Steady.Recovery(RecoveredShare)
		each[i] = s
	}
	out := each[0]
	out.Runs = len(each)
	out.Calls = median(each, func(s DeadSummary) int { return s.Calls })
	out.OK = median(each, func(s DeadSummary) int { return s.OK })
	out.FailedP50 = median(each, func(s DeadSummary) time.Duration { return s.FailedP50 })
	out.AttemptsPerSecond = median(each, func(s DeadSummary) float64 { return s.AttemptsPerSecond })
	out.NotReturned = median(each, func(s DeadSummary) int { return s.NotReturned })
	const never = time.Duration(1<<63 - 1)
	rec := median(each, func(s DeadSummary) time.Duration {
		if s.Never {
			return never
		}
		return s.Recovery
	})
	out.Recovery, out.Never = rec, rec == never
	if out.Never {
		out.Recovery = 0
	}
	return out
}

// attemptsBetween counts the attempts the server received in the windows
// from..to since its clock started.
func attemptsBetween(r Result, from, to time.Duration) int64 {
	w := time.Duration(r.Stats.GetWindowMs()) * time.Millisecond
	if w <= 0 {
		return 0
	}
	var n int64
	for i, win := range r.Stats.GetWindows() {
		if at := time.Duration(i) * w; at >= from && at < to {
			n += win.GetFirstAttempts() + win.GetRetries()
		}
	}
	return n
}

// WriteDeadTable prints one row per strategy of a dead server.
func WriteDeadTable(w io.Writer, rows []DeadSummary) error {
	if len(rows) > 0 && rows[0].Runs > 1 {
		fmt.Fprintf(w, "%s\n\n", mediansOf(rows[0].Runs)[2:])
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "strategy\tcalls ok\tok %\tfailed call p50, dead 1 s+\tattempts/s while dead\trecovery after it came back\tnot returned\t")
	for _, s := range rows {
		rec := fmtDur(s.Recovery)
		if s.Never {
			rec = "never"
		}
		fmt.Fprintf(tw, "%s\t%d\t%.1f %%\t%s\t%.0f\t%s\t%d\t\n", s.Strategy, s.OK, 100*float64(s.OK)/float64(max(s.Calls, 1)),
			fmtFailed(s.FailedP50), s.AttemptsPerSecond, rec, s.NotReturned)
	}
	return tw.Flush()
}

// DeadLegend says where the figures of a dead server's table come from.
const DeadLegend = `dead after answering: calls ok, failed call p50, recovery, not returned: counted by the client; attempts/s while
dead: counted by the server (none reach a killed one). failed call p50: the median time of the failed calls started
once the server had been dead for 1 s (at full scale), while it stayed dead. recovery: from the server's return until
every later 250 ms of completions is at least 95 % ok. not returned: calls without a deadline still running 20 s after
the last call started.`
