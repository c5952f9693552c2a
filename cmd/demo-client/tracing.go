package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net/url"
	"slices"
	"time"

	"github.com/herdguard/herdguard/telemetry"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/herdguard/herdguard/cmd/internal/jaegerlab"
	"github.com/herdguard/herdguard/cmd/stormlab"
)

// tracing is the client's tracer provider and what it keeps of the spans.
type tracing struct {
	labeler stormlab.Labeler
	rec     *tracetest.SpanRecorder // -trace or -trace-svg
	tp      *sdktrace.TracerProvider
	exp     *stormlab.Exporter // -otlp
	done    bool               // tp shut down

	drawn []stormlab.TraceSpan // the call -trace-svg draws, as recorded here
}

func newTracing(ctx context.Context, o options) (*tracing, error) {
	t := &tracing{}
	if o.jaeger != "" {
		if o.otlp == "" || o.traceSVG == "" {
			return nil, errors.New("-jaeger reads the call -trace-svg draws back from Jaeger: it needs -otlp and -trace-svg")
		}
		u, err := url.Parse(o.jaeger)
		if err != nil || u.Scheme != "http" || u.Host == "" {
			return nil, fmt.Errorf("-jaeger %q: want http://host:port", o.jaeger)
		}
		if err := checkLoopback("-jaeger", u.Host); err != nil {
			return nil, err
		}
	}
	var opts []sdktrace.TracerProviderOption
	if o.trace || o.traceSVG != "" {
		t.rec = tracetest.NewSpanRecorder()
		opts = append(opts, sdktrace.WithSpanProcessor(t.rec))
	}
	if o.otlp == "" && t.rec == nil {
		return t, nil
	}
	opts = append(opts, sdktrace.WithSpanProcessor(&t.labeler))
	if o.otlp != "" {
		if err := checkLoopback("-otlp", o.otlp); err != nil {
			return nil, err
		}
		exp, tp, err := stormlab.NewExporter(ctx, "demo-client", o.otlp, opts...)
		if err != nil {
			return nil, fmt.Errorf("-otlp: %w", err)
		}
		t.exp, t.tp = exp, tp
		return t, nil
	}
	res, err := stormlab.Resource(ctx, "demo-client")
	if err != nil {
		return nil, err
	}
	t.tp = sdktrace.NewTracerProvider(append(opts, sdktrace.WithResource(res))...)
	return t, nil
}

// sample prints the span trees of the run that just ended, with their
// trace ids, and keeps the first retried call for -trace-svg.
func (t *tracing) sample(out io.Writer, strategy string, o options) {
	ended := t.rec.Ended()
	trees := stormlab.SampleTrees(ended, max(o.samples, 1))
	if o.trace {
		for _, tree := range trees[:min(o.samples, len(trees))] {
			id := tree[0].SpanContext().TraceID().String()
			fmt.Fprintf(out, "span tree, %s (trace %s):\n", strategy, id)
			stormlab.WriteSpanTree(out, tree[0], tree[1:])
			if o.jaeger != "" {
				fmt.Fprintf(out, "  in Jaeger: %s\n", jaegerlab.TraceURL(o.jaeger, id))
			}
			fmt.Fprintln(out)
		}
	}
	if o.traceSVG != "" && t.drawn == nil && len(trees) > 0 {
		id := trees[0][0].SpanContext().TraceID()
		var spans []sdktrace.ReadOnlySpan
		for _, s := range ended {
			if s.SpanContext().TraceID() == id {
				spans = append(spans, s)
			}
		}
		t.drawn = stormlab.SpansFromSDK(spans)
	}
}

// flush sends every span to the collector (-otlp) and stops the provider.
func (t *tracing) flush(ctx context.Context) error {
	if t.exp == nil {
		return nil
	}
	t.done = true
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	return t.exp.Shutdown(sctx)
}

// finish flushes the spans to the collector, then draws -trace-svg.
func (t *tracing) finish(ctx context.Context, out io.Writer, o options) error {
	if err := t.flush(ctx); err != nil {
		return err
	}
	if o.traceSVG == "" {
		return nil
	}
	if t.drawn == nil {
		return fmt.Errorf("-trace-svg %s: no call was retried, nothing to draw", o.traceSVG)
	}
	spans, from := t.drawn, "as recorded by the client"
	if o.jaeger != "" {
		var err error
		if spans, err = readBack(ctx, o.jaeger, t.drawn); err != nil {
			return fmt.Errorf("-jaeger: %w", err)
		}
		from = "as read back from Jaeger"
	}
	if err := writeFile(o.traceSVG, func(w io.Writer) error { return stormlab.WriteWaterfall(w, spans) }); err != nil {
		return err
	}
	fmt.Fprintf(out, "wrote %s: trace %s, %d spans %s\n", o.traceSVG, spans[0].TraceID, len(spans), from)
	return nil
}

