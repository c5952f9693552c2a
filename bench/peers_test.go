package bench

import (
	"context"
	"testing"
	"time"

	"github.com/failsafe-go/failsafe-go/circuitbreaker"
	"github.com/failsafe-go/failsafe-go/failsafegrpc"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"github.com/sony/gobreaker/v2"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	"github.com/herdguard/herdguard/cmd/stormlab"
	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/policy"
)

// A peer is one way to call: a name and the dial options that install it.
// backoff is the first wait of the peers that retry.
type peer struct {
	name string
	dial func(tb testing.TB, attempts int, backoff time.Duration) []grpc.DialOption
	// unary is the peer's interceptor alone, for the invoker-only figures;
	// nil for gRPC's built-in retry, which is no interceptor.
	unary func(tb testing.TB, attempts int, backoff time.Duration) grpc.UnaryClientInterceptor
}

func withUnary(f func(testing.TB, int, time.Duration) grpc.UnaryClientInterceptor) func(testing.TB, int, time.Duration) []grpc.DialOption {
	return func(tb testing.TB, n int, d time.Duration) []grpc.DialOption {
		return []grpc.DialOption{grpc.WithChainUnaryInterceptor(f(tb, n, d))}
	}
}

func ggmRetry(_ testing.TB, attempts int, backoff time.Duration) grpc.UnaryClientInterceptor {
	// its README's advice: exponential backoff with jitter, on chosen codes;
	// WithMax counts attempts in its code, whatever its docs say
	return retry.UnaryClientInterceptor(retry.WithMax(uint(attempts)), retry.WithCodes(codes.Unavailable),
		retry.WithBackoff(retry.BackoffExponentialWithJitter(backoff, 0.1)))
}

func failsafe(_ testing.TB, attempts int, backoff time.Duration) grpc.UnaryClientInterceptor {
	rp := failsafegrpc.NewRetryPolicyBuilder[any]().WithMaxAttempts(attempts).
		WithBackoff(max(backoff, time.Nanosecond), time.Minute).WithJitterFactor(0.1).Build()
	cb := circuitbreaker.NewBuilder[any]().WithFailureThreshold(5).WithDelay(5 * time.Second).Build()
	return failsafegrpc.NewUnaryClientInterceptor[any](rp, cb)
}

func gobreakerAlone(testing.TB, int, time.Duration) grpc.UnaryClientInterceptor {
	cb := gobreaker.NewCircuitBreaker[struct{}](gobreaker.Settings{})
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, inv grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		_, err := cb.Execute(func() (struct{}, error) { return struct{}{}, inv(ctx, method, req, reply, cc, opts...) })
		return err
	}
}

func herdguard(tb testing.TB, attempts int, backoff time.Duration, extra ...interceptor.Option) *interceptor.Interceptor {
	tb.Helper()
	p := policy.Default()
	p.MaxAttempts, p.InitialBackoff, p.MaxBackoff = attempts, max(backoff, 1), max(backoff, time.Minute)
	ic, err := interceptor.New(append([]interceptor.Option{interceptor.WithPolicy(p),
		interceptor.WithTracerProvider(noop.NewTracerProvider())}, extra...)...)
	if err != nil {
		tb.Fatal(err)
	}
	return ic
}

var peers = []peer{
	{name: "none", dial: func(testing.TB, int, time.Duration) []grpc.DialOption { return nil }},
	{name: "grpc-retry", dial: func(_ testing.TB, n int, d time.Duration) []grpc.DialOption {
		// Throttling off: the failure-path benchmark's two failures per
		// call would drain the bucket and make it measure refusals.
		return []grpc.DialOption{grpc.WithDefaultServiceConfig(stormlab.GRPCRetryConfig(n, max(d, time.Nanosecond), time.Minute, false))}
	}},
	{name: "ggm-retry", dial: withUnary(ggmRetry), unary: ggmRetry},
	{name: "failsafe", dial: withUnary(failsafe), unary: failsafe},
	{name: "gobreaker", dial: withUnary(gobreakerAlone), unary: gobreakerAlone},
	{name: "herdguard", dial: func(tb testing.TB, n int, d time.Duration) []grpc.DialOption {
		return herdguard(tb, n, d).DialOptions()
	},
		unary: func(tb testing.TB, n int, d time.Duration) grpc.UnaryClientInterceptor {
			return herdguard(tb, n, d).Unary()
		}},
}
