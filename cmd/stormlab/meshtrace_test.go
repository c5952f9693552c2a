package stormlab

import (
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// traceLab is a mesh lab run in this process whose every tier traces into
// one recorder, each as its own service.
type traceLab struct {
	MeshLab
	rec *tracetest.SpanRecorder
	mu  sync.Mutex
	tps []*sdktrace.TracerProvider
}

func newTraceLab(t *testing.T) *traceLab {
	l := &traceLab{rec: tracetest.NewSpanRecorder()}
	l.Tracing = func(service string) trace.TracerProvider {
		tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(l.rec),
			sdktrace.WithResource(resource.NewSchemaless(semconv.ServiceName(service))))
		l.mu.Lock()
		l.tps = append(l.tps, tp)
		l.mu.Unlock()
		return tp
	}
	t.Cleanup(func() {
		for _, tp := range l.tps {
			_ = tp.Shutdown(t.Context())
		}
	})
	return l
}

// traces returns the spans recorded so far by trace, and forgets them.
func (l *traceLab) traces() map[string][]TraceSpan {
	out := map[string][]TraceSpan{}
	for _, s := range SpansFromSDK(l.rec.Ended()) {
		out[s.TraceID] = append(out[s.TraceID], s)
	}
	l.rec.Reset()
	return out
}

// TestMeshTraceAcrossTiers traces the chain user -> gateway -> service ->
// leaf at a leaf failing 67 % of attempts (MeshTrace): every user call is
// one trace, joined across every tier (no span without its parent), the
// leaf's every attempt in one of them. The leaf fails on its own, not for
// load: nothing judges it overloaded, so with the server half the layers
// above the service retry too, as with herdguard at every layer and no
// server half, and a trace's layers say so. The waterfall of a call
// retried below names the layer of each row.
func TestMeshTraceAcrossTiers(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the chain twice for 1.5 s")
	}
	lab := newTraceLab(t)
	sc := MeshTrace()

	half := runMesh(t, &lab.MeshLab, sc, 1, MeshServerHalf)[MeshServerHalf]
	traces := lab.traces()
	if len(traces) != half.Calls {
		t.Errorf("server half: %d traces for %d user calls, want one each", len(traces), half.Calls)
	}
	leafSpans, retriedBelow, aboveHalf := 0, 0, 0
	var drawn []TraceSpan
	for id, spans := range traces {
		ids := map[string]bool{}
		services := map[string]bool{}
		for _, s := range spans {
			ids[s.SpanID] = true
			services[s.Service] = true
			if s.Service == LeafService && s.Kind == "server" {
				leafSpans++
			}
		}
		for _, s := range spans {
			if s.ParentID != "" && !ids[s.ParentID] {
				t.Fatalf("trace %s: span %s %q of %s has no parent in the trace: the context was not carried down", id, s.SpanID, s.Name, s.Service)
			}
		}
		for _, want := range []string{UserService, TierService(2), TierService(MeshDepth), LeafService} {
			if !services[want] {
				t.Errorf("trace %s lacks spans of %s: it has %v", id, want, services)
			}
		}
		layers, err := MeshLayers(spans)
		if err != nil {
			t.Fatalf("trace %s: %v", id, err)
		}
		if len(layers) != MeshDepth {
			t.Fatalf("trace %s: layers %+v, want %d (user, gateway, service)", id, layers, MeshDepth)
		}
		for _, l := range layers[:MeshDepth-1] {
			if l.Retried() {
				aboveHalf++
				break
			}
		}
		if RetriedBelow(layers) {
			retriedBelow++
			drawn = spans
		}
	}
	if aboveHalf == 0 {
		t.Errorf("server half: no trace with a retry above the leaf's caller, at a leaf failing on its own; want the retries of every layer")
	}
	if int64(leafSpans) != half.Stats.GetAttempts() {
		t.Errorf("server half: %d leaf server spans in the traces, the leaf counted %d attempts: want each in a trace", leafSpans, half.Stats.GetAttempts())
	}
	if retriedBelow < half.Calls/4 {
		t.Errorf("server half: %d of %d user calls retried below the user, want at least a quarter at a 67 %% failing leaf", retriedBelow, half.Calls)
	}
	if drawn != nil {
		var b strings.Builder
		if err := WriteWaterfall(&b, drawn); err != nil {
			t.Fatal(err)
		}
		for _, want := range []string{"[" + UserService + "] ", "[" + TierService(2) + "] ", "[" + TierService(MeshDepth) + "] attempt 2", "server (" + LeafService + ")", "user → gateway → service"} {
			if !strings.Contains(b.String(), want) {
				t.Errorf("the waterfall lacks %q", want)
			}
		}
	}

	runMesh(t, &lab.MeshLab, sc, 1, MeshHerdguard)
	above := 0
	for _, spans := range lab.traces() {
		layers, err := MeshLayers(spans)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range layers[:len(layers)-1] {
			if l.Retried() {
				above++
				break
			}
		}
	}
	if above == 0 {
		t.Errorf("herdguard at every layer, no server half: no trace with a retry above the leaf's caller; want the multiplication in the traces")
	}
}

func TestMeshHealthyCheck(t *testing.T) {
	row := func(name string, perCall float64, ok int) MeshSummary {
		return MeshSummary{Summary: Summary{Strategy: name, Calls: 100, OK: ok, AttemptsPerCall: perCall, P50: 800 * time.Microsecond}}
	}
	slower := func(r MeshSummary, d time.Duration) MeshSummary { r.P50 += d; return r }
	tests := []struct {
		name string
		rows []MeshSummary
		errs int
	}{
		{"one attempt each, every call ok", []MeshSummary{row(MeshHerdguard, 1, 100), row(MeshServerHalf, 1, 100)}, 0},
		{"an attempt added", []MeshSummary{row(MeshHerdguard, 1, 100), row(MeshServerHalf, 1.01, 100)}, 2},
		{"a call failed", []MeshSummary{row(MeshServerHalf, 1, 99)}, 1},
		{"p50 within the resolution", []MeshSummary{row(MeshHerdguard, 1, 100), slower(row(MeshServerHalf, 1, 100), MeshLatencyResolution)}, 0},
		{"p50 a step slower", []MeshSummary{row(MeshHerdguard, 1, 100), slower(row(MeshServerHalf, 1, 100), MeshLatencyResolution+time.Microsecond)}, 1},
		{"p50 faster", []MeshSummary{slower(row(MeshHerdguard, 1, 100), time.Millisecond), row(MeshServerHalf, 1, 100)}, 0},
		{"no server half row", []MeshSummary{row(MeshHerdguard, 1, 100)}, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if errs := MeshHealthyCheck(tt.rows); len(errs) != tt.errs {
				t.Errorf("MeshHealthyCheck = %v, want %d errors", errs, tt.errs)
			}
		})
	}
}
