package interceptor

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/herdguard/herdguard/internal/clock"
	"github.com/herdguard/herdguard/internal/names"
	"github.com/herdguard/herdguard/internal/wire"
	"github.com/herdguard/herdguard/telemetry"

	"go.opentelemetry.io/otel/attribute"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/internal/testutil"
	"github.com/herdguard/herdguard/policy"
)

// manualClock is a clock whose time moves, and whose AfterFunc timers
// fire (each in its own goroutine), only when the test says: Advance,
// Skip to move it without firing, Expire to get the due callbacks unrun.
// Delays returns every delay a timer was set to. Its NewTimer fires at
// once: hedging tests make no backoff waits.
type manualClock struct {
	*testutil.Clock
	waits *testutil.Clock
}

func newManualClock() *manualClock {
	return &manualClock{testutil.NewClock(time.Now(), testutil.Async()), testutil.NewClock(time.Now(), testutil.Instant())}
}

func (c *manualClock) NewTimer(d time.Duration) clock.Timer { return c.waits.NewTimer(d) }

// waitArmed waits until a timer has been set to d.
func (c *manualClock) waitArmed(t *testing.T, d time.Duration) {
	t.Helper()
	testutil.Eventually(t, fmt.Sprintf("a timer set to %v", d), func() bool { return slices.Contains(c.Delays(), d) })
}

// eventually polls f until it reports ok, for at most 10 s, and returns
// its value; it fails the test, naming what it waited for, if f never
// does.
func eventually[T any](t *testing.T, what string, f func() (T, bool)) T {
	t.Helper()
	var v T
	testutil.Eventually(t, what, func() (ok bool) { v, ok = f(); return ok })
	return v
}

// hedgeServer answers UnaryCall per attempt: the test sets, by attempt
// number, what each attempt does; every arrival is announced on arrived.
type hedgeServer struct {
	*testserver.Server
	arrived arrivals
	mu      sync.Mutex
	answer  map[int]func(ctx context.Context) (*testgrpc.SimpleResponse, error)
	ended   map[int]error // how each attempt's context ended, if it did
	keys    map[int]string
}

func startHedgeServer(t *testing.T) *hedgeServer {
	h := &hedgeServer{arrived: make(arrivals, 16), answer: map[int]func(context.Context) (*testgrpc.SimpleResponse, error){},
		ended: map[int]error{}, keys: map[int]string{}}
	h.Server = testserver.Start(t, &testserver.Server{Unary: func(ctx context.Context, _ *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
		n := attemptOf(ctx)
		md, _ := metadata.FromIncomingContext(ctx)
		h.mu.Lock()
		f := h.answer[n]
		if v := md.Get("idempotency-key"); len(v) > 0 {
			h.keys[n] = v[0]
		}
		h.mu.Unlock()
		h.arrived <- n
		if f == nil {
			<-ctx.Done() // hang until cancelled
			h.mu.Lock()
			h.ended[n] = ctx.Err()
			h.mu.Unlock()
			return nil, status.FromContextError(ctx.Err()).Err()
		}
		return f(ctx)
	}})
	return h
}

// on sets what attempt n does.
func (h *hedgeServer) on(n int, f func(ctx context.Context) (*testgrpc.SimpleResponse, error)) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.answer[n] = f
}

func reply(name string) func(context.Context) (*testgrpc.SimpleResponse, error) {
	return func(context.Context) (*testgrpc.SimpleResponse, error) {
		return &testgrpc.SimpleResponse{Username: name}, nil
	}
}

func failWith(c codes.Code, pushbackMS string) func(context.Context) (*testgrpc.SimpleResponse, error) {
	return func(ctx context.Context) (*testgrpc.SimpleResponse, error) {
		if pushbackMS != "" {
			_ = grpc.SetTrailer(ctx, metadata.Pairs(wire.PushbackKey, pushbackMS))
		}
		return nil, status.Error(c, "scripted "+c.String())
	}
}

// waitArrival waits for attempt want to reach the server.
func (h *hedgeServer) waitArrival(t *testing.T, want int) {
	t.Helper()
	h.arrived.wait(t, want)
}

// waitEnded waits until attempt n's context ends at the server, and
// returns how it ended.
func (h *hedgeServer) waitEnded(t *testing.T, n int) error {
	t.Helper()
	return endedAt(t, &h.mu, h.ended, n)
}

// noArrival checks that no attempt reaches the server for a while.
func (h *hedgeServer) noArrival(t *testing.T) {
	t.Helper()
	h.arrived.none(t)
}

// arrivals announces, by number, the attempts that reach a test server.
type arrivals chan int

// wait waits for attempt want to reach the server.
func (c arrivals) wait(t *testing.T, want int) {
	t.Helper()
	select {
	case n := <-c:
		if n != want {
			t.Fatalf("attempt %d reached the server, want %d", n, want)
		}
	case <-time.After(callTimeout):
		t.Fatalf("attempt %d never reached the server", want)
	}
}

// none checks that no attempt reaches the server for a while.
func (c arrivals) none(t *testing.T) {
	t.Helper()
	select {
	case n := <-c:
		t.Fatalf("attempt %d reached the server, want none", n)
	case <-time.After(50 * time.Millisecond):
	}
}

// endedAt waits until ended, guarded by mu, says how attempt n's context
// ended at the server, and returns that.
func endedAt(t *testing.T, mu *sync.Mutex, ended map[int]error, n int) error {
	t.Helper()
	return eventually(t, fmt.Sprintf("attempt %d to end at the server", n), func() (error, bool) {
		mu.Lock()
		defer mu.Unlock()
		err, ok := ended[n]
		return err, ok
	})
}

const hedgeDelay = 20 * time.Millisecond

