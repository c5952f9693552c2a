package interceptor

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/herdguard/herdguard/internal/pacing"
	"github.com/herdguard/herdguard/internal/testutil"

	"github.com/herdguard/herdguard/internal/names"
	"github.com/herdguard/herdguard/internal/wire"
	"github.com/herdguard/herdguard/telemetry"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/overload"
	"github.com/herdguard/herdguard/policy"
)

func TestLoadOutcome(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want pacing.Outcome
	}{
		{nil, pacing.Answered},
		{status.Error(codes.NotFound, "no"), pacing.Answered},
		{status.Error(codes.InvalidArgument, "bad"), pacing.Answered},
		{status.Error(codes.Unavailable, "down"), pacing.Overloaded},
		{status.Error(codes.ResourceExhausted, "busy"), pacing.Overloaded},
		{status.Error(codes.DeadlineExceeded, "slow"), pacing.Late},
		{status.Error(codes.ResourceExhausted, "trying to send message larger than max (9 vs. 1)"), pacing.Ignored},
		{status.Error(codes.Canceled, "caller"), pacing.Ignored},
		{quotaExceeded(t), pacing.Ignored},
	} {
		if got := loadOutcome(tc.err); got != tc.want {
			t.Errorf("loadOutcome(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}

// Overload control is on by default and off by option.
func TestOverloadControlDefault(t *testing.T) {
	ic, err := New()
	if err != nil {
		t.Fatal(err)
	}
	if ic.controllerFor("dns:///a") == nil || ic.controllerFor("dns:///a") != ic.controllerFor("dns:///a") {
		t.Error("no controller per target by default")
	}
	ic, err = New(WithoutOverloadControl())
	if err != nil {
		t.Fatal(err)
	}
	if ic.controllerFor("dns:///a") != nil {
		t.Error("a controller with WithoutOverloadControl")
	}
	if _, err := New(WithOverloadControl(overload.Settings{FailureRatio: 2})); err == nil ||
		err.Error() != "herdguard: interceptor: WithOverloadControl: overload: FailureRatio = 2: must be in [0, 1]" {
		t.Errorf("bad settings: %v", err)
	}
}

// overloaded makes a client whose server answers 30 attempts, refuses the
// next n+1 (Unavailable) and then answers, with a controller that starts
// pacing after 3 refusals; it sends those n+31 calls, one attempt each.
// The server collapsed (it answered none of the last n, a run the share it
// failed before cannot explain), so the controller probes only; the last
// call is held for the first probe, which the server refuses. It returns
// the gap to the next probe: with the fixed random number 0.5, the mean
// gap.
func overloaded(t *testing.T, n int, opts ...Option) (*fakeClock, grpc_testing.TestServiceClient, *Interceptor, time.Duration) {
	t.Helper()
	const answers = 30
	codesList := make([]codes.Code, answers+n+2)
	for i := range n + 1 {
		codesList[answers+i] = codes.Unavailable
	}
	sc := fail(codesList...)
	srv := testserver.Start(t, &testserver.Server{Unary: sc.unary,
		ServerStream: func(_ *grpc_testing.StreamingOutputCallRequest, ss grpc_testing.TestService_StreamingOutputCallServer) error {
			return ss.Send(&grpc_testing.StreamingOutputCallResponse{Payload: payload("0")})
		}})
	clk := newFakeClock()
	ic, err := New(append([]Option{withClock(clk), withRand(fixedRand(0.5)), WithoutBreaker(),
		WithPolicy(policy.Policy{MaxAttempts: 1}), WithOverloadControl(overload.Settings{MinFailures: 3})}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, ic.DialOptions()...)
	for range answers {
		if err := call(t, c); err != nil {
			t.Fatalf("scripted answer: %v", err)
		}
	}
	// The answers are counted in a calm Interval of their own, which the
	// first refusal, a Window later, finds leaving the Window: the server
	// fails nothing on its own.
	clk.Advance(overload.DefaultInterval)
	ic.controllerFor(testserver.Target).State()
	clk.Advance(10 * overload.DefaultInterval)
	for range n {
		if err := call(t, c); status.Code(err) != codes.Unavailable {
			t.Fatalf("scripted failure: %v", err)
		}
	}
	ctl := ic.controllerFor(testserver.Target)
	st := ctl.State()
	if !st.Pacing || st.Rate <= 0 {
		t.Fatalf("not probing after the refusals: %+v", st)
	}
	if err := call(t, c); status.Code(err) != codes.Unavailable { // held for the first probe
		t.Fatalf("scripted failure of the first probe: %v", err)
	}
	return clk, c, ic, time.Duration(float64(time.Second) / ctl.State().Rate)
}

// An attempt held back waits for the controller's next token (a probe,
// nextProbe later on the fake clock), is traced as a held span under the
// call and measured, and then goes.
func TestOverloadHoldsAnAttempt(t *testing.T) {
	rec, tp := newRecorder()
	mrec, mp := newMetrics()
	_, c, _, nextProbe := overloaded(t, 3, WithTracerProvider(tp), WithMeterProvider(mp))
	rec.Reset()
	if err := call(t, c); err != nil {
		t.Fatalf("held call: %v", err)
	}
	var held int
	for _, s := range rec.Ended() {
		if s.Name() != telemetry.SpanHeld {
			continue
		}
		held++
		attrs := map[attribute.Key]attribute.Value{}
		for _, kv := range s.Attributes() {
			attrs[kv.Key] = kv.Value
		}
		if attrs[names.AttrHeldMS].AsFloat64() != float64(nextProbe)/float64(time.Millisecond) || attrs[telemetry.AttrAttempt].AsInt64() != 1 || attrs[telemetry.AttrShed].AsBool() {
			t.Errorf("held span attributes %v, want %v before attempt 1, not shed", attrs, nextProbe)
		}
		if !s.Parent().IsValid() {
			t.Error("held span has no parent call span")
		}
	}
	if held != 1 {
		t.Errorf("%d held spans, want 1", held)
	}
	if h, ok := collect(t, mrec, telemetry.MetricOverloadHeld).(metricdata.Histogram[float64]); !ok || len(h.DataPoints) != 1 || h.DataPoints[0].Count != 2 {
		t.Errorf("%s = %+v, want two waits (the first probe's and this call's)", telemetry.MetricOverloadHeld, h)
	}
}

// A waiter whose deadline the controller's rate cannot meet is shed: the
// call fails at once with OutcomeShed, an Unavailable status that says so,
// and nothing is sent. One whose deadline has already passed on the
// controller's clock (its context's timer not yet run) is not shed: it
// fails with DeadlineExceeded, as its context would, and nothing is sent.
func TestOverloadShedsAttempt(t *testing.T) {
	mrec, mp := newMetrics()
	sc := fail(codes.OK)
	clk := newFakeClock()
	var slow atomic.Bool // answers take 400ms on the fake clock
	srv := testserver.Start(t, &testserver.Server{Unary: func(ctx context.Context, req *grpc_testing.SimpleRequest) (*grpc_testing.SimpleResponse, error) {
		if slow.Load() {
			clk.Advance(400 * time.Millisecond)
		}
		return sc.unary(ctx, req)
	}})
	var heldEvents []HeldEvent // OnHeld hears of the shed attempt
	ic, err := New(withClock(clk), withRand(fixedRand(0.5)), WithoutBreaker(), WithMeterProvider(mp),
		WithPolicy(policy.Policy{MaxAttempts: 1}), WithOverloadControl(overload.Settings{MinFailures: 3}),
		WithHooks(Hooks{OnHeld: func(_ context.Context, e HeldEvent) { heldEvents = append(heldEvents, e) }}))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, ic.DialOptions()...)
	// The server sustains 3 per interval for a second, then refuses 4: a
	// run that what it failed before (nothing, of 30) cannot explain.
	for range 30 {
		if err := call(t, c); err != nil {
			t.Fatal(err)
		}
	}
	clk.Advance(time.Second)
	sc.mu.Lock()
	sc.errs, sc.n = []error{status.Error(codes.Unavailable, "1"), status.Error(codes.Unavailable, "2"), status.Error(codes.Unavailable, "3"), status.Error(codes.Unavailable, "4"), nil}, 0
	sc.mu.Unlock()
	for i := range 4 {
		if err := call(t, c); status.Code(err) != codes.Unavailable {
			t.Fatalf("scripted refusal %d: %v, want Unavailable", i+1, err)
		}
	}
	if err := call(t, c); err != nil { // held for the probe; its answer restarts the rate at 3
		t.Fatalf("probe call: %v", err)
	}
	ctl := ic.controllerFor(testserver.Target)
	sent := len(srv.Attempts())

	// The fake clock runs ahead of real time: a real deadline one second
	// away is already past on it.
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if _, err := c.UnaryCall(ctx, &grpc_testing.SimpleRequest{}); status.Code(err) != codes.DeadlineExceeded || ctx.Err() != nil {
		t.Fatalf("a call past its deadline on the controller's clock: %v (its context: %v), want DeadlineExceeded before its context ended", err, ctx.Err())
	}
	if got := len(srv.Attempts()); got != sent {
		t.Errorf("%d attempts reached the server for a call past its deadline", got-sent)
	}
	if st := ctl.State(); st.Shed != 0 {
		t.Errorf("controller shed %d for a deadline that passed, want 0", st.Shed)
	}

	// An answer that took 400ms, in the interval before: a call with
	// 200ms left cannot be answered in time.
	slow.Store(true)
	ctx, cancel = context.WithDeadline(context.Background(), clk.Now().Add(2*time.Second))
	defer cancel()
	if _, err := c.UnaryCall(ctx, &grpc_testing.SimpleRequest{}); err != nil {
		t.Fatalf("the slow answer: %v", err)
	}
	slow.Store(false)
	clk.Advance(overload.DefaultInterval)
	sent = len(srv.Attempts())
	ctx, cancel = context.WithDeadline(context.Background(), clk.Now().Add(200*time.Millisecond))
	defer cancel()
	_, err = c.UnaryCall(ctx, &grpc_testing.SimpleRequest{})
	var re *RetryError
	if !errors.As(err, &re) || re.Outcome != OutcomeShed || re.Attempts != 0 || status.Code(err) != codes.Unavailable {
		t.Fatalf("shed call: %v, want a RetryError with OutcomeShed, 0 attempts, Unavailable", err)
	}
	if msg := status.Convert(err).Message(); msg != pacing.ErrShed.Error() {
		t.Errorf("the shed call's status says %q, want %q: one prefix", msg, pacing.ErrShed.Error())
	}
	if got := len(srv.Attempts()); got != sent {
		t.Errorf("%d attempts reached the server for a shed call", got-sent)
	}
	if st := ctl.State(); st.Shed != 1 {
		t.Errorf("controller shed %d, want 1", st.Shed)
	}
	if n := sumInt(t, mrec, telemetry.MetricCalls, []attribute.KeyValue{telemetry.AttrOutcome.String(string(OutcomeShed))}); n != 1 {
		t.Errorf("calls with outcome shed = %d, want 1", n)
	}
	// OnHeld heard of each attempt held back (the two held for their
	// token, the one whose deadline passed in line), and last of the shed
	// one.
	if want := (HeldEvent{Method: testserver.MethodUnary, Target: testserver.Target, Attempt: 1, Shed: true}); len(heldEvents) != 4 || heldEvents[3] != want ||
		heldEvents[0].Held <= 0 || heldEvents[0].Shed || slices.ContainsFunc(heldEvents[:3], func(e HeldEvent) bool { return e.Shed }) {
		t.Errorf("OnHeld heard %+v, want 3 attempts held, not shed, then %+v", heldEvents, want)
	}
}

// Streams ask the controller too: a stream opened while the controller
// paces is held for its token, then works. Its attempt records when it
// asked and when it went, which a time-out at its deadline is judged by
// (TestOverloadTimeoutAtTheEdgeOfItsDeadline); one opened while calm reads
// no clock.
func TestOverloadHoldsAStream(t *testing.T) {
	rec, tp := newRecorder()
	clk, c, ic, nextProbe := overloaded(t, 3, WithTracerProvider(tp))
	rec.Reset()
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	s, err := c.StreamingOutputCall(ctx, &grpc_testing.StreamingOutputCallRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if !ic.controllerFor(testserver.Target).Pacing() {
		t.Fatal("the controller stopped pacing")
	}
	// Held for the next probe's token.
	if asked, sent := attemptTimes(t, s); !sent.Equal(clk.Now()) || sent.Sub(asked) != nextProbe {
		t.Errorf("paced stream's attempt: asked %v, sent %v (the clock now %v); want it sent now, held %v",
			asked, sent, clk.Now(), nextProbe)
	}
	srv := testserver.Start(t, &testserver.Server{ServerStream: func(_ *grpc_testing.StreamingOutputCallRequest, ss grpc_testing.TestService_StreamingOutputCallServer) error {
		return nil
	}})
	calm, err := New(withClock(clk), WithoutBreaker())
	if err != nil {
		t.Fatal(err)
	}
	cs, err := srv.Client(t, calm.DialOptions()...).StreamingOutputCall(ctx, &grpc_testing.StreamingOutputCallRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if asked, sent := attemptTimes(t, cs); !asked.IsZero() || !sent.IsZero() {
		t.Errorf("calm stream's attempt: asked %v, sent %v; want neither read", asked, sent)
	}
	if _, err := recvAll(cs.Recv); err != nil {
		t.Fatalf("calm stream: %v", err)
	}
	if _, err := recvAll(s.Recv); err != nil {
		t.Fatalf("held stream: %v", err)
	}
	held := 0
	for _, sp := range rec.Ended() {
		if sp.Name() == telemetry.SpanHeld {
			held++
		}
	}
	if held != 1 {
		t.Errorf("%d held spans for the stream, want 1", held)
	}
}

// No hedge is sent while the controller paces the target.
func TestOverloadStopsHedges(t *testing.T) {
	ctl, err := pacing.New(overload.Settings{MinFailures: 1}, pacing.Env{})
	if err != nil {
		t.Fatal(err)
	}
	ic, err := New()
	if err != nil {
		t.Fatal(err)
	}
	r := hedgeRules{max: 3, hedges: ic.hedgeBudget("t"), ctl: ctl}
	if got := r.refusal(); got != "" {
		t.Fatalf("calm: refusal %q", got)
	}
	for range 4 { // at MinFailures 1, four attempts are enough evidence for a fresh client
		ctl.Done(pacing.Overloaded, 0)
	}
	if got := r.refusal(); got != "overload" {
		t.Errorf("pacing: refusal %q, want overload", got)
	}
}

// While the controller paces, a retry after a refusal for load waits in its
// line, behind everyone, instead of a backoff: no backoff span, a held span
// for the retry.
func TestOverloadRetryWaitsInLine(t *testing.T) {
	rec, tp := newRecorder()
	_, c, clk, _ := setup(t, fail(codes.OK, codes.Unavailable, codes.Unavailable, codes.Unavailable, codes.Unavailable, codes.Unavailable, codes.OK),
		WithoutBreaker(), WithTracerProvider(tp), WithOverloadControl(overload.Settings{MinFailures: 3}),
		WithPolicy(policy.Policy{MaxAttempts: 2}))
	one := CallPolicy(policy.Policy{MaxAttempts: 1})
	if err := call(t, c); err != nil { // a server that answered: overloaded, not down
		t.Fatal(err)
	}
	clk.Advance(overload.DefaultInterval)
	for range 4 { // 3 start the pacing, and the first probe, sent at once
		if err := call(t, c, one); status.Code(err) != codes.Unavailable {
			t.Fatalf("scripted failure: %v", err)
		}
	}
	rec.Reset()
	if err := call(t, c); err != nil {
		t.Fatalf("call retried in line: %v", err)
	}
	var held []int64
	for _, s := range rec.Ended() {
		switch s.Name() {
		case telemetry.SpanBackoff:
			t.Error("a backoff span while the controller paces")
		case telemetry.SpanHeld:
			for _, kv := range s.Attributes() {
				if kv.Key == telemetry.AttrAttempt {
					held = append(held, kv.Value.AsInt64())
				}
			}
		}
	}
	if !slices.Equal(held, []int64{1, 2}) {
		t.Errorf("held spans for attempts %v, want [1 2]", held)
	}
}

// A retry at the back of the controller's line that goes at once has its
// held span all the same, as the wait it had in place of its backoff: in
// a trace every retry follows a wait. A first attempt that goes at once
// has none.
func TestOverloadRetryInLineAtOnceIsTraced(t *testing.T) {
	ctl, clk := pacedController(t)
	ctl.Done(pacing.Answered, time.Millisecond) // the restart: a rate, and a token a second later
	clk.Skip(time.Second)
	if !ctl.Pacing() {
		t.Fatal("not pacing")
	}
	rec, tp := newRecorder()
	mrec, mp := newMetrics()
	ic, err := New(WithMeterProvider(mp))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := ic.take(ctx, tp.Tracer("test"), ctl, "/s/M", "passthrough:///t", 2, pacing.Back, new(ticket)); err != nil {
		t.Fatalf("retry in line: %v", err)
	}
	clk.Skip(time.Minute)
	if err := ic.take(ctx, tp.Tracer("test"), ctl, "/s/M", "passthrough:///t", 1, pacing.Fresh, new(ticket)); err != nil {
		t.Fatalf("first attempt: %v", err)
	}
	var spans []string
	for _, s := range rec.Ended() {
		a := attrs(s)
		spans = append(spans, fmt.Sprintf("%s %d %v", s.Name(), a[telemetry.AttrAttempt].AsInt64(), a[names.AttrHeldMS].AsFloat64()))
	}
	if want := []string{"held 2 0"}; !slices.Equal(spans, want) {
		t.Errorf("spans %q, want %q: the retry's wait of none, nothing for the first attempt", spans, want)
	}
	if h, ok := collect(t, mrec, telemetry.MetricOverloadHeld).(metricdata.Histogram[float64]); ok && len(h.DataPoints) > 0 {
		t.Errorf("%s = %+v, want no attempt counted as delayed", telemetry.MetricOverloadHeld, h)
	}
}

// The controller's state is in the metrics: its pace while it paces, its
// line, and the attempts it delayed.
func TestOverloadMetrics(t *testing.T) {
	mrec, mp := newMetrics()
	_, c, _, nextProbe := overloaded(t, 3, WithMeterProvider(mp))
	rate, ok := collect(t, mrec, telemetry.MetricOverloadRate).(metricdata.Gauge[float64])
	if want := float64(time.Second) / float64(nextProbe); !ok || len(rate.DataPoints) != 1 || math.Abs(rate.DataPoints[0].Value-want) > 1e-6*want {
		t.Fatalf("%s = %+v, want one target at a probe per %v (%v/s)", telemetry.MetricOverloadRate, rate, nextProbe, want)
	}
	if v, _ := rate.DataPoints[0].Attributes.Value(telemetry.AttrTarget); v.AsString() != testserver.Target {
		t.Errorf("rate's target = %q, want %q", v.AsString(), testserver.Target)
	}
	if err := call(t, c); err != nil { // held for the probe
		t.Fatal(err)
	}
	delayed, ok := collect(t, mrec, telemetry.MetricOverloadDelayed).(metricdata.Sum[int64])
	if !ok || len(delayed.DataPoints) != 1 || delayed.DataPoints[0].Value != 2 {
		t.Errorf("%s = %+v, want 2 (two probes)", telemetry.MetricOverloadDelayed, delayed)
	}
	waiting, ok := collect(t, mrec, telemetry.MetricOverloadWaiting).(metricdata.Gauge[int64])
	if !ok || len(waiting.DataPoints) != 1 || waiting.DataPoints[0].Value != 0 {
		t.Errorf("%s = %+v, want 0", telemetry.MetricOverloadWaiting, waiting)
	}
	if shed, ok := collect(t, mrec, telemetry.MetricOverloadShed).(metricdata.Sum[int64]); !ok || len(shed.DataPoints) != 1 || shed.DataPoints[0].Value != 0 {
		t.Errorf("%s = %+v, want 0", telemetry.MetricOverloadShed, shed)
	}
}

// Finding a target's controller allocates nothing, even for an interceptor
// that alternates between targets (the one-entry cache misses every time).
func TestControllerLookupAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector adds allocations")
	}
	ic, err := New()
	if err != nil {
		t.Fatal(err)
	}
	a, b := ic.controllerFor("dns:///a"), ic.controllerFor("dns:///b")
	allocs := testing.AllocsPerRun(100, func() {
		if ic.controllerFor("dns:///a") != a || ic.controllerFor("dns:///b") != b {
			t.Fatal("a target's controller changed")
		}
	})
	if allocs != 0 {
		t.Errorf("%v allocations per two lookups, want 0", allocs)
	}
}

// While the controller paces, the interceptor tells it how long answers
// take, for plain and hedged calls: after answers that took 400ms, a call
// with 200ms left is shed without being sent, and one with 2s goes.
func TestOverloadLearnsAnswerTimes(t *testing.T) {
	for _, tc := range []struct {
		name string
		p    policy.Policy
	}{
		{"retry", policy.Policy{MaxAttempts: 1}},
		{"hedging", policy.Policy{Hedging: policy.Hedging{MaxAttempts: 2, Delay: time.Second}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := newFakeClock()
			sc := fail(codes.OK, codes.Unavailable, codes.Unavailable, codes.Unavailable, codes.OK)
			var slow atomic.Bool // answers take 400ms once pacing began
			srv := testserver.Start(t, &testserver.Server{Unary: func(ctx context.Context, req *grpc_testing.SimpleRequest) (*grpc_testing.SimpleResponse, error) {
				r, err := sc.unary(ctx, req)
				if err == nil && slow.Load() {
					clk.Advance(400 * time.Millisecond) // a slow answer, on the interceptor's clock
				}
				return r, err
			}})
			ic, err := New(withClock(clk), withRand(fixedRand(0.5)), WithoutBreaker(),
				// Calm: the fake clock runs every hedge timer at once, and
				// pacing must outlast the seconds that adds.
				WithPolicy(tc.p), WithOverloadControl(overload.Settings{MinFailures: 3, Calm: 100}))
			if err != nil {
				t.Fatal(err)
			}
			c := srv.Client(t, ic.DialOptions()...)
			one := CallPolicy(policy.Policy{MaxAttempts: 1})
			if err := call(t, c, one); err != nil { // a server that answered: overloaded, not down
				t.Fatal(err)
			}
			clk.Advance(overload.DefaultInterval)
			for range 3 {
				if err := call(t, c, one); status.Code(err) != codes.Unavailable {
					t.Fatalf("scripted failure: %v", err)
				}
			}
			slow.Store(true)
			// The probe and two more: intervals with answers. No hedge
			// goes while the controller paces.
			for i := range 3 {
				if err := call(t, c); err != nil {
					t.Fatalf("answer %d: %v", i, err)
				}
			}
			wantShedThenSent(t, srv, c, clk)
		})
	}
}

// wantShedThenSent checks, after answers that took 400ms, that a call with
// 200ms left is shed without being sent, and that one with 2s goes.
func wantShedThenSent(t *testing.T, srv *testserver.Server, c grpc_testing.TestServiceClient, clk *fakeClock) {
	t.Helper()
	sent := len(srv.Attempts())
	ctx, cancel := context.WithDeadline(context.Background(), clk.Now().Add(200*time.Millisecond))
	defer cancel()
	_, err := c.UnaryCall(ctx, &grpc_testing.SimpleRequest{})
	var re *RetryError
	if !errors.As(err, &re) || re.Outcome != OutcomeShed || len(srv.Attempts()) != sent {
		t.Fatalf("200ms left, answers take 400ms: %v, %d attempts sent; want it shed, none sent", err, len(srv.Attempts())-sent)
	}
	ctx, cancel = context.WithDeadline(context.Background(), clk.Now().Add(2*time.Second))
	defer cancel()
	if _, err := c.UnaryCall(ctx, &grpc_testing.SimpleRequest{}); err != nil {
		t.Fatalf("2s left: %v", err)
	}
}

// A stream the server answered, ended by its caller's deadline (a watch
// that lives until then), says nothing of the server's load: many such
// ends at once must not start pacing a healthy target.
func TestOverloadAnsweredStreamsEndingAtTheirDeadline(t *testing.T) {
	for _, tc := range []struct {
		name    string
		message bool // the server sends a message, or headers alone
	}{{"a message", true}, {"headers alone", false}} {
		t.Run(tc.name, func(t *testing.T) {
			srv := testserver.Start(t, &testserver.Server{ServerStream: func(_ *grpc_testing.StreamingOutputCallRequest, ss grpc_testing.TestService_StreamingOutputCallServer) error {
				var err error
				if tc.message {
					err = ss.Send(&grpc_testing.StreamingOutputCallResponse{Payload: payload("hello")})
				} else {
					err = ss.SendHeader(metadata.Pairs("watch", "on"))
				}
				if err != nil {
					return err
				}
				<-ss.Context().Done()
				return status.FromContextError(ss.Context().Err()).Err()
			}})
			ic, err := New()
			if err != nil {
				t.Fatal(err)
			}
			c := srv.Client(t, ic.DialOptions()...)
			// Twice the controller's MinFailures, ending together.
			deadline := time.Now().Add(500 * time.Millisecond)
			var wg sync.WaitGroup
			for range 2 * overload.DefaultMinFailures {
				wg.Go(func() {
					ctx, cancel := context.WithDeadline(context.Background(), deadline)
					defer cancel()
					s, err := c.StreamingOutputCall(ctx, &grpc_testing.StreamingOutputCallRequest{})
					if err != nil {
						t.Error(err)
						return
					}
					if tc.message {
						if _, err := s.Recv(); err != nil {
							t.Error("first message:", err)
							return
						}
					}
					if _, err := s.Recv(); status.Code(err) != codes.DeadlineExceeded {
						t.Error("the stream's end:", err)
					}
				})
			}
			wg.Wait()
			if st := ic.controllerFor(testserver.Target).State(); st.Pacing || st.Episodes != 0 {
				t.Errorf("the controller paces a target that answered every stream: %+v", st)
			}
		})
	}
}

// An attempt whose caller's deadline had passed before it went out was
// never sent (gRPC fails it at once): it says nothing of the server's load,
// however many come at once (a server passing down its own expired
// deadline), and must not start pacing a healthy target.
func TestOverloadNeverSentSaysNothing(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{Unary: func(context.Context, *grpc_testing.SimpleRequest) (*grpc_testing.SimpleResponse, error) {
		return &grpc_testing.SimpleResponse{}, nil
	}})
	ic, err := New(WithoutBreaker())
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, ic.DialOptions()...)
	if _, err := c.UnaryCall(ctxT(t), &grpc_testing.SimpleRequest{}); err != nil {
		t.Fatal(err)
	}
	before := srv.Requests()
	for range 2 * overload.DefaultMinFailures {
		ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
		_, err := c.UnaryCall(ctx, &grpc_testing.SimpleRequest{})
		if status.Code(err) != codes.DeadlineExceeded {
			t.Errorf("unary with a past deadline: %v", err)
		}
		s, err := c.StreamingOutputCall(ctx, &grpc_testing.StreamingOutputCallRequest{})
		if err == nil {
			_, err = s.Recv()
		}
		if status.Code(err) != codes.DeadlineExceeded {
			t.Errorf("stream with a past deadline: %v", err)
		}
		cancel()
	}
	if n := srv.Requests() - before; n != 0 {
		t.Fatalf("%d requests reached the server; the test needs none", n)
	}
	if st := ic.controllerFor(testserver.Target).State(); st.Pacing || st.Episodes != 0 {
		t.Errorf("the controller paces a healthy target after calls that were never sent: %+v", st)
	}
}

// An attempt that the controller's line held until its caller had less
// time left than it had waited, and whose call's deadline then passed in
// flight, is no overload signal: the line spent the call's time, not the
// server (served by deadline, it sends callers at the edge of their
// deadlines). One that timed out with its time ahead of it is Late, and
// one that ran out of its own PerAttemptTimeout is no time-out at the
// call's deadline at all (the usual outcome, a refusal, applies).
//
// The server's DeadlineExceeded may come before the context's own timer
// has run (live): within a millisecond of the deadline it is the caller's
// deadline all the same; with more time left it is the server's own
// time-out, told as any refusal.
func TestOverloadTimeoutAtTheEdgeOfItsDeadline(t *testing.T) {
	expired, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Millisecond))
	defer cancel()
	timedOut := status.Error(codes.DeadlineExceeded, context.DeadlineExceeded.Error())
	for _, tc := range []struct {
		name       string
		held, left time.Duration
		perAttempt bool
		// live: the context's timer has not run yet, and the answer
		// comes after the attempt (sent with left) was out for inFlight.
		live     bool
		inFlight time.Duration
		// want is the outcome told the controller for a time-out at the
		// call's deadline; atDeadline false: it is none.
		want       pacing.Outcome
		atDeadline bool
	}{
		{"with its time ahead", 10 * time.Millisecond, time.Second, false, false, 0, pacing.Late, true},
		{"held as long as it had left", 300 * time.Millisecond, 300 * time.Millisecond, false, false, 0, pacing.Late, true},
		{"held past its time", 1900 * time.Millisecond, 100 * time.Millisecond, false, false, 0, pacing.Ignored, true},
		{"its own per-attempt timeout", 1900 * time.Millisecond, 100 * time.Millisecond, true, false, 0, pacing.Ignored, false},
		{"held past its time, the server's timer first", 1900 * time.Millisecond, 3 * time.Millisecond, false, true, 2500 * time.Microsecond, pacing.Ignored, true},
		{"held past its time, the server's own time-out", 1900 * time.Millisecond, 3 * time.Millisecond, false, true, 1500 * time.Microsecond, pacing.Ignored, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := newFakeClock()
			sent := clk.Now()
			ended := context.Context(expired)
			if tc.live {
				ended = context.Background()
			}
			ctx, asked := fakeDeadline{ended, sent.Add(tc.left)}, sent.Add(-tc.held)
			clk.Advance(tc.inFlight)
			o, ok := timeoutOutcome(ctx, timedOut, tc.perAttempt, sent.Sub(asked), sent, clk)
			if ok != tc.atDeadline || ok && o != tc.want {
				t.Errorf("timeoutOutcome = %v, %v; want %v, %v", o, ok, tc.want, tc.atDeadline)
			}
		})
	}
}

