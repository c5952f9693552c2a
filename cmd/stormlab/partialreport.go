package stormlab

import (
	"fmt"
	"html"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

// PartialCell is one strategy's figures in one partial failure: the
// medians, figure by figure, of its runs.
type PartialCell struct {
	P        float64 // the share of attempts the server fails on its own
	Runs     int
	Calls    int
	OK       int     // calls that succeeded
	OKPerSec float64 // the calls that succeeded per second of the run
	// AttemptsPerSec is the attempts the server received per second of
	// the run.
	AttemptsPerSec float64
	// FailedP50 is the median latency of the failed calls: how long a
	// caller waited to learn its call failed.
	FailedP50 time.Duration
}

// OKShare is the share of calls that succeeded, in percent.
func (c PartialCell) OKShare() float64 { return 100 * float64(c.OK) / float64(max(c.Calls, 1)) }

// SummarizePartial returns the cell of one strategy's runs of the partial
// failure sc (at full scale; the runs were made at scale). runs must not be
// empty.
func SummarizePartial(sc Scenario, scale float64, runs ...Result) PartialCell {
	d := sc.Scale(scale).Duration.Seconds()
	each := make([]PartialCell, len(runs))
	for i, r := range runs {
		each[i] = PartialCell{
			P: sc.Faults.FailRate, Calls: r.Calls, OK: r.Succeeded, OKPerSec: float64(r.Succeeded) / d,
			AttemptsPerSec: float64(r.Stats.GetAttempts()) / d, FailedP50: nearestRank(r.FailedLatencies, 0.5),
		}
	}
	mid := func(f func(PartialCell) float64) float64 {
		v := make([]float64, len(each))
		for i, c := range each {
			v[i] = f(c)
		}
		slices.Sort(v)
		return v[len(v)/2]
	}
	return PartialCell{
		P: sc.Faults.FailRate, Runs: len(runs),
		Calls:          int(mid(func(c PartialCell) float64 { return float64(c.Calls) })),
		OK:             int(mid(func(c PartialCell) float64 { return float64(c.OK) })),
		OKPerSec:       mid(func(c PartialCell) float64 { return c.OKPerSec }),
		AttemptsPerSec: mid(func(c PartialCell) float64 { return c.AttemptsPerSec }),
		FailedP50:      time.Duration(mid(func(c PartialCell) float64 { return float64(c.FailedP50) })),
	}
}

// nearestRank returns the q quantile (nearest rank) of sorted, or 0 when
// it is empty.
func nearestRank(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	k := int(float64(len(sorted))*q+0.999999) - 1
	return sorted[min(max(k, 0), len(sorted)-1)]
}

// PartialRow is one strategy's cells in the partial failures of one loop,
// in the order of the shares p.
type PartialRow struct {
	Strategy string
	Cells    []PartialCell
}

// WritePartialTable prints one row per strategy and one column per share
// p below 1 (the calls ok: their share of the calls for an open loop, ok
// calls a second for a closed one), then the dead server's (p = 1)
// attempts a second at the server and median failed call. It reports; it
// does not grade.
func WritePartialTable(w io.Writer, closed bool, rows []PartialRow) error {
	if len(rows) == 0 {
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	what := "calls ok"
	if closed {
		what = "ok calls/s"
	}
	var head []string
	for _, c := range rows[0].Cells {
		if c.P < 1 {
			head = append(head, fmt.Sprintf("%s at p = %g", what, c.P))
		} else {
			head = append(head, "dead server: attempts/s", "failed call p50")
		}
	}
	fmt.Fprintf(tw, "strategy\t%s\t\n", strings.Join(head, "\t"))
	for _, r := range rows {
		var cols []string
		for _, c := range r.Cells {
			switch {
			case c.P >= 1:
				cols = append(cols, fmt.Sprintf("%.0f", c.AttemptsPerSec), fmtFailed(c.FailedP50))
			case closed:
				cols = append(cols, fmt.Sprintf("%.0f", c.OKPerSec))
			default:
				cols = append(cols, fmt.Sprintf("%.1f %%", c.OKShare()))
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t\n", r.Strategy, strings.Join(cols, "\t"))
	}
	return tw.Flush()
}

// fmtFailed formats a failed call's latency, to 0.1ms: one refused at once
// takes less.
func fmtFailed(d time.Duration) string {
	if d < 100*time.Microsecond {
		return "<0.1ms"
	}
	return fmtLatency(d)
}

// PartialLegend says where the figures of the partial-failure tables come
// from.
const PartialLegend = `partial failures: the server fails each attempt with probability p on its own (Unavailable), answers
the rest at once, and has no capacity limit; p = 1 is a dead server. calls ok and failed call p50 (the
median time a failed call took to fail): counted by the client; attempts/s: received by the server.
"retries alone" is the policy with neither the breaker nor overload control; "herdguard defaults" has
both; "breaker only" and "overload control only" one each.`

// WritePartialSVG draws one chart per loop (open, then closed; a loop with
// no rows is left out): the calls ok of each strategy against p, one line
// per strategy, the dead server at p = 1.
func WritePartialSVG(w io.Writer, open, closed []PartialRow) error {
	var parts []string
	height, width := 0, 0
	for _, l := range []struct {
		rows   []PartialRow
		closed bool
	}{{open, false}, {closed, true}} {
		if len(l.rows) == 0 {
			continue
		}
		body, h, wd := drawPartial(partialTitle(l.closed), l.rows, l.closed, height)
		parts = append(parts, body)
		height += h
		width = max(width, wd)
	}
	return writeSVGDoc(w, parts, width, height)
}

func partialTitle(closed bool) string {
	if closed {
		return fmt.Sprintf("partial failures, closed loop (%d callers): ok calls per second against p", ClosedLoopWorkers)
	}
	return "partial failures, open loop: calls ok (% of calls) against p"
}

// drawPartial draws one chart of rows from y0; it returns the drawing, its
// height and its width.
func drawPartial(title string, rows []PartialRow, closed bool, y0 int) (string, int, int) {
	const (
		left, top, plotW, plotH, legendW = 70, 40, 560, 240, 300
		bottom                           = 50
	)
	value := func(c PartialCell) float64 {
		if closed {
			return c.OKPerSec
		}
		return c.OKShare()
	}
	pMin, pMax, vMax := 1.0, 0.0, 0.0
	for _, r := range rows {
		for _, c := range r.Cells {
			pMin, pMax, vMax = min(pMin, c.P), max(pMax, c.P), max(vMax, value(c))
		}
	}
	if !closed {
		vMax = 100
	}
	pMin, pMax, vMax = min(pMin, 0.2), max(pMax, 1), max(vMax*1.05, 1)
	x := func(p float64) float64 { return left + plotW*(p-pMin)/(pMax-pMin) }
	y := func(v float64) float64 { return float64(y0+top+plotH) - plotH*v/vMax }
	legendH := 20*len(rows) + 20
	height := top + max(plotH, legendH) + bottom
	var b strings.Builder
	fmt.Fprintf(&b, `<text x="10" y="%d" font-size="15">%s</text>`+"\n", y0+22, html.EscapeString(title))
	fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#999"/><line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#999"/>`+"\n",
		left, y0+top+plotH, left+plotW, y0+top+plotH, left, y0+top, left, y0+top+plotH)
	for p := 0.2; p <= pMax+1e-9; p += 0.1 {
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#999"/><text x="%.1f" y="%d" text-anchor="middle" fill="#555">%.1f</text>`+"\n",
			x(p), y0+top+plotH, x(p), y0+top+plotH+4, x(p), y0+top+plotH+18, p)
	}
	vstep := roundStep(vMax, 5)
	for v := 0.0; v <= vMax; v += vstep {
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end" fill="#555">%g</text>`+"\n", left-6, y(v)+4, v)
	}
	lx := left + plotW + 20
	for i, r := range rows {
		color := chartColors[i%len(chartColors)]
		pts := make([]string, len(r.Cells))
		for j, c := range r.Cells {
			pts[j] = fmt.Sprintf("%.1f,%.1f", x(c.P), y(value(c)))
			fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>`+"\n", x(c.P), y(value(c)), color)
		}
		width := 1.5
		if r.Strategy == HerdguardDefault {
			width = 3 // the lines of those that do as well overlap it
		}
		fmt.Fprintf(&b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="%g" stroke-opacity="0.8"/>`+"\n", strings.Join(pts, " "), color, width)
		ly := y0 + top + 10 + 20*i
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="3"/><text x="%d" y="%d">%s</text>`+"\n",
			lx, ly, lx+20, ly, color, lx+26, ly+4, html.EscapeString(r.Strategy))
	}
	what := "% of calls ok"
	if closed {
		what = "ok calls per second"
	}
	fmt.Fprintf(&b, `<text x="%d" y="%d" fill="#555">%s against p, the share of attempts the server fails on its own (1: a dead server)</text>`+"\n",
		left, y0+top+plotH+38, what)
	return b.String(), height, left + plotW + 20 + legendW
}

// PartialHarm checks that the defaults do no harm on the rows of one loop,
// and returns what breaks it: at every p below 1 the defaults get the calls
// ok of retries alone, less 1 point of the calls (open loop) or at least
// 0.9 of its ok calls a second (closed loop); at a dead server (p = 1)
// they send at most 5 % of the attempts that retries alone sends, or 25 a
// second, and their failed calls fail at once (a median under 10ms).
func PartialHarm(rows []PartialRow, closed bool) []error {
	find := func(name string) []PartialCell {
		for _, r := range rows {
			if r.Strategy == name {
				return r.Cells
			}
		}
		return nil
	}
	hg, alone := find(HerdguardDefault), find(RetriesAlone)
	if len(hg) != len(alone) || len(hg) == 0 {
		return []error{fmt.Errorf("partial failures: no %q or %q row to compare", HerdguardDefault, RetriesAlone)}
	}
	var errs []error
	for i, c := range hg {
		a := alone[i]
		switch {
		case c.P >= 1:
			if limit := max(a.AttemptsPerSec/20, 25); c.AttemptsPerSec > limit {
				errs = append(errs, fmt.Errorf("dead server: the defaults sent %.0f attempts/s, retries alone %.0f: want at most %.0f", c.AttemptsPerSec, a.AttemptsPerSec, limit))
			}
			if c.FailedP50 > 10*time.Millisecond {
				errs = append(errs, fmt.Errorf("dead server: the defaults' median failed call took %v: want it failed at once", c.FailedP50))
			}
		case closed:
			if c.OKPerSec < 0.9*a.OKPerSec {
				errs = append(errs, fmt.Errorf("closed loop, p = %g: the defaults made %.0f ok calls/s, retries alone %.0f: want at least 0.9 of them", c.P, c.OKPerSec, a.OKPerSec))
			}
		default:
			if c.OKShare() < a.OKShare()-1 {
				errs = append(errs, fmt.Errorf("open loop, p = %g: the defaults got %.1f %% of calls ok, retries alone %.1f %%: want at most 1 point fewer", c.P, c.OKShare(), a.OKShare()))
			}
		}
	}
	return errs
}
