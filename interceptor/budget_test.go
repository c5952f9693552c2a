package interceptor

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/herdguard/herdguard/telemetry"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/internal/testutil"
	"github.com/herdguard/herdguard/internal/wire"
	"github.com/herdguard/herdguard/policy"
	"google.golang.org/grpc/metadata"
)

func TestThrottlingStopsRetries(t *testing.T) {
	// 10 tokens: each failed attempt takes one; retries stop at 5 or fewer
	srv, c, _, _ := setup(t, fail(codes.Unavailable), WithoutBreaker(),
		WithPolicy(policy.Policy{MaxAttempts: 10, InitialBackoff: ms}),
		WithRetryThrottling(policy.Throttling{MaxTokens: 10, TokenRatio: 0.5}))
	err := call(t, c)
	var re *RetryError
	if !errors.As(err, &re) || re.Outcome != OutcomeBudgetExhausted || status.Code(err) != codes.Unavailable {
		t.Fatalf("err = %v, want a RetryError with outcome budget_exhausted and the last status", err)
	}
	if n := srv.Requests(); n != 5 {
		t.Errorf("server saw %d attempts, want 5 (tokens 9, 8, 7, 6 allow retries; 5 does not)", n)
	}
	// a throttled target refuses the first retry of the next call
	n := srv.Requests()
	call(t, c)
	if d := srv.Requests() - n; d != 1 {
		t.Errorf("next call sent %d attempts, want 1", d)
	}
}

func TestThrottlingRefillsOnSuccess(t *testing.T) {
	sc := &script{}
	srv, c, _, _ := setup(t, sc, WithoutBreaker(), WithPolicy(policy.Policy{MaxAttempts: 2, InitialBackoff: ms}),
		WithRetryThrottling(policy.Throttling{MaxTokens: 4, TokenRatio: 1}))
	sc.errs = []error{status.Error(codes.Unavailable, "x")} // 4 -> 3 tokens: 3 > 2, retry allowed; 2: not
	call(t, c)                                              // tokens 4 -> 3 -> 2
	if n := srv.Requests(); n != 2 {
		t.Fatalf("server saw %d, want 2", n)
	}
	sc.mu.Lock()
	sc.errs, sc.n = []error{nil}, 0
	sc.mu.Unlock()
	call(t, c) // success: 2 -> 3
	call(t, c) // 3 -> 4
	sc.mu.Lock()
	sc.errs, sc.n = []error{status.Error(codes.Unavailable, "x"), nil}, 0
	sc.mu.Unlock()
	if err := call(t, c); err != nil {
		t.Errorf("after successes refilled the bucket a retry must be allowed: %v", err)
	}
}

// TestBudgetUnderConcurrency fires 1000 calls at once at a server that
// fails every first attempt: the budget allows exactly Ratio × calls +
// reserve retries, and the server sees exactly calls + allowed retries.
func TestBudgetUnderConcurrency(t *testing.T) {
	var attempts atomic.Int64
	srv := testserver.Start(t, &testserver.Server{NoRecord: true, Unary: func(ctx context.Context, _ *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
		attempts.Add(1)
		if attemptOf(ctx) == 1 {
			return nil, status.Error(codes.Unavailable, "first attempts fail")
		}
		return &testgrpc.SimpleResponse{}, nil
	}})
	rec, mp := newMetrics()
	// The budget alone: half the attempts fail, which the overload
	// controller would pace.
	ic, err := New(withClock(newFakeClock()), WithoutBreaker(), WithoutOverloadControl(), WithMeterProvider(mp),
		WithPolicy(policy.Policy{MaxAttempts: 3, InitialBackoff: ms}),
		WithRetryBudget(policy.Budget{Ratio: 0.1, MinPerSecond: 1, Window: time.Minute})) // 100 + 60
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, ic.DialOptions()...)
	const calls = 1000
	var ok, refused atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range calls {
		wg.Go(func() {
			<-start
			err := call(t, c)
			var re *RetryError
			switch {
			case err == nil:
				ok.Add(1)
			case errors.As(err, &re) && re.Outcome == OutcomeBudgetExhausted:
				refused.Add(1)
			default:
				t.Errorf("unexpected %v", err)
			}
		})
	}
	close(start)
	wg.Wait()
	// The budget is checked when a call fails, which may be before every
	// call has started: a retry is allowed while retries < 0.1 × calls
	// started so far + 60. It is exact in sum: every call either retried
	// (and succeeded) or was refused.
	if ok.Load()+refused.Load() != calls {
		t.Fatalf("%d ok + %d refused != %d calls", ok.Load(), refused.Load(), calls)
	}
	if got := attempts.Load(); got != calls+ok.Load() {
		t.Errorf("server saw %d attempts, want %d first attempts + %d retries", got, calls, ok.Load())
	}
	if ok.Load() > 160 || ok.Load() < 60 {
		t.Errorf("%d retries allowed, want between the reserve 60 and 0.1 × 1000 + 60", ok.Load())
	}
	if got := sumInt(t, rec, telemetry.MetricBudgetRefusals, nil); got != refused.Load() {
		t.Errorf("refusals metric %d, want %d", got, refused.Load())
	}
}