func hedging(maxAttempts int, nonFatal ...codes.Code) policy.Policy {
	return policy.Policy{Hedging: policy.Hedging{MaxAttempts: maxAttempts, Delay: hedgeDelay, NonFatalCodes: nonFatal}}
}

// hedgedCall starts a UnaryCall in the background through a new interceptor
// with the manual clock; wait for its result on the returned channel.
func hedgedCall(t *testing.T, srv *hedgeServer, clk *manualClock, p policy.Policy, opts ...Option) (<-chan result, *Interceptor) {
	t.Helper()
	ic, err := New(append([]Option{withClock(clk), WithPolicy(p), WithIdempotencyKey("idempotency-key")}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, ic.DialOptions()...)
	done := make(chan result, 1)
	go func() {
		r, err := c.UnaryCall(ctxT(t), &testgrpc.SimpleRequest{})
		done <- result{r, err}
	}()
	return done, ic
}

type result struct {
	r   *testgrpc.SimpleResponse
	err error
}

func (r result) String() string { return fmt.Sprintf("%v, %v", r.r, r.err) }

func waitResult(t *testing.T, done <-chan result) result {
	t.Helper()
	select {
	case r := <-done:
		return r
	case <-time.After(callTimeout):
		t.Fatal("the call never returned")
		return result{}
	}
}

func TestHedgeFirstAttemptAloneWhenItAnswersInTime(t *testing.T) {
	srv, clk := startHedgeServer(t), newManualClock()
	srv.on(1, reply("first"))
	done, _ := hedgedCall(t, srv, clk, hedging(3))
	srv.waitArrival(t, 1)
	if r := waitResult(t, done); r.err != nil || r.r.GetUsername() != "first" {
		t.Fatalf("call: %v; want the first attempt's reply", r)
	}
	clk.Advance(time.Hour) // a stale timer must send nothing
	srv.noArrival(t)
	if got := clk.Delays(); !slices.Equal(got, []time.Duration{hedgeDelay}) {
		t.Errorf("timers set to %v, want one hedging delay", got)
	}
}

// TestHedgeAfterTheDelayAndTheFirstAnswerWins: a hedge goes after the
// delay, carries the attempt number and the call's one idempotency key;
// its reply is the caller's, and the first attempt is cancelled.
func TestHedgeAfterTheDelayAndTheFirstAnswerWins(t *testing.T) {
	srv, clk := startHedgeServer(t), newManualClock()
	srv.on(2, reply("hedge"))
	done, _ := hedgedCall(t, srv, clk, hedging(3))
	srv.waitArrival(t, 1)
	srv.noArrival(t) // no hedge before the delay
	clk.Advance(hedgeDelay)
	srv.waitArrival(t, 2)
	r := waitResult(t, done)
	if r.err != nil || r.r.GetUsername() != "hedge" {
		t.Fatalf("call: %v; want the hedge's reply", r)
	}
	if err := srv.waitEnded(t, 1); !errors.Is(err, context.Canceled) {
		t.Errorf("the first attempt ended with %v, want cancelled by the winner", err)
	}
	srv.mu.Lock()
	defer srv.mu.Unlock()
	if k1, k2 := srv.keys[1], srv.keys[2]; k1 == "" || k1 != k2 {
		t.Errorf("idempotency keys %q and %q, want one key on both attempts", k1, k2)
	}
}

func TestHedgeNonFatalSendsTheNextAtOnce(t *testing.T) {
	srv, clk := startHedgeServer(t), newManualClock()
	srv.on(1, failWith(codes.Unavailable, ""))
	srv.on(2, reply("second"))
	done, _ := hedgedCall(t, srv, clk, hedging(3, codes.Unavailable))
	srv.waitArrival(t, 1)
	srv.waitArrival(t, 2) // without the clock moving
	if r := waitResult(t, done); r.err != nil || r.r.GetUsername() != "second" {
		t.Fatalf("call: %v; want the second attempt's reply", r)
	}
}

func TestHedgeFatalStatusEndsTheCall(t *testing.T) {
	srv, clk := startHedgeServer(t), newManualClock()
	srv.on(2, failWith(codes.Internal, ""))
	done, _ := hedgedCall(t, srv, clk, hedging(3, codes.Unavailable))
	srv.waitArrival(t, 1)
	clk.Advance(hedgeDelay)
	srv.waitArrival(t, 2)
	r := waitResult(t, done)
	var re *RetryError
	if status.Code(r.err) != codes.Internal || errors.As(r.err, &re) {
		t.Fatalf("call: %v; want the hedge's Internal as it is", r)
	}
	clk.Advance(time.Hour)
	srv.noArrival(t) // no third attempt after a fatal status
	if err := srv.waitEnded(t, 1); !errors.Is(err, context.Canceled) {
		t.Errorf("the first attempt ended with %v, want cancelled", err)
	}
}

func TestHedgePushback(t *testing.T) {
	t.Run("positive delays the next hedge", func(t *testing.T) {
		srv, clk := startHedgeServer(t), newManualClock()
		srv.on(1, failWith(codes.Unavailable, "500"))
		srv.on(2, reply("second"))
		done, _ := hedgedCall(t, srv, clk, hedging(3, codes.Unavailable))
		srv.waitArrival(t, 1)
		srv.noArrival(t) // not at once: the server asked for 500ms
		clk.Advance(hedgeDelay)
		srv.noArrival(t) // nor after the hedging delay
		clk.Advance(500*time.Millisecond - hedgeDelay)
		srv.waitArrival(t, 2)
		if r := waitResult(t, done); r.err != nil {
			t.Fatalf("call: %v", r)
		}
		if got := clk.Delays(); !slices.Contains(got, 500*time.Millisecond) {
			t.Errorf("timers set to %v, want one of 500ms after the pushback", got)
		}
	})
	t.Run("negative stops hedging", func(t *testing.T) {
		srv, clk := startHedgeServer(t), newManualClock()
		srv.on(1, failWith(codes.Unavailable, "-1"))
		done, _ := hedgedCall(t, srv, clk, hedging(3, codes.Unavailable))
		srv.waitArrival(t, 1)
		r := waitResult(t, done)
		var re *RetryError
		if status.Code(r.err) != codes.Unavailable || !errors.As(r.err, &re) || re.Outcome != OutcomePushbackStop || re.Attempts != 1 {
			t.Fatalf("call: %v; want a pushback_stop RetryError after 1 attempt", r)
		}
		clk.Advance(time.Hour)
		srv.noArrival(t)
	})
}

// TestHedgeAllNonFatal: when every attempt fails non-fatally, the call
// fails loudly with the last status.
func TestHedgeAllNonFatal(t *testing.T) {
	srv, clk := startHedgeServer(t), newManualClock()
	for n := 1; n <= 3; n++ {
		srv.on(n, failWith(codes.Unavailable, ""))
	}
	done, _ := hedgedCall(t, srv, clk, hedging(3, codes.Unavailable))
	for n := 1; n <= 3; n++ {
		srv.waitArrival(t, n)
	}
	r := waitResult(t, done)
	var re *RetryError
	if !errors.As(r.err, &re) || re.Outcome != OutcomeExhausted || re.Attempts != 3 || status.Code(r.err) != codes.Unavailable {
		t.Fatalf("call: %v; want an exhausted RetryError after 3 attempts with Unavailable", r)
	}
}

// TestHedgeNeedsAThrottlingToken: with half the tokens gone, no hedge goes.
func TestHedgeNeedsAThrottlingToken(t *testing.T) {
	srv, clk := startHedgeServer(t), newManualClock()
	srv.on(1, failWith(codes.Unavailable, ""))
	done, ic := hedgedCall(t, srv, clk, hedging(3, codes.Unavailable),
		WithRetryThrottling(policy.Throttling{MaxTokens: 2, TokenRatio: 1}))
	srv.waitArrival(t, 1) // its failure takes a token: 1 of 2 left, not more than half
	r := waitResult(t, done)
	var re *RetryError
	if !errors.As(r.err, &re) || re.Outcome != OutcomeBudgetExhausted || re.Attempts != 1 {
		t.Fatalf("call: %v; want a budget_exhausted RetryError after 1 attempt", r)
	}
	srv.noArrival(t)
	if got := ic.limitsFor(testserver.Target).throttle.Tokens(); got != 1 {
		t.Errorf("throttling tokens %v after one failed attempt of 2, want 1", got)
	}
}

// TestHedgeBudgetIsEarnedByAnswers: by default, hedges to a target are at
// most a tenth of its hedged calls that succeeded, plus 10 in 10s: a server
// whose first attempts all hang gets only what earlier answers paid for.
func TestHedgeBudgetIsEarnedByAnswers(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{Unary: func(ctx context.Context, req *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
		if attemptOf(ctx) == 1 && req.GetFillUsername() {
			<-ctx.Done() // a first attempt that hangs until the hedge wins
			return nil, ctx.Err()
		}
		return &testgrpc.SimpleResponse{}, nil
	}})
	clk := newFakeClock() // every hedging delay passes at once
	ic, err := New(withClock(clk), WithoutBreaker(), WithPolicy(hedging(2)))
	if err != nil {
		t.Fatal(err)
	}
	var hedges atomic.Int64 // hedges sent, as the next interceptor sees them
	count := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		md, _ := metadata.FromOutgoingContext(ctx)
		if v := md.Get(wire.AttemptKey); len(v) == 1 && v[0] != "1" {
			hedges.Add(1)
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	c := srv.Client(t, append(ic.DialOptions(), grpc.WithChainUnaryInterceptor(count))...)
	const (
		answered = 100                   // calls whose first attempt answers
		hanging  = 200                   // then calls whose first attempt hangs
		wait     = 25 * time.Millisecond // a hanging call without a hedge ends by it
	)
	succeeded, rescued := 0, 0
	for i := range answered + hanging {
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		_, err := c.UnaryCall(ctx, &testgrpc.SimpleRequest{FillUsername: i >= answered})
		cancel()
		if err == nil {
			succeeded++
			if i >= answered {
				rescued++
			}
		}
	}
	if succeeded < answered {
		t.Fatalf("%d calls succeeded, want at least the %d that answer at once", succeeded, answered)
	}
	// A hedge goes while the hedges sent are fewer than 0.1 × the successes
	// so far + 1/s × 10s; hanging calls ask for one each until refused.
	allowed := 10 + 0.1*float64(succeeded)
	if h := float64(hedges.Load()); h > allowed+1 || h < allowed-2 {
		t.Errorf("%v hedges for %d successful calls, want the budget's %.1f", h, succeeded, allowed)
	}
	if rescued >= hanging/2 {
		t.Errorf("%d of %d hanging calls rescued by a hedge, want the budget to refuse most", rescued, hanging)
	}
}

func TestHedgeOnlyIdempotentMethodsWithIdempotentOnly(t *testing.T) {
	srv, clk := startHedgeServer(t), newManualClock()
	srv.on(1, reply("first")) // TestService's UnaryCall is not marked idempotent
	done, _ := hedgedCall(t, srv, clk, hedging(3), WithIdempotentOnly())
	srv.waitArrival(t, 1)
	if r := waitResult(t, done); r.err != nil {
		t.Fatalf("call: %v", r)
	}
	if got := clk.Delays(); len(got) != 0 {
		t.Errorf("timers set to %v for a method that may not be hedged, want none", got)
	}
}

// TestHedgeCallerCancelEndsEveryAttempt: a cancelled caller cancels every
// outstanding hedge at once, and no goroutine outlives the call (TestMain).
func TestHedgeCallerCancelEndsEveryAttempt(t *testing.T) {
	srv, clk := startHedgeServer(t), newManualClock()
	ic, err := New(withClock(clk), WithPolicy(hedging(3)))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, ic.DialOptions()...)
	ctx, cancel := context.WithCancel(ctxT(t))
	done := make(chan error, 1)
	go func() {
		_, err := c.UnaryCall(ctx, &testgrpc.SimpleRequest{})
		done <- err
	}()
	srv.waitArrival(t, 1)
	clk.Advance(hedgeDelay)
	srv.waitArrival(t, 2)
	clk.Advance(hedgeDelay)
	srv.waitArrival(t, 3)
	cancel()
	select {
	case err := <-done:
		if status.Code(err) != codes.Canceled {
			t.Errorf("call: %v, want Canceled", err)
		}
	case <-time.After(callTimeout):
		t.Fatal("the call did not end when its caller cancelled")
	}
	for n := 1; n <= 3; n++ {
		if err := srv.waitEnded(t, n); !errors.Is(err, context.Canceled) {
			t.Errorf("attempt %d ended with %v, want cancelled", n, err)
		}
	}
}

