package interceptor

import (
	"context"
	"io"
	"net"
	"testing"
	"time"

	"github.com/herdguard/herdguard/internal/names"
	"github.com/herdguard/herdguard/internal/wire"
	"github.com/herdguard/herdguard/telemetry"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/policy"
)

func newRecorder() (*tracetest.SpanRecorder, *sdktrace.TracerProvider) {
	rec := tracetest.NewSpanRecorder()
	return rec, sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
}

func attrs(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes() {
		m[kv.Key] = kv.Value
	}
	return m
}

func spansNamed(spans []sdktrace.ReadOnlySpan, name string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range spans {
		if s.Name() == name {
			out = append(out, s)
		}
	}
	return out
}

func TestSpanTree(t *testing.T) {
	rec, tp := newRecorder()
	sc := fail(codes.Unavailable, codes.Unavailable, codes.OK)
	sc.trailers = map[int]metadata.MD{1: metadata.Pairs(wire.PushbackKey, "30")}
	_, c, _, _ := setup(t, sc, WithTracerProvider(tp), WithPolicy(tablePolicy))
	if err := call(t, c); err != nil {
		t.Fatal(err)
	}
	spans := rec.Ended()
	calls := spansNamed(spans, "grpc.testing.TestService/UnaryCall")
	if len(calls) != 1 {
		t.Fatalf("%d call spans, want 1 (spans: %d)", len(calls), len(spans))
	}
	cs := calls[0]
	if cs.SpanKind() != trace.SpanKindClient {
		t.Errorf("call span kind %v, want client", cs.SpanKind())
	}
	a := attrs(cs)
	for k, want := range map[attribute.Key]any{
		"rpc.system.name":          "grpc",
		"rpc.method":               "grpc.testing.TestService/UnaryCall",
		"rpc.response.status_code": "OK",
		telemetry.AttrAttempts:     int64(3),
		telemetry.AttrOutcome:      "ok",
	} {
		if got := a[k].AsInterface(); got != want {
			t.Errorf("call span %s = %v, want %v", k, got, want)
		}
	}
	if cs.InstrumentationScope().Name != telemetry.ScopeName || cs.InstrumentationScope().Version != telemetry.Version {
		t.Errorf("instrumentation scope %+v", cs.InstrumentationScope())
	}

	attempts, backoffs := spansNamed(spans, telemetry.SpanAttempt), spansNamed(spans, telemetry.SpanBackoff)
	if len(attempts) != 3 || len(backoffs) != 2 {
		t.Fatalf("%d attempt and %d backoff spans, want 3 and 2", len(attempts), len(backoffs))
	}
	wantCodes := []string{"UNAVAILABLE", "UNAVAILABLE", "OK"}
	for i, s := range attempts {
		if s.Parent().SpanID() != cs.SpanContext().SpanID() {
			t.Errorf("attempt %d is not a child of the call span", i+1)
		}
		a := attrs(s)
		if got := a[telemetry.AttrAttempt].AsInt64(); got != int64(i+1) {
			t.Errorf("attempt span %d has %s = %d", i+1, telemetry.AttrAttempt, got)
		}
		if got := a["rpc.response.status_code"].AsString(); got != wantCodes[i] {
			t.Errorf("attempt %d status %q, want %q", i+1, got, wantCodes[i])
		}
	}
	wantBackoff := []struct {
		next   int64
		ms     float64
		jitter string
	}{{2, 10, "none"}, {3, 30, "pushback"}}
	for i, s := range backoffs {
		if s.Parent().SpanID() != cs.SpanContext().SpanID() {
			t.Errorf("backoff %d is not a child of the call span", i+1)
		}
		a, w := attrs(s), wantBackoff[i]
		if a[telemetry.AttrAttempt].AsInt64() != w.next || a[names.AttrBackoffDelayMS].AsFloat64() != w.ms || a[names.AttrBackoffJitter].AsString() != w.jitter {
			t.Errorf("backoff %d: attempt %v, delay %v ms, jitter %v; want %d, %v, %q", i+1,
				a[telemetry.AttrAttempt].AsInt64(), a[names.AttrBackoffDelayMS].AsFloat64(), a[names.AttrBackoffJitter].AsString(), w.next, w.ms, w.jitter)
		}
	}
	// attempt 1 ends before backoff 1 starts, which ends before attempt 2
	if !attempts[0].EndTime().Before(backoffs[0].StartTime()) && !attempts[0].EndTime().Equal(backoffs[0].StartTime()) {
		t.Error("the first backoff started before the first attempt ended")
	}
}

