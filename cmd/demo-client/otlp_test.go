package main

import (
	"bytes"
	"context"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	coltrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracev1 "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"

	"github.com/herdguard/herdguard/cmd/stormlab"
)

// collector is a stand-in OTLP trace collector that counts the spans it
// receives by name, and keeps the call spans (the roots).
type collector struct {
	coltrace.UnimplementedTraceServiceServer
	mu       sync.Mutex
	names    map[string]int
	roots    []*tracev1.Span
	services map[string]bool
}

func (c *collector) Export(_ context.Context, req *coltrace.ExportTraceServiceRequest) (*coltrace.ExportTraceServiceResponse, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		for _, kv := range rs.GetResource().GetAttributes() {
			if kv.GetKey() == "service.name" {
				c.services[kv.GetValue().GetStringValue()] = true
			}
		}
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				c.names[s.GetName()]++
				if len(s.GetParentSpanId()) == 0 {
					c.roots = append(c.roots, s)
				}
			}
		}
	}
	return &coltrace.ExportTraceServiceResponse{}, nil
}

func (c *collector) count(name string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.names[name]
}

// serve runs g on 127.0.0.1 until the test ends and returns its address.
func serve(t *testing.T, g *grpc.Server) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = g.Serve(lis) }()
	t.Cleanup(func() { g.Stop(); <-done })
	return lis.Addr().String()
}

// otlpRun starts a stand-in collector and a demo server on 127.0.0.1 for
// the test, and returns them with the options of a small traced run.
func otlpRun(t *testing.T) (*collector, *grpc.Server, options) {
	t.Helper()
	col := &collector{names: map[string]int{}, services: map[string]bool{}}
	cg := grpc.NewServer()
	coltrace.RegisterTraceServiceServer(cg, col)
	colAddr := serve(t, cg)
	_, addr, stop, err := stormlab.ServeLoopback(stormlab.Faults{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	return col, cg, options{addr: addr, calls: 20, attempts: 3, base: time.Second, scale: 20, width: 40,
		strategy: "herdguard defaults", scenario: "published", otlp: colAddr}
}

func TestExportsSpansOverOTLP(t *testing.T) {
	col, _, o := otlpRun(t)
	if err := run(context.Background(), o, &bytes.Buffer{}, &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	// run flushes the exporter before it returns
	col.mu.Lock()
	defer col.mu.Unlock()
	if len(col.roots) != 20 {
		t.Errorf("collector got %d root spans, want 20 (one call span per call)", len(col.roots))
	}
	for _, s := range col.roots {
		attrs := map[string]string{}
		for _, kv := range s.GetAttributes() {
			attrs[kv.GetKey()] = kv.GetValue().GetStringValue()
		}
		if s.GetName() != "herdguard.demo.v1.GatewayService/Charge" || attrs["stormlab.strategy"] != "herdguard defaults" ||
			attrs["stormlab.scenario"] != stormlab.Published().Name {
			t.Errorf("root span %q with attributes %v, want the call span naming the strategy and scenario", s.GetName(), attrs)
			break
		}
	}
	if n := col.names["attempt"]; n < 20 {
		t.Errorf("collector got %d attempt spans, want at least 20", n)
	}
	if !col.services["demo-client"] {
		t.Errorf("services %v, want demo-client", col.services)
	}
}

func TestOTLPFailsFastNamingTheCollector(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	free := lis.Addr().String()
	lis.Close()
	_, _, o := otlpRun(t)
	o.otlp = free
	began := time.Now()
	err = run(context.Background(), o, &bytes.Buffer{}, &bytes.Buffer{})
	if err == nil || !strings.Contains(err.Error(), free) || !strings.Contains(err.Error(), "-otlp") {
		t.Errorf("run with no collector = %v, want an error naming -otlp and %s", err, free)
	}
	if d := time.Since(began); d > 3*time.Second {
		t.Errorf("run with no collector took %v to fail", d)
	}
}

// TestOTLPCollectorGoneFails: a collector that stops answering during the
// run makes run fail, naming it, instead of exiting 0 with spans lost.
func TestOTLPCollectorGoneFails(t *testing.T) {
	_, cg, o := otlpRun(t)
	progress := gone{stop: cg.Stop}
	err := run(context.Background(), o, &bytes.Buffer{}, &progress)
	if err == nil || !strings.Contains(err.Error(), o.otlp) {
		t.Errorf("run whose collector went away = %v, want an error naming %s", err, o.otlp)
	}
}

// gone stops the collector when the run reports its first progress.
type gone struct {
	once sync.Once
	stop func()
}

func (g *gone) Write(p []byte) (int, error) {
	g.once.Do(g.stop)
	return len(p), nil
}