func newMetrics() (*sdkmetric.ManualReader, *sdkmetric.MeterProvider) {
	r := sdkmetric.NewManualReader()
	return r, sdkmetric.NewMeterProvider(sdkmetric.WithReader(r))
}

// collect returns the named metric's data points.
func collect(t *testing.T, r *sdkmetric.ManualReader, name string) metricdata.Aggregation {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	for _, sm := range rm.ScopeMetrics {
		if sm.Scope.Name != telemetry.ScopeName {
			continue
		}
		for _, m := range sm.Metrics {
			if m.Name == name {
				return m.Data
			}
		}
	}
	return nil
}

// sumInt adds the points of an int64 counter whose attributes include
// every one in want.
func sumInt(t *testing.T, r *sdkmetric.ManualReader, name string, want []attribute.KeyValue) int64 {
	t.Helper()
	data, _ := collect(t, r, name).(metricdata.Sum[int64])
	var n int64
	for _, p := range data.DataPoints {
		match := true
		for _, kv := range want {
			if v, ok := p.Attributes.Value(kv.Key); !ok || v != kv.Value {
				match = false
			}
		}
		if match {
			n += p.Value
		}
	}
	return n
}

func TestMetrics(t *testing.T) {
	rec, mp := newMetrics()
	sc := fail(codes.Unavailable, codes.Unavailable, codes.OK)
	// Without the overload controller, which would pace the refusals
	// below instead of letting the breaker count them.
	_, c, _, _ := setup(t, sc, WithMeterProvider(mp), WithPolicy(tablePolicy), WithBreaker(breaker.Settings{ConsecutiveFailures: 1}), WithoutOverloadControl())
	if err := call(t, c); err != nil {
		t.Fatal(err)
	}
	method := attribute.String("rpc.method", "grpc.testing.TestService/UnaryCall")
	for _, tt := range []struct {
		attrs []attribute.KeyValue
		want  int64
	}{
		{[]attribute.KeyValue{method}, 3},
		{[]attribute.KeyValue{telemetry.AttrRetry.Bool(false)}, 1},
		{[]attribute.KeyValue{telemetry.AttrRetry.Bool(true), attribute.String("rpc.response.status_code", "UNAVAILABLE")}, 1},
		{[]attribute.KeyValue{telemetry.AttrRetry.Bool(true), attribute.String("rpc.response.status_code", "OK")}, 1},
	} {
		if got := sumInt(t, rec, telemetry.MetricAttempts, tt.attrs); got != tt.want {
			t.Errorf("attempts with %v = %d, want %d", tt.attrs, got, tt.want)
		}
	}
	if got := sumInt(t, rec, telemetry.MetricCalls, []attribute.KeyValue{telemetry.AttrOutcome.String("ok")}); got != 1 {
		t.Errorf("ok calls %d, want 1", got)
	}
	hist, _ := collect(t, rec, telemetry.MetricRetryDelay).(metricdata.Histogram[float64])
	if len(hist.DataPoints) != 1 || hist.DataPoints[0].Count != 2 || hist.DataPoints[0].Sum != 0.03 {
		t.Errorf("retry delay %+v, want 2 waits summing to 0.03 s", hist.DataPoints)
	}

	// trip the breaker: one exhausted call, then one refused
	sc.mu.Lock()
	sc.errs, sc.n = []error{status.Error(codes.Unavailable, "down")}, 0
	sc.mu.Unlock()
	call(t, c)
	call(t, c)
	if got := sumInt(t, rec, telemetry.MetricCalls, []attribute.KeyValue{telemetry.AttrOutcome.String("breaker_open")}); got != 1 {
		t.Errorf("breaker_open calls %d, want 1", got)
	}
	if got := sumInt(t, rec, telemetry.MetricBreakerTransitions, []attribute.KeyValue{telemetry.AttrBreakerTo.String("open")}); got != 1 {
		t.Errorf("transitions to open %d, want 1", got)
	}
	gauge, _ := collect(t, rec, telemetry.MetricBreakerState).(metricdata.Gauge[int64])
	if len(gauge.DataPoints) != 1 || gauge.DataPoints[0].Value != 2 {
		t.Errorf("breaker state gauge %+v, want one point of 2 (open)", gauge.DataPoints)
	}
}