// fakeDeadline is a context with the deadline at, of the fake clock: one
// that has ended at its deadline, or one whose timer has not run yet.
type fakeDeadline struct {
	context.Context // ended by its deadline, or not yet
	at              time.Time
}

func (c fakeDeadline) Deadline() (time.Time, bool) { return c.at, true }

// attemptTimes returns when the current attempt of stream cs, made by
// herdguard's interceptor, asked the overload controller and when it went.
func attemptTimes(t *testing.T, cs grpc_testing.TestService_StreamingOutputCallClient) (asked, sent time.Time) {
	t.Helper()
	g, ok := cs.(*grpc.GenericClientStream[grpc_testing.StreamingOutputCallRequest, grpc_testing.StreamingOutputCallResponse])
	if !ok {
		t.Fatalf("stream %T is not gRPC's generated one", cs)
	}
	rs, ok := g.ClientStream.(*clientStream)
	if !ok {
		t.Fatalf("stream %T is not herdguard's", cs)
	}
	rs.mu.Lock()
	defer rs.mu.Unlock()
	return rs.a.ticket.sent.Add(-rs.a.ticket.held), rs.a.ticket.sent
}

// A server that refuses a share of a wave at once and answers the rest a
// little later shows the client only refusals at first. They are judged
// against the attempts sent: 30 refusals of 100 are no overload, though
// they came back before any answer. Before, the default controller started
// pacing at the 20th refusal (every answer so far), and a fresh client of
// a server failing 30 % of its attempts on its own held its next calls.
func TestOverloadRefusalsAheadOfAnswers(t *testing.T) {
	const calls, refused = 100, 30
	for _, kind := range []string{"unary", "hedged unary", "server stream"} {
		t.Run(kind, func(t *testing.T) {
			var mu sync.Mutex
			seen := 0
			release := make(chan struct{})
			// 3 of every 10 arrivals are refused at once; the others
			// wait for release.
			refuse := func() bool {
				mu.Lock()
				defer mu.Unlock()
				seen++
				return seen%10 < 3
			}
			srv := testserver.Start(t, &testserver.Server{
				Unary: func(ctx context.Context, _ *grpc_testing.SimpleRequest) (*grpc_testing.SimpleResponse, error) {
					if refuse() {
						return nil, status.Error(codes.Unavailable, "shed")
					}
					<-release
					return &grpc_testing.SimpleResponse{}, nil
				},
				ServerStream: func(_ *grpc_testing.StreamingOutputCallRequest, ss grpc_testing.TestService_StreamingOutputCallServer) error {
					if refuse() {
						return status.Error(codes.Unavailable, "shed")
					}
					<-release
					return ss.Send(&grpc_testing.StreamingOutputCallResponse{Payload: payload("0")})
				}})
			opts := []Option{withClock(newFakeClock()), WithoutBreaker(), WithPolicy(policy.Policy{MaxAttempts: 1})}
			if kind == "hedged unary" {
				// Real time, as the fake clock fires timers at once: no
				// hedge goes within the test, and a refusal decides.
				opts = []Option{WithoutBreaker(), WithPolicy(policy.Policy{Hedging: policy.Hedging{
					MaxAttempts: 2, Delay: time.Hour, NonFatalCodes: []codes.Code{codes.Aborted}}})}
			}
			ic, err := New(opts...)
			if err != nil {
				t.Fatal(err)
			}
			c := srv.Client(t, ic.DialOptions()...)
			errs := make(chan error, calls)
			var wg sync.WaitGroup
			for range calls {
				wg.Go(func() {
					ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
					defer cancel()
					if kind != "server stream" {
						_, err := c.UnaryCall(ctx, &grpc_testing.SimpleRequest{})
						errs <- err
						return
					}
					errs <- firstMessage(ctx, c)
				})
			}
			for range refused {
				if err := <-errs; status.Code(err) != codes.Unavailable {
					t.Fatalf("before any answer: %v, want the refusals", err)
				}
			}
			ctl := ic.controllerFor(testserver.Target)
			if ctl.Pacing() {
				t.Errorf("pacing after %d refusals of %d attempts sent", refused, calls)
			}
			close(release)
			wg.Wait()
			close(errs)
			for err := range errs {
				if err != nil {
					t.Errorf("an answer: %v", err)
				}
			}
			if st := ctl.State(); st.Pacing || st.Episodes != 0 {
				t.Errorf("after the answers: %+v", st)
			}
		})
	}
}