// TestHedgeBreakerCountsOneCallAndProbesAlone: the breaker sees a hedged
// call as one call, and a half-open probe makes a single attempt.
func TestHedgeBreakerCountsOneCallAndProbesAlone(t *testing.T) {
	srv, clk := startHedgeServer(t), newManualClock()
	srv.on(1, failWith(codes.Unavailable, ""))
	srv.on(2, failWith(codes.Unavailable, ""))
	srv.on(3, failWith(codes.Unavailable, ""))
	done, ic := hedgedCall(t, srv, clk, hedging(3, codes.Unavailable), WithBreaker(breaker.Settings{ConsecutiveFailures: 2, OpenTimeout: 50 * ms}))
	for n := 1; n <= 3; n++ {
		srv.waitArrival(t, n)
	}
	if r := waitResult(t, done); !errors.As(r.err, new(*RetryError)) || status.Code(r.err) != codes.Unavailable {
		t.Fatalf("first call: %v; want a RetryError with Unavailable after 3 attempts", r)
	}
	b := ic.Breakers().Get(testserver.Target, testserver.MethodUnary)
	if c := b.Counts(); c.ConsecutiveFailures != 1 || b.State() != breaker.Closed {
		t.Fatalf("after one hedged call of 3 failed attempts: %v with %+v; want closed with a run of 1", b.State(), c)
	}

	// A second failed call opens it; once half-open, the probe is a single
	// attempt that no hedge follows, however long it takes.
	c := srv.Client(t, ic.DialOptions()...)
	srv.on(1, failWith(codes.Internal, "")) // fatal at once, a failure for the breaker
	if _, err := c.UnaryCall(ctxT(t), &testgrpc.SimpleRequest{}); status.Code(err) != codes.Internal {
		t.Fatalf("second call: %v", err)
	}
	srv.waitArrival(t, 1)
	if b.State() != breaker.Open {
		t.Fatalf("breaker %v after two failed calls, want open", b.State())
	}
	passOpen(t, clk, b)
	armed := len(clk.Delays())
	release := make(chan struct{})
	srv.on(1, func(ctx context.Context) (*testgrpc.SimpleResponse, error) {
		<-release // slower than any hedging delay
		return reply("probe")(ctx)
	})
	probe := make(chan result, 1)
	go func() {
		r, err := c.UnaryCall(ctxT(t), &testgrpc.SimpleRequest{})
		probe <- result{r, err}
	}()
	srv.waitArrival(t, 1)
	clk.Advance(time.Hour)
	srv.noArrival(t)
	close(release)
	if r := waitResult(t, probe); r.err != nil || r.r.GetUsername() != "probe" {
		t.Fatalf("probe: %v", r)
	}
	if got := len(clk.Delays()); got != armed {
		t.Errorf("the probe set %d hedge timers, want none", got-armed)
	}
	if b.State() != breaker.Closed {
		t.Errorf("breaker %v after a good probe, want closed", b.State())
	}
}

