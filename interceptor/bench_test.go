package interceptor

import (
	"context"
	"testing"
	"time"

	"github.com/sony/gobreaker/v2"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/policy"
)

// The interceptor alone, called with an invoker that does nothing: the only
// figure steady enough on a shared machine to compare.

func nopInvoker(context.Context, string, any, any, *grpc.ClientConn, ...grpc.CallOption) error {
	return nil
}

func benchInterceptorAlone(b *testing.B, opts ...Option) {
	benchInterceptorAloneCalled(b, nil, opts...)
}

// benchInterceptorAloneCalled is benchInterceptorAlone for calls made with
// callOpts.
func benchInterceptorAloneCalled(b *testing.B, callOpts []grpc.CallOption, opts ...Option) {
	u, cc := alone(b, opts...)
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if err := u(ctx, testserver.MethodUnary, nil, nil, cc, nopInvoker, callOpts...); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkUnaryAlone(b *testing.B) {
	b.Run("retry+breaker/tracing=off", func(b *testing.B) {
		benchInterceptorAlone(b, WithTracerProvider(noop.NewTracerProvider()))
	})
	b.Run("retry+breaker/overload=off/tracing=off", func(b *testing.B) {
		benchInterceptorAlone(b, WithTracerProvider(noop.NewTracerProvider()), WithoutOverloadControl())
	})
	b.Run("retry/tracing=off", func(b *testing.B) {
		benchInterceptorAlone(b, WithTracerProvider(noop.NewTracerProvider()), WithoutBreaker())
	})
	// As generated clients call: with grpc.StaticMethod.
	b.Run("retry+breaker/static-method/tracing=off", func(b *testing.B) {
		benchInterceptorAloneCalled(b, []grpc.CallOption{grpc.StaticMethod()}, WithTracerProvider(noop.NewTracerProvider()))
	})
	b.Run("retry+breaker/tracing=global-unset", func(b *testing.B) {
		benchInterceptorAlone(b)
	})
	b.Run("retry+breaker/tracing=sdk", func(b *testing.B) {
		tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(tracetest.NewSpanRecorder()))
		benchInterceptorAlone(b, WithTracerProvider(tp))
	})
}

// BenchmarkUnaryFailurePathAlone: a call that needs 3 attempts, with 1ns
// backoff so the figure is the machinery's own cost, against a hand-written
// retry loop over the same invoker.
func BenchmarkUnaryFailurePathAlone(b *testing.B) {
	errUnavailable := status.Error(codes.Unavailable, "down")
	newInvoker := func() grpc.UnaryInvoker {
		n := 0
		return func(context.Context, string, any, any, *grpc.ClientConn, ...grpc.CallOption) error {
			n++
			if n%3 != 0 {
				return errUnavailable
			}
			return nil
		}
	}
	cc, err := grpc.NewClient(testserver.Target, grpc.WithTransportCredentials(insecureCreds()))
	if err != nil {
		b.Fatal(err)
	}
	defer cc.Close()
	ctx := context.Background()
	b.Run("hand-written", func(b *testing.B) {
		inv := newInvoker()
		b.ReportAllocs()
		for b.Loop() {
			handWrittenRetry(ctx, testserver.MethodUnary, nil, nil, cc, inv)
		}
	})
	// Two attempts in three refused: the overload controller would pace
	// them; this measures the retries. With hooks that do nothing, the
	// cost of telling them (two OnRetry a call).
	for _, hooked := range []bool{false, true} {
		name := "herdguard"
		opts := []Option{WithTracerProvider(noop.NewTracerProvider()), WithoutOverloadControl(),
			WithPolicy(policy.Policy{MaxAttempts: 3, InitialBackoff: 1, MaxBackoff: 1})}
		if hooked {
			name += "/hooks=nop"
			opts = append(opts, WithHooks(Hooks{
				OnRetry:         func(context.Context, RetryEvent) {},
				OnGiveUp:        func(context.Context, GiveUpEvent) {},
				OnHeld:          func(context.Context, HeldEvent) {},
				OnBreakerChange: func(context.Context, BreakerEvent) {},
			}))
		}
		b.Run(name, func(b *testing.B) {
			ic, _ := New(opts...)
			u, inv := ic.Unary(), newInvoker()
			b.ReportAllocs()
			for b.Loop() {
				if err := u(ctx, testserver.MethodUnary, nil, nil, cc, inv); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// handWrittenRetry is the loop a user would write: up to 3 attempts of
// Unavailable, a 1ns timer between them, stopping when ctx is done.
func handWrittenRetry(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, inv grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	for attempt := 1; ; attempt++ {
		err := inv(ctx, method, req, reply, cc, opts...)
		if err == nil || status.Code(err) != codes.Unavailable || attempt == 3 {
			return err
		}
		t := time.NewTimer(time.Nanosecond)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return status.FromContextError(ctx.Err()).Err()
		}
	}
}

// BenchmarkGobreakerAlone is the reference the success path is held to:
// sony/gobreaker's Execute around the invoker, in an interceptor.
func BenchmarkGobreakerAlone(b *testing.B) {
	cb := gobreaker.NewCircuitBreaker[struct{}](gobreaker.Settings{})
	u := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, inv grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		_, err := cb.Execute(func() (struct{}, error) { return struct{}{}, inv(ctx, method, req, reply, cc, opts...) })
		return err
	}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if err := u(ctx, testserver.MethodUnary, nil, nil, nil, nopInvoker); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkUnaryBufconn is the whole call over bufconn. Its time varies a
// lot between runs; compare allocations.
func BenchmarkUnaryBufconn(b *testing.B) {
	run := func(b *testing.B, dial ...grpc.DialOption) {
		srv := testserver.Start(b, &testserver.Server{NoRecord: true, Unary: func(context.Context, *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
			return &testgrpc.SimpleResponse{}, nil
		}})
		c := srv.Client(b, dial...)
		ctx := context.Background()
		req := &testgrpc.SimpleRequest{}
		b.ReportAllocs()
		for b.Loop() {
			if _, err := c.UnaryCall(ctx, req); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.Run("no-interceptor", func(b *testing.B) { run(b) })
	b.Run("herdguard/tracing=off", func(b *testing.B) {
		ic, _ := New(WithTracerProvider(noop.NewTracerProvider()))
		run(b, ic.DialOptions()...)
	})
	b.Run("herdguard/tracing=sdk", func(b *testing.B) {
		tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(tracetest.NewSpanRecorder()))
		ic, _ := New(WithTracerProvider(tp))
		run(b, ic.DialOptions()...)
	})
}
