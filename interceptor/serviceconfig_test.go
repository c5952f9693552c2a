package interceptor

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/policy"
)

func TestWithServiceConfig(t *testing.T) {
	const sc = `{"methodConfig": [
	  {"name": [{"service": "grpc.testing.TestService"}],
	   "retryPolicy": {"maxAttempts": 4, "initialBackoff": "0.01s", "maxBackoff": "0.1s",
	     "backoffMultiplier": 2, "retryableStatusCodes": ["INTERNAL"]}},
	  {"name": [{"service": "grpc.testing.TestService", "method": "EmptyCall"}], "timeout": "0.05s"}],
	 "retryThrottling": {"maxTokens": 100, "tokenRatio": 1}}`
	sleepy := func(ctx context.Context, _ *testgrpc.Empty) (*testgrpc.Empty, error) {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	srv := testserver.Start(t, &testserver.Server{Unary: fail(codes.Internal).unary, Empty: sleepy})
	ic, err := New(withClock(newFakeClock()), WithoutBreaker(), WithServiceConfig(sc))
	if err != nil {
		t.Fatal(err)
	}
	if ic.throttling == nil || ic.throttling.MaxTokens != 100 {
		t.Errorf("retryThrottling not taken: %+v", ic.throttling)
	}
	c := srv.Client(t, ic.DialOptions()...)
	if err := call(t, c); status.Code(err) != codes.Internal {
		t.Fatalf("err = %v", err)
	}
	if n := srv.Requests(); n != 4 {
		t.Errorf("server saw %d attempts, want the service config's 4 (INTERNAL retryable)", n)
	}
	start := time.Now()
	_, err = c.EmptyCall(context.Background(), &testgrpc.Empty{})
	if status.Code(err) != codes.DeadlineExceeded || time.Since(start) > 5*time.Second {
		t.Errorf("EmptyCall: %v after %v; want DeadlineExceeded from the 50ms timeout", err, time.Since(start))
	}

	// a later option overrides the config
	ic, _ = New(withClock(newFakeClock()), WithoutBreaker(), WithServiceConfig(sc),
		WithMethodPolicy("/grpc.testing.TestService/", policy.Policy{MaxAttempts: 2, RetryableCodes: []codes.Code{codes.Internal}}))
	n := srv.Requests()
	call(t, srv.Client(t, ic.DialOptions()...))
	if d := srv.Requests() - n; d != 2 {
		t.Errorf("server saw %d attempts, want 2 from the later WithMethodPolicy", d)
	}
}

// TestServiceConfigLeavesOtherMethodsAlone: as in gRPC, a method that no
// method config covers makes a single attempt, while gRPC's own retry runs
// beside it as a control.
func TestServiceConfigLeavesOtherMethodsAlone(t *testing.T) {
	const sc = `{"methodConfig": [{"name": [{"service": "grpc.testing.TestService", "method": "EmptyCall"}],
	   "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.01s",
	     "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]}}]}`
	ic, err := New(withClock(newFakeClock()), WithoutBreaker(), WithServiceConfig(sc))
	if err != nil {
		t.Fatal(err)
	}
	for _, mode := range []struct {
		name string
		dial []grpc.DialOption
	}{
		{"grpc", []grpc.DialOption{grpc.WithDefaultServiceConfig(sc)}},
		{"herdguard", ic.DialOptions()},
	} {
		t.Run(mode.name, func(t *testing.T) {
			srv := testserver.Start(t, &testserver.Server{Unary: fail(codes.Unavailable).unary, Empty: fail(codes.Unavailable).empty})
			c := srv.Client(t, mode.dial...)
			ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
			defer cancel()
			if _, err := c.EmptyCall(ctx, &testgrpc.Empty{}); status.Code(err) != codes.Unavailable {
				t.Fatalf("EmptyCall: %v", err)
			}
			if n := srv.Requests(); n != 3 {
				t.Errorf("EmptyCall: server saw %d attempts, want the config's 3", n)
			}
			if err := call(t, c); status.Code(err) != codes.Unavailable {
				t.Fatalf("UnaryCall: %v", err)
			}
			if n := srv.Requests() - 3; n != 1 {
				t.Errorf("UnaryCall, named by no method config: server saw %d attempts, want 1", n)
			}
		})
	}
	// without methodConfig, the config sets no policy
	ic, err = New(WithServiceConfig(`{"retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := ic.policy.p.MaxAttempts; got != policy.DefaultMaxAttempts {
		t.Errorf("a config with no methodConfig set MaxAttempts %d, want the default %d", got, policy.DefaultMaxAttempts)
	}
}

func TestWithServiceConfigErrors(t *testing.T) {
	_, err := New(WithServiceConfig(`{"methodConfig": [{"name": [{"service": "a.B"}], "retryPolicy": {"maxAttempts": 0}}]}`))
	if err == nil || !strings.Contains(err.Error(), "WithServiceConfig") || !strings.Contains(err.Error(), "methodConfig[0].retryPolicy.maxAttempts = 0") {
		t.Errorf("New = %v, want an error naming the option, the JSON path and the value", err)
	}
	if _, err := New(WithServiceConfig(`{`)); err == nil {
		t.Error("New accepted malformed JSON")
	}
}

// A retryPolicy's perAttemptRecvTimeout bounds each attempt: one that the
// server does not answer in time ends with DeadlineExceeded and is retried,
// though DEADLINE_EXCEEDED is not among the retryable codes.
func TestServiceConfigPerAttemptRecvTimeout(t *testing.T) {
	const sc = `{"methodConfig": [{"name": [{"service": "grpc.testing.TestService"}],
	   "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.1s",
	     "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"], "perAttemptRecvTimeout": "0.05s"}}]}`
	var attempts atomic.Int32
	srv := testserver.Start(t, &testserver.Server{Empty: func(ctx context.Context, _ *testgrpc.Empty) (*testgrpc.Empty, error) {
		if attempts.Add(1) == 1 {
			<-ctx.Done() // the first attempt hangs until its own deadline
			return nil, ctx.Err()
		}
		return &testgrpc.Empty{}, nil
	}})
	ic, err := New(withClock(newFakeClock()), WithoutBreaker(), WithServiceConfig(sc))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	if _, err := srv.Client(t, ic.DialOptions()...).EmptyCall(ctx, &testgrpc.Empty{}); err != nil {
		t.Fatalf("EmptyCall: %v; want the second attempt's answer", err)
	}
	if n := attempts.Load(); n != 2 {
		t.Errorf("server saw %d attempts, want 2", n)
	}
}
