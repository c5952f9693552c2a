package interceptor

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/status"

	"io"
	"sync"
	"sync/atomic"

	"github.com/herdguard/herdguard"
	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/policy"
	"google.golang.org/grpc/metadata"

	"github.com/herdguard/herdguard/internal/testutil"
)

func TestBreakerCountsCallsNotAttempts(t *testing.T) {
	// Each call fails twice, then succeeds: 2 failed attempts per call, but
	// every call is a success, so a breaker that trips after 2 failures must
	// stay closed.
	sc := &script{}
	for range 5 {
		sc.errs = append(sc.errs, status.Error(codes.Unavailable, "blip"), status.Error(codes.Unavailable, "blip"), nil)
	}
	srv, c, _, ic := setup(t, sc, WithBreaker(breaker.Settings{ConsecutiveFailures: 2}))
	for i := range 5 {
		if err := call(t, c); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	if got := ic.Breakers().Get(testserver.Target, testserver.MethodUnary).State(); got != breaker.Closed {
		t.Errorf("breaker %v after 5 calls that succeeded on retry, want closed", got)
	}
	if got := srv.Requests(); got != 15 {
		t.Errorf("server saw %d attempts, want 15", got)
	}
}

func TestBreakerOpensAfterExhaustedCallsAndFailsFast(t *testing.T) {
	// The breaker alone: with the overload controller, a server that
	// refuses everything is the controller's (TestNoHarmServerDiesAfterAnswering).
	srv, c, clk, ic := setup(t, fail(codes.Unavailable), WithBreaker(breaker.Settings{ConsecutiveFailures: 2}), WithoutOverloadControl())
	b := ic.Breakers().Get(testserver.Target, testserver.MethodUnary)
	if err := call(t, c); status.Code(err) != codes.Unavailable {
		t.Fatal(err)
	}
	if b.State() != breaker.Closed {
		t.Fatalf("breaker opened after one failed call of 3 attempts; it must count calls")
	}
	call(t, c)
	if b.State() != breaker.Open {
		t.Fatalf("breaker %v after 2 exhausted calls, want open", b.State())
	}
	sent, waits := srv.Requests(), len(clk.Delays())

	err := call(t, c)
	if !errors.Is(err, breaker.ErrOpen) || status.Code(err) != codes.Unavailable {
		t.Fatalf("err = %v, want ErrOpen with code Unavailable", err)
	}
	if !strings.Contains(err.Error(), testserver.Target) {
		t.Errorf("err = %q, want it to name the scope %q", err, testserver.Target)
	}
	// It says how long the breaker stays open: at most OpenTimeout.
	var oe *breaker.OpenError
	if !errors.As(err, &oe) || oe.RetryAfter <= 0 || oe.RetryAfter > breaker.DefaultOpenTimeout || !strings.Contains(err.Error(), "open for ") {
		t.Errorf("err = %q (%+v), want an OpenError that says how long it stays open, within %v", err, oe, breaker.DefaultOpenTimeout)
	}
	if srv.Requests() != sent || len(clk.Delays()) != waits {
		t.Errorf("an open breaker sent %d attempts and waited %d times; want none", srv.Requests()-sent, len(clk.Delays())-waits)
	}
	// the breaker is per target: another method is refused too
	if _, err := c.EmptyCall(context.Background(), &testgrpc.Empty{}); !errors.Is(err, breaker.ErrOpen) {
		t.Errorf("EmptyCall on the same target: %v, want ErrOpen", err)
	}
}

func TestBreakerHealthyCodesAndCancellationDoNotTrip(t *testing.T) {
	srv, c, _, ic := setup(t, fail(codes.NotFound), WithBreaker(breaker.Settings{ConsecutiveFailures: 1}))
	for range 5 {
		call(t, c)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for range 5 {
		c.UnaryCall(ctx, &testgrpc.SimpleRequest{})
	}
	if got := ic.Breakers().Get(testserver.Target, testserver.MethodUnary).State(); got != breaker.Closed {
		t.Errorf("breaker %v after NotFound and cancelled calls, want closed", got)
	}
	if srv.Requests() != 5 {
		t.Errorf("server saw %d requests, want 5 (cancelled calls send nothing)", srv.Requests())
	}
}

func TestBreakerCountsPerAttemptTimeoutsAsFailures(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{Unary: func(ctx context.Context, _ *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
		<-ctx.Done()
		return nil, ctx.Err()
	}})
	ic, _ := New(withClock(newFakeClock()),
		WithPolicy(policy.Policy{MaxAttempts: 2, PerAttemptTimeout: 20 * ms}),
		WithBreaker(breaker.Settings{ConsecutiveFailures: 1}))
	if err := call(t, srv.Client(t, ic.DialOptions()...)); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("err = %v, want DeadlineExceeded", err)
	}
	if got := ic.Breakers().Get(testserver.Target, "").State(); got != breaker.Open {
		t.Errorf("breaker %v after a call whose attempts all timed out, want open", got)
	}
}

