package interceptor_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/breaker"
	"github.com/herdguard/herdguard/interceptor"
	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/policy"
)

// TestGaveUpBelow: a server that answers "don't retry" because a layer
// below it gave up (grpc-retry-pushback-ms -1 with herdguard-gave-up) makes
// a herdguard call give up at once with OutcomePushbackStop, whatever the
// code, whichever attempt the answer comes to, and hedged as well as
// retried; the breaker leaves the call out. The control, the same pushback
// without herdguard-gave-up, is counted and opens the same breaker. Unary
// calls and server streams. After response headers (a tier whose
// middleware sets one) a unary call gives up the same way. A stream whose
// headers came with the failure has committed: it ends with the server's
// status as it is, as gRPC's does, and the breaker leaves it out all the
// same.
func TestGaveUpBelow(t *testing.T) {
	retried := func(attempts int) policy.Policy {
		p := policy.Default()
		p.MaxAttempts, p.InitialBackoff = attempts, time.Millisecond
		return p
	}
	hedged := policy.Policy{Hedging: policy.Hedging{MaxAttempts: 3, Delay: time.Hour}} // every code fatal
	for _, below := range []bool{true, false} {
		for _, kind := range []string{"unary", "stream"} {
			for _, v := range []struct {
				name    string
				p       policy.Policy
				headers bool // the server sets a response header first (sent in a frame of its own)
			}{
				{"one attempt", retried(1), false},
				{"3 attempts", retried(3), false},
				{"3 attempts, after headers", retried(3), true},
				{"hedged", hedged, false},
			} {
				name := map[bool]string{true: "gave up below", false: "control: a pushback alone"}[below]
				t.Run(name+", "+kind+", "+v.name, func(t *testing.T) {
					// A committed stream fails as it is, with no RetryError.
					committed := kind == "stream" && v.headers
					gaveUp := below && !committed
					trailer := metadata.Pairs("grpc-retry-pushback-ms", "-1")
					if below {
						trailer.Set("herdguard-gave-up", "exhausted")
					}
					fail := func(ctx context.Context) error {
						if v.headers {
							_ = grpc.SetHeader(ctx, metadata.Pairs("request-id", "r1"))
						}
						_ = grpc.SetTrailer(ctx, trailer)
						return status.Error(codes.Unavailable, "tier: the layer below gave up")
					}
					srv := testserver.Start(t, &testserver.Server{
						Unary: func(ctx context.Context, _ *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
							return nil, fail(ctx)
						},
						ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
							return fail(ss.Context())
						},
					})
					ic, err := interceptor.New(interceptor.WithPolicy(v.p), interceptor.WithoutOverloadControl(),
						interceptor.WithBreaker(breaker.Settings{ConsecutiveFailures: 3, OpenTimeout: time.Minute}))
					if err != nil {
						t.Fatal(err)
					}
					c := srv.Client(t, ic.DialOptions()...)
					ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					defer cancel()
					open := 0
					for i := range 6 {
						err := callKind(ctx, c, kind)
						var oe *breaker.OpenError
						if errors.As(err, &oe) {
							open++
							continue
						}
						var re *interceptor.RetryError
						if gaveUp && (!errors.As(err, &re) || re.Outcome != interceptor.OutcomePushbackStop) {
							t.Errorf("call %d: %v, want a RetryError with %s", i, err, interceptor.OutcomePushbackStop)
						}
						if committed && errors.As(err, &re) {
							t.Errorf("call %d: %v, want the server's status as it is: the stream had committed", i, err)
						}
						if status.Code(err) != codes.Unavailable {
							t.Errorf("call %d: %v, want the server's Unavailable", i, err)
						}
					}
					if got := srv.Requests(); got != 6-open {
						t.Errorf("the server received %d attempts for %d calls sent, want one each: a pushback of -1 stops the retries and the hedges", got, 6-open)
					}
					if wantOpen := !below; (open > 0) != wantOpen {
						t.Errorf("%d of 6 calls refused by the breaker, want the breaker open: %v", open, wantOpen)
					}
				})
			}
		}
	}
}

// callKind makes one UnaryCall ("unary") or StreamingOutputCall up to its
// first message ("stream") and returns how it ended.
func callKind(ctx context.Context, c testgrpc.TestServiceClient, kind string) error {
	if kind == "unary" {
		_, err := c.UnaryCall(ctx, &testgrpc.SimpleRequest{})
		return err
	}
	cs, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{})
	if err != nil {
		return err
	}
	_, err = cs.Recv()
	return err
}