// TestOverloadHedgesCountAsSent: a hedged stream's hedges count as attempts
// sent while calm, as its first attempt does. 50 streams whose first
// attempts the server holds, and whose hedges it refuses at once: 50
// refusals of 100 attempts sent, no overload. Counted against the first
// attempts alone, the refusals were every attempt, and the pacing started.
func TestOverloadHedgesCountAsSent(t *testing.T) {
	const streams = 50
	release := make(chan struct{})
	srv := testserver.Start(t, &testserver.Server{
		ServerStream: func(_ *grpc_testing.StreamingOutputCallRequest, ss grpc_testing.TestService_StreamingOutputCallServer) error {
			md, _ := metadata.FromIncomingContext(ss.Context())
			if len(md.Get(wire.AttemptKey)) > 0 {
				return status.Error(codes.Unavailable, "shed")
			}
			select { // the hedge's refusal cancels it
			case <-release:
			case <-ss.Context().Done():
			}
			return nil
		}})
	// The fake clock fires the hedging delay's timer at once.
	ic, err := New(withClock(newFakeClock()), WithoutBreaker(), WithPolicy(policy.Policy{Hedging: policy.Hedging{
		MaxAttempts: 2, Delay: 100 * time.Microsecond}}), WithHedgeBudget(policy.Budget{MinPerSecond: 2 * streams / 10}))
	if err != nil {
		t.Fatal(err)
	}
	defer close(release)
	c := srv.Client(t, ic.DialOptions()...)
	errs := make(chan error, streams)
	var wg sync.WaitGroup
	for range streams {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
			defer cancel()
			errs <- firstMessage(ctx, c)
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs { // a hedge's refusal is fatal: the stream ends with it
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("a stream: %v, want its hedge's refusal", err)
		}
	}
	if got := srv.Requests(); got != 2*streams {
		t.Fatalf("%d attempts arrived, want %d", got, 2*streams)
	}
	if st := ic.controllerFor(testserver.Target).State(); st.Pacing || st.Episodes != 0 {
		t.Errorf("after %d refused hedges of %d attempts sent: %+v", streams, 2*streams, st)
	}
}