// TestHedgeSpansAndMetrics: every hedge is an attempt span marked as one,
// the winner is marked, the call span says how many hedges went and which
// attempt won; attempts carry the hedge attribute and hedges are counted.
func TestHedgeSpansAndMetrics(t *testing.T) {
	srv, clk := startHedgeServer(t), newManualClock()
	srv.on(2, reply("hedge"))
	rec, tp := newRecorder()
	reader, mp := newMetrics()
	done, _ := hedgedCall(t, srv, clk, hedging(3), WithTracerProvider(tp), WithMeterProvider(mp))
	srv.waitArrival(t, 1)
	clk.Advance(hedgeDelay)
	srv.waitArrival(t, 2)
	if r := waitResult(t, done); r.err != nil {
		t.Fatal(r)
	}
	calls := spansNamed(rec.Ended(), "grpc.testing.TestService/UnaryCall")
	if len(calls) != 1 {
		t.Fatalf("%d call spans, want 1", len(calls))
	}
	attrs := attrMap(calls[0].Attributes())
	if attrs[names.AttrHedges] != attribute.IntValue(1) || attrs[names.AttrHedgeWinner] != attribute.IntValue(2) || attrs[telemetry.AttrAttempts] != attribute.IntValue(2) {
		t.Errorf("call span attributes %v: want 2 attempts, 1 hedge, attempt 2 the winner", attrs)
	}
	attempts := spansNamed(rec.Ended(), telemetry.SpanAttempt)
	if len(attempts) != 2 {
		t.Fatalf("%d attempt spans, want 2", len(attempts))
	}
	for _, s := range attempts {
		a := attrMap(s.Attributes())
		n := a[telemetry.AttrAttempt].AsInt64()
		hedge, won := a[telemetry.AttrHedge].AsBool(), a[telemetry.AttrHedgeWon].AsBool()
		if hedge != (n == 2) || won != (n == 2) {
			t.Errorf("attempt %d span: hedge=%v won=%v; want both %v", n, hedge, won, n == 2)
		}
	}
	if got := sumInt(t, reader, telemetry.MetricHedges, []attribute.KeyValue{telemetry.AttrHedgeWon.Bool(true)}); got != 1 {
		t.Errorf("hedges won %d, want 1", got)
	}
	if got := sumInt(t, reader, telemetry.MetricAttempts, []attribute.KeyValue{telemetry.AttrHedge.Bool(true)}); got != 1 {
		t.Errorf("attempts that were hedges %d, want 1", got)
	}
}

