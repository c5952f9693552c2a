package stormlab

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/herdguard/herdguard/internal/names"
	"github.com/herdguard/herdguard/telemetry"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

func at(ms int) time.Time {
	return time.Unix(1_700_000_000, 0).Add(time.Duration(ms) * time.Millisecond)
}

// retriedCall is a call that failed once, waited, and succeeded.
func retriedCall() []TraceSpan {
	span := func(id, parent, name, kind, service string, from, to int, attrs map[string]string) TraceSpan {
		return TraceSpan{TraceID: "t1", SpanID: id, ParentID: parent, Name: name, Kind: kind, Service: service,
			Start: at(from), Duration: time.Duration(to-from) * time.Millisecond, Attrs: attrs}
	}
	const m = "demo.Gateway/Charge"
	// given out of order, as a collector may return them
	return []TraceSpan{
		span("s2", "w2", m, "server", "demo-server", 121, 123, map[string]string{"rpc.grpc.status_code": "0"}),
		span("a2", "c", "attempt", "internal", "demo-client", 120, 125, map[string]string{"herdguard.attempt": "2", "rpc.response.status_code": "OK"}),
		span("b", "c", "backoff", "internal", "demo-client", 10, 120, map[string]string{"herdguard.attempt": "2", "herdguard.backoff.jitter": "full"}),
		span("c", "", m, "client", "demo-client", 0, 126, map[string]string{"herdguard.attempts": "2", "rpc.response.status_code": "OK", "stormlab.strategy": "herdguard defaults", "stormlab.scenario": "published"}),
		span("w1", "a1", m, "client", "demo-client", 1, 9, nil),
		span("a1", "c", "attempt", "internal", "demo-client", 0, 10, map[string]string{"herdguard.attempt": "1", "rpc.response.status_code": "UNAVAILABLE"}),
		span("s1", "w1", m, "server", "demo-server", 2, 8, map[string]string{"rpc.grpc.status_code": "14"}),
		span("w2", "a2", m, "client", "demo-client", 121, 124, nil),
	}
}

func TestTraceTree(t *testing.T) {
	rows, depth, err := TraceTree(retriedCall())
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for i, r := range rows {
		got = append(got, strings.Repeat(".", depth[i])+r.SpanID)
	}
	if want := "c .a1 ..w1 ...s1 .b .a2 ..w2 ...s2"; strings.Join(got, " ") != want {
		t.Errorf("tree %q, want %q", strings.Join(got, " "), want)
	}
	if c := rows[3].StatusCode(); c != "UNAVAILABLE" {
		t.Errorf("server span's status from rpc.grpc.status_code 14 = %q, want UNAVAILABLE", c)
	}

	orphan := append(retriedCall(), TraceSpan{SpanID: "x", ParentID: "gone", Start: at(50)})
	rows, depth, err = TraceTree(orphan)
	if err != nil || rows[len(rows)-1].SpanID != "x" || depth[len(depth)-1] != 1 {
		t.Errorf("a span whose parent is missing: %v; want it last, at depth 1", err)
	}
	for _, spans := range [][]TraceSpan{nil, append(retriedCall(), TraceSpan{SpanID: "r2"})} {
		if _, _, err := TraceTree(spans); err == nil || !strings.Contains(err.Error(), "roots") {
			t.Errorf("TraceTree of %d spans = %v, want an error about the roots", len(spans), err)
		}
	}
}

func TestWriteWaterfall(t *testing.T) {
	var b bytes.Buffer
	if err := WriteWaterfall(&b, retriedCall()); err != nil {
		t.Fatal(err)
	}
	svg := b.String()
	for _, want := range []string{
		"<svg", "demo.Gateway/Charge: 2 attempts, OK (herdguard defaults, scenario published)", "trace t1; services: demo-client, demo-server",
		"attempt 1  UNAVAILABLE", "attempt 2  OK", "backoff before attempt 2 (full)", "server (demo-server)  UNAVAILABLE", "on the wire (otelgrpc)",
		">0s<", ">100ms<", // the time axis: 126 ms in steps of 20 ms
	} {
		if !strings.Contains(svg, want) {
			t.Errorf("waterfall lacks %q", want)
		}
	}
	if n := strings.Count(svg, "<rect x="); n != 8 {
		t.Errorf("%d bars, want one per span (8)", n)
	}
	if strings.Contains(svg, "brown") {
		t.Error("the legend explains held waits where there are none")
	}
	if err := WriteWaterfall(&b, nil); err == nil {
		t.Error("a waterfall of no spans drew")
	}

	// a retry held in the overload controller's line, after its backoff
	held := append(retriedCall(), TraceSpan{TraceID: "t1", SpanID: "h", ParentID: "c", Name: "held", Kind: "internal", Service: "demo-client",
		Start: at(115), Duration: 5 * time.Millisecond, Attrs: map[string]string{"herdguard.attempt": "2", "herdguard.held.delay_ms": "5"}})
	b.Reset()
	if err := WriteWaterfall(&b, held); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"held before attempt 2 (overload controller)", "brown: a wait in the overload controller's line"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("waterfall with a held wait lacks %q", want)
		}
	}
}

