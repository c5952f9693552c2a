package stormlab

import (
	"fmt"
	"html"
	"io"
	"strings"
	"text/tabwriter"
	"time"
)

// MeshSummary is one row of a mesh table: the medians, figure by figure,
// of one mesh strategy's runs in one scenario (Summary's
// AttemptsPerCall is the leaf's attempts per user call), and the leaf's
// deadline counts summed over the runs (MaxExcess the most of any run).
type MeshSummary struct {
	Summary
	Deadlines DeadlineCounts
	// RetriedAbovePerCall is the median of the runs' leaf attempts made
	// for retries above the leaf's caller, per user call.
	RetriedAbovePerCall float64
	Typical             MeshResult // the median run (MedianRun), to chart
}

// SummarizeMesh returns the row of one mesh strategy's runs; runs must
// not be empty.
func SummarizeMesh(runs ...MeshResult) MeshSummary {
	rs := make([]Result, len(runs))
	var d DeadlineCounts
	for i, r := range runs {
		rs[i] = r.Result
		if i == 0 || r.Deadlines.MaxExcess > d.MaxExcess {
			d.MaxExcess = r.Deadlines.MaxExcess
		}
		d.Stamped += r.Deadlines.Stamped
		d.None += r.Deadlines.None
		d.Late += r.Deadlines.Late
	}
	typical := MedianRun(rs)
	out := MeshSummary{Summary: Summarize(rs...), Deadlines: d, RetriedAbovePerCall: median(runs, MeshResult.RetriedAbovePerCall)}
	for _, r := range runs {
		if r.Strategy == typical.Strategy && r.Succeeded == typical.Succeeded && r.Stats == typical.Stats {
			out.Typical = r
		}
	}
	return out
}

// MeshRow returns the row of the strategy named name, if rows has it.
func MeshRow(rows []MeshSummary, name string) (MeshSummary, bool) {
	for _, r := range rows {
		if r.Strategy == name {
			return r, true
		}
	}
	return MeshSummary{}, false
}

// WriteMeshTable prints one row per mesh strategy of one scenario (sc, at
// full scale): the leaf's attempts per user call, also as a multiple of
// the last-hop-only row's, and how many of them were made for retries
// above the leaf's caller; the user's calls ok; the ok calls' p50 and p99;
// the recovery after the trigger (for a leaf with one); and the share of
// the leaf's attempts whose deadline was within their user's. A line
// under it says what the deadlines were. It reports; it does not grade.
func WriteMeshTable(w io.Writer, sc Scenario, rows []MeshSummary) error {
	if len(rows) == 0 {
		return nil
	}
	if rows[0].Runs > 1 {
		fmt.Fprintf(w, "%s\n\n", mediansOf(rows[0].Runs)[2:])
	}
	ref, hasRef := MeshRow(rows, MeshLastHop)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "strategy\tleaf attempts / user call\t× last hop only\tfor retries above\tcalls ok\tok %\tp50\tp99\trecovery after trigger\tleaf deadlines within user's\t")
	var all DeadlineCounts
	for i, s := range rows {
		times := ""
		if hasRef && ref.AttemptsPerCall > 0 {
			times = fmt.Sprintf("%.2f", s.AttemptsPerCall/ref.AttemptsPerCall)
		}
		rec := "n/a"
		if sc.Faults.TriggerFor > 0 {
			rec = fmtDur(s.Recovery)
			if s.Never {
				rec = "never"
			}
		}
		fmt.Fprintf(tw, "%s\t%.2f\t%s\t%.2f\t%d\t%.1f %%\t%s\t%s\t%s\t%.1f %% (latest %s past)\t\n", s.Strategy, s.AttemptsPerCall, times, s.RetriedAbovePerCall, s.OK, s.OKShare(),
			fmtLatency(s.P50), fmtLatency(s.P99), rec, s.Deadlines.Within(), fmtExcess(s.Deadlines.MaxExcess))
		all.Stamped, all.None, all.Late = all.Stamped+s.Deadlines.Stamped, all.None+s.Deadlines.None, all.Late+s.Deadlines.Late
		if i == 0 || s.Deadlines.MaxExcess > all.MaxExcess {
			all.MaxExcess = s.Deadlines.MaxExcess
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "\n%s\n", DescribeDeadlines(all))
	return err
}

