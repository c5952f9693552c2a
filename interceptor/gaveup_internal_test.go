package interceptor

import (
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/herdguard/herdguard/internal/testserver"
	"github.com/herdguard/herdguard/internal/testutil"
	"github.com/herdguard/herdguard/overload"
	"github.com/herdguard/herdguard/policy"
)

// TestCommittedStreamGaveUpBelow: a stream that committed (response
// headers, read or not, or a message) and then failed because a layer below gave up
// (grpc-retry-pushback-ms -1 with herdguard-gave-up) ends with the
// server's status as it is, on that RecvMsg and every later one, and is
// not retried; and the overload controller leaves it out of its count.
// The control, the same failure with the pushback alone, has the same
// controller pacing after a few calls. Retried and hedged streams.
func TestCommittedStreamGaveUpBelow(t *testing.T) {
	const calls = 12 // four times the controller's MinFailures
	retried := policy.Policy{MaxAttempts: 3, InitialBackoff: time.Millisecond}
	hedged := policy.Policy{Hedging: policy.Hedging{MaxAttempts: 3, Delay: time.Hour, NonFatalCodes: []codes.Code{codes.Unavailable}}}
	for _, below := range []bool{true, false} {
		for _, tt := range []struct {
			name   string
			p      policy.Policy
			commit string // what commits the stream: "message", "headers" the caller reads, or "unread headers"
		}{
			{"retried, after a message", retried, "message"},
			{"retried, after headers", retried, "headers"},
			// The caller's RecvMsg learns of the headers with the failure.
			{"retried, after headers the caller did not read", retried, "unread headers"},
			{"hedged, after a message", hedged, "message"},
			{"hedged, after headers", hedged, "headers"},
			{"hedged, after headers the caller did not read", hedged, "unread headers"},
		} {
			name := map[bool]string{true: "gave up below, ", false: "control: a pushback alone, "}[below] + tt.name
			t.Run(name, func(t *testing.T) {
				trailer := metadata.Pairs("grpc-retry-pushback-ms", "-1")
				if below {
					trailer.Set("herdguard-gave-up", "exhausted")
				}
				srv := testserver.Start(t, &testserver.Server{
					ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
						if tt.commit == "message" {
							if err := ss.Send(&testgrpc.StreamingOutputCallResponse{}); err != nil {
								return err
							}
						} else if err := ss.SendHeader(metadata.Pairs("request-id", "r1")); err != nil {
							return err
						}
						ss.SetTrailer(trailer)
						return status.Error(codes.Unavailable, "tier: the layer below gave up")
					},
				})
				// A still clock: every call falls in one interval, and no
				// hedge's delay passes.
				clk := &fakeClock{testutil.NewClock(time.Now(), testutil.Async())}
				ic, err := New(withClock(clk), WithoutBreaker(), WithPolicy(tt.p),
					WithOverloadControl(overload.Settings{MinFailures: 3}))
				if err != nil {
					t.Fatal(err)
				}
				c := srv.Client(t, ic.DialOptions()...)
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				ctl := ic.controllerFor(testserver.Target)
				made := 0
				for ; made < calls && !ctl.Pacing(); made++ { // a paced call would wait for a probe: the clock stands still
					if err := committedFailure(ctx, c, tt.commit); err != nil {
						t.Fatalf("call %d: %v", made, err)
					}
				}
				if got := srv.Requests(); got != made {
					t.Errorf("the server received %d attempts for %d calls, want one each: a committed stream is not retried", got, made)
				}
				if pacing := ctl.Pacing(); pacing == below {
					t.Errorf("after %d committed streams failed: the controller paces: %v, want %v", made, pacing, !below)
				}
			})
		}
	}
}

// committedFailure opens a StreamingOutputCall that commits (commit: its
// first message, its response headers read by Header, or headers it does
// not read) and then fails with Unavailable, and checks that the failure
// comes as the server's status, the same on a second RecvMsg.
func committedFailure(ctx context.Context, c testgrpc.TestServiceClient, commit string) error {
	cs, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{})
	if err != nil {
		return err
	}
	switch commit {
	case "message":
		if _, err := cs.Recv(); err != nil {
			return errors.New("first Recv: " + err.Error() + ", want the server's message")
		}
	case "headers":
		if md, err := cs.Header(); md == nil || err != nil {
			return errors.New("Header: no headers")
		}
	}
	first := cs.RecvMsg(new(testgrpc.StreamingOutputCallResponse))
	again := cs.RecvMsg(new(testgrpc.StreamingOutputCallResponse))
	var re *RetryError
	switch {
	case first == nil || first == io.EOF || status.Code(first) != codes.Unavailable:
		return errors.New("the failure: " + errString(first) + ", want the server's Unavailable")
	case errors.As(first, &re):
		return errors.New("the failure: a RetryError (" + first.Error() + "), want the server's status as it is: the stream had committed")
	case errString(again) != errString(first):
		return errors.New("a second RecvMsg: " + errString(again) + ", want the first's " + errString(first))
	}
	return nil
}

func errString(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}