func attrMap(kvs []attribute.KeyValue) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range kvs {
		m[kv.Key] = kv.Value
	}
	return m
}

// TestHedgeLatencyAwareDelay: once enough latencies are known, the delay
// is their quantile, never below the configured floor.
func TestHedgeLatencyAwareDelay(t *testing.T) {
	srv := startHedgeServer(t)
	clk := newManualClock()
	const floor, typical = 2 * time.Millisecond, 7 * time.Millisecond
	srv.on(1, func(context.Context) (*testgrpc.SimpleResponse, error) {
		clk.Skip(typical) // every attempt takes 7ms on the manual clock, and no hedge goes
		return &testgrpc.SimpleResponse{}, nil
	})
	p := policy.Policy{Hedging: policy.Hedging{MaxAttempts: 2, Delay: floor, Quantile: 0.95}}
	ic, err := New(withClock(clk), WithPolicy(p))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, ic.DialOptions()...)
	for i := range policy.HedgeSamples + 1 {
		if _, err := c.UnaryCall(ctxT(t), &testgrpc.SimpleRequest{}); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
		<-srv.arrived
	}
	armed := clk.Delays()
	if len(armed) != policy.HedgeSamples+1 {
		t.Fatalf("%d timers set, want one per call", len(armed))
	}
	for i, d := range armed[:policy.HedgeSamples] {
		if d != floor {
			t.Errorf("call %d: delay %v, want the floor %v while latencies are few", i+1, d, floor)
		}
	}
	if got := armed[policy.HedgeSamples]; got != typical {
		t.Errorf("after %d calls of %v: delay %v, want their p95 %v", policy.HedgeSamples, typical, got, typical)
	}
}

func TestHedgeFromServiceConfig(t *testing.T) {
	srv, clk := startHedgeServer(t), newManualClock()
	srv.on(1, failWith(codes.Unavailable, ""))
	srv.on(2, reply("second"))
	ic, err := New(withClock(clk), WithServiceConfig(`{"methodConfig": [{"name": [{"service": "grpc.testing.TestService"}],
	  "hedgingPolicy": {"maxAttempts": 2, "hedgingDelay": "1s", "nonFatalStatusCodes": ["UNAVAILABLE"]}}]}`))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, ic.DialOptions()...)
	r, err := c.UnaryCall(ctxT(t), &testgrpc.SimpleRequest{})
	if err != nil || r.GetUsername() != "second" {
		t.Fatalf("call: %v, %v; want the hedge's reply after the first failed non-fatally", r, err)
	}
	if got := clk.Delays(); len(got) == 0 || got[0] != time.Second {
		t.Errorf("timers set to %v, want the config's 1s first", got)
	}
}

// TestHedgedCallAnsweredInTimeAllocates: a hedged call answered before its
// hedging delay costs at most 3 allocations more than an unhedged one.
func TestHedgedCallAnsweredInTimeAllocates(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector makes sync.Pool drop pooled calls")
	}
	count := func(p policy.Policy) float64 {
		u, cc := alone(t, WithTracerProvider(noopTP()), WithMeterProvider(noopMP()), WithPolicy(p))
		ctx, reply := context.Background(), &testgrpc.SimpleResponse{}
		nop := func(context.Context, string, any, any, *grpc.ClientConn, ...grpc.CallOption) error { return nil }
		call := func() {
			if err := u(ctx, testserver.MethodUnary, nil, reply, cc, nop); err != nil {
				t.Fatal(err)
			}
		}
		call() // the target's breaker, budgets and the pooled call
		return testing.AllocsPerRun(200, call)
	}
	plain := count(policy.Policy{})
	hedged := count(policy.Policy{Hedging: policy.Hedging{MaxAttempts: 3, Delay: time.Hour}})
	if hedged > plain+3 {
		t.Errorf("a hedged call answered in time: %v allocations, an unhedged one %v; want at most 3 more", hedged, plain)
	}
}

// TestHedgeFailureAfterHeadersIsFatal: an attempt whose server sent
// response headers has the call (gRFC A6); its failure ends the call even
// with a non-fatal code.
func TestHedgeFailureAfterHeadersIsFatal(t *testing.T) {
	srv, clk := startHedgeServer(t), newManualClock()
	srv.on(1, func(ctx context.Context) (*testgrpc.SimpleResponse, error) {
		_ = grpc.SendHeader(ctx, metadata.Pairs("k", "v"))
		return nil, status.Error(codes.Unavailable, "after headers")
	})
	done, _ := hedgedCall(t, srv, clk, hedging(3, codes.Unavailable))
	srv.waitArrival(t, 1)
	r := waitResult(t, done)
	var re *RetryError
	if status.Code(r.err) != codes.Unavailable || errors.As(r.err, &re) {
		t.Fatalf("call: %v; want the first attempt's Unavailable as it is", r)
	}
	clk.Advance(time.Hour)
	srv.noArrival(t)
}