// A status code outside gRPC's 17 is counted as UNKNOWN, and all such
// codes share one set of attributes: a server answering with ever new
// numbers does not grow the interceptor's memory.
func TestMetricsUnknownCodes(t *testing.T) {
	var n atomic.Uint32
	srv := testserver.Start(t, &testserver.Server{Unary: func(context.Context, *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
		return nil, status.Error(codes.Code(100+n.Add(1)), "a code of its own")
	}})
	rec, mp := newMetrics()
	ic, err := New(WithMeterProvider(mp), WithoutBreaker(), WithoutOverloadControl(), WithPolicy(policy.Policy{MaxAttempts: 1}))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, ic.DialOptions()...)
	for range 50 {
		if _, err := c.UnaryCall(ctxT(t), &testgrpc.SimpleRequest{}); status.Code(err) < 100 {
			t.Fatalf("call: %v, want the server's own code", err)
		}
	}
	if got := sumInt(t, rec, telemetry.MetricAttempts, []attribute.KeyValue{attribute.String("rpc.response.status_code", "UNKNOWN")}); got != 50 {
		t.Errorf("attempts counted as UNKNOWN: %d, want 50", got)
	}
	if got := ic.metering.attemptOpts.Len(); got != 1 {
		t.Errorf("%d attribute sets kept for 50 unknown codes, want 1", got)
	}
}

func TestMetricsOffCostNothing(t *testing.T) {
	ctx := t.Context()
	ic, err := New(WithoutBreaker())
	if err != nil {
		t.Fatal(err)
	}
	if _, isSet := otel.GetMeterProvider().(*sdkmetric.MeterProvider); !isSet && ic.metering.calls.Enabled(ctx) {
		t.Error("metrics enabled with no SDK behind the global meter provider")
	}
	ic, _ = New(WithMeterProvider(metricnoop.NewMeterProvider()))
	if ic.metering.calls != nil {
		t.Error("instruments made from a no-op meter provider")
	}
	_, mp := newMetrics()
	ic, _ = New(WithMeterProvider(mp))
	if !ic.metering.calls.Enabled(ctx) {
		t.Error("metrics off with an SDK meter provider")
	}
}

func TestNewRejectsBadBudgets(t *testing.T) {
	for _, o := range []Option{
		WithRetryThrottling(policy.Throttling{MaxTokens: 0, TokenRatio: 1}),
		WithRetryBudget(policy.Budget{Ratio: -1}),
		WithHedgeBudget(policy.Budget{Window: time.Millisecond}),
	} {
		if _, err := New(o); err == nil {
			t.Errorf("New accepted a bad budget")
		}
	}
}

// TestBudgetsAllocateNothingPerCall runs the interceptor alone, with both
// budgets on, and counts allocations on the success path.
func TestBudgetsAllocateNothingPerCall(t *testing.T) {
	u, cc := alone(t, WithTracerProvider(noopTP()), WithMeterProvider(noopMP()),
		WithRetryThrottling(policy.Throttling{MaxTokens: 10, TokenRatio: 0.1}),
		WithRetryBudget(policy.Budget{}))
	ctx := context.Background()
	invoked := 0
	nop := func(context.Context, string, any, any, *grpc.ClientConn, ...grpc.CallOption) error {
		invoked++
		return nil
	}
	call := func() {
		if err := u(ctx, testserver.MethodUnary, nil, nil, cc, nop); err != nil {
			t.Fatal(err)
		}
	}
	call() // make the target's breaker and budgets
	if a := testing.AllocsPerRun(200, call); a != 0 {
		t.Errorf("%v allocations per call with budgets on, want 0", a)
	}
	if invoked != 202 { // the first call, AllocsPerRun's warm-up and its 200
		t.Errorf("the invoker ran %d times, want 202: the measured path is not the call's", invoked)
	}
}

func noopTP() trace.TracerProvider { return tracenoop.NewTracerProvider() }
func noopMP() metric.MeterProvider { return metricnoop.NewMeterProvider() }