func TestBreakerPerMethodScope(t *testing.T) {
	srv, c, _, _ := setup(t, fail(codes.Unavailable), WithBreaker(breaker.Settings{ConsecutiveFailures: 1, Scope: breaker.PerMethod}))
	call(t, c)
	err := call(t, c)
	if !errors.Is(err, breaker.ErrOpen) || !strings.Contains(err.Error(), testserver.MethodUnary) {
		t.Fatalf("err = %v, want ErrOpen naming the method", err)
	}
	n := srv.Requests()
	c.EmptyCall(context.Background(), &testgrpc.Empty{})
	if srv.Requests() != n+3 {
		t.Errorf("another method sent %d attempts; its own breaker is closed, want 3", srv.Requests()-n)
	}
}

func TestWithoutBreakerNeverRefuses(t *testing.T) {
	srv, c, _, ic := setup(t, fail(codes.Unavailable), WithoutBreaker(), WithPolicy(policy.Policy{MaxAttempts: 1}))
	if ic.Breakers() != nil {
		t.Fatal("Breakers() != nil without a breaker")
	}
	for range 20 {
		if err := call(t, c); errors.Is(err, breaker.ErrOpen) {
			t.Fatal("a call was refused with the breaker off")
		}
	}
	if srv.Requests() != 20 {
		t.Errorf("server saw %d requests, want 20", srv.Requests())
	}
}

// TestBreakerHalfOpenProbeIsOneAttempt: once the open period has passed on
// the interceptor's clock, a probe is a single attempt, and a failed one
// opens the breaker again.
func TestBreakerHalfOpenProbeIsOneAttempt(t *testing.T) {
	const openTimeout = 50 * ms
	sc := fail(codes.Unavailable)
	srv, c, clk, ic := setup(t, sc, WithBreaker(breaker.Settings{ConsecutiveFailures: 1, OpenTimeout: openTimeout}))
	b := ic.Breakers().Get(testserver.Target, testserver.MethodUnary)
	call(t, c)
	if b.State() != breaker.Open {
		t.Fatalf("breaker %v, want open", b.State())
	}
	passOpen(t, clk, b)

	n := srv.Requests()
	if err := call(t, c); status.Code(err) != codes.Unavailable {
		t.Fatalf("probe: %v", err)
	}
	if got := srv.Requests() - n; got != 1 {
		t.Errorf("a failing probe sent %d attempts, want 1", got)
	}
	if b.State() != breaker.Open {
		t.Fatalf("breaker %v after a failed probe, want open", b.State())
	}

	passOpen(t, clk, b)
	sc.mu.Lock()
	sc.errs = []error{nil}
	sc.mu.Unlock()
	if err := call(t, c); err != nil {
		t.Fatalf("probe: %v", err)
	}
	if b.State() != breaker.Closed {
		t.Errorf("breaker %v after a good probe, want closed", b.State())
	}
}