// TestHedgeNotWhileTheServerFails: a hedge adds load, so none goes while
// the target's breaker has a failed call on its run: under overload, which
// shows as failures, hedging stops by itself.
func TestHedgeNotWhileTheServerFails(t *testing.T) {
	srv, clk := startHedgeServer(t), newManualClock()
	srv.on(1, failWith(codes.Internal, "")) // a failed call: the breaker's run is 1
	ic, err := New(withClock(clk), WithPolicy(hedging(2)))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, ic.DialOptions()...)
	if _, err := c.UnaryCall(ctxT(t), &testgrpc.SimpleRequest{}); status.Code(err) != codes.Internal {
		t.Fatalf("first call: %v", err)
	}
	srv.waitArrival(t, 1)
	release := make(chan struct{})
	srv.on(1, func(context.Context) (*testgrpc.SimpleResponse, error) {
		<-release
		return &testgrpc.SimpleResponse{Username: "slow"}, nil
	})
	done := make(chan result, 1)
	go func() {
		r, err := c.UnaryCall(ctxT(t), &testgrpc.SimpleRequest{})
		done <- result{r, err}
	}()
	srv.waitArrival(t, 1)
	clk.Advance(hedgeDelay)
	srv.noArrival(t) // the breaker is not calm: no hedge
	close(release)
	if r := waitResult(t, done); r.err != nil || r.r.GetUsername() != "slow" {
		t.Fatalf("call: %v; want the first attempt's reply", r)
	}
}

// TestHedgeCallerCatchersGetTheWinners: the caller's Header, Trailer and
// Peer options get the values of the attempt whose answer the caller got,
// not of a loser that ended later (gRPC fills them as each attempt ends).
func TestHedgeCallerCatchersGetTheWinners(t *testing.T) {
	answer := func(who string) func(context.Context) (*testgrpc.SimpleResponse, error) {
		return func(ctx context.Context) (*testgrpc.SimpleResponse, error) {
			_ = grpc.SetHeader(ctx, metadata.Pairs("who", who))
			_ = grpc.SetTrailer(ctx, metadata.Pairs("who-t", who))
			return &testgrpc.SimpleResponse{Username: who}, nil
		}
	}
	for _, tc := range []struct {
		name   string
		winner int
	}{{"the hedge wins", 2}, {"the first wins while the hedge runs", 1}} {
		t.Run(tc.name, func(t *testing.T) {
			srv, clk := startHedgeServer(t), newManualClock()
			release := make(chan struct{})
			if tc.winner == 2 {
				srv.on(2, answer("hedge"))
			} else {
				srv.on(1, func(ctx context.Context) (*testgrpc.SimpleResponse, error) {
					<-release // answer once the hedge is out
					return answer("first")(ctx)
				})
			}
			ic, err := New(withClock(clk), WithPolicy(hedging(2)))
			if err != nil {
				t.Fatal(err)
			}
			c := srv.Client(t, ic.DialOptions()...)
			var (
				header, trailer metadata.MD
				p               peer.Peer
			)
			done := make(chan *testgrpc.SimpleResponse, 1)
			go func() {
				r, err := c.UnaryCall(ctxT(t), &testgrpc.SimpleRequest{}, grpc.Header(&header), grpc.Trailer(&trailer), grpc.Peer(&p))
				if err != nil {
					t.Errorf("call: %v", err)
				}
				done <- r
			}()
			srv.waitArrival(t, 1)
			clk.Advance(hedgeDelay)
			srv.waitArrival(t, 2)
			close(release)
			r := <-done
			want := map[int]string{1: "first", 2: "hedge"}[tc.winner]
			if r.GetUsername() != want || !slices.Equal(header.Get("who"), []string{want}) || !slices.Equal(trailer.Get("who-t"), []string{want}) {
				t.Errorf("reply %q, header %v, trailer %v; want all of %s", r.GetUsername(), header, trailer, want)
			}
			if p.Addr == nil {
				t.Error("the caller's Peer option was left empty")
			}
		})
	}
}

// TestHedgeRefusedByTheRetryBudgetCostsNoHedge: a hedge that the retry
// budget refuses is not counted against the hedge budget.
func TestHedgeRefusedByTheRetryBudgetCostsNoHedge(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{Unary: func(ctx context.Context, _ *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
		if attemptOf(ctx) == 1 {
			<-ctx.Done() // every first attempt hangs
			return nil, ctx.Err()
		}
		return &testgrpc.SimpleResponse{}, nil
	}})
	// A retry budget with room for a single retry in its window.
	ic, err := New(withClock(newFakeClock()), WithoutBreaker(), WithPolicy(hedging(2)),
		WithRetryBudget(policy.Budget{Ratio: 1e-9, MinPerSecond: 0.05}))
	if err != nil {
		t.Fatal(err)
	}
	// Attempts are counted where the interceptor sends them: an attempt
	// cancelled as soon as the other one answers may never reach the
	// server, since gRPC drops a stream whose headers it has not written.
	var attempts atomic.Int64
	count := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		attempts.Add(1)
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	c := srv.Client(t, append(ic.DialOptions(), grpc.WithChainUnaryInterceptor(count))...)
	ok := 0
	for range 5 {
		ctx, cancel := context.WithTimeout(context.Background(), 25*time.Millisecond)
		if _, err := c.UnaryCall(ctx, &testgrpc.SimpleRequest{}); err == nil {
			ok++
		} else if status.Code(err) != codes.DeadlineExceeded {
			t.Errorf("call: %v, want DeadlineExceeded or an answer", err)
		}
		cancel()
	}
	if _, hedges := ic.hedgeBudget(testserver.Target).Counts(); hedges != 1 {
		t.Errorf("the hedge budget counted %d hedges; the retry budget let 1 go", hedges)
	}
	if ok != 1 || attempts.Load() != 6 {
		t.Errorf("%d calls answered, %d attempts; want 1 answered by the one hedge the retry budget let go, and 6 attempts", ok, attempts.Load())
	}
}

