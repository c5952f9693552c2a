package stormlab

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
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
	if err := WriteWaterfall(&b, nil); err == nil {
		t.Error("a waterfall of no spans drew")
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