// TestThrottlingMatchesGRPC: a trailers-only answer with a pushback
// that says stop takes a throttling token even when its code is not
// retryable, as in gRPC. Five of them leave half the tokens of ten, so the
// next retryable failure is not retried, by gRPC's own retry (the control)
// nor by herdguard. The same answer after response headers (the call
// committed) takes none, in gRPC and in herdguard, and the next failure
// is retried in full.
func TestThrottlingMatchesGRPC(t *testing.T) {
	const (
		maxAttempts = 3
		stops       = 5
	)
	trailers := map[string]metadata.MD{
		"negative pushback":                {wire.PushbackKey: {"-1"}},
		"two pushback values":              {wire.PushbackKey: {"10", "20"}},
		"negative pushback, after headers": {wire.PushbackKey: {"-1"}},
	}
	srv := testserver.Start(t, &testserver.Server{Unary: func(ctx context.Context, r *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
		name := string(r.GetPayload().GetBody())
		if md := trailers[name]; md != nil {
			if strings.HasSuffix(name, "after headers") {
				if err := grpc.SendHeader(ctx, metadata.Pairs("request-id", "r1")); err != nil {
					return nil, err
				}
			}
			if err := grpc.SetTrailer(ctx, md); err != nil {
				return nil, err
			}
			return nil, status.Error(codes.Internal, "regress: broken, do not retry")
		}
		return nil, status.Error(codes.Unavailable, "regress: down")
	}})
	for _, name := range []string{"negative pushback", "two pushback values", "negative pushback, after headers"} {
		want := 1 // the stops took half the tokens
		if strings.HasSuffix(name, "after headers") {
			want = maxAttempts // committed: no token taken
		}
		t.Run(name, func(t *testing.T) {
			// lastAttempts makes the stop calls, then one that fails
			// Unavailable, and returns how many attempts the last one made.
			lastAttempts := func(c testgrpc.TestServiceClient) int {
				t.Helper()
				for i := range stops {
					_, err := c.UnaryCall(ctxT(t), &testgrpc.SimpleRequest{Payload: payload(name)})
					if status.Code(err) != codes.Internal {
						t.Fatalf("call %d: got %v, want Internal", i+1, err)
					}
				}
				n := srv.Requests()
				if _, err := c.UnaryCall(ctxT(t), &testgrpc.SimpleRequest{}); status.Code(err) != codes.Unavailable {
					t.Fatalf("last call: got %v, want Unavailable", err)
				}
				return srv.Requests() - n
			}
			ic, err := New(withClock(newFakeClock()), withRand(fixedRand(0.5)), WithoutBreaker(),
				WithPolicy(policy.Policy{MaxAttempts: maxAttempts, RetryableCodes: []codes.Code{codes.Unavailable}}),
				WithRetryThrottling(policy.Throttling{MaxTokens: 10, TokenRatio: 0.1}))
			if err != nil {
				t.Fatal(err)
			}
			got := lastAttempts(srv.Client(t, ic.DialOptions()...))
			control := lastAttempts(srv.Client(t,
				grpc.WithDefaultServiceConfig(grpcRetryConfig(maxAttempts, `{"maxTokens": 10, "tokenRatio": 0.1}`))))
			if control != want {
				t.Errorf("control: gRPC's own retry made %d attempts of the last call, want %d", control, want)
			}
			if got != control {
				t.Errorf("herdguard made %d attempts of the last call, gRPC's own retry %d; want the same", got, control)
			}
		})
	}
}