// DescribeDeadlines says in a line what the leaf saw of its attempts'
// deadlines.
func DescribeDeadlines(d DeadlineCounts) string {
	if d.Stamped == 0 {
		return fmt.Sprintf("deadlines: no leaf attempt carried its user's deadline (%d had none)", d.None)
	}
	if d.Late == 0 && d.None == 0 {
		return fmt.Sprintf("deadlines: every one of the leaf's %d attempts carried a deadline within its user's (the latest %s past it: %d hops of transit; slack %v)",
			d.Stamped, fmtExcess(d.MaxExcess), MeshDepth, DeadlineSlack)
	}
	return fmt.Sprintf("deadlines: of the leaf's %d attempts, %d had no deadline and %d one later than their user's by over %v (the latest %s)",
		d.Stamped, d.None, d.Late, DeadlineSlack, fmtExcess(d.MaxExcess))
}

func fmtExcess(d time.Duration) string {
	if d < 0 {
		return "-" + (-d).Round(10*time.Microsecond).String()
	}
	return d.Round(10 * time.Microsecond).String()
}

// MeshLegend says where the figures of the mesh tables come from.
const MeshLegend = `mesh: a chain of processes on 127.0.0.1, user client -> gateway -> service -> leaf (3 hops); each tier
forwards the charge with the request's context (its deadline goes down) and answers with the error as it came.
The leaf is the demo server with the scenario's faults; the user's load is the scenario's, fired at the gateway.
leaf attempts / user call: the attempts the leaf received per call the user started; x last hop only: as a
multiple of "herdguard at the last hop only" (retries at one layer, the one above the failure); for retries
above: those of them, per user call, made for a retry or hedge of a layer above the leaf's caller (each tier
marks what it sends on for a request that is one, or carries the mark). calls ok, ok %,
p50, p99 (of the ok calls), recovery: counted by the user's client, as in the steady tables. leaf deadlines
within user's: the share of leaf attempts whose own deadline was no later than their user's (which rides along
in metadata), up to 250 ms of transit, and how late the latest was. Every retrying client makes at most 3
attempts on Unavailable, waits from 100 ms. "go-grpc-middleware at every layer" runs its tiers in
cmd/ggm-tier, and the user's hop in one more such tier in front of the gateway.`

// MeshSection is one scenario's rows, to chart.
type MeshSection struct {
	Title string
	Rows  []MeshSummary
}

// leafSeries returns the leaf's attempts per user call per window of a
// run: the attempts that arrived in the window over the calls the user
// started in as long (its rate times the window).
func leafSeries(r Result) []float64 {
	st, win := r.Steady, time.Duration(r.Stats.GetWindowMs())*time.Millisecond
	if st == nil || st.Rate <= 0 || win <= 0 {
		return nil
	}
	per := st.Rate * win.Seconds()
	out := make([]float64, len(r.Stats.GetWindows()))
	for i, w := range r.Stats.GetWindows() {
		out[i] = float64(w.GetFirstAttempts()+w.GetRetries()) / per
	}
	return out
}

// WriteMeshSVG draws, per section, the leaf's attempts per user call in
// each window of each strategy's median run, one polyline per strategy
// against time, the trigger shaded and one attempt per call dashed; the
// sections one above the other. A section with no rows draws nothing.
func WriteMeshSVG(w io.Writer, sections []MeshSection) error {
	var parts []string
	height, width := 0, 0
	for _, s := range sections {
		if len(s.Rows) == 0 {
			continue
		}
		body, h, wd := meshSection(s.Title, s.Rows, height)
		parts = append(parts, body)
		height += h
		width = max(width, wd)
	}
	return writeSVGDoc(w, parts, width, height)
}