func TestSpanOutcomes(t *testing.T) {
	tests := []struct {
		name    string
		sc      *script
		opts    []Option
		outcome Outcome
		code    string
		n       int64
	}{
		{"exhausted", fail(codes.Unavailable), nil, OutcomeExhausted, "UNAVAILABLE", 3},
		{"not retryable", fail(codes.NotFound), nil, OutcomeNotRetryable, "NOT_FOUND", 1},
		{"pushback stop", func() *script {
			s := fail(codes.Unavailable)
			s.trailers = map[int]metadata.MD{0: metadata.Pairs(wire.PushbackKey, "-1")}
			return s
		}(), nil, OutcomePushbackStop, "UNAVAILABLE", 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec, tp := newRecorder()
			_, c, _, _ := setup(t, tt.sc, append(tt.opts, WithTracerProvider(tp))...)
			call(t, c)
			cs := spansNamed(rec.Ended(), "grpc.testing.TestService/UnaryCall")
			if len(cs) != 1 {
				t.Fatalf("%d call spans", len(cs))
			}
			a := attrs(cs[0])
			if a[telemetry.AttrOutcome].AsString() != string(tt.outcome) || a["rpc.response.status_code"].AsString() != tt.code || a[telemetry.AttrAttempts].AsInt64() != tt.n {
				t.Errorf("outcome %q code %q attempts %d; want %q %q %d", a[telemetry.AttrOutcome].AsString(),
					a["rpc.response.status_code"].AsString(), a[telemetry.AttrAttempts].AsInt64(), tt.outcome, tt.code, tt.n)
			}
			if cs[0].Status().Code.String() != "Error" {
				t.Errorf("span status %v, want Error", cs[0].Status())
			}
		})
	}
}

func TestSpanDeadlineAndCancelOutcomes(t *testing.T) {
	rec, tp := newRecorder()
	p := policy.Policy{MaxAttempts: 5, InitialBackoff: 10 * ms * 1000, Jitter: policy.NoJitter}
	_, c, _, _ := setup(t, fail(codes.Unavailable), WithTracerProvider(tp), WithPolicy(p), WithoutBreaker())
	ctx, cancel := context.WithTimeout(context.Background(), 5*ms*1000)
	defer cancel()
	c.UnaryCall(ctx, nil)
	ctx, cancel = context.WithCancel(context.Background())
	cancel()
	c.UnaryCall(ctx, nil)
	cs := spansNamed(rec.Ended(), "grpc.testing.TestService/UnaryCall")
	if len(cs) != 2 {
		t.Fatalf("%d call spans, want 2", len(cs))
	}
	if got := attrs(cs[0])[telemetry.AttrOutcome].AsString(); got != string(OutcomeDeadline) {
		t.Errorf("outcome %q, want deadline", got)
	}
	if got := attrs(cs[1])[telemetry.AttrOutcome].AsString(); got != string(OutcomeCanceled) {
		t.Errorf("outcome %q, want canceled", got)
	}
}

func TestSpanBreakerEvents(t *testing.T) {
	rec, tp := newRecorder()
	_, c, _, _ := setup(t, fail(codes.Unavailable), WithTracerProvider(tp), WithBreaker(breaker.Settings{ConsecutiveFailures: 1}))
	call(t, c) // trips the breaker
	call(t, c) // refused
	cs := spansNamed(rec.Ended(), "grpc.testing.TestService/UnaryCall")
	if len(cs) != 2 {
		t.Fatalf("%d call spans, want 2", len(cs))
	}
	ev := cs[0].Events()
	if len(ev) != 1 || ev[0].Name != names.EventBreakerStateChange {
		t.Fatalf("tripping call's events %v, want one %s", ev, names.EventBreakerStateChange)
	}
	got := map[attribute.Key]string{}
	for _, kv := range ev[0].Attributes {
		got[kv.Key] = kv.Value.AsString()
	}
	if got[telemetry.AttrBreakerFrom] != "closed" || got[telemetry.AttrBreakerTo] != "open" || got[telemetry.AttrBreakerScope] != testserver.Target {
		t.Errorf("state change event %v", got)
	}
	if ev := cs[1].Events(); len(ev) != 1 || ev[0].Name != names.EventBreakerRejected {
		t.Errorf("refused call's events %v, want one %s", ev, names.EventBreakerRejected)
	}
	a := attrs(cs[1])
	if a[telemetry.AttrOutcome].AsString() != string(OutcomeBreakerOpen) || a[telemetry.AttrAttempts].AsInt64() != 0 {
		t.Errorf("refused call: outcome %q attempts %d, want breaker_open and 0", a[telemetry.AttrOutcome].AsString(), a[telemetry.AttrAttempts].AsInt64())
	}
	if n := len(spansNamed(rec.Ended(), telemetry.SpanAttempt)); n != 3 {
		t.Errorf("%d attempt spans, want 3 (the refused call sends none)", n)
	}
}

