package stormlab

import (
	"fmt"
	"io"
	"slices"
	"text/tabwriter"
	"time"
)

// Summary is one row of a herd or steady-load table: the figures of one
// run, or the medians, figure by figure, of several runs of one strategy.
type Summary struct {
	Strategy string
	Runs     int
	Calls    int
	OK       int // calls that succeeded
	// Attempts is what the server received; AttemptsPerCall divides it by
	// the calls.
	Attempts        int64
	AttemptsPerCall float64
	LastSuccess     time.Duration // the server's last success, since its clock started
	OverloadedFor   time.Duration // how long the sticky server was overloaded
	PeakRetries     int64         // the most retries in any span one window long
	// Recovery is how long after the trigger ended every later bucket of
	// completions was at least RecoveredShare ok; Never when the run ended
	// short of it. Steady load only.
	Recovery time.Duration
	Never    bool
	P50, P99 time.Duration // of the successful calls' latencies
}

// OKShare is the share of calls that succeeded, in percent.
func (s Summary) OKShare() float64 { return 100 * float64(s.OK) / float64(max(s.Calls, 1)) }

// Summarize returns the row of one strategy's runs: the median of each
// figure over runs (a recovery that never came ranks above every time).
// runs must not be empty.
func Summarize(runs ...Result) Summary {
	each := make([]Summary, len(runs))
	for i, r := range runs {
		s := Summary{
			Strategy: r.Strategy, Runs: 1, Calls: r.Calls, OK: r.Succeeded,
			Attempts: r.Stats.GetAttempts(), AttemptsPerCall: r.AttemptsPerCall(),
			LastSuccess:   time.Duration(r.Stats.GetLastSuccessMs()) * time.Millisecond,
			OverloadedFor: time.Duration(r.Stats.GetOverloadedMs()) * time.Millisecond,
			PeakRetries:   r.Stats.GetPeakRetriesSliding(),
			P50:           r.Percentile(0.5), P99: r.Percentile(0.99),
		}
		if r.Steady != nil {
			s.Recovery, s.Never = r.Steady.Recovery(RecoveredShare)
		}
		each[i] = s
	}
	out := each[0]
	out.Runs = len(each)
	out.Calls = median(each, func(s Summary) int { return s.Calls })
	out.OK = median(each, func(s Summary) int { return s.OK })
	out.Attempts = median(each, func(s Summary) int64 { return s.Attempts })
	out.AttemptsPerCall = median(each, func(s Summary) float64 { return s.AttemptsPerCall })
	out.LastSuccess = median(each, func(s Summary) time.Duration { return s.LastSuccess })
	out.OverloadedFor = median(each, func(s Summary) time.Duration { return s.OverloadedFor })
	out.PeakRetries = median(each, func(s Summary) int64 { return s.PeakRetries })
	out.P50 = median(each, func(s Summary) time.Duration { return s.P50 })
	out.P99 = median(each, func(s Summary) time.Duration { return s.P99 })
	const never = time.Duration(1<<63 - 1)
	rec := median(each, func(s Summary) time.Duration {
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

// median returns the median of f over ss (the upper one of an even count).
func median[S any, T int | int64 | float64 | time.Duration](ss []S, f func(S) T) T {
	v := make([]T, len(ss))
	for i, s := range ss {
		v[i] = f(s)
	}
	slices.Sort(v)
	return v[len(v)/2]
}

// MedianRun returns the run whose calls ok are the median of runs, to
// chart as the strategy's typical run. runs must not be empty.
func MedianRun(runs []Result) Result {
	byOK := slices.Clone(runs)
	slices.SortStableFunc(byOK, func(a, b Result) int { return a.Succeeded - b.Succeeded })
	return byOK[len(byOK)/2]
}

// WriteHerdTable prints one row per strategy of a herd, beside the least
// possible attempts and time to the last success (b, from Scenario.Bound)
// and each row's figures as multiples of them.
func WriteHerdTable(w io.Writer, b Bound, rows []Summary) error {
	runs := 1
	if len(rows) > 0 {
		runs = rows[0].Runs
	}
	fmt.Fprintf(w, "least possible: %d attempts, last success at %s%s\n\n", b.Attempts, fmtDur(b.LastSuccess), mediansOf(runs))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "strategy\tcalls ok\tattempts\t× least\tlast success\t× least\toverloaded for\tpeak retries / window\t")
	for _, s := range rows {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.2f\t%s\t%.2f\t%s\t%d\t\n", s.Strategy, s.OK, s.Attempts,
			float64(s.Attempts)/float64(max(b.Attempts, 1)), fmtDur(s.LastSuccess),
			float64(s.LastSuccess)/float64(max(b.LastSuccess, 1)), fmtDur(s.OverloadedFor), s.PeakRetries)
	}
	fmt.Fprintf(tw, "least possible\t%d\t%d\t1.00\t%s\t1.00\t\t\t\n", b.OK, b.Attempts, fmtDur(b.LastSuccess))
	return tw.Flush()
}

// WriteSteadyTable prints one row per strategy of a steady load, and a
// last row with the best possible numbers (b, from Scenario.Bound).
func WriteSteadyTable(w io.Writer, b Bound, rows []Summary) error {
	if len(rows) > 0 && rows[0].Runs > 1 {
		fmt.Fprintf(w, "%s\n\n", mediansOf(rows[0].Runs)[2:])
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "strategy\tcalls ok\tok %\tattempts / call\trecovery after trigger\tp50\tp99\t")
	for _, s := range rows {
		rec := fmtDur(s.Recovery)
		if s.Never {
			rec = "never"
		}
		fmt.Fprintf(tw, "%s\t%d\t%.1f %%\t%.2f\t%s\t%s\t%s\t\n", s.Strategy, s.OK, s.OKShare(), s.AttemptsPerCall, rec, fmtLatency(s.P50), fmtLatency(s.P99))
	}
	fmt.Fprintf(tw, "best possible\t%d\t%.1f %%\t1.00\t\t\t\t\n", b.OK, 100*float64(b.OK)/float64(max(b.Calls, 1)))
	return tw.Flush()
}

func mediansOf(runs int) string {
	if runs <= 1 {
		return ""
	}
	return fmt.Sprintf("; medians of %d runs", runs)
}

func fmtDur(d time.Duration) string {
	if d == 0 {
		return "0"
	}
	return fmt.Sprintf("%.2fs", d.Seconds())
}

// SteadyLegend says where the figures of a steady-load table come from.
const SteadyLegend = `calls ok, ok %, recovery, p50, p99: counted by the client; attempts / call: the attempts the server received
per call started. recovery after trigger: from the trigger's end until every later 250 ms (at full scale) of
completions, counted by when they ended, is at least 95 % ok; "never" when the run ends short of it.
p50, p99: the latencies of the successful calls (nearest rank). best possible: a client that sends each call
when the server can take it, oldest first, until its deadline, but cannot foresee the trigger.
"exponential + ..." strategies retry without a breaker; "herdguard ..." ones have the default breaker.`

// HerdLegend says where the figures of a herd table come from.
const HerdLegend = `calls ok: counted by the client; attempts, last success, overloaded for, peak retries: counted by the server
from its first arrival. least possible: every call once, plus one retry of each the first window turned away
(1000 + (1000 - C)); the last success as the last window the retries need begins: the first window and the
server's calm, then one window per C calls left but the last (1.0 s + ceil((1000 - C)/C) x 0.1 s at full scale).
x least: the row's figure as a multiple of the least.`
