package interceptor

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/herdguard/herdguard/internal/wire"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/policy"
)

const ms = time.Millisecond

// tablePolicy waits 10, 20, 40, 80, 100, 100 ms without jitter.
var tablePolicy = policy.Policy{MaxAttempts: 7, InitialBackoff: 10 * ms, Multiplier: 2, MaxBackoff: 100 * ms, Jitter: policy.NoJitter}

func TestSuccessFirstTime(t *testing.T) {
	srv, c, clk, _ := setup(t, fail(codes.OK))
	if err := call(t, c); err != nil {
		t.Fatalf("call: %v", err)
	}
	if got := srv.Attempts(); !slices.Equal(got, []string{""}) {
		t.Errorf("server saw attempts %q, want one first attempt without %s", got, wire.AttemptKey)
	}
	if w := clk.Delays(); len(w) != 0 {
		t.Errorf("waited %v on a call that succeeded at once", w)
	}
}

func TestRetriesUntilSuccess(t *testing.T) {
	srv, c, clk, _ := setup(t, fail(codes.Unavailable, codes.ResourceExhausted, codes.Unavailable, codes.OK), WithPolicy(tablePolicy))
	if err := call(t, c); err != nil {
		t.Fatalf("call: %v", err)
	}
	if got, want := srv.Attempts(), []string{"", "2", "3", "4"}; !slices.Equal(got, want) {
		t.Errorf("server saw %s %q, want %q", wire.AttemptKey, got, want)
	}
	if got, want := clk.Delays(), []time.Duration{10 * ms, 20 * ms, 40 * ms}; !slices.Equal(got, want) {
		t.Errorf("waits %v, want %v", got, want)
	}
}

func TestBackoffTablesPerJitter(t *testing.T) {
	rs := []float64{0.5, 0.25, 1, 0, 0.5, 0.75}
	tests := []struct {
		j    policy.Jitter
		want []time.Duration
	}{
		{policy.NoJitter, []time.Duration{10 * ms, 20 * ms, 40 * ms, 80 * ms, 100 * ms, 100 * ms}},
		{policy.FullJitter, []time.Duration{5 * ms, 5 * ms, 40 * ms, 0, 50 * ms, 75 * ms}},
		{policy.EqualJitter, []time.Duration{7500 * time.Microsecond, 12500 * time.Microsecond, 40 * ms, 40 * ms, 75 * ms, 87500 * time.Microsecond}},
		{policy.DecorrelatedJitter, []time.Duration{20 * ms, 22500 * time.Microsecond, 67500 * time.Microsecond, 10 * ms, 20 * ms, 47500 * time.Microsecond}},
	}
	for _, tt := range tests {
		t.Run(tt.j.String(), func(t *testing.T) {
			p := tablePolicy
			p.Jitter = tt.j
			srv, c, clk, _ := setup(t, fail(codes.Unavailable), WithPolicy(p), withRand(fixedRand(rs...)), WithoutBreaker(), WithoutOverloadControl())
			err := call(t, c)
			if status.Code(err) != codes.Unavailable {
				t.Fatalf("call: %v, want Unavailable", err)
			}
			if got := srv.Requests(); got != 7 {
				t.Errorf("server saw %d attempts, want 7", got)
			}
			// the fake clock asks for a zero wait too: it is a real step of the loop
			got := clk.Delays()
			if tt.j == policy.FullJitter {
				got = slices.Insert(got, 3, 0) // a zero wait takes no timer
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("waits %v, want %v", got, tt.want)
			}
		})
	}
}

func TestExhaustedFailsLoudlyWithLastStatus(t *testing.T) {
	sc := &script{errs: []error{
		status.Error(codes.Unavailable, "first"),
		status.Error(codes.Unavailable, "second"),
		status.Error(codes.ResourceExhausted, "third and last"),
	}}
	srv, c, _, _ := setup(t, sc, WithPolicy(policy.Policy{MaxAttempts: 3}))
	err := call(t, c)
	var re *RetryError
	if !errors.As(err, &re) {
		t.Fatalf("err = %T %v, want a *RetryError", err, err)
	}
	if re.Attempts != 3 || re.Outcome != OutcomeExhausted {
		t.Errorf("RetryError = %+v, want 3 attempts, exhausted", re)
	}
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.ResourceExhausted || st.Message() != "third and last" {
		t.Errorf("status.FromError(err) = %v, %v; want the last attempt's status unchanged", st, ok)
	}
	if !strings.Contains(err.Error(), "3 attempt") || !strings.Contains(err.Error(), "third and last") {
		t.Errorf("err = %q, want the attempt count and the last message", err)
	}
	if got := srv.Requests(); got != 3 {
		t.Errorf("server saw %d attempts, want 3", got)
	}
}