// meshSection draws one chart of rows from y0; it returns the drawing, its
// height and its width.
func meshSection(title string, rows []MeshSummary, y0 int) (string, int, int) {
	const (
		left, top, plotW, plotH, legendW = 60, 40, 800, 240, 330
		bottom                           = 50
	)
	var win time.Duration
	longest, peak := 1, 1.0
	var st *Steady
	for _, r := range rows {
		s := leafSeries(r.Typical.Result)
		longest = max(longest, len(s))
		for _, v := range s {
			peak = max(peak, v)
		}
		if r.Typical.Steady != nil && st == nil {
			st, win = r.Typical.Steady, time.Duration(r.Typical.Stats.GetWindowMs())*time.Millisecond
		}
	}
	win = max(win, time.Millisecond)
	yTop := peak * 1.1
	span := time.Duration(longest) * win
	x := func(d time.Duration) float64 { return left + float64(plotW)*float64(d)/float64(span) }
	y := func(v float64) float64 { return float64(y0+top+plotH) - float64(plotH)*v/yTop }
	legendH := 20*len(rows) + 40
	height := top + max(plotH, legendH) + bottom
	var b strings.Builder
	chartFrame(&b, title, st, y0, left, top, plotW, plotH, span, yTop, x, y)
	fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#555" stroke-dasharray="4 4"/>`+"\n", left, y(1), left+plotW, y(1))
	lx := left + plotW + 20
	for i, r := range rows {
		color := chartColors[i%len(chartColors)]
		s := leafSeries(r.Typical.Result)
		pts := make([]string, len(s))
		for j, v := range s {
			pts[j] = fmt.Sprintf("%.1f,%.1f", x(time.Duration(j)*win+win/2), y(v))
		}
		width := 1.5
		if r.Strategy == MeshServerHalf {
			width = 3 // the last-hop-only line runs under it
		}
		if len(pts) > 0 {
			fmt.Fprintf(&b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="%g" stroke-opacity="0.85"/>`+"\n", strings.Join(pts, " "), color, width)
		}
		ly := y0 + top + 10 + 20*i
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="3"/><text x="%d" y="%d">%s (%.2f per call)</text>`+"\n",
			lx, ly, lx+20, ly, color, lx+26, ly+4, html.EscapeString(r.Strategy), r.AttemptsPerCall)
	}
	ly := y0 + top + 10 + 20*len(rows)
	fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#555" stroke-dasharray="4 4"/><text x="%d" y="%d">one attempt per call</text>`+"\n",
		lx, ly, lx+20, ly, lx+26, ly+4)
	fmt.Fprintf(&b, `<text x="%d" y="%d" fill="#555">the leaf's attempts per user call, per %v window, against time since the first attempt (median runs)</text>`+"\n",
		left, y0+top+plotH+38, win)
	return b.String(), height, left + plotW + 20 + legendW
}

// MeshHarm checks that the server half holds the leaf to one retrying
// layer without costing calls, on one brownout's rows, and returns what
// breaks it: the server half makes the leaf receive at most 1.1
// times the attempts per user call of the last hop only, and gets at
// least the last hop only's calls ok less 1 point, and at least those of
// herdguard at every layer.
func MeshHarm(rows []MeshSummary) []error {
	half, ok1 := MeshRow(rows, MeshServerHalf)
	last, ok2 := MeshRow(rows, MeshLastHop)
	if !ok1 || !ok2 {
		return []error{fmt.Errorf("mesh: no %q or %q row to compare", MeshServerHalf, MeshLastHop)}
	}
	var errs []error
	if half.AttemptsPerCall > 1.1*last.AttemptsPerCall {
		errs = append(errs, fmt.Errorf("the server half: %.2f leaf attempts per user call, the last hop only %.2f: want at most 1.1 times", half.AttemptsPerCall, last.AttemptsPerCall))
	}
	if half.OKShare() < last.OKShare()-1 {
		errs = append(errs, fmt.Errorf("the server half: %.1f %% of calls ok, the last hop only %.1f %%: want at most 1 point fewer", half.OKShare(), last.OKShare()))
	}
	if every, ok := MeshRow(rows, MeshHerdguard); ok && half.OKShare() < every.OKShare() {
		errs = append(errs, fmt.Errorf("the server half: %.1f %% of calls ok, herdguard at every layer %.1f %%: want at least as many", half.OKShare(), every.OKShare()))
	}
	return errs
}