// TestHedgingPolicyNotHedgedMakesOneAttempt: a method whose hedging policy
// cannot hedge it (WithIdempotentOnly, not idempotent) makes one attempt,
// as a stream does: a hedging policy never retries.
func TestHedgingPolicyNotHedgedMakesOneAttempt(t *testing.T) {
	ic, err := New(WithoutBreaker(), WithPolicy(hedging(3)), WithIdempotentOnly())
	if err != nil {
		t.Fatal(err)
	}
	var attempts atomic.Int64
	count := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		attempts.Add(1)
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	// Nothing listens there: each attempt fails Unavailable without
	// reaching a server, which an unsafe method's retry loop would retry.
	cc, err := grpc.NewClient("127.0.0.1:1", append(ic.DialOptions(), grpc.WithTransportCredentials(insecureCreds()),
		grpc.WithChainUnaryInterceptor(count))...)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	_, err = testgrpc.NewTestServiceClient(cc).UnaryCall(ctxT(t), &testgrpc.SimpleRequest{})
	if status.Code(err) != codes.Unavailable || attempts.Load() != 1 {
		t.Errorf("got %v after %d attempts; want Unavailable after 1", err, attempts.Load())
	}
}

// Every attempt of a hedged unary call fails non-fatally: the caller's
// grpc.Trailer is the last attempt's, whose status the call ends with.
func TestHedgeExhaustedFillsTheLastAttempts(t *testing.T) {
	srv, clk := startHedgeServer(t), newManualClock()
	for n := 1; n <= 2; n++ {
		srv.on(n, func(ctx context.Context) (*testgrpc.SimpleResponse, error) {
			_ = grpc.SetTrailer(ctx, metadata.Pairs("who", fmt.Sprint(n)))
			return nil, status.Error(codes.Unavailable, fmt.Sprint("down ", n))
		})
	}
	ic, err := New(withClock(clk), WithPolicy(hedging(2, codes.Unavailable)))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, ic.DialOptions()...)
	var trailer metadata.MD
	_, err = c.UnaryCall(ctxT(t), &testgrpc.SimpleRequest{}, grpc.Trailer(&trailer))
	if status.Convert(err).Message() != "down 2" {
		t.Fatalf("call: %v, want down 2", err)
	}
	if got := trailer.Get("who"); !slices.Equal(got, []string{"2"}) {
		t.Errorf("caller's trailer who=%q, want attempt 2's", got)
	}
}

// The hedging delay passes at the moment attempt 1 fails non-fatally with
// a pushback of 1 s: the timer fired, and its callback waits for the call's
// lock while the pushback sets the timer again. The late callback sends
// nothing: the next hedge waits for the pushback's 1 s, then the one after
// for the hedging delay.
func TestHedgePushbackOutlastsATimerThatFired(t *testing.T) {
	srv, clk := startHedgeServer(t), newManualClock()
	fail1 := make(chan struct{})
	srv.on(1, func(ctx context.Context) (*testgrpc.SimpleResponse, error) {
		<-fail1
		_ = grpc.SetTrailer(ctx, metadata.Pairs(wire.PushbackKey, "1000"))
		return nil, status.Error(codes.Unavailable, "down 1")
	})
	done, _ := hedgedCall(t, srv, clk, hedging(3, codes.Unavailable))
	srv.waitArrival(t, 1)
	due := clk.Expire(hedgeDelay) // the delay passed; the callback has not run
	close(fail1)                  // attempt 1 fails: pushback 1 s
	clk.waitArmed(t, time.Second)
	for _, f := range due {
		f() // the late callback: the pushback came first, hedge 2 waits for it
	}
	srv.noArrival(t)
	clk.Advance(time.Second)
	srv.waitArrival(t, 2)
	clk.Advance(hedgeDelay) // then the hedging delay again
	srv.waitArrival(t, 3)
	_ = done // the test's context ends the call at cleanup
}

// waitArmedN waits until timers have been set n times, and returns the
// delays they were set to, in order.
func (c *manualClock) waitArmedN(t *testing.T, n int) []time.Duration {
	t.Helper()
	return eventually(t, fmt.Sprintf("%d timer settings", n), func() ([]time.Duration, bool) {
		a := c.Delays()
		return a, len(a) >= n
	})
}

