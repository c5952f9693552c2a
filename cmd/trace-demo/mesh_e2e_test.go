package main

import (
	"bytes"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/herdguard/herdguard/cmd/internal/jaegerlab"
	"github.com/herdguard/herdguard/cmd/stormlab"
)

// TestE2EMeshTraceInJaeger runs trace-demo -mesh against a real Jaeger:
// the chain user -> gateway -> service -> leaf, four processes exporting
// on their own. Every printed user call is one trace in Jaeger holding the
// spans of every tier, each under its parent (the trace context carried
// down every hop); the leaf fails on its own, so every layer may retry,
// the leaf's caller among them; the waterfall names each row's layer.
func TestE2EMeshTraceInJaeger(t *testing.T) {
	o := e2e(t)
	o.mesh, o.meshStrategy, o.samples = true, stormlab.MeshServerHalf, 2
	ctx, j, out := startE2E(t, &o)

	ids, err := meshDemo(ctx, j, o)
	if err != nil {
		t.Fatal(err)
	}
	if len(ids) != o.samples {
		t.Errorf("%d trace ids printed, want %d", len(ids), o.samples)
	}
	tiers := []string{"demo-client", stormlab.TierService(2), stormlab.TierService(stormlab.MeshDepth), stormlab.LeafService}
	for _, id := range ids {
		spans, err := jaegerlab.FetchTrace(ctx, j.QueryURL, id)
		if err != nil {
			t.Fatal(err)
		}
		byID := map[string]bool{}
		for _, s := range spans {
			byID[s.SpanID] = true
		}
		var services []string
		for _, s := range spans {
			if s.ParentID != "" && !byID[s.ParentID] {
				t.Errorf("trace %s: span %q of %s has no parent in the trace", id, s.Name, s.Service)
			}
			if !slices.Contains(services, s.Service) {
				services = append(services, s.Service)
			}
		}
		for _, want := range tiers {
			if !slices.Contains(services, want) {
				t.Errorf("trace %s: services %v, want %s among them", id, services, want)
			}
		}
		layers, err := stormlab.MeshLayers(spans)
		if err != nil {
			t.Fatal(err)
		}
		if len(layers) != stormlab.MeshDepth {
			t.Fatalf("trace %s: layers %+v, want the user, the gateway and the service", id, layers)
		}
		// The leaf fails on its own: nothing judges it overloaded, and
		// every layer may retry, with the server half as without it. The
		// printed calls were retried below the user: the leaf's caller did.
		for i, l := range layers {
			if want := tiers[i]; l.Service != want {
				t.Errorf("trace %s: layer %d %+v: want %s", id, i, l, want)
			}
		}
		if !layers[stormlab.MeshDepth-1].Retried() {
			t.Errorf("trace %s: the leaf's caller did not retry: %+v", id, layers)
		}
		if !strings.Contains(out.String(), jaegerlab.TraceURL(j.QueryURL, id)) {
			t.Errorf("no Jaeger link printed for trace %s", id)
		}
	}
	svg, err := os.ReadFile(o.svg)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"<svg", "[demo-client] ", "[gateway] attempt 1", "[service] attempt 2", "server (leaf)", "demo-client → gateway → service", ids[0]} {
		if !bytes.Contains(svg, []byte(want)) {
			t.Errorf("the waterfall lacks %q", want)
		}
	}
}
