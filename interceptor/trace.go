package interceptor

import (
	"context"
	"reflect"
	"sync/atomic"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc/codes"

	"github.com/herdguard/herdguard"
	"github.com/herdguard/herdguard/breaker"
)

// Names of the spans, attributes and events that herdguard records. The
// rpc.* attributes are the semconv package's.
const (
	// ScopeName is the instrumentation scope of herdguard's tracer.
	ScopeName = "github.com/herdguard/herdguard/interceptor"
	// Version is herdguard's version, recorded with the instrumentation scope.
	Version = "0.1.0"

	SpanAttempt = "attempt"
	SpanBackoff = "backoff"

	AttrAttempts       = attribute.Key("herdguard.attempts")
	AttrOutcome        = attribute.Key("herdguard.outcome")
	AttrAttempt        = attribute.Key("herdguard.attempt")
	AttrBackoffDelayMS = attribute.Key("herdguard.backoff.delay_ms")
	AttrBackoffJitter  = attribute.Key("herdguard.backoff.jitter")
	AttrBreakerScope   = attribute.Key("herdguard.breaker.scope")
	AttrBreakerState   = attribute.Key("herdguard.breaker.state")
	AttrBreakerFrom    = attribute.Key("herdguard.breaker.from")
	AttrBreakerTo      = attribute.Key("herdguard.breaker.to")
	AttrBreakerProbe   = attribute.Key("herdguard.breaker.probe")

	AttrStreamSent             = attribute.Key("herdguard.stream.messages_sent")
	AttrStreamReceived         = attribute.Key("herdguard.stream.messages_received")
	AttrStreamReplayedMessages = attribute.Key("herdguard.stream.replayed_messages")
	AttrStreamReplayedBytes    = attribute.Key("herdguard.stream.replayed_bytes")
	AttrStreamOverflow         = attribute.Key("herdguard.stream.buffer_overflow")

	EventBreakerRejected    = "herdguard.breaker.rejected"
	EventBreakerStateChange = "herdguard.breaker.state_change"
)

// tracing finds the tracer for each call. With no provider given it follows
// the global provider, which may be installed after New; when the provider
// is a no-op, it reports tracing off so calls skip span work entirely.
type tracing struct {
	fixed bool // the provider was given and is not the global one
	cur   atomic.Pointer[tracerSnapshot]
}

type tracerSnapshot struct {
	tp     trace.TracerProvider
	cmp    bool // tp's type is comparable
	tracer trace.Tracer
	on     bool
}

func (t *tracing) init(tp trace.TracerProvider) {
	if tp != nil && !isGlobalDelegate(tp) {
		t.fixed = true
	} else {
		tp = otel.GetTracerProvider()
	}
	t.cur.Store(newSnapshot(tp))
}

func newSnapshot(tp trace.TracerProvider) *tracerSnapshot {
	s := &tracerSnapshot{tp: tp, cmp: comparable(tp), on: !isNoop(tp)}
	if s.on {
		s.tracer = tp.Tracer(ScopeName, trace.WithInstrumentationVersion(Version))
	}
	return s
}

// tracer returns the tracer of this call, or nil when tracing is off.
func (t *tracing) tracer() trace.Tracer {
	s := t.cur.Load()
	if !t.fixed {
		if tp := otel.GetTracerProvider(); !sameProvider(tp, s.tp, s.cmp) {
			s = newSnapshot(tp)
			t.cur.Store(s)
		}
	}
	if !s.on {
		return nil
	}
	return s.tracer
}

// sameProvider reports whether p is still the provider old, whose type's
// comparability is oldCmp. A provider of a type that cannot be compared is
// taken as unchanged while its type stays the same.
func sameProvider(p, old any, oldCmp bool) bool {
	if oldCmp {
		return p == old // different dynamic types compare unequal, never panic
	}
	return reflect.TypeOf(p) == reflect.TypeOf(old)
}

func comparable(p any) bool {
	t := reflect.TypeOf(p)
	return t == nil || t.Comparable()
}

// isGlobalDelegate reports whether p is one of OpenTelemetry's global
// providers (tracer or meter) before an SDK is installed: it records
// nothing until one is.
func isGlobalDelegate(p any) bool {
	t := reflect.TypeOf(p)
	return t != nil && t.Kind() == reflect.Pointer && t.Elem().PkgPath() == "go.opentelemetry.io/otel/internal/global"
}

func isNoop(tp trace.TracerProvider) bool {
	switch tp.(type) {
	case nil, noop.TracerProvider, *noop.TracerProvider:
		return true
	}
	return isGlobalDelegate(tp)
}

// startCall starts the call span.
func startCall(ctx context.Context, tr trace.Tracer, method string) (context.Context, trace.Span) {
	name := trimSlash(method)
	return tr.Start(ctx, name,
		trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(semconv.RPCSystemNameGRPC, semconv.RPCMethod(name)))
}

// endCall records the call's result on its span and ends it.
func endCall(span trace.Span, attempts int, outcome Outcome, code codes.Code, msg string) {
	span.SetAttributes(
		AttrAttempts.Int(attempts),
		AttrOutcome.String(string(outcome)),
		semconv.RPCResponseStatusCode(canonicalCode(code)),
	)
	if code != codes.OK {
		span.SetStatus(otelcodes.Error, msg)
	}
	span.End()
}

func startAttempt(ctx context.Context, tr trace.Tracer, attempt int) (context.Context, trace.Span) {
	return tr.Start(ctx, SpanAttempt, trace.WithAttributes(AttrAttempt.Int(attempt)))
}

func endAttempt(span trace.Span, code codes.Code, msg string) {
	span.SetAttributes(semconv.RPCResponseStatusCode(canonicalCode(code)))
	if code != codes.OK {
		span.SetStatus(otelcodes.Error, msg)
	}
	span.End()
}

func startBackoff(ctx context.Context, tr trace.Tracer, next int, delayMS float64, jitter string) trace.Span {
	_, span := tr.Start(ctx, SpanBackoff, trace.WithAttributes(
		AttrAttempt.Int(next),
		AttrBackoffDelayMS.Float64(delayMS),
		AttrBackoffJitter.String(jitter),
	))
	return span
}

func breakerRejected(span trace.Span, err *breaker.OpenError) {
	span.AddEvent(EventBreakerRejected, trace.WithAttributes(
		AttrBreakerScope.String(err.Scope), AttrBreakerState.String(err.State.String())))
}

func breakerChanged(span trace.Span, scope string, from, to breaker.State) {
	span.AddEvent(EventBreakerStateChange, trace.WithAttributes(
		AttrBreakerScope.String(scope), AttrBreakerFrom.String(from.String()), AttrBreakerTo.String(to.String())))
}

// canonicalCode returns the status code's name as gRPC's spec spells it,
// which is what rpc.response.status_code carries.
func canonicalCode(c codes.Code) string { return herdguard.CodeName(c) }
