package stormlab

import (
	"fmt"
	"html"
	"io"
	"slices"
	"strings"
)

// FleetPanel is what a herd's or a brownout's runs did against the number
// of clients that offered the load: each strategy's calls ok (% of calls)
// at each number of clients.
type FleetPanel struct {
	Title string
	Lines []FleetLine
}

// FleetLine is one strategy's points of a FleetPanel.
type FleetLine struct {
	Strategy string
	Clients  []int
	OK       []float64 // % of calls ok, at Clients[i]
}

// Add records the calls ok (%) of strategy offered by n clients.
func (p *FleetPanel) Add(strategy string, n int, ok float64) {
	i := slices.IndexFunc(p.Lines, func(l FleetLine) bool { return l.Strategy == strategy })
	if i < 0 {
		p.Lines = append(p.Lines, FleetLine{Strategy: strategy})
		i = len(p.Lines) - 1
	}
	p.Lines[i].Clients = append(p.Lines[i].Clients, n)
	p.Lines[i].OK = append(p.Lines[i].OK, ok)
}

// WriteFleetSVG draws one chart per panel: each strategy's calls ok against
// the number of clients the load was offered by, the numbers evenly
// spaced.
func WriteFleetSVG(w io.Writer, panels []FleetPanel) error {
	var parts []string
	height, width := 0, 0
	for _, p := range panels {
		body, h, wd := drawFleet(p, height)
		parts = append(parts, body)
		height += h
		width = max(width, wd)
	}
	return writeSVGDoc(w, parts, width, height)
}

// drawFleet draws one panel from y0; it returns the drawing, its height and
// its width.
func drawFleet(p FleetPanel, y0 int) (string, int, int) {
	const (
		left, top, plotW, plotH, legendW = 70, 40, 420, 200, 300
		bottom                           = 50
	)
	var ns []int
	for _, l := range p.Lines {
		for _, n := range l.Clients {
			if !slices.Contains(ns, n) {
				ns = append(ns, n)
			}
		}
	}
	slices.Sort(ns)
	x := func(n int) float64 {
		if len(ns) == 1 {
			return left + plotW/2
		}
		return left + plotW*float64(slices.Index(ns, n))/float64(len(ns)-1)
	}
	y := func(v float64) float64 { return float64(y0+top+plotH) - plotH*v/100 }
	legendH := 20*len(p.Lines) + 20
	height := top + max(plotH, legendH) + bottom
	var b strings.Builder
	fmt.Fprintf(&b, `<text x="10" y="%d" font-size="15">%s</text>`+"\n", y0+22, html.EscapeString(p.Title+": calls ok (%) against the clients offering the load"))
	fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#999"/><line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#999"/>`+"\n",
		left, y0+top+plotH, left+plotW, y0+top+plotH, left, y0+top, left, y0+top+plotH)
	for _, n := range ns {
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#999"/><text x="%.1f" y="%d" text-anchor="middle" fill="#555">%d</text>`+"\n",
			x(n), y0+top+plotH, x(n), y0+top+plotH+4, x(n), y0+top+plotH+18, n)
	}
	for v := 0.0; v <= 100; v += 20 {
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end" fill="#555">%g</text>`+"\n", left-6, y(v)+4, v)
	}
	lx := left + plotW + 20
	for i, l := range p.Lines {
		color := chartColors[i%len(chartColors)]
		pts := make([]string, len(l.Clients))
		for j, n := range l.Clients {
			pts[j] = fmt.Sprintf("%.1f,%.1f", x(n), y(l.OK[j]))
			fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>`+"\n", x(n), y(l.OK[j]), color)
		}
		width := 1.5
		if l.Strategy == HerdguardDefault {
			width = 3
		}
		fmt.Fprintf(&b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="%g" stroke-opacity="0.8"/>`+"\n", strings.Join(pts, " "), color, width)
		ly := y0 + top + 10 + 20*i
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="3"/><text x="%d" y="%d">%s</text>`+"\n",
			lx, ly, lx+20, ly, color, lx+26, ly+4, html.EscapeString(l.Strategy))
	}
	fmt.Fprintf(&b, `<text x="%d" y="%d" fill="#555">clients, each with a connection and an interceptor of its own; the calls dealt out in turn</text>`+"\n",
		left, y0+top+plotH+38)
	return b.String(), height, left + plotW + 20 + legendW
}
