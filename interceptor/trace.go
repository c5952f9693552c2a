package interceptor

import (
	"context"
	"net"
	"reflect"
	"strconv"
	"strings"

	"github.com/herdguard/herdguard/internal/names"
	"github.com/herdguard/herdguard/telemetry"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard"
	"github.com/herdguard/herdguard/breaker"
)

// tracing holds the tracer, made once in New from the tracer provider given,
// or from the global provider as it is then, which, before an SDK is
// installed, forwards to the first one installed later (as otelgrpc relies
// on). So that calls do no span work while nothing would record it, a
// no-op provider turns tracing off, and OpenTelemetry's global provider
// before an SDK is installed (initialGlobal) turns it off for as long as
// otel.GetTracerProvider still returns it.
type tracing struct {
	tr trace.Tracer // nil: tracing off for good
	// unset, when not nil, is the global provider as New found it making
	// no spans: tracing is off while it is still the global one.
	unset trace.TracerProvider
}

func (t *tracing) init(tp trace.TracerProvider) {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	switch tp.(type) {
	case noop.TracerProvider, *noop.TracerProvider:
		return
	}
	t.tr = tp.Tracer(telemetry.ScopeName, trace.WithInstrumentationVersion(telemetry.Version))
	if comparable(tp) && tp == initialGlobal && !initialMakesSpans && tp == otel.GetTracerProvider() {
		t.unset = tp
	}
}

// initialGlobal is the global tracer provider as it was when this package
// was initialized: OpenTelemetry's own, which makes no spans until an SDK
// is installed, unless a package initialized earlier installed one, which
// initialMakesSpans tells. It is asked once here, so that New starts no
// span: a probe span started on an SDK whose sampler does not follow the
// parent (AlwaysSample, a ratio of trace IDs) is sampled and exported, and
// when New asked, each New sent one to the user's backend.
var (
	initialGlobal     = otel.GetTracerProvider()
	initialMakesSpans = !comparable(initialGlobal) || makesSpans(initialGlobal.Tracer(telemetry.ScopeName))
)

// tracer returns the tracer of this call, or nil when tracing is off.
func (t *tracing) tracer() trace.Tracer {
	if t.unset != nil && otel.GetTracerProvider() == t.unset {
		return nil
	}
	return t.tr
}

// probeParent is the remote parent under which makesSpans starts its span.
var probeParent = trace.NewSpanContext(trace.SpanContextConfig{
	TraceID: trace.TraceID{'h', 'e', 'r', 'd', 'g', 'u', 'a', 'r', 'd', 'p', 'r', 'o', 'b', 'e'},
	SpanID:  trace.SpanID{'h', 'g', 'p', 'r', 'o', 'b', 'e'},
	Remote:  true,
})

// makesSpans reports whether tr makes spans of its own. A span started under
// a remote, unsampled parent gets a span ID of its own from any SDK (which,
// sampling by the parent as it does by default, records nothing and exports
// nothing), and comes back with the parent's own from a tracer that makes
// no spans: a no-op one, or the global one before an SDK is installed.
func makesSpans(tr trace.Tracer) bool {
	ctx := trace.ContextWithRemoteSpanContext(context.Background(), probeParent)
	_, span := tr.Start(ctx, "herdguard.probe")
	span.End() // as every span; only an SDK installed before this package's init sees it
	return span.SpanContext().SpanID() != probeParent.SpanID()
}

// comparable reports whether values of p's dynamic type can be compared
// with ==, which the check in tracer makes on every call.
func comparable(p any) bool {
	t := reflect.TypeOf(p)
	return t == nil || t.Comparable()
}

// startCall starts the call span of a call to method on target (the
// connection's target, "" when unknown).
func startCall(ctx context.Context, tr trace.Tracer, method, target string) (context.Context, trace.Span) {
	name := trimSlash(method)
	attrs := [4]attribute.KeyValue{semconv.RPCSystemNameGRPC, semconv.RPCMethod(name)}
	n := 2
	if host, port := serverAddress(target); host != "" {
		attrs[n] = semconv.ServerAddress(host)
		n++
		if port > 0 {
			attrs[n] = semconv.ServerPort(port)
			n++
		}
	}
	return tr.Start(ctx, name, trace.WithSpanKind(trace.SpanKindClient), trace.WithAttributes(attrs[:n]...))
}