// BenchmarkHedgeAlone: a hedged call through the interceptor alone, answered
// before its hedging delay, and one whose first attempt fails non-fatally, so
// that a hedge goes at once and answers.
func BenchmarkHedgeAlone(b *testing.B) {
	run := func(b *testing.B, inv grpc.UnaryInvoker) {
		p := policy.Policy{Hedging: policy.Hedging{MaxAttempts: 3, Delay: time.Hour, NonFatalCodes: []codes.Code{codes.Unavailable}}}
		room := policy.Budget{Ratio: 1, MinPerSecond: 1e9} // every hedge passes
		u, cc := alone(b, WithTracerProvider(noopTP()), WithMeterProvider(noopMP()), WithPolicy(p),
			WithRetryBudget(room), WithHedgeBudget(room))
		ctx, reply := context.Background(), &testgrpc.SimpleResponse{}
		b.ReportAllocs()
		for b.Loop() {
			if err := u(ctx, testserver.MethodUnary, nil, reply, cc, inv); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.Run("answered-in-time", func(b *testing.B) { run(b, nopInvoker) })
	b.Run("first-fails", func(b *testing.B) {
		run(b, func(ctx context.Context, _ string, _, _ any, _ *grpc.ClientConn, _ ...grpc.CallOption) error {
			if md, _ := metadata.FromOutgoingContext(ctx); len(md.Get(wire.AttemptKey)) == 0 {
				return status.Error(codes.Unavailable, "down")
			}
			return nil
		})
	})
}

// TestHedgeLastAllowedAttemptPushedBack: a pushback on the last attempt
// allowed, with none in flight, has no hedge to delay: the call ends as
// exhausted at once, as a hedged stream does, even when the pushback would
// outlast its deadline.
func TestHedgeLastAllowedAttemptPushedBack(t *testing.T) {
	srv, clk := startHedgeServer(t), newManualClock()
	srv.on(1, failWith(codes.Unavailable, "10"))
	srv.on(2, failWith(codes.Unavailable, "3600000")) // an hour: past the call's deadline
	done, _ := hedgedCall(t, srv, clk, hedging(2, codes.Unavailable))
	srv.waitArrival(t, 1)
	clk.waitArmed(t, 10*time.Millisecond)
	clk.Advance(10 * time.Millisecond)
	srv.waitArrival(t, 2)
	r := waitResult(t, done)
	var re *RetryError
	if !errors.As(r.err, &re) || re.Outcome != OutcomeExhausted || re.Attempts != 2 || status.Code(r.err) != codes.Unavailable {
		t.Fatalf("call: %v; want an exhausted RetryError after 2 attempts with Unavailable", r)
	}
}

// TestHedgeVerdictFollowsTheLastFailure: a hedged call whose first attempt
// is answered "don't retry" because a layer below gave up, while a hedge is
// in flight, ends with that hedge's failure; the breaker counts the call
// when that failure is the target's own (a plain Unavailable), and leaves
// it out when the hedge too was a give-up below. Unary calls and server
// streams.
func TestHedgeVerdictFollowsTheLastFailure(t *testing.T) {
	gaveUpMD := metadata.Pairs(wire.PushbackKey, "-1", wire.GaveUpKey, "exhausted")
	for _, kind := range []string{"unary", "stream"} {
		for _, tt := range []struct {
			name      string
			gaveUp2   bool // the hedge gives up below too
			wantCount bool
		}{
			{"the hedge fails plainly", false, true},
			{"the hedge gave up below too", true, false},
		} {
			t.Run(kind+", "+tt.name, func(t *testing.T) {
				fail1, fail2 := make(chan struct{}), make(chan struct{})
				// answer is attempt n's failure, once its channel is closed;
				// setTrailer sets a trailer on the server's call.
				answer := func(n int, setTrailer func(metadata.MD)) error {
					gaveUp := n == 1 || tt.gaveUp2
					<-map[int]chan struct{}{1: fail1, 2: fail2}[n]
					if gaveUp {
						setTrailer(gaveUpMD)
						return status.Error(codes.Unavailable, "a layer below gave up")
					}
					return status.Error(codes.Unavailable, "down")
				}
				clk := newManualClock()
				rec, tp := newRecorder()
				opts := []Option{withClock(clk), WithPolicy(hedging(3, codes.Unavailable)), WithTracerProvider(tp),
					WithBreaker(breaker.Settings{ConsecutiveFailures: 100, OpenTimeout: time.Hour})}
				var (
					call    func() error
					arrival func(n int)
					none    func()
				)
				if kind == "unary" {
					srv := startHedgeServer(t)
					for n := 1; n <= 2; n++ {
						srv.on(n, func(ctx context.Context) (*testgrpc.SimpleResponse, error) {
							return nil, answer(n, func(md metadata.MD) { _ = grpc.SetTrailer(ctx, md) })
						})
					}
					ic, err := New(opts...)
					if err != nil {
						t.Fatal(err)
					}
					c := srv.Client(t, ic.DialOptions()...)
					call = func() error { _, err := c.UnaryCall(ctxT(t), &testgrpc.SimpleRequest{}); return err }
					arrival, none = func(n int) { srv.waitArrival(t, n) }, func() { srv.noArrival(t) }
					defer func() { checkCounted(t, ic, tt.wantCount) }()
				} else {
					sc := newStreamScript()
					for n := 1; n <= 2; n++ {
						sc.on(n, func(ss grpc.ServerStream) error { return answer(n, ss.SetTrailer) })
					}
					srv := startStreamScript(t, sc)
					ic, err := New(opts...)
					if err != nil {
						t.Fatal(err)
					}
					c := srv.Client(t, ic.DialOptions()...)
					call = func() error {
						s, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{})
						if err == nil {
							_, err = s.Recv()
						}
						return err
					}
					arrival, none = func(n int) { sc.wait(t, n) }, func() { sc.none(t) }
					defer func() { checkCounted(t, ic, tt.wantCount) }()
				}
				done := make(chan error, 1)
				go func() { done <- call() }()
				arrival(1)
				clk.Advance(hedgeDelay)
				arrival(2)
				close(fail1) // attempt 1 gives up below: no more hedges; attempt 2 goes on
				testutil.Eventually(t, "attempt 1's span ended", func() bool { return len(spansNamed(rec.Ended(), telemetry.SpanAttempt)) == 1 })
				close(fail2)
				select {
				case err := <-done:
					if status.Code(err) != codes.Unavailable {
						t.Fatalf("call: %v, want Unavailable", err)
					}
				case <-time.After(callTimeout):
					t.Fatal("the call never returned")
				}
				clk.Advance(time.Hour)
				none()
			})
		}
	}
}

// checkCounted checks whether ic's breakers counted exactly one failed
// call (want) or none.
func checkCounted(t *testing.T, ic *Interceptor, want bool) {
	t.Helper()
	var failures uint32
	ic.Breakers().Each(func(b *breaker.Breaker) { failures += b.Counts().TotalFailures })
	if counted := failures == 1; counted != want || failures > 1 {
		t.Errorf("the breaker counted %d failures, want the call counted: %v", failures, want)
	}
}