func TestNotRetryable(t *testing.T) {
	for _, code := range []codes.Code{codes.InvalidArgument, codes.NotFound, codes.PermissionDenied, codes.Internal, codes.DeadlineExceeded} {
		t.Run(code.String(), func(t *testing.T) {
			srv, c, clk, _ := setup(t, fail(code, codes.OK))
			err := call(t, c)
			if status.Code(err) != code {
				t.Fatalf("err = %v, want %v", err, code)
			}
			var re *RetryError
			if errors.As(err, &re) {
				t.Errorf("a not-retryable failure came wrapped: %v", err)
			}
			if got := srv.Requests(); got != 1 {
				t.Errorf("server saw %d attempts, want 1", got)
			}
			if len(clk.Delays()) != 0 {
				t.Errorf("waited %v", clk.Delays())
			}
		})
	}
}

func TestRetryableCodesReplaceDefaults(t *testing.T) {
	p := policy.Policy{MaxAttempts: 3, RetryableCodes: []codes.Code{codes.Internal}}
	srv, c, _, _ := setup(t, fail(codes.Internal, codes.Unavailable, codes.OK), WithPolicy(p))
	if err := call(t, c); status.Code(err) != codes.Unavailable {
		t.Fatalf("err = %v, want Unavailable (not in RetryableCodes)", err)
	}
	if got := srv.Requests(); got != 2 {
		t.Errorf("server saw %d attempts, want 2", got)
	}
}

func TestPerAttemptTimeoutIsRetried(t *testing.T) {
	var n atomic.Int32 // the attempts run in handlers of their own
	srv := testserver.Start(t, &testserver.Server{Unary: func(ctx context.Context, _ *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
		if n.Add(1) == 1 {
			<-ctx.Done() // hang until the attempt's own timeout
			return nil, ctx.Err()
		}
		return &testgrpc.SimpleResponse{}, nil
	}})
	ic, err := New(WithPolicy(policy.Policy{MaxAttempts: 2, InitialBackoff: ms, PerAttemptTimeout: 100 * ms}))
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := call(t, srv.Client(t, ic.DialOptions()...)); err != nil {
		t.Fatalf("call: %v, want success on the second attempt", err)
	}
	if el := time.Since(start); el > 5*time.Second {
		t.Errorf("took %v: the per-attempt timeout did not cut the first attempt", el)
	}
	if got := srv.Requests(); got != 2 {
		t.Errorf("server saw %d attempts, want 2", got)
	}
}

func TestStopsBeforeWaitingIntoTheDeadline(t *testing.T) {
	// waits 1s, 2s, 4s: after the second wait 3s of a 5s deadline are gone,
	// so the third wait would cross it.
	p := policy.Policy{MaxAttempts: 10, InitialBackoff: time.Second, Multiplier: 2, MaxBackoff: time.Minute, Jitter: policy.NoJitter}
	srv, c, clk, _ := setup(t, fail(codes.Unavailable), WithPolicy(p), WithoutBreaker())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := c.UnaryCall(ctx, &testgrpc.SimpleRequest{})
	var re *RetryError
	if !errors.As(err, &re) || re.Outcome != OutcomeDeadline || re.Attempts != 3 {
		t.Fatalf("err = %v, want a RetryError with outcome deadline after 3 attempts", err)
	}
	if status.Code(err) != codes.Unavailable {
		t.Errorf("status.Code = %v, want the last attempt's Unavailable", status.Code(err))
	}
	if got, want := clk.Delays(), []time.Duration{time.Second, 2 * time.Second}; !slices.Equal(got, want) {
		t.Errorf("waits %v, want %v: it must not start a wait that ends past the deadline", got, want)
	}
	if got := srv.Requests(); got != 3 {
		t.Errorf("server saw %d attempts, want 3", got)
	}
}