// meshCandidates is how many user calls, the longest first, meshSample
// reads back from Jaeger looking for retries below the user.
const meshCandidates = 60

// meshSample flushes the spans, then reads the user calls of the mesh
// lab's runs back from Jaeger, the longest first, and prints (-trace) up
// to o.samples of those whose retries happened below the user, each
// layer's calls and attempts and its Jaeger link, and draws the first
// (-trace-svg).
func (t *tracing) meshSample(ctx context.Context, out io.Writer, o options) error {
	var roots []sdktrace.ReadOnlySpan
	for _, s := range t.rec.Ended() {
		if !s.Parent().IsValid() {
			roots = append(roots, s)
		}
	}
	slices.SortStableFunc(roots, func(a, b sdktrace.ReadOnlySpan) int {
		return cmp.Compare(b.EndTime().Sub(b.StartTime()), a.EndTime().Sub(a.StartTime()))
	})
	if err := t.flush(ctx); err != nil {
		return err
	}
	var found [][]stormlab.TraceSpan
	for _, r := range roots[:min(meshCandidates, len(roots))] {
		if len(found) == max(o.samples, 1) {
			break
		}
		spans, err := settled(ctx, o.jaeger, r.SpanContext().TraceID().String())
		if err != nil {
			return fmt.Errorf("-jaeger: %w", err)
		}
		layers, err := stormlab.MeshLayers(spans)
		if err != nil || !stormlab.RetriedBelow(layers) {
			continue
		}
		found = append(found, spans)
		if o.trace {
			id := spans[0].TraceID
			strategy := "?"
			for _, s := range spans {
				if s.ParentID == "" {
					strategy = s.Attrs[string(stormlab.AttrStrategy)]
				}
			}
			fmt.Fprintf(out, "mesh trace, %s (trace %s):\n", strategy, id)
			stormlab.WriteMeshLayers(out, layers)
			fmt.Fprintf(out, "  in Jaeger: %s\n\n", jaegerlab.TraceURL(o.jaeger, id))
		}
	}
	if len(found) == 0 {
		return fmt.Errorf("-mesh: none of the %d longest user calls was retried below the user, in Jaeger", min(meshCandidates, len(roots)))
	}
	if o.traceSVG == "" {
		return nil
	}
	if err := writeFile(o.traceSVG, func(w io.Writer) error { return stormlab.WriteWaterfall(w, found[0]) }); err != nil {
		return err
	}
	fmt.Fprintf(out, "wrote %s: trace %s, %d spans as read back from Jaeger\n", o.traceSVG, found[0][0].TraceID, len(found[0]))
	return nil
}

// settled reads trace id back from Jaeger once two reads 300 ms apart
// find the same spans (at most 10 s): the chain's processes flushed their
// spans when they stopped, and Jaeger stores them a little later.
func settled(ctx context.Context, queryURL, id string) ([]stormlab.TraceSpan, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	last := -1
	for {
		spans, err := jaegerlab.FetchTrace(ctx, queryURL, id)
		if err == nil && len(spans) == last {
			return spans, nil
		}
		if err == nil {
			last = len(spans)
		}
		select {
		case <-ctx.Done():
			if err != nil {
				return nil, err
			}
			return spans, nil
		case <-time.After(300 * time.Millisecond):
		}
	}
}

// readBack reads the trace of the recorded spans from Jaeger, waiting (at
// most 15 s) until it holds them all and a server span under every
// attempt, which a traced demo-server exports on its own schedule.
func readBack(ctx context.Context, queryURL string, recorded []stormlab.TraceSpan) ([]stormlab.TraceSpan, error) {
	attempts := 0
	for _, s := range recorded {
		if s.Name == telemetry.SpanAttempt {
			attempts++
		}
	}
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	var spans []stormlab.TraceSpan
	var err error
	for {
		spans, err = jaegerlab.FetchTrace(ctx, queryURL, recorded[0].TraceID)
		servers := 0
		for _, s := range spans {
			if s.Kind == "server" {
				servers++
			}
		}
		if err == nil && len(spans)-servers >= len(recorded) && servers >= attempts {
			return spans, nil
		}
		select {
		case <-ctx.Done():
			if err != nil {
				return nil, err
			}
			log.Printf("trace %s in Jaeger has %d of %d client spans and %d server spans for %d attempts; drawing what it has",
				recorded[0].TraceID, len(spans)-servers, len(recorded), servers, attempts)
			return spans, nil
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// shutdown stops the provider if finish did not, on the way out of a run
// that failed.
func (t *tracing) shutdown() {
	if t.tp == nil || t.done {
		return
	}
	t.done = true
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var err error
	if t.exp != nil {
		err = t.exp.Shutdown(ctx)
	} else {
		err = t.tp.Shutdown(ctx)
	}
	if err != nil {
		log.Print(err)
	}
}
