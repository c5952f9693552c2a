package main

import (
	"bytes"
	"context"
	"net"
	"sync"
	"testing"
	"time"

	coltrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"

	"github.com/herdguard/herdguard/internal/stormlab"
)

// collector is a stand-in OTLP trace collector that counts the spans it
// receives by name.
type collector struct {
	coltrace.UnimplementedTraceServiceServer
	mu    sync.Mutex
	names map[string]int
}

func (c *collector) Export(_ context.Context, req *coltrace.ExportTraceServiceRequest) (*coltrace.ExportTraceServiceResponse, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				c.names[s.GetName()]++
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

func TestExportsSpansOverOTLP(t *testing.T) {
	col := &collector{names: map[string]int{}}
	cg := grpc.NewServer()
	coltrace.RegisterTraceServiceServer(cg, col)
	colAddr := serve(t, cg)

	_, addr, stop, err := stormlab.ServeLoopback(stormlab.Faults{})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()

	o := options{addr: addr, calls: 20, attempts: 3, base: time.Second, scale: 20, width: 40,
		strategy: "herdguard defaults", scenario: "published", otlp: colAddr}
	if err := run(context.Background(), o, &bytes.Buffer{}, &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	// run flushes the exporter before it returns
	if n := col.count("herdguard.demo.v1.GatewayService/Charge"); n != 20 {
		t.Errorf("collector got %d call spans, want 20 (one per call)", n)
	}
	if n := col.count("attempt"); n < 20 {
		t.Errorf("collector got %d attempt spans, want at least 20", n)
	}
}