// passOpen moves clk, the breaker's clock, past b's open period (at most
// DefaultMaxOpenTimeout, as the tests set it), and checks that b is then
// half-open: the next call is its probe.
func passOpen(t *testing.T, clk interface{ Advance(time.Duration) }, b *breaker.Breaker) {
	t.Helper()
	clk.Advance(breaker.DefaultMaxOpenTimeout)
	if got := b.State(); got != breaker.HalfOpen {
		t.Fatalf("breaker %v past its open period, want half-open", got)
	}
}

// TestBreakerVerdictSetting: the breaker's Verdict decides what a code
// tells it. By the default table one tenant's ResourceExhausted quota counts
// against the whole target; a Verdict that ignores it keeps the breaker
// closed, for unary calls and streams alike, while other failures still
// count.
func TestBreakerVerdictSetting(t *testing.T) {
	ignoreQuota := func(err error) herdguard.Verdict {
		if status.Code(err) == codes.ResourceExhausted {
			return herdguard.Ignored
		}
		return herdguard.BreakerVerdict(status.Code(err))
	}
	for _, tc := range []struct {
		name    string
		verdict func(error) herdguard.Verdict
		code    codes.Code
		want    breaker.State
	}{
		{"default table, quota", nil, codes.ResourceExhausted, breaker.Open},
		{"quota ignored, quota", ignoreQuota, codes.ResourceExhausted, breaker.Closed},
		{"quota ignored, internal", ignoreQuota, codes.Internal, breaker.Open},
		{"default table, not found", nil, codes.NotFound, breaker.Closed},
	} {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/stream=%v", tc.name, stream), func(t *testing.T) {
				fails := status.Error(tc.code, "scripted")
				srv := testserver.Start(t, &testserver.Server{
					Unary: fail(tc.code).unary,
					ServerStream: func(*testgrpc.StreamingOutputCallRequest, testgrpc.TestService_StreamingOutputCallServer) error {
						return fails
					},
				})
				c, ic := streamClient(t, srv, WithBreaker(breaker.Settings{ConsecutiveFailures: 3, Verdict: tc.verdict}))
				method := testserver.MethodUnary
				if stream {
					method = "/grpc.testing.TestService/StreamingOutputCall"
				}
				for range 3 {
					var err error
					if stream {
						var s testgrpc.TestService_StreamingOutputCallClient
						if s, err = c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{}, NoRetry()); err == nil {
							_, err = s.Recv()
						}
					} else {
						err = call(t, c, NoRetry())
					}
					if status.Code(err) != tc.code {
						t.Fatalf("call: %v, want %v", err, tc.code)
					}
				}
				if got := ic.Breakers().Get(testserver.Target, method).State(); got != tc.want {
					t.Errorf("breaker %v after 3 calls failing %v, want %v", got, tc.code, tc.want)
				}
			})
		}
	}
}

// TestStreamClientErrorDoesNotCount: a stream that ends with the client's
// own SendMsg error (a message over the call's size limit) says nothing of
// the server, though its code, ResourceExhausted, is one the table counts.
func TestStreamClientErrorDoesNotCount(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{ClientStream: func(ss testgrpc.TestService_StreamingInputCallServer) error {
		<-ss.Context().Done()
		return ss.Context().Err()
	}})
	c, ic := streamClient(t, srv, WithBreaker(breaker.Settings{ConsecutiveFailures: 1}))
	stream, err := c.StreamingInputCall(ctxT(t), grpc.MaxCallSendMsgSize(8))
	if err != nil {
		t.Fatal(err)
	}
	err = stream.Send(&testgrpc.StreamingInputCallRequest{Payload: payload("far more than eight bytes")})
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("Send: %v, want the client's own ResourceExhausted", err)
	}
	if got := ic.Breakers().Get(testserver.Target, "/grpc.testing.TestService/StreamingInputCall").State(); got != breaker.Closed {
		t.Errorf("breaker %v after the client's own send error, want closed", got)
	}
}

