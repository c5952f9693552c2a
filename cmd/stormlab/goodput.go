package stormlab

import (
	"fmt"
	"html"
	"io"
	"math"
	"strings"
	"time"
)

// steadyOnly returns the results of steady-load runs among rs.
func steadyOnly(rs []Result) []Result {
	var out []Result
	for _, r := range rs {
		if r.Steady != nil && r.Steady.Bucket > 0 {
			out = append(out, r)
		}
	}
	return out
}

// goodputExtent returns the longest goodput series among rs, the largest
// count of ok calls in one bucket, and the calls offered per bucket (the
// largest rate times the bucket).
func goodputExtent(rs []Result) (longest, peak int, offered float64) {
	for _, r := range rs {
		ok, all := r.Steady.Goodput()
		longest = max(longest, len(all))
		for _, v := range ok {
			peak = max(peak, v)
		}
		offered = max(offered, r.Steady.Rate*r.Steady.Bucket.Seconds())
	}
	return longest, peak, offered
}

// WriteGoodput draws the ok calls per bucket of each steady-load result as
// a row of bars, all on one scale, under a row that marks the trigger.
// Results of other scenarios are left out; with none it writes nothing.
// Long series are folded: a column shows the mean of several buckets.
func WriteGoodput(w io.Writer, results []Result, width int) error {
	rs := steadyOnly(results)
	if len(rs) == 0 {
		return nil
	}
	width = max(width, 10)
	longest, peak, offered := goodputExtent(rs)
	top := max(float64(peak), offered, 1)
	per := max(1, (longest+width-1)/width)
	cols := (longest + per - 1) / per
	st := rs[0].Steady
	fmt.Fprintf(w, "ok calls per %v (by when they ended), one column = %d bucket(s), full bar = %.0f calls; ▒ marks the trigger\n",
		st.Bucket, per, top)
	nameWidth := len("trigger")
	for _, r := range rs {
		nameWidth = max(nameWidth, len(r.Strategy))
	}
	var mark strings.Builder
	for c := range cols {
		from, to := time.Duration(c*per)*st.Bucket, time.Duration((c+1)*per)*st.Bucket
		if st.TriggerEnd > st.TriggerStart && from < st.TriggerEnd && to > st.TriggerStart {
			mark.WriteRune('▒')
		} else {
			mark.WriteRune(' ')
		}
	}
	fmt.Fprintf(w, "%-*s |%s|\n", nameWidth, "trigger", mark.String())
	runes := []rune(sparkRunes)
	for _, r := range rs {
		ok, _ := r.Steady.Goodput()
		var b strings.Builder
		for c := range cols {
			sum, n := 0, 0
			for i := c * per; i < min((c+1)*per, len(ok)); i++ {
				sum, n = sum+ok[i], n+1
			}
			v := 0.0
			if n > 0 {
				v = float64(sum) / float64(n)
			}
			i := 0
			if v > 0 {
				i = min(1+int(v/top*float64(len(runes)-2)+0.5), len(runes)-1)
			}
			b.WriteRune(runes[i])
		}
		if _, err := fmt.Fprintf(w, "%-*s |%s| ok %.1f %%\n", nameWidth, r.Strategy, b.String(),
			100*float64(r.Succeeded)/float64(max(r.Calls, 1))); err != nil {
			return err
		}
	}
	return nil
}

// chartColors are the polylines' colours, one per strategy in turn.
var chartColors = []string{"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf", "#bcbd22"}

// WriteGoodputSVG draws, per section, the ok calls per bucket of each of its
// steady-load results as one polyline against time, the trigger shaded,
// the offered load dashed, and a legend; the sections one above the other.
// A section with no steady-load result draws nothing; with none at all the
// file is an empty chart.
func WriteGoodputSVG(w io.Writer, sections []SVGSection) error {
	return writeStacked(w, sections, steadyOnly, goodputSection)
}