func TestCancelDuringWaitReturnsPromptly(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	srv := testserver.Start(t, &testserver.Server{Unary: func(context.Context, *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
		time.AfterFunc(20*ms, cancel) // cancel while the client waits 10s
		return nil, status.Error(codes.Unavailable, "down")
	}})
	ic, err := New(WithPolicy(policy.Policy{MaxAttempts: 3, InitialBackoff: 10 * time.Second, Multiplier: 1, Jitter: policy.NoJitter}))
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err = srv.Client(t, ic.DialOptions()...).UnaryCall(ctx, &testgrpc.SimpleRequest{})
	if el := time.Since(start); el > 3*time.Second {
		t.Errorf("returned after %v; cancelling a 10s wait must return within milliseconds", el)
	}
	if status.Code(err) != codes.Canceled {
		t.Errorf("err = %v, want Canceled", err)
	}
	if got := srv.Requests(); got != 1 {
		t.Errorf("server saw %d attempts, want 1", got)
	}
}

func TestNeverRetriesWhenCallerIsDone(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	srv := testserver.Start(t, &testserver.Server{Unary: func(sctx context.Context, _ *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
		cancel()
		<-sctx.Done()
		return nil, status.Error(codes.Unavailable, "too late")
	}})
	clk := newFakeClock()
	ic, _ := New(withClock(clk))
	_, err := srv.Client(t, ic.DialOptions()...).UnaryCall(ctx, &testgrpc.SimpleRequest{})
	if status.Code(err) != codes.Canceled {
		t.Errorf("err = %v, want Canceled", err)
	}
	if got := srv.Requests(); got != 1 || len(clk.Delays()) != 0 {
		t.Errorf("server saw %d attempts and client waited %v; want 1 attempt, no wait", got, clk.Delays())
	}
}

func TestPushback(t *testing.T) {
	tests := []struct {
		name      string
		value     string
		wantN     int
		wantWaits []time.Duration
		wantErr   codes.Code
		outcome   Outcome
	}{
		// the pushback replaces the wait, then the backoff starts afresh (10ms)
		{"honoured", "250", 3, []time.Duration{250 * ms, 10 * ms}, codes.OK, OutcomeOK},
		{"zero", "0", 3, []time.Duration{10 * ms}, codes.OK, OutcomeOK},
		{"negative stops", "-1", 1, nil, codes.Unavailable, OutcomePushbackStop},
		{"malformed stops", "soon", 1, nil, codes.Unavailable, OutcomePushbackStop},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sc := fail(codes.Unavailable, codes.Unavailable, codes.OK)
			sc.trailers = map[int]metadata.MD{0: metadata.Pairs(wire.PushbackKey, tt.value)}
			srv, c, clk, _ := setup(t, sc, WithPolicy(tablePolicy))
			err := call(t, c)
			if status.Code(err) != tt.wantErr {
				t.Fatalf("err = %v, want %v", err, tt.wantErr)
			}
			var re *RetryError
			if tt.outcome == OutcomePushbackStop && (!errors.As(err, &re) || re.Outcome != OutcomePushbackStop) {
				t.Errorf("err = %v, want a RetryError with outcome pushback_stop", err)
			}
			if got := srv.Requests(); got != tt.wantN {
				t.Errorf("server saw %d attempts, want %d", got, tt.wantN)
			}
			if got := clk.Delays(); !slices.Equal(got, tt.wantWaits) {
				t.Errorf("waits %v, want %v", got, tt.wantWaits)
			}
		})
	}
}

func TestPushbackParse(t *testing.T) {
	tests := []struct {
		md          metadata.MD
		wait        time.Duration
		ok, present bool
	}{
		{nil, 0, false, false},
		{metadata.Pairs(wire.PushbackKey, "15"), 15 * ms, true, true},
		{metadata.Pairs(wire.PushbackKey, "-5"), 0, false, true},
		{metadata.Pairs(wire.PushbackKey, "1.5"), 0, false, true},
		{metadata.Pairs(wire.PushbackKey, "99999999999999999999"), 0, false, true},
		{metadata.Pairs(wire.PushbackKey, "1", wire.PushbackKey, "2"), 0, false, true},
	}
	for _, tt := range tests {
		w, ok, present := pushback(tt.md)
		if w != tt.wait || ok != tt.ok || present != tt.present {
			t.Errorf("pushback(%v) = %v, %v, %v; want %v, %v, %v", tt.md, w, ok, present, tt.wait, tt.ok, tt.present)
		}
	}
}