// serverAddress returns the host (or socket path) and port that a gRPC
// target names, for server.address and server.port: "host:port",
// "dns:///host:port", "dns://resolver/host:port", "unix:///path" or
// "unix:path" (no port), or "scheme:endpoint" for a registered resolver's
// scheme, as gRPC reads it. port is 0 when the target names none; host is ""
// when target is.
func serverAddress(target string) (host string, port int) {
	scheme, rest, ok := strings.Cut(target, ":")
	switch {
	case !ok:
		return target, 0
	case scheme == "unix" || scheme == "unix-abstract":
		if path, ok := strings.CutPrefix(rest, "//"); ok {
			// unix://authority/path: the authority is empty in practice.
			_, path, _ = strings.Cut(path, "/")
			return "/" + path, 0
		}
		return rest, 0
	}
	endpoint := target
	if isScheme(scheme) {
		if after, ok := strings.CutPrefix(rest, "//"); ok {
			_, endpoint, _ = strings.Cut(after, "/") // scheme://authority/endpoint
		} else if strings.Contains(rest, ":") || resolver.Get(scheme) != nil {
			// scheme:host:port, or scheme:endpoint with a scheme gRPC
			// resolves ("passthrough:bufnet"); "localhost:50051" is
			// neither, and gRPC dials it as dns:///localhost:50051.
			endpoint = rest
		}
	}
	h, p, err := net.SplitHostPort(endpoint)
	if err != nil {
		return endpoint, 0
	}
	if n, err := strconv.Atoi(p); err == nil && n > 0 && n < 1<<16 {
		port = n
	}
	return h, port
}

// isScheme reports whether s can be a URL scheme (letters, digits, "+",
// "-" and "."), and is not a host name (which has a dot).
func isScheme(s string) bool {
	if s == "" || strings.Contains(s, ".") {
		return false
	}
	for _, c := range s {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '+' || c == '-') {
			return false
		}
	}
	return true
}

// endCall records the call's result on its span and ends it.
func endCall(span trace.Span, attempts int, outcome Outcome, code codes.Code, msg string) {
	name := canonicalCode(code)
	span.SetAttributes(
		telemetry.AttrAttempts.Int(attempts),
		telemetry.AttrOutcome.String(string(outcome)),
		semconv.RPCResponseStatusCode(name),
	)
	if code != codes.OK {
		span.SetAttributes(semconv.ErrorTypeKey.String(name))
		span.SetStatus(otelcodes.Error, msg)
	}
	span.End()
}

// startAttempt starts the span of attempt number attempt of a call to method.
func startAttempt(ctx context.Context, tr trace.Tracer, method string, attempt int) (context.Context, trace.Span) {
	return tr.Start(ctx, telemetry.SpanAttempt, trace.WithAttributes(semconv.RPCMethod(trimSlash(method)), telemetry.AttrAttempt.Int(attempt)))
}

// attemptEnded counts attempt n of a call to method, which ended with err,
// and ends its span (nil when tracing is off). hedge says the attempt was a
// hedge, and won that its answer decided a hedged call.
func (ic *Interceptor) attemptEnded(ctx context.Context, method, target string, span trace.Span, n int, err error, hedge, won bool) {
	ic.metering.attempt(ctx, method, target, err, n > 1, hedge)
	if hedge {
		ic.metering.hedge(ctx, method, target, won)
	}
	if span != nil {
		if won {
			span.SetAttributes(telemetry.AttrHedgeWon.Bool(true))
		}
		st := status.Convert(err)
		endAttempt(span, st.Code(), st.Message())
	}
}

func endAttempt(span trace.Span, code codes.Code, msg string) {
	name := canonicalCode(code)
	span.SetAttributes(semconv.RPCResponseStatusCode(name))
	if code != codes.OK {
		span.SetAttributes(semconv.ErrorTypeKey.String(name))
		span.SetStatus(otelcodes.Error, msg)
	}
	span.End()
}

func startBackoff(ctx context.Context, tr trace.Tracer, next int, delayMS float64, jitter string) trace.Span {
	_, span := tr.Start(ctx, telemetry.SpanBackoff, trace.WithAttributes(
		telemetry.AttrAttempt.Int(next),
		names.AttrBackoffDelayMS.Float64(delayMS),
		names.AttrBackoffJitter.String(jitter),
	))
	return span
}

func breakerRejected(span trace.Span, err *breaker.OpenError) {
	span.AddEvent(names.EventBreakerRejected, trace.WithAttributes(
		telemetry.AttrBreakerScope.String(err.Scope), names.AttrBreakerState.String(err.State.String()), telemetry.AttrBreakerShared.Bool(err.Shared)))
}

func breakerChanged(span trace.Span, scope string, from, to breaker.State) {
	span.AddEvent(names.EventBreakerStateChange, trace.WithAttributes(
		telemetry.AttrBreakerScope.String(scope), telemetry.AttrBreakerFrom.String(from.String()), telemetry.AttrBreakerTo.String(to.String())))
}

// canonicalCode returns the status code's name as gRPC's spec spells it,
// which is what rpc.response.status_code carries.
func canonicalCode(c codes.Code) string { return herdguard.CodeName(c) }

// targetOf returns cc's target, or "" when there is no connection (an
// invoker called directly, as in tests and benchmarks).
func targetOf(cc *grpc.ClientConn) string {
	if cc == nil {
		return ""
	}
	return cc.Target()
}
