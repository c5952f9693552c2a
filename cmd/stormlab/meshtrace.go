package stormlab

import (
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/herdguard/herdguard/telemetry"
)

// MeshTrace is the leaf the mesh trace demo (trace-demo -mesh) runs the
// chain against: Partial(0.67)'s leaf, failing 67 % of attempts on its
// own, at 40 calls/s for 1.5 s, few enough user calls that every one of
// them is traced through every tier. Nothing judges it overloaded, so
// every layer retries, with the server half as without it.
func MeshTrace() Scenario {
	sc := Partial(0.67)
	sc.Name = "mesh trace, a leaf failing 67 % of attempts"
	sc.Rate, sc.Duration = 40, 1500*time.Millisecond
	return sc
}

// MeshHealthy is a healthy leaf: Partial(0)'s load (600 calls/s for 6 s,
// 2 s deadlines) and no fault, where the server half must add no attempt
// and no latency.
func MeshHealthy() Scenario {
	sc := Partial(0)
	sc.Name = "a healthy leaf"
	return sc
}

// MeshLatencyResolution is the least latency the mesh lab can tell apart
// at a healthy leaf: the step its tables print, and more than the run-to-run
// spread of a median p50 there. What the server half costs per call (a few
// microseconds: BenchmarkClientHalf, BenchmarkServerHalf) is far below it,
// so the lab checks only that nothing the size of a step was added.
const MeshLatencyResolution = 100 * time.Microsecond

// MeshHealthyCheck returns what is wrong with a healthy leaf's rows: the
// server half must send the leaf exactly one attempt per user call, as
// herdguard at every layer without it does, fail none, and answer with a
// p50 within MeshLatencyResolution of herdguard at every layer's.
func MeshHealthyCheck(rows []MeshSummary) []error {
	half, ok := MeshRow(rows, MeshServerHalf)
	if !ok {
		return []error{fmt.Errorf("mesh: no %q row", MeshServerHalf)}
	}
	var errs []error
	if half.AttemptsPerCall != 1 || half.OK != half.Calls {
		errs = append(errs, fmt.Errorf("the server half at a healthy leaf: %.3f leaf attempts per user call and %d of %d calls ok: want 1 and every one", half.AttemptsPerCall, half.OK, half.Calls))
	}
	if every, ok := MeshRow(rows, MeshHerdguard); ok {
		if every.AttemptsPerCall != half.AttemptsPerCall {
			errs = append(errs, fmt.Errorf("at a healthy leaf: the server half %.3f leaf attempts per user call, herdguard at every layer %.3f: want the same", half.AttemptsPerCall, every.AttemptsPerCall))
		}
		if half.P50 > every.P50+MeshLatencyResolution {
			errs = append(errs, fmt.Errorf("at a healthy leaf: the server half's p50 %v, herdguard at every layer's %v: want no more than %v added", half.P50, every.P50, MeshLatencyResolution))
		}
	}
	return errs
}

// Layer is what one service of a mesh trace did with the calls it made
// through herdguard: its call spans, the attempts they made in all, and
// the most one of them made.
type Layer struct {
	Service  string
	Calls    int
	Attempts int
	Most     int
}

// Retried reports whether the layer retried: a call of it made more than
// one attempt.
func (l Layer) Retried() bool { return l.Most > 1 }

// MeshLayers returns the layers of one trace that made herdguard calls,
// from the root down (in the order TraceTree reads them).
func MeshLayers(spans []TraceSpan) ([]Layer, error) {
	rows, _, err := TraceTree(spans)
	if err != nil {
		return nil, err
	}
	var out []Layer
	for _, s := range rows {
		v, ok := s.Attrs[string(telemetry.AttrAttempts)]
		if !ok {
			continue
		}
		n, err := strconv.Atoi(v)
		if err != nil {
			return nil, fmt.Errorf("span %s of %s: %s %q: %w", s.SpanID, s.Service, telemetry.AttrAttempts, v, err)
		}
		i := 0
		for i < len(out) && out[i].Service != s.Service {
			i++
		}
		if i == len(out) {
			out = append(out, Layer{Service: s.Service})
		}
		out[i].Calls++
		out[i].Attempts += n
		out[i].Most = max(out[i].Most, n)
	}
	return out, nil
}

// RetriedBelow reports whether a layer under the root's service retried.
func RetriedBelow(layers []Layer) bool {
	for i, l := range layers {
		if i > 0 && l.Retried() {
			return true
		}
	}
	return false
}

// WriteMeshLayers prints one line per layer of a mesh trace: its calls,
// their attempts, and whether it retried.
func WriteMeshLayers(w io.Writer, layers []Layer) {
	for _, l := range layers {
		what := "did not retry"
		if l.Retried() {
			what = "RETRIED"
		}
		fmt.Fprintf(w, "  %-10s %d call(s), %d attempt(s) in all, at most %d in one: %s\n", l.Service, l.Calls, l.Attempts, l.Most, what)
	}
}