// firstMessage opens a server stream and receives its first message.
func firstMessage(ctx context.Context, c grpc_testing.TestServiceClient) error {
	s, err := c.StreamingOutputCall(ctx, &grpc_testing.StreamingOutputCallRequest{})
	if err == nil {
		_, err = s.Recv()
	}
	return err
}

// A retry whose wait the server set (a pushback) waits as told, not in
// the controller's line; a retry of an attempt refused for load waits in
// the line while the controller paces. The decision says which by a typed
// field, whatever the wait's name in the span.
func TestInLineLeavesPushbacksToTheServer(t *testing.T) {
	ctl, _ := pacedController(t)
	if !ctl.Pacing() {
		t.Fatal("not pacing")
	}
	refused := status.Error(codes.Unavailable, "overloaded")
	for _, tt := range []struct {
		name string
		d    decision
		err  error
		want bool
	}{
		{"backoff after a refusal", decision{retry: true, jitter: "full"}, refused, true},
		{"pushback after a refusal", decision{retry: true, pushback: true, jitter: "pushback"}, refused, false},
		{"a pushback whatever its name", decision{retry: true, pushback: true, jitter: "full"}, refused, false},
		{"backoff after an answer", decision{retry: true, jitter: "full"}, status.Error(codes.Internal, "bug"), false},
		{"backoff after a caller's quota ran out", decision{retry: true, jitter: "full"}, quotaExceeded(t), false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := inLine(ctl, tt.d, tt.err); got != tt.want {
				t.Errorf("inLine = %v, want %v", got, tt.want)
			}
		})
	}
	if inLine(nil, decision{retry: true}, refused) {
		t.Error("inLine without a controller = true, want false")
	}
}

