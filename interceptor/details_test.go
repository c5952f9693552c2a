package interceptor

import (
	"context"
	"errors"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/policy"
)

// withDetails returns a status error of code c carrying details.
func withDetails(t *testing.T, c codes.Code, details ...*errdetails.RetryInfo) error {
	t.Helper()
	st := status.New(c, "try later")
	for _, d := range details {
		var err error
		if st, err = st.WithDetails(d); err != nil {
			t.Fatal(err)
		}
	}
	return st.Err()
}

// quotaExceeded is a RESOURCE_EXHAUSTED with a google.rpc.QuotaFailure: a
// caller over its own quota.
func quotaExceeded(t *testing.T) error {
	t.Helper()
	st, err := status.New(codes.ResourceExhausted, "quota exceeded").WithDetails(
		&errdetails.QuotaFailure{Violations: []*errdetails.QuotaFailure_Violation{{Subject: "tenant:a", Description: "600/s over 100/s"}}})
	if err != nil {
		t.Fatal(err)
	}
	return st.Err()
}

func retryInfo(d time.Duration) *errdetails.RetryInfo {
	return &errdetails.RetryInfo{RetryDelay: durationpb.New(d)}
}

// A status that carries google.rpc.RetryInfo is retried no sooner than its
// retry_delay, whatever the backoff says; the waits after it grow from it
// (retry_delay × Multiplier), as the detail's documentation asks; a later
// RetryInfo is honoured again; and every wait counts against MaxAttempts.
func TestRetryInfoSetsTheWait(t *testing.T) {
	answers := []error{
		withDetails(t, codes.ResourceExhausted, retryInfo(300*time.Millisecond)),
		status.Error(codes.Unavailable, "no details"), // backs off from 300ms: 600ms
		withDetails(t, codes.Unavailable, retryInfo(50*time.Millisecond)),
		nil,
	}
	var n atomic.Int32
	srv := testserver.Start(t, &testserver.Server{Unary: func(context.Context, *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
		if err := answers[min(int(n.Add(1)), len(answers))-1]; err != nil {
			return nil, err
		}
		return &testgrpc.SimpleResponse{}, nil
	}})
	clk := newFakeClock()
	ic, err := New(withClock(clk), WithoutBreaker(), WithoutOverloadControl(),
		WithPolicy(policy.Policy{MaxAttempts: 4, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 5 * time.Second, Multiplier: 2, Jitter: policy.NoJitter}))
	if err != nil {
		t.Fatal(err)
	}
	if err := call(t, srv.Client(t, ic.DialOptions()...)); err != nil {
		t.Fatalf("call: %v, want the fourth attempt's answer", err)
	}
	want := []time.Duration{300 * time.Millisecond, 600 * time.Millisecond, 50 * time.Millisecond}
	if got := clk.Delays(); !slices.Equal(got, want) {
		t.Errorf("waits %v, want %v", got, want)
	}

	// Out of attempts, it fails loudly with the last status, RetryInfo
	// and all.
	n.Store(0)
	answers = []error{withDetails(t, codes.ResourceExhausted, retryInfo(time.Second))}
	ic, _ = New(withClock(newFakeClock()), WithoutBreaker(), WithoutOverloadControl(), WithPolicy(policy.Policy{MaxAttempts: 2}))
	err = call(t, srv.Client(t, ic.DialOptions()...))
	if status.Code(err) != codes.ResourceExhausted || n.Load() != 2 {
		t.Errorf("err %v after %d attempts, want ResourceExhausted after 2", err, n.Load())
	}
	// A retry_delay past the deadline is not waited: the call ends at
	// once with the status.
	n.Store(0)
	answers = []error{withDetails(t, codes.ResourceExhausted, retryInfo(time.Hour))}
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	_, err = srv.Client(t, ic.DialOptions()...).UnaryCall(ctx, &testgrpc.SimpleRequest{})
	var re *RetryError
	if status.Code(err) != codes.ResourceExhausted || n.Load() != 1 || !errors.As(err, &re) || re.Outcome != OutcomeDeadline {
		t.Errorf("err %v after %d attempts, want a RetryError of outcome %s after 1", err, n.Load(), OutcomeDeadline)
	}
}

