package interceptor

import (
	"context"
	"slices"
	"strconv"
	"sync"
	"testing"

	"github.com/herdguard/herdguard/internal/wire"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/policy"
)

type ctxKey struct{}

// TestRetriesKeepTheCallersContext makes calls that need 13 attempts, past
// the attempt numbers made in advance, with and without outgoing metadata of
// the caller's own. Every retry must carry its number and the caller's
// metadata, and the interceptors after herdguard must still see the
// caller's context values and deadline.
func TestRetriesKeepTheCallersContext(t *testing.T) {
	for _, callerMD := range []metadata.MD{nil, metadata.Pairs("x-user", "ada", "x-tags", "a", "x-tags", "b")} {
		t.Run("metadata="+strconv.FormatBool(callerMD != nil), func(t *testing.T) {
			var (
				mu   sync.Mutex
				seen []metadata.MD
			)
			srv := testserver.Start(t, &testserver.Server{Unary: func(ctx context.Context, _ *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
				md, _ := metadata.FromIncomingContext(ctx)
				mu.Lock()
				defer mu.Unlock()
				seen = append(seen, md)
				if len(seen) < 13 {
					return nil, status.Error(codes.Unavailable, "down")
				}
				return &testgrpc.SimpleResponse{}, nil
			}})
			ic, err := New(withClock(newFakeClock()), WithoutBreaker(),
				WithPolicy(policy.Policy{MaxAttempts: 13, InitialBackoff: ms, MaxBackoff: ms, Jitter: policy.NoJitter}))
			if err != nil {
				t.Fatal(err)
			}
			var (
				inner []string
				ctxs  []context.Context // as each attempt saw it
			)
			after := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
				if _, ok := ctx.Deadline(); !ok || ctx.Value(ctxKey{}) != "kept" {
					inner = append(inner, "lost the caller's context")
				}
				ctxs = append(ctxs, ctx)
				return invoker(ctx, method, req, reply, cc, opts...)
			}
			c := srv.Client(t, append(ic.DialOptions(), grpc.WithChainUnaryInterceptor(after))...)
			ctx, cancel := context.WithTimeout(context.WithValue(context.Background(), ctxKey{}, "kept"), callTimeout)
			defer cancel()
			if callerMD != nil {
				ctx = metadata.NewOutgoingContext(ctx, callerMD)
			}
			if _, err := c.UnaryCall(ctx, &testgrpc.SimpleRequest{}); err != nil {
				t.Fatalf("call: %v", err)
			}
			if len(inner) != 0 {
				t.Errorf("interceptor after herdguard: %q", inner)
			}
			if len(seen) != 13 {
				t.Fatalf("server saw %d attempts, want 13", len(seen))
			}
			for i, md := range seen {
				want := []string(nil)
				if i > 0 {
					want = []string{strconv.Itoa(i + 1)}
				}
				if got := md.Get(wire.AttemptKey); !slices.Equal(got, want) {
					t.Errorf("attempt %d: %s %q, want %q", i+1, wire.AttemptKey, got, want)
				}
				want = nil
				if i > 0 {
					want = []string{strconv.Itoa(i)}
				}
				if got := md.Get(wire.PreviousAttemptsKey); !slices.Equal(got, want) {
					t.Errorf("attempt %d: %s %q, want %q", i+1, wire.PreviousAttemptsKey, got, want)
				}
				for k, v := range callerMD {
					if got := md.Get(k); !slices.Equal(got, v) {
						t.Errorf("attempt %d: %s %q, want the caller's %q", i+1, k, got, v)
					}
				}
			}
			// A context handed to an attempt never changes: what a later
			// interceptor kept from attempt i still numbers attempt i.
			for i, ctx := range ctxs {
				want := []string(nil)
				if i > 0 {
					want = []string{strconv.Itoa(i + 1)}
				}
				md, _ := metadata.FromOutgoingContext(ctx)
				if got := md.Get(wire.AttemptKey); !slices.Equal(got, want) {
					t.Errorf("after the call, attempt %d's context says %s %q, want %q", i+1, wire.AttemptKey, got, want)
				}
			}
			if got := callerMD.Get(wire.AttemptKey); len(got) != 0 {
				t.Errorf("the caller's own metadata was changed: %v", callerMD)
			}
		})
	}
}

