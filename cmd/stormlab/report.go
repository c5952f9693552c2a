package stormlab

import (
	"encoding/csv"
	"fmt"
	"html"
	"io"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// WriteTable prints one row per result, every figure labelled with who
// counted it. It reports; it does not grade.
func WriteTable(w io.Writer, results []Result) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	if len(results) > 0 && results[0].Stats.GetChargesApplied() > 0 && isChargeRun(results) {
		return writeChargeTable(tw, results)
	}
	if len(results) > 0 && results[0].Scenario == SlowAttempts().Name {
		return writeLatencyTable(tw, results)
	}
	fmt.Fprintln(tw, "strategy\tcalls ok\tfailed\tbreaker fast-fails\tbudget refusals\tattempts sent\tuntil last success\tpeak retries / window\t(any span)\tpeak attempts / window\toverloaded for\tlast recovery at\tafter recovery ok\t")
	for _, r := range results {
		s := r.Stats
		overloaded, recovered := "-", "-"
		if s.GetOverloadedMs() > 0 {
			overloaded, recovered = fmtMS(s.GetOverloadedMs()), "still down"
			if !s.GetOverloaded() {
				recovered = fmtMS(s.GetRecoveredMs())
			}
		}
		after := "-"
		if r.AfterRecovery > 0 {
			after = fmt.Sprintf("%d/%d", r.AfterRecoveryOK, r.AfterRecovery)
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%s\t%d\t%d\t%d\t%s\t%s\t%s\t\n",
			r.Strategy, r.Succeeded, r.Failed, r.FastFails, r.BudgetRefusals, s.GetAttempts(),
			fmtMS(s.GetLastSuccessMs()), s.GetPeakRetries(), s.GetPeakRetriesSliding(), s.GetPeakAttempts(), overloaded, recovered, after)
	}
	return tw.Flush()
}

// isChargeRun reports whether results are of the lost-replies scenario,
// where what matters is how often each charge was taken.
func isChargeRun(results []Result) bool { return results[0].Scenario == LostReplies().Name }

// writeChargeTable prints what the lost-replies scenario is about: charges
// the server took against calls the client made.
func writeChargeTable(tw *tabwriter.Writer, results []Result) error {
	fmt.Fprintln(tw, "strategy\tcalls\tcalls ok\tattempts sent\tcharges applied\tduplicates refused\tcharged more than once\t")
	for _, r := range results {
		s := r.Stats
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t\n", r.Strategy, r.Calls, r.Succeeded, s.GetAttempts(),
			s.GetChargesApplied(), s.GetDuplicatesRefused(), s.GetChargesApplied()-int64(r.Calls))
	}
	return tw.Flush()
}

// writeLatencyTable prints what the slow-attempts scenario is about: the
// calls' latency percentiles against the extra attempts it cost.
func writeLatencyTable(tw *tabwriter.Writer, results []Result) error {
	fmt.Fprintln(tw, "strategy\tcalls\tcalls ok\tp50\tp99\tp99.9\tmax\tattempts sent\textra attempts\t")
	for _, r := range results {
		s := r.Stats
		extra := s.GetAttempts() - int64(r.Calls)
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s\t%s\t%s\t%d\t%d (%.1f %%)\t\n", r.Strategy, r.Calls, r.Succeeded,
			fmtLatency(r.Percentile(0.5)), fmtLatency(r.Percentile(0.99)), fmtLatency(r.Percentile(0.999)), fmtLatency(r.Percentile(1)),
			s.GetAttempts(), extra, 100*float64(extra)/float64(max(r.Calls, 1)))
	}
	return tw.Flush()
}

func fmtLatency(d time.Duration) string { return d.Round(100 * time.Microsecond).String() }

// Legend says where each figure comes from.
const Legend = `calls ok, failed, breaker fast-fails, budget refusals, after recovery: counted by the client
(a refused call never reaches the server; "after recovery": calls made one after another once the server
recovered and the client's breaker, if any, let calls through again).
peak retries / window: the most retries in one window of the series, as the published figures count;
(any span): the most in any span one window long, wherever it starts, so a wave straddling two windows counts whole.
attempts sent, until last success, peaks, overload, charges: counted by the server, by arrival time since its first arrival,
read once an overloaded server has recovered ("still down": it had not within 10 times its recovery period).
charged more than once = charges applied - calls: every call's first attempt is charged, and each retry of a call
whose reply was lost is charged again unless the server can recognise it by its idempotency key.
p50, p99, p99.9, max: the latencies of the successful calls, timed by the client (nearest rank); extra attempts =
attempts the server received - calls.`