// goodputSection draws one chart of rs (not empty, all steady) from y0; it
// returns the drawing, its height and its width.
func goodputSection(title string, rs []Result, y0 int) (string, int, int) {
	const (
		left, top, plotW, plotH, legendW = 60, 40, 800, 240, 300
		bottom                           = 50
	)
	longest, peak, offered := goodputExtent(rs)
	longest = max(longest, 1)
	yTop := max(float64(peak), offered, 1) * 1.1
	st := rs[0].Steady
	span := time.Duration(longest) * st.Bucket
	x := func(d time.Duration) float64 { return left + float64(plotW)*float64(d)/float64(span) }
	y := func(v float64) float64 { return float64(y0+top+plotH) - float64(plotH)*v/yTop }
	legendH := 20*len(rs) + 40
	height := top + max(plotH, legendH) + bottom
	var b strings.Builder
	chartFrame(&b, title, st, y0, left, top, plotW, plotH, span, yTop, x, y)
	if offered > 0 {
		fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#555" stroke-dasharray="4 4"/>`+"\n", left, y(offered), left+plotW, y(offered))
	}
	lx := left + plotW + 20
	for i, r := range rs {
		color := chartColors[i%len(chartColors)]
		ok, _ := r.Steady.Goodput()
		pts := make([]string, len(ok))
		for j, v := range ok {
			pts[j] = fmt.Sprintf("%.1f,%.1f", x(time.Duration(j)*st.Bucket+st.Bucket/2), y(float64(v)))
		}
		if len(pts) > 0 {
			fmt.Fprintf(&b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="1.5"/>`+"\n", strings.Join(pts, " "), color)
		}
		ly := y0 + top + 10 + 20*i
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="3"/><text x="%d" y="%d">%s (%.1f %% ok)</text>`+"\n",
			lx, ly, lx+20, ly, color, lx+26, ly+4, html.EscapeString(r.Strategy), 100*float64(r.Succeeded)/float64(max(r.Calls, 1)))
	}
	ly := y0 + top + 10 + 20*len(rs)
	fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#555" stroke-dasharray="4 4"/><text x="%d" y="%d">calls offered</text>`+"\n",
		lx, ly, lx+20, ly, lx+26, ly+4)
	fmt.Fprintf(&b, `<text x="%d" y="%d" fill="#555">ok calls per %v, by when they ended, against time since the first call</text>`+"\n",
		left, y0+top+plotH+38, st.Bucket)
	return b.String(), height, left + plotW + 20 + legendW
}

// roundStep returns a round step (1, 2 or 5 times a power of ten) that
// divides extent into about n parts.
func roundStep(extent float64, n int) float64 {
	if extent <= 0 || n <= 0 {
		return 1
	}
	raw := extent / float64(n)
	p := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= raw {
			return m * p
		}
	}
	return 10 * p
}

// chartFrame writes a time chart's title, its trigger shaded (when st has
// one), its axes and their ticks: time along x over span, values up to
// yTop along y; x and y map a time and a value to the drawing.
func chartFrame(b *strings.Builder, title string, st *Steady, y0, left, top, plotW, plotH int, span time.Duration, yTop float64, x func(time.Duration) float64, y func(float64) float64) {
	fmt.Fprintf(b, `<text x="10" y="%d" font-size="15">%s</text>`+"\n", y0+22, html.EscapeString(title))
	if st != nil && st.TriggerEnd > st.TriggerStart {
		fmt.Fprintf(b, `<rect x="%.1f" y="%d" width="%.1f" height="%d" fill="#f3d9d9"/><text x="%.1f" y="%d" fill="#a55">trigger</text>`+"\n",
			x(st.TriggerStart), y0+top, x(st.TriggerEnd)-x(st.TriggerStart), plotH, x(st.TriggerStart)+3, y0+top+14)
	}
	fmt.Fprintf(b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#999"/><line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#999"/>`+"\n",
		left, y0+top+plotH, left+plotW, y0+top+plotH, left, y0+top, left, y0+top+plotH)
	step := roundStep(span.Seconds(), 10)
	for s := 0.0; s <= span.Seconds()+1e-9; s += step {
		px := x(time.Duration(s * float64(time.Second)))
		fmt.Fprintf(b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#999"/><text x="%.1f" y="%d" text-anchor="middle" fill="#555">%gs</text>`+"\n",
			px, y0+top+plotH, px, y0+top+plotH+4, px, y0+top+plotH+18, math.Round(s*1000)/1000)
	}
	vstep := roundStep(yTop, 5)
	for v := 0.0; v <= yTop; v += vstep {
		fmt.Fprintf(b, `<text x="%d" y="%.1f" text-anchor="end" fill="#555">%g</text>`+"\n", left-6, y(v)+4, v)
	}
}