// The span tree a demo client prints shows every wait of a call: its
// backoffs and its waits in the overload controller's line.
func TestWriteSpanTree(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	tr := tp.Tracer("test")
	t0 := at(0)
	ctx, call := tr.Start(context.Background(), "demo.Gateway/Charge", trace.WithTimestamp(t0))
	child := func(name string, from, to int, attrs ...attribute.KeyValue) {
		_, s := tr.Start(ctx, name, trace.WithTimestamp(t0.Add(time.Duration(from)*time.Millisecond)), trace.WithAttributes(attrs...))
		s.End(trace.WithTimestamp(t0.Add(time.Duration(to) * time.Millisecond)))
	}
	child(telemetry.SpanAttempt, 0, 10, telemetry.AttrAttempt.Int(1), semconv.RPCResponseStatusCode("UNAVAILABLE"))
	child(telemetry.SpanBackoff, 10, 110, telemetry.AttrAttempt.Int(2), names.AttrBackoffDelayMS.Float64(100), names.AttrBackoffJitter.String("full"))
	child(telemetry.SpanHeld, 110, 150, telemetry.AttrAttempt.Int(2), names.AttrHeldMS.Float64(40))
	child(telemetry.SpanAttempt, 150, 152, telemetry.AttrAttempt.Int(2), semconv.RPCResponseStatusCode("UNAVAILABLE"))
	child(telemetry.SpanHeld, 152, 160, telemetry.AttrAttempt.Int(3), telemetry.AttrShed.Bool(true))
	call.SetAttributes(telemetry.AttrAttempts.Int(2), telemetry.AttrOutcome.String("shed"), semconv.RPCResponseStatusCode("UNAVAILABLE"))
	call.End(trace.WithTimestamp(t0.Add(160 * time.Millisecond)))

	trees := SampleTrees(rec.Ended(), 1)
	if len(trees) != 1 {
		t.Fatalf("%d trees, want the retried call's", len(trees))
	}
	var b bytes.Buffer
	WriteSpanTree(&b, trees[0][0], trees[0][1:])
	want := `demo.Gateway/Charge  160ms  outcome=shed attempts=2 status=UNAVAILABLE
  ├─ attempt 1  10ms  UNAVAILABLE
  ├─ backoff before attempt 2  wait 100ms (full)
  ├─ held before attempt 2  wait 40ms (overload controller)
  ├─ attempt 2  2ms  UNAVAILABLE
  └─ held before attempt 3  wait 8ms (overload controller, shed)
`
	if b.String() != want {
		t.Errorf("span tree:\n%s\nwant:\n%s", b.String(), want)
	}
}

func TestNiceStep(t *testing.T) {
	for _, tt := range []struct{ total, want time.Duration }{
		{126 * time.Millisecond, 20 * time.Millisecond},
		{time.Second, 200 * time.Millisecond},
		{3 * time.Second, 500 * time.Millisecond},
		{8 * time.Millisecond, time.Millisecond},
	} {
		if got := niceStep(tt.total); got != tt.want {
			t.Errorf("niceStep(%v) = %v, want %v", tt.total, got, tt.want)
		}
	}
}

func TestLabelerLabelsRootSpans(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	var l Labeler
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(&l), sdktrace.WithSpanProcessor(rec))
	tr := tp.Tracer("test")
	_, before := tr.Start(context.Background(), "before any run")
	before.End()
	l.Set("published", "herdguard defaults")
	ctx, root := tr.Start(context.Background(), "call")
	_, child := tr.Start(ctx, "attempt")
	child.End()
	root.End()
	got := map[string]int{}
	for _, s := range rec.Ended() {
		got[s.Name()] = len(s.Attributes())
		if s.Name() == "call" {
			a := map[string]string{}
			for _, kv := range s.Attributes() {
				a[string(kv.Key)] = kv.Value.AsString()
			}
			if a["stormlab.scenario"] != "published" || a["stormlab.strategy"] != "herdguard defaults" {
				t.Errorf("call span attributes %v", a)
			}
		}
	}
	if got["before any run"] != 0 || got["attempt"] != 0 || got["call"] != 2 {
		t.Errorf("attributes per span %v: want only the root span started after Set labeled", got)
	}
}