func TestPolicyPrecedence(t *testing.T) {
	one := policy.Policy{MaxAttempts: 1}
	two := policy.Policy{MaxAttempts: 2}
	four := policy.Policy{MaxAttempts: 4}
	five := policy.Policy{MaxAttempts: 5}
	tests := []struct {
		name  string
		opts  []Option
		call  []grpc.CallOption
		wantN int
	}{
		{"default", nil, nil, 3},
		{"WithPolicy", []Option{WithPolicy(two)}, nil, 2},
		{"service over default", []Option{WithPolicy(two), WithMethodPolicy("/grpc.testing.TestService/", four)}, nil, 4},
		{"method over service", []Option{WithMethodPolicy("/grpc.testing.TestService/", four), WithMethodPolicy(testserver.MethodUnary, five)}, nil, 5},
		{"other method's policy unused", []Option{WithMethodPolicy(testserver.MethodEmpty, five)}, nil, 3},
		{"other service's policy unused", []Option{WithMethodPolicy("/other.Svc/", five)}, nil, 3},
		{"last WithMethodPolicy wins", []Option{WithMethodPolicy(testserver.MethodUnary, five), WithMethodPolicy(testserver.MethodUnary, two)}, nil, 2},
		{"CallPolicy over method", []Option{WithMethodPolicy(testserver.MethodUnary, five)}, []grpc.CallOption{CallPolicy(two)}, 2},
		{"NoRetry", []Option{WithPolicy(five)}, []grpc.CallOption{NoRetry()}, 1},
		{"NoRetry over CallPolicy", nil, []grpc.CallOption{CallPolicy(four), NoRetry()}, 1},
		{"MaxAttempts 1", []Option{WithPolicy(one)}, nil, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv, c, _, _ := setup(t, fail(codes.Unavailable), append(tt.opts, WithoutBreaker())...)
			if err := call(t, c, tt.call...); status.Code(err) != codes.Unavailable {
				t.Fatalf("err = %v, want Unavailable", err)
			}
			if got := srv.Requests(); got != tt.wantN {
				t.Errorf("server saw %d attempts, want %d", got, tt.wantN)
			}
		})
	}
}

func TestInvalidCallPolicyFailsWithoutSending(t *testing.T) {
	srv, c, _, _ := setup(t, fail(codes.OK))
	err := call(t, c, CallPolicy(policy.Policy{MaxAttempts: -2}))
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "MaxAttempts") || !strings.Contains(err.Error(), "-2") {
		t.Errorf("err = %v, want InvalidArgument naming MaxAttempts and -2", err)
	}
	if got := srv.Requests(); got != 0 {
		t.Errorf("server saw %d requests, want none", got)
	}
}

func TestNewRejectsBadConfiguration(t *testing.T) {
	tests := []struct {
		name string
		opt  Option
		want []string
	}{
		{"negative attempts", WithPolicy(policy.Policy{MaxAttempts: -1}), []string{"WithPolicy", "MaxAttempts", "-1"}},
		{"negative backoff", WithPolicy(policy.Policy{InitialBackoff: -ms}), []string{"InitialBackoff", "-1ms"}},
		{"max below initial", WithPolicy(policy.Policy{InitialBackoff: time.Second, MaxBackoff: ms}), []string{"MaxBackoff", "1ms"}},
		{"multiplier NaN", WithPolicy(policy.Policy{Multiplier: nan()}), []string{"Multiplier", "NaN"}},
		{"multiplier below 1", WithPolicy(policy.Policy{Multiplier: 0.9}), []string{"Multiplier", "0.9"}},
		{"unknown jitter", WithPolicy(policy.Policy{Jitter: 12}), []string{"Jitter", "12"}},
		{"OK retryable", WithPolicy(policy.Policy{RetryableCodes: []codes.Code{codes.OK}}), []string{"RetryableCodes[0]", "OK"}},
		{"Canceled retryable", WithPolicy(policy.Policy{RetryableCodes: []codes.Code{codes.Canceled}}), []string{"RetryableCodes[0]", "Canceled"}},
		{"unknown code", WithPolicy(policy.Policy{RetryableCodes: []codes.Code{99}}), []string{"RetryableCodes[0]", "99"}},
		{"method without slash", WithMethodPolicy("pkg.Svc/M", policy.Policy{}), []string{"WithMethodPolicy", `"pkg.Svc/M"`}},
		{"method with extra part", WithMethodPolicy("/pkg.Svc/M/x", policy.Policy{}), []string{`"/pkg.Svc/M/x"`}},
		{"method without service", WithMethodPolicy("//M", policy.Policy{}), []string{`"//M"`}},
		{"method policy invalid", WithMethodPolicy("/pkg.Svc/M", policy.Policy{PerAttemptTimeout: -ms}), []string{"/pkg.Svc/M", "PerAttemptTimeout", "-1ms"}},
		{"breaker ratio", WithBreaker(breaker.Settings{FailureRatio: 2}), []string{"WithBreaker", "FailureRatio", "2"}},
		{"breaker timeout", WithBreaker(breaker.Settings{OpenTimeout: -time.Second}), []string{"OpenTimeout", "-1s"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ic, err := New(tt.opt)
			if err == nil || ic != nil {
				t.Fatalf("New = %v, %v; want nil and an error", ic, err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not name %s", err, w)
				}
			}
		})
	}
	if _, err := New(WithBreaker(breaker.Settings{FailureRatio: 2}), WithoutBreaker()); err != nil {
		t.Errorf("settings of a breaker turned off must not matter: %v", err)
	}
	if _, err := New(nil, WithTracerProvider(nil), WithMeterProvider(nil)); err != nil {
		t.Errorf("nil options must be ignored: %v", err)
	}
}