// heldClock reads the wall clock, but its timers never fire (nothing
// advances it): a backoff wait ends only when the call's context does.
// Delays returns every wait asked for.
type heldClock struct{ *testutil.Clock }

func newHeldClock() *heldClock { return &heldClock{testutil.NewClock(time.Now())} }

func (*heldClock) Now() time.Time { return time.Now() }

// hungServer answers calls whose payload is "fail" with Unavailable at once
// and hangs on any other until its context ends. A hanging handler first
// offers a value on entered, so a test can learn that its attempt is in
// flight.
func hungServer(t *testing.T) (*testserver.Server, chan struct{}) {
	entered := make(chan struct{})
	hang := func(ctx context.Context, body []byte) error {
		if string(body) == "fail" {
			return status.Error(codes.Unavailable, "regress: down")
		}
		select {
		case entered <- struct{}{}:
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		}
		<-ctx.Done()
		return status.FromContextError(ctx.Err()).Err()
	}
	srv := testserver.Start(t, &testserver.Server{
		Unary: func(ctx context.Context, r *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
			return nil, hang(ctx, r.GetPayload().GetBody())
		},
		ServerStream: func(r *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
			return hang(ss.Context(), r.GetPayload().GetBody())
		},
	})
	return srv, entered
}

// breakerKinds make one call of their kind with the given payload and
// return its error.
var breakerKinds = []struct {
	name string
	call func(context.Context, testgrpc.TestServiceClient, string) error
}{
	{"unary", func(ctx context.Context, c testgrpc.TestServiceClient, body string) error {
		_, err := c.UnaryCall(ctx, &testgrpc.SimpleRequest{Payload: payload(body)})
		return err
	}},
	{"server stream", func(ctx context.Context, c testgrpc.TestServiceClient, body string) error {
		s, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{Payload: payload(body)})
		if err != nil {
			return err
		}
		_, err = s.Recv()
		return err
	}},
}

// TestHungBackendTripsBreaker: a call whose deadline (the caller's,
// or the policy's Timeout) runs out while its attempt waits on a server
// that does not answer is the server's failure, and opens the breaker like
// any other.
func TestHungBackendTripsBreaker(t *testing.T) {
	const trip = 3
	srv, _ := hungServer(t)
	for _, deadline := range []string{"caller's", "Policy.Timeout"} {
		for _, k := range breakerKinds {
			t.Run(deadline+"/"+k.name, func(t *testing.T) {
				opts := []Option{WithBreaker(breaker.Settings{ConsecutiveFailures: trip})}
				callCtx := func() (context.Context, context.CancelFunc) {
					return context.WithTimeout(context.Background(), hungDeadline)
				}
				if deadline == "Policy.Timeout" {
					opts = append(opts, WithPolicy(policy.Policy{Timeout: hungDeadline}))
					callCtx = func() (context.Context, context.CancelFunc) {
						return context.WithTimeout(context.Background(), 100*hungDeadline) // far beyond the policy's
					}
				}
				c, ic := streamClient(t, srv, opts...)
				for i := range trip {
					ctx, cancel := callCtx()
					err := k.call(ctx, c, "hang")
					cancel()
					if status.Code(err) != codes.DeadlineExceeded {
						t.Fatalf("call %d: got %v, want DeadlineExceeded", i+1, err)
					}
				}
				if got := ic.Breakers().Get(testserver.Target, testserver.MethodUnary).State(); got != breaker.Open {
					t.Errorf("breaker %v after %d calls timed out on a hung server, want open", got, trip)
				}
				n := srv.Requests()
				ctx, cancel := callCtx()
				defer cancel()
				if err := k.call(ctx, c, "hang"); !errors.Is(err, breaker.ErrOpen) {
					t.Errorf("call %d: got %v, want it refused with breaker.ErrOpen", trip+1, err)
				}
				if got := srv.Requests() - n; got != 0 {
					t.Errorf("call %d reached the server %d times, want 0", trip+1, got)
				}
			})
		}
	}
}

