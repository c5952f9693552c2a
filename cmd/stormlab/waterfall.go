package stormlab

import (
	"cmp"
	"errors"
	"fmt"
	"html"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/herdguard/herdguard/internal/names"
	"github.com/herdguard/herdguard/telemetry"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"

	"github.com/herdguard/herdguard"
)

// TraceSpan is one span of a trace, as recorded in process or as read back
// from a collector: what the waterfall draws and the end-to-end test checks.
type TraceSpan struct {
	TraceID, SpanID, ParentID string // hex; ParentID "" for a root
	Name                      string
	Service                   string // service.name of the process that made it
	Kind                      string // "client", "server" or "internal"
	Start                     time.Time
	Duration                  time.Duration
	Attrs                     map[string]string // attribute values, as strings
	Resource                  [][2]string       // the process's resource attributes
}

// End is when the span ended.
func (s TraceSpan) End() time.Time { return s.Start.Add(s.Duration) }

// StatusCode is the span's gRPC status code name (OK, UNAVAILABLE, ...),
// from rpc.response.status_code or otelgrpc's numeric rpc.grpc.status_code;
// "" when it has neither.
func (s TraceSpan) StatusCode() string {
	if c := s.Attrs["rpc.response.status_code"]; c != "" {
		return c
	}
	if n, err := strconv.Atoi(s.Attrs["rpc.grpc.status_code"]); err == nil {
		return herdguard.CodeName(codes.Code(n))
	}
	return ""
}

// SpansFromSDK converts spans recorded in process.
func SpansFromSDK(spans []sdktrace.ReadOnlySpan) []TraceSpan {
	out := make([]TraceSpan, 0, len(spans))
	for _, s := range spans {
		ts := TraceSpan{
			TraceID:  s.SpanContext().TraceID().String(),
			SpanID:   s.SpanContext().SpanID().String(),
			Name:     s.Name(),
			Kind:     kindName(s.SpanKind()),
			Start:    s.StartTime(),
			Duration: s.EndTime().Sub(s.StartTime()),
			Attrs:    make(map[string]string, len(s.Attributes())),
		}
		if s.Parent().IsValid() {
			ts.ParentID = s.Parent().SpanID().String()
		}
		for _, kv := range s.Attributes() {
			ts.Attrs[string(kv.Key)] = kv.Value.Emit()
		}
		if r := s.Resource(); r != nil {
			for _, kv := range r.Attributes() {
				ts.Resource = append(ts.Resource, [2]string{string(kv.Key), kv.Value.Emit()})
				if kv.Key == "service.name" {
					ts.Service = kv.Value.AsString()
				}
			}
		}
		out = append(out, ts)
	}
	return out
}

func kindName(k trace.SpanKind) string {
	switch k {
	case trace.SpanKindClient:
		return "client"
	case trace.SpanKindServer:
		return "server"
	case trace.SpanKindProducer:
		return "producer"
	case trace.SpanKindConsumer:
		return "consumer"
	}
	return "internal"
}

// TraceTree orders the spans of one trace for reading: the root first, then
// every span after its parent, siblings by start time. depth[i] is how deep
// out[i] sits under the root. Spans whose parent is missing come last, at
// depth 1.
func TraceTree(spans []TraceSpan) (out []TraceSpan, depth []int, err error) {
	byID := make(map[string]bool, len(spans))
	for _, s := range spans {
		byID[s.SpanID] = true
	}
	children := map[string][]TraceSpan{}
	var roots, orphans []TraceSpan
	for _, s := range spans {
		switch {
		case s.ParentID == "":
			roots = append(roots, s)
		case byID[s.ParentID]:
			children[s.ParentID] = append(children[s.ParentID], s)
		default:
			orphans = append(orphans, s)
		}
	}
	if len(roots) != 1 {
		return nil, nil, fmt.Errorf("a trace of %d spans has %d roots, want 1", len(spans), len(roots))
	}
	byStart := func(a, b TraceSpan) int { return cmp.Or(a.Start.Compare(b.Start), cmp.Compare(a.SpanID, b.SpanID)) }
	var walk func(s TraceSpan, d int)
	walk = func(s TraceSpan, d int) {
		out, depth = append(out, s), append(depth, d)
		kids := children[s.SpanID]
		slices.SortFunc(kids, byStart)
		for _, k := range kids {
			walk(k, d+1)
		}
	}
	walk(roots[0], 0)
	slices.SortFunc(orphans, byStart)
	for _, o := range orphans {
		out, depth = append(out, o), append(depth, 1)
	}
	return out, depth, nil
}