// TestOtelgrpcSpansNestUnderAttempts checks that a stats handler sees each
// attempt's context: otelgrpc's client span is a child of our attempt span.
func TestOtelgrpcSpansNestUnderAttempts(t *testing.T) {
	rec, tp := newRecorder()
	srv := testserver.Start(t, &testserver.Server{Unary: fail(codes.Unavailable, codes.OK).unary})
	ic, err := New(WithTracerProvider(tp), withClock(newFakeClock()))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, append(ic.DialOptions(), grpc.WithStatsHandler(otelgrpc.NewClientHandler(otelgrpc.WithTracerProvider(tp))))...)
	if err := call(t, c); err != nil {
		t.Fatal(err)
	}
	spans := rec.Ended()
	attempts := spansNamed(spans, telemetry.SpanAttempt)
	if len(attempts) != 2 {
		t.Fatalf("%d attempt spans, want 2", len(attempts))
	}
	var nested int
	for _, s := range spans {
		if s.InstrumentationScope().Name == telemetry.ScopeName {
			continue
		}
		for _, a := range attempts {
			if s.Parent().SpanID() == a.SpanContext().SpanID() {
				nested++
			}
		}
	}
	if nested != 2 {
		t.Errorf("%d otelgrpc spans are children of attempt spans, want 2", nested)
	}
}

func TestGlobalProviderInstalledAfterNew(t *testing.T) {
	if makesSpans(otel.GetTracerProvider().Tracer("")) {
		t.Skip("a global tracer provider is installed already; this test needs the process's first")
	}
	_, c, _, ic := setup(t, fail(codes.OK))
	if ic.tracing.tracer() != nil {
		t.Error("tracing on while the global provider has no SDK behind it")
	}
	call(t, c) // global provider not set: no spans, no failure
	rec, tp := newRecorder()
	old := otel.GetTracerProvider()
	otel.SetTracerProvider(tp)
	t.Cleanup(func() { otel.SetTracerProvider(old) })
	if err := call(t, c); err != nil {
		t.Fatal(err)
	}
	if n := len(spansNamed(rec.Ended(), "grpc.testing.TestService/UnaryCall")); n != 1 {
		t.Errorf("%d call spans after installing a global provider, want 1", n)
	}
}

// TestNewExportsNoProbe: New tells whether the global provider has an SDK
// behind it by starting a span; with a global SDK that samples every span,
// that span must not reach its exporter.
func TestNewExportsNoProbe(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()), sdktrace.WithSpanProcessor(rec))
	old := otel.GetTracerProvider()
	otel.SetTracerProvider(tp)
	t.Cleanup(func() { otel.SetTracerProvider(old) })
	ic, err := New()
	if err != nil {
		t.Fatal(err)
	}
	if ic.tracing.tracer() == nil {
		t.Error("tracing off with a global SDK installed")
	}
	if started := rec.Started(); len(started) > 0 {
		t.Errorf("New started %d spans (%s), want none: ended, an exporter would send them", len(started), started[0].Name())
	}
}

func TestNoopProviderIsOff(t *testing.T) {
	for _, tp := range []trace.TracerProvider{noop.NewTracerProvider(), &noop.TracerProvider{}} {
		var tr tracing
		tr.init(tp)
		if tr.tracer() != nil {
			t.Errorf("tracing on with %T", tp)
		}
	}
	_, tp := newRecorder()
	var on tracing
	on.init(tp)
	if on.tracer() == nil {
		t.Error("tracing reported off with an SDK provider")
	}
	// An SDK that samples nothing still makes spans of its own.
	never := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.NeverSample()))
	if !makesSpans(never.Tracer("")) {
		t.Error("makesSpans = false for an SDK that samples nothing")
	}
}