// A tenant over its quota (RESOURCE_EXHAUSTED with google.rpc.QuotaFailure)
// sending 600 calls a second never paces the target nor trips its breaker:
// another tenant's calls to the same target go at once, one attempt each.
// The control, the same refusals without QuotaFailure, does both.
func TestQuotaFailureIsTheCallersOwn(t *testing.T) {
	for _, quota := range []bool{true, false} {
		name := map[bool]string{true: "QuotaFailure", false: "no detail (control)"}[quota]
		t.Run(name, func(t *testing.T) {
			refusal := status.Convert(status.Error(codes.ResourceExhausted, "quota exceeded"))
			if quota {
				refusal = status.Convert(quotaExceeded(t))
			}
			var others atomic.Int32
			srv := testserver.Start(t, &testserver.Server{Unary: func(ctx context.Context, _ *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
				md, _ := metadata.FromIncomingContext(ctx)
				if slices.Contains(md.Get("tenant"), "a") {
					return nil, refusal.Err()
				}
				others.Add(1)
				return &testgrpc.SimpleResponse{}, nil
			}})
			clk := newFakeClock()
			ic, err := New(withClock(clk), WithBreaker(breaker.Settings{ConsecutiveFailures: 5}))
			if err != nil {
				t.Fatal(err)
			}
			c := srv.Client(t, ic.DialOptions()...)
			a := metadata.AppendToOutgoingContext(context.Background(), "tenant", "a")
			for range 600 {
				_, err := c.UnaryCall(a, &testgrpc.SimpleRequest{})
				if quota && status.Code(err) != codes.ResourceExhausted {
					t.Fatalf("tenant a: %v, want ResourceExhausted", err)
				}
				clk.Advance(time.Second / 600)
			}
			paced, open := ic.Overloaded(testserver.Target), ic.Breakers().Get(testserver.Target, testserver.MethodUnary).State() != breaker.Closed
			if !quota {
				if !paced && !open {
					t.Fatal("control: 600 refusals for load neither paced the target nor tripped its breaker; the test shows nothing")
				}
				return
			}
			if paced || open {
				t.Errorf("a tenant's quota paced the target (%v) or tripped its breaker (%v)", paced, open)
			}
			for range 20 {
				if _, err := c.UnaryCall(context.Background(), &testgrpc.SimpleRequest{}); err != nil {
					t.Fatalf("tenant b: %v", err)
				}
			}
			if got := others.Load(); got != 20 {
				t.Errorf("tenant b: server saw %d attempts for 20 calls, want 20", got)
			}
		})
	}
}

// A policy's RetryIf decides on the whole status, details and message
// included, before the codes: it may retry a code the policy does not
// (here, INTERNAL with a RetryInfo), refuse one it does (a "permanent"
// RESOURCE_EXHAUSTED), or leave it to the codes. A call's own policy
// (CallPolicy) brings its own; a hedged call's says which failures are
// non-fatal.
func TestRetryIfDecidesOnTheWholeStatus(t *testing.T) {
	var script []error // the server's answers, in order; then OK
	var n atomic.Int32
	srv := testserver.Start(t, &testserver.Server{Unary: func(context.Context, *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
		if i := int(n.Add(1)) - 1; i < len(script) && script[i] != nil {
			return nil, script[i]
		}
		return &testgrpc.SimpleResponse{}, nil
	}})
	retryIf := func(st *status.Status) (retry, ok bool) {
		for _, d := range st.Details() {
			if _, hint := d.(*errdetails.RetryInfo); hint {
				return true, true
			}
		}
		if st.Message() == "permanent" {
			return false, true
		}
		return false, false
	}
	p := policy.Policy{MaxAttempts: 3, RetryIf: retryIf}
	ic, err := New(withClock(newFakeClock()), WithoutBreaker(), WithoutOverloadControl(), WithPolicy(p))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, ic.DialOptions()...)
	for _, tc := range []struct {
		name     string
		script   []error
		opts     []grpc.CallOption
		want     codes.Code
		attempts int32
	}{
		{"a code not retried, with RetryInfo", []error{withDetails(t, codes.Internal, retryInfo(time.Millisecond))}, nil, codes.OK, 2},
		{"a retried code, refused by message", []error{status.Error(codes.ResourceExhausted, "permanent")}, nil, codes.ResourceExhausted, 1},
		{"left to the codes", []error{status.Error(codes.Unavailable, "blip")}, nil, codes.OK, 2},
		{"left to the codes, not retried", []error{status.Error(codes.Internal, "bug")}, nil, codes.Internal, 1},
		{"a call's own RetryIf", []error{status.Error(codes.Unavailable, "blip")},
			[]grpc.CallOption{CallPolicy(policy.Policy{MaxAttempts: 3, RetryIf: func(*status.Status) (bool, bool) { return false, true }})}, codes.Unavailable, 1},
	} {
		script = tc.script
		n.Store(0)
		_, err := c.UnaryCall(context.Background(), &testgrpc.SimpleRequest{}, tc.opts...)
		if status.Code(err) != tc.want || n.Load() != tc.attempts {
			t.Errorf("%s: %v after %d attempts, want %v after %d", tc.name, err, n.Load(), tc.want, tc.attempts)
		}
	}

	// Hedged: with no NonFatalCodes every failure is fatal, but the one
	// RetryIf retries sends the next hedge at once. The hedging delay
	// never passes on the manual clock: only that failure sends it.
	for _, nonFatal := range []bool{false, true} {
		hedged := hedging(2)
		if nonFatal {
			hedged.RetryIf = func(st *status.Status) (bool, bool) { return st.Message() == "blip", true }
		}
		ic, err := New(withClock(newManualClock()), WithoutBreaker(), WithoutOverloadControl(), WithPolicy(hedged))
		if err != nil {
			t.Fatal(err)
		}
		script = []error{status.Error(codes.Unavailable, "blip")}
		n.Store(0)
		_, err = srv.Client(t, ic.DialOptions()...).UnaryCall(context.Background(), &testgrpc.SimpleRequest{})
		want, attempts := map[bool]codes.Code{false: codes.Unavailable, true: codes.OK}[nonFatal], map[bool]int32{false: 1, true: 2}[nonFatal]
		if status.Code(err) != want || n.Load() != attempts {
			t.Errorf("hedged, RetryIf %v: %v after %d attempts, want %v after %d", nonFatal, err, n.Load(), want, attempts)
		}
	}
}