// TestCallerEndedCallsDoNotTrip: calls the caller ended itself say
// nothing about the server and leave the breaker closed, however many.
func TestCallerEndedCallsDoNotTrip(t *testing.T) {
	const (
		trip = 3
		runs = trip + 1
	)
	srv, entered := hungServer(t)
	cases := []struct {
		name string
		want codes.Code
		// run makes one call that the caller ends.
		run func(t *testing.T, clk *heldClock, call func(context.Context, string) error) error
	}{
		{"cancelled in flight", codes.Canceled, func(t *testing.T, _ *heldClock, call func(context.Context, string) error) error {
			ctx, cancel := context.WithCancel(ctxT(t))
			defer cancel()
			got := make(chan error, 1)
			go func() { got <- call(ctx, "hang") }()
			select {
			case <-entered:
			case err := <-got:
				return fmt.Errorf("the call ended before it reached the server: %w", err)
			}
			cancel()
			return <-got
		}},
		{"deadline during backoff", codes.DeadlineExceeded, func(t *testing.T, clk *heldClock, call func(context.Context, string) error) error {
			ctx, cancel := context.WithTimeout(context.Background(), hungDeadline)
			defer cancel()
			waits := len(clk.Delays())
			err := call(ctx, "fail")
			if len(clk.Delays()) == waits {
				t.Error("the call started no backoff wait: the case tests nothing")
			}
			return err
		}},
		{"deadline passed before the call", codes.DeadlineExceeded, func(t *testing.T, _ *heldClock, call func(context.Context, string) error) error {
			ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
			defer cancel()
			return call(ctx, "hang")
		}},
	}
	for _, k := range breakerKinds {
		for _, tt := range cases {
			t.Run(k.name+"/"+tt.name, func(t *testing.T) {
				clk := newHeldClock()
				ic, err := New(withClock(clk), WithBreaker(breaker.Settings{ConsecutiveFailures: trip}),
					WithPolicy(policy.Policy{MaxAttempts: 3, InitialBackoff: ms}))
				if err != nil {
					t.Fatal(err)
				}
				c := srv.Client(t, ic.DialOptions()...)
				call := func(ctx context.Context, body string) error { return k.call(ctx, c, body) }
				for i := range runs {
					if err := tt.run(t, clk, call); status.Code(err) != tt.want {
						t.Fatalf("call %d: got %v, want %v", i+1, err, tt.want)
					}
				}
				if got := ic.Breakers().Get(testserver.Target, testserver.MethodUnary).State(); got != breaker.Closed {
					t.Errorf("breaker %v after %d such calls, want closed", got, runs)
				}
			})
		}
	}
}