func nan() float64 { z := 0.0; return z / z }

// TestInterceptorOrder checks what DialOptions promises: an interceptor
// chained before herdguard runs once per call, one after it once per attempt.
func TestInterceptorOrder(t *testing.T) {
	srv := testserver.Start(t, &testserver.Server{Unary: fail(codes.Unavailable, codes.Unavailable, codes.OK).unary})
	ic, _ := New(withClock(newFakeClock()))
	var outer, inner int
	count := func(n *int) grpc.UnaryClientInterceptor {
		return func(ctx context.Context, m string, req, reply any, cc *grpc.ClientConn, inv grpc.UnaryInvoker, o ...grpc.CallOption) error {
			*n++
			return inv(ctx, m, req, reply, cc, o...)
		}
	}
	opts := append([]grpc.DialOption{grpc.WithChainUnaryInterceptor(count(&outer))}, ic.DialOptions()...)
	opts = append(opts, grpc.WithChainUnaryInterceptor(count(&inner)))
	if err := call(t, srv.Client(t, opts...)); err != nil {
		t.Fatal(err)
	}
	if outer != 1 || inner != 3 {
		t.Errorf("outer ran %d times, inner %d; want 1 and 3", outer, inner)
	}
}

// TestSingleAttemptErrorAsIs: a call allowed one attempt returns that
// attempt's error as it is, not wrapped in a RetryError.
func TestSingleAttemptErrorAsIs(t *testing.T) {
	down := status.Error(codes.Unavailable, "regress: down")
	srv := testserver.Start(t, &testserver.Server{
		Unary: func(context.Context, *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
			return nil, down
		},
		ServerStream: func(*testgrpc.StreamingOutputCallRequest, testgrpc.TestService_StreamingOutputCallServer) error {
			return down
		},
	})
	one := policy.Policy{MaxAttempts: 1}
	for _, tt := range []struct {
		name string
		opts []Option
		call []grpc.CallOption
	}{
		{"NoRetry", nil, []grpc.CallOption{NoRetry()}},
		{"CallPolicy", nil, []grpc.CallOption{CallPolicy(one)}},
		{"WithPolicy", []Option{WithPolicy(one)}, nil},
	} {
		for _, k := range []struct {
			name string
			run  func(context.Context, testgrpc.TestServiceClient, ...grpc.CallOption) error
		}{
			{"unary", func(ctx context.Context, c testgrpc.TestServiceClient, opts ...grpc.CallOption) error {
				_, err := c.UnaryCall(ctx, &testgrpc.SimpleRequest{}, opts...)
				return err
			}},
			{"server stream", func(ctx context.Context, c testgrpc.TestServiceClient, opts ...grpc.CallOption) error {
				s, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{}, opts...)
				if err != nil {
					return err
				}
				_, err = s.Recv()
				return err
			}},
		} {
			t.Run(tt.name+"/"+k.name, func(t *testing.T) {
				c, _ := streamClient(t, srv, append(tt.opts, WithoutBreaker())...)
				n := srv.Requests()
				err := k.run(ctxT(t), c, tt.call...)
				if errors.As(err, new(*RetryError)) {
					t.Errorf("got %v, a *RetryError; want the attempt's error as it is", err)
				}
				if err == nil || err.Error() != down.Error() {
					t.Errorf("got %v, want %q", err, down.Error())
				}
				if got := srv.Requests() - n; got != 1 {
					t.Errorf("server saw %d attempts, want 1", got)
				}
			})
		}
	}
}