// TestRetriedCallAllocatesOnce runs the interceptor alone on calls that
// need 3 attempts: numbering the retries of a call whose context carries no
// metadata of the caller's costs one allocation per call (the contexts of
// both retries at once), and nothing else in the loop allocates (the wait
// timer is pooled).
func TestRetriedCallAllocatesOnce(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector makes sync.Pool drop pooled buffers")
	}
	// Two attempts in three refused: the overload controller would pace
	// them (its own costs are measured in package overload); this measures
	// the retries.
	u, cc := alone(t, WithTracerProvider(noopTP()), WithMeterProvider(noopMP()), WithoutOverloadControl(),
		WithPolicy(policy.Policy{MaxAttempts: 3, InitialBackoff: 1, MaxBackoff: 1}))
	unavailable := status.Error(codes.Unavailable, "down")
	n := 0
	failTwice := func(context.Context, string, any, any, *grpc.ClientConn, ...grpc.CallOption) error {
		if n++; n%3 != 0 {
			return unavailable
		}
		return nil
	}
	ctx := context.Background()
	call := func() {
		if err := u(ctx, testserver.MethodUnary, nil, nil, cc, failTwice); err != nil {
			t.Fatal(err)
		}
	}
	call() // make the target's breaker and the pooled timer
	if a := testing.AllocsPerRun(200, call); a > 1 {
		t.Errorf("%v allocations per 3-attempt call, want at most 1", a)
	}
}

// Hedges are numbered as retries are: hedge n carries herdguard-attempt n
// and gRPC's grpc-previous-rpc-attempts n-1, on unary calls and streams.
func TestHedgesCarryPreviousAttempts(t *testing.T) {
	var (
		mu      sync.Mutex
		seen    = map[string][]string{} // per attempt number, what previous attempts it said
		arrived = sync.NewCond(&mu)
	)
	// Every attempt but the last waits for the call to end: the hedges
	// all go, each after the hedging delay, which the fake clock passes at
	// once. The last answers once the server has seen all three.
	serve := func(ctx context.Context) error {
		md, _ := metadata.FromIncomingContext(ctx)
		n := "1"
		if v := md.Get(wire.AttemptKey); len(v) == 1 {
			n = v[0]
		}
		stop := context.AfterFunc(ctx, func() { mu.Lock(); arrived.Broadcast(); mu.Unlock() })
		defer stop()
		mu.Lock()
		seen[n] = md.Get(wire.PreviousAttemptsKey)
		arrived.Broadcast()
		for n == "3" && len(seen) < 3 && ctx.Err() == nil {
			arrived.Wait()
		}
		mu.Unlock()
		if n != "3" {
			<-ctx.Done()
			return ctx.Err()
		}
		return nil
	}
	srv := testserver.Start(t, &testserver.Server{
		Unary: func(ctx context.Context, _ *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
			if err := serve(ctx); err != nil {
				return nil, err
			}
			return &testgrpc.SimpleResponse{}, nil
		},
		ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
			if err := serve(ss.Context()); err != nil {
				return err
			}
			return ss.Send(&testgrpc.StreamingOutputCallResponse{})
		},
	})
	ic, err := New(withClock(newFakeClock()), WithoutBreaker(), WithPolicy(hedging(3)))
	if err != nil {
		t.Fatal(err)
	}
	c := srv.Client(t, ic.DialOptions()...)
	want := map[string][]string{"1": nil, "2": {"1"}, "3": {"2"}}
	check := func(kind string) {
		mu.Lock()
		defer mu.Unlock()
		for n, w := range want {
			if got, ok := seen[n]; !ok || !slices.Equal(got, w) {
				t.Errorf("%s: attempt %s: %s %q (seen %v), want %q", kind, n, wire.PreviousAttemptsKey, got, ok, w)
			}
		}
		clear(seen)
	}
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	if _, err := c.UnaryCall(ctx, &testgrpc.SimpleRequest{}); err != nil {
		t.Fatalf("unary: %v", err)
	}
	check("unary")
	stream, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{})
	if err != nil {
		t.Fatalf("stream: %v", err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatalf("stream: Recv: %v", err)
	}
	check("server stream")
}