// WriteWaterfall draws one call's trace as an SVG waterfall: a row per
// span, the call on top, its attempts with the time on the wire and the
// server's span inside each, and the backoff waits between them, on one
// time axis.
func WriteWaterfall(w io.Writer, spans []TraceSpan) error {
	rows, depth, err := TraceTree(spans)
	if err != nil {
		return err
	}
	if len(rows) == 0 {
		return errors.New("no spans to draw")
	}
	const (
		left, plotW, right, top, rowH, barH = 360, 760, 90, 64, 24, 14
	)
	t0 := rows[0].Start
	end := rows[0].End()
	for _, r := range rows {
		if r.End().After(end) {
			end = r.End()
		}
	}
	total := max(end.Sub(t0), time.Microsecond)
	x := func(t time.Time) float64 { return left + float64(t.Sub(t0))/float64(total)*plotW }
	// In a trace through a mesh, each herdguard row names its layer.
	var callers []string
	for _, r := range rows {
		if r.Kind != "server" && r.Service != "" && !slices.Contains(callers, r.Service) {
			callers = append(callers, r.Service)
		}
	}
	multi := len(callers) > 1
	held := slices.ContainsFunc(rows, func(r TraceSpan) bool { return r.Name == telemetry.SpanHeld })
	height := top + rowH*len(rows) + 50
	if multi {
		height += 16
	}
	if held {
		height += 16
	}
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", left+plotW+right, height)
	b.WriteString(`<rect width="100%" height="100%" fill="white"/>` + "\n")
	root := rows[0]
	title := fmt.Sprintf("%s: %s attempts, %s", root.Name, root.Attrs[string(telemetry.AttrAttempts)], root.StatusCode())
	if st, sc := root.Attrs[string(AttrStrategy)], root.Attrs[string(AttrScenario)]; st != "" {
		title += fmt.Sprintf(" (%s, scenario %s)", st, sc)
	}
	fmt.Fprintf(&b, `<text x="10" y="22" font-size="15">%s</text>`+"\n", html.EscapeString(title))
	fmt.Fprintf(&b, `<text x="10" y="40" fill="#555">trace %s; services: %s</text>`+"\n", root.TraceID, html.EscapeString(strings.Join(services(rows), ", ")))

	// the time axis: gridlines and labels at a round step
	step := niceStep(total)
	axisY := top + rowH*len(rows) + 8
	for t := time.Duration(0); t <= total; t += step {
		px := left + float64(t)/float64(total)*plotW
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#e4e4e4"/>`+"\n", px, top-6, px, axisY)
		fmt.Fprintf(&b, `<text x="%.1f" y="%d" fill="#555" text-anchor="middle">%v</text>`+"\n", px, axisY+16, t)
	}
	for i, r := range rows {
		y := top + i*rowH
		label, fill := waterfallRow(r)
		if multi && r.Kind != "server" && r.Service != "" {
			label = "[" + r.Service + "] " + label
		}
		fmt.Fprintf(&b, `<text x="%d" y="%d">%s</text>`+"\n", 10+14*depth[i], y+barH-2, html.EscapeString(label))
		x0, x1 := x(r.Start), x(r.End())
		fmt.Fprintf(&b, `<rect x="%.2f" y="%d" width="%.2f" height="%d" fill="%s"><title>%s</title></rect>`+"\n",
			x0, y, math.Max(x1-x0, 2), barH, fill, html.EscapeString(r.Name+" "+r.Duration.String()))
		fmt.Fprintf(&b, `<text x="%.2f" y="%d" fill="#555">%v</text>`+"\n", x1+4, y+barH-2, round(r.Duration))
	}
	legendY := height - 8
	if multi {
		fmt.Fprintf(&b, `<text x="%d" y="%d" fill="#555">[layer]: the service whose client made the call, the attempt or the wait (%s)</text>`+"\n",
			10, legendY, html.EscapeString(strings.Join(callers, " → ")))
		legendY -= 16
	}
	if held {
		fmt.Fprintf(&b, `<text x="%d" y="%d" fill="#555">brown: a wait in the overload controller's line</text>`+"\n", 10, legendY)
		legendY -= 16
	}
	fmt.Fprintf(&b, `<text x="%d" y="%d" fill="#555">gray: the call; blue: an attempt that succeeded, red: one that failed; light: on the wire (otelgrpc); green or dark red: the server's span; amber: a backoff wait</text>`+"\n",
		10, legendY)
	b.WriteString("</svg>\n")
	_, err = io.WriteString(w, b.String())
	return err
}

// waterfallRow returns the label and bar color of a span.
func waterfallRow(s TraceSpan) (label, fill string) {
	failed := s.StatusCode() != "" && s.StatusCode() != "OK"
	switch {
	case s.Attrs[string(telemetry.AttrAttempts)] != "":
		return s.Name, "#777"
	case s.Name == telemetry.SpanAttempt:
		label = "attempt " + s.Attrs[string(telemetry.AttrAttempt)] + "  " + s.StatusCode()
		if failed {
			return label, "#c0392b"
		}
		return label, "#3b6ea5"
	case s.Name == telemetry.SpanBackoff:
		return "backoff before attempt " + s.Attrs[string(telemetry.AttrAttempt)] + " (" + s.Attrs[string(names.AttrBackoffJitter)] + ")", "#e0a030"
	case s.Name == telemetry.SpanHeld:
		return "held before attempt " + s.Attrs[string(telemetry.AttrAttempt)] + " (overload controller)", "#a0522d"
	case s.Kind == "server":
		label = "server (" + s.Service + ")  " + s.StatusCode()
		if failed {
			return label, "#8e2a1f"
		}
		return label, "#2e8b57"
	case s.Kind == "client":
		return "on the wire (otelgrpc)", "#9cc3e6"
	}
	return s.Name, "#bbb"
}

func services(spans []TraceSpan) []string {
	var out []string
	for _, s := range spans {
		if s.Service != "" && !slices.Contains(out, s.Service) {
			out = append(out, s.Service)
		}
	}
	return out
}

// niceStep returns a step of 1, 2 or 5 times a power of ten that cuts
// total into about 8 intervals.
func niceStep(total time.Duration) time.Duration {
	raw := float64(total) / 8
	mag := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*mag >= raw {
			return max(time.Duration(m*mag), time.Nanosecond)
		}
	}
	return time.Duration(10 * mag)
}
