package interceptor

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"slices"
	"strings"
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
				committedFailures(t, srv, tt.p, !below, func(ctx context.Context, c testgrpc.TestServiceClient) error {
					return committedFailure(ctx, c, tt.commit)
				})
			})
		}
	}
}

// committedFailures makes calls through herdguard with policy p to srv,
// each a stream that commits and then fails (call), until the overload
// controller paces or 12 calls, four times its MinFailures, are made; it
// wants one attempt at the server per call, and the controller pacing
// when wantPacing. A still clock: every call falls in one interval, and
// no hedge's delay passes.
func committedFailures(t *testing.T, srv *testserver.Server, p policy.Policy, wantPacing bool, call func(context.Context, testgrpc.TestServiceClient) error) {
	t.Helper()
	const calls = 12
	clk := &fakeClock{testutil.NewClock(time.Now(), testutil.Async())}
	ic, err := New(withClock(clk), WithoutBreaker(), WithPolicy(p),
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
		if err := call(ctx, c); err != nil {
			t.Fatalf("call %d: %v", made, err)
		}
	}
	if got := srv.Requests(); got != made {
		t.Errorf("the server received %d attempts for %d calls, want one each: a committed stream is not retried", got, made)
	}
	if pacing := ctl.Pacing(); pacing != wantPacing {
		t.Errorf("after %d committed streams failed: the controller paces: %v, want %v", made, pacing, wantPacing)
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

// TestHeaderCommittedMeanwhileGaveUpBelow: a stream that commits
// (Context) while its Header waits for an attempt that then ends without
// headers, failed because a layer below gave up, is over with the server's
// status as it is, not retried, and left out of the overload controller's
// count; Header's own judge takes the give-up there (gaveUpBelowLocked). The
// test waits until the caller's Header is inside gRPC's before it
// commits, so that Header, not RecvMsg, learns the end. The control, a
// pushback alone, has the controller pacing after a few calls.
func TestHeaderCommittedMeanwhileGaveUpBelow(t *testing.T) {
	for _, below := range []bool{true, false} {
		name := map[bool]string{true: "gave up below", false: "control: a pushback alone"}[below]
		t.Run(name, func(t *testing.T) {
			trailer := metadata.Pairs("grpc-retry-pushback-ms", "-1")
			if below {
				trailer.Set("herdguard-gave-up", "exhausted")
			}
			release := make(chan struct{})
			srv := testserver.Start(t, &testserver.Server{
				ServerStream: func(_ *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
					select {
					case <-release:
					case <-ss.Context().Done():
						return ss.Context().Err()
					}
					ss.SetTrailer(trailer)
					return status.Error(codes.Unavailable, "tier: the layer below gave up")
				},
			})
			committedFailures(t, srv, policy.Policy{MaxAttempts: 3, InitialBackoff: time.Millisecond}, !below,
				func(ctx context.Context, c testgrpc.TestServiceClient) error {
					return headerCommittedMeanwhile(t, ctx, c, release)
				})
		})
	}
}

// headerCommittedMeanwhile opens a StreamingOutputCall, calls Header and,
// once Header waits inside gRPC, commits the stream by Context; then it
// lets the server fail the attempt (one value on release) and checks what
// Header and RecvMsg return.
func headerCommittedMeanwhile(t *testing.T, ctx context.Context, c testgrpc.TestServiceClient, release chan<- struct{}) error {
	cs, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{})
	if err != nil {
		return err
	}
	type header struct {
		md  metadata.MD
		err error
	}
	got := make(chan header, 1)
	go func() {
		md, err := cs.Header()
		got <- header{md, err}
	}()
	waitGoroutine(t, "interceptor.(*clientStream).Header.func1", "grpc.(*clientStream).Header")
	_ = cs.Context() // commits the stream to the attempt Header waits on
	release <- struct{}{}
	h := <-got
	if h.md != nil || h.err != nil {
		return fmt.Errorf("Header: %v, %v; want no headers and no error: the attempt ended without headers, and RecvMsg tells how", h.md, h.err)
	}
	first := cs.RecvMsg(new(testgrpc.StreamingOutputCallResponse))
	var re *RetryError
	switch {
	case status.Code(first) != codes.Unavailable:
		return errors.New("RecvMsg: " + errString(first) + ", want the server's Unavailable")
	case errors.As(first, &re):
		return errors.New("RecvMsg: a RetryError (" + first.Error() + "), want the server's status as it is: the stream had committed")
	}
	return nil
}

// waitGoroutine waits until one goroutine runs every one of fns (functions'
// names as a stack trace prints them).
func waitGoroutine(t *testing.T, fns ...string) {
	t.Helper()
	buf := make([]byte, 1<<20)
	testutil.Eventually(t, "a goroutine running "+strings.Join(fns, " and "), func() bool {
		n := runtime.Stack(buf, true)
		for _, g := range bytes.Split(buf[:n], []byte("\n\n")) {
			if !slices.ContainsFunc(fns, func(fn string) bool { return !bytes.Contains(g, []byte(fn)) }) {
				return true
			}
		}
		return false
	})
}