func fmtMS(ms int64) string { return fmt.Sprintf("%.1fs", float64(ms)/1000) }

// WriteOutcomes prints, per result, how many calls ended each way.
func WriteOutcomes(w io.Writer, results []Result) error {
	for _, r := range results {
		keys := make([]string, 0, len(r.Outcomes))
		for k := range r.Outcomes {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		parts := make([]string, len(keys))
		for i, k := range keys {
			parts[i] = fmt.Sprintf("%s %d", k, r.Outcomes[k])
		}
		if _, err := fmt.Fprintf(w, "%s: %s\n", r.Strategy, strings.Join(parts, ", ")); err != nil {
			return err
		}
	}
	return nil
}

const sparkRunes = " ▁▂▃▄▅▆▇█"

// WriteHistograms draws the retries per window of each result as a row of
// bars, all on one scale (the largest peak among them) so rows compare.
// Long series are folded: each column shows the largest of several windows.
func WriteHistograms(w io.Writer, results []Result, width int) error {
	if len(results) == 0 {
		return nil
	}
	if width < 10 {
		width = 10
	}
	top, longest := extent(results)
	per := max(1, (longest+width-1)/width)
	window := time.Duration(results[0].Stats.GetWindowMs()) * time.Millisecond
	fmt.Fprintf(w, "retries per window, one column = %d window(s) of %v (largest shown), full bar = %d retries\n", per, window, top)
	nameWidth := 0
	for _, r := range results {
		nameWidth = max(nameWidth, len(r.Strategy))
	}
	for _, r := range results {
		var b strings.Builder
		ws := r.Stats.GetWindows()
		for i := 0; i < len(ws); i += per {
			var m int64
			for _, x := range ws[i:min(i+per, len(ws))] {
				m = max(m, x.GetRetries())
			}
			b.WriteRune(sparkRune(m, top))
		}
		if _, err := fmt.Fprintf(w, "%-*s |%s| peak %d\n", nameWidth, r.Strategy, b.String(), r.Stats.GetPeakRetries()); err != nil {
			return err
		}
	}
	return nil
}

// extent returns the largest peak of retries per window among results and
// the length of their longest series, the common scale of their charts.
func extent(results []Result) (peak int64, longest int) {
	for _, r := range results {
		peak = max(peak, r.Stats.GetPeakRetries())
		longest = max(longest, len(r.Stats.GetWindows()))
	}
	return peak, longest
}

func sparkRune(v, top int64) rune {
	runes := []rune(sparkRunes)
	if v <= 0 || top <= 0 {
		return runes[0]
	}
	i := 1 + int(float64(v)/float64(top)*float64(len(runes)-2)+0.5)
	return runes[min(i, len(runes)-1)]
}

// SVGSection is one titled group of results in an SVG chart.
type SVGSection struct {
	Title   string
	Results []Result
}

// WriteSVG draws the histograms of every section in one SVG file, the
// sections one above the other. A section with no results draws nothing, as
// WriteHistograms writes nothing for no results; with none at all the file
// is an empty chart.
func WriteSVG(w io.Writer, sections []SVGSection) error {
	return writeStacked(w, sections, func(rs []Result) []Result { return rs }, svgSection)
}

// writeStacked writes one SVG file of the sections drawn by draw one above
// the other, each from the results keep leaves of it; a section left with
// none draws nothing.
func writeStacked(w io.Writer, sections []SVGSection, keep func([]Result) []Result,
	draw func(title string, rs []Result, y0 int) (body string, height, width int)) error {
	var parts []string
	height, width := 0, 0
	for _, s := range sections {
		rs := keep(s.Results)
		if len(rs) == 0 {
			continue
		}
		body, h, wd := draw(s.Title, rs, height)
		parts = append(parts, body)
		height += h
		width = max(width, wd)
	}
	return writeSVGDoc(w, parts, width, height)
}

// writeSVGDoc writes one SVG file of the drawn parts, width by height.
func writeSVGDoc(w io.Writer, parts []string, width, height int) error {
	_, err := fmt.Fprintf(w, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n"+
		`<rect width="100%%" height="100%%" fill="white"/>`+"\n%s</svg>\n", width, height, strings.Join(parts, ""))
	return err
}

// svgSection draws one panel per result, a bar per window, all panels on
// one scale, starting at y0. It returns the drawing, its height and width.
// results must not be empty.
func svgSection(title string, results []Result, y0 int) (string, int, int) {
	const (
		panelH, barAreaH, left, right, top = 90, 60, 230, 20, 40
		plotW                              = 900
	)
	peak, longest := extent(results)
	peak, longest = max(peak, 1), max(longest, 1)
	height := top + panelH*len(results) + 30
	width := left + plotW + right
	bw := float64(plotW) / float64(longest)
	var b strings.Builder
	fmt.Fprintf(&b, `<text x="10" y="%d" font-size="15">%s</text>`+"\n", y0+22, html.EscapeString(title))
	for i, r := range results {
		y0 := y0 + top + i*panelH
		base := y0 + barAreaH
		fmt.Fprintf(&b, `<text x="10" y="%d">%s</text><text x="10" y="%d" fill="#555">peak %d, %d attempts</text>`+"\n",
			base-30, html.EscapeString(r.Strategy), base-14, r.Stats.GetPeakRetries(), r.Stats.GetAttempts())
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#999"/>`+"\n", left, base, left+plotW, base)
		for j, win := range r.Stats.GetWindows() {
			if win.GetRetries() == 0 {
				continue
			}
			h := float64(win.GetRetries()) / float64(peak) * barAreaH
			fmt.Fprintf(&b, `<rect x="%.2f" y="%.2f" width="%.2f" height="%.2f" fill="#3b6ea5"/>`+"\n",
				float64(left)+float64(j)*bw, float64(base)-h, max(bw-0.5, 0.5), h)
		}
	}
	window := time.Duration(results[0].Stats.GetWindowMs()) * time.Millisecond
	fmt.Fprintf(&b, `<text x="%d" y="%d" fill="#555">retries per %v window at the server; all panels share one scale (peak %d); time runs left to right over %v</text>`+"\n",
		left, y0+height-10, window, peak, time.Duration(longest)*window)
	return b.String(), height, width
}

// CallsHeader is the header row [WriteCalls] writes under.
var CallsHeader = []string{"scenario", "strategy", "clients", "run", "start_ms", "end_ms", "outcome"}

// WriteCalls writes every call of one brownout run as the client saw it,
// a row per call in start order, to w as CSV (columns as in
// [CallsHeader]; times in milliseconds since the first call started): a
// recovery is set by the last 250 ms of calls under 95 % ok, and these
// rows show which calls those were, and when they began. A herd's run
// writes nothing.
func WriteCalls(w *csv.Writer, clients, run int, r Result) error {
	if r.Steady == nil {
		return nil
	}
	ms := func(d time.Duration) string {
		return strconv.FormatFloat(float64(d)/float64(time.Millisecond), 'f', 1, 64)
	}
	for _, c := range r.Steady.Calls {
		row := []string{r.Scenario, r.Strategy, strconv.Itoa(clients), strconv.Itoa(run), ms(c.Start), ms(c.End), c.Outcome}
		if err := w.Write(row); err != nil {
			return err
		}
	}
	w.Flush()
	return w.Error()
}

// WindowsHeader is the header row [WriteWindows] writes under.
var WindowsHeader = []string{"scenario", "strategy", "clients", "run", "window_start_ms", "first_attempts", "retries", "failed", "succeeded"}

// WriteWindows writes the server's counts per window of one run, a row
// per window, to w as CSV (columns as in [WindowsHeader]): the attempts
// each window took are what a sticky server judges, so a run that went
// down again after its recovery shows the window that sent it down.
func WriteWindows(w *csv.Writer, clients, run int, r Result) error {
	width := r.Stats.GetWindowMs()
	for i, win := range r.Stats.GetWindows() {
		row := []string{r.Scenario, r.Strategy, strconv.Itoa(clients), strconv.Itoa(run),
			strconv.FormatInt(int64(i)*width, 10),
			strconv.FormatInt(win.GetFirstAttempts(), 10), strconv.FormatInt(win.GetRetries(), 10),
			strconv.FormatInt(win.GetFailed(), 10), strconv.FormatInt(win.GetSucceeded(), 10)}
		if err := w.Write(row); err != nil {
			return err
		}
	}
	w.Flush()
	return w.Error()
}