// pacedController returns a controller on a fake clock whose timers fire
// only when the test advances it (it skips time), with MinFailures 1, that
// four refusals have started pacing (collapsed: probes only, the first at
// a mean gap, at the random source's 0.5).
func pacedController(t *testing.T) (*pacing.Controller, *testutil.Clock) {
	t.Helper()
	clk := testutil.NewClock(time.Unix(1_700_000_000, 0))
	ctl, err := pacing.New(overload.Settings{MinFailures: 1}, pacing.Env{Clock: clk, Rand: func() float64 { return 0.5 }})
	if err != nil {
		t.Fatal(err)
	}
	for range 4 { // at MinFailures 1, four refusals start the pacing
		if _, err := ctl.Acquire(context.Background(), pacing.Aside); err != nil {
			t.Fatal(err)
		}
		ctl.Done(pacing.Overloaded, 0)
	}
	return ctl, clk
}

// Every attempt, a unary call's, a stream's or a hedge's, tells the
// controller what its end says of the server's load through one
// classification (ticket.outcome): what each kind of end tells, and how
// long an answer took.
func TestTicketOutcome(t *testing.T) {
	ctl, clk := pacedController(t)
	expired, cancel := context.WithDeadline(context.Background(), clk.Now().Add(-time.Millisecond))
	defer cancel()
	var (
		refused  = status.Error(codes.Unavailable, "overloaded")
		timedOut = status.Error(codes.DeadlineExceeded, context.DeadlineExceeded.Error())
		gaveUp   = metadata.MD{wire.GaveUpKey: {"1"}, wire.PushbackKey: {"-1"}}
		held     = metadata.MD{wire.HeldBelowKey: {"1"}}
		sent     = clk.Now().Add(-30 * time.Millisecond)
		calm     = ticket{ctl: ctl, live: true}
		paced    = ticket{ctl: ctl, live: true, held: time.Millisecond, sent: sent}
	)
	for _, tc := range []struct {
		name string
		t    ticket
		ctx  context.Context
		e    attemptEnd
		want pacing.Outcome
		took time.Duration
		ok   bool // false: it tells nothing
	}{
		{"no controller", ticket{live: true}, nil, attemptEnd{err: refused}, pacing.Ignored, 0, false},
		{"never went out", ticket{ctl: ctl}, nil, attemptEnd{err: refused}, pacing.Ignored, 0, false},
		{"an answer while calm", calm, nil, attemptEnd{}, pacing.Answered, 0, true},
		{"an answer while pacing, timed", paced, nil, attemptEnd{}, pacing.Answered, 30 * time.Millisecond, true},
		{"a stream's answer while pacing, untimed", ticket{ctl: ctl, live: true, sent: sent, untimed: true}, nil, attemptEnd{}, pacing.Answered, 0, true},
		{"an answer held below", paced, nil, attemptEnd{trailer: held}, pacing.HeldBelow, 0, true},
		{"a refusal", calm, nil, attemptEnd{err: refused}, pacing.Overloaded, 0, true},
		{"a refusal with a trailer held below", calm, nil, attemptEnd{err: refused, trailer: held}, pacing.Overloaded, 0, true},
		{"an answer with another code", calm, nil, attemptEnd{err: status.Error(codes.NotFound, "no")}, pacing.Answered, 0, true},
		{"the caller's cancellation", calm, nil, attemptEnd{err: status.Error(codes.Canceled, "cancelled")}, pacing.Ignored, 0, true},
		{"a caller's quota ran out", calm, nil, attemptEnd{err: quotaExceeded(t)}, pacing.Ignored, 0, true},
		{"a give-up below, in the trailer", calm, nil, attemptEnd{err: refused, trailer: gaveUp}, pacing.Below, 0, true},
		{"a give-up below, read before the end", calm, nil, attemptEnd{err: refused, gaveUpBelow: true}, pacing.Below, 0, true},
		{"a stream answered, then its deadline", paced, expired, attemptEnd{err: timedOut, answered: true}, pacing.Answered, 0, true},
		{"an idle stream at its deadline", paced, expired, attemptEnd{err: timedOut, idle: true}, pacing.Ignored, 0, true},
		{"in flight at the call's deadline", paced, fakeDeadline{expired, sent.Add(time.Second)}, attemptEnd{err: timedOut}, pacing.Late, 0, true},
		{"in line longer than it then had left", paced, fakeDeadline{expired, sent.Add(time.Microsecond)}, attemptEnd{err: timedOut}, pacing.Ignored, 0, true},
		{"its own per-attempt timeout", paced, expired, attemptEnd{err: timedOut, timedOut: true}, pacing.Late, 0, true},
		{"the server's own time-out, the call's deadline ahead", paced, context.Background(), attemptEnd{err: timedOut}, pacing.Late, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := tc.ctx
			if ctx == nil {
				ctx = context.Background()
			}
			o, took, ok := tc.t.outcome(ctx, clk, &tc.e)
			if ok != tc.ok || ok && (o != tc.want || took != tc.took) {
				t.Errorf("outcome = %v, %v, %v; want %v, %v, %v", o, took, ok, tc.want, tc.took, tc.ok)
			}
		})
	}
}
