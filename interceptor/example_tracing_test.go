package interceptor_test

import (
	"context"
	"fmt"
	"log"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/policy"
	"github.com/herdguard/herdguard/telemetry"
)

// flaky answers Unavailable to its first call, and then serves.
type flaky struct {
	testgrpc.UnimplementedTestServiceServer
	calls atomic.Int32
}

func (f *flaky) EmptyCall(context.Context, *testgrpc.Empty) (*testgrpc.Empty, error) {
	if f.calls.Add(1) == 1 {
		return nil, status.Error(codes.Unavailable, "restarting")
	}
	return &testgrpc.Empty{}, nil
}

// Tracing beside otelgrpc: herdguard's interceptors go on the ClientConn,
// otelgrpc's stats handler beside them, one tracer provider for both.
// Under the caller's span, herdguard records the call's span (named after
// the method), and under it an attempt span per attempt and a backoff span
// per wait (its attempt attribute: the attempt it waits for); otelgrpc's
// client span of each attempt is a child of herdguard's attempt span, so a
// trace shows which attempt each RPC was.
func ExampleWithTracerProvider_otelgrpc() {
	target, _, stop := serveFlaky() // a server on 127.0.0.1 that fails its first call
	defer stop()

	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(context.Background())

	ic, err := interceptor.New(interceptor.WithTracerProvider(tp),
		interceptor.WithPolicy(policy.Policy{InitialBackoff: time.Millisecond}))
	if err != nil {
		log.Fatal(err)
	}
	cc, err := grpc.NewClient(target, append(ic.DialOptions(),
		grpc.WithStatsHandler(otelgrpc.NewClientHandler(otelgrpc.WithTracerProvider(tp))),
		grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()

	ctx, span := tp.Tracer("shop").Start(context.Background(), "checkout")
	_, err = testgrpc.NewTestServiceClient(cc).EmptyCall(ctx, &testgrpc.Empty{})
	span.End()
	fmt.Println("call:", err)

	// The spans, as a tree under the caller's (children in start order).
	spans := rec.Ended()
	slices.SortFunc(spans, func(a, b sdktrace.ReadOnlySpan) int { return a.StartTime().Compare(b.StartTime()) })
	var print func(parent sdktrace.ReadOnlySpan, depth int)
	print = func(parent sdktrace.ReadOnlySpan, depth int) {
		for _, s := range spans {
			if s.Parent().SpanID() != parent.SpanContext().SpanID() {
				continue
			}
			line := strings.Repeat("  ", depth) + s.Name()
			for _, kv := range s.Attributes() {
				if kv.Key == telemetry.AttrAttempt {
					line += fmt.Sprintf(" %d", kv.Value.AsInt64())
				}
			}
			fmt.Println(line)
			print(s, depth+1)
		}
	}
	for _, s := range spans {
		if s.Name() == "checkout" {
			fmt.Println(s.Name())
			print(s, 1)
		}
	}
	// Output:
	// call: <nil>
	// checkout
	//   grpc.testing.TestService/EmptyCall
	//     attempt 1
	//       grpc.testing.TestService/EmptyCall
	//     backoff 2
	//     attempt 2
	//       grpc.testing.TestService/EmptyCall
}