// TestHedgedThrottlingAfterHeaders: a hedged call takes throttling tokens
// as a retried call does (TestThrottlingMatchesGRPC): a pushback that says
// stop takes one when the answer is trailers-only, and none after response
// headers, which committed the call.
func TestHedgedThrottlingAfterHeaders(t *testing.T) {
	const stops = 5
	for _, headers := range []bool{false, true} {
		t.Run(map[bool]string{false: "trailers only", true: "after headers"}[headers], func(t *testing.T) {
			srv := testserver.Start(t, &testserver.Server{Unary: func(ctx context.Context, _ *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
				if headers {
					if err := grpc.SendHeader(ctx, metadata.Pairs("request-id", "r1")); err != nil {
						return nil, err
					}
				}
				if err := grpc.SetTrailer(ctx, metadata.MD{wire.PushbackKey: {"-1"}}); err != nil {
					return nil, err
				}
				return nil, status.Error(codes.Internal, "regress: broken, do not retry")
			}})
			p := policy.Policy{Hedging: policy.Hedging{MaxAttempts: 3, Delay: time.Hour, NonFatalCodes: []codes.Code{codes.Unavailable}}}
			ic, err := New(withClock(&fakeClock{testutil.NewClock(time.Now(), testutil.Async())}), WithoutBreaker(), WithPolicy(p),
				WithRetryThrottling(policy.Throttling{MaxTokens: 10, TokenRatio: 0.1}))
			if err != nil {
				t.Fatal(err)
			}
			c := srv.Client(t, ic.DialOptions()...)
			for i := range stops {
				if _, err := c.UnaryCall(ctxT(t), &testgrpc.SimpleRequest{}); status.Code(err) != codes.Internal {
					t.Fatalf("call %d: got %v, want Internal", i+1, err)
				}
			}
			want := 10.0 - stops
			if headers {
				want = 10
			}
			if got := ic.limitsFor(testserver.Target).throttle.Tokens(); got != want {
				t.Errorf("throttling tokens after %d stops: %v, want %v", stops, got, want)
			}
			if got := srv.Requests(); got != stops {
				t.Errorf("the server received %d attempts for %d calls, want one each", got, stops)
			}
		})
	}
}

// Two backends behind one interceptor are told apart on a dashboard: every
// call and attempt metric carries the target (herdguard.target, the
// ClientConn's Target()), and no unit translates to a Prometheus suffix
// nobody asked for ("1" becomes "_ratio"; a unit in braces adds none).
func TestMetricsCarryTheTarget(t *testing.T) {
	rec, mp := newMetrics()
	ok := testserver.Start(t, &testserver.Server{Empty: func(context.Context, *testgrpc.Empty) (*testgrpc.Empty, error) { return &testgrpc.Empty{}, nil }})
	missing := testserver.Start(t, &testserver.Server{Unary: fail(codes.NotFound).unary})
	ic, err := New(withClock(newFakeClock()), WithMeterProvider(mp))
	if err != nil {
		t.Fatal(err)
	}
	const a, b = "passthrough:///backend-a", "passthrough:///backend-b"
	ca := testgrpc.NewTestServiceClient(ok.DialTarget(t, a, ic.DialOptions()...))
	cb := testgrpc.NewTestServiceClient(missing.DialTarget(t, b, ic.DialOptions()...))
	for range 2 {
		if _, err := ca.EmptyCall(context.Background(), &testgrpc.Empty{}); err != nil {
			t.Fatalf("backend a: %v", err)
		}
	}
	if err := call(t, cb); status.Code(err) != codes.NotFound {
		t.Fatalf("backend b: %v, want NotFound", err)
	}
	for _, tt := range []struct {
		metric string
		attrs  []attribute.KeyValue
		want   int64
	}{
		{telemetry.MetricCalls, []attribute.KeyValue{telemetry.AttrTarget.String(a), telemetry.AttrOutcome.String(string(OutcomeOK))}, 2},
		{telemetry.MetricCalls, []attribute.KeyValue{telemetry.AttrTarget.String(b), telemetry.AttrOutcome.String(string(OutcomeNotRetryable))}, 1},
		{telemetry.MetricCalls, []attribute.KeyValue{telemetry.AttrTarget.String(b), telemetry.AttrOutcome.String(string(OutcomeOK))}, 0},
		{telemetry.MetricAttempts, []attribute.KeyValue{telemetry.AttrTarget.String(a)}, 2},
		{telemetry.MetricAttempts, []attribute.KeyValue{telemetry.AttrTarget.String(b), attribute.String("rpc.response.status_code", "NOT_FOUND")}, 1},
	} {
		if got := sumInt(t, rec, tt.metric, tt.attrs); got != tt.want {
			t.Errorf("%s with %v = %d, want %d", tt.metric, tt.attrs, got, tt.want)
		}
	}
	var rm metricdata.ResourceMetrics
	if err := rec.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	units := 0
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			units++
			if m.Unit == "1" || m.Unit == "" {
				t.Errorf("%s has unit %q: Prometheus names it with a suffix (or none says what it counts); want a unit in braces or a UCUM unit", m.Name, m.Unit)
			}
		}
	}
	if _, ok := collect(t, rec, telemetry.MetricBreakerState).(metricdata.Gauge[int64]); !ok || units == 0 {
		t.Errorf("%d metrics collected, none the breaker state: the units went unchecked", units)
	}
}
