package bench

import (
	"context"
	"io"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/herdguard/herdguard/internal/wire"

	"github.com/failsafe-go/failsafe-go/failsafegrpc"
	"github.com/failsafe-go/failsafe-go/hedgepolicy"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/policy"
)

// Sub-benchmarks are named peer=NAME, so `benchstat -col /peer` puts the
// peers side by side.

func nopInvoker(context.Context, string, any, any, *grpc.ClientConn, ...grpc.CallOption) error {
	return nil
}

// BenchmarkInterceptorAlone is each interceptor called with an invoker
// that does nothing: the figure steady enough to compare on a shared
// machine. gRPC's built-in retry is not an interceptor and is absent.
func BenchmarkInterceptorAlone(b *testing.B) {
	cc, err := grpc.NewClient(testserver.Target, grpc.WithTransportCredentials(insecureCreds()))
	if err != nil {
		b.Fatal(err)
	}
	defer cc.Close()
	// herdguard without its overload controller: what the controller costs
	// a healthy call, side by side.
	bare := peer{name: "herdguard-no-overload", unary: func(tb testing.TB, n int, d time.Duration) grpc.UnaryClientInterceptor {
		return herdguard(tb, n, d, interceptor.WithoutOverloadControl()).Unary()
	}}
	for _, p := range append(peers[:len(peers):len(peers)], bare) {
		if p.unary == nil {
			continue
		}
		b.Run("peer="+p.name, func(b *testing.B) {
			u := p.unary(b, 3, 100*time.Millisecond)
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				if err := u(ctx, testserver.MethodUnary, nil, nil, cc, nopInvoker); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkBreakerContention runs the interceptors that hold a breaker from
// many goroutines at once.
func BenchmarkBreakerContention(b *testing.B) {
	cc, err := grpc.NewClient(testserver.Target, grpc.WithTransportCredentials(insecureCreds()))
	if err != nil {
		b.Fatal(err)
	}
	defer cc.Close()
	for _, p := range peers {
		if p.name != "gobreaker" && p.name != "herdguard" && p.name != "failsafe" {
			continue
		}
		b.Run("peer="+p.name, func(b *testing.B) {
			u := p.unary(b, 3, 100*time.Millisecond)
			b.ReportAllocs()
			b.SetParallelism(32)
			b.RunParallel(func(pb *testing.PB) {
				ctx := context.Background()
				for pb.Next() {
					if err := u(ctx, testserver.MethodUnary, nil, nil, cc, nopInvoker); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}

func okServer(tb testing.TB) *testserver.Server {
	return testserver.Start(tb, &testserver.Server{NoRecord: true, Unary: func(context.Context, *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
		return &testgrpc.SimpleResponse{}, nil
	}})
}

// BenchmarkUnarySuccess is a whole call over bufconn, tracing off. Its time
// varies between runs; compare allocations.
//
// "hand-written-a6" is the retry loop with gRFC A6's rules (see
// handWrittenA6): what catching the header and the trailer costs a call
// that needs no retry.
func BenchmarkUnarySuccess(b *testing.B) {
	srv := okServer(b)
	req := &testgrpc.SimpleRequest{}
	for _, p := range append(peers[:len(peers):len(peers)], loop("hand-written-a6", handWrittenA6)) {
		b.Run("peer="+p.name, func(b *testing.B) {
			c := srv.Client(b, p.dial(b, 3, 100*time.Millisecond)...)
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				if _, err := c.UnaryCall(ctx, req); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkUnarySuccessParallel is the same call from many goroutines.
func BenchmarkUnarySuccessParallel(b *testing.B) {
	srv := okServer(b)
	for _, p := range peers {
		b.Run("peer="+p.name, func(b *testing.B) {
			c := srv.Client(b, p.dial(b, 3, 100*time.Millisecond)...)
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				ctx, req := context.Background(), &testgrpc.SimpleRequest{}
				for pb.Next() {
					if _, err := c.UnaryCall(ctx, req); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}

// BenchmarkUnaryTraced is a whole call with tracing to the SDK and an
// in-memory exporter: herdguard's own spans against otelgrpc's stats
// handler alone.
func BenchmarkUnaryTraced(b *testing.B) {
	srv := okServer(b)
	req := &testgrpc.SimpleRequest{}
	newTP := func() *sdktrace.TracerProvider {
		return sdktrace.NewTracerProvider(sdktrace.WithSyncer(tracetest.NewInMemoryExporter()))
	}
	for _, tc := range []struct {
		name string
		dial func() []grpc.DialOption
	}{
		{"otelgrpc", func() []grpc.DialOption {
			return []grpc.DialOption{grpc.WithStatsHandler(otelgrpc.NewClientHandler(otelgrpc.WithTracerProvider(newTP())))}
		}},
		{"herdguard", func() []grpc.DialOption {
			return herdguard(b, 3, 100*time.Millisecond, interceptor.WithTracerProvider(newTP())).DialOptions()
		}},
	} {
		b.Run("peer="+tc.name, func(b *testing.B) {
			c := srv.Client(b, tc.dial()...)
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				if _, err := c.UnaryCall(ctx, req); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkUnaryFailure3 is a call that needs 3 attempts (the first two
// fail with Unavailable), with a 1 ns backoff so the figure is the retry
// machinery's own cost. "hand-written" is the loop a user would write, with
// a timer for each wait; "hand-written-nowait" retries at once, and
// "hand-written-pushback" too but reads the server's pushback, which costs
// gRPC's copy of every failed attempt's trailer, as it costs herdguard;
// "hand-written-a6" has herdguard's wire behaviour and gRFC A6's rules
// without waiting: the attempt number, the pushback and the commit on
// response headers.
func BenchmarkUnaryFailure3(b *testing.B) {
	var n atomic.Int64
	srv := testserver.Start(b, &testserver.Server{NoRecord: true, Unary: func(context.Context, *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
		if n.Add(1)%3 != 0 {
			return nil, status.Error(codes.Unavailable, "down")
		}
		return &testgrpc.SimpleResponse{}, nil
	}})
	all := append([]peer{
		loop("hand-written", handWritten),
		loop("hand-written-nowait", handWrittenNoWait),
		loop("hand-written-pushback", handWrittenPushback),
		loop("hand-written-a6", handWrittenA6),
	}, peers...)
	req := &testgrpc.SimpleRequest{}
	for _, p := range all {
		if p.name == "none" || p.name == "gobreaker" {
			continue // they do not retry
		}
		// herdguard runs with its defaults, the overload controller on:
		// two attempts in three refused whatever the load are no
		// overload: refused as much at a lowered rate, they are the
		// server's own, and the pacing they start ends.
		b.Run("peer="+p.name, func(b *testing.B) {
			c := srv.Client(b, p.dial(b, 3, time.Nanosecond)...)
			ctx := context.Background()
			n.Store(0)
			b.ReportAllocs()
			for b.Loop() {
				if _, err := c.UnaryCall(ctx, req); err != nil {
					b.Fatalf("%s: %v", p.name, err)
				}
			}
		})
	}
}

// BenchmarkSerialFailingCaller is the serial caller: one call after
// another, for 3 s of wall time whatever b.N, to a server that fails the
// first two attempts of every call (Unavailable) and answers the third.
// Nothing is overloaded and nothing is down, so herdguard's defaults
// (breaker and overload controller on, waits of 1 ns) must keep up with a
// hand-written loop with the same wire behaviour: at least 1/1.5 of its
// calls a second: two refusals in three must not look like overload
// (taken for it, they cost a hundredfold). It reports calls/s, and ns,
// bytes and allocations per call (the whole process's, server included).
func BenchmarkSerialFailingCaller(b *testing.B) {
	srv := testserver.Start(b, &testserver.Server{NoRecord: true, Unary: func(ctx context.Context, _ *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		if n := md.Get(wire.AttemptKey); len(n) == 0 || n[0] == "2" {
			return nil, status.Error(codes.Unavailable, "the first two attempts fail")
		}
		return &testgrpc.SimpleResponse{}, nil
	}})
	req := &testgrpc.SimpleRequest{}
	for _, p := range []peer{
		{name: "herdguard", dial: func(tb testing.TB, n int, d time.Duration) []grpc.DialOption {
			return herdguard(tb, n, d).DialOptions()
		}},
		loop("hand-written-a6", handWrittenA6),
	} {
		b.Run("peer="+p.name, func(b *testing.B) {
			c := srv.Client(b, p.dial(b, 3, time.Nanosecond)...)
			ctx := context.Background()
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			calls, began := 0, time.Now()
			for time.Since(began) < sustained {
				if _, err := c.UnaryCall(ctx, req); err != nil {
					b.Fatalf("%s: call %d: %v", p.name, calls, err)
				}
				calls++
			}
			took := time.Since(began)
			runtime.ReadMemStats(&after)
			// Per call, not per run: these replace the whole run's figures.
			b.ReportMetric(float64(calls)/took.Seconds(), "calls/s")
			b.ReportMetric(float64(took.Nanoseconds())/float64(calls), "ns/op")
			b.ReportMetric(float64(after.TotalAlloc-before.TotalAlloc)/float64(calls), "B/op")
			b.ReportMetric(float64(after.Mallocs-before.Mallocs)/float64(calls), "allocs/op")
		})
	}
}

// sustained is how long BenchmarkSerialFailingCaller runs each peer.
const sustained = 3 * time.Second

// loop is a hand-written retry loop as a peer.
func loop(name string, f grpc.UnaryClientInterceptor) peer {
	return peer{name: name, dial: func(testing.TB, int, time.Duration) []grpc.DialOption {
		return []grpc.DialOption{grpc.WithChainUnaryInterceptor(f)}
	}}
}

// handWritten retries Unavailable up to 3 attempts with a 1 ns timer.
func handWritten(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, inv grpc.UnaryInvoker, opts ...grpc.CallOption) error {
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

// handWrittenNoWait retries Unavailable up to 3 attempts at once.
func handWrittenNoWait(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, inv grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	for attempt := 1; ; attempt++ {
		err := inv(ctx, method, req, reply, cc, opts...)
		if err == nil || status.Code(err) != codes.Unavailable || attempt == 3 {
			return err
		}
	}
}

// handWrittenPushback retries Unavailable up to 3 attempts at once, but
// honours the server's pushback as gRFC A6 asks: it catches the trailer of
// every attempt that another may follow, and stops on a pushback that says
// so. gRPC copies each caught trailer.
func handWrittenPushback(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, inv grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	var trailer metadata.MD
	withTrailer := append(opts[:len(opts):len(opts)], grpc.Trailer(&trailer))
	for attempt := 1; ; attempt++ {
		o := withTrailer
		if attempt == 3 {
			o = opts
		}
		err := inv(ctx, method, req, reply, cc, o...)
		if err == nil || status.Code(err) != codes.Unavailable || attempt == 3 {
			return err
		}
		if v := trailer.Get("grpc-retry-pushback-ms"); len(v) > 0 && v[0] != "0" {
			return err // a hand-written loop that does not wait stops on any pushback
		}
	}
}

// handWrittenA6 retries Unavailable up to 3 attempts at once, with the wire
// behaviour and the rules gRFC A6 asks of a retrying client, as herdguard
// has them: it numbers each retry in its metadata, honours the server's
// pushback, and does not retry once the server sent response headers (the
// call is committed). It catches the header and the trailer of every attempt
// that another may follow; gRPC copies each.
func handWrittenA6(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, inv grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	var header, trailer metadata.MD
	caught := append(opts[:len(opts):len(opts)], grpc.Header(&header), grpc.Trailer(&trailer))
	for attempt := 1; ; attempt++ {
		o, actx := caught, ctx
		if attempt == 3 {
			o = opts
		}
		if attempt > 1 {
			actx = metadata.AppendToOutgoingContext(ctx, wire.AttemptKey, strconv.Itoa(attempt))
		}
		header, trailer = nil, nil
		err := inv(actx, method, req, reply, cc, o...)
		if err == nil || status.Code(err) != codes.Unavailable || attempt == 3 || header != nil {
			return err
		}
		if v := trailer.Get("grpc-retry-pushback-ms"); len(v) > 0 && v[0] != "0" {
			return err // a loop that does not wait stops on any pushback
		}
	}
}

// BenchmarkHedgedInTime is a call whose hedging policy would hedge after
// a second, answered long before: what hedging costs a call that needs no
// hedge, herdguard against failsafe-go's hedge policy, and against
// herdguard's default (retried, unhedged) call and a call with no
// interceptor. "alone" runs the interceptor with an invoker
// that does nothing; "bufconn" is a whole call.
func BenchmarkHedgedInTime(b *testing.B) {
	hedged := policy.Policy{Hedging: policy.Hedging{MaxAttempts: 2, Delay: time.Second}}
	peers := []struct {
		name string
		u    grpc.UnaryClientInterceptor
	}{
		{"no-interceptor", passThrough},
		{"herdguard-unhedged", herdguard(b, 3, 100*time.Millisecond).Unary()},
		{"herdguard", hedgedHerdguard(b, hedged).Unary()},
		{"failsafe", failsafegrpc.NewUnaryClientInterceptor[any](hedgepolicy.NewWithDelay[any](time.Second))},
	}
	cc, err := grpc.NewClient(testserver.Target, grpc.WithTransportCredentials(insecureCreds()))
	if err != nil {
		b.Fatal(err)
	}
	defer cc.Close()
	srv := okServer(b)
	for _, p := range peers {
		b.Run("alone/peer="+p.name, func(b *testing.B) {
			ctx, reply := context.Background(), &testgrpc.SimpleResponse{}
			b.ReportAllocs()
			for b.Loop() {
				if err := p.u(ctx, testserver.MethodUnary, nil, reply, cc, nopInvoker); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run("bufconn/peer="+p.name, func(b *testing.B) {
			c := srv.Client(b, grpc.WithChainUnaryInterceptor(p.u), grpc.WithDisableRetry())
			ctx, req := context.Background(), &testgrpc.SimpleRequest{}
			b.ReportAllocs()
			for b.Loop() {
				if _, err := c.UnaryCall(ctx, req); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// passThrough is a unary interceptor that only invokes.
func passThrough(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	return invoker(ctx, method, req, reply, cc, opts...)
}

func hedgedHerdguard(tb testing.TB, p policy.Policy) *interceptor.Interceptor {
	tb.Helper()
	ic, err := interceptor.New(interceptor.WithPolicy(p), interceptor.WithTracerProvider(noop.NewTracerProvider()))
	if err != nil {
		tb.Fatal(err)
	}
	return ic
}

const streamMessages = 100

// BenchmarkServerStream100 opens a stream and reads 100 messages; divide
// by 100 for per-message figures. gRPC's built-in retry is the only peer
// that retries streams.
func BenchmarkServerStream100(b *testing.B) {
	resp := &testgrpc.StreamingOutputCallResponse{Payload: &testgrpc.Payload{Body: []byte("0123456789")}}
	srv := testserver.Start(b, &testserver.Server{NoRecord: true, ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
		for range streamMessages {
			if err := ss.Send(resp); err != nil {
				return err
			}
		}
		return nil
	}})
	for _, p := range streamPeers() {
		b.Run("peer="+p.name, func(b *testing.B) {
			c := srv.Client(b, p.dial(b, 3, 100*time.Millisecond)...)
			ctx, req := context.Background(), &testgrpc.StreamingOutputCallRequest{}
			var m testgrpc.StreamingOutputCallResponse
			b.ReportAllocs()
			for b.Loop() {
				s, err := c.StreamingOutputCall(ctx, req)
				if err != nil {
					b.Fatal(err)
				}
				got := 0
				for ; ; got++ {
					if err := s.RecvMsg(&m); err != nil {
						if err != io.EOF {
							b.Fatal(err)
						}
						break
					}
				}
				if got != streamMessages {
					b.Fatalf("got %d messages", got)
				}
			}
		})
	}
}

// BenchmarkClientStream100 sends 100 messages and reads the answer; every
// message goes out before the stream commits, so retrying peers keep each.
func BenchmarkClientStream100(b *testing.B) {
	srv := testserver.Start(b, &testserver.Server{NoRecord: true, ClientStream: func(ss testgrpc.TestService_StreamingInputCallServer) error {
		for {
			if _, err := ss.Recv(); err != nil {
				if err == io.EOF {
					return ss.SendAndClose(&testgrpc.StreamingInputCallResponse{})
				}
				return err
			}
		}
	}})
	for _, p := range streamPeers() {
		b.Run("peer="+p.name, func(b *testing.B) {
			c := srv.Client(b, p.dial(b, 3, 100*time.Millisecond)...)
			ctx := context.Background()
			req := &testgrpc.StreamingInputCallRequest{Payload: &testgrpc.Payload{Body: []byte("0123456789")}}
			b.ReportAllocs()
			for b.Loop() {
				s, err := c.StreamingInputCall(ctx)
				if err != nil {
					b.Fatal(err)
				}
				for range streamMessages {
					if err := s.Send(req); err != nil {
						b.Fatal(err)
					}
				}
				if _, err := s.CloseAndRecv(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func streamPeers() []peer {
	var out []peer
	for _, p := range peers {
		if p.name == "none" || p.name == "grpc-retry" || p.name == "herdguard" {
			out = append(out, p)
		}
	}
	return out
}
