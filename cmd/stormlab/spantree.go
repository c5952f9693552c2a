package stormlab

import (
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/herdguard/herdguard/internal/names"
	"github.com/herdguard/herdguard/telemetry"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// WriteSpanTree prints a call span and its attempt, backoff and held
// children as a compact tree with their durations and waits.
func WriteSpanTree(w io.Writer, call sdktrace.ReadOnlySpan, children []sdktrace.ReadOnlySpan) {
	a := attrMap(call)
	fmt.Fprintf(w, "%s  %v  outcome=%s attempts=%d status=%s\n", call.Name(), round(call.EndTime().Sub(call.StartTime())),
		a[telemetry.AttrOutcome].AsString(), a[telemetry.AttrAttempts].AsInt64(), a["rpc.response.status_code"].AsString())
	slices.SortFunc(children, func(x, y sdktrace.ReadOnlySpan) int { return x.StartTime().Compare(y.StartTime()) })
	for i, c := range children {
		branch := "├─"
		if i == len(children)-1 {
			branch = "└─"
		}
		ca := attrMap(c)
		switch c.Name() {
		case telemetry.SpanAttempt:
			fmt.Fprintf(w, "  %s attempt %d  %v  %s\n", branch, ca[telemetry.AttrAttempt].AsInt64(),
				round(c.EndTime().Sub(c.StartTime())), ca["rpc.response.status_code"].AsString())
		case telemetry.SpanBackoff:
			fmt.Fprintf(w, "  %s backoff before attempt %d  wait %v (%s)\n", branch, ca[telemetry.AttrAttempt].AsInt64(),
				round(time.Duration(ca[names.AttrBackoffDelayMS].AsFloat64()*float64(time.Millisecond))), ca[names.AttrBackoffJitter].AsString())
		case telemetry.SpanHeld:
			shed := ""
			if ca[telemetry.AttrShed].AsBool() {
				shed = ", shed"
			}
			fmt.Fprintf(w, "  %s held before attempt %d  wait %v (overload controller%s)\n", branch, ca[telemetry.AttrAttempt].AsInt64(),
				round(c.EndTime().Sub(c.StartTime())), shed)
		default:
			fmt.Fprintf(w, "  %s %s  %v\n", branch, c.Name(), round(c.EndTime().Sub(c.StartTime())))
		}
	}
}

// SampleTrees picks from recorded spans up to n calls that were retried, the
// most attempts first, and returns each call span with its children.
func SampleTrees(spans []sdktrace.ReadOnlySpan, n int) [][]sdktrace.ReadOnlySpan {
	children := map[[8]byte][]sdktrace.ReadOnlySpan{}
	var calls []sdktrace.ReadOnlySpan
	for _, s := range spans {
		if s.Parent().IsValid() && (s.Name() == telemetry.SpanAttempt || s.Name() == telemetry.SpanBackoff || s.Name() == telemetry.SpanHeld) {
			id := s.Parent().SpanID()
			children[id] = append(children[id], s)
			continue
		}
		if attrMap(s)[telemetry.AttrAttempts].AsInt64() > 1 {
			calls = append(calls, s)
		}
	}
	slices.SortStableFunc(calls, func(x, y sdktrace.ReadOnlySpan) int {
		return int(attrMap(y)[telemetry.AttrAttempts].AsInt64() - attrMap(x)[telemetry.AttrAttempts].AsInt64())
	})
	var out [][]sdktrace.ReadOnlySpan
	for _, c := range calls[:min(n, len(calls))] {
		out = append(out, append([]sdktrace.ReadOnlySpan{c}, children[c.SpanContext().SpanID()]...))
	}
	return out
}

func attrMap(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	m := make(map[attribute.Key]attribute.Value, len(s.Attributes()))
	for _, kv := range s.Attributes() {
		m[kv.Key] = kv.Value
	}
	return m
}

func round(d time.Duration) time.Duration {
	switch {
	case d > time.Second:
		return d.Round(10 * time.Millisecond)
	case d > time.Millisecond:
		return d.Round(10 * time.Microsecond)
	}
	return d.Round(time.Microsecond)
}
