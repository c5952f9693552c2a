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

	"github.com/herdguard/herdguard"
	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/policy"
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
	srv, c, clk, ic := setup(t, fail(codes.Unavailable), WithBreaker(breaker.Settings{ConsecutiveFailures: 2}))
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
	sent, waits := srv.Requests(), len(clk.Waits())

	err := call(t, c)
	if !errors.Is(err, breaker.ErrOpen) || status.Code(err) != codes.Unavailable {
		t.Fatalf("err = %v, want ErrOpen with code Unavailable", err)
	}
	if !strings.Contains(err.Error(), testserver.Target) {
		t.Errorf("err = %q, want it to name the scope %q", err, testserver.Target)
	}
	if srv.Requests() != sent || len(clk.Waits()) != waits {
		t.Errorf("an open breaker sent %d attempts and waited %d times; want none", srv.Requests()-sent, len(clk.Waits())-waits)
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

// TestBreakerHalfOpenProbeIsOneAttempt runs in real time: gobreaker reads
// the wall clock. The open period is short and the wait for it generous.
func TestBreakerHalfOpenProbeIsOneAttempt(t *testing.T) {
	const openTimeout = 50 * ms
	sc := fail(codes.Unavailable)
	srv, c, _, ic := setup(t, sc, WithBreaker(breaker.Settings{ConsecutiveFailures: 1, OpenTimeout: openTimeout}))
	b := ic.Breakers().Get(testserver.Target, testserver.MethodUnary)
	call(t, c)
	if b.State() != breaker.Open {
		t.Fatalf("breaker %v, want open", b.State())
	}
	waitHalfOpen(t, b)

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

	waitHalfOpen(t, b)
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

func waitHalfOpen(t *testing.T, b *breaker.Breaker) {
	t.Helper()
	deadline := time.Now().Add(callTimeout)
	for b.State() != breaker.HalfOpen {
		if time.Now().After(deadline) {
			t.Fatalf("breaker still %v after %v", b.State(), callTimeout)
		}
		time.Sleep(5 * ms)
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