func TestServerAddress(t *testing.T) {
	tests := []struct {
		target string
		host   string
		port   int
	}{
		{"127.0.0.1:7000", "127.0.0.1", 7000},
		{"localhost:50051", "localhost", 50051},
		{"[::1]:443", "::1", 443},
		{"dns:///example.com:443", "example.com", 443},
		{"dns://8.8.8.8/example.com:8443", "example.com", 8443},
		{"dns:example.com:443", "example.com", 443},
		{"passthrough:10.0.0.1:7000", "10.0.0.1", 7000},
		{"passthrough:///[::1]:50051", "::1", 50051},
		{"passthrough:///bufnet", "bufnet", 0},
		{"passthrough:bufnet", "bufnet", 0},
		{"dns:example.com", "example.com", 0},
		{"notascheme:bufnet", "notascheme", 0}, // gRPC dials dns:///notascheme:bufnet
		{"xds:///payments", "payments", 0},
		{"unix:///tmp/grpc.sock", "/tmp/grpc.sock", 0},
		{"unix:relative.sock", "relative.sock", 0},
		{"unix-abstract:herd", "herd", 0},
		{"example.com", "example.com", 0},
		{"example.com:http", "example.com", 0},
		{"", "", 0},
	}
	for _, tt := range tests {
		host, port := serverAddress(tt.target)
		if host != tt.host || port != tt.port {
			t.Errorf("serverAddress(%q) = %q, %d; want %q, %d", tt.target, host, port, tt.host, tt.port)
		}
	}
}

// TestSpanRPCAttributes checks the RPC client span conventions on a real
// connection over 127.0.0.1: server.address and server.port on the call
// span of a unary call and of a stream, error.type on a failed call and
// attempt only, and rpc.method on every attempt.
func TestSpanRPCAttributes(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	sc := fail(codes.Unavailable, codes.OK, codes.NotFound)
	g := grpc.NewServer()
	testgrpc.RegisterTestServiceServer(g, &testserver.Server{Unary: sc.unary, Empty: sc.empty,
		Bidi: func(testgrpc.TestService_FullDuplexCallServer) error { return nil }})
	done := make(chan struct{})
	go func() { defer close(done); _ = g.Serve(lis) }()
	defer func() { g.Stop(); <-done }()
	port := lis.Addr().(*net.TCPAddr).Port

	// the SDK's in-memory exporter, behind a processor that exports each span as it ends
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	ic, err := New(withClock(newFakeClock()), withRand(fixedRand(0.5)), WithPolicy(tablePolicy), WithTracerProvider(tp))
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(lis.Addr().String(), append(ic.DialOptions(), grpc.WithTransportCredentials(insecureCreds()))...)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	c := testgrpc.NewTestServiceClient(cc)
	if err := call(t, c); err != nil { // attempts: UNAVAILABLE, OK
		t.Fatal(err)
	}
	if err := call(t, c); status.Code(err) != codes.NotFound {
		t.Fatalf("second call: %v, want NotFound", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	st, err := c.FullDuplexCall(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err != io.EOF {
		t.Fatalf("Recv: %v, want EOF", err)
	}

	spans := exp.GetSpans().Snapshots()
	calls := append(spansNamed(spans, "grpc.testing.TestService/UnaryCall"), spansNamed(spans, "grpc.testing.TestService/FullDuplexCall")...)
	if len(calls) != 3 {
		t.Fatalf("%d call spans, want 3", len(calls))
	}
	for i, cs := range calls {
		a := attrs(cs)
		if a["server.address"].AsString() != "127.0.0.1" || a["server.port"].AsInt64() != int64(port) {
			t.Errorf("call span %d: server.address %v, server.port %v; want 127.0.0.1, %d", i, a["server.address"], a["server.port"], port)
		}
		wantErr := map[int]string{1: "NOT_FOUND"}[i]
		if got, ok := a["error.type"]; ok != (wantErr != "") || got.AsString() != wantErr {
			t.Errorf("call span %d: error.type %v (set: %v), want %q", i, got.AsString(), ok, wantErr)
		}
	}
	attempts := spansNamed(spans, telemetry.SpanAttempt)
	if len(attempts) != 4 {
		t.Fatalf("%d attempt spans, want 4", len(attempts))
	}
	for _, s := range attempts {
		a := attrs(s)
		method := a["rpc.method"].AsString()
		if method != "grpc.testing.TestService/UnaryCall" && method != "grpc.testing.TestService/FullDuplexCall" {
			t.Errorf("attempt span has rpc.method %q", method)
		}
		code := a["rpc.response.status_code"].AsString()
		if got, ok := a["error.type"]; ok != (code != "OK") || (ok && got.AsString() != code) {
			t.Errorf("attempt with status %s has error.type %q (set: %v)", code, got.AsString(), ok)
		}
	}
}

// holdCallEnd is a span processor that holds the end of a call span (a
// client span) until released, and says when one began to end.
type holdCallEnd struct {
	sdktrace.SpanProcessor
	ending  chan struct{}
	release chan struct{}
}

func (h *holdCallEnd) OnEnd(s sdktrace.ReadOnlySpan) {
	if s.SpanKind() == trace.SpanKindClient {
		close(h.ending)
		<-h.release
	}
	h.SpanProcessor.OnEnd(s)
}

// When the caller's context ends a stream, the watcher ends it on its own
// goroutine; a RecvMsg that finds it ended reports the end only once the
// call span has ended (as gRPC's stream records its end before RecvMsg
// returns it), so that whoever reads the spans after RecvMsg finds it. The
// call span's end is held here: RecvMsg must still wait when it is let go.
func TestStreamEndRecordedBeforeRecvReturns(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{Bidi: func(ss testgrpc.TestService_FullDuplexCallServer) error {
		for {
			m, err := ss.Recv()
			if err != nil {
				return err
			}
			if err := ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: m.GetPayload()}); err != nil {
				return err
			}
		}
	}})
	rec := tracetest.NewSpanRecorder()
	hold := &holdCallEnd{SpanProcessor: rec, ending: make(chan struct{}), release: make(chan struct{})}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(hold))
	c, _ := streamClient(t, srv, WithTracerProvider(tp))
	ctx, cancel := context.WithCancel(ctxT(t))
	defer cancel()
	stream, err := c.FullDuplexCall(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&testgrpc.StreamingOutputCallRequest{Payload: payload("x")}); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	cancel() // the watcher ends the stream, and the call span's end is held
	select {
	case <-hold.ending:
	case <-time.After(callTimeout):
		t.Fatal("the call span never began to end after the context ended")
	}
	recvErr := make(chan error, 1)
	go func() {
		_, err := stream.Recv()
		recvErr <- err
	}()
	select {
	case err := <-recvErr:
		close(hold.release)
		t.Fatalf("RecvMsg returned %v while the call span had not ended", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(hold.release)
	if err := <-recvErr; status.Code(err) != codes.Canceled {
		t.Fatalf("RecvMsg after the context ended: %v, want Canceled", err)
	}
	if calls := spansNamed(rec.Ended(), "grpc.testing.TestService/FullDuplexCall"); len(calls) != 1 {
		t.Fatalf("%d call spans ended, want 1", len(calls))
	}
}

// A hedged stream that never sent an attempt (its context was over before
// the first) reports no hedges on its call span, not -1.
func TestHedgedStreamWithoutAttemptsReportsNoHedges(t *testing.T) {
	rec, tp := newRecorder()
	srv := testserver.Start(t, &testserver.Server{
		ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
			return ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: payload("0")})
		}})
	c, _ := streamClient(t, srv, WithTracerProvider(tp),
		WithPolicy(policy.Policy{Hedging: policy.Hedging{MaxAttempts: 3}}))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{}); err == nil {
		t.Fatal("a stream opened on a cancelled context")
	}
	calls := spansNamed(rec.Ended(), "grpc.testing.TestService/StreamingOutputCall")
	if len(calls) != 1 {
		t.Fatalf("%d call spans, want 1", len(calls))
	}
	a := attrs(calls[0])
	if v := a[names.AttrHedges]; v.AsInt64() != 0 || a[telemetry.AttrAttempts].AsInt64() != 0 {
		t.Errorf("call span %s = %d, %s = %d; want 0 and 0", names.AttrHedges, v.AsInt64(), telemetry.AttrAttempts, a[telemetry.AttrAttempts].AsInt64())
	}
}

