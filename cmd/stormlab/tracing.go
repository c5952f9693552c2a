package stormlab

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/herdguard/herdguard/telemetry"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/stats"
)

// Attributes the storm lab records on the root span of every call, so that
// a trace read back from a collector names the run it came from.
const (
	AttrScenario = attribute.Key("stormlab.scenario")
	AttrStrategy = attribute.Key("stormlab.strategy")
)

// Propagator is the one the demo's client and server carry trace context
// with: W3C Trace Context.
var Propagator propagation.TextMapPropagator = propagation.TraceContext{}

// Exporter sends spans over OTLP gRPC to a collector on loopback.
type Exporter struct {
	Endpoint string // host:port
	tp       *sdktrace.TracerProvider
	exp      *countingExporter
}

// countingExporter remembers the spans its exporter failed to deliver.
type countingExporter struct {
	sdktrace.SpanExporter
	mu    sync.Mutex
	lost  int
	first error
}

func (c *countingExporter) ExportSpans(ctx context.Context, spans []sdktrace.ReadOnlySpan) error {
	err := c.SpanExporter.ExportSpans(ctx, spans)
	if err != nil {
		c.mu.Lock()
		c.lost += len(spans)
		if c.first == nil {
			c.first = err
		}
		c.mu.Unlock()
	}
	return err
}

// collectorTimeout bounds the check that a collector listens and each
// export to it.
const collectorTimeout = 2 * time.Second

// NewExporter returns a tracer provider that exports every span to the
// OTLP gRPC collector at endpoint, on loopback, as service (unless
// OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES say otherwise), with
// herdguard's version as service.version. It fails at once, naming the
// endpoint, when nothing listens there. extra options are added to the
// provider's, such as another span processor.
func NewExporter(ctx context.Context, service, endpoint string, extra ...sdktrace.TracerProviderOption) (*Exporter, *sdktrace.TracerProvider, error) {
	if err := CheckLoopback(endpoint); err != nil {
		return nil, nil, fmt.Errorf("OTLP endpoint: %w", err)
	}
	d := net.Dialer{Timeout: collectorTimeout}
	conn, err := d.DialContext(ctx, "tcp", endpoint)
	if err != nil {
		return nil, nil, fmt.Errorf("no OTLP collector at %s: %w", endpoint, err)
	}
	conn.Close()
	grpcExp, err := otlptracegrpc.New(ctx, otlptracegrpc.WithEndpoint(endpoint), otlptracegrpc.WithInsecure(),
		otlptracegrpc.WithTimeout(collectorTimeout), otlptracegrpc.WithRetry(otlptracegrpc.RetryConfig{Enabled: false}))
	if err != nil {
		return nil, nil, fmt.Errorf("OTLP exporter for %s: %w", endpoint, err)
	}
	exp := &countingExporter{SpanExporter: grpcExp}
	res, err := Resource(ctx, service)
	if err != nil {
		return nil, nil, err
	}
	// A herd of 1000 calls makes 10 000 spans in a second: a queue that
	// holds them all, and a processor that waits rather than drops.
	opts := append([]sdktrace.TracerProviderOption{
		sdktrace.WithResource(res),
		sdktrace.WithBatcher(exp, sdktrace.WithMaxQueueSize(1<<16), sdktrace.WithMaxExportBatchSize(2048),
			sdktrace.WithBatchTimeout(500*time.Millisecond), sdktrace.WithBlocking()),
	}, extra...)
	tp := sdktrace.NewTracerProvider(opts...)
	return &Exporter{Endpoint: endpoint, tp: tp, exp: exp}, tp, nil
}

// Shutdown flushes every span to the collector and stops the provider. It
// fails, naming the endpoint, when any span was not delivered.
func (e *Exporter) Shutdown(ctx context.Context) error {
	if err := e.tp.Shutdown(ctx); err != nil {
		return fmt.Errorf("sending spans to the OTLP collector at %s: %w", e.Endpoint, err)
	}
	e.exp.mu.Lock()
	defer e.exp.mu.Unlock()
	if e.exp.lost > 0 {
		return fmt.Errorf("the OTLP collector at %s did not take %d spans: %w", e.Endpoint, e.exp.lost, e.exp.first)
	}
	return nil
}

// Resource describes a demo process: service.name is service unless
// OTEL_SERVICE_NAME sets another, service.version is herdguard's, and
// OTEL_RESOURCE_ATTRIBUTES adds more.
func Resource(ctx context.Context, service string) (*resource.Resource, error) {
	res, err := resource.New(ctx,
		resource.WithAttributes(semconv.ServiceName(service), semconv.ServiceVersion(telemetry.Version)),
		resource.WithFromEnv(), // after ours: the environment overrides them
		resource.WithTelemetrySDK(),
	)
	if err != nil && !errors.Is(err, resource.ErrPartialResource) {
		return nil, fmt.Errorf("resource of %s: %w", service, err)
	}
	return res, nil
}

// ServerTracing traces every call to the demo service with otelgrpc's
// server handler, continuing the trace context the client sent. The
// control calls (ResetStats, GetStats) are not traced.
func ServerTracing(tp trace.TracerProvider) grpc.ServerOption {
	return grpc.StatsHandler(otelgrpc.NewServerHandler(
		otelgrpc.WithTracerProvider(tp),
		otelgrpc.WithPropagators(Propagator),
		otelgrpc.WithFilter(func(i *stats.RPCTagInfo) bool { return !controlMethod(i.FullMethodName) }),
	))
}

// ClientTracing adds otelgrpc's client handler to the connection the calls
// go through: a span per attempt on the wire, under herdguard's attempt
// span, and the W3C trace context sent with every attempt.
func ClientTracing(tp trace.TracerProvider) grpc.DialOption {
	return grpc.WithStatsHandler(otelgrpc.NewClientHandler(
		otelgrpc.WithTracerProvider(tp),
		otelgrpc.WithPropagators(Propagator),
	))
}

// Labeler is a span processor that records the scenario and strategy being
// run on every root span (a call span), so every trace names its run. Set
// it from [Runner.OnProgress].
type Labeler struct {
	run atomic.Pointer[[2]attribute.KeyValue]
}

// Set makes the spans started from now on carry scenario and strategy.
func (l *Labeler) Set(scenario, strategy string) {
	l.run.Store(&[2]attribute.KeyValue{AttrScenario.String(scenario), AttrStrategy.String(strategy)})
}

// OnStart labels s when it is a root span.
func (l *Labeler) OnStart(_ context.Context, s sdktrace.ReadWriteSpan) {
	if s.Parent().IsValid() {
		return
	}
	if kv := l.run.Load(); kv != nil {
		s.SetAttributes(kv[:]...)
	}
}

// OnEnd does nothing.
func (*Labeler) OnEnd(sdktrace.ReadOnlySpan) {}

// Shutdown does nothing.
func (*Labeler) Shutdown(context.Context) error { return nil }

// ForceFlush does nothing.
func (*Labeler) ForceFlush(context.Context) error { return nil }

// CheckLoopback returns an error unless addr is host:port with a loopback
// host (an IP address, or localhost).
func CheckLoopback(addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%q: %w", addr, err)
	}
	if host == "localhost" {
		return nil
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		return fmt.Errorf("%s: the demo talks to loopback addresses only", addr)
	}
	return nil
}