// TestLongStreamClosesHalfOpenBreaker: a probe stream the server
// has answered has shown the server healthy; the breaker closes then, not
// when the (long) stream ends, and lets other calls through: when the
// caller received a message, and when the server sent headers alone that
// the caller has not read, also after Context() committed the stream
// before they came.
func TestLongStreamClosesHalfOpenBreaker(t *testing.T) {
	for _, tc := range []struct {
		name    string
		message bool // the server sends a message, or headers alone
		context bool // the caller calls Context() first
	}{
		{"a message received", true, false},
		{"headers unread", false, false},
		{"headers unread after Context", false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var failing atomic.Bool
			failing.Store(true)
			release := make(chan struct{})
			stopProbe := sync.OnceFunc(func() { close(release) })
			defer stopProbe()
			srv := testserver.Start(t, &testserver.Server{
				Unary: func(context.Context, *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
					if failing.Load() {
						return nil, status.Error(codes.Unavailable, "regress: down")
					}
					return &testgrpc.SimpleResponse{}, nil
				},
				ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
					var err error
					if tc.message {
						err = ss.Send(&testgrpc.StreamingOutputCallResponse{Payload: payload("first")})
					} else {
						err = ss.SendHeader(metadata.Pairs("watch", "on"))
					}
					if err != nil {
						return err
					}
					select {
					case <-release:
					case <-ss.Context().Done():
					}
					return nil
				},
			})
			clk := newFakeClock()
			c, ic := streamClient(t, srv, withClock(clk), WithBreaker(breaker.Settings{ConsecutiveFailures: 1, OpenTimeout: 50 * ms}))
			b := ic.Breakers().Get(testserver.Target, testserver.MethodUnary)
			if err := call(t, c); status.Code(err) != codes.Unavailable {
				t.Fatalf("tripping call: got %v, want Unavailable", err)
			}
			if got := b.State(); got != breaker.Open {
				t.Fatalf("breaker %v, want open", got)
			}
			passOpen(t, clk, b)
			failing.Store(false)

			stream, err := c.StreamingOutputCall(ctxT(t), &testgrpc.StreamingOutputCallRequest{})
			if err != nil {
				t.Fatalf("probe stream: %v", err)
			}
			if tc.context {
				_ = stream.Context()
			}
			if tc.message {
				if m, err := stream.Recv(); err != nil || string(m.GetPayload().GetBody()) != "first" {
					t.Fatalf("probe's first Recv = %v, %v; want first", m, err)
				}
			}
			// The headers are the server's answer, whenever they come.
			deadline := time.Now().Add(callTimeout)
			for b.State() != breaker.Closed && time.Now().Before(deadline) {
				time.Sleep(5 * ms)
			}
			if got := b.State(); got != breaker.Closed {
				t.Errorf("breaker %v while the answered probe stream is open, want closed", got)
			}
			if err := call(t, c); err != nil {
				t.Errorf("unary call while the answered probe stream is open: got %v, want nil", err)
			}
			stopProbe()
			if tc.message {
				if m, err := stream.Recv(); err != io.EOF {
					t.Errorf("probe's last Recv = %v, %v; want io.EOF", m, err)
				}
			} else if md, err := stream.Header(); err != nil || md.Get("watch")[0] != "on" {
				t.Errorf("probe's Header() = %v, %v; want watch: on", md, err)
			} else if m, err := stream.Recv(); err != io.EOF {
				t.Errorf("probe's Recv = %v, %v; want io.EOF", m, err)
			}
		})
	}
}

// The breaker keeps its word through a real server: 5 failed calls in a
// row trip it however slowly they come, here 300ms apart, past its 1s
// Window, whose rolling buckets would otherwise take the first failures
// back out of the run. The pace is a lower bound: a slower machine spreads
// the calls further, and the run trips all the same.
func TestBreakerTripsOnASlowRunOfFailedCalls(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{Unary: fail(codes.Unavailable).unary})
	ic, err := New(WithoutOverloadControl(), WithPolicy(policy.Policy{MaxAttempts: 1}),
		WithBreaker(breaker.Settings{ConsecutiveFailures: 5, Window: time.Second}))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, ic.DialOptions()...)
	b := ic.Breakers().Get(testserver.Target, testserver.MethodUnary)
	for i := range 5 {
		if i > 0 {
			time.Sleep(300 * time.Millisecond)
		}
		if err := call(t, c); status.Code(err) != codes.Unavailable || errors.Is(err, breaker.ErrOpen) {
			t.Fatalf("call %d: %v, want the server's Unavailable", i+1, err)
		}
	}
	if got := b.State(); got != breaker.Open {
		t.Fatalf("5 failed calls in a row over 1.2s: breaker %v, want open", got)
	}
	if err := call(t, c); !errors.Is(err, breaker.ErrOpen) {
		t.Errorf("the next call: %v, want refused by the open breaker", err)
	}
}