// makesSpans ends the span it starts, as every span must end.
func TestProviderProbeSpanEnds(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()), sdktrace.WithSpanProcessor(rec))
	if !makesSpans(tp.Tracer("")) {
		t.Error("makesSpans = false for an SDK")
	}
	if started, ended := len(rec.Started()), len(rec.Ended()); started != 1 || ended != 1 {
		t.Errorf("makesSpans started %d span(s) and ended %d; want 1 and 1", started, ended)
	}
}

// A call refused for an invalid call option has the status message as its
// span's description, as every other call has, not the error's text.
func TestInvalidCallOptionSpanDescription(t *testing.T) {
	rec, tp := newRecorder()
	_, c, _, _ := setup(t, fail(codes.OK), WithTracerProvider(tp))
	err := call(t, c, CallPolicy(policy.Policy{MaxAttempts: -1}))
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("an invalid CallPolicy: %v, want InvalidArgument", err)
	}
	calls := spansNamed(rec.Ended(), "grpc.testing.TestService/UnaryCall")
	if len(calls) != 1 {
		t.Fatalf("%d call spans, want 1", len(calls))
	}
	if d, want := calls[0].Status().Description, status.Convert(err).Message(); d != want {
		t.Errorf("span status description %q, want the status message %q", d, want)
	}
}
